"""The node's host tier: parked workers kept in host memory, charged by what they measurably use.

A parked worker is a process whose model stays loaded in host memory after its GPU evicted it; a
miss for the model takes it back (one message, no process start). The tier's budget is host
memory, so each worker is charged its proportional set size (PSS: its private pages plus its share
of the pages it shares with the zygote and the other workers; the sum over processes is what they
use together), read from /proc once it is parked, for one worker of each model a minute (reading
it walks the page tables: 1-4 ms of the node's CPU, more than a take-back costs). Until then, and
for a worker whose memory the node cannot read (a container's process in its own PID namespace),
it is charged what the last worker of the same model measured, else the median of what parked
workers measured, else the model's declared memory. A cpu worker of a 100 MB model measures
about 17 MB: charging declared memory kept a sixth of the models a 4 GB tier can hold.

`ParkedTier` is plain bookkeeping (no I/O, no clock): the pool measures, and stops what the tier
pushes out.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Generic, Protocol, TypeVar

from gpufaas.footprints import Footprints

_MIB = 1024 * 1024
REMEASURE_S = 60.0  # a model's parked workers are measured at most this often


class Parkable(Protocol):
    """What the tier needs of a worker."""

    @property
    def model(self) -> str: ...

    memory_mb: int  # the model's declared memory
    host_mb: int | None  # measured once parked (None: not yet, or not measurable)


W = TypeVar("W", bound=Parkable)


class ParkedTier(Generic[W]):
    """Parked workers by model, least recently parked first, within `budget_mb` of host memory."""

    def __init__(self, budget_mb: int, *, remeasure_s: float = REMEASURE_S) -> None:
        if budget_mb < 0:
            raise ValueError(f"the host tier's budget must be >= 0 MiB, got {budget_mb}")
        self.budget_mb = budget_mb
        self.remeasure_s = remeasure_s
        self._workers: OrderedDict[str, W] = OrderedDict()
        self._footprints = Footprints()  # model -> its last parked worker's PSS
        self._measured_at_s: dict[str, float] = {}  # model -> when that was read

    def wants_measure(self, model: str, now_s: float) -> bool:
        """Whether a worker of `model` parked at `now_s` should be measured: none of the model's
        was in the last `remeasure_s` (a worker of the same model and runtime uses about the same;
        reading the figure costs the node 1-4 ms of CPU, more than taking a worker back)."""
        at_s = self._measured_at_s.get(model)
        return at_s is None or now_s - at_s >= self.remeasure_s

    def __len__(self) -> int:
        return len(self._workers)

    def __contains__(self, model: object) -> bool:
        return model in self._workers

    def get(self, model: str) -> W | None:
        return self._workers.get(model)

    def pop(self, model: str) -> W | None:
        return self._workers.pop(model, None)

    def models(self) -> list[tuple[str, int]]:
        """(model, charged MiB) of every parked worker, least recently parked first."""
        return [(model, self.charge_mb(w)) for model, w in self._workers.items()]

    @property
    def used_mb(self) -> int:
        return sum(self.charge_mb(w) for w in self._workers.values())

    def charge_mb(self, worker: W) -> int:
        """What `worker` counts against the budget (see the module)."""
        if worker.host_mb is not None:
            return worker.host_mb
        return self._footprints.charge_mb(worker.model, worker.memory_mb)

    def park(self, worker: W) -> list[W]:
        """`worker` enters as the most recent; returns the workers it displaces (another replica of
        its model parked before, the oldest past the budget), for the caller to stop. A worker
        charged more than the whole budget displaces itself."""
        displaced = []
        older = self._workers.pop(worker.model, None)
        if older is not None and older is not worker:
            displaced.append(older)
        self._workers[worker.model] = worker
        return displaced + self._trim(worker)

    def measured(self, worker: W, host_mb: int, now_s: float) -> list[W]:
        """`worker`'s footprint was read at `now_s`: charge it that from now on (and remember it
        for its model's next workers, and for the estimate of those not measured yet); returns
        the workers now past the budget, the oldest first."""
        worker.host_mb = host_mb
        self._footprints.record(worker.model, host_mb)
        self._measured_at_s[worker.model] = now_s
        return self._trim(worker)

    def _trim(self, newest: W) -> list[W]:
        """The workers past the budget, the oldest first; `newest` (just parked or measured) first
        where it is charged more than the whole budget: it would push out every other one, then
        itself. The others may still be past it then: its measure moved the median they are
        charged."""
        pushed_out = []
        if self.charge_mb(newest) > self.budget_mb and self._workers.get(newest.model) is newest:
            del self._workers[newest.model]
            pushed_out.append(newest)
        used_mb = self.used_mb
        while self._workers and used_mb > self.budget_mb:
            _, oldest = self._workers.popitem(last=False)
            used_mb -= self.charge_mb(oldest)
            pushed_out.append(oldest)
        return pushed_out


def proportional_set_mb(pid: int) -> int | None:
    """Process `pid`'s PSS in MiB (rounded up) from /proc/PID/smaps_rollup; None where it cannot be
    read (the process is gone, or the kernel is too old to have the file). Reading it walks the
    process's page tables: about 2 ms for a torch worker, so the pool reads it off its event loop."""
    try:
        with open(f"/proc/{pid}/smaps_rollup", encoding="ascii") as f:
            for line in f:
                if line.startswith("Pss:"):
                    kib = int(line.split()[1])
                    return -(-kib * 1024 // _MIB)
    except (OSError, ValueError):
        return None
    return None
