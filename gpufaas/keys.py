"""Every etcd key of gpufaas, built in this one module under one root (a shipped layout is forever)."""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_ROOT = "/gpufaas"


class _Folder:
    """A folder of the key layout, read on a `Keys`: "{root}/{name}/", its name the attribute's."""

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    def __get__(self, keys: Keys | None, owner: type | None = None) -> str:
        return f"{keys.root if keys is not None else '{root}'}/{self.name}/"


@dataclass(frozen=True, slots=True)
class Keys:
    """The key layout (docs/architecture.md says who writes each), under `root`:

    {root}/functions/{name}                 function spec (JSON), written by the gateway
    {root}/nodes/{node}                     node record (JSON: address, GPUs, draining), under the node's lease
    {root}/gpus/{node}/{gpu}/status         idle | busy, with memory figures (JSON)
    {root}/gpus/{node}/{gpu}/lru            the GPU's LRU list, most recent first (JSON)
    {root}/profiles/{gpu_type}/{model}      load time, inference time per batch size (JSON)
    {root}/models/{model}/replicas          GPUs where the model is cached (JSON list of "node/gpu")
    {root}/services/{service}               a service's address (scheduler, gateway), under its lease;
                                            services/scheduler is the leader key: created only if
                                            absent, under the leading scheduler's lease, its
                                            create_revision the leader's epoch (scheduler.leadership)
    {root}/packages/{hex}                   a package: its manifest, the gateway that took its blobs, its
                                            resolved requirements (JSON), written once by that gateway
    {root}/holders/{name}                   a blob holder (gateway or node): its blob address and the
                                            packages it holds whole (JSON), under the holder's lease
    """

    root: str = DEFAULT_ROOT

    # The folders (`keys.functions` is "{root}/functions/": what a prefix read or watch takes).
    functions = _Folder()
    nodes = _Folder()
    gpus = _Folder()
    profiles = _Folder()
    models = _Folder()
    services = _Folder()
    packages = _Folder()
    holders = _Folder()

    def __post_init__(self) -> None:
        if not self.root.startswith("/") or self.root.endswith("/"):
            raise ValueError(f"key root must start with '/' and not end with it, got {self.root!r}")

    def function(self, name: str) -> str:
        return self.functions + _segment(name)

    def node(self, node: str) -> str:
        return self.nodes + _segment(node)

    # --- GPUs, profiles and replicas --------------------------------------------------------
    def node_gpus(self, node: str) -> str:
        return f"{self.gpus}{_segment(node)}/"

    def gpu_status(self, node: str, gpu: str) -> str:
        return f"{self.node_gpus(node)}{_segment(gpu)}/status"

    def gpu_lru(self, node: str, gpu: str) -> str:
        return f"{self.node_gpus(node)}{_segment(gpu)}/lru"

    def parse_gpu_key(self, key: str) -> tuple[str, str, str] | None:
        """(node, gpu, "status" | "lru") for a key under `gpus`, else None."""
        if not key.startswith(self.gpus):
            return None
        parts = key[len(self.gpus) :].split("/")
        if len(parts) != 3 or parts[2] not in ("status", "lru"):
            return None
        return parts[0], parts[1], parts[2]

    def profile(self, gpu_type: str, model: str) -> str:
        return f"{self.profiles}{_segment(gpu_type)}/{_segment(model)}"

    def replicas(self, model: str) -> str:
        return f"{self.models}{_segment(model)}/replicas"

    # --- services, packages and the holders of their blobs ------------------------------------
    def service(self, name: str) -> str:
        return self.services + _segment(name)

    @property
    def scheduler_leader(self) -> str:
        """The leading scheduler's address (see the layout above)."""
        return self.service("scheduler")

    def package(self, digest: str) -> str:
        return self.packages + _segment(digest.removeprefix("sha256:"))

    def holder(self, name: str) -> str:
        return self.holders + _segment(name)


def _segment(value: str) -> str:
    """One path segment: names with '/' would silently change the layout, so refuse them."""
    if not value or "/" in value:
        raise ValueError(f"a key segment must be non-empty and contain no '/', got {value!r}")
    return value


def gpu_address(node: str, gpu: str) -> str:
    """The cluster-wide GPU id the scheduler uses: "node/gpu" (also the X-Gpu header)."""
    return f"{node}/{gpu}"


def split_gpu_address(address: str) -> tuple[str, str]:
    node, _, gpu = address.partition("/")
    if not node or not gpu:
        raise ValueError(f"a GPU address is 'node/gpu', got {address!r}")
    return node, gpu
