"""gpufaas.settings: a daemon's command line and environment come from its settings model, and
the flags a launcher renders are read back as the same settings."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from gateway.settings import GatewaySettings
from gpu_manager.settings import NodeSettings
from gpufaas.settings import SettingsError, options_of
from scheduler.policies import PolicyConfig
from scheduler.settings import SchedulerSettings


def scheduler(*argv: str) -> SchedulerSettings:
    parser = SchedulerSettings.parser("python -m scheduler", "", raising=True)
    return SchedulerSettings.from_namespace(parser, parser.parse_args(list(argv)))


def test_every_policy_config_field_is_a_scheduler_flag() -> None:
    flags = {
        option.path[1]: option.flag for option in options_of(SchedulerSettings) if option.path[0] == "policy_config"
    }
    assert set(flags) == {field.name for field in dataclasses.fields(PolicyConfig)}
    assert flags["max_num_skips"] == "--o3-limit"  # the name the simulator and the deploy files use
    assert flags["mqfq_overrun_s"] == "--mqfq-overrun-s"


def test_the_flags_that_existed_keep_their_meaning() -> None:
    settings = scheduler(
        "--o3-limit", "7", "--mqfq-swap-out", "--no-interference-aware-loads", "--insecure", "--adaptive-slots", "3"
    )
    assert settings.policy_config == PolicyConfig(max_num_skips=7, mqfq_swap_out=True, interference_aware_loads=False)
    assert settings.insecure and settings.adaptive_slots == 3


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--prestage-nodes", "-1"], "--prestage-nodes must be >= 0"),
        (["--claim-s", "31"], "--claim-s must be <= 30"),
        (["--torpor-alpha-period-s", "0"], "--torpor-alpha-period-s must be > 0"),
        (["--policy", "nonsense"], "--policy: unknown scheduling policy 'nonsense'"),
        (["--eviction", "fifo"], "--eviction: unknown eviction policy 'fifo'"),
        (["--queue-capacity", "x"], "argument --queue-capacity: invalid int value: 'x'"),
        (["--bogus"], "unrecognized arguments: --bogus"),
        (["--etcd", "nohostport"], "--etcd: expected host:port, such as 127.0.0.1:2379; got 'nohostport'"),
        (["--etcd", "127.0.0.1:99999"], "--etcd: expected host:port"),
        # Each passed before, and failed once the daemon started, in a traceback: the bind's
        # int(port), the metrics server's ValueError, Keys' ValueError (after etcd was opened).
        (["--listen", "nohostport"], "--listen: expected host:port with a port of 0-65535"),
        (["--listen", "127.0.0.1:99999"], "--listen: expected host:port with a port of 0-65535"),
        (["--advertise", "scheduler-0"], "--advertise: expected host:port"),
        (["--metrics-listen", "9100"], "--metrics-listen: expected host:port"),
        (["--root", "gpufaas"], "--root: key root must start with '/'"),
        (["--root", "/gpufaas/"], "--root: key root must start with '/' and not end with it"),
    ],
)
def test_a_refused_value_names_its_flag(argv: list[str], says: str) -> None:
    with pytest.raises(SettingsError) as refused:
        scheduler(*argv)
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--node", "a/b"], "--node: a node name must be non-empty, printable and without '/'"),
        (["--node", ""], "--node: a node name must be"),
        (["--node", "n1\nforged log line"], "--node: a node name must be"),
        (["--listen", "nohostport"], "--listen: expected host:port"),
        (["--listen", "127.0.0.1:99999"], "--listen: expected host:port with a port of 0-65535"),
        (["--blob-listen", "127.0.0.1:x"], "--blob-listen: expected host:port"),
        (["--max-payload-mb", "inf"], "--max-payload-mb: Input should be a finite number"),
        (["--worker-cpus", "inf"], "--worker-cpus: Input should be a finite number"),
    ],
)
def test_a_node_flag_the_node_cannot_run_with_is_a_usage_error(tmp_path: Path, argv: list[str], says: str) -> None:
    # Each passed before, and failed later with a traceback: a key segment's ValueError at
    # registration, the server's bind, int(inf) making the daemon or each worker's cgroup quota.
    parser = NodeSettings.parser("python -m gpu_manager", "", raising=True)
    with pytest.raises(SettingsError) as refused:
        NodeSettings.from_namespace(parser, parser.parse_args(["--state-dir", str(tmp_path), *argv]))
    assert says in str(refused.value)


@pytest.mark.parametrize(
    ("argv", "says"),
    [
        (["--max-payload-mb", "inf"], "--max-payload-mb: Input should be a finite number"),
        (["--scheduler", "scheduler-0"], "--scheduler: expected host:port"),
        (["--blob-listen", "0.0.0.0"], "--blob-listen: expected host:port"),
        (["--root", "x"], "--root: key root must start with '/'"),
        # Passed before: the gateway registered http://HOST:0 as its URL and its blob holder name.
        (["--port", "0"], "--port 0 (any free port) needs --public-url"),
    ],
)
def test_a_gateway_flag_the_gateway_cannot_run_with_is_a_usage_error(
    tmp_path: Path, argv: list[str], says: str
) -> None:
    # Each passed before, and failed later in a traceback: int(inf) making the HTTP limits (an
    # OverflowError, not a ValidationError), Keys' ValueError, the dial or bind's int(port).
    parser = GatewaySettings.parser("python -m gateway", "", raising=True)
    with pytest.raises(SettingsError) as refused:
        GatewaySettings.from_namespace(parser, parser.parse_args(["--state-dir", str(tmp_path), *argv]))
    assert says in str(refused.value)


def test_the_environment_is_a_second_source_and_a_flag_wins(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GPUFAAS_SCHEDULER_POLICY", "lb")
    monkeypatch.setenv("GPUFAAS_SCHEDULER_POLICY_CONFIG__MQFQ_TTL_ALPHA", "3")
    monkeypatch.setenv("GPUFAAS_SECRET_FILE", "/run/secret")
    settings = scheduler()
    assert (settings.policy, settings.policy_config.mqfq_ttl_alpha) == ("lb", 3.0)
    assert settings.secret_file == Path("/run/secret")
    assert scheduler("--policy", "torpor").policy == "torpor"


@pytest.mark.parametrize(
    ("variable", "value", "says"),
    [
        ("GPUFAAS_SCHEDULER_POLICY_CONFIG__NOPE", "3", "no setting policy_config.nope"),
        ("GPUFAAS_SCHEDULER_POLICY_CONFIG", "x", 'field "policy_config"'),
    ],
)
def test_a_refused_environment_variable_is_one_line_naming_it(
    monkeypatch: pytest.MonkeyPatch, variable: str, value: str, says: str
) -> None:
    monkeypatch.setenv(variable, value)
    with pytest.raises(SettingsError) as refused:
        scheduler()
    assert says in str(refused.value) and "GPUFAAS_" in str(refused.value)


def test_rendered_flags_read_back_as_the_same_settings(tmp_path: Path) -> None:
    node = NodeSettings(
        state_dir=tmp_path, node="n1", runtime="docker", spares=0, unconfined_workers=True, pool_mb=0, worker_cpus=1.5
    )
    assert NodeSettings.from_args(node.to_argv(), "python -m gpu_manager", "") == node
    gateway = GatewaySettings(state_dir=tmp_path, port=8081, insecure=True, max_header_kb=16)
    assert GatewaySettings.from_args(gateway.to_argv(), "python -m gateway", "") == gateway
    knobs = SchedulerSettings(policy_config=PolicyConfig(room_aware_misses=False, torpor_alpha=0.25))
    assert knobs.to_argv() == ["--no-room-aware-misses", "--torpor-alpha", "0.25"]
    assert scheduler(*knobs.to_argv()) == knobs


def test_with_flags_puts_flags_over_settings_and_checks_them(tmp_path: Path) -> None:
    base = SchedulerSettings(policy="mqfq-sticky", slots="2")
    changed = base.with_flags(["--mqfq-overrun-s", "4", "--slots", "3"])
    assert (changed.policy, changed.slots, changed.policy_config.mqfq_overrun_s) == ("mqfq-sticky", "3", 4.0)
    with pytest.raises(SettingsError, match="--slots"):
        base.with_flags(["--slots", "0"])
