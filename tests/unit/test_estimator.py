"""Load- and inference-time estimates: profiles, size-based fallbacks, batch scaling, EWMA."""

from __future__ import annotations

import math

import pytest

from gpufaas.profiles import ModelProfile, paper_table1
from scheduler import Estimator


def test_profiled_figures_are_returned_as_is() -> None:
    estimator = Estimator(paper_table1())
    assert estimator.load_time_s("vgg19", "rtx2080", 3947) == pytest.approx(4.07)
    assert estimator.inference_time_s("inception_v3", "rtx2080", 32) == pytest.approx(1.63)


def test_unknown_model_is_estimated_from_its_size() -> None:
    estimator = Estimator(paper_table1())
    small = estimator.load_time_s("new-small", "rtx2080", 1300)
    large = estimator.load_time_s("new-large", "rtx2080", 3900)
    assert 2.0 < small < large < 5.0
    # The median per-sample time of Table I, times the batch.
    assert estimator.inference_time_s("new", "rtx2080", 32) == pytest.approx(1.30, abs=0.02)


def test_unknown_gpu_type_falls_back_to_defaults() -> None:
    estimator = Estimator()
    assert estimator.load_time_s("m", "h100", 1600) == pytest.approx(1.5 + 1600 / 1600)
    assert estimator.inference_time_s("m", "h100", 64) > estimator.inference_time_s("m", "h100", 32)


def test_unprofiled_batch_size_scales_from_the_nearest_profiled_one() -> None:
    estimator = Estimator([ModelProfile("m", "t", 1000, 2.0, 1.0, 32)])
    assert estimator.inference_time_s("m", "t", 16) == pytest.approx(0.5)


def test_a_batch_size_between_two_measured_ones_is_interpolated_linearly() -> None:
    estimator = Estimator([ModelProfile("m", "t", 1000, 2.0, 1.0, 32)])
    estimator.observe_inference("m", "t", 128, 2.5)  # batching is sublinear on this GPU
    estimator.observe_inference("m", "t", 64, 1.6)
    assert estimator.inference_time_s("m", "t", 48) == pytest.approx(1.0 + 0.6 * 16 / 32)
    assert estimator.inference_time_s("m", "t", 96) == pytest.approx(1.6 + 0.9 * 32 / 64)
    assert estimator.inference_time_s("m", "t", 64) == pytest.approx(1.6)  # measured: as is


def test_outside_the_measured_range_the_nearest_size_scales_proportionally() -> None:
    estimator = Estimator([ModelProfile("m", "t", 1000, 2.0, 1.0, 32)])
    estimator.observe_inference("m", "t", 128, 2.5)
    assert estimator.inference_time_s("m", "t", 8) == pytest.approx(1.0 * 8 / 32)
    assert estimator.inference_time_s("m", "t", 256) == pytest.approx(2.5 * 256 / 128)
    # Another GPU type's measurements do not count.
    estimator.observe_inference("m", "other", 64, 9.0)
    assert estimator.inference_time_s("m", "t", 64) == pytest.approx(1.0 + 1.5 * 32 / 96)


def test_measurements_move_the_estimate_by_ewma() -> None:
    estimator = Estimator([ModelProfile("m", "t", 1000, 2.0, 1.0, 32)], alpha=0.5)
    estimator.observe_load("m", "t", 4.0)
    estimator.observe_inference("m", "t", 32, 2.0)
    assert estimator.load_time_s("m", "t", 1000) == pytest.approx(3.0)
    assert estimator.inference_time_s("m", "t", 32) == pytest.approx(1.5)
    estimator.observe_load("unknown", "t", 7.0)  # a first measurement is taken whole
    assert estimator.load_time_s("unknown", "t", 1) == pytest.approx(7.0)


@pytest.mark.parametrize("bad_s", [math.inf, math.nan, -1.0])
def test_a_measurement_that_is_no_time_leaves_the_estimates_as_they_were(bad_s: float) -> None:
    # An infinite inference time went in whole, and the next finite one made it NaN for good
    # (inf + alpha * (x - inf)); with it the median per-sample time of every unprofiled model.
    estimator = Estimator([ModelProfile("m", "t", 1000, 2.0, 1.0, 32)], alpha=0.5)
    estimator.observe_load("m", "t", bad_s)
    estimator.observe_swap_in("m", "t", bad_s)
    estimator.observe_inference("m", "t", 32, bad_s)
    estimator.observe_inference("m", "t", 0, 1.0)  # no samples: no time per sample
    estimator.observe_inference("m", "t", 32, 2.0)
    assert estimator.known_times_s("m", "t") == (2.0, {32: pytest.approx(1.5)})
    assert estimator.swap_in_time_s("m", "t", 1000) == estimator.swap_in_time_s("other", "t", 1000)
    assert estimator.inference_time_s("unprofiled", "t", 32) == pytest.approx(1.5)


def test_alpha_must_be_a_fraction() -> None:
    with pytest.raises(ValueError, match="alpha"):
        Estimator(alpha=0.0)


def test_restored_figures_replace_the_known_ones_as_they_are() -> None:
    # A successor's figures from etcd are estimates already: not averaged in as a measurement.
    estimator = Estimator([ModelProfile("m", "t", 1000, 2.0, 1.0, 32)])
    estimator.restore("m", "t", 9.0, {1: 0.1})
    assert estimator.known_times_s("m", "t") == (9.0, {1: 0.1, 32: 1.0})
    estimator.restore("m", "t", None, {32: 0.8})  # no load time known there: this one's stays
    assert estimator.known_times_s("m", "t") == (9.0, {1: 0.1, 32: 0.8})
