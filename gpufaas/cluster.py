"""Node records: how a GPU manager announces itself and its GPUs in etcd (under its lease)."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field


@dataclass(frozen=True, slots=True)
class GpuRecord:
    gpu: str  # node-local id, e.g. "gpu0"
    memory_mb: int  # what the cache may fill
    gpu_type: str
    link: str | None = None  # the shared host link (PCIe switch) on the node, None: its own


@dataclass(frozen=True, slots=True)
class NodeRecord:
    """`address` is the node's GPU-manager endpoint (gpufaas.wire); `incarnation` changes on every start, so
    a restarted manager (whose workers, and so whose cached models, are gone) is told apart.
    `draining`: the manager is stopping gracefully (gpu_manager.drain): the leader places nothing
    more on its GPUs, and the calls placed there run to their end."""

    node: str
    address: str
    backend: str
    incarnation: str
    gpus: list[GpuRecord] = field(default_factory=list)
    draining: bool = False

    def to_json(self) -> bytes:
        return json.dumps(asdict(self), sort_keys=True).encode()

    @classmethod
    def from_json(cls, data: bytes) -> NodeRecord:
        """ValueError for a record of another shape. Fields a newer node adds to its GPUs are
        ignored (a rolling upgrade registers them before every reader knows them)."""
        try:
            raw = json.loads(data)
            known = set(GpuRecord.__dataclass_fields__)
            record = cls(
                node=raw["node"],
                address=raw["address"],
                backend=raw["backend"],
                incarnation=raw["incarnation"],
                gpus=[GpuRecord(**{k: v for k, v in gpu.items() if k in known}) for gpu in raw.get("gpus", [])],
                draining=raw.get("draining", False),  # (absent from an older node's record)
            )
        except (KeyError, TypeError, AttributeError) as exc:
            raise ValueError(f"not a node record: {exc!r}") from None
        return _typed(record)


def _typed(record: NodeRecord) -> NodeRecord:
    """`record`, if every field has its type and no GPU is named twice (ValueError otherwise): a
    GPU's memory as a string, say, was taken in, and the scheduler's attach of the node then
    failed comparing it."""
    names = [record.node, record.address, record.backend, record.incarnation]
    for gpu in record.gpus:
        names += [gpu.gpu, gpu.gpu_type] + ([] if gpu.link is None else [gpu.link])
        if type(gpu.memory_mb) is not int or gpu.memory_mb < 0:
            raise ValueError(f"not a node record: GPU {gpu.gpu!r} has memory_mb {gpu.memory_mb!r}")
    if type(record.draining) is not bool:
        raise ValueError(f"not a node record: draining is {record.draining!r}")
    if not all(isinstance(name, str) for name in names):
        raise ValueError(f"not a node record: a name that is not a string in {names!r}")
    gpus = [gpu.gpu for gpu in record.gpus]
    if len(set(gpus)) != len(gpus):  # (the scheduler's attach of the node failed at the second)
        raise ValueError(f"not a node record: a GPU named twice in {gpus!r}")
    return record
