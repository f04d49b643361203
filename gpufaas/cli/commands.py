"""The `gpufaas` command line: the user's entry point (a local cluster: up, down, status; functions: new,
deploy, invoke, ls, describe, rm; the cluster: gpus, top, logs; login, logout; sim, the simulator)."""

from __future__ import annotations

import contextlib
import enum
import json
import os
import sys
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import httpx
import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from gpufaas.credentials import ADMIN_USER, basic_authorization
from gpufaas.errors import GpufaasError

if TYPE_CHECKING:
    from scheduler.policies import PolicyConfig
    from scheduler.settings import SchedulerSettings
    from simulator.engine import Batching, ClusterConfig, SimResult
    from simulator.report import Aggregate
    from simulator.workload import Workload

app = typer.Typer(
    name="gpufaas",
    help="gpufaas: GPU-enabled Function-as-a-Service for ML inference.",
    no_args_is_help=True,
    add_completion=False,
    pretty_exceptions_enable=False,
)
err_console = Console(stderr=True, soft_wrap=True)
console = Console(soft_wrap=True)  # messages: never wrapped mid-sentence when piped


@app.callback()
def _root() -> None:
    """gpufaas: GPU-enabled Function-as-a-Service for ML inference."""


class TraceFormat(enum.StrEnum):
    azure2019 = "azure2019"
    azure2021 = "azure2021"


def _int_list(value: str, flag: str, *, minimum: int) -> list[int]:
    try:
        numbers = [int(part) for part in value.split(",") if part.strip()]
    except ValueError:
        raise typer.BadParameter(f"expected comma-separated whole numbers, got {value!r}", param_hint=flag) from None
    if not numbers or any(n < minimum for n in numbers):
        raise typer.BadParameter(f"every value must be >= {minimum}, got {value!r}", param_hint=flag)
    return numbers


@app.command()
def sim(
    trace: Annotated[
        Path | None,
        typer.Option(help="Trace file. Default: the Azure Functions 2019 extract shipped with gpufaas."),
    ] = None,
    trace_format: Annotated[TraceFormat, typer.Option(help="Trace file format.")] = TraceFormat.azure2019,
    policy: Annotated[
        str, typer.Option(help="Scheduling policy: lb, lalb, lalb-o3, mqfq-sticky or torpor.")
    ] = "lalb-o3",
    o3_limit: Annotated[
        int, typer.Option(min=0, help="lalb-o3 and mqfq-sticky: how often a request may be passed over.")
    ] = 25,
    gpus: Annotated[int, typer.Option(min=1, help="Number of simulated GPUs.")] = 12,
    gpu_memory_mb: Annotated[int, typer.Option(min=1, help="Cache capacity of each GPU (MB).")] = 8192,
    working_set: Annotated[
        str, typer.Option(help="Most invoked functions to keep; a comma list (15,25,35) runs each.")
    ] = "35",
    start_minute: Annotated[int | None, typer.Option(help="First trace minute of the window.")] = None,
    minutes: Annotated[int, typer.Option(min=1, help="Length of the window in minutes.")] = 6,
    rpm: Annotated[int, typer.Option(min=1, help="Requests per minute after scaling.")] = 325,
    seed: Annotated[int, typer.Option(help="Seed for arrival times inside each minute.")] = 0,
    json_output: Annotated[bool, typer.Option("--json", help="Print JSON instead of a table.")] = False,
    compare: Annotated[bool, typer.Option(help="Run every policy on the same workload.")] = False,
    plot: Annotated[
        Path | None, typer.Option(help="Write the paper's figures (4-6 with --compare, 7 with --sweep-o3) to a PNG.")
    ] = None,
    literal_misses: Annotated[
        bool,
        typer.Option(
            help="Algorithm 2 to the letter: a miss loads on the GPU being filled even if another idle GPU has room."
        ),
    ] = False,
    coldest_victim: Annotated[
        bool,
        typer.Option(
            help="A miss that must evict goes to the idle GPU whose victim is least recently used "
            "(else to the GPU being filled). Off with --literal-misses."
        ),
    ] = True,
    literal_visits: Annotated[
        bool,
        typer.Option(
            help="Algorithm 1's visit counting to the letter: every request a scan passes counts a visit, and "
            "one is forced when its visits are higher than the limit (default: a skip counts only when a younger "
            "request is dispatched ahead, and the limit is reached at >=)."
        ),
    ] = False,
    mqfq_overrun_s: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="mqfq-sticky: T, seconds of service a flow may run ahead of the slowest before it is throttled.",
        ),
    ] = 10.0,
    mqfq_ttl_alpha: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="mqfq-sticky: a flow's keep-alive, in mean inter-arrival times (with --mqfq-swap-out, past "
            "it its model leaves GPU memory for the host tier).",
        ),
    ] = 1.5,
    mqfq_swap_out: Annotated[
        bool,
        typer.Option(
            help="mqfq-sticky: swap a flow's model out to its node's host tier (--host-memory-mb) once the flow "
            "is past its keep-alive (the paper's proactive memory management)."
        ),
    ] = False,
    torpor_alpha_period_s: Annotated[
        float,
        typer.Option(
            min=0.0,
            help="torpor: retune alpha this often by Torpor's Algorithm 2, from the share of functions within "
            "their SLO (default 0: alpha fixed at 0.5).",
        ),
    ] = 0.0,
    slots: Annotated[int, typer.Option(min=1, help="D: calls each GPU runs at once.")] = 1,
    adaptive_slots: Annotated[
        int | None,
        typer.Option(
            min=1,
            help="Adaptive D (MQFQ-Sticky's): each GPU's D moves between 1 and this from its utilization every "
            "200 ms, starting at --slots (use with --interference).",
        ),
    ] = None,
    utilization_threshold: Annotated[
        float, typer.Option(min=0.01, max=1.0, help="Adaptive D: above this share of time busy D steps down.")
    ] = 0.9,
    max_batch_size: Annotated[
        int, typer.Option(min=1, help="Calls of one model a worker may merge into one batch (needs --slots > 1).")
    ] = 1,
    max_batch_wait_ms: Annotated[
        float, typer.Option(min=0.0, help="How long a free worker with fewer calls than a batch waits for more.")
    ] = 0.0,
    batch_exponent: Annotated[
        float,
        typer.Option(help="A batch of k calls takes k**EXPONENT times one call's time (1: batching gains nothing)."),
    ] = 1.0,
    sweep_o3: Annotated[
        str | None, typer.Option(help="Run lalb-o3 at each of these limits (e.g. 0,5,10,...,45): Figure 7.")
    ] = None,
    mappings: Annotated[
        str,
        typer.Option(
            help="How models are dealt to functions: 'ends' (hottest gets the smallest, then the largest, ...) "
            "and/or seeds of a shuffle, comma-separated (e.g. ends,1,2,3). Several: every figure as mean ± sd."
        ),
    ] = "ends",
    host_memory_mb: Annotated[
        int,
        typer.Option(
            min=0,
            help="Each node's host tier (Torpor): models its GPUs evict stay in host memory up to this much, and a "
            "miss takes them back by a host-to-GPU copy instead of a load (0: none, the paper's testbed).",
        ),
    ] = 0,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="GPUs per node (they share its host tier).")] = 4,
    gpu_idle_release_s: Annotated[
        float | None,
        typer.Option(min=0.0, help="EDAS staged exit: a model unused this long leaves its GPU (for the host tier)."),
    ] = None,
    host_idle_release_s: Annotated[
        float | None,
        typer.Option(min=0.0, help="EDAS staged exit: a model this long in a host tier leaves it."),
    ] = None,
    eviction: Annotated[
        str,
        typer.Option(
            help="Which models a miss evicts: lru (the paper's), heaviness (Torpor's: replicated models first, "
            "then light before heavy, LRU within) or tinylfu (the least used lately, after TinyLFU)."
        ),
    ] = "lru",
    host_to_gpu_mb_s: Annotated[
        float, typer.Option(min=1.0, help="Host-to-GPU copy bandwidth of a swap-in (MB/s).")
    ] = 10_000.0,
    gpus_per_link: Annotated[
        int,
        typer.Option(
            min=0,
            help="The transfer-bandwidth model: a node's GPUs sit behind shared host links (PCIe switches) of this "
            "many GPUs each, and concurrent loads share their bandwidth (0: off, every load takes its fixed time).",
        ),
    ] = 0,
    link_mb_s: Annotated[
        float | None,
        typer.Option(
            min=1.0, help="With --gpus-per-link: a shared link's bandwidth (MB/s; default --host-to-gpu-mb-s)."
        ),
    ] = None,
    interference_aware: Annotated[
        bool,
        typer.Option(
            help="A miss prefers an idle GPU whose shared host link carries no load in flight (Torpor's "
            "interference-aware placement; in effect with --gpus-per-link)."
        ),
    ] = True,
    slo_factor: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            help="Give every function an SLO of this multiple of its model's inference time (torpor orders by "
            "it; every policy reports SLO attainment). Default: no SLOs.",
        ),
    ] = None,
    timing_spread: Annotated[
        float,
        typer.Option(
            min=0.0,
            max=10.0,
            help="Noise on every load and batch time: coefficient of variation of a mean-1 log-normal factor "
            "(0: the profile exactly, so every estimate is exact). Drawn from --seed.",
        ),
    ] = 0.0,
    interference: Annotated[
        float | None,
        typer.Option(
            min=0.0,
            max=100.0,
            help="With --slots > 1: the calls on a GPU run at once, each slowed down by 1 + I x (others running) "
            "(0: no interference; 1: no gain over one at a time). Default: one batch at a time.",
        ),
    ] = None,
) -> None:
    """Replay a function trace through the real scheduler and cache manager on a virtual clock."""
    from scheduler.policies import PolicyConfig
    from simulator.engine import Batching, ClusterConfig
    from simulator.report import build_workloads, compare_policies, plot_policies, plot_sweep, shipped_trace
    from simulator.workload import WorkloadConfig, load_trace

    working_sets, mapping_seeds, limits = _sim_checked(
        working_set, mappings, sweep_o3, compare=compare, plot=plot, policy=policy, eviction=eviction
    )
    if not batch_exponent > 0:  # NaN too
        raise typer.BadParameter(f"must be positive, got {batch_exponent}", param_hint="--batch-exponent")
    cluster = ClusterConfig(
        gpus=gpus,
        gpu_memory_mb=gpu_memory_mb,
        slots=slots,
        batch_exponent=batch_exponent,
        timing_spread=timing_spread,
        timing_seed=seed,
        gpus_per_node=gpus_per_node,
        host_memory_mb=host_memory_mb,
        eviction=eviction,
        gpu_idle_release_s=gpu_idle_release_s,
        host_idle_release_s=host_idle_release_s,
        host_to_gpu_mb_s=host_to_gpu_mb_s,
        gpus_per_link=gpus_per_link,
        link_mb_s=link_mb_s,
        interference=interference,
        adaptive_slots=adaptive_slots,
        utilization_threshold=utilization_threshold,
    )
    # The policy's knobs as the real scheduler takes them (python -m scheduler, gpufaas up).
    config = PolicyConfig(
        max_num_skips=o3_limit,
        room_aware_misses=not literal_misses,
        coldest_victim_misses=coldest_victim,
        literal_visits=literal_visits,
        mqfq_overrun_s=mqfq_overrun_s,
        mqfq_ttl_alpha=mqfq_ttl_alpha,
        mqfq_swap_out=mqfq_swap_out,
        torpor_alpha_period_s=torpor_alpha_period_s or None,
        interference_aware_loads=interference_aware,
    )
    policies = compare_policies() if compare or plot is not None else [policy]
    workload_config = WorkloadConfig(
        start_minute=start_minute, minutes=minutes, rpm=rpm, seed=seed, slo_factor=slo_factor
    )
    with _user_errors():
        trace_path = trace if trace is not None else shipped_trace()
        counts = load_trace(trace_path, trace_format.value)
        workloads = build_workloads(counts, working_sets, workload_config, mapping_seeds)
        batching = Batching(max_batch_size, max_batch_wait_ms) if max_batch_size > 1 else None
        runs = (working_sets, policies, limits, mapping_seeds)
        results = _sim_execute(workloads, runs, cluster, config, batching, progress=not json_output)
        if plot is not None:
            (plot_sweep if limits is not None else plot_policies)(results, plot)
    first = next(iter(workloads.values()))
    window = {"start_minute": first.start_minute, "minutes": first.minutes, "rpm": rpm, "seed": seed}
    meta: dict[str, object] = {"trace": str(trace_path), "trace_format": trace_format.value, **window}
    meta.update(_sim_cluster_meta(cluster, results, slo_factor))
    _sim_output(results, meta, grouped=len(mapping_seeds) > 1, json_output=json_output, plot=plot)


def _sim_checked(
    working_set: str,
    mappings: str,
    sweep_o3: str | None,
    *,
    compare: bool,
    plot: Path | None,
    policy: str,
    eviction: str,
) -> tuple[list[int], list[int | None], list[int] | None]:
    """`gpufaas sim`'s options that go together, checked: (working sets, mapping seeds, the o3
    limits of a sweep or None)."""
    from scheduler import make_policy

    working_sets = _int_list(working_set, "--working-set", minimum=1)
    mapping_seeds = _mapping_list(mappings)
    if plot is not None and len(mapping_seeds) > 1:
        raise typer.BadParameter("--plot draws one mapping; pass one --mappings value with it", param_hint="--plot")
    limits = _int_list(sweep_o3, "--sweep-o3", minimum=0) if sweep_o3 is not None else None
    if limits is not None and compare:
        raise typer.BadParameter("use either --compare or --sweep-o3, not both", param_hint="--sweep-o3")
    try:
        make_policy(policy)
    except GpufaasError as exc:
        raise typer.BadParameter(str(exc), param_hint="--policy") from None
    _check_eviction(eviction)
    if plot is not None and plot.suffix.lower() != ".png":
        raise typer.BadParameter(f"the plot is written as PNG; name it *.png, got {plot}", param_hint="--plot")
    return working_sets, mapping_seeds, limits


def _sim_execute(
    workloads: dict[tuple[int, int | None], Workload],
    plan: tuple[list[int], list[str], list[int] | None, list[int | None]],
    cluster: ClusterConfig,
    config: PolicyConfig,
    batching: Batching | None,
    *,
    progress: bool,
) -> list[SimResult]:
    """Every run of `plan` (working sets, policies, the o3 limits of a sweep or None, mapping
    seeds: each policy, or lalb-o3 at each limit, per working set and mapping) with the policy's
    knobs of `config`, a progress bar on a terminal."""
    from simulator.report import execute, policy_runs, sweep_runs

    working_sets, policies, limits, mapping_seeds = plan
    if limits is not None:
        runs = sweep_runs(working_sets, limits, mapping_seeds)
    else:
        runs = policy_runs(working_sets, policies, config.max_num_skips, mapping_seeds)
    total = sum(len(workloads[(run.working_set, run.mapping_seed)].requests) for run in runs)
    with _progress(total, enabled=progress and sys.stderr.isatty()) as advance:
        return execute(
            workloads,
            runs,
            cluster=cluster,
            room_aware_misses=config.room_aware_misses,
            coldest_victim_misses=config.coldest_victim_misses,
            literal_visits=config.literal_visits,
            mqfq_overrun_s=config.mqfq_overrun_s,
            mqfq_ttl_alpha=config.mqfq_ttl_alpha,
            mqfq_swap_out=config.mqfq_swap_out,
            torpor_alpha_period_s=config.torpor_alpha_period_s,
            interference_aware_loads=config.interference_aware_loads,
            batching=batching,
            on_progress=advance,
            optimum=True,
        )


def _sim_cluster_meta(
    cluster: ClusterConfig, results: Sequence[SimResult], slo_factor: float | None
) -> dict[str, object]:
    """What `gpufaas sim` reports of the simulated cluster beside the results."""
    return {
        "gpus": cluster.gpus,
        "gpu_memory_mb": cluster.gpu_memory_mb,
        "slots": cluster.slots,
        "mappings": list(dict.fromkeys(result.mapping for result in results)),
        "timing_spread": cluster.timing_spread,
        "host_memory_mb": cluster.host_memory_mb,
        "eviction": cluster.eviction,
        "slo_factor": slo_factor,
        "interference": cluster.interference,
        "adaptive_slots": cluster.adaptive_slots,
        "gpus_per_link": cluster.gpus_per_link,
    }


def _sim_output(
    results: list[SimResult], meta: dict[str, object], *, grouped: bool, json_output: bool, plot: Path | None
) -> None:
    """The results as JSON or tables (aggregated over mappings when `grouped`)."""
    from simulator.report import aggregate

    groups = aggregate(results) if grouped else []
    if json_output:
        if len(results) == 1:
            print(json.dumps({**results[0].to_json(), **meta}, indent=2))
        else:
            document: dict[str, object] = {**meta, "results": [r.to_json() for r in results]}
            if groups:
                document["aggregates"] = [group.to_json() for group in groups]
            print(json.dumps(document, indent=2))
    elif groups:
        _print_aggregates(groups, meta)
    else:
        _print_table(results, meta)
        if plot is not None:
            console.print(f"wrote {plot}")


def _check_eviction(name: str) -> None:
    """`--eviction`: a registered eviction policy, else one line listing them."""
    from cache_manager import eviction_policy

    try:
        eviction_policy(name)
    except GpufaasError as exc:
        raise typer.BadParameter(str(exc), param_hint="--eviction") from None


def _sim_title(meta: Mapping[str, object]) -> str:
    noise = f", timing spread {meta['timing_spread']}" if meta.get("timing_spread") else ""
    noise += f", host tier {meta['host_memory_mb']} MB/node" if meta.get("host_memory_mb") else ""
    noise += f", interference {meta['interference']}" if meta.get("interference") is not None else ""
    return (
        f"{meta['trace']} minutes {meta['start_minute']}+{meta['minutes']}, {meta['rpm']} rpm, "
        f"{meta['gpus']} GPUs x {meta['gpu_memory_mb']} MB x {meta['slots']} slots, seed {meta['seed']}{noise}, "
        f"mapping {', '.join(str(m) for m in meta['mappings'])}"  # type: ignore[attr-defined]
    )


def _print_aggregates(groups: Sequence[Aggregate], meta: Mapping[str, object]) -> None:
    """One row per (policy, WS, O3 limit): each metric as mean ± sample sd over the mappings."""
    table = Table(title=_sim_title(meta) + " (mean ± sd over mappings)", title_justify="left")
    columns = [
        ("avg lat (s)", "avg_latency_s"),
        ("p50 (s)", "p50_latency_s"),
        ("p99 (s)", "p99_latency_s"),
        ("miss ratio", "miss_ratio"),
        ("false miss", "false_miss_ratio"),
        ("GPU util", "gpu_utilization"),
        ("fn lat var (s²)", "function_latency_variance"),
    ]
    for header in ("policy", "WS", "O3 limit", "mappings", *(h for h, _ in columns)):
        table.add_column(header, justify="left" if header == "policy" else "right")
    for group in groups:
        cells = [f"{group.metrics[f].mean:.3f} ± {group.metrics[f].stdev:.3f}" for _, f in columns]
        table.add_row(group.policy, str(group.working_set), str(group.max_num_skips), str(len(group.mappings)), *cells)
    Console(width=None if sys.stdout.isatty() else 250).print(table)


def _mapping_list(text: str) -> list[int | None]:
    """--mappings: 'ends' and/or non-negative shuffle seeds, comma-separated, no repeats."""
    out: list[int | None] = []
    for item in (part.strip() for part in text.split(",")):
        if item == "ends":
            value: int | None = None
        elif item.isdigit():
            value = int(item)
        else:
            raise typer.BadParameter(
                f"expected 'ends' or a non-negative seed, got {item!r} (e.g. --mappings ends,1,2)",
                param_hint="--mappings",
            )
        if value in out:
            raise typer.BadParameter(f"{item!r} is listed twice", param_hint="--mappings")
        out.append(value)
    return out


def _print_table(results: Sequence[SimResult], meta: Mapping[str, object]) -> None:
    table = Table(title=_sim_title(meta), title_justify="left")
    columns = [
        ("policy", "policy"),
        ("WS", "working_set"),
        ("O3 limit", "max_num_skips"),
        ("requests", "requests"),
        ("avg lat (s)", "avg_latency_s"),
        ("floor (s)", "floor_latency_s"),
        ("p50 (s)", "p50_latency_s"),
        ("p99 (s)", "p99_latency_s"),
        ("miss ratio", "miss_ratio"),
        ("optimal", "optimal_miss_ratio"),
        ("false miss", "false_miss_ratio"),
        ("top replicas", "avg_top_model_replicas"),
        ("GPU util", "gpu_utilization"),
        ("fn lat var (s²)", "function_latency_variance"),
    ]
    if any(result.max_batch_size > 1 for result in results):
        columns.append(("calls/batch", "avg_batch_calls"))
    if meta.get("slo_factor"):
        columns += [("SLO met", "slo_attainment"), ("fns in SLO", "slo_functions_met")]
    for header, _ in columns:
        table.add_column(header, justify="left" if header == "policy" else "right")
    for result in results:
        row = []
        for _, field in columns:
            value = getattr(result, field)
            if field == "optimal_miss_ratio":  # a floor; "≥" where the solver only bounded it
                row.append("-" if value is None else f"{'' if result.optimal_exact else '≥'}{value:.3f}")
                continue
            row.append(f"{value:.3f}" if isinstance(value, float) else str(value))
        table.add_row(*row)
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@contextmanager
def _user_errors() -> Iterator[None]:
    """A user's mistake becomes one line on stderr and exit status 1, never a traceback."""
    try:
        yield
    except GpufaasError as exc:
        err_console.print(f"[bold red]error:[/] {escape(str(exc))}", highlight=False)  # its words, not markup
        raise typer.Exit(code=1) from None


@contextmanager
def _progress(total: int, *, enabled: bool) -> Iterator[Callable[[int], None]]:
    if not enabled:
        yield lambda _: None
        return
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    with Progress(
        TextColumn("simulating"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(), console=err_console
    ) as progress:
        task = progress.add_task("sim", total=total)
        yield lambda n: progress.advance(task, n)


# --- the cluster and its functions ------------------------------------------------------------

DEFAULT_GATEWAY = "http://127.0.0.1:8080"


def state_dir_default() -> Path:
    env = os.environ.get("GPUFAAS_STATE_DIR")
    return Path(env) if env else Path.home() / ".local" / "state" / "gpufaas"


StateDir = Annotated[Path, typer.Option("--state-dir", help="Where the local cluster keeps its state and logs.")]
GatewayOpt = Annotated[
    str | None, typer.Option("--gateway", "-g", help="Gateway URL (else $GPUFAAS_URL, else http://127.0.0.1:8080).")
]


def gateway_url(flag: str | None, stack_gateway: str | None = None) -> str:
    """--gateway, else $GPUFAAS_URL, else the stack file's provider.gateway, else the default."""
    return (flag or os.environ.get("GPUFAAS_URL") or stack_gateway or DEFAULT_GATEWAY).rstrip("/")


def credentials_path() -> Path:
    """Where `gpufaas login` keeps passwords, by gateway URL (mode 0600)."""
    env = os.environ.get("GPUFAAS_CONFIG_DIR")
    return (Path(env) if env else Path.home() / ".config" / "gpufaas") / "credentials.json"


def _saved_credentials() -> dict[str, str]:
    try:
        saved = json.loads(credentials_path().read_text())
    except (OSError, ValueError):
        return {}
    return {str(k): str(v) for k, v in saved.items()} if isinstance(saved, dict) else {}


def admin_password_for(url: str, state_dir: Path | None = None) -> str | None:
    """The admin password to use with the gateway at `url`: $GPUFAAS_PASSWORD, else what
    `gpufaas login` saved for it, else the local cluster's own if `url` is its gateway."""
    from gpufaas.credentials import CredentialError, SecretFiles, read_secret

    if os.environ.get("GPUFAAS_PASSWORD"):
        return os.environ["GPUFAAS_PASSWORD"]
    saved = _saved_credentials().get(url)
    if saved:
        return saved
    state_dir = state_dir or state_dir_default()
    info = _cluster_info(state_dir)
    if info.get("gateway_url", "").rstrip("/") == url and info.get("secrets"):
        with contextlib.suppress(CredentialError):
            return read_secret(SecretFiles(Path(info["secrets"])).admin_password)
    return None


class GatewayClient:
    """The CLI's handle on a gateway: every failure becomes a GpufaasError that says what to do.
    It authenticates as admin with `admin_password_for(url)` when there is one."""

    def __init__(self, url: str, *, timeout_s: float = 120.0, password: str | None = None) -> None:
        self.url = url
        password = password if password is not None else admin_password_for(url)
        auth = httpx.BasicAuth(ADMIN_USER, password) if password else None
        # The same credential for the gateway's blob server (gpufaas.blobnet), which httpx does not reach.
        self.authorization = basic_authorization(ADMIN_USER, password) if password else None
        self._client = httpx.Client(base_url=url, timeout=timeout_s, auth=auth)

    def request(self, method: str, path: str, **kwargs: Any) -> httpx.Response:
        try:
            return self._client.request(method, path, **kwargs)
        except httpx.ConnectError:
            raise GpufaasError(
                f"no gateway answers at {self.url}; start a local cluster with `gpufaas up`, "
                "or point --gateway / GPUFAAS_URL at a running one"
            ) from None
        except httpx.HTTPError as exc:
            raise GpufaasError(f"talking to the gateway at {self.url} failed: {exc}") from None

    def ok(self, response: httpx.Response, *, accept: tuple[int, ...] = (200, 201, 202)) -> Any:
        if response.status_code == 401:
            raise GpufaasError(
                f"the gateway at {self.url} needs credentials: `gpufaas login --gateway {self.url} --password-stdin` "
                "(the password of a local cluster is in its state directory, secrets/admin-password)"
            )
        if response.status_code not in accept:
            try:
                message = response.json().get("error", response.text)
            except ValueError:
                message = response.text
            raise GpufaasError(f"{message} (HTTP {response.status_code})")
        return response.json() if response.content else None


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(
    ctx: typer.Context,
    nodes: Annotated[int, typer.Option(min=1, help="GPU managers to start.")] = 2,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="Logical GPUs per node (cpu/emulated).")] = 2,
    backend: Annotated[
        str | None, typer.Option(help="cuda, cpu or emulated (default: cuda if NVML finds GPUs).")
    ] = None,
    gpu_memory_mb: Annotated[int, typer.Option(min=1, help="Cache capacity per logical GPU (MB).")] = 8192,
    policy: Annotated[
        str, typer.Option(help="Scheduling policy: lb, lalb, lalb-o3, mqfq-sticky or torpor.")
    ] = "lalb-o3",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Gateway port.")] = 8080,
    slots: Annotated[str, typer.Option(help="Calls a GPU runs at once: N, or N,GPU_TYPE=M,... per GPU type.")] = "4",
    spares: Annotated[
        int | None,
        typer.Option(min=0, help="Warm spare workers per GPU (a miss takes one; default 1, 0 with --runtime docker)."),
    ] = None,
    runtime: Annotated[
        str,
        typer.Option(
            help="How nodes run workers: process (forked from a zygote, confined) or docker (a container per "
            "model, from --docker-image: no spares)."
        ),
    ] = "process",
    docker_image: Annotated[
        str | None, typer.Option(help="The docker runtime's worker image (default: the GPU manager's).")
    ] = None,
    eviction: Annotated[
        str, typer.Option(help="Which models a miss evicts: lru, heaviness or tinylfu (docs/policies.md).")
    ] = "lru",
    gpu_idle_release_s: Annotated[
        float | None,
        typer.Option(
            min=0.001, help="EDAS staged exit: a model unused this long leaves its GPU (for its node's host tier)."
        ),
    ] = None,
    host_idle_release_s: Annotated[
        float | None,
        typer.Option(min=0.001, help="EDAS staged exit: a model this long in a node's host tier leaves it."),
    ] = None,
    scheduler_args: Annotated[
        str,
        typer.Option(
            help="More flags for the scheduler, as one string: the policy's tunables as the simulator takes them, "
            "e.g. '--mqfq-ttl-alpha 3 --torpor-alpha-period-s 10' (python -m scheduler --help lists them)."
        ),
    ] = "",
    state_dir: StateDir = state_dir_default(),  # noqa: B008
) -> None:
    """Start a local cluster in the background: etcd, scheduler, gateway and GPU managers, under a
    supervisor that restarts any of them that exits (with backoff) until `gpufaas down`.

    Any other scheduler setting may follow as the scheduler takes it (`python -m scheduler --help`):
    the policy's knobs as `gpufaas sim` takes them, e.g. `gpufaas up --policy mqfq-sticky
    --o3-limit 10 --mqfq-overrun-s 5 --mqfq-ttl-alpha 3 --torpor-alpha 0.3`."""
    from gpufaas.dev.local_cluster import recorded_pids
    from gpufaas.processes import pid_alive

    if runtime not in ("process", "docker"):
        raise typer.BadParameter(f"expected process or docker, got {runtime!r}", param_hint="--runtime")
    if runtime == "docker" and spares:
        raise typer.BadParameter(
            "the docker runtime keeps no warm spares (a container is made for its model): leave --spares out or pass 0",
            param_hint="--spares",
        )
    if docker_image is not None and runtime != "docker":
        raise typer.BadParameter("--docker-image goes with --runtime docker", param_hint="--docker-image")
    scheduler: dict[str, Any] = {
        "policy": policy,
        "eviction": eviction,
        "slots": slots,
        "gpu_idle_release_s": gpu_idle_release_s,
        "host_idle_release_s": host_idle_release_s,
    }
    scheduler_flags = [*ctx.args, *_split_flags(scheduler_args)]
    checked = _checked_scheduler(scheduler, scheduler_flags)
    backend = backend if backend is not None else ("cuda" if _nvml_finds_gpus() else "cpu")
    if backend not in ("cuda", "cpu", "emulated"):
        raise typer.BadParameter(f"expected cuda, cpu or emulated, got {backend!r}", param_hint="--backend")
    if any(pid_alive(pid) for pid in recorded_pids(state_dir).values()):
        url = _cluster_info(state_dir).get("gateway_url", "?")
        console.print(
            f"a cluster is already running from {state_dir} (gateway {url}); "
            "`gpufaas status` shows it, `gpufaas down` stops it"
        )
        return
    options = {
        **scheduler,
        "nodes": nodes,
        "gpus_per_node": gpus_per_node,
        "backend": backend,
        "gpu_memory_mb": gpu_memory_mb,
        "gateway_port": port,
        "spares": spares if spares is not None else (0 if runtime == "docker" else 1),
        "runtime": runtime,
        "docker_image": docker_image,
        "scheduler_flags": scheduler_flags,
    }
    _start_supervised(state_dir, options, policy=checked.policy)


def _split_flags(text: str) -> list[str]:
    """`--scheduler-args`: split as a shell would."""
    import shlex

    try:
        return shlex.split(text)
    except ValueError as exc:
        raise typer.BadParameter(f"cannot split {text!r}: {exc}", param_hint="--scheduler-args") from None


def _checked_scheduler(scheduler: dict[str, Any], flags: list[str]) -> SchedulerSettings:
    """The settings `gpufaas up`'s scheduler will run with (its own scheduler options, `scheduler`
    by field name, and `flags` on top), checked by the scheduler's settings model now: a mistake is
    one line here, not a scheduler that keeps failing to start."""
    from pydantic import ValidationError

    from gpufaas.settings import SettingsError
    from scheduler.settings import SchedulerSettings

    try:
        return SchedulerSettings(**scheduler).with_flags(flags)
    except SettingsError as exc:
        raise typer.BadParameter(str(exc)) from None
    except ValidationError as exc:
        raise typer.BadParameter(SchedulerSettings.refusal(exc)) from None


def _start_supervised(state_dir: Path, options: Mapping[str, Any], *, policy: str) -> None:
    """Start `python -m gpufaas.dev.local_cluster` with `options` in the background (it outlives this
    command) and wait until it says the cluster is up, or why it is not."""
    import subprocess

    from gpufaas.dev.local_cluster import SUPERVISOR_STATUS, LocalCluster, read_supervisor_status

    cluster = LocalCluster(state_dir, **options)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / SUPERVISOR_STATUS).unlink(missing_ok=True)
    logs = state_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    argv = [sys.executable, "-m", "gpufaas.dev.local_cluster", "--state-dir", str(state_dir)]
    with (logs / "supervisor.log").open("ab") as supervisor_log:
        supervisor = subprocess.Popen(
            [*argv, "--options", json.dumps(options)],
            stdin=subprocess.DEVNULL,
            stdout=supervisor_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives this command
        )
    with _user_errors(), err_console.status("starting etcd, the scheduler, the gateway and the GPU managers..."):
        while (status := read_supervisor_status(state_dir)).get("status") != "up":
            if status.get("status") == "failed" or supervisor.poll() is not None:
                supervisor.wait()
                tail = "\n".join((logs / "supervisor.log").read_text(errors="replace").splitlines()[-15:])
                raise GpufaasError(f"the cluster did not start: {status.get('error') or tail}")
            time.sleep(0.2)
    console.print(
        f"[bold green]gpufaas is up[/]: gateway {cluster.gateway_url}, {cluster.nodes} node(s) x "
        f"{cluster.gpus_per_node} {cluster.backend} GPU(s), policy {policy}"
    )
    console.print(f"state: {state_dir}   logs: {logs}   (gpufaas logs \\[component])")
    console.print(
        f"credentials (mode 0600) in {cluster.secrets.directory}: admin-password (user admin: /system/*, and "
        "this CLI uses it), invoke-token (Authorization: Bearer, to call functions)"
    )
    console.print("stop it with `gpufaas down`")


@app.command()
def down(state_dir: StateDir = state_dir_default()) -> None:  # noqa: B008
    """Stop exactly the processes `gpufaas up` started (by PID)."""
    from gpufaas.dev.local_cluster import stop_recorded

    stopped = stop_recorded(state_dir)
    if stopped:
        console.print(f"stopped {', '.join(stopped)}")
    else:
        console.print(f"nothing is running from {state_dir}")


@app.command()
def status(state_dir: StateDir = state_dir_default(), gateway: GatewayOpt = None) -> None:  # noqa: B008
    """Say what runs: the local cluster's processes and whether the gateway answers."""
    from gpufaas.dev.local_cluster import recorded_pids
    from gpufaas.processes import pid_alive

    pids = recorded_pids(state_dir)
    info = _cluster_info(state_dir)
    url = gateway_url(gateway, info.get("gateway_url"))
    table = Table(title=f"local cluster in {state_dir}", title_justify="left")
    table.add_column("component")
    table.add_column("pid", justify="right")
    table.add_column("state")
    for name, pid in pids.items():
        table.add_row(name, str(pid), "running" if pid_alive(pid) else "[red]stopped[/]")
    if pids:
        console.print(table)
    else:
        console.print(f"no local cluster recorded in {state_dir}")
    try:
        healthy = httpx.get(f"{url}/healthz", timeout=3).status_code == 200
    except httpx.HTTPError:
        healthy = False
    console.print(f"gateway {url}: {'[green]answers[/]' if healthy else '[red]does not answer[/]'}")
    if not healthy:
        raise typer.Exit(code=1)


@app.command()
def login(
    gateway: GatewayOpt = None,
    password_stdin: Annotated[bool, typer.Option("--password-stdin", help="Read the password from stdin.")] = False,
    state_dir: StateDir = state_dir_default(),  # noqa: B008
) -> None:
    """Check the admin password with the gateway and keep it for later commands (mode 0600).

    Without --password-stdin: the local cluster's own password (its state directory), if the
    gateway is the local cluster's."""
    with _user_errors():
        url = gateway_url(gateway, _cluster_info(state_dir).get("gateway_url"))
        if password_stdin:
            if sys.stdin.isatty():
                raise GpufaasError("--password-stdin: pipe the password in, e.g. `cat FILE | gpufaas login ...`")
            password = sys.stdin.readline().strip()
        else:
            password = admin_password_for(url, state_dir) or ""
        if not password:
            raise GpufaasError(
                f"no password for {url}: pass it with --password-stdin (a local cluster keeps it in "
                f"{state_dir / 'secrets' / 'admin-password'})"
            )
        client = GatewayClient(url, password=password)
        response = client.request("GET", "/system/info")
        if response.status_code in (401, 403):
            raise GpufaasError(f"the gateway at {url} refused that password; check it and try again")
        client.ok(response)
        path = credentials_path()
        path.parent.mkdir(parents=True, exist_ok=True)
        saved = _saved_credentials()
        saved[url] = password
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as out:
            json.dump(saved, out, indent=2)
        os.chmod(path, 0o600)
    console.print(f"logged in to {url} as {ADMIN_USER} (kept in {path})")


@app.command()
def logout(gateway: GatewayOpt = None) -> None:
    """Forget the password `gpufaas login` kept for a gateway."""
    url = gateway_url(gateway)
    saved = _saved_credentials()
    if saved.pop(url, None) is None:
        console.print(f"no password kept for {url}")
        return
    credentials_path().write_text(json.dumps(saved, indent=2))
    console.print(f"forgot the password for {url}")


@app.command()
def new(
    name: Annotated[str | None, typer.Argument(help="The new function's name.", show_default=False)] = None,
    template: Annotated[
        str, typer.Option("--template", "-t", help="A template from `gpufaas new --list`.")
    ] = "pytorch-custom",
    directory: Annotated[Path, typer.Option("--dir", help="Where to create it (a stack.yml goes there too).")] = Path(
        "."
    ),
    list_templates: Annotated[bool, typer.Option("--list", help="List the templates and exit.")] = False,
) -> None:
    """Create a function from a template (handler, weights, and an entry in stack.yml)."""
    import shutil
    import subprocess

    from gpufaas.functions import NAME_PATTERN

    templates = _templates()
    if list_templates:
        for template_name, path in sorted(templates.items()):
            console.print(f"{template_name:28} {_template_meta(path).get('description', '')}")
        return
    if name is None:
        raise typer.BadParameter("give the new function's name (or --list for the templates)", param_hint="NAME")
    if not NAME_PATTERN.match(name):
        raise typer.BadParameter("use lower-case letters, digits and '-' (at most 63)", param_hint="NAME")
    if template not in templates:
        raise typer.BadParameter(
            f"unknown template {template!r}; templates: {', '.join(sorted(templates))}", param_hint="--template"
        )
    target = directory / name
    if target.exists():
        raise typer.BadParameter(f"{target} already exists", param_hint="NAME")
    source = templates[template]
    # What this command makes, removed again if any step fails: the function's directory and the
    # folders above it that did not exist (a stack.yml it had not finished is never left half written).
    made = target
    while not made.parent.exists():
        made = made.parent
    try:
        with _user_errors():
            shutil.copytree(source, target, ignore=shutil.ignore_patterns("__pycache__", "stack.yml", "template.yml"))
            if (target / "make_weights.py").exists():
                done = subprocess.run(
                    [sys.executable, "make_weights.py"], cwd=target, capture_output=True, text=True, check=False
                )
                if done.returncode != 0:
                    raise GpufaasError(_weights_failure(template, done.stderr))
            stack_path = _add_to_stack(directory / "stack.yml", name, template, _template_meta(source))
    except BaseException:
        shutil.rmtree(made, ignore_errors=True)
        raise
    console.print(
        f"created {target} from {template} and added it to {stack_path}; deploy with `gpufaas deploy -f {stack_path}`"
    )


def _add_to_stack(stack_path: Path, name: str, template: str, meta: Mapping[str, Any]) -> Path:
    """Add function `name` (from `template`, with its template.yml `meta`) to the stack file at
    `stack_path`, made if absent; written whole or not at all. Returns `stack_path`."""
    import yaml

    stack: dict[str, Any] = {
        "version": 1.0,
        "provider": {"name": "gpufaas", "gateway": DEFAULT_GATEWAY},
        "functions": {},
    }
    if stack_path.exists():
        try:
            stack = yaml.safe_load(stack_path.read_text()) or stack
        except (OSError, yaml.YAMLError) as exc:
            raise GpufaasError(f"cannot read {stack_path}: {exc}") from None
        if not isinstance(stack, dict) or not isinstance(stack.setdefault("functions", {}), dict):
            raise GpufaasError(f"{stack_path} is not a stack file (no functions mapping)")
    stack["functions"][name] = {
        "template": template,
        "handler": f"./{name}",
        "gpu": meta.get("gpu", "any"),
        "memory_mb": int(meta.get("memory_mb", 1024)),
        "batch_size": int(meta.get("batch_size", 32)),
        "timeout_s": float(meta.get("timeout_s", 60)),
        "labels": {},
        "environment": {},
    }
    partial = stack_path.with_name(f".{stack_path.name}.{os.getpid()}.tmp")
    try:
        partial.write_text(yaml.safe_dump(stack, sort_keys=False))
        partial.replace(stack_path)
    finally:
        partial.unlink(missing_ok=True)
    return stack_path


@app.command()
def deploy(
    file: Annotated[Path, typer.Option("-f", "--file", help="The stack file.")] = Path("stack.yml"),
    gateway: GatewayOpt = None,
    only: Annotated[list[str] | None, typer.Option("--filter", help="Deploy only these functions.")] = None,
) -> None:
    """Upload what the gateway lacks of each function's handler directory (files it holds already,
    such as unchanged weights, are not sent again), then register or update the functions."""
    from gpufaas.cli import uploads
    from gpufaas.cli.stack import load_stack
    from gpufaas.packages import DigestCache

    with _user_errors():
        stack = load_stack(file)
        client = GatewayClient(gateway_url(gateway, stack.gateway))
        selected = [f for f in stack.functions if not only or f.name in only]
        if not selected:
            raise GpufaasError(f"no function in {file} matches --filter {', '.join(only or [])}")
        for function in selected:
            if not (function.handler / "handler.py").is_file():
                raise GpufaasError(f"{file}: functions.{function.name}.handler: {function.handler} has no handler.py")
        scanned = uploads.scan([(f.name, f.handler) for f in selected], DigestCache(_digest_cache_path()))
        with _transfer_progress("uploading") as progress:
            report = uploads.upload(client, scanned, progress=progress)
        for function, package in zip(selected, scanned, strict=True):
            registered = report.packages[package.manifest.digest]
            spec = function.spec(str(registered["digest"]))
            response = client.request("POST", "/system/functions", json=spec)
            if response.status_code == 409:
                response = client.request("PUT", "/system/functions", json=spec)
            answer = client.ok(response)
            layer = registered.get("requirements") or []
            extra = f", requirements: {', '.join(layer)}" if layer else ""
            console.print(
                f"deployed [bold]{function.name}[/] (model {answer['model']}, "
                f"{package.manifest.unpacked_bytes / 1e6:.1f} MB in {len(package.manifest.files)} files{extra})"
            )
        how = " (through its API: its blob server is not reachable from here)" if report.via_api else ""
        console.print(
            f"sent {report.bytes_sent / 1e6:.1f} MB in {report.blobs_sent} blob(s); the gateway had the rest{how}"
        )


def _digest_cache_path() -> Path:
    """Where `deploy` remembers the digests of files it hashed (XDG cache)."""
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "gpufaas" / "digests.json"


@contextmanager
def _transfer_progress(what: str) -> Iterator[Callable[[int, int], None]]:
    """A progress bar of bytes on stderr when it is a terminal (nothing otherwise)."""
    if not err_console.is_terminal:
        yield lambda sent, total: None
        return
    from rich.progress import BarColumn, DownloadColumn, Progress, TextColumn, TransferSpeedColumn

    with Progress(
        TextColumn(what), BarColumn(), DownloadColumn(), TransferSpeedColumn(), console=err_console
    ) as progress:
        task = progress.add_task(what, total=None)

        def update(sent: int, total: int) -> None:
            progress.update(task, completed=sent, total=total)

        yield update


@app.command()
def invoke(
    name: Annotated[str, typer.Argument(help="The function to call.")],
    data: Annotated[
        str | None, typer.Option("--data", "-d", help="The request body (else --file, else stdin).")
    ] = None,
    file: Annotated[Path | None, typer.Option("--file", help="Read the request body from a file.")] = None,
    content_type: Annotated[
        str | None, typer.Option(help="Content type (default: JSON if the body parses as JSON).")
    ] = None,
    verbose: Annotated[bool, typer.Option("-v", "--verbose", help="Also print the X-* headers.")] = False,
    gateway: GatewayOpt = None,
) -> None:
    """Call a function; the result goes to stdout."""
    with _user_errors():
        if data is not None:
            body = data.encode()
        elif file is not None:
            try:
                body = file.read_bytes()
            except OSError as exc:
                raise GpufaasError(f"cannot read {file}: {exc}") from None
        elif not sys.stdin.isatty():
            body = sys.stdin.buffer.read()
        else:
            body = b""
        if content_type is None:
            try:
                json.loads(body or b"null")
                content_type = "application/json"
            except (ValueError, UnicodeDecodeError):
                content_type = "application/octet-stream"
        client = GatewayClient(gateway_url(gateway))
        response = client.request("POST", f"/function/{name}", content=body, headers={"content-type": content_type})
        if verbose:
            for header, value in response.headers.items():
                if header.lower().startswith("x-"):
                    err_console.print(f"{header}: {value}", highlight=False)
        if response.status_code != 200:
            client.ok(response)
        sys.stdout.buffer.write(response.content)
        if not response.content.endswith(b"\n"):
            sys.stdout.buffer.write(b"\n")
        sys.stdout.flush()


@app.command("ls")
def list_functions(gateway: GatewayOpt = None) -> None:
    """List the deployed functions."""
    with _user_errors():
        client = GatewayClient(gateway_url(gateway))
        functions = client.ok(client.request("GET", "/system/functions"))
    table = Table(title_justify="left")
    for column in ("name", "memory (MB)", "batch", "timeout (s)", "GPU", "invocations", "replicas"):
        table.add_column(column, justify="left" if column in ("name", "GPU") else "right")
    for f in functions:
        table.add_row(
            f["name"],
            str(f["memory_mb"]),
            str(f["batch_size"]),
            f"{f['timeout_s']:g}",
            f["gpu"],
            str(f["invocationCount"]),
            str(f["replicas"]),
        )
    Console().print(table)


@app.command()
def describe(name: Annotated[str, typer.Argument()], gateway: GatewayOpt = None) -> None:
    """Show one function: its spec, where it is cached, how often it ran."""
    with _user_errors():
        client = GatewayClient(gateway_url(gateway))
        response = client.request("GET", f"/system/function/{name}")
        function = client.ok(response)
    for key, value in function.items():
        console.print(f"{key + ':':18} {value}", highlight=False)


@app.command()
def rm(name: Annotated[str, typer.Argument()], gateway: GatewayOpt = None) -> None:
    """Remove a deployed function."""
    with _user_errors():
        client = GatewayClient(gateway_url(gateway))
        client.ok(client.request("DELETE", "/system/functions", json={"functionName": name}))
    console.print(f"removed {name}")


@app.command()
def gpus(gateway: GatewayOpt = None) -> None:
    """Every GPU: node, status, memory used/capacity, LRU list (most recent first), and its node's
    host tier (models evicted and kept in host memory, most recent first)."""
    with _user_errors():
        client = GatewayClient(gateway_url(gateway))
        rows = client.ok(client.request("GET", "/system/gpus"))
    table = Table(title_justify="left")
    columns = ("node", "GPU", "type", "status", "memory (MB)", "queued", "LRU list (most recent first)", "host tier")
    for column in columns:
        table.add_column(column)
    for g in sorted(rows, key=lambda g: g["gpu"]):
        table.add_row(
            g["node"],
            g["gpu"].split("/", 1)[1],
            g["gpu_type"],
            g["status"],
            f"{g['memory_used_mb']}/{g['memory_capacity_mb']}",
            str(g["local_queue"]),
            ", ".join(g["lru"]) or "-",
            ", ".join(g.get("host_tier", [])) or "-",
        )
    Console(width=None if sys.stdout.isatty() else 200).print(table)


@app.command()
def top(
    gateway: GatewayOpt = None,
    interval_s: Annotated[float, typer.Option("--interval", min=0.1, help="Seconds between refreshes.")] = 2.0,
    once: Annotated[bool, typer.Option("--once", help="Print one frame and exit (for scripts).")] = False,
) -> None:
    """A live view of the cluster until Ctrl-C: GPUs (memory, running calls, LRU lists, host tiers),
    functions (calls, hit ratio, latency percentiles), the global queue and recent evictions."""
    from rich.live import Live

    from gpufaas.cli.top import render

    try:
        with _user_errors():
            client = GatewayClient(gateway_url(gateway), timeout_s=10.0)
            overview = _fetch_overview(client)  # a first failure (no gateway, 401, 404) ends the command
        out = Console(width=None if sys.stdout.isatty() else 200)
        if once:
            out.print(render(overview, gateway_url=client.url, now_unix_s=time.time()))
            return
        problem: str | None = None
        with Live(console=out, auto_refresh=False) if out.is_terminal else contextlib.nullcontext() as live:
            while True:
                frame = render(overview, gateway_url=client.url, now_unix_s=time.time(), problem=problem)
                if live is not None:
                    live.update(frame, refresh=True)
                else:  # piped: one frame after another, like `top -b`
                    out.print(frame, "")
                time.sleep(interval_s)
                # A later failure keeps the last overview on screen under the error, and tries again.
                try:
                    overview, problem = _fetch_overview(client), None
                except GpufaasError as exc:
                    problem = f"refresh failed, showing the last overview: {exc}"
    except KeyboardInterrupt:  # Ctrl-C is how a live view ends: quietly, with status 0
        return


def _fetch_overview(client: GatewayClient) -> dict[str, Any]:
    response = client.request("GET", "/system/overview")
    if response.status_code == 404:
        raise GpufaasError(
            f"the gateway at {client.url} has no /system/overview: it is older than this CLI; upgrade the "
            "gateway (meanwhile `gpufaas gpus` and `gpufaas ls` show part of the picture)"
        )
    try:
        overview = client.ok(response, accept=(200,))
    except ValueError:  # a 200 whose body is not JSON: not a gpufaas gateway, or a proxy's page
        overview = None
    if not isinstance(overview, dict):
        raise GpufaasError(
            f"the gateway at {client.url} answered /system/overview with something other than an overview"
        )
    return overview


@app.command()
def logs(
    component: Annotated[str | None, typer.Argument(help="scheduler, gateway, node0, ... (default: list them)")] = None,
    lines: Annotated[int, typer.Option("-n", "--lines", min=1, help="How many lines from the end.")] = 50,
    state_dir: StateDir = state_dir_default(),  # noqa: B008
) -> None:
    """Show the local cluster's logs."""
    log_dir = state_dir / "logs"
    available = sorted(p.stem for p in log_dir.glob("*.log")) if log_dir.is_dir() else []
    if component is None:
        console.print(f"logs in {log_dir}: {', '.join(available) or 'none'}")
        return
    if component not in available:
        known = ", ".join(available) or "none (is the cluster up?)"
        err_console.print(f"[bold red]error:[/] no log for {component!r}; available: {known}")
        raise typer.Exit(code=1)
    text = (log_dir / f"{component}.log").read_text(errors="replace").splitlines()[-lines:]
    sys.stdout.write("\n".join(text) + "\n")


def _cluster_info(state_dir: Path) -> dict[str, Any]:
    try:
        info: dict[str, Any] = json.loads((state_dir / "cluster.json").read_text())
        return info
    except (OSError, ValueError):
        return {}


def _nvml_finds_gpus() -> bool:
    try:
        from gpu_manager.devices import discover_nvml
    except ImportError:
        return False
    return bool(discover_nvml())


def _templates() -> dict[str, Path]:
    try:
        from importlib import resources

        root = Path(str(resources.files("function_templates")))
    except ModuleNotFoundError:
        root = Path(__file__).resolve().parents[2] / "function_templates"
    return {p.name: p for p in root.iterdir() if p.is_dir() and (p / "handler.py").exists()} if root.is_dir() else {}


# Modules a template's make_weights.py imports that come with an extra of gpufaas (the rest with gpufaas itself).
_EXTRA_OF_MODULE = {"torch": "worker", "numpy": "worker", "PIL": "worker"}


def _weights_failure(template: str, stderr: str) -> str:
    """One line for a template's make_weights.py that failed: what to install when a module is
    missing (the usual cause outside a dev install), else the script's last line of error."""
    import re

    missing = re.findall(r"(?:ModuleNotFoundError|ImportError): No module named '([\w.]+)'", stderr)
    if missing:
        module = missing[-1].split(".")[0]
        extra = _EXTRA_OF_MODULE.get(module)
        install = f"pip install 'gpufaas[{extra}]'" if extra else f"pip install {module}"
        return (
            f"the {template} template writes its weights with {module}, which this Python ({sys.executable}) "
            f"lacks: {install}, then run `gpufaas new` again"
        )
    lines = [line.strip() for line in stderr.splitlines() if line.strip()]
    last = lines[-1] if lines else "no message"
    return f"the {template} template's make_weights.py failed: {last}"


def _template_meta(path: Path) -> dict[str, Any]:
    import yaml

    try:
        meta = yaml.safe_load((path / "template.yml").read_text()) or {}
    except (OSError, yaml.YAMLError):
        return {}
    return meta if isinstance(meta, dict) else {}


def main() -> None:
    app()
