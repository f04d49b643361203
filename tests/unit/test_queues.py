"""The global queue: arrival order, the per-model index, and lazy skip counts."""

from __future__ import annotations

import random

import pytest

from scheduler.queues import GlobalQueue, Taken
from tests.builders import make_request


def make_queue(*models: str) -> tuple[GlobalQueue, list[str]]:
    queue = GlobalQueue()
    ids = []
    for seq, model in enumerate(models):
        request = make_request(model)
        queue.push(request, seq)
        ids.append(request.request_id)
    return queue, ids


def test_arrival_order_and_per_model_index() -> None:
    queue, ids = make_queue("A", "B", "A", "C")
    assert [r.request_id for r in queue] == ids
    assert queue.oldest_for("A") is not None and queue.oldest_for("A").request_id == ids[0]  # type: ignore[union-attr]
    oldest = queue.oldest_of(["C", "B"])
    assert oldest is not None and oldest.request_id == ids[1]
    queue.remove(ids[0])
    assert queue.oldest_for("A").request_id == ids[2]  # type: ignore[union-attr]
    assert queue.oldest_of(["Z"]) is None


def test_pass_over_counts_one_skip_for_every_older_request_only() -> None:
    queue, ids = make_queue("A", "B", "C", "D")
    queue.pass_over(ids[2])
    queue.remove(ids[2])
    assert [queue.num_skips(i) for i in (ids[0], ids[1], ids[3])] == [1, 1, 0]
    queue.pass_over(ids[1])
    queue.remove(ids[1])
    assert [queue.num_skips(i) for i in (ids[0], ids[3])] == [2, 0]
    assert queue.head_skips() == 2


def test_skip_counts_survive_removal_of_the_marked_request() -> None:
    queue, ids = make_queue("A", "B", "C", "D")
    queue.pass_over(ids[3])  # marks A, B, C (the mark sits on C)
    queue.remove(ids[3])
    queue.remove(ids[2])  # the mark moves to B
    assert [queue.num_skips(i) for i in ids[:2]] == [1, 1]
    queue.remove(ids[0])  # head leaves: B keeps its skip
    assert queue.head_skips() == 1
    assert [(r.request_id, skips) for r, skips in queue.walk()] == [(ids[1], 1)]


def test_walk_reports_exact_skips_while_the_walker_removes() -> None:
    queue, ids = make_queue("A", "B", "C", "D", "E")
    queue.pass_over(ids[4])  # A..D +1
    queue.pass_over(ids[2])  # A, B +1
    seen = []
    for request, skips in queue.walk():
        seen.append((request.request_id, skips))
        if request.request_id in (ids[0], ids[2]):
            queue.remove(request.request_id)
    assert seen == [(ids[0], 2), (ids[1], 2), (ids[2], 1), (ids[3], 1), (ids[4], 0)]
    assert [queue.num_skips(i) for i in (ids[1], ids[3], ids[4])] == [2, 1, 0]


def test_requeued_request_goes_back_in_arrival_order_keeping_counts_monotone() -> None:
    queue = GlobalQueue()
    a, b, c = make_request("A"), make_request("B"), make_request("A")
    queue.push(a, 0)
    queue.push(b, 1)
    queue.push(c, 2)
    queue.pass_over(c.request_id)  # A and B +1
    queue.remove(a.request_id)
    queue.insert(a, 0)  # back at the front, with the count of the request behind it
    assert [r.request_id for r in queue] == [a.request_id, b.request_id, c.request_id]
    assert [queue.num_skips(r.request_id) for r in (a, b, c)] == [1, 1, 0]
    assert queue.oldest_for("A") == a


@pytest.mark.parametrize("seed", range(5))
def test_requests_requeued_in_any_order_leave_each_models_index_in_arrival_order(seed: int) -> None:
    """A node's calls go back together (a node left, a scheduler stepped down), in no particular
    order, into a queue that has younger calls of the same models."""
    rng = random.Random(seed)
    models = [rng.choice("ABC") for _ in range(60)]
    queue, ids = make_queue(*models)
    requeued = rng.sample(range(60), 25)
    requests = {i: queue.remove(ids[i]) for i in requeued}
    for i in rng.sample(requeued, len(requeued)):
        queue.insert(requests[i], i)
    assert [r.request_id for r in queue] == ids
    for model in "ABC":
        drained = []
        while (oldest := queue.oldest_for(model)) is not None:
            drained.append(oldest.request_id)
            queue.remove(oldest.request_id)
        assert drained == [ids[i] for i, m in enumerate(models) if m == model]


def snapshot(queue: GlobalQueue) -> list[tuple[str, int]]:
    return [(r.request_id, queue.num_skips(r.request_id)) for r in queue]


def test_take_and_untake_last_in_first_out_restore_order_marks_and_model_index() -> None:
    queue, ids = make_queue("A", "B", "A", "C", "A")
    queue.pass_over(ids[3])  # A, B, A: one skip each (the mark sits on ids[2])
    queue.pass_over(ids[1])  # A: one more
    queue.visit(ids[4])
    before = snapshot(queue)
    # Take the oldest A, then the A holding the mark, then the tail: undo in reverse.
    taken = [queue.take(ids[0]), queue.take(ids[2]), queue.take(ids[4])]
    assert [r.request_id for r in queue] == [ids[1], ids[3]]
    assert queue.oldest_for("A") is None
    for one in reversed(taken):
        queue.untake(one)
    assert snapshot(queue) == before
    assert queue.oldest_for("A").request_id == ids[0]  # type: ignore[union-attr]
    queue.remove(ids[0])
    assert queue.oldest_for("A").request_id == ids[2]  # type: ignore[union-attr]  # index order kept


def test_untake_of_a_younger_request_keeps_the_model_index_in_arrival_order() -> None:
    queue, ids = make_queue("A", "B", "A", "A")
    middle = queue.take(ids[2])
    queue.untake(middle)
    assert [r.request_id for r in queue] == ids
    queue.remove(ids[0])
    assert queue.oldest_for("A").request_id == ids[2]  # type: ignore[union-attr]


def test_unpass_and_unvisit_undo_their_counts() -> None:
    queue, ids = make_queue("A", "B", "C")
    before = snapshot(queue)
    queue.pass_over(ids[2], exempt=[ids[0]])
    queue.visit(ids[1])
    queue.unvisit(ids[1])
    queue.unpass(ids[2], exempt=[ids[0]])
    assert snapshot(queue) == before


def test_untake_after_the_queue_changed_around_it_is_refused() -> None:
    queue, ids = make_queue("A", "B", "C")
    taken = queue.take(ids[1])
    queue.remove(ids[2])
    with pytest.raises(RuntimeError, match="changed around it"):
        queue.untake(taken)


def test_models_by_count_and_by_oldest_match_a_recount_through_every_kind_of_change() -> None:
    rng = random.Random(7)
    queue = GlobalQueue()
    seq = 0
    undo: list[Taken] = []
    for _ in range(2_000):
        action = rng.random()
        if action < 0.45 or not queue:
            undo.clear()  # takes are undone only inside a draft, which pushes nothing
            queue.push(make_request(rng.choice("ABCDEF")), seq)
            seq += 1
        elif action < 0.6:
            undo.append(queue.take(rng.choice(list(queue)).request_id))
        elif action < 0.7 and undo:
            queue.untake(undo.pop())
        else:
            undo.clear()  # a removal outside a draft: what was taken stays out
            request = queue.remove(rng.choice(list(queue)).request_id)
            if action > 0.9:
                queue.insert(request, seq)  # requeued (as the newest, to keep seqs unique)
                seq += 1
        counts = {model: queue.count_for(model) for model in queue.models()}
        by_count = list(queue.models_by_count())
        assert [count for count, _ in by_count] == sorted(set(counts.values()), reverse=True)
        assert {model: count for count, models in by_count for model in models} == counts
        in_order = list(dict.fromkeys(r.model for r in queue))
        assert list(queue.models_by_oldest()) == in_order


def test_models_by_oldest_tolerates_removals_between_steps() -> None:
    queue, ids = make_queue("A", "A", "B", "A", "C", "B", "D")
    walk = queue.models_by_oldest()
    assert next(walk) == "A"
    for request_id in (ids[0], ids[1], ids[3], ids[2]):  # every A, and the B right behind them
        queue.remove(request_id)
    assert list(walk) == ["C", "B", "D"]
