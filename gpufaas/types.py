"""Domain types shared by every role: requests, GPUs and models, as plain values (immutable but
`Request`, which is never changed once made either), and the by-name registry of a policy family."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Generic, TypeVar

from gpufaas.errors import UnknownPolicy

T = TypeVar("T")

DEFAULT_BATCH_SIZE = 32
"""The batch size of the paper's profiles (Table I); a request carries its own."""


# Not frozen: one is made per call, and a frozen one costs 3x to make (never changed once made).
@dataclass(slots=True)
class Request:
    """One invocation waiting for, or holding, a GPU.

    Requests are ordered by arrival: the scheduler numbers each one on submit (`Scheduler.submit`;
    the number is kept beside the request, not in it), and every queue in the scheduler sorts by
    that number. `arrival_s` is the caller's clock (virtual in the simulator, monotonic in the
    service): the core does not read it, policies may (mqfq-sticky's inter-arrival times, torpor's
    SLO clock).
    """

    request_id: str
    function: str
    model: str
    arrival_s: float
    batch_size: int = DEFAULT_BATCH_SIZE
    avoid_gpu: str | None = None  # a GPU this request must not run on (its worker just died there)
    slo_s: float | None = None  # the latency it should meet, from arrival (its function's SLO)


@dataclass(frozen=True, slots=True)
class GpuSpec:
    """A GPU as the scheduler sees it.

    `speed` is relative throughput (higher is faster; the paper sorts idle GPUs "by frequency"):
    idle GPUs are offered work fastest first, then by `gpu_id`. `memory_mb` is what the cache may
    fill (the device's memory minus a reserve for the CUDA context and fragmentation). `slots` is
    D, how many requests the GPU may run at once (its workers share it; 1 = the paper's one
    request at a time). `node` names the machine it is in: GPUs of one node share its host tier.
    `link` names the host link it shares with other GPUs for host-to-GPU copies (GPUs behind one
    PCIe switch share its uplink: two loads there at once each get about half of it); None: a
    link of its own. Unique cluster-wide (the node's name is part of it).
    """

    gpu_id: str
    memory_mb: int
    gpu_type: str = "rtx2080"
    speed: float = 1.0
    slots: int = 1
    node: str | None = None
    link: str | None = None

    def __post_init__(self) -> None:
        check_positive(f"GPU {self.gpu_id!r}: ", memory_mb=self.memory_mb, speed=self.speed)
        if self.slots < 1:
            raise ValueError(f"GPU {self.gpu_id!r}: slots must be at least 1, got {self.slots}")


@dataclass(frozen=True, slots=True)
class ModelSpec:
    """A model as a cache item: `memory_mb` is its *peak* GPU occupancy at its batch size
    (weights + activations + workspace, Table I's "size"), not the size of its weights file."""

    name: str
    memory_mb: int
    gpu_type: str | None = None  # a required GPU type, or None for any
    labels: dict[str, str] = field(default_factory=dict, compare=False, hash=False)

    def __post_init__(self) -> None:
        check_positive(f"model {self.name!r}: ", memory_mb=self.memory_mb)


def check_positive(where: str, **values: float) -> None:
    """ValueError for the first of `values` that is not above 0: "<where><name> must be positive,
    got <value>" (`where` names the owner, e.g. "GPU 'g0': ", or is empty)."""
    for name, value in values.items():
        if not value > 0:
            raise ValueError(f"{where}{name} must be positive, got {value}")


class Registry(dict[str, type[T]], Generic[T]):
    """One policy family's classes by their short names ("lalb", "lru"): the family's base class
    registers each subclass as it is defined, and a setting names one (`lookup`)."""

    def __init__(self, family: str) -> None:
        super().__init__()
        self.family = family

    def register(self, name: str, cls: type[T]) -> None:
        """Add `cls` as `name`; ValueError if the name is taken (it would answer for two classes)."""
        if name in self:
            raise ValueError(f"{self.family} policy {name!r} is registered twice")
        self[name] = cls

    def lookup(self, name: str) -> type[T]:
        """The class registered as `name`; UnknownPolicy, listing the valid names, if there is none."""
        try:
            return self[name]
        except KeyError:
            valid = ", ".join(sorted(self))
            raise UnknownPolicy(f"unknown {self.family} policy {name!r}; valid policies: {valid}") from None
