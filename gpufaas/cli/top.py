"""`gpufaas top`'s frame: one rendering of the gateway's /system/overview, pure (no I/O, no clock).

The overview is read as a loosely typed JSON document: a key an older or newer gateway leaves
out, or a value of an unexpected type, shows as '-' (or an empty table) instead of failing, so
the view keeps working across gateway versions. What the gateway reports is shown as text, never
read as Rich markup (a node's name is its operator's choice). Model names (`function@digest`) are shown as the
function part alone where that names one model in the whole frame, and in full where two models
share it (two versions of one function), so a short name always means the same model.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from datetime import UTC, datetime
from typing import Any

from rich import box
from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

MEMORY_BAR_CELLS = 12
MAX_LRU_SHOWN = 6  # a long LRU list would wrap every row; its head is what the next call reuses
MAX_QUEUED_SHOWN = 5
MAX_EVICTIONS_SHOWN = 8
LAST_PRINTABLE_UNIX_S = 253_402_300_800.0  # 10000-01-01: datetime's range ends there


def render(
    overview: Mapping[str, Any], *, gateway_url: str, now_unix_s: float, problem: str | None = None
) -> RenderableType:
    """The whole frame: header, GPUs, functions, global queue, recent evictions.

    `now_unix_s` is the CLI's clock; it is used only when the overview carries no `time_unix_s`,
    because eviction ages are differences of gateway timestamps and must not include the skew
    between the two machines' clocks. `problem` (e.g. the last refresh failed) is shown in red
    under the header, above the last good overview."""
    gpus = [g for g in _list(overview.get("gpus")) if isinstance(g, Mapping)]
    functions = [f for f in _list(overview.get("functions")) if isinstance(f, Mapping)]
    queue = overview.get("queue")
    queue = queue if isinstance(queue, Mapping) else {}
    evictions = [e for e in _list(overview.get("evictions")) if isinstance(e, Mapping)]
    overview_time_s = _unix_time(overview.get("time_unix_s"))
    frame_time_s = overview_time_s if overview_time_s is not None else now_unix_s
    names = short_model_names(_models_in(gpus, functions, queue, evictions))

    parts: list[RenderableType] = [
        _header(overview, gpus, functions, queue, gateway_url=gateway_url, frame_time_s=frame_time_s)
    ]
    if problem:
        parts.append(Text(problem, style="bold red"))
    if not gpus and not functions:
        parts.append(
            Text(
                "The cluster is empty: no GPU has registered and no function is deployed. Start one with "
                "`gpufaas up`, deploy with `gpufaas deploy -f stack.yml`; `gpufaas logs scheduler` says why a "
                "GPU manager is missing.",
                style="yellow",
            )
        )
    else:
        parts.append(
            _gpu_table(gpus, names) if gpus else Text("No GPUs registered (is a GPU manager running?)", style="yellow")
        )
        parts.append(
            _function_table(functions)
            if functions
            else Text("No functions deployed (`gpufaas deploy -f stack.yml`).", style="yellow")
        )
    parts.append(_queue_view(queue, names))
    parts.append(_eviction_view(evictions, names, frame_time_s))
    return Group(*parts)


def short_model_names(models: Iterable[str]) -> dict[str, str]:
    """Each model's display name: the part before '@' where no other model shares it, else the whole."""
    distinct = set(models)
    bases = Counter(model.split("@", 1)[0] for model in distinct)
    return {model: (base if bases[base] == 1 else model) for model in distinct for base in [model.split("@", 1)[0]]}


def natural_key(text: str) -> tuple[tuple[int, int | str], ...]:
    """Sort key that puts node-2/1 before node-10/0 (digit runs compare as numbers)."""
    # isdecimal, not isdigit: '²' is a digit to isdigit but not to int() (nor to the regex).
    return tuple((0, int(part)) if part.isdecimal() else (1, part) for part in re.split(r"(\d+)", text) if part)


def hit_ratio_text(hits: float | None, misses: float | None) -> str:
    """Hits over hits plus misses as a percentage, '-' before the first call."""
    if hits is None or misses is None or hits + misses <= 0:
        return "-"
    return _percent(hits / (hits + misses))


def memory_bar(used_mb: float | None, capacity_mb: float | None, *, cells: int = MEMORY_BAR_CELLS) -> Text:
    """A text bar of the GPU memory the cached models take, then 'used/capacity MB'."""
    if used_mb is None or capacity_mb is None:
        return Text("-")
    fraction = used_mb / capacity_mb if capacity_mb > 0 else 0.0
    filled = round(min(max(fraction, 0.0), 1.0) * cells)
    style = "red" if fraction > 0.9 else "yellow" if fraction > 0.7 else "green"
    bar = Text()  # styled piece by piece: a Text's own style would colour the figures too
    bar.append("█" * filled, style=style)
    bar.append("░" * (cells - filled), style="dim")
    bar.append(f" {_int_text(used_mb)}/{_int_text(capacity_mb)} MB")
    return bar


def age_text(seconds: float) -> str:
    """How long ago, for a person: '4.2 s ago', '35 s ago', '3 min ago', '2.0 h ago'."""
    seconds = max(seconds, 0.0)  # a gateway timestamp a little ahead of its own overview time
    if seconds < 10:
        return f"{seconds:.1f} s ago"
    if seconds < 120:
        return f"{seconds:.0f} s ago"
    if seconds < 7200:
        return f"{seconds / 60:.0f} min ago"
    return f"{seconds / 3600:.1f} h ago"


def _header(
    overview: Mapping[str, Any],
    gpus: Sequence[Mapping[str, Any]],
    functions: Sequence[Mapping[str, Any]],
    queue: Mapping[str, Any],
    *,
    gateway_url: str,
    frame_time_s: float,
) -> Text:
    stamp = datetime.fromtimestamp(frame_time_s, tz=UTC).strftime("%Y-%m-%d %H:%M:%S UTC")
    busy = sum(1 for g in gpus if g.get("status") == "busy")
    # No functions: nothing has been called (0), not an unknown count ('-').
    calls = _sum(f.get("calls") for f in functions) if functions else 0.0
    hits = _sum(f.get("hits") for f in functions)
    misses = _sum(f.get("misses") for f in functions)
    header = Text()
    header.append("gpufaas top", style="bold")
    header.append(f"  {gateway_url}  policy {_text(overview.get('policy'))}  {stamp}\n")
    header.append(f"GPUs {len(gpus)} ({busy} busy)  functions {len(functions)}  calls {_int_text(calls)}  ")
    header.append(f"hit ratio {hit_ratio_text(hits, misses)}  queue {_queue_fill(queue)}")
    return header


def _gpu_table(gpus: Sequence[Mapping[str, Any]], names: Mapping[str, str]) -> Group:
    table = _table()
    for column in ("GPU", "type", "status", "memory", "running"):
        table.add_column(column, no_wrap=True)
    table.add_column("queued", justify="right", no_wrap=True)
    table.add_column("LRU (newest first)")
    table.add_column("host tier")
    for gpu in sorted(gpus, key=lambda g: natural_key(_text(g.get("gpu")))):
        status = _text(gpu.get("status"))
        _add_row(
            table,
            _text(gpu.get("gpu")),
            _text(gpu.get("gpu_type")),
            Text(status, style={"idle": "green", "busy": "yellow"}.get(status, "red")),
            memory_bar(_number(gpu.get("memory_used_mb")), _number(gpu.get("memory_capacity_mb"))),
            _running_text(_strings(gpu.get("running")), _number(gpu.get("slots")), names),
            _int_text(_number(gpu.get("local_queue"))),
            _model_list(_strings(gpu.get("lru")), names, limit=MAX_LRU_SHOWN),
            _model_list(_strings(gpu.get("host_tier")), names, limit=MAX_LRU_SHOWN),
        )
    return _section("GPUs", table)


def _function_table(functions: Sequence[Mapping[str, Any]]) -> Group:
    table = _table()
    table.add_column("function", no_wrap=True)
    for column in ("replicas", "calls", "hit %", "p50 ms", "p95 ms", "p99 ms", "errors"):
        table.add_column(column, justify="right")
    # The busiest first: that is where a change in hit ratio or latency matters.
    ordered = sorted(functions, key=lambda f: (-(_number(f.get("calls")) or 0), _text(f.get("name"))))
    for function in ordered:
        latency = function.get("latency_ms")
        latency = latency if isinstance(latency, Mapping) else {}
        ratio = _number(function.get("hit_ratio"))
        errors = _number(function.get("errors"))
        _add_row(
            table,
            _text(function.get("name")),
            _int_text(_number(function.get("replicas"))),
            _int_text(_number(function.get("calls"))),
            _percent(ratio, suffix="") if ratio is not None else "-",
            *(_ms_text(_number(latency.get(p))) for p in ("p50", "p95", "p99")),
            Text(_int_text(errors), style="red" if errors else ""),
        )
    return _section("Functions (busiest first)", table)


def _queue_view(queue: Mapping[str, Any], names: Mapping[str, str]) -> RenderableType:
    calls = [c for c in _list(queue.get("calls")) if isinstance(c, Mapping)]
    title = f"Global queue {_queue_fill(queue)}"
    if not calls:
        return _section(f"{title}: empty" if _number(queue.get("length")) == 0 else title)
    table = _table()
    table.add_column("function")
    table.add_column("model")
    table.add_column("waited s", justify="right")
    oldest = sorted(calls, key=lambda c: -(_number(c.get("waited_s")) or 0.0))
    for call in oldest[:MAX_QUEUED_SHOWN]:
        waited_s = _number(call.get("waited_s"))
        model = _text(call.get("model"))
        _add_row(
            table,
            _text(call.get("function")),
            names.get(model, model),
            f"{waited_s:.2f}" if waited_s is not None else "-",
        )
    length = _number(queue.get("length"))
    shown = min(len(calls), MAX_QUEUED_SHOWN)
    more = f", the {shown} oldest shown" if length is not None and length > shown else ""
    return _section(f"{title}{more}", table)


def _eviction_view(
    evictions: Sequence[Mapping[str, Any]], names: Mapping[str, str], frame_time_s: float
) -> RenderableType:
    if not evictions:
        return _section("Recent evictions: none")
    table = _table()
    for column in ("when", "GPU", "model", "reason"):
        table.add_column(column)
    for eviction in evictions[:MAX_EVICTIONS_SHOWN]:
        at_s = _number(eviction.get("time_unix_s"))
        model = _text(eviction.get("model"))
        _add_row(
            table,
            age_text(frame_time_s - at_s) if at_s is not None else "-",
            _text(eviction.get("gpu")),
            names.get(model, model),
            _text(eviction.get("reason")),
        )
    return _section("Recent evictions (most recent first)", table)


def _table() -> Table:
    # Compact (no outer frame) so a terminal holds more rows.
    return Table(box=box.SIMPLE_HEAD, expand=False, pad_edge=False, show_edge=False)


def _add_row(table: Table, *cells: str | Text) -> None:
    # A str cell would be read as markup: '[/b]' in a name fails the frame, '[bold]' vanishes.
    table.add_row(*(Text(cell) if isinstance(cell, str) else cell for cell in cells))


def _section(title: str, body: RenderableType | None = None) -> Group:
    # A title of its own line, not the table's: a table's title wraps at the table's width.
    heading = Text("\n" + title, style="bold")
    return Group(heading, body) if body is not None else Group(heading)


def _models_in(
    gpus: Sequence[Mapping[str, Any]],
    functions: Sequence[Mapping[str, Any]],
    queue: Mapping[str, Any],
    evictions: Sequence[Mapping[str, Any]],
) -> list[str]:
    models = [f.get("model") for f in functions]
    models += [c.get("model") for c in _list(queue.get("calls")) if isinstance(c, Mapping)]
    models += [e.get("model") for e in evictions]
    out = [m for m in models if isinstance(m, str)]
    for gpu in gpus:
        for key in ("lru", "running", "host_tier"):
            out += _strings(gpu.get(key))
    return out


def _running_text(running: Sequence[str], slots: float | None, names: Mapping[str, str]) -> str:
    count = f"{len(running)}/{_int_text(slots)}"
    if not running:
        return count
    # One model may run in several slots at once (a replica per slot, or a batch each).
    tally = Counter(names.get(model, model) for model in running)
    models = ", ".join(name if n == 1 else f"{name} x{n}" for name, n in tally.items())
    return f"{count} {models}"


def _model_list(models: Sequence[str], names: Mapping[str, str], *, limit: int) -> str:
    if not models:
        return "-"
    shown = ", ".join(names.get(model, model) for model in models[:limit])
    return shown + (f" +{len(models) - limit} more" if len(models) > limit else "")


def _queue_fill(queue: Mapping[str, Any]) -> str:
    capacity = _number(queue.get("capacity"))
    length = _int_text(_number(queue.get("length")))
    return f"{length}/{_int_text(capacity)}" if capacity is not None else length


def _percent(ratio: float, *, suffix: str = "%") -> str:
    return f"{ratio * 100:.1f}{suffix}"


def _ms_text(value_ms: float | None) -> str:
    return "-" if value_ms is None else f"{value_ms:.1f}"


def _int_text(value: float | None) -> str:
    return "-" if value is None else f"{value:.0f}"


def _number(value: object) -> float | None:
    """A JSON number as a finite float; anything else (null, a string, a bool, absent, and the
    NaN and infinities Python's json reads) as None."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    number = float(value)
    return number if math.isfinite(number) else None


def _unix_time(value: object) -> float | None:
    """`_number`, where it is a time the frame can print (years 1970 to 9999); else None."""
    number = _number(value)
    return number if number is not None and 0 <= number < LAST_PRINTABLE_UNIX_S else None


def _sum(values: Iterable[object]) -> float | None:
    numbers = [n for n in (_number(v) for v in values) if n is not None]
    return sum(numbers) if numbers else None


def _list(value: object) -> list[Any]:
    return value if isinstance(value, list) else []


def _strings(value: object) -> list[str]:
    return [item for item in _list(value) if isinstance(item, str)]


def _text(value: object) -> str:
    return "-" if value is None or value == "" else str(value)
