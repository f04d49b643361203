"""The deployment files stay valid and agree with the daemons: docker-compose.yml and its cpu
override deploy/compose.local-cpu.yml (rendered by `docker-compose config` where it is installed,
and parsed), the `monitoring` profile, deploy/k8s/*.yaml, the Dockerfiles, and every daemon
command line they (and README.md) hold, read by that daemon's settings model as the daemon reads it:
an unknown flag or a value the daemon would refuse fails here."""

from __future__ import annotations

import fnmatch
import functools
import os
import re
import shlex
import shutil
import stat
import subprocess
import sys
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from gateway.settings import GatewaySettings
from gpu_manager.settings import NodeSettings
from gpufaas.dev.balancer import BalancerConfig
from gpufaas.settings import DaemonSettings, SettingsError, options_of
from scheduler.settings import SchedulerSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "docker-compose.yml"
DEPLOY = ROOT / "deploy"
CPU_OVERRIDE = DEPLOY / "compose.local-cpu.yml"
K8S = DEPLOY / "k8s"
NAMESPACE = "gpufaas"

DAEMONS = ("scheduler", "gateway", "gpu_manager")
SETTINGS: dict[str, type[DaemonSettings]] = {
    "scheduler": SchedulerSettings,
    "gateway": GatewaySettings,
    "gpu_manager": NodeSettings,
}
GPU_MANAGERS = ("gpu-manager-0", "gpu-manager-1")
SCHEDULERS = ("scheduler-0", "scheduler-1")
GATEWAYS = ("gateway-0", "gateway-1")
LONG_RUNNING = {"etcd", *SCHEDULERS, *GATEWAYS, "balancer", *GPU_MANAGERS}
MONITORING = {"prometheus", "grafana"}  # the `monitoring` profile: started only when asked for
SERVICES = {"credentials", *LONG_RUNNING, *MONITORING}  # credentials: one-shot, makes the credential files
METRICS_PORT = 9100  # the scheduler's and the GPU managers' --metrics-listen, inside the compose network
HEALTHY, DONE = "service_healthy", "service_completed_successfully"
AFTER_THE_SCHEDULERS = {"credentials": DONE, "etcd": HEALTHY, **dict.fromkeys(SCHEDULERS, HEALTHY)}
# service -> the services it waits for, and for what
STARTS_AFTER: dict[str, dict[str, str]] = {
    "credentials": {},
    "etcd": {},
    **{name: {"credentials": DONE, "etcd": HEALTHY} for name in SCHEDULERS},
    **{name: AFTER_THE_SCHEDULERS for name in [*GATEWAYS, *GPU_MANAGERS]},
    "balancer": dict.fromkeys(GATEWAYS, HEALTHY),  # it resolves their names at start
    "prometheus": {"credentials": DONE},
    "grafana": {"credentials": DONE, "prometheus": "service_started"},
}
CREDENTIALS_DIR = "/run/gpufaas"
REQUIRED_FLAGS = {
    "scheduler": {"--etcd", "--listen", "--advertise", "--secret-file", "--etcd-password-file"},
    "gateway": {"--etcd", "--state-dir", "--host", "--secret-file", "--admin-password-file", "--etcd-password-file"},
}
REQUIRED_FLAGS["gpu_manager"] = {
    "--etcd",
    "--node",
    "--listen",
    "--advertise",
    "--state-dir",
    "--secret-file",
    "--etcd-password-file",
}
WORKLOAD_KINDS = {"Deployment", "StatefulSet", "DaemonSet"}
API_VERSIONS = {"Namespace": "v1", "Service": "v1", **dict.fromkeys(WORKLOAD_KINDS, "apps/v1")}
ETCD_ELECTION_TIMEOUT_MS = "500"  # etcd grants a 1 s lease as 1 s (2 s with its default 1000)
TLS_ROLE = {"scheduler": "scheduler", "gateway": "gateway", "gpu_manager": "node"}  # the certificate each presents
EXPECTED_KINDS = {
    "namespace.yaml": ["Namespace"],
    "etcd.yaml": ["Service", "StatefulSet"],
    "scheduler.yaml": ["Service", "Deployment"],
    "gateway.yaml": ["Service", "Service", "StatefulSet"],
    "gpu-manager.yaml": ["DaemonSet"],
}


# --- loading --------------------------------------------------------------------------------
@functools.cache
def compose() -> dict[str, Any]:
    loaded = yaml.safe_load(COMPOSE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def services() -> dict[str, Any]:
    return dict(compose()["services"])


@functools.cache
def manifests() -> dict[str, list[dict[str, Any]]]:
    return {
        path.name: [doc for doc in yaml.safe_load_all(path.read_text()) if doc]
        for path in sorted(K8S.glob("*.yaml"))
        if path.name != "kustomization.yaml"
    }


@functools.cache
def kustomization() -> dict[str, Any]:
    loaded = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    assert isinstance(loaded, dict)
    return loaded


def all_objects() -> list[dict[str, Any]]:
    return [doc for docs in manifests().values() for doc in docs]


def objects(kind: str) -> list[dict[str, Any]]:
    return [doc for doc in all_objects() if doc["kind"] == kind]


def workloads() -> list[dict[str, Any]]:
    return [doc for doc in all_objects() if doc["kind"] in WORKLOAD_KINDS]


def containers(workload: dict[str, Any]) -> list[dict[str, Any]]:
    return list(workload["spec"]["template"]["spec"]["containers"])


def flag_values(argv: list[str]) -> dict[str, str]:
    """`--flag value` and `--flag=value` pairs of a command line (a flag with no value maps to "")."""
    values: dict[str, str] = {}
    for i, token in enumerate(argv):
        if not token.startswith("--"):
            continue
        if "=" in token:
            flag, value = token.split("=", 1)
        else:
            following = argv[i + 1] if i + 1 < len(argv) else ""
            flag, value = token, ("" if following.startswith("--") else following)
        values[flag] = value
    return values


def daemon_of(argv: list[str]) -> str | None:
    """`python -m scheduler ...` -> "scheduler"."""
    if len(argv) >= 3 and argv[0].startswith("python") and argv[1] == "-m" and argv[2] in DAEMONS:
        return argv[2]
    return None


def command_lines() -> list[tuple[str, str, list[str]]]:
    """(where, daemon, argv) for every gpufaas daemon started by compose (and its cpu override) or
    a k8s manifest."""
    found: list[tuple[str, str, list[str]]] = []
    for path, compose_services in ((COMPOSE, services()), (CPU_OVERRIDE, cpu_override()["services"])):
        for name, service in compose_services.items():
            argv = [str(token) for token in service.get("command", [])]
            if (daemon := daemon_of(argv)) is not None:
                found.append((f"{path.name}:{name}", daemon, argv))
    for workload in workloads():
        for container in containers(workload):
            argv = [str(token) for token in [*container.get("command", []), *container.get("args", [])]]
            if (daemon := daemon_of(argv)) is not None:
                found.append((f"k8s {workload['kind']}/{workload['metadata']['name']}", daemon, argv))
    return found


def compose_command(name: str) -> dict[str, str]:
    return flag_values([str(token) for token in services()[name]["command"]])


def published_port(port: str | dict[str, Any]) -> tuple[int, int]:
    """(published, target) of a compose port: short "8080:8080" or long form (v1 and v2 render it so)."""
    if isinstance(port, dict):
        return int(port["published"]), int(port["target"])
    defaults = re.sub(r"\$\{\w+:-(\d+)\}", r"\1", str(port))  # "${GPUFAAS_GATEWAY_PORT:-8080}" -> "8080"
    published, target = defaults.rsplit("/", 1)[0].split(":")[-2:]
    return int(published), int(target)


def readme_command_lines() -> list[tuple[str, str, list[str]]]:
    """(where, daemon, argv) for every daemon command line README.md shows, a line of its own that
    starts `.venv/bin/python -m DAEMON` (continued at `\\`)."""
    text = (ROOT / "README.md").read_text().replace("\\\n", " ")
    found: list[tuple[str, str, list[str]]] = []
    for match in re.finditer(rf"^\.venv/bin/python -m ({'|'.join(DAEMONS)}) (.*)$", text, re.MULTILINE):
        argv = ["python", "-m", match[1], *shlex.split(match[2])]
        found.append((f"README.md:{match[1]}", match[1], argv))
    return found


def parsed(daemon: str, argv: list[str]) -> DaemonSettings:
    """What `python -m DAEMON argv...` runs with (its environment aside): its settings model reads
    the command line as the daemon does; an unknown flag or a refused value is a SettingsError."""
    model = SETTINGS[daemon]
    parser = model.parser(daemon, "", raising=True)
    return model.from_namespace(parser, parser.parse_args(argv[3:]))


# --- docker-compose.yml -----------------------------------------------------------------------
def docker_compose_config(*files: Path, profiles: tuple[str, ...] = ()) -> dict[str, Any]:
    """`docker-compose config` of `files` merged (the default port variables unset)."""
    binary = shutil.which("docker-compose")
    if binary is None:
        pytest.skip("docker-compose is not installed (CI: apt-get install -y docker-compose)")
    argv = [binary, "--project-directory", str(ROOT)]
    for path in files:
        argv += ["--file", str(path)]
    for profile in profiles:
        argv += ["--profile", profile]
    env = {k: v for k, v in os.environ.items() if not k.startswith("GPUFAAS_")}
    result = subprocess.run(
        [*argv, "config"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=120, check=False
    )
    assert result.returncode == 0, result.stderr
    rendered = yaml.safe_load(result.stdout)
    assert isinstance(rendered, dict)
    return rendered


def test_docker_compose_config_renders_the_file() -> None:
    rendered = docker_compose_config(COMPOSE, profiles=("monitoring",))
    assert set(rendered["services"]) == SERVICES
    assert {"etcd-data", "gateway-packages", "gateway-1-packages", "credentials", "prometheus-data"} <= set(
        rendered["volumes"]
    )
    for name in GPU_MANAGERS:
        devices = rendered["services"][name]["deploy"]["resources"]["reservations"]["devices"]
        assert any(d["driver"] == "nvidia" and "gpu" in d["capabilities"] for d in devices)
    assert (8080, 8080) in [published_port(port) for port in rendered["services"]["balancer"]["ports"]]
    for name, after in STARTS_AFTER.items():
        depends = rendered["services"][name].get("depends_on", {})
        assert {dep: cond["condition"] for dep, cond in depends.items()} == after


def test_compose_has_the_services() -> None:
    assert set(services()) == SERVICES
    for name, service in services().items():
        assert service.get("profiles", []) == (["monitoring"] if name in MONITORING else []), name


# --- deploy/compose.local-cpu.yml: the stack with no GPU and no image registry ----------------
@functools.cache
def cpu_override() -> dict[str, Any]:
    loaded = yaml.safe_load(CPU_OVERRIDE.read_text())
    assert isinstance(loaded, dict)
    return loaded


def test_cpu_override_names_only_base_services_and_local_images() -> None:
    overridden = cpu_override()["services"]
    assert set(overridden) <= set(services())
    for name in SERVICES - {"grafana"}:  # grafana has no local stand-in (the e2e script leaves it out)
        assert overridden[name]["image"].endswith(":local"), name
    for name in [*GATEWAYS, *SCHEDULERS, "balancer"]:
        assert set(overridden[name]) == {"image"}, "the override changes images and GPU managers' flags only"


@pytest.mark.parametrize("name", GPU_MANAGERS)
def test_cpu_override_runs_the_cpu_backend_with_the_base_flags(name: str) -> None:
    args = flag_values([str(token) for token in cpu_override()["services"][name]["command"]])
    assert args["--backend"] == "cpu"
    assert int(args["--gpu-memory-mb"]) >= 600, "the pytorch-custom template declares 600 MB"
    base = compose_command(name)
    assert set(base) - {"--backend"} <= set(args), "the cpu command drops none of the base's flags"
    for flag in base.keys() - {"--backend"}:
        assert args[flag] == base[flag], flag


def test_cpu_render_drops_the_gpu_reservations() -> None:
    """What deploy/compose-e2e.sh runs: the merged render without NVIDIA device reservations."""
    rendered = docker_compose_config(COMPOSE, CPU_OVERRIDE)
    result = subprocess.run(
        [sys.executable, str(DEPLOY / "drop_gpu_reservations.py")],
        input=yaml.safe_dump(rendered),
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
    )
    cpu = yaml.safe_load(result.stdout)
    assert set(cpu["services"]) == set(rendered["services"])
    for name in GPU_MANAGERS:
        assert "deploy" not in cpu["services"][name]
        assert cpu["services"][name]["image"] == "gpufaas/gpu-manager:local"
        assert "cpu" in cpu["services"][name]["command"]
    assert cpu["services"]["etcd"]["image"] == "gpufaas/etcd:local"
    unchanged = {name: {k: v for k, v in s.items() if k != "deploy"} for name, s in rendered["services"].items()}
    assert {name: s for name, s in cpu["services"].items()} == unchanged


def test_e2e_script_uses_the_override_and_cleans_up() -> None:
    script = (DEPLOY / "compose-e2e.sh").read_text()
    assert "compose.local-cpu.yml" in script and "drop_gpu_reservations.py" in script
    assert "trap cleanup EXIT" in script
    assert "down --volumes" in script
    # never an unpinned torch (it would pull several GB of CUDA packages)
    assert re.search(r"^TORCH=torch==\d+\.\d+\.\d+ ", (DEPLOY / "local-images.sh").read_text(), re.MULTILINE)


@pytest.mark.parametrize("name", sorted(LONG_RUNNING))
def test_every_service_has_a_healthcheck(name: str) -> None:
    check = services()[name].get("healthcheck")
    assert check, f"{name} has no healthcheck"
    if name.startswith(("scheduler", "gpu-manager")):  # its loop answers, not only its port
        assert "127.0.0.1:9100/healthz" in " ".join(check["test"]), f"{name}: {check['test']}"
    assert not check.get("disable", False)
    test = check["test"]
    assert isinstance(test, list) and test[0] in {"CMD", "CMD-SHELL"} and len(test) > 1
    if test[1] == "python" and test[2] == "-c":
        compile(test[3], f"{name} healthcheck", "exec")  # the inline check is valid Python


@pytest.mark.parametrize("name", sorted(SERVICES))
def test_services_start_in_health_order(name: str) -> None:
    depends = services()[name].get("depends_on", {})
    assert isinstance(depends, dict), "depends_on must use the long form with a condition"
    assert {dep: spec.get("condition") for dep, spec in depends.items()} == STARTS_AFTER[name]


def credentials_script() -> str:
    command = services()["credentials"]["command"]
    assert command[:2] == ["sh", "-ec"]
    return str(command[2])


def test_every_daemon_reads_its_credentials_from_the_volume_the_one_shot_service_fills() -> None:
    assert f"python -m gpufaas.credentials {CREDENTIALS_DIR}\n" in credentials_script()
    for name in sorted(LONG_RUNNING - {"etcd", "balancer"}):
        service = services()[name]
        mounts = {v.split(":")[1]: v for v in service["volumes"]}
        assert mounts[CREDENTIALS_DIR] == f"credentials:{CREDENTIALS_DIR}:ro", name
        args = compose_command(name)
        assert args["--secret-file"] == f"{CREDENTIALS_DIR}/cluster-secret", name
        assert args["--etcd-password-file"] == f"{CREDENTIALS_DIR}/etcd-password", name
        assert "--insecure" not in args, name
    for name in GATEWAYS:
        gateway = compose_command(name)
        assert gateway["--admin-password-file"] == f"{CREDENTIALS_DIR}/admin-password"
        assert gateway["--invoke-token-file"] == f"{CREDENTIALS_DIR}/invoke-token"


def test_the_credentials_service_writes_the_metrics_token_for_the_monitoring_group_only(tmp_path: Path) -> None:
    """Run the service's own script against a directory here: the metrics token is the one the
    daemons derive; it and the admin password are group-readable, the rest stays 0600."""
    from gpufaas.credentials import SecretFiles, metrics_token, read_secret

    directory = tmp_path / "gpufaas"
    script = credentials_script().replace(CREDENTIALS_DIR, str(directory)).replace("python ", f"{sys.executable} ")
    for _ in range(2):  # the service runs on every `up`: a second run keeps the credentials
        subprocess.run(["sh", "-ec", script], cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)}, check=True)
    files = SecretFiles(directory)
    token_file = directory / "metrics-token"
    assert token_file.read_text().strip() == metrics_token(read_secret(files.cluster_secret))
    mode = {path.name: stat.S_IMODE(path.stat().st_mode) for path in directory.iterdir()}
    assert mode == {
        "cluster-secret": 0o600,
        "etcd-password": 0o600,
        "invoke-token": 0o600,
        "admin-password": 0o640,
        "metrics-token": 0o640,
        "tls": 0o700,  # the cluster CA and the daemons' certificates (gpufaas.tls)
    }
    assert stat.S_IMODE(directory.stat().st_mode) == 0o750
    read_secret(files.admin_password)  # the daemons still accept it


@pytest.mark.parametrize("name", [*SCHEDULERS, *GPU_MANAGERS])
def test_metrics_listen_inside_the_compose_network(name: str) -> None:
    assert compose_command(name)["--metrics-listen"] == f"0.0.0.0:{METRICS_PORT}"
    assert "ports" not in services()[name]


@pytest.mark.parametrize("name", sorted(MONITORING))
def test_monitoring_services_read_credentials_as_the_daemons_group(name: str) -> None:
    service = services()[name]
    assert service["group_add"] == ["10001"]
    mounts = {v.split(":")[1]: v for v in service["volumes"]}
    assert mounts[CREDENTIALS_DIR] == f"credentials:{CREDENTIALS_DIR}:ro"
    for port in service["ports"]:
        assert str(port).startswith("127.0.0.1:"), "published on this host only"


def test_prometheus_service() -> None:
    prometheus = services()["prometheus"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in prometheus["volumes"]}
    assert mounts["/etc/prometheus/prometheus.yml"] == "./deploy/monitoring/prometheus.yml"
    assert "--config.file=/etc/prometheus/prometheus.yml" in prometheus["command"]
    assert mounts["/prometheus"] in compose()["volumes"]


def test_grafana_is_provisioned_with_the_dashboard_and_prometheus() -> None:
    grafana = services()["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in grafana["volumes"]}
    provisioning = ROOT / mounts["/etc/grafana/provisioning"]
    (source,) = yaml.safe_load((provisioning / "datasources" / "prometheus.yml").read_text())["datasources"]
    assert source["url"] == "http://prometheus:9090"
    (provider,) = yaml.safe_load((provisioning / "dashboards" / "gpufaas.yml").read_text())["providers"]
    assert mounts[provider["options"]["path"]] == "./deploy/monitoring/grafana"
    assert grafana["environment"]["GF_SECURITY_ADMIN_PASSWORD__FILE"] == f"{CREDENTIALS_DIR}/admin-password"


def test_the_balancer_and_the_blob_servers_are_published_on_this_host_only() -> None:
    assert services()["balancer"]["ports"] == ["127.0.0.1:${GPUFAAS_GATEWAY_PORT:-8080}:8080"]
    # Each gateway's blob server, for `gpufaas deploy` on this host; calls go through the balancer.
    assert services()["gateway-0"]["ports"] == ["127.0.0.1:${GPUFAAS_BLOB_PORT:-8081}:8081"]
    assert services()["gateway-1"]["ports"] == ["127.0.0.1:${GPUFAAS_BLOB_PORT_1:-8082}:8082"]


def test_etcd_service() -> None:
    etcd = services()["etcd"]
    assert re.fullmatch(r"quay\.io/coreos/etcd:v3\.5\.\d+", etcd["image"])
    args = flag_values([str(token) for token in etcd["command"]])
    assert args["--election-timeout"] == ETCD_ELECTION_TIMEOUT_MS, "1 s scheduler leases (docs/failover.md)"
    assert args["--listen-client-urls"] == "http://0.0.0.0:2379"
    assert args["--advertise-client-urls"] == "http://etcd:2379"
    data_dir = args["--data-dir"]
    volumes = {v.split(":")[1]: v.split(":")[0] for v in etcd["volumes"]}
    assert volumes.get(data_dir) in compose()["volumes"], "etcd's data dir must be a named volume"
    assert "etcdctl" in " ".join(etcd["healthcheck"]["test"]) and "endpoint" in etcd["healthcheck"]["test"]
    # `endpoint health` reads a key, which etcd refuses without a user once the daemons turn auth on.
    assert "status" in etcd["healthcheck"]["test"]


@pytest.mark.parametrize("name", SCHEDULERS)
def test_scheduler_service(name: str) -> None:
    args = compose_command(name)
    assert args["--etcd"] == "etcd:2379"
    assert args["--listen"] == "0.0.0.0:50051"
    assert args["--advertise"] == f"{name}:50051"
    assert "ports" not in services()[name], "the scheduler stays on the compose network"


@pytest.mark.parametrize("name", GATEWAYS)
def test_gateway_service(name: str) -> None:
    gateway = services()[name]
    args = compose_command(name)
    assert args["--etcd"] == "etcd:2379"
    assert (args["--host"], args["--port"]) == ("0.0.0.0", "8080")
    assert "--scheduler" not in args, "with several schedulers a gateway follows the one registered in etcd"
    assert args["--public-url"] == f"http://{name}:8080"
    # Nodes fetch blobs from the advertised address; the CLI, from the same port on this host.
    blob_port = int(args["--blob-listen"].rsplit(":", 1)[1])
    assert args["--blob-listen"] == f"0.0.0.0:{blob_port}" and args["--blob-advertise"] == f"http://{name}:{blob_port}"
    assert [published_port(port) for port in gateway["ports"]] == [(blob_port, blob_port)]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in gateway["volumes"]}
    assert mounts.get(args["--state-dir"]) in compose()["volumes"], "uploaded packages need a volume"
    assert "/healthz" in " ".join(gateway["healthcheck"]["test"])


def test_gateways_keep_their_packages_apart_and_serve_blobs_on_their_own_ports() -> None:
    volumes = [
        next(v for v in services()[name]["volumes"] if v.endswith(":/var/lib/gpufaas/gateway")) for name in GATEWAYS
    ]
    assert len(set(volumes)) == len(GATEWAYS)
    assert len({compose_command(name)["--blob-listen"] for name in GATEWAYS}) == len(GATEWAYS)


def test_the_balancer_runs_the_config_gpufaas_writes_for_the_gateways() -> None:
    """deploy/haproxy.cfg is what gpufaas.dev.balancer writes for compose's gateways (on a
    mismatch: write this test's `expected` to the file), mounted where the image reads it."""
    balancer = services()["balancer"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in balancer["volumes"]}
    config_path = mounts["/usr/local/etc/haproxy/haproxy.cfg"]
    assert config_path == "./deploy/haproxy.cfg" and "/usr/local/etc/haproxy/haproxy.cfg" in balancer["command"]
    gateways = {name: f"{name}:{compose_command(name)['--port']}" for name in GATEWAYS}
    expected = BalancerConfig(listen="0.0.0.0:8080", gateways=gateways, resolver="127.0.0.11:53").render()
    assert (DEPLOY / "haproxy.cfg").read_text() == expected
    # The gateways' liveness, not their readiness: /healthz needs the scheduler, which every gateway
    # loses at once during a leader change (HAProxy would then answer every call 503 itself).
    assert "option httpchk GET /livez\n" in expected and "/healthz" not in expected
    assert answers_without_credentials("api", "/livez"), "the gateways answer the balancer's check"
    assert [published_port(port) for port in balancer["ports"]] == [(8080, 8080)]
    assert "/balancer/livez" in " ".join(balancer["healthcheck"]["test"])


@pytest.mark.parametrize("name", GPU_MANAGERS)
def test_gpu_manager_service(name: str) -> None:
    manager = services()[name]
    args = compose_command(name)
    assert args["--etcd"] == "etcd:2379"
    assert args["--node"] == name
    assert args["--backend"] == "cuda"
    host, port = args["--listen"].rsplit(":", 1)
    assert host == "0.0.0.0"
    assert args["--advertise"] == f"{name}:{port}", "the scheduler dials the advertised address by service name"
    mounts = {v.split(":")[1]: v.split(":")[0] for v in manager["volumes"]}
    assert mounts.get(args["--state-dir"]) in compose()["volumes"]
    assert manager["build"]["dockerfile"] == "deploy/Dockerfile.gpu-manager"
    devices = manager["deploy"]["resources"]["reservations"]["devices"]
    assert len(devices) == 1
    device = devices[0]
    assert device["driver"] == "nvidia"
    assert "gpu" in device["capabilities"]
    assert ("count" in device) != ("device_ids" in device), "count and device_ids are exclusive"


def test_gpu_managers_take_different_gpus() -> None:
    reserved = []
    for name in GPU_MANAGERS:
        device = services()[name]["deploy"]["resources"]["reservations"]["devices"][0]
        reserved.append(tuple(device.get("device_ids", ())))
    assert all(reserved) and len(set(reserved)) == len(reserved), "two managers on one GPU"


def test_compose_builds_existing_dockerfiles() -> None:
    for name, service in services().items():
        if "build" in service:
            assert (ROOT / service["build"]["context"] / service["build"]["dockerfile"]).is_file(), name


# --- daemon flags ---------------------------------------------------------------------------
def test_every_daemon_is_started_somewhere() -> None:
    started = {daemon for _, daemon, _ in command_lines()}
    assert started == set(DAEMONS)


@pytest.mark.parametrize(
    ("where", "daemon", "argv"),
    [pytest.param(*line, id=line[0]) for line in [*command_lines(), *readme_command_lines()]],
)
def test_every_command_line_is_read_by_the_daemons_settings(where: str, daemon: str, argv: list[str]) -> None:
    """Every flag is a setting of the daemon's model with a value it takes (`$(POD_IP):50061`, a
    k8s substitution, is a string like any other)."""
    try:
        settings = parsed(daemon, argv)
    except SettingsError as exc:
        pytest.fail(f"{where}: python -m {daemon} would refuse it: {exc}")
    assert not settings.insecure and settings.secret_file is not None, f"{where} runs without credentials"


def test_readme_shows_every_daemon() -> None:
    assert {daemon for _, daemon, _ in readme_command_lines()} == set(DAEMONS)


# `docker compose run|exec` or `docker-compose run|exec`, with the flags before the service.
_COMPOSE_RUN = re.compile(r"(?:docker compose|docker-compose|\bcompose)\s+(?:run|exec)\b((?:\s+-[-\w]*)*)")


def captured_compose_commands() -> list[tuple[str, str]]:
    """(where, command) for every `compose run`/`exec` whose output a document's shell line
    captures (`$(...)`) or pipes on: the deploy docs, the compose file's comments, the e2e script."""
    found: list[tuple[str, str]] = []
    for path in [ROOT / "README.md", DEPLOY / "README.md", COMPOSE, DEPLOY / "compose-e2e.sh", *ROOT.glob("docs/*.md")]:
        for number, line in enumerate(path.read_text().splitlines(), 1):
            for match in _COMPOSE_RUN.finditer(line):
                before, after = line[: match.start()], line[match.end() :]
                if before.rstrip().endswith("$(") or "|" in after.split(")", 1)[0]:
                    found.append((f"{path.relative_to(ROOT)}:{number}", match[0]))
    return found


def test_compose_output_a_command_reads_comes_without_a_tty() -> None:
    """`docker-compose run`/`exec` (v1) give the command a TTY whenever stdin is a terminal, and
    a TTY ends lines with CRLF: `$(docker-compose run --rm credentials cat .../admin-password)`
    is the password and a carriage return, which the gateway refuses (401). `-T` gives none."""
    found = captured_compose_commands()
    assert any(where.startswith("deploy/README.md") for where, _ in found), "the matcher finds nothing"
    for where, command in found:
        assert re.search(r"\s(?:-T|--no-TTY)\b", command), f"{where}: {command} (add -T)"


def test_every_command_passes_the_required_flags() -> None:
    for where, daemon, argv in command_lines():
        assert REQUIRED_FLAGS[daemon] <= {option.flag for option in options_of(SETTINGS[daemon])}, daemon
        missing = REQUIRED_FLAGS[daemon] - set(flag_values(argv))
        assert not missing, f"{where}: {sorted(missing)}"


# --- Dockerfiles ----------------------------------------------------------------------------
def test_control_plane_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile.control-plane").read_text()
    assert re.search(r"^FROM python:3\.11-slim", text, re.MULTILINE)
    assert re.search(r"^USER (?!0\b|root\b)\S+", text, re.MULTILINE), "must run as non-root"
    assert re.search(r"^EXPOSE .*\b50051\b.*\b8080\b.*\b8081\b", text, re.MULTILINE)


def test_control_plane_requirements_leave_out_torch() -> None:
    """Run the Dockerfile's own requirements one-liner against pyproject.toml: torch is the
    `worker` extra's, which the control plane does not install."""
    text = (DEPLOY / "Dockerfile.control-plane").read_text()
    match = re.search(r'python -c "(import tomllib;.*?)" >', text)
    assert match, "requirements one-liner not found"
    code = match.group(1).replace("\\\\", "\\")  # sh's double quotes turn \\ into \
    result = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60, check=True
    )
    requirements = result.stdout.split()
    names = [re.split(r"[<>=!~;\[ ]", r)[0].lower() for r in requirements]
    assert "torch" not in names
    assert {"protobuf", "fastapi", "uvicorn", "aetcd"} <= set(names)
    assert "pip install --no-deps ." in text, "the project itself must not pull its extras"


def test_torch_is_the_worker_extra() -> None:
    """Only the GPU managers' workers need torch: it is an extra, which the gpu-manager image
    installs and the control-plane image does not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    names = [re.split(r"[<>=!~;\[ ]", r)[0].lower() for r in project["dependencies"]]
    assert "torch" not in names
    assert [r for r in project["optional-dependencies"]["worker"] if r.startswith("torch")]
    assert "'.[worker]'" in (DEPLOY / "Dockerfile.gpu-manager").read_text()
    assert "[worker]" not in (DEPLOY / "Dockerfile.control-plane").read_text()


def test_gpu_manager_dockerfile() -> None:
    text = (DEPLOY / "Dockerfile.gpu-manager").read_text()
    assert re.search(r"^ARG CUDA_IMAGE=nvidia/cuda:12\.\d+\.\d+-runtime-ubuntu22\.04$", text, re.MULTILINE)
    assert re.search(r"^FROM \$\{CUDA_IMAGE\}", text, re.MULTILINE)
    assert "python3.11" in text
    assert re.search(r"^ARG TORCH_VERSION=2\.13\.0$", text, re.MULTILINE)
    assert re.search(r"^ARG TORCH_INDEX_URL=\S+/cu\d+$", text, re.MULTILINE)
    assert re.search(r"^USER (?!0\b|root\b)\S+", text, re.MULTILINE), "must run as non-root"
    assert re.search(r"^EXPOSE .*\b50061\b", text, re.MULTILINE)


@pytest.mark.parametrize("dockerfile", ["Dockerfile.control-plane", "Dockerfile.gpu-manager"])
def test_dockerignore_keeps_what_the_build_needs(dockerfile: str) -> None:
    ignored = {
        line.strip()
        for line in (DEPLOY / f"{dockerfile}.dockerignore").read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    assert ".venv" in ignored and ".git" in ignored
    needed = {"pyproject.toml", "README.md", "gpufaas", "scheduler", "gateway", "gpu_manager", "cache_manager"}
    assert not needed & ignored


def dockerignore_patterns(path: Path) -> list[str]:
    """The patterns of an ignore file (comments and blank lines left out)."""
    return [line.strip() for line in path.read_text().splitlines() if line.strip() and not line.startswith("#")]


def ignored_by(patterns: list[str], path: str) -> bool:
    """Whether `path` (relative to the build context) is left out of it by `patterns`: a pattern
    leaves out what it matches and everything under it (`**/` matches any depth; no `!` here)."""
    parts = path.split("/")
    prefixes = ["/".join(parts[: i + 1]) for i in range(len(parts))]
    for pattern in patterns:
        assert not pattern.startswith("!"), "the matcher here does not read exceptions"
        bare = pattern.removeprefix("**/")
        candidates = [p.rsplit("/", 1)[-1] for p in prefixes] if bare != pattern else prefixes
        if any(fnmatch.fnmatchcase(candidate, bare) for candidate in candidates):
            return True
    return False


SECRETS_IN_THE_CHECKOUT = ("deploy/k8s/secrets/admin-password", "deploy/k8s/secrets/tls/ca-key.pem")


@pytest.mark.parametrize("dockerfile", ["Dockerfile.control-plane", "Dockerfile.gpu-manager"])
def test_every_builder_leaves_the_secrets_and_the_venv_out_of_the_image(dockerfile: str) -> None:
    """Only BuildKit reads `<Dockerfile>.dockerignore`; the classic builder (`docker build` before
    Docker 23 unless DOCKER_BUILDKIT=1, `DOCKER_BUILDKIT=0`) and other builders read the context's
    own `.dockerignore` alone. Without one, `COPY . ./` put the whole checkout in a layer of the
    image (the `rm -rf` after it frees nothing): .git, .venv and deploy/k8s/secrets/ (the cluster
    secret, the admin password, the CA's key) in every image pushed for Kubernetes."""
    root = ROOT / ".dockerignore"
    assert root.is_file(), "no .dockerignore at the build context's root: the classic builder copies everything"
    assert dockerignore_patterns(root) == dockerignore_patterns(DEPLOY / f"{dockerfile}.dockerignore")
    for patterns in (dockerignore_patterns(root), dockerignore_patterns(DEPLOY / f"{dockerfile}.dockerignore")):
        for path in (".git/config", ".venv/bin/python", *SECRETS_IN_THE_CHECKOUT, "gpufaas/__pycache__/x.pyc"):
            assert ignored_by(patterns, path), path
        for path in ("pyproject.toml", "README.md", "gpufaas/settings.py", "gateway/ui/index.html"):
            assert not ignored_by(patterns, path), path


# --- deploy/k8s -----------------------------------------------------------------------------
def test_kustomization_lists_every_manifest() -> None:
    listed = kustomization()["resources"]
    assert sorted(listed) == sorted(manifests()), "kustomization.yaml and deploy/k8s/*.yaml differ"
    assert len(listed) == len(set(listed))
    assert kustomization()["namespace"] == NAMESPACE


@pytest.mark.parametrize(("filename", "kinds"), sorted(EXPECTED_KINDS.items()))
def test_manifest_kinds(filename: str, kinds: list[str]) -> None:
    assert [doc["kind"] for doc in manifests()[filename]] == kinds
    for doc in manifests()[filename]:
        assert doc["apiVersion"] == API_VERSIONS[doc["kind"]], f"{filename}: {doc['kind']} {doc['apiVersion']}"
        assert doc["metadata"].get("name")


def test_pods_are_well_formed() -> None:
    """What the API server would refuse or a container would start without: a mount of a volume
    the pod lacks, a volume nothing mounts, a port name that is not an IANA service name (at
    most 15 characters: a-z, 0-9, -), or repeated, and a `$(VAR)` the container's env lacks
    (Kubernetes then passes it on as it is)."""
    for workload in workloads():
        pod = workload["spec"]["template"]["spec"]
        volumes = {volume["name"] for volume in pod.get("volumes", [])}
        claims = {claim["metadata"]["name"] for claim in workload["spec"].get("volumeClaimTemplates", [])}
        mounted: set[str] = set()
        for container in containers(workload):
            where = f"{workload['kind']}/{workload['metadata']['name']}/{container['name']}"
            names = {mount["name"] for mount in container.get("volumeMounts", [])}
            assert names <= volumes | claims, f"{where} mounts {sorted(names - volumes - claims)}, which the pod lacks"
            mounted |= names
            ports = [port["name"] for port in container.get("ports", []) if "name" in port]
            assert len(ports) == len(set(ports)), f"{where}: port names repeat"
            for name in ports:
                assert re.fullmatch(r"(?=.*[a-z])[a-z0-9]([a-z0-9-]{0,13}[a-z0-9])?", name), f"{where}: port {name}"
            env = {variable["name"] for variable in container.get("env", [])}
            argv = [str(token) for token in [*container.get("command", []), *container.get("args", [])]]
            used = {name for token in argv for name in re.findall(r"\$\((\w+)\)", token)}
            assert used <= env, f"{where} uses $({', $('.join(sorted(used - env))}) without defining it in env"
        assert volumes | claims <= mounted, (
            f"{workload['metadata']['name']}: {sorted(volumes | claims - mounted)} unmounted"
        )


def test_one_namespace_everywhere() -> None:
    (namespace,) = objects("Namespace")
    assert namespace["metadata"]["name"] == NAMESPACE
    for doc in all_objects():
        if doc["kind"] != "Namespace":
            assert doc["metadata"].get("namespace") == NAMESPACE, f"{doc['kind']}/{doc['metadata']['name']}"


def test_every_container_has_probes_and_resource_limits() -> None:
    assert {w["kind"] for w in workloads()} == WORKLOAD_KINDS
    for workload in workloads():
        for container in containers(workload):
            where = f"{workload['kind']}/{workload['metadata']['name']}/{container['name']}"
            assert container.get("livenessProbe"), f"{where}: no livenessProbe"
            assert container.get("readinessProbe"), f"{where}: no readinessProbe"
            resources = container.get("resources", {})
            assert {"cpu", "memory"} <= set(resources.get("limits", {})), f"{where}: no cpu/memory limits"
            assert {"cpu", "memory"} <= set(resources.get("requests", {})), f"{where}: no cpu/memory requests"
            named_ports = {port.get("name") for port in container.get("ports", [])}
            numbers = {port["containerPort"] for port in container.get("ports", [])}
            for probe in (container["livenessProbe"], container["readinessProbe"]):
                handler = probe.get("httpGet") or probe.get("tcpSocket")
                if handler is not None:
                    assert handler["port"] in named_ports | numbers, f"{where}: probe port {handler['port']}"


def listeners(daemon: str, argv: list[str]) -> dict[int, str]:
    """Port -> what the daemon serves there: "api" (the gateway's HTTP API), "metrics" (the
    metrics listener, HTTP), "wire" or "blobs" (not HTTP probes' business)."""
    settings = parsed(daemon, argv)
    found: dict[int, str] = {}
    for kind, address in (
        ("wire", getattr(settings, "listen", None)),
        ("blobs", getattr(settings, "blob_listen", None)),
        ("metrics", getattr(settings, "metrics_listen", None)),
    ):
        if address is not None:
            found[int(address.rsplit(":", 1)[1])] = kind
    if isinstance(settings, GatewaySettings):
        found[settings.port] = "api"
    return found


def answers_without_credentials(listener: str, path: str) -> bool:
    """Whether GET `path` with no credentials (as a probe or a healthcheck sends it) is answered
    by that listener: a route of the gateway's that its auth leaves open, or the metrics
    listener's own answer (200), asked of its ASGI app."""
    path = path.split("?", 1)[0]
    if listener == "api":
        from gateway.auth import OPEN_PATHS
        from gateway.routes import cluster, dashboard, functions, health, packages

        routes = [
            route for module in (health, packages, functions, cluster, dashboard) for route in module.router.routes
        ]
        return path in OPEN_PATHS and any(
            route.path_regex.fullmatch(path) and "GET" in route.methods
            for route in routes  # type: ignore[attr-defined]
        )
    if listener != "metrics":
        return False
    import asyncio

    from prometheus_client import CollectorRegistry

    from gpufaas.metrics import MetricsServer

    statuses: list[int] = []

    async def receive() -> dict[str, Any]:
        return {"type": "http.request", "body": b"", "more_body": False}

    async def send(message: dict[str, Any]) -> None:
        if message["type"] == "http.response.start":
            statuses.append(message["status"])

    server = MetricsServer(CollectorRegistry(), token="token")
    scope = {"type": "http", "method": "GET", "path": path, "query_string": b"", "headers": []}
    asyncio.run(server._app(scope, receive, send))
    return statuses == [200]


_HEALTHCHECK_URL = re.compile(r"http://(?:127\.0\.0\.1|localhost):(\d+)(/[^'\"\s]*)")


def probes() -> list[tuple[str, str, list[str], dict[str, Any]]]:
    """(where, daemon, argv, probe) for every probe of a gpufaas daemon: each k8s container's
    (its port resolved to a number) and each compose healthcheck's URL, as an httpGet."""
    found: list[tuple[str, str, list[str], dict[str, Any]]] = []
    for workload in workloads():
        for container in containers(workload):
            argv = [str(token) for token in [*container.get("command", []), *container.get("args", [])]]
            if (daemon := daemon_of(argv)) is None:
                continue
            numbers = {port["name"]: port["containerPort"] for port in container.get("ports", []) if "name" in port}
            for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
                for handler, probe in container.get(kind, {}).items():
                    if handler in {"httpGet", "tcpSocket"}:
                        port = numbers.get(probe["port"], probe["port"])
                        found.append(
                            (
                                f"k8s {workload['metadata']['name']} {kind}",
                                daemon,
                                argv,
                                {handler: {**probe, "port": port}},
                            )
                        )
    for name, service in services().items():
        argv = [str(token) for token in service.get("command", [])]
        if (daemon := daemon_of(argv)) is None:
            continue
        for port, path in _HEALTHCHECK_URL.findall(" ".join(service["healthcheck"]["test"])):
            found.append((f"compose {name} healthcheck", daemon, argv, {"httpGet": {"port": int(port), "path": path}}))
    return found


@pytest.mark.parametrize(("where", "daemon", "argv", "probe"), [pytest.param(*p, id=p[0]) for p in probes()])
def test_every_probe_asks_a_port_and_path_its_daemon_serves(
    where: str, daemon: str, argv: list[str], probe: dict[str, Any]
) -> None:
    """Each probe reaches a port the daemon's own flags make it listen on and, over HTTP, a path
    that listener answers without credentials: a renamed flag, port or route fails here, not as
    pods restarted for ever or containers that never become healthy."""
    serving = listeners(daemon, argv)
    ((handler, spec),) = probe.items()
    assert spec["port"] in serving, f"{where}: port {spec['port']}, but python -m {daemon} listens on {serving}"
    if handler == "httpGet":
        listener = serving[spec["port"]]
        assert answers_without_credentials(listener, spec["path"]), (
            f"{where}: GET {spec['path']} on its {listener} port"
        )


def test_every_daemon_is_probed() -> None:
    assert {(where.split()[0], daemon) for where, daemon, _, _ in probes()} == {
        (place, daemon) for place in ("k8s", "compose") for daemon in DAEMONS
    }


def test_k8s_daemons_dial_etcd_at_a_service_port_that_reaches_it() -> None:
    """Every daemon's --etcd endpoint names a Service of these manifests, at a port it has, whose
    target is etcd's --listen-client-urls port."""
    (etcd,) = [w for w in workloads() if w["metadata"]["name"] == "etcd"]
    (container,) = containers(etcd)
    client_port = int(flag_values(container["args"])["--listen-client-urls"].rsplit(":", 1)[1])
    named = {port.get("name"): port["containerPort"] for port in container["ports"]}
    service_ports = {
        (service["metadata"]["name"], port["port"]): named.get(port.get("targetPort"), port.get("targetPort"))
        for service in objects("Service")
        if service["spec"]["selector"].items() <= etcd["spec"]["template"]["metadata"]["labels"].items()
        for port in service["spec"]["ports"]
    }
    for where, _, argv in command_lines():
        if where.startswith("k8s"):
            for endpoint in flag_values(argv)["--etcd"].split(","):
                host, port = endpoint.rsplit(":", 1)
                assert service_ports.get((host, int(port))) == client_port, f"{where}: --etcd {endpoint}"


def test_workload_selectors_match_their_pods() -> None:
    for workload in workloads():
        selector = workload["spec"]["selector"]["matchLabels"]
        labels = workload["spec"]["template"]["metadata"]["labels"]
        assert selector.items() <= labels.items(), workload["metadata"]["name"]


@pytest.mark.parametrize(
    ("service", "ports"),
    [("etcd", {2379, 2380}), ("scheduler", {50051, 9100}), ("gateway", {8080}), ("gateway-pods", {8080, 8081})],
)
def test_service_ports_reach_a_container(service: str, ports: set[int]) -> None:
    (svc,) = [s for s in objects("Service") if s["metadata"]["name"] == service]
    assert {port["port"] for port in svc["spec"]["ports"]} == ports
    pods = [
        w for w in workloads() if svc["spec"]["selector"].items() <= w["spec"]["template"]["metadata"]["labels"].items()
    ]
    assert len(pods) == 1, f"Service {service} selects {len(pods)} workloads"
    container_ports = {
        key: port["containerPort"]
        for container in containers(pods[0])
        for port in container.get("ports", [])
        for key in (port.get("name"), port["containerPort"])
    }
    for port in svc["spec"]["ports"]:
        assert container_ports.get(port.get("targetPort", port["port"])) == port["port"], f"{service}:{port['port']}"


def test_no_daemons_state_directory_is_a_volumes_root() -> None:
    # Kubernetes mounts an emptyDir or a fresh claim owned by root (group: the pod's fsGroup), and
    # only a directory's owner may change its mode: a daemon running as 10001 that makes its state
    # directory private (the gateway 0700, the node 0711) could not start on the volume's root.
    checked = 0
    for workload in workloads():
        for container in containers(workload):
            state_dir = flag_values(container.get("args", [])).get("--state-dir")
            if state_dir is None:
                continue
            mounts = {mount["mountPath"].rstrip("/") for mount in container.get("volumeMounts", [])}
            assert state_dir.rstrip("/") not in mounts, f"{workload['metadata']['name']}: --state-dir {state_dir}"
            assert any(state_dir.startswith(f"{mount}/") for mount in mounts), f"{state_dir} is on no volume"
            checked += 1
    assert checked == 2  # the gateway's and the node's


def test_etcd_statefulset() -> None:
    (statefulset,) = [s for s in objects("StatefulSet") if s["metadata"]["name"] == "etcd"]
    (headless,) = [s for s in objects("Service") if s["metadata"]["name"] == statefulset["spec"]["serviceName"]]
    assert headless["spec"]["clusterIP"] == "None"
    assert statefulset["spec"]["volumeClaimTemplates"], "etcd needs persistent storage"
    (container,) = containers(statefulset)
    assert container["image"] == services()["etcd"]["image"], "compose and k8s run the same etcd"
    claim = statefulset["spec"]["volumeClaimTemplates"][0]["metadata"]["name"]
    assert claim in {mount["name"] for mount in container["volumeMounts"]}
    assert flag_values(container["args"])["--election-timeout"] == ETCD_ELECTION_TIMEOUT_MS, "as compose's"


def test_two_schedulers_elect_their_leader_as_in_compose() -> None:
    """As many schedulers as compose runs, each registering its own pod's address in the leader
    election (a shared Service name would have every gateway dial whichever pod it balanced to)."""
    (deployment,) = [d for d in objects("Deployment") if d["metadata"]["name"] == "scheduler"]
    assert deployment["spec"]["replicas"] == len(SCHEDULERS) == 2
    assert deployment["spec"]["strategy"]["rollingUpdate"]["maxSurge"] == 0, "never more schedulers than replicas"
    (container,) = containers(deployment)
    args = flag_values(container["args"])
    assert args["--advertise"] == f"$(POD_IP):{args['--listen'].rsplit(':', 1)[1]}"
    assert args["--name"] == "$(POD_NAME)"
    assert pod_env(container) == {"POD_NAME": "metadata.name", "POD_IP": "status.podIP"}
    (service,) = [s for s in objects("Service") if s["metadata"]["name"] == "scheduler"]
    assert service["spec"]["clusterIP"] == "None", "nothing may be balanced over a leader and a standby"
    assert "tcpSocket" in container["readinessProbe"]
    assert_liveness_asks_the_event_loop(container)


def pod_env(container: dict[str, Any]) -> dict[str, str | None]:
    return {e["name"]: e.get("valueFrom", {}).get("fieldRef", {}).get("fieldPath") for e in container["env"]}


def assert_liveness_asks_the_event_loop(container: dict[str, Any]) -> None:
    """A stopped or stalled daemon still accepts TCP connections (the kernel completes them): its
    liveness probe must ask /healthz on the metrics listener, answered by the daemon's own loop."""
    probe = container["livenessProbe"]["httpGet"]
    assert probe["path"] == "/healthz" and probe["port"] == "metrics"
    assert "--metrics-listen=0.0.0.0:9100" in container["args"]
    assert {"name": "metrics", "containerPort": 9100} in container["ports"]


def test_several_gateways_each_with_its_packages_and_addresses_as_in_compose() -> None:
    (gateways,) = [d for d in objects("StatefulSet") if d["metadata"]["name"] == "gateway"]
    assert gateways["spec"]["replicas"] == len(GATEWAYS) > 1
    (container,) = containers(gateways)
    assert container["readinessProbe"]["httpGet"]["path"] == "/healthz"  # reaches the scheduler and etcd
    assert container["livenessProbe"]["httpGet"]["path"] == "/livez"  # not restarted for another's outage"
    args = flag_values(container["args"])
    assert "--scheduler" not in args, "with several schedulers a gateway follows the one registered in etcd"
    mounts = {mount["mountPath"]: mount["name"] for mount in container["volumeMounts"]}
    claims = {claim["metadata"]["name"] for claim in gateways["spec"]["volumeClaimTemplates"]}
    on = [volume for path, volume in mounts.items() if args["--state-dir"].startswith(f"{path}/")]
    assert on and on[0] in claims, "each gateway keeps its packages on a volume of its own"
    # Each registers its own stable name, which the headless Service publishes even before it is ready.
    (pods,) = [s for s in objects("Service") if s["metadata"]["name"] == gateways["spec"]["serviceName"]]
    assert pods["spec"]["clusterIP"] == "None" and pods["spec"]["publishNotReadyAddresses"]
    host = f"$(POD_NAME).{pods['metadata']['name']}"
    assert args["--public-url"] == f"http://{host}:{args['--port']}"
    assert args["--blob-advertise"] == f"http://{host}:{args['--blob-listen'].rsplit(':', 1)[1]}"
    assert pod_env(container) == {"POD_NAME": "metadata.name"}


def secret_keys(secrets: Path) -> dict[str, Path]:
    """The Secret kustomization.yaml's generator makes: key -> the file under `secrets` it holds."""
    (generator,) = kustomization()["secretGenerator"]
    keys: dict[str, Path] = {}
    for entry in generator["files"]:
        key, _, path = entry.rpartition("=")
        keys[key or Path(path).name] = secrets / Path(path).relative_to("secrets")
    return keys


@pytest.mark.parametrize("name", ["scheduler", "gateway", "gpu-manager"])
def test_each_workload_gets_the_credentials_and_tls_files_its_daemon_loads(name: str, tmp_path: Path) -> None:
    """Make the credentials as the kustomization's comment says, build the Secret from them, lay out
    the workload's volume as the kubelet would (its items, its mode) and start the daemon's settings
    on it: every credential file it names is there, and it finds its role's TLS files and loads them
    (links are TLS by default: a daemon without them would talk in clear)."""
    from gpufaas.credentials import main as make_credentials
    from gpufaas.service_main import tls_directory
    from gpufaas.tls import LinkTls

    assert make_credentials([str(tmp_path / "secrets")]) == 0
    keys = secret_keys(tmp_path / "secrets")
    assert all(path.is_file() for path in keys.values()), "the generator names a file the credentials lack"
    (workload,) = [w for w in workloads() if w["metadata"]["name"] == name]
    (container,) = containers(workload)
    (mount,) = [m for m in container["volumeMounts"] if m["name"] == "credentials"]
    (volume,) = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == "credentials"]
    mounted = tmp_path / "mounted"
    for item in volume["secret"]["items"]:
        target = mounted / item["path"]
        target.parent.mkdir(parents=True, exist_ok=True)
        target.write_bytes(keys[item["key"]].read_bytes())
        target.chmod(volume["secret"]["defaultMode"])
    argv = [str(token) for token in [*container["command"], *container["args"]]]
    daemon = daemon_of(argv)
    assert daemon is not None
    argv = [token.replace(mount["mountPath"], str(mounted)) for token in argv]
    for flag, value in flag_values(argv).items():
        if flag.endswith("-file"):
            assert Path(value).is_file(), f"{name}: {flag} {value} is not in its volume"
    model = SETTINGS[daemon]
    parser = model.parser(daemon, "", raising=True)
    settings = model.from_namespace(parser, parser.parse_args(argv[3:]))
    directory = tls_directory(parser, settings, TLS_ROLE[daemon])
    assert directory == mounted / "tls", f"{name} would run its links without TLS"
    LinkTls.load(directory, TLS_ROLE[daemon])
    assert "ca-key.pem" not in {Path(key).name for key in keys}, "no pod signs certificates: the CA key stays out"


def test_gpu_manager_daemonset() -> None:
    (daemonset,) = objects("DaemonSet")
    pod = daemonset["spec"]["template"]["spec"]
    (container,) = containers(daemonset)
    assert int(container["resources"]["limits"]["nvidia.com/gpu"]) >= 1
    assert pod.get("nodeSelector") or pod.get("affinity"), "must run only on GPU nodes"
    assert any(t.get("key") == "nvidia.com/gpu" for t in pod.get("tolerations", []))
    assert pod_env(container) == {"NODE_NAME": "spec.nodeName", "POD_IP": "status.podIP"}
    args = flag_values(container["args"])
    assert args["--node"] == "$(NODE_NAME)"
    port = args["--listen"].rsplit(":", 1)[1]
    assert args["--advertise"] == f"$(POD_IP):{port}"
    assert args["--backend"] == "cuda"
    assert int(port) in {p["containerPort"] for p in container["ports"]}
    assert_liveness_asks_the_event_loop(container)
    # /healthz answers once the spares' CUDA contexts are made: the liveness probe (about 15 s of
    # silence) must not restart a node still starting; a startup probe holds it off for minutes.
    startup = container["startupProbe"]
    assert startup["httpGet"] == container["livenessProbe"]["httpGet"]
    assert startup["periodSeconds"] * startup["failureThreshold"] >= 300
    assert pod["shareProcessNamespace"] is True  # the pause process reaps orphans, not the node


def test_gpu_managers_run_under_an_init_process_in_compose() -> None:
    # A worker's own children outlive it as orphans of PID 1; the node (PID 1 without init) never
    # waits for them, and their zombies hold PIDs of the container's pids limit.
    managers = [name for name in services() if name.startswith("gpu-manager")]
    assert managers
    for name in managers:
        assert services()[name].get("init") is True, name


def test_k8s_images_match_compose_images() -> None:
    # Kubernetes' Service balances over the gateways: no HAProxy there.
    compose_images = {
        s["image"].rsplit(":", 1)[0] for name, s in services().items() if name not in {*MONITORING, "balancer"}
    }
    k8s_images = {c["image"].rsplit(":", 1)[0] for w in workloads() for c in containers(w)}
    assert k8s_images == compose_images
    overridable = {image["name"] for image in kustomization().get("images", [])}
    assert k8s_images - {"quay.io/coreos/etcd"} <= overridable


def test_prometheus_scrapes_each_daemon_where_compose_makes_it_listen() -> None:
    """Every target of deploy/monitoring/prometheus.yml is a compose service listening on that
    port (--metrics-listen, or the gateway's own --port), with the credential that port asks for."""
    config = yaml.safe_load((DEPLOY / "monitoring" / "prometheus.yml").read_text())
    listening: dict[str, str] = {}  # "service:port" -> the credential file it asks for
    for name, service in services().items():
        command = [str(part) for part in service.get("command", [])]
        if "--metrics-listen" in command:
            port = command[command.index("--metrics-listen") + 1].rsplit(":", 1)[1]
            listening[f"{name}:{port}"] = f"{CREDENTIALS_DIR}/metrics-token"
        if "gateway" in command and "--port" in command:
            listening[f"{name}:{command[command.index('--port') + 1]}"] = f"{CREDENTIALS_DIR}/admin-password"
    scraped = {
        target: job["authorization"]["credentials_file"]
        for job in config["scrape_configs"]
        for group in job["static_configs"]
        for target in group["targets"]
    }
    assert scraped == listening


def test_kubernetes_exposes_the_same_metrics_as_compose() -> None:
    """The scheduler and the GPU managers listen for Prometheus on the port compose uses, announce
    it for pod discovery, and the Secret carries the token they ask for."""
    compose_ports = {
        str(service["command"][service["command"].index("--metrics-listen") + 1]).rsplit(":", 1)[1]
        for service in services().values()
        if "--metrics-listen" in [str(part) for part in service.get("command", [])]
    }
    (port,) = compose_ports
    for name in ("scheduler", "gpu-manager"):
        (workload,) = [w for w in workloads() if w["metadata"]["name"] == name]
        (container,) = containers(workload)
        assert f"--metrics-listen=0.0.0.0:{port}" in container["args"]
        assert {"name": "metrics", "containerPort": int(port)} in container["ports"]
        annotations = workload["spec"]["template"]["metadata"]["annotations"]
        assert annotations == {"prometheus.io/scrape": "true", "prometheus.io/port": port}
    kustomization = yaml.safe_load((K8S / "kustomization.yaml").read_text())
    (generator,) = kustomization["secretGenerator"]
    assert "secrets/metrics-token" in generator["files"]


def _seconds(value: str | int) -> float:
    """A compose duration ("45s", "1m30s") or a k8s count of seconds, in seconds."""
    if isinstance(value, int):
        return float(value)
    parts = re.fullmatch(r"(?:(\d+)m)?(?:(\d+)s)?", value)
    assert parts is not None and value, f"not a duration: {value!r}"
    return 60.0 * int(parts[1] or 0) + int(parts[2] or 0)


def test_every_gpu_manager_is_given_longer_to_stop_than_its_drain() -> None:
    # A node drains on SIGTERM for up to --drain-timeout-s; the SIGKILL that follows the grace
    # (compose's stop_grace_period, k8s terminationGracePeriodSeconds) must come after it, or the
    # calls still running there are cut off, which the drain exists to avoid.
    checked: list[str] = []
    for name, service in services().items():
        argv = [str(token) for token in service.get("command", [])]
        if daemon_of(argv) == "gpu_manager":
            grace_s = _seconds(service.get("stop_grace_period", "10s"))  # (Docker's default)
            drain_s = parsed("gpu_manager", argv).drain_timeout_s
            assert grace_s > drain_s, f"compose {name}: {grace_s:g} s to stop, but it may drain for {drain_s:g} s"
            checked.append(name)
    for workload in workloads():
        pod = workload["spec"]["template"]["spec"]
        for container in containers(workload):
            argv = [str(token) for token in [*container.get("command", []), *container.get("args", [])]]
            if daemon_of(argv) == "gpu_manager":
                grace_s = _seconds(pod.get("terminationGracePeriodSeconds", 30))  # (Kubernetes' default)
                drain_s = parsed("gpu_manager", argv).drain_timeout_s
                where = f"k8s {workload['metadata']['name']}"
                assert grace_s > drain_s, f"{where}: {grace_s:g} s to stop, but it may drain for {drain_s:g} s"
                checked.append(where)
    assert len(checked) >= 3, f"GPU managers found in the deploy files: {checked}"
