"""Trace loading and workload building: Azure Functions traces in, a seeded list of Requests out.

A trace is reduced to per-minute invocation counts per function (`TraceCounts`), whichever format
it came in. `build_workload` then cuts a window of minutes out of it, keeps the `working_set` most
invoked functions, rescales every minute to exactly `rpm` requests (keeping the functions'
proportions within that minute) and spreads each request uniformly at random inside its minute.

Function -> model mapping. The Azure traces say nothing about models, so each working-set function
is given its own model with the figures of a Table I model, chosen so that sizes are spread evenly
over the table and popularity does not correlate with size:

1. Sort the table by `memory_mb` and pick `n` models (n = the number of working-set functions) at
   the evenly spaced indices `round(i * (len(table) - 1) / (n - 1))`, i = 0..n-1 (n = 1 picks
   index 0). With n = len(table) every model is picked once; with n > len(table) some repeat.
2. Deal the picked models to the functions in popularity order (rank 0 = most invoked),
   alternately from both ends: rank 0 gets the smallest picked, rank 1 the largest, rank 2 the
   second smallest, rank 3 the second largest, and so on. That is mapping "ends" (the default,
   `mapping_seed=None`). It hands the hottest function the smallest model, and a run's latency
   depends on that choice: with `mapping_seed=k` the same picked models are dealt in the order
   of random.Random(k).shuffle instead, so a report can give every figure over several mappings.
3. Every function gets its own model, i.e. a distinct cache item: it is named after the table
   model when that model was picked once, else `f"{name}#{k}"` with k = 1, 2, ... in rank order,
   and carries a copy of the table model's figures.

`zipf_workload` builds a synthetic workload instead: equal models, Zipf popularity, evenly spaced
calls (for cases a trace does not isolate, e.g. one call at a time).
"""

from __future__ import annotations

import csv
import math
import random
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import overload

from gpufaas.errors import InvalidInput
from gpufaas.functions import DEFAULT_TIMEOUT_S, MAX_TIMEOUT_S
from gpufaas.profiles import ModelProfile
from gpufaas.types import DEFAULT_BATCH_SIZE, Request

AZURE2019_KEY_COLUMNS = ("HashOwner", "HashApp", "HashFunction", "Trigger")
AZURE2021_COLUMNS = ("app", "func", "end_timestamp", "duration")
SECONDS_PER_MINUTE = 60
MAX_TRACE_MINUTES = 366 * 1440  # the longest span a per-invocation trace may cover
# The longest deadline a function may have: the paper's model, in which no call is dropped. The
# benchmarks that compare latencies give it to every call (`WorkloadConfig.timeout_s`): with the
# 60 s default a queued row loses calls to timeouts, and its latencies, over completed calls only,
# look better for it.
NO_DEADLINE_S = MAX_TIMEOUT_S


@dataclass(frozen=True)
class TraceCounts:
    """Invocations per function per minute, as read from one trace file."""

    path: Path
    minutes: list[int]
    """Every minute the trace covers, sorted ascending."""
    counts: dict[str, dict[int, int]]
    """Function id -> {minute: invocations}; minutes with zero invocations may be omitted."""


@dataclass(frozen=True)
class WorkloadConfig:
    """Which part of a trace to replay and how hard."""

    start_minute: int | None = None
    """First minute of the window; None = the trace's first minute."""
    minutes: int = 6
    working_set: int = 35
    """How many of the window's most invoked functions to keep."""
    rpm: int = 325
    """Requests generated for every minute of the window that has any invocation."""
    seed: int = 0
    mapping_seed: int | None = None
    """How the picked models are dealt to the functions: None = from both ends (the module
    docstring); an int = a random.Random(mapping_seed) shuffle."""
    slo_factor: float | None = None
    """Each function's SLO: this multiple of its model's inference time (None: no SLOs)."""
    timeout_s: float = DEFAULT_TIMEOUT_S
    """Every function's call deadline (FunctionSpec.timeout_s), from arrival."""


@dataclass(frozen=True)
class Workload:
    """The requests to replay and the models they need."""

    requests: Sequence[Request]
    """Sorted by arrival_s; request ids r000000, r000001, ... in that order. A trace's are drawn
    as they are iterated (`DrawnRequests`), so a run of millions of calls holds only a minute's."""
    profiles: list[ModelProfile]
    """One per working-set function, in popularity order: that function's own model."""
    function_models: dict[str, str]
    """Function id -> model name."""
    top_function: str
    """The most invoked function in the window."""
    start_minute: int
    minutes: int
    mapping: str = "ends"
    """How models were dealt to functions: "ends" (mapping_seed None) or "seed K"."""
    timeouts_s: Mapping[str, float] = field(default_factory=dict)
    """Function id -> its calls' deadline from arrival (FunctionSpec.timeout_s); a function absent
    from it has FunctionSpec's default. A call still waiting for a GPU then times out (the engine)."""

    def __post_init__(self) -> None:
        for function, timeout_s in self.timeouts_s.items():
            check_timeout_s(timeout_s, f"function {function!r}")

    def timeout_s(self, function: str) -> float:
        """The deadline of `function`'s calls, in seconds from arrival."""
        return self.timeouts_s.get(function, DEFAULT_TIMEOUT_S)


def check_timeout_s(timeout_s: float, what: str) -> None:
    """Raise InvalidInput unless `timeout_s` is one a function may have: in (0, MAX_TIMEOUT_S]."""
    if not 0 < timeout_s <= MAX_TIMEOUT_S:
        raise InvalidInput(f"{what}: timeout_s is {timeout_s}; expected seconds in (0, {MAX_TIMEOUT_S:g}]")


# ---------------------------------------------------------------------------------------------
# Loading


def _decoded_lines(path: Path, what: str) -> Iterator[str]:
    """Yield the lines of `path` decoded one at a time, so a decoding error knows its line."""
    try:
        handle = path.open("rb")
    except FileNotFoundError:
        raise InvalidInput(f"{path}: no such file; expected {what}") from None
    except OSError as exc:
        raise InvalidInput(f"{path}: cannot be read ({exc.strerror}); expected {what}") from exc
    with handle:
        line = 0
        try:
            for line, raw in enumerate(handle, start=1):
                yield raw.decode("utf-8-sig" if line == 1 else "utf-8")
        except UnicodeDecodeError as exc:
            raise InvalidInput(f"{path}:{line}: not UTF-8 text ({exc.reason}); expected {what}") from exc
        except OSError as exc:
            raise InvalidInput(f"{path}:{line + 1}: cannot be read ({exc.strerror}); expected {what}") from exc


def _rows(path: Path, what: str) -> Iterator[tuple[int, list[str]]]:
    """Yield (1-based line number, fields) for every non-blank CSV row of `path`.

    Every way reading can fail becomes an InvalidInput naming the file and the line, so the
    loaders only have to judge the values.
    """
    reader = csv.reader(_decoded_lines(path, what))
    try:
        for fields in reader:
            if fields:
                yield reader.line_num, fields
    except csv.Error as exc:
        raise InvalidInput(f"{path}:{reader.line_num}: malformed CSV ({exc}); expected {what}") from exc


def _header(rows: Iterator[tuple[int, list[str]]], path: Path, what: str) -> list[str]:
    first = next(rows, None)
    if first is None:
        raise InvalidInput(f"{path}:1: empty file; expected {what}")
    line, fields = first
    if line != 1:
        raise InvalidInput(f"{path}:1: line is blank; expected the header of {what}")
    return [field.strip() for field in fields]


def _count(text: str, path: Path, line: int, column: str) -> int:
    """Parse one per-minute count: a non-negative integer ("3.0" is accepted as 3)."""
    value = text.strip()
    try:
        count = int(value)
    except ValueError:
        try:
            number = float(value)
        except ValueError:
            number = math.nan
        count = int(number) if math.isfinite(number) and number.is_integer() else -1
    if count < 0:
        raise InvalidInput(f"{path}:{line}: minute {column} has count {text!r}; expected a non-negative integer")
    return count


def load_azure2019(path: Path) -> TraceCounts:
    """Load an Azure Functions 2019 per-minute invocation file.

    Header `HashOwner,HashApp,HashFunction,Trigger,<minute>,<minute>,...`, where the minute
    columns are distinct non-negative integers (they need not start at 1). The function id is
    `HashOwner/HashApp/HashFunction`; rows with the same id are summed.
    """
    what = "an Azure 2019 per-minute invocation CSV with header 'HashOwner,HashApp,HashFunction,Trigger,<minute>,...'"
    rows = _rows(path, what)
    header = _header(rows, path, what)
    key_count = len(AZURE2019_KEY_COLUMNS)
    if tuple(header[:key_count]) != AZURE2019_KEY_COLUMNS:
        raise InvalidInput(f"{path}:1: header starts with {','.join(header[:key_count])!r}; expected {what}")
    if len(header) == key_count:
        raise InvalidInput(f"{path}:1: header has no minute columns; expected {what}")
    minute_columns: list[int] = []
    for position, name in enumerate(header[key_count:], start=key_count + 1):
        try:
            minute = int(name)
        except ValueError:
            minute = -1
        if minute < 0:
            raise InvalidInput(
                f"{path}:1: column {position} is named {name!r}; expected a minute number (a non-negative integer)"
            )
        if minute in minute_columns:
            raise InvalidInput(f"{path}:1: minute column {minute} appears twice; expected each once")
        minute_columns.append(minute)

    counts: dict[str, dict[int, int]] = {}
    any_row = False
    for line, fields in rows:
        any_row = True
        if len(fields) != len(header):
            raise InvalidInput(
                f"{path}:{line}: row has {len(fields)} fields; expected {len(header)}, one per header column"
            )
        owner, app, function = (field.strip() for field in fields[:3])
        if not (owner and app and function):
            raise InvalidInput(f"{path}:{line}: empty HashOwner, HashApp or HashFunction; expected all three")
        per_minute = counts.setdefault(f"{owner}/{app}/{function}", {})
        for minute, text in zip(minute_columns, fields[key_count:], strict=True):
            count = _count(text, path, line, str(minute))
            if count:
                per_minute[minute] = per_minute.get(minute, 0) + count
    if not any_row:
        raise InvalidInput(f"{path}:2: no function rows after the header; expected at least one")
    return TraceCounts(path=path, minutes=sorted(minute_columns), counts=counts)


def _seconds(text: str, path: Path, line: int, column: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not math.isfinite(value) or value < 0:
        raise InvalidInput(f"{path}:{line}: {column} is {text!r}; expected a non-negative number of seconds")
    return value


def load_azure2021(path: Path) -> TraceCounts:
    """Load an Azure Functions 2021 per-invocation file and count invocations per minute.

    Header `app,func,end_timestamp,duration` (seconds; end_timestamp relative to the trace start;
    extra columns are ignored). An invocation arrives at end_timestamp - duration, clamped to 0,
    and counts in minute floor(arrival / 60). The function id is `app/func`. The trace covers every
    minute from the first invocation's to the last one's.
    """
    what = "an Azure 2021 per-invocation CSV with header 'app,func,end_timestamp,duration'"
    rows = _rows(path, what)
    header = _header(rows, path, what)
    missing = [name for name in AZURE2021_COLUMNS if name not in header]
    if missing:
        raise InvalidInput(f"{path}:1: header lacks column(s) {', '.join(missing)}; expected {what}")
    app_at, func_at, end_at, duration_at = (header.index(name) for name in AZURE2021_COLUMNS)

    counts: dict[str, dict[int, int]] = {}
    for line, fields in rows:
        if len(fields) != len(header):
            raise InvalidInput(
                f"{path}:{line}: row has {len(fields)} fields; expected {len(header)}, one per header column"
            )
        app, func = fields[app_at].strip(), fields[func_at].strip()
        if not (app and func):
            raise InvalidInput(f"{path}:{line}: empty app or func; expected both")
        end_s = _seconds(fields[end_at], path, line, "end_timestamp")
        duration_s = _seconds(fields[duration_at], path, line, "duration")
        minute = math.floor(max(end_s - duration_s, 0.0) / SECONDS_PER_MINUTE)
        per_minute = counts.setdefault(f"{app}/{func}", {})
        per_minute[minute] = per_minute.get(minute, 0) + 1
    if not counts:
        raise InvalidInput(f"{path}:2: no invocation rows after the header; expected at least one")
    seen = [minute for per_minute in counts.values() for minute in per_minute]
    if max(seen) - min(seen) > MAX_TRACE_MINUTES:  # (its minutes are listed one by one: 1e10 s, 1.7e8 of them)
        raise InvalidInput(
            f"{path}: its invocations span minutes {min(seen)} to {max(seen)}, more than {MAX_TRACE_MINUTES} "
            "(a year); expected one trace's rows, their end_timestamp in seconds"
        )
    return TraceCounts(path=path, minutes=list(range(min(seen), max(seen) + 1)), counts=counts)


TRACE_LOADERS: dict[str, Callable[[Path], TraceCounts]] = {
    "azure2019": load_azure2019,
    "azure2021": load_azure2021,
}


def load_trace(path: Path, trace_format: str) -> TraceCounts:
    """Load `path` with the loader registered for `trace_format`."""
    loader = TRACE_LOADERS.get(trace_format)
    if loader is None:
        raise InvalidInput(f"unknown trace format {trace_format!r}; expected one of: {', '.join(TRACE_LOADERS)}")
    return loader(path)


# ---------------------------------------------------------------------------------------------
# Building


def _describe_minutes(minutes: list[int]) -> str:
    if not minutes:
        return "no minutes"
    if minutes[-1] - minutes[0] + 1 == len(minutes):
        return f"minutes {minutes[0]}..{minutes[-1]}"
    return f"{len(minutes)} minutes between {minutes[0]} and {minutes[-1]}, with gaps"


def _largest_remainder(counts: list[int], total: int) -> list[int]:
    """Split `total` in proportion to `counts` (sum > 0); leftovers go to the largest remainders,
    ties to the earlier entry."""
    weight = sum(counts)
    shares = [count * total // weight for count in counts]
    remainders = [count * total % weight for count in counts]
    leftover = total - sum(shares)
    for index in sorted(range(len(counts)), key=lambda i: (-remainders[i], i))[:leftover]:
        shares[index] += 1
    return shares


def assign_models(
    functions: list[str], table: list[ModelProfile], mapping_seed: int | None = None
) -> list[ModelProfile]:
    """Give each function (in popularity order) its own model; see the module docstring."""
    if not table:
        raise InvalidInput("the model table is empty; expected at least one profile")
    by_size = sorted(table, key=lambda profile: (profile.memory_mb, profile.model))
    n = len(functions)
    # Evenly spaced indices over the sizes, exactly as the module docstring writes them.
    picked = [by_size[round(i * (len(by_size) - 1) / (n - 1)) if n > 1 else 0] for i in range(n)]
    dealt: list[ModelProfile] = []
    low, high = 0, n - 1
    for rank in range(n):
        if rank % 2 == 0:
            dealt.append(picked[low])
            low += 1
        else:
            dealt.append(picked[high])
            high -= 1
    if mapping_seed is not None:
        random.Random(mapping_seed).shuffle(dealt)
    uses: dict[str, int] = {}
    for profile in dealt:
        uses[profile.model] = uses.get(profile.model, 0) + 1
    seen: dict[str, int] = {}
    own: list[ModelProfile] = []
    for profile in dealt:
        name = profile.model
        if uses[name] > 1:
            seen[name] = seen.get(name, 0) + 1
            name = f"{name}#{seen[name]}"
        own.append(replace(profile, model=name))
    return own


def build_workload(trace: TraceCounts, config: WorkloadConfig, table: list[ModelProfile]) -> Workload:
    """Cut `config`'s window out of `trace` and turn it into seeded, rescaled requests.

    Window = [start, start + minutes). Working set = the `working_set` functions with the most
    invocations over the window (ties by function id, ascending; fewer if the window has fewer
    invoked functions). Every minute's working-set counts are scaled to exactly `rpm` requests by
    largest-remainder rounding (ties by rank); a minute with no working-set invocation yields
    none. Each request arrives at (minute - start) * 60 + uniform(0, 60) seconds, drawn from
    random.Random(seed) minute by minute, function by function in rank order.
    """
    window = _window(trace, config)
    functions = _working_set(trace, window, config.working_set)
    profiles = assign_models(functions, table, config.mapping_seed)
    function_models = {f: p.model for f, p in zip(functions, profiles, strict=True)}
    if config.slo_factor is not None and not config.slo_factor > 0:
        raise InvalidInput(f"workload slo_factor is {config.slo_factor}; expected a positive number")
    check_timeout_s(config.timeout_s, "workload")
    slos = [None if config.slo_factor is None else config.slo_factor * p.inference_time_s for p in profiles]
    shares = [
        (minute, _largest_remainder(counts, config.rpm))
        for minute in window
        if sum(counts := [trace.counts[f].get(minute, 0) for f in functions])
    ]
    templates = [
        (function, profile.model, profile.batch_size, slo_s)
        for function, profile, slo_s in zip(functions, profiles, slos, strict=True)
    ]
    return Workload(
        requests=DrawnRequests(shares, templates, window.start, config.seed),
        profiles=profiles,
        function_models=function_models,
        top_function=functions[0],
        start_minute=window.start,
        minutes=config.minutes,
        mapping="ends" if config.mapping_seed is None else f"seed {config.mapping_seed}",
        timeouts_s=dict.fromkeys(functions, config.timeout_s),
    )


def _window(trace: TraceCounts, config: WorkloadConfig) -> range:
    """The minutes `config` cuts out of `trace`; InvalidInput for a non-positive size or a
    window not wholly inside the trace."""
    for name, value in (
        ("minutes", config.minutes),
        ("working_set", config.working_set),
        ("rpm", config.rpm),
    ):
        if value <= 0:
            raise InvalidInput(f"workload {name} is {value}; expected a positive integer")
    if not trace.minutes:
        raise InvalidInput(f"{trace.path}: the trace has no minutes; expected at least one")
    start = trace.minutes[0] if config.start_minute is None else config.start_minute
    window = range(start, start + config.minutes)
    available = set(trace.minutes)
    if any(minute not in available for minute in window):
        raise InvalidInput(
            f"{trace.path}: window minutes {window[0]}..{window[-1]} are not all in the trace, "
            f"which has {_describe_minutes(trace.minutes)}; expected a window inside it"
        )
    return window


def _working_set(trace: TraceCounts, window: range, size: int) -> list[str]:
    """The `size` functions invoked most over `window`, most first (ties by function id);
    InvalidInput when none is invoked in it."""
    totals = {
        function: sum(per_minute.get(minute, 0) for minute in window) for function, per_minute in trace.counts.items()
    }
    ranked = sorted((f for f, total in totals.items() if total > 0), key=lambda f: (-totals[f], f))
    functions = ranked[:size]
    if not functions:
        raise InvalidInput(
            f"{trace.path}: no invocations in window minutes {window[0]}..{window[-1]}; "
            "expected a window with at least one"
        )
    return functions


class DrawnRequests(Sequence[Request]):
    """A trace window's requests, drawn when iterated: each minute's `shares` (requests per function
    rank) arrive uniform at random in that minute, from random.Random(seed) minute by minute,
    function by function in rank order, sorted by (arrival, rank) within the minute; request ids
    r000000, r000001, ... in arrival order. Minutes do not overlap, so this is the order of the
    whole window sorted at once. Iterating holds one minute's requests; every iteration draws the
    same ones. Indexing materializes the whole list once (for small windows and tests)."""

    def __init__(
        self,
        shares: list[tuple[int, list[int]]],
        templates: list[tuple[str, str, int, float | None]],
        start_minute: int,
        seed: int,
    ) -> None:
        self._shares = shares
        self._templates = templates  # per rank: (function, model, batch size, SLO)
        self._start_minute = start_minute
        self._seed = seed
        self._count = sum(sum(per_rank) for _, per_rank in shares)
        self._list: list[Request] | None = None

    def __len__(self) -> int:
        return self._count

    def __iter__(self) -> Iterator[Request]:
        if self._list is not None:
            yield from self._list
            return
        # rng.uniform(0, SECONDS_PER_MINUTE) is 0 + SECONDS_PER_MINUTE * rng.random(): the same
        # double, without a Python-level call per request.
        draw, templates, index = random.Random(self._seed).random, self._templates, 0
        for minute, per_rank in self._shares:
            offset_s = float((minute - self._start_minute) * SECONDS_PER_MINUTE)
            # Keep the arrival inside its minute even if the float addition rounds up to its end.
            last_s = math.nextafter(offset_s + SECONDS_PER_MINUTE, -math.inf)
            drawn = [
                (min(offset_s + SECONDS_PER_MINUTE * draw(), last_s), rank)
                for rank, share in enumerate(per_rank)
                for _ in range(share)
            ]
            drawn.sort()
            for arrival_s, rank in drawn:
                function, model, batch_size, slo_s = templates[rank]
                yield Request(f"r{index:06d}", function, model, arrival_s, batch_size, slo_s=slo_s)
                index += 1

    def __eq__(self, other: object) -> bool:
        """Equal to any sequence of the same requests in the same order (a list included)."""
        if not isinstance(other, Sequence) or isinstance(other, str):
            return NotImplemented
        return len(self) == len(other) and all(a == b for a, b in zip(self, other, strict=True))

    __hash__ = None  # type: ignore[assignment]  # equal to lists, which have none

    @overload
    def __getitem__(self, index: int) -> Request: ...
    @overload
    def __getitem__(self, index: slice) -> list[Request]: ...
    def __getitem__(self, index: int | slice) -> Request | list[Request]:
        if self._list is None:
            self._list = list(iter(self))
        return self._list[index]


def zipf_workload(
    *,
    calls: int,
    models: int,
    zipf_exponent: float,
    memory_mb: int,
    gap_s: float,
    seed: int,
    load_time_s: float = 2.0,
    inference_time_s: float = 1.0,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> Workload:
    """`calls` requests `gap_s` apart (the first at 0), each for one of `models` equal models
    m0, m1, ... (function fn-<model>), model of rank r drawn with weight 1 / r**zipf_exponent from
    random.Random(seed). Every model takes `memory_mb`, loads in `load_time_s` and runs a call of
    DEFAULT_BATCH_SIZE samples in `inference_time_s`. With `gap_s` above load + inference time,
    each call arrives after the previous one completed: one call at a time. Every function's calls
    have a deadline of `timeout_s` from arrival."""
    if calls <= 0 or models <= 0:
        raise InvalidInput(f"a Zipf workload needs calls and models, got {calls} calls and {models} models")
    names = [f"m{rank}" for rank in range(models)]
    weights = [1.0 / (rank**zipf_exponent) for rank in range(1, models + 1)]
    drawn = random.Random(seed).choices(names, weights, k=calls)
    return Workload(
        requests=[
            Request(f"r{index:06d}", f"fn-{name}", name, index * gap_s, DEFAULT_BATCH_SIZE)
            for index, name in enumerate(drawn)
        ],
        profiles=[
            ModelProfile(name, "rtx2080", memory_mb, load_time_s, inference_time_s, DEFAULT_BATCH_SIZE)
            for name in names
        ],
        function_models={f"fn-{name}": name for name in names},
        top_function="fn-m0",
        start_minute=0,
        minutes=max(1, math.ceil(calls * gap_s / SECONDS_PER_MINUTE)),
        timeouts_s=dict.fromkeys((f"fn-{name}" for name in names), timeout_s),
    )
