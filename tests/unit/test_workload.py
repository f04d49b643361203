"""Unit tests of trace loading and workload building (simulator/workload.py)."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable
from pathlib import Path

import pytest

from gpufaas.errors import InvalidInput
from gpufaas.profiles import ModelProfile, paper_table1
from simulator.workload import (
    TraceCounts,
    WorkloadConfig,
    build_workload,
    load_azure2019,
    load_azure2021,
    load_trace,
    zipf_workload,
)

SHIPPED_TRACE = Path(__file__).resolve().parents[2] / "simulator/traces/azure2019-500fn/invocations.csv"
HEADER_2019 = "HashOwner,HashApp,HashFunction,Trigger"


def write(tmp_path: Path, name: str, text: str) -> Path:
    path = tmp_path / name
    path.write_text(text, encoding="utf-8")
    return path


def assert_rejected(load: Callable[[Path], object], path: Path, where: str, what: str) -> None:
    """`load(path)` raises InvalidInput naming the place (`where`), the fault (`what`) and what
    was expected."""
    with pytest.raises(InvalidInput) as raised:
        load(path)

    assert where in str(raised.value)
    assert what in str(raised.value)
    assert "expected" in str(raised.value)


def make_trace(counts: dict[str, dict[int, int]], minutes: list[int]) -> TraceCounts:
    return TraceCounts(path=Path("mem.csv"), minutes=minutes, counts=counts)


def make_table(sizes: list[int]) -> list[ModelProfile]:
    return [
        ModelProfile(
            model=f"m{size}",
            gpu_type="rtx2080",
            memory_mb=size,
            load_time_s=1.0,
            inference_time_s=0.5,
            batch_size=16,
        )
        for size in sizes
    ]


# --- Azure 2019 per-minute format -------------------------------------------------------------


def test_load_azure2019_reads_minutes_and_sums_duplicate_rows(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "inv.csv",
        f"{HEADER_2019},10,11,12\no1,a1,f1,http,3,0,2\no1,a1,f2,timer,0,0,0\no1,a1,f1,queue,1,4.0,0\n",
    )

    trace = load_azure2019(path)

    assert trace.path == path
    assert trace.minutes == [10, 11, 12]
    assert trace.counts["o1/a1/f1"] == {10: 4, 11: 4, 12: 2}
    assert sum(trace.counts["o1/a1/f2"].values()) == 0
    assert set(trace.counts) == {"o1/a1/f1", "o1/a1/f2"}


def test_load_azure2019_sorts_minute_columns(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.csv", f"{HEADER_2019},12,10,11\no,a,f,http,1,2,3\n")

    trace = load_azure2019(path)

    assert trace.minutes == [10, 11, 12]
    assert trace.counts["o/a/f"] == {12: 1, 10: 2, 11: 3}


def test_load_trace_dispatches_by_format_and_rejects_unknown(tmp_path: Path) -> None:
    path = write(tmp_path, "inv.csv", f"{HEADER_2019},10\no,a,f,http,5\n")

    assert load_trace(path, "azure2019").counts == {"o/a/f": {10: 5}}
    with pytest.raises(InvalidInput, match="azure2019, azure2021"):
        load_trace(path, "azure2020")


# --- Azure 2021 per-invocation format ---------------------------------------------------------


def test_load_azure2021_counts_arrivals_per_minute(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        "inv2021.txt",
        "app,func,end_timestamp,duration\n"
        "a,f,70.0,5.0\n"  # arrives 65.0 -> minute 1
        "a,f,125,10\n"  # arrives 115.0 -> minute 1, though it ends in minute 2
        "a,g,190,0.25\n"  # arrives 189.75 -> minute 3
        "b,f,2.0,3.0\n",  # arrives -1.0, clamped -> minute 0
    )

    trace = load_azure2021(path)

    assert trace.minutes == [0, 1, 2, 3]
    assert trace.counts == {"a/f": {1: 2}, "a/g": {3: 1}, "b/f": {0: 1}}


def test_load_azure2021_minutes_span_gaps(tmp_path: Path) -> None:
    path = write(tmp_path, "inv2021.txt", "app,func,end_timestamp,duration\na,f,130,0\na,f,400,10\n")

    trace = load_trace(path, "azure2021")

    assert trace.minutes == [2, 3, 4, 5, 6]
    assert trace.counts == {"a/f": {2: 1, 6: 1}}


# --- Errors -----------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("", "bad.csv:1:", "empty file"),
        ("Owner,App,Function,Trigger,1\n", "bad.csv:1:", "header starts with"),
        (f"{HEADER_2019}\n", "bad.csv:1:", "no minute columns"),
        (f"{HEADER_2019},1,two\n", "bad.csv:1:", "'two'"),
        (f"{HEADER_2019},1,1\n", "bad.csv:1:", "appears twice"),
        (f"{HEADER_2019},1,2\n", "bad.csv:2:", "no function rows"),
        (f"{HEADER_2019},1,2\no,a,f,http,1,2\no,a,g,http,1\n", "bad.csv:3:", "has 5 fields"),
        (f"{HEADER_2019},1,2\no,a,f,http,1,x\n", "bad.csv:2:", "'x'"),
        (f"{HEADER_2019},1,2\no,a,f,http,1,2\no,a,g,http,-1,2\n", "bad.csv:3:", "'-1'"),
        (f"{HEADER_2019},1,2\no,a,f,http,1.5,2\n", "bad.csv:2:", "non-negative integer"),
        (f"{HEADER_2019},1,2\no,a,f,http,nan,2\n", "bad.csv:2:", "non-negative integer"),
        (f"{HEADER_2019},1\no,,f,http,1\n", "bad.csv:2:", "empty HashOwner"),
    ],
)
def test_load_azure2019_rejects_bad_input(tmp_path: Path, text: str, where: str, what: str) -> None:
    assert_rejected(load_azure2019, write(tmp_path, "bad.csv", text), where, what)


@pytest.mark.parametrize(
    ("text", "where", "what"),
    [
        ("", "bad.txt:1:", "empty file"),
        ("app,func,end,duration\n", "bad.txt:1:", "end_timestamp"),
        ("app,func,end_timestamp,duration\n", "bad.txt:2:", "no invocation rows"),
        ("app,func,end_timestamp,duration\na,f,1,0\na,f,2\n", "bad.txt:3:", "has 3 fields"),
        ("app,func,end_timestamp,duration\na,f,1,0\na,f,soon,0\n", "bad.txt:3:", "'soon'"),
        ("app,func,end_timestamp,duration\na,f,-4,0\n", "bad.txt:2:", "end_timestamp"),
        ("app,func,end_timestamp,duration\na,f,4,-1\n", "bad.txt:2:", "duration"),
        ("app,func,end_timestamp,duration\na,f,inf,0\n", "bad.txt:2:", "'inf'"),
        ("app,func,end_timestamp,duration\n,f,4,1\n", "bad.txt:2:", "empty app"),
    ],
)
def test_load_azure2021_rejects_bad_input(tmp_path: Path, text: str, where: str, what: str) -> None:
    assert_rejected(load_azure2021, write(tmp_path, "bad.txt", text), where, what)


def test_csv_error_names_its_line(tmp_path: Path) -> None:
    huge_field = "g" * 200_000  # over csv's default field size limit
    path = write(tmp_path, "huge.csv", f"{HEADER_2019},1\no,a,f,http,1\no,a,{huge_field},http,1\n")

    with pytest.raises(InvalidInput, match=r"huge.csv:3: malformed CSV"):
        load_azure2019(path)


def test_missing_file_is_invalid_input(tmp_path: Path) -> None:
    path = tmp_path / "nowhere.csv"

    for trace_format in ("azure2019", "azure2021"):
        with pytest.raises(InvalidInput, match=r"nowhere\.csv: no such file"):
            load_trace(path, trace_format)


def test_directory_is_invalid_input(tmp_path: Path) -> None:
    with pytest.raises(InvalidInput, match="cannot be read"):
        load_azure2019(tmp_path)


def test_non_utf8_bytes_name_their_line(tmp_path: Path) -> None:
    path = tmp_path / "latin.csv"
    path.write_bytes(f"{HEADER_2019},1\no,a,f,http,1\no,a,\xe9,http,1\n".encode("latin-1"))

    with pytest.raises(InvalidInput, match=r"latin.csv:3: not UTF-8"):
        load_azure2019(path)


# --- Window and working set -------------------------------------------------------------------


def test_window_defaults_to_first_minute_and_can_be_chosen() -> None:
    trace = make_trace({"f": {10: 1, 11: 1, 12: 1, 13: 1}}, [10, 11, 12, 13])
    table = make_table([100])

    default = build_workload(trace, WorkloadConfig(minutes=2, rpm=4), table)
    later = build_workload(trace, WorkloadConfig(start_minute=12, minutes=2, rpm=4), table)

    assert (default.start_minute, default.minutes) == (10, 2)
    assert (later.start_minute, later.minutes) == (12, 2)
    assert len(default.requests) == 8
    assert len(later.requests) == 8
    # Arrivals are relative to the window's start, whatever minute it is.
    assert all(0 <= r.arrival_s < 120 for r in later.requests)


@pytest.mark.parametrize(("start", "minutes"), [(9, 2), (12, 3), (20, 1)])
def test_window_outside_trace_is_invalid(start: int, minutes: int) -> None:
    trace = make_trace({"f": {10: 1}}, [10, 11, 12, 13])

    with pytest.raises(InvalidInput, match=r"which has minutes 10\.\.13"):
        build_workload(trace, WorkloadConfig(start_minute=start, minutes=minutes), make_table([100]))


@pytest.mark.parametrize("field", ["minutes", "working_set", "rpm"])
@pytest.mark.parametrize("value", [0, -1])
def test_non_positive_config_is_invalid(field: str, value: int) -> None:
    trace = make_trace({"f": {10: 1}}, [10])
    sizes = {"minutes": 1, "working_set": 1, "rpm": 1} | {field: value}
    config = WorkloadConfig(minutes=sizes["minutes"], working_set=sizes["working_set"], rpm=sizes["rpm"])

    with pytest.raises(InvalidInput, match=field):
        build_workload(trace, config, make_table([100]))


def test_working_set_takes_most_invoked_in_window_ties_by_id() -> None:
    trace = make_trace(
        {
            "e9": {0: 100},  # outside the window: counts for nothing
            "d4": {1: 9},
            "c3": {1: 3, 2: 2},
            "b1": {2: 5},
            "a2": {1: 4, 2: 1},
            "f0": {1: 1},
            "z0": {},
        },
        [0, 1, 2],
    )
    config = WorkloadConfig(start_minute=1, minutes=2, working_set=3, rpm=10)

    workload = build_workload(trace, config, make_table([1]))

    # d4=9 first; a2, b1 and c3 tie at 5: ids ascending, and the cut falls inside the tie.
    assert list(workload.function_models) == ["d4", "a2", "b1"]
    assert workload.top_function == "d4"
    assert {r.function for r in workload.requests} == {"d4", "a2", "b1"}


def test_working_set_larger_than_invoked_functions_uses_those_there_are() -> None:
    trace = make_trace({"a": {0: 2}, "b": {0: 1}, "c": {}}, [0])

    workload = build_workload(trace, WorkloadConfig(minutes=1, rpm=3), make_table([1, 2]))

    assert list(workload.function_models) == ["a", "b"]
    assert len(workload.profiles) == 2


def test_window_without_invocations_is_invalid() -> None:
    trace = make_trace({"a": {0: 2}}, [0, 1])

    with pytest.raises(InvalidInput, match="no invocations"):
        build_workload(trace, WorkloadConfig(start_minute=1, minutes=1), make_table([1]))


# --- Scaling and arrivals ---------------------------------------------------------------------


def test_minute_is_scaled_to_rpm_keeping_proportions() -> None:
    trace = make_trace({"a": {0: 3, 1: 30}, "b": {0: 1, 1: 10}}, [0, 1])

    workload = build_workload(trace, WorkloadConfig(minutes=2, rpm=8), make_table([1, 2]))

    counts = Counter((int(r.arrival_s // 60), r.function) for r in workload.requests)
    assert counts == {(0, "a"): 6, (0, "b"): 2, (1, "a"): 6, (1, "b"): 2}


def test_largest_remainder_rounding_sums_exactly_and_breaks_ties_by_rank() -> None:
    # Minute 0: 1:1:1 at rpm 10 -> 3.33 each, the leftover 1 goes to rank 0 ("a").
    # Minute 1: 5:3:2 at rpm 7 -> 3.5, 2.1, 1.4 -> 3, 2, 1 + leftover to the largest remainder.
    trace = make_trace({"a": {0: 1, 1: 5}, "b": {0: 1, 1: 3}, "c": {0: 1, 1: 2}}, [0, 1])

    first = build_workload(trace, WorkloadConfig(minutes=1, rpm=10), make_table([1, 2, 3]))
    second = build_workload(trace, WorkloadConfig(start_minute=1, minutes=1, rpm=7), make_table([1, 2, 3]))

    assert Counter(r.function for r in first.requests) == {"a": 4, "b": 3, "c": 3}
    assert Counter(r.function for r in second.requests) == {"a": 4, "b": 2, "c": 1}


def test_zero_minute_produces_no_requests() -> None:
    trace = make_trace({"a": {0: 2, 2: 1}, "b": {0: 2}}, [0, 1, 2])

    workload = build_workload(trace, WorkloadConfig(minutes=3, rpm=5), make_table([1, 2]))

    minutes = Counter(int(r.arrival_s // 60) for r in workload.requests)
    assert minutes == {0: 5, 2: 5}


def test_arrivals_fall_inside_their_minute_and_ids_follow_arrival_order() -> None:
    trace = make_trace({"a": {5: 3, 6: 1, 7: 2}, "b": {5: 1, 6: 3, 7: 2}}, [5, 6, 7])

    workload = build_workload(trace, WorkloadConfig(minutes=3, rpm=40), make_table([1, 2]))
    requests = workload.requests

    assert len(requests) == 120
    assert [r.request_id for r in requests] == [f"r{i:06d}" for i in range(120)]
    assert [r.arrival_s for r in requests] == sorted(r.arrival_s for r in requests)
    by_minute_and_function = Counter((int(r.arrival_s // 60), r.function) for r in requests)
    assert by_minute_and_function == {
        (0, "a"): 30,
        (0, "b"): 10,
        (1, "a"): 10,
        (1, "b"): 30,
        (2, "a"): 20,
        (2, "b"): 20,
    }
    assert all(0 <= r.arrival_s < 180 for r in requests)


def test_requests_carry_function_model_and_batch_size() -> None:
    trace = make_trace({"a": {0: 1}, "b": {0: 1}}, [0])

    workload = build_workload(trace, WorkloadConfig(minutes=1, rpm=4), make_table([100, 200]))

    assert workload.function_models == {"a": "m100", "b": "m200"}
    for request in workload.requests:
        assert request.model == workload.function_models[request.function]
        assert request.batch_size == 16


def test_same_seed_same_workload_other_seed_other_arrivals() -> None:
    trace = make_trace({"a": {0: 3, 1: 2}, "b": {0: 1, 1: 2}}, [0, 1])
    table = make_table([1, 2])

    one = build_workload(trace, WorkloadConfig(minutes=2, rpm=20, seed=7), table)
    again = build_workload(trace, WorkloadConfig(minutes=2, rpm=20, seed=7), table)
    other = build_workload(trace, WorkloadConfig(minutes=2, rpm=20, seed=8), table)

    assert one == again
    assert [r.arrival_s for r in one.requests] != [r.arrival_s for r in other.requests]
    assert Counter(r.function for r in one.requests) == Counter(r.function for r in other.requests)


# --- Function -> model mapping ----------------------------------------------------------------


def trace_with_functions(n: int) -> TraceCounts:
    """n functions f000, f001, ... with strictly decreasing popularity (f000 most invoked)."""
    return make_trace({f"f{i:03d}": {0: 1000 - i} for i in range(n)}, [0])


def test_mapping_with_22_functions_uses_every_table_model_once() -> None:
    table = paper_table1()

    workload = build_workload(trace_with_functions(22), WorkloadConfig(minutes=1, working_set=22), table)
    names = [p.model for p in workload.profiles]

    assert sorted(names) == sorted(p.model for p in table)
    assert sorted(p.memory_mb for p in workload.profiles) == sorted(p.memory_mb for p in table)
    assert names[:4] == ["squeezenet1_1", "vgg19", "resnet18", "vgg16_bn"]
    assert workload.function_models["f000"] == "squeezenet1_1"
    assert workload.function_models["f001"] == "vgg19"
    # Figures are copied from the table model.
    by_name = {p.model: p for p in table}
    for profile in workload.profiles:
        assert profile == by_name[profile.model]


def test_mapping_with_35_functions_gives_each_its_own_model() -> None:
    table = paper_table1()

    workload = build_workload(trace_with_functions(35), WorkloadConfig(minutes=1, working_set=35), table)
    profiles = workload.profiles

    assert len(profiles) == 35
    assert len({p.model for p in profiles}) == 35
    assert len(set(workload.function_models.values())) == 35
    # Rank 0 gets the smallest model, rank 1 the largest, rank 2 the next smallest.
    assert profiles[0].memory_mb == min(p.memory_mb for p in table)
    assert profiles[1].memory_mb == max(p.memory_mb for p in table)
    assert [p.model for p in profiles[:5]] == [
        "squeezenet1_1",
        "vgg19",
        "resnet18#1",
        "vgg16_bn#1",
        "resnet18#2",
    ]
    # Every table model is picked at least once: sizes span the whole table.
    bases = {p.model.split("#")[0] for p in profiles}
    assert bases == {p.model for p in table}


def test_mapping_alternates_ends_and_numbers_repeats_in_rank_order() -> None:
    table = make_table([40, 10, 30, 20])  # unsorted on purpose

    workload = build_workload(trace_with_functions(7), WorkloadConfig(minutes=1, working_set=7, rpm=7), table)

    # Sorted sizes 10, 20, 30, 40; indices round(i * 3 / 6) = 0, 0, 1, 2, 2, 2, 3 (round half to
    # even) -> picked 10, 10, 20, 30, 30, 30, 40; dealt from both ends by rank.
    assert [p.model for p in workload.profiles] == [
        "m10#1",
        "m40",
        "m10#2",
        "m30#1",
        "m20",
        "m30#2",
        "m30#3",
    ]
    assert [p.memory_mb for p in workload.profiles] == [10, 40, 10, 30, 20, 30, 30]


def test_mapping_with_one_function_takes_the_smallest_model() -> None:
    workload = build_workload(trace_with_functions(1), WorkloadConfig(minutes=1, rpm=3), make_table([30, 10, 20]))

    assert [p.model for p in workload.profiles] == ["m10"]
    assert workload.function_models == {"f000": "m10"}


# --- The shipped trace ------------------------------------------------------------------------


def test_shipped_trace_default_workload() -> None:
    trace = load_azure2019(SHIPPED_TRACE)

    workload = build_workload(trace, WorkloadConfig(minutes=6, working_set=35, rpm=325), paper_table1())

    assert trace.minutes == list(range(480, 960))
    assert len(trace.counts) == 500
    assert workload.start_minute == 480
    assert len(workload.requests) == 1950
    assert len(workload.profiles) == 35
    assert len(workload.function_models) == 35
    assert len({p.model for p in workload.profiles}) == 35
    # The trace is skewed: rescaled to 325 a minute, the least invoked of the 35 round to no
    # request at all, and the top function takes about two thirds of them.
    assert len({r.function for r in workload.requests}) == 30
    assert set(workload.function_models) >= {r.function for r in workload.requests}
    minutes = Counter(int(r.arrival_s // 60) for r in workload.requests)
    assert minutes == {m: 325 for m in range(6)}
    top = Counter(r.function for r in workload.requests).most_common(1)[0][0]
    assert top == workload.top_function


def test_zipf_workload_spaces_calls_and_follows_the_popularity() -> None:
    workload = zipf_workload(calls=2000, models=4, zipf_exponent=1.1, memory_mb=100, gap_s=10.0, seed=7)
    assert [r.arrival_s for r in workload.requests[:3]] == [0.0, 10.0, 20.0]
    assert [p.model for p in workload.profiles] == ["m0", "m1", "m2", "m3"]
    assert all(p.memory_mb == 100 and p.load_time_s == 2.0 and p.inference_time_s == 1.0 for p in workload.profiles)
    counts = [sum(r.model == f"m{rank}" for r in workload.requests) for rank in range(4)]
    assert counts == sorted(counts, reverse=True)
    assert workload.top_function == "fn-m0" and workload.function_models["fn-m3"] == "m3"
    again = zipf_workload(calls=2000, models=4, zipf_exponent=1.1, memory_mb=100, gap_s=10.0, seed=7)
    assert again.requests == workload.requests
    with pytest.raises(InvalidInput, match="calls and models"):
        zipf_workload(calls=0, models=4, zipf_exponent=1.1, memory_mb=100, gap_s=10.0, seed=7)


def test_mapping_ends_is_the_default_and_a_seed_deals_the_same_models_otherwise() -> None:
    counts = load_trace(SHIPPED_TRACE, "azure2019")
    table = paper_table1()
    ends = build_workload(counts, WorkloadConfig(working_set=15), table)
    assert ends.mapping == "ends"
    assert build_workload(counts, WorkloadConfig(working_set=15, mapping_seed=None), table) == ends
    sizes = {p.model: p.memory_mb for p in ends.profiles}
    # "ends": the hottest function gets the smallest picked model, the next one the largest.
    assert sizes[ends.function_models[ends.top_function]] == min(sizes.values())

    shuffled = [build_workload(counts, WorkloadConfig(working_set=15, mapping_seed=k), table) for k in (1, 2)]
    for workload in shuffled:
        # Only the models move, not the calls.
        assert [(r.request_id, r.function, r.arrival_s) for r in workload.requests] == [
            (r.request_id, r.function, r.arrival_s) for r in ends.requests
        ]
        assert all(r.model == workload.function_models[r.function] for r in workload.requests)
        assert sorted(p.memory_mb for p in workload.profiles) == sorted(sizes.values())
        assert len(set(workload.function_models.values())) == 15  # still one model per function
    assert shuffled[0].mapping == "seed 1"
    assert shuffled[0].function_models != ends.function_models
    assert shuffled[0].function_models != shuffled[1].function_models
    again = build_workload(counts, WorkloadConfig(working_set=15, mapping_seed=1), table)
    assert again.function_models == shuffled[0].function_models
