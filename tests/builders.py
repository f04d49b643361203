"""Small builders for unit tests of the pure scheduling core (and a few reads tests share)."""

from __future__ import annotations

import itertools
from pathlib import Path

from gpu_manager.sandbox import PACKAGE_USERS_FILE, PackageUsers
from gpufaas.functions import FunctionSpec
from gpufaas.keys import Keys
from gpufaas.profiles import ModelProfile
from gpufaas.store import KeyValue
from gpufaas.types import GpuSpec, ModelSpec, Request
from scheduler import Estimator, PolicyConfig, Scheduler, make_policy

LOAD_S = 2.0
INFERENCE_S = 1.0
_ids = itertools.count()


def make_scheduler(
    policy: str = "lalb",
    *,
    gpus: int | dict[str, int] = 2,
    models: dict[str, int] | None = None,
    max_num_skips: int = 25,
    speeds: dict[str, float] | None = None,
    slots: int | dict[str, int] = 1,
    coldest_victim_misses: bool = True,
    literal_visits: bool = False,
) -> Scheduler:
    """A scheduler over GPUs g0, g1, ... (8000 MB each unless given; `slots` each, or per GPU
    id) and models with the same profile: load 2 s, inference 1 s at batch 32, unless the test
    says otherwise."""
    models = models if models is not None else {m: 1000 for m in "ABCDEF"}
    estimator = Estimator(
        ModelProfile(name, "rtx2080", memory_mb, LOAD_S, INFERENCE_S, 32) for name, memory_mb in models.items()
    )
    config = PolicyConfig(
        max_num_skips=max_num_skips, coldest_victim_misses=coldest_victim_misses, literal_visits=literal_visits
    )
    scheduler = Scheduler(make_policy(policy, config), estimator=estimator)
    sizes = gpus if isinstance(gpus, dict) else {f"g{i}": 8000 for i in range(gpus)}
    for gpu_id, memory_mb in sizes.items():
        speed = (speeds or {}).get(gpu_id, 1.0)
        gpu_slots = slots.get(gpu_id, 1) if isinstance(slots, dict) else slots
        scheduler.add_gpu(GpuSpec(gpu_id, memory_mb, speed=speed, slots=gpu_slots))
    for name, memory_mb in models.items():
        scheduler.register_model(ModelSpec(name, memory_mb))
    return scheduler


def make_request(model: str, arrival_s: float = 0.0, request_id: str | None = None) -> Request:
    return Request(request_id or f"r{next(_ids)}", function=f"fn-{model}", model=model, arrival_s=arrival_s)


def submit(scheduler: Scheduler, *models: str, now: float = 0.0) -> list[Request]:
    requests = [make_request(model, now) for model in models]
    for request in requests:
        scheduler.submit(request)
    return requests


def cache_on(scheduler: Scheduler, gpu_id: str, *models: str) -> None:
    """Make models resident on an idle GPU (oldest first), as if earlier requests had run there."""
    for model in models:
        scheduler.cache.admit(gpu_id, model, scheduler.model(model).memory_mb)


def run_on(scheduler: Scheduler, gpu_id: str, model: str, now: float = 0.0) -> Request:
    """Start a request for `model` in a free slot of `gpu_id` (a hit if resident, else a miss)."""
    (request,) = submit(scheduler, model, now=now)
    scheduler.dispatch(request, gpu_id, now)
    return request


def fill_slots(scheduler: Scheduler, gpu_id: str, model: str, now: float = 0.0) -> list[Request]:
    """Start requests for `model` on `gpu_id` until it has no free slot."""
    return [run_on(scheduler, gpu_id, model, now) for _ in range(scheduler.gpu(gpu_id).free_slots)]


def stored_spec(keys: Keys, spec: FunctionSpec, mod_revision: int = 0) -> KeyValue:
    """`spec` as etcd holds it under its key, changed at `mod_revision`."""
    return KeyValue(keys.function(spec.name), spec.to_json(), mod_revision, mod_revision, 0)


def package_user(node_state_dir: Path, digest: str) -> int:
    """The user id package `digest`'s workers run as on the node of `node_state_dir` (given at
    its first load there)."""
    uid = PackageUsers(node_state_dir / PACKAGE_USERS_FILE).get(digest)
    assert uid is not None, f"no worker of {digest} has run on the node of {node_state_dir}"
    return uid
