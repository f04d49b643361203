"""The local cluster: `gpufaas up` (the supervisor, started in the background), `down` and `status`."""

from __future__ import annotations

import json
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any, NoReturn

import typer
from rich.markup import escape
from rich.table import Table

from gpufaas.cli.base import GatewayOpt, StateDir, app, console, err_console, user_errors
from gpufaas.cli.client import GatewayClient, cluster_info, gateway_url, state_dir_default, what_to_start
from gpufaas.errors import GpufaasError

if TYPE_CHECKING:
    from scheduler.settings import SchedulerSettings


@app.command(context_settings={"allow_extra_args": True, "ignore_unknown_options": True})
def up(
    ctx: typer.Context,
    nodes: Annotated[int, typer.Option(min=1, help="GPU managers to start.")] = 2,
    gateways: Annotated[
        int, typer.Option(min=1, help="Gateways to start; several: behind HAProxy (round robin) at --port.")
    ] = 1,
    schedulers: Annotated[int, typer.Option(min=1, help="Scheduler processes to start.")] = 1,
    scheduler_in_gateway: Annotated[
        bool | None,
        typer.Option(
            "--scheduler-in-gateway/--scheduler-apart",
            help="Run the (first) scheduler in the (first) gateway's process, which then reaches it in memory, "
            "not over a socket (docs/serving-path.md), or apart in a process of its own. Default: in the gateway "
            "where there is one gateway (on one host, as one user, the two processes share every secret anyway).",
            show_default=False,
        ),
    ] = None,
    node_in_gateway: Annotated[
        bool | None,
        typer.Option(
            "--node-in-gateway/--node-apart",
            help="Run the (first) node in the (first) gateway's process, which then reaches it in memory: a call "
            "crosses only the gateway and its worker's process (docs/serving-path.md), or apart in a process of "
            "its own. Default: in the gateway where there is one gateway and one node.",
            show_default=False,
        ),
    ] = None,
    gpus_per_node: Annotated[int, typer.Option(min=1, help="Logical GPUs per node (cpu/emulated).")] = 2,
    backend: Annotated[
        str | None, typer.Option(help="cuda, cpu or emulated (default: cuda if NVML finds GPUs).")
    ] = None,
    gpu_memory_mb: Annotated[int, typer.Option(min=1, help="Cache capacity per logical GPU (MB).")] = 8192,
    policy: Annotated[
        str, typer.Option(help="Scheduling policy: lb, lalb, lalb-o3, mqfq-sticky or torpor.")
    ] = "lalb-o3",
    port: Annotated[int, typer.Option(min=1, max=65535, help="Gateway port (the balancer's, with several).")] = 8080,
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
    scheduler_args: Annotated[
        str,
        typer.Option(
            help="More flags for the scheduler, as one string: the policy's tunables as the simulator takes them, "
            "e.g. '--mqfq-ttl-alpha 3 --torpor-alpha-period-s 10' (python -m scheduler --help lists them)."
        ),
    ] = "",
    tls: Annotated[
        bool,
        typer.Option(
            "--tls/--no-tls",
            help="TLS on the links between the daemons (the cluster CA and certificates in the state dir's "
            "secrets/tls); --no-tls: plain links, authenticated still (a private network, or measuring TLS's cost).",
        ),
    ] = True,
    state_dir: StateDir = state_dir_default(),  # noqa: B008
) -> None:
    """Start a local cluster in the background: etcd, scheduler(s), gateway(s) (several: behind
    HAProxy) and GPU managers, under a supervisor that restarts any of them that exits (with
    backoff) until `gpufaas down`.

    Any other scheduler setting may follow as the scheduler takes it (`python -m scheduler --help`):
    the policy's knobs as `gpufaas sim` takes them, e.g. `gpufaas up --policy mqfq-sticky
    --o3-limit 10 --mqfq-overrun-s 5 --mqfq-ttl-alpha 3 --torpor-alpha 0.3`, or EDAS's staged exit,
    `--gpu-idle-release-s S --host-idle-release-s S`."""
    from gpufaas.dev.local_cluster import supervised

    if runtime not in ("process", "docker"):
        raise typer.BadParameter(f"expected process or docker, got {runtime!r}", param_hint="--runtime")
    if runtime == "docker" and spares:
        raise typer.BadParameter(
            "the docker runtime keeps no warm spares (a container is made for its model): leave --spares out or pass 0",
            param_hint="--spares",
        )
    if docker_image is not None and runtime != "docker":
        raise typer.BadParameter("--docker-image goes with --runtime docker", param_hint="--docker-image")
    if gateways > 1:
        _check_balancer()
    scheduler: dict[str, Any] = {"policy": policy, "eviction": eviction, "slots": slots}
    scheduler_flags = [*ctx.args, *_split_flags(scheduler_args)]
    checked = _checked_scheduler(scheduler, scheduler_flags)
    backend = backend if backend is not None else ("cuda" if _nvml_finds_gpus() else "cpu")
    if backend not in ("cuda", "cpu", "emulated"):
        raise typer.BadParameter(f"expected cuda, cpu or emulated, got {backend!r}", param_hint="--backend")
    try:  # (after the options' checks: a refused `up` leaves nothing)
        state_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # a file there or above it, a dangling link, no right to make it
        raise typer.BadParameter(f"{state_dir}: {exc.strerror}; the cluster's state goes in a folder") from None
    options = {
        **scheduler,
        "nodes": nodes,
        "gateways": gateways,
        "schedulers": schedulers,
        "scheduler_in_gateway": scheduler_in_gateway if scheduler_in_gateway is not None else gateways == 1,
        "node_in_gateway": node_in_gateway if node_in_gateway is not None else gateways == 1 and nodes == 1,
        "gpus_per_node": gpus_per_node,
        "backend": backend,
        "gpu_memory_mb": gpu_memory_mb,
        "gateway_port": port,
        "spares": spares if spares is not None else (0 if runtime == "docker" else 1),
        "runtime": runtime,
        "docker_image": docker_image,
        "scheduler_flags": scheduler_flags,
        "tls": tls,
    }
    if supervised(state_dir):
        _already_running(ctx, state_dir, options)
        return
    _refuse_leftovers(state_dir)
    _start_supervised(state_dir, options, policy=checked.policy)


# `up`'s parameters by the supervisor's option each sets (the rest share their names).
OPTION_OF_PARAMETER = {"port": "gateway_port", "scheduler_args": "scheduler_flags"}


def _already_running(ctx: typer.Context, state_dir: Path, options: Mapping[str, Any]) -> None:
    """`up` on a state directory whose cluster is starting or running: unchanged (exit 0) where the
    options given on the command line are the ones it runs with (as its supervisor recorded them
    in supervisor.json) or none were given; else exit 1 naming each that differs. A script once
    read "already running" and exit 0 after asking for another port, and got the old one."""
    from gpufaas.dev.local_cluster import read_supervisor_status

    url = cluster_info(state_dir).get("gateway_url", "?")
    # By name: typer carries a click of its own, whose ParameterSource is not click's.
    explicit = ("COMMANDLINE", "ENVIRONMENT")
    flags = {
        OPTION_OF_PARAMETER.get(name, name): f"--{name.replace('_', '-')}"
        for name in ctx.params
        if name != "state_dir" and getattr(ctx.get_parameter_source(name), "name", None) in explicit
    }
    if ctx.args:  # (scheduler flags given to `up` itself)
        flags["scheduler_flags"] = "--scheduler-args"
    recorded = read_supervisor_status(state_dir).get("options")
    if not isinstance(recorded, dict):  # (an older gpufaas's supervisor, or one not yet started)
        recorded = {}
    differ = [
        f"{flag} {_shown(options[key])} (it runs with {_shown(recorded[key]) if key in recorded else 'unrecorded'})"
        for key, flag in flags.items()
        if key not in recorded or recorded[key] != options[key]
    ]
    if differ:
        _refuse(
            f"a cluster is already running from {state_dir} (gateway {url}), not with {'; '.join(differ)}: "
            "`gpufaas down` stops it, then `gpufaas up` with these options starts them"
        )
    console.print(
        f"a cluster is already running from {state_dir} (gateway {url}); "
        "`gpufaas status` shows it, `gpufaas down` stops it",
        markup=False,  # (a path's '[/old]' is text: read as markup, a traceback)
    )


def _shown(value: object) -> str:
    """An option's value as `up` took it: a list of flags as one string, a switch as on or off,
    None as "default"."""
    if isinstance(value, bool):
        return "on" if value else "off"
    if isinstance(value, list):
        return repr(" ".join(map(str, value)))
    return "default" if value is None else str(value)


def _refuse_leftovers(state_dir: Path) -> None:
    """Exit 1 with one line where processes of an earlier cluster in `state_dir` outlived its
    supervisor (killed, or crashed): nothing restarts them, and a new cluster cannot start beside
    them (its etcd's data directory, its nodes' state are theirs). `up` said "already running" and
    exited 0, with no gateway answering."""
    from gpufaas.dev.local_cluster import recorded_pids
    from gpufaas.processes import pid_alive

    alive = [f"{name} (pid {pid})" for name, pid in recorded_pids(state_dir).items() if pid_alive(pid)]
    if alive:
        _refuse(
            f"the cluster in {state_dir} lost its supervisor, and {', '.join(alive)} still run(s): "
            "`gpufaas down` stops them, then `gpufaas up` starts the cluster again"
        )


def _refuse(line: str) -> NoReturn:
    """Exit 1 with `line` on stderr, as text (a path's '[/old]' is no markup)."""
    err_console.print(line, markup=False)
    raise typer.Exit(code=1)


def _check_balancer() -> None:
    """Several gateways stand behind HAProxy: say how to install it now, not as a failed start."""
    from gpufaas.dev.balancer import haproxy_binary

    try:
        haproxy_binary()
    except GpufaasError as exc:
        raise typer.BadParameter(str(exc), param_hint="--gateways") from None


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
    from gpufaas.policy_flags import checked_scheduler

    return checked_scheduler(scheduler, flags)


def _start_supervised(state_dir: Path, options: Mapping[str, Any], *, policy: str) -> None:
    """Start `python -m gpufaas.dev.local_cluster` with `options` in the background (it outlives this
    command) and wait until it says the cluster is up, or why it is not."""
    import subprocess

    from gpufaas.dev.local_cluster import SUPERVISOR_STATUS, LocalCluster, in_gateway, read_supervisor_status
    from gpufaas.logfiles import LOG_ROTATE_BYTES, rotate, tail_lines

    cluster = LocalCluster(state_dir, **options)
    state_dir.mkdir(parents=True, exist_ok=True)
    (state_dir / SUPERVISOR_STATUS).unlink(missing_ok=True)
    logs = state_dir / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    rotate(logs / "supervisor.log", LOG_ROTATE_BYTES)
    argv = [sys.executable, "-m", "gpufaas.dev.local_cluster", "--state-dir", str(state_dir)]
    with (logs / "supervisor.log").open("ab") as supervisor_log:
        supervisor = subprocess.Popen(
            [*argv, "--options", json.dumps(options)],
            stdin=subprocess.DEVNULL,
            stdout=supervisor_log,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives this command
        )
    starting = "starting etcd, the scheduler(s), the gateway(s) and the GPU managers..."
    try:
        with user_errors(), err_console.status(starting):
            while (status := read_supervisor_status(state_dir)).get("status") != "up":
                if status.get("status") == "failed" or supervisor.poll() is not None:
                    supervisor.wait()
                    tail = "\n".join(tail_lines(logs / "supervisor.log", 15))
                    raise GpufaasError(f"the cluster did not start: {status.get('error') or tail}")
                time.sleep(0.2)
    except KeyboardInterrupt:  # the supervisor is in a session of its own: it goes on
        _until_recorded(state_dir, supervisor)
        err_console.print("interrupted: the cluster goes on starting in the background; `gpufaas down` stops it")
        raise typer.Exit(code=130) from None
    gateways = f" (HAProxy over {cluster.gateways} gateways)" if cluster.gateways > 1 else ""
    schedulers = f", {cluster.schedulers} schedulers" if cluster.schedulers > 1 else ""
    inside = in_gateway(cluster)
    schedulers += f" ({' and '.join(inside)} in the gateway's process)" if inside else ""
    console.print(
        f"[bold green]gpufaas is up[/]: gateway {cluster.gateway_url}{gateways}{schedulers}, {cluster.nodes} "
        f"node(s) x {cluster.gpus_per_node} {cluster.backend} GPU(s), policy {policy}"
    )
    console.print(f"state: {escape(str(state_dir))}   logs: {escape(str(logs))}   (gpufaas logs \\[component])")
    console.print(
        f"credentials (mode 0600) in {escape(str(cluster.secrets.directory))}: admin-password (user admin: "
        "/system/*, and this CLI uses it), invoke-token (Authorization: Bearer, to call functions)"
    )
    console.print("stop it with `gpufaas down`")


def _until_recorded(state_dir: Path, supervisor: Any, timeout_s: float = 10.0) -> None:
    """Until the supervisor started in the background has recorded itself (pids.json), where
    `gpufaas down` finds it, or has exited: a down sent at once must not find nothing to stop."""
    from gpufaas.dev.local_cluster import recorded_pids

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and supervisor.poll() is None:
        if recorded_pids(state_dir).get("supervisor") == supervisor.pid:
            return
        time.sleep(0.05)


@app.command()
def down(state_dir: StateDir = state_dir_default()) -> None:  # noqa: B008
    """Stop exactly the processes `gpufaas up` started (by PID)."""
    from gpufaas.dev.local_cluster import stop_recorded

    stopped = stop_recorded(state_dir)
    if stopped:
        console.print(f"stopped {', '.join(stopped)}")
    else:
        console.print(f"nothing is running from {state_dir}", markup=False)


@app.command()
def status(state_dir: StateDir = state_dir_default(), gateway: GatewayOpt = None) -> None:  # noqa: B008
    """Say what runs: the local cluster's processes and whether the gateway answers."""
    from gpufaas.dev.local_cluster import recorded_pids
    from gpufaas.processes import pid_alive

    pids = recorded_pids(state_dir)
    info = cluster_info(state_dir)
    url = gateway_url(gateway, state_dir=state_dir)
    table = Table(title=f"local cluster in {escape(str(state_dir))}", title_justify="left")
    table.add_column("component")
    table.add_column("pid", justify="right")
    table.add_column("state")
    first_gateway = next(iter(info.get("gateways") or {}), "gateway")
    inside = ", ".join(info.get("in_gateway") or [])
    restarts = info.get("restarts")
    restarts = restarts if isinstance(restarts, dict) else {}
    stopped = [name for name, pid in pids.items() if not pid_alive(pid)]
    for name, pid in pids.items():
        label = f"{name} (with {inside} in its process)" if name == first_gateway and inside else name
        count = restarts.get(name, 0) if isinstance(restarts.get(name, 0), int) else 0
        state = "[red]stopped[/]" if name in stopped else "running"
        # The supervisor restarts what exits: one that crashes as it starts is "running" at most
        # reads of its PID, and only its count of restarts tells.
        table.add_row(label, str(pid), f"{state} [yellow](restarted {count}x)[/]" if count else state)
    if pids:
        console.print(table)
    else:
        # (`down` empties pids.json and leaves cluster.json: what_to_start below names the stopped one)
        recorded = "nothing of the local cluster runs" if info.get("gateway_url") else "no local cluster recorded"
        console.print(f"{recorded} in {state_dir}", markup=False)
    try:  # (the CLI's client: a gateway on this machine is reached directly, whatever http_proxy says)
        healthy = GatewayClient(url, timeout_s=3.0, password="").request("GET", "/healthz").status_code == 200
    except GpufaasError:  # not a URL at all, or nothing answers there
        healthy = False
    console.print(f"gateway {escape(url)}: {'[green]answers[/]' if healthy else '[red]does not answer[/]'}")
    if not healthy:
        console.print(what_to_start(url, state_dir), markup=False)
        raise typer.Exit(code=1)
    if stopped:  # (the gateway answers, yet part of the cluster is gone: etcd, a node, the scheduler)
        first = stopped[0]
        console.print(
            f"not running: {', '.join(stopped)}: `gpufaas logs {first}` says why; "
            "`gpufaas down` then `gpufaas up` starts the cluster again",
            markup=False,
        )
        raise typer.Exit(code=1)


def _nvml_finds_gpus() -> bool:
    try:
        from gpu_manager.devices import discover_nvml
    except ImportError:
        return False
    return bool(discover_nvml())
