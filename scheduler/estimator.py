"""Load- and inference-time estimates per (model, GPU type), from profiles, refined online by EWMA."""

from __future__ import annotations

import bisect
import math
import statistics
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

from gpufaas.profiles import ModelProfile

# Defaults for a GPU type with fewer than two profiled models: a line fitted to the paper's
# Table I (RTX 2080 over PCIe 3): about 1.5 s of process/context start plus 1.6 GB/s.
DEFAULT_LOAD_OVERHEAD_S = 1.5
DEFAULT_LOAD_BANDWIDTH_MB_S = 1600.0
DEFAULT_INFERENCE_S_PER_SAMPLE = 1.3 / 32
# Taking a model back from its node's host tier onto a GPU: a host-to-device copy of its weights
# (pinned memory, pipelined by layer, as Torpor does) at about what PCIe 3 x16 carries, plus a
# fixed cost to hand the worker its GPU. Measured swap-ins replace it per (model, GPU type).
DEFAULT_HOST_TO_GPU_MB_S = 10_000.0
DEFAULT_SWAP_IN_OVERHEAD_S = 0.005
# Fetching a package a node has not staged, from another holder, before it loads: at about what
# a 10 Gb/s link carries, plus the round trips to find and start it. The size is the declared
# memory: the weights a package carries are most of a model's memory.
DEFAULT_FETCH_MB_S = 1_000.0
DEFAULT_FETCH_OVERHEAD_S = 0.05


@dataclass(frozen=True, slots=True)
class _Line:
    intercept_s: float
    slope_s_per_mb: float

    def at(self, memory_mb: int) -> float:
        return max(0.0, self.intercept_s + self.slope_s_per_mb * memory_mb)


class Estimator:
    """Estimates how long a model takes to load on a GPU type and to run a batch there.

    Known (model, GPU type) pairs start from their profile; every measurement reported back moves
    the estimate by `alpha` toward it (EWMA). Unknown models are estimated from their size: load
    time from a line fitted to the profiled models of that GPU type (size -> load time), inference
    time from the median per-sample time of the profiled models. Inference time at a batch size
    never measured for that (model, GPU type) is interpolated linearly between the two nearest
    measured batch sizes around it, and outside the measured range scales proportionally from
    the nearest one (a batch twice as large takes twice as long). Pure: no clock, no I/O.
    """

    def __init__(
        self,
        profiles: Iterable[ModelProfile] = (),
        *,
        alpha: float = 0.2,
        host_to_gpu_mb_s: float = DEFAULT_HOST_TO_GPU_MB_S,
    ) -> None:
        if not 0.0 < alpha <= 1.0:
            raise ValueError(f"alpha must be in (0, 1], got {alpha}")
        if not host_to_gpu_mb_s > 0:
            raise ValueError(f"host_to_gpu_mb_s must be positive, got {host_to_gpu_mb_s}")
        self.alpha = alpha
        self.host_to_gpu_mb_s = host_to_gpu_mb_s
        self._swap_in_s: dict[tuple[str, str], float] = {}
        self._load_s: dict[tuple[str, str], float] = {}
        self._inference_s: dict[tuple[str, str], dict[int, float]] = {}
        self._sizes: dict[tuple[str, str], int] = {}
        self._fits: dict[str, _Line] = {}
        self._per_sample_s: dict[str, float] = {}
        for profile in profiles:
            self.add_profile(profile)

    def add_profile(self, profile: ModelProfile) -> None:
        key = (profile.model, profile.gpu_type)
        self._load_s[key] = profile.load_time_s
        self._inference_s.setdefault(key, {})[profile.batch_size] = profile.inference_time_s
        self._sizes[key] = profile.memory_mb
        self._fits.pop(profile.gpu_type, None)
        self._per_sample_s.pop(profile.gpu_type, None)

    # --- estimates ------------------------------------------------------------------------
    def load_time_s(self, model: str, gpu_type: str, memory_mb: int) -> float:
        known = self._load_s.get((model, gpu_type))
        if known is not None:
            return known
        return self._load_line(gpu_type).at(memory_mb)

    def swap_in_time_s(self, model: str, gpu_type: str, memory_mb: int) -> float:
        """Taking `model` back from its node's host tier: measured, else its size over the
        host-to-GPU bandwidth plus a fixed cost."""
        known = self._swap_in_s.get((model, gpu_type))
        if known is not None:
            return known
        return DEFAULT_SWAP_IN_OVERHEAD_S + memory_mb / self.host_to_gpu_mb_s

    def transfer_time_s(self, memory_mb: int) -> float:
        """The host-to-GPU copy of `memory_mb` alone on its link: the part of a load or swap-in that
        a second copy over the same link (GPUs behind one PCIe switch) slows down."""
        return memory_mb / self.host_to_gpu_mb_s

    def fetch_time_s(self, memory_mb: int) -> float:
        """Bringing a package of about `memory_mb` to a node that lacks it (before its load)."""
        return DEFAULT_FETCH_OVERHEAD_S + memory_mb / DEFAULT_FETCH_MB_S

    def inference_time_s(self, model: str, gpu_type: str, batch_size: int) -> float:
        by_batch = self._inference_s.get((model, gpu_type))
        if by_batch:
            exact = by_batch.get(batch_size)
            if exact is not None:
                return exact
            return _interpolate(by_batch, batch_size)
        return self._median_per_sample_s(gpu_type) * batch_size

    def known_times_s(self, model: str, gpu_type: str) -> tuple[float | None, dict[int, float]]:
        """What is known of `model` on `gpu_type`, profiled or measured, with no fallback: its load
        time (None: unknown) and its inference time per batch size (a copy): what a scheduler
        persists for its successors' `restore`."""
        key = (model, gpu_type)
        return self._load_s.get(key), dict(self._inference_s.get(key, {}))

    def known_swap_in_s(self, model: str, gpu_type: str) -> float | None:
        """The measured time of taking `model` back from a host tier onto `gpu_type` (None: never
        measured), persisted with `known_times_s`."""
        return self._swap_in_s.get((model, gpu_type))

    def restore(
        self,
        model: str,
        gpu_type: str,
        load_time_s: float | None,
        inference_time_s: Mapping[int, float],
        swap_in_time_s: float | None = None,
    ) -> None:
        """Take figures another scheduler knew (`known_times_s`, `known_swap_in_s`, persisted) as
        they are: they are estimates already, not a new measurement to average in. They replace
        the ones known here, batch size by batch size; a load or swap-in time of None leaves the
        one known here."""
        key = (model, gpu_type)
        if swap_in_time_s is not None:
            self._swap_in_s[key] = swap_in_time_s
        if load_time_s is not None:
            self._load_s[key] = load_time_s
            self._fits.pop(gpu_type, None)
        if inference_time_s:
            self._inference_s.setdefault(key, {}).update(inference_time_s)
            self._per_sample_s.pop(gpu_type, None)

    # --- online updates -------------------------------------------------------------------
    # A measurement that is not a finite, non-negative time (or a batch below one sample) is
    # ignored: one NaN or infinity would stay in the EWMA for good (inf + alpha * (x - inf) is
    # NaN), and with the other models' figures in the size-based estimates of its GPU type.
    def observe_load(self, model: str, gpu_type: str, load_time_s: float) -> None:
        if not 0.0 <= load_time_s < math.inf:
            return
        key = (model, gpu_type)
        old = self._load_s.get(key)
        self._load_s[key] = load_time_s if old is None else old + self.alpha * (load_time_s - old)
        self._fits.pop(gpu_type, None)

    def observe_swap_in(self, model: str, gpu_type: str, swap_in_time_s: float) -> None:
        if not 0.0 <= swap_in_time_s < math.inf:
            return
        key = (model, gpu_type)
        old = self._swap_in_s.get(key)
        self._swap_in_s[key] = swap_in_time_s if old is None else old + self.alpha * (swap_in_time_s - old)

    def observe_inference(self, model: str, gpu_type: str, batch_size: int, inference_time_s: float) -> None:
        if batch_size < 1 or not 0.0 <= inference_time_s < math.inf:
            return
        by_batch = self._inference_s.setdefault((model, gpu_type), {})
        old = by_batch.get(batch_size)
        by_batch[batch_size] = inference_time_s if old is None else old + self.alpha * (inference_time_s - old)

    # --- size-based fallbacks ---------------------------------------------------------------
    def _load_line(self, gpu_type: str) -> _Line:
        line = self._fits.get(gpu_type)
        if line is None:
            points = [
                (float(self._sizes[key]), self._load_s[key])
                for key in self._sizes
                if key[1] == gpu_type and key in self._load_s
            ]
            line = _fit(points)
            self._fits[gpu_type] = line
        return line

    def _median_per_sample_s(self, gpu_type: str) -> float:
        per_sample = self._per_sample_s.get(gpu_type)
        if per_sample is None:
            samples = [
                seconds / batch
                for (model, kind), by_batch in self._inference_s.items()
                if kind == gpu_type
                for batch, seconds in by_batch.items()
            ]
            per_sample = statistics.median(samples) if samples else DEFAULT_INFERENCE_S_PER_SAMPLE
            self._per_sample_s[gpu_type] = per_sample
        return per_sample


def _interpolate(by_batch: dict[int, float], batch_size: int) -> float:
    """Inference time at an unmeasured `batch_size`: on the segment between the measured sizes
    around it, else proportional to the nearest measured size. O(m log m) for m measured sizes
    (a handful per model)."""
    sizes = sorted(by_batch)
    above = bisect.bisect_right(sizes, batch_size)
    if above == 0 or above == len(sizes):
        nearest = sizes[0] if above == 0 else sizes[-1]
        return by_batch[nearest] * batch_size / nearest
    low, high = sizes[above - 1], sizes[above]
    return by_batch[low] + (by_batch[high] - by_batch[low]) * (batch_size - low) / (high - low)


def _fit(points: list[tuple[float, float]]) -> _Line:
    """Least-squares line through (memory_mb, load_time_s); defaults when it is undetermined."""
    if len({x for x, _ in points}) < 2:
        return _Line(DEFAULT_LOAD_OVERHEAD_S, 1.0 / DEFAULT_LOAD_BANDWIDTH_MB_S)
    slope, intercept = statistics.linear_regression([x for x, _ in points], [y for _, y in points])
    if slope <= 0:
        # A flat or inverted fit would make big models look free to load; keep size in the estimate.
        slope = 1.0 / DEFAULT_LOAD_BANDWIDTH_MB_S
        intercept = statistics.fmean(y for _, y in points) - slope * statistics.fmean(x for x, _ in points)
    return _Line(intercept, slope)
