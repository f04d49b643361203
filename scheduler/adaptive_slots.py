"""Adaptive D: MQFQ-Sticky's device-concurrency controller, for every GPU.

A GPU may run D calls at once (`GpuSpec.slots`). MQFQ-Sticky (section 4.2, "Device Concurrency
and Feedback") adjusts D from the device's utilization: a coarse loop every `period_s` (200 ms in
the paper) compares the utilization over the last period with a threshold (90%, say): above it, D
comes down by one (at least 1), so that calls do not pile onto a saturated device and slow each
other down; below it, D goes up by one (at most `max_slots`), so that a device with headroom takes
more. Utilization here is the share of the period during which the GPU ran at least one call, as
the scheduler sees its calls start and end: what NVML's utilization counts at the device (the
share of time a kernel ran), less the parts of a call that do not use the device.

`AdaptiveSlots` is plain bookkeeping with time passed in: the simulator and the scheduler service
feed it the running calls per GPU at their events and apply the D it returns
(`Scheduler.set_slots`). Where events are further apart than a period, the whole span counts as
one period (one step of D). The service samples on a timer; the simulator observes after each
scheduling pass and, where nothing else happens, at `next_step_s` (the end of a period at which D
would move with the calls running unchanged), so that D steps as often as the service's would.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

DEFAULT_PERIOD_S = 0.2
DEFAULT_THRESHOLD = 0.9


@dataclass(slots=True)
class _Gpu:
    slots: int
    running: int = 0  # calls running at the last observation
    busy_s: float = 0.0  # time with at least one call running, this period so far
    period_start_s: float = 0.0
    last_s: float = 0.0


class AdaptiveSlots:
    """D per GPU between 1 and `max_slots`, stepped by one a period against `threshold`."""

    def __init__(
        self,
        max_slots: int,
        *,
        threshold: float = DEFAULT_THRESHOLD,
        period_s: float = DEFAULT_PERIOD_S,
        track_next_step: bool = False,
    ) -> None:
        """`track_next_step`: keep `next_step_s` (what a simulator's clock stops for; the service
        samples on a timer and does not pay for it)."""
        if max_slots < 1 or not 0.0 < threshold <= 1.0 or not period_s > 0:
            raise ValueError(
                f"max_slots must be >= 1, threshold in (0, 1] and period_s > 0, got {max_slots}, {threshold}, "
                f"{period_s}"
            )
        self.max_slots = max_slots
        self.threshold = threshold
        self.period_s = period_s
        self.track_next_step = track_next_step
        self._gpus: dict[str, _Gpu] = {}
        self.changes = 0  # steps of D taken, over every GPU
        # Set by `observe` (with `track_next_step`): the earliest end of a period at which some
        # GPU's D moves if the calls running on it stay as they are (inf: none would, or untracked).
        self.next_step_s = math.inf

    def slots(self, gpu_id: str) -> int | None:
        gpu = self._gpus.get(gpu_id)
        return None if gpu is None else gpu.slots

    def start_slots(self, gpu_id: str, slots: int) -> int:
        """The D a GPU joining (or joining again) configured with `slots` starts at: the
        controller's where it still tracks that GPU, else `slots` within [1, `max_slots`]. (A GPU
        registered above the bound took calls beyond it until the controller's next look.)"""
        gpu = self._gpus.get(gpu_id)
        return gpu.slots if gpu is not None else min(max(slots, 1), self.max_slots)

    def observe(self, now: float, running: Mapping[str, tuple[int, int]]) -> dict[str, int]:
        """`running`: GPU id -> (calls running on it now, its D now). Returns the GPUs whose D
        should change, with the new D. A GPU seen for the first time starts its first period, at
        `start_slots`."""
        changes: dict[str, int] = {}
        next_step_s = math.inf
        for gpu_id, (count, slots) in running.items():
            gpu = self._gpus.get(gpu_id)
            if gpu is None:
                gpu = self._gpus[gpu_id] = _Gpu(self.start_slots(gpu_id, slots), count, 0.0, now, now)
            else:
                self._observe(gpu, count, now)
            if gpu.slots != slots:  # a step now, a D out of bounds, or one set from elsewhere since
                changes[gpu_id] = gpu.slots
            # (the end of its period first: a GPU whose period ends no sooner cannot change it)
            end_s = gpu.period_start_s + self.period_s
            if self.track_next_step and end_s < next_step_s and self._would_step(gpu):
                next_step_s = end_s
        self.next_step_s = next_step_s
        for gpu_id in [g for g in self._gpus if g not in running]:
            del self._gpus[gpu_id]  # the GPU left
        return changes

    def _observe(self, gpu: _Gpu, count: int, now: float) -> None:
        """`count` calls run on `gpu` from `now`: count its busy time, and step its D if its
        period is over."""
        if gpu.running > 0:
            gpu.busy_s += now - gpu.last_s
        gpu.running = count
        gpu.last_s = now
        elapsed_s = now - gpu.period_start_s
        if elapsed_s >= self.period_s - 1e-9:  # periods of float clocks: 0.6 - 0.4 < 0.2
            new = self._stepped(gpu.slots, gpu.busy_s / elapsed_s)
            gpu.busy_s = 0.0
            gpu.period_start_s = now
            if new != gpu.slots:
                gpu.slots = new
                self.changes += 1

    def _stepped(self, slots: int, utilization: float) -> int:
        """D after a period of `utilization` at D = `slots`."""
        return min(max(slots - 1 if utilization > self.threshold else slots + 1, 1), self.max_slots)

    def _would_step(self, gpu: _Gpu) -> bool:
        """Whether `gpu`'s D moves at the end of its period, or at the end of the next, if the
        calls running on it now run on unchanged."""
        busy_s = gpu.busy_s + (gpu.period_start_s + self.period_s - gpu.last_s if gpu.running > 0 else 0.0)
        if self._stepped(gpu.slots, busy_s / self.period_s) != gpu.slots:
            return True
        return self._stepped(gpu.slots, 1.0 if gpu.running > 0 else 0.0) != gpu.slots
