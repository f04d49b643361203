"""bench.busy_holder_bench measures what it says: every round is a lone hit on a holder whose
worker is busy, on GPUs with no room for a replica."""

from __future__ import annotations

from bench.busy_holder_bench import busy_holders_cluster, measure


def test_its_cluster_is_full_and_every_holder_of_the_hot_model_is_busy() -> None:
    scheduler = busy_holders_cluster(20, 3, "lalb-o3")
    cluster = scheduler.cluster
    assert all(scheduler.cache.gpu(gpu_id).free_mb < 3000 for gpu_id in cluster.gpus)  # no room for A
    assert scheduler.cache.gpus_with("A") == {"g0", "g1", "g2"}
    assert all(cluster.worker_wait_s("A", gpu_id, 0.0) > 0 for gpu_id in ("g0", "g1", "g2"))


def test_every_round_is_a_hit() -> None:
    result = measure(20, 3, 50, "lalb-o3")
    assert result["hits"] == 50 and result["rounds"] == 50
    assert 0 < result["p50_us"] <= result["p90_us"]
