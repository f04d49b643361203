"""The user's path through the real `gpufaas` CLI, as a subprocess: up, new, deploy, invoke, gpus, rm, down."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import yaml

from gpufaas.dev.local_cluster import free_port, recorded_pids, stop_recorded
from gpufaas.processes import descendants, pid_alive, survivors
from tests.integration.test_control_plane import wait_for

pytestmark = pytest.mark.integration


def gpufaas(*args: str, env: dict[str, str], cwd: Path, stdin: str | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "gpufaas.cli", *args],
        env=env,
        cwd=cwd,
        input=stdin,
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )


@pytest.fixture
def cli_env(tmp_path: Path) -> dict[str, str]:
    env = dict(os.environ)
    env["GPUFAAS_STATE_DIR"] = str(tmp_path / "state")
    env.pop("GPUFAAS_URL", None)
    env["COLUMNS"] = "200"
    return env


def answers(url: str) -> bool:
    """Whether `url` answers 200 now (a restarted gateway listens a moment after its process starts)."""
    with contextlib.suppress(httpx.HTTPError):
        return httpx.get(url, timeout=2).status_code == 200
    return False


def test_up_new_deploy_invoke_gpus_rm_down(tmp_path: Path, cli_env: dict[str, str]) -> None:
    state = tmp_path / "state"
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    try:
        up = gpufaas(
            "up",
            "--backend",
            "cpu",
            "--nodes",
            "1",
            "--gpus-per-node",
            "2",
            "--gpu-memory-mb",
            "2000",
            "--port",
            str(port),
            env=cli_env,
            cwd=tmp_path,
        )
        assert up.returncode == 0, up.stderr
        assert "gpufaas is up" in up.stdout and str(state) in up.stdout
        again = gpufaas("up", "--backend", "cpu", "--port", str(port), env=cli_env, cwd=tmp_path)
        assert again.returncode == 0 and "already running" in again.stdout

        work = tmp_path / "work"
        work.mkdir()
        created = gpufaas("new", "hello", "--template", "pytorch-custom", env=cli_env, cwd=work)
        assert created.returncode == 0, created.stderr
        assert (work / "hello" / "handler.py").is_file() and (work / "hello" / "weights.safetensors").is_file()
        stack = yaml.safe_load((work / "stack.yml").read_text())
        stack["provider"]["gateway"] = url  # deploy finds the gateway through the stack file
        (work / "stack.yml").write_text(yaml.safe_dump(stack))

        deployed = gpufaas("deploy", "-f", "stack.yml", env=cli_env, cwd=work)
        assert deployed.returncode == 0, deployed.stderr
        assert "deployed hello" in deployed.stdout

        cli_env["GPUFAAS_URL"] = url  # the other commands find it through the environment
        first = gpufaas("invoke", "hello", "-v", env=cli_env, cwd=work, stdin='{"inputs": [[1, 2, 3, 4]]}')
        assert first.returncode == 0, first.stderr
        outputs = json.loads(first.stdout)["outputs"]
        assert len(outputs) == 1 and len(outputs[0]) == 3
        assert "x-cache: miss" in first.stderr.lower()
        second = gpufaas("invoke", "hello", "-v", "--data", '{"inputs": [[1, 2, 3, 4]]}', env=cli_env, cwd=work)
        assert second.returncode == 0 and json.loads(second.stdout)["outputs"] == outputs
        assert "x-cache: hit" in second.stderr.lower()

        # The supervisor `up` left behind restarts a component that dies, and calls succeed again:
        # here the gateway, and with it the scheduler and the node in its process (one gateway and one
        # node: `up`'s default; the node's workers exit with it, so the next call loads the model again).
        assert "scheduler" not in recorded_pids(state) and "node0" not in recorded_pids(state)
        killed = recorded_pids(state)["gateway"]
        os.kill(killed, signal.SIGKILL)
        killed_at = time.monotonic()
        restarted_after_s = None
        while restarted_after_s is None and time.monotonic() - killed_at < 5.0:
            again_pid = recorded_pids(state).get("gateway")
            if again_pid not in (None, killed) and pid_alive(again_pid):
                restarted_after_s = time.monotonic() - killed_at
            time.sleep(0.1)
        assert restarted_after_s is not None, "the gateway was not restarted within 5 s"
        assert "restarting" in (state / "logs" / "supervisor.log").read_text()
        wait_for(lambda: answers(f"{url}/livez"), timeout_s=30)
        third = gpufaas("invoke", "hello", "--data", '{"inputs": [[1, 2, 3, 4]]}', env=cli_env, cwd=work)
        assert third.returncode == 0, third.stderr
        status = gpufaas("status", env={**cli_env, "COLUMNS": "200"}, cwd=work)  # (one line a row)
        assert "running (restarted 1x)" in status.stdout, status.stdout

        gpus = gpufaas("gpus", env=cli_env, cwd=work)
        assert gpus.returncode == 0 and "hello@" in gpus.stdout
        listed = gpufaas("ls", env=cli_env, cwd=work)
        assert "hello" in listed.stdout
        unknown = gpufaas("invoke", "nope", "-d", "{}", env=cli_env, cwd=work)
        assert unknown.returncode == 1 and "'nope' is not deployed" in unknown.stderr
        assert "Traceback" not in unknown.stderr
        bad_input = gpufaas("invoke", "hello", "-d", '{"inputs": "x"}', env=cli_env, cwd=work)
        assert bad_input.returncode == 1 and "inputs" in bad_input.stderr and "HTTP 400" in bad_input.stderr

        removed = gpufaas("rm", "hello", env=cli_env, cwd=work)
        assert removed.returncode == 0
        assert "hello" not in gpufaas("ls", env=cli_env, cwd=work).stdout
        pids = recorded_pids(state)
        assert set(pids) >= {"etcd", "gateway", "supervisor"}
        workers = descendants(pids["gateway"])  # the node's: the model's worker process, at least
        assert workers
        down = gpufaas("down", env=cli_env, cwd=work)
        assert down.returncode == 0 and "stopped" in down.stdout
        assert not survivors(pids.values()), pids
        assert not survivors(workers)
    finally:
        stop_recorded(state)


def test_cli_errors_are_plain_words(tmp_path: Path, cli_env: dict[str, str]) -> None:
    nobody = f"http://127.0.0.1:{free_port()}"
    unreachable = gpufaas("invoke", "hello", "-d", "{}", "--gateway", nobody, env=cli_env, cwd=tmp_path)
    assert unreachable.returncode == 1
    assert nobody in unreachable.stderr and "gpufaas up" in unreachable.stderr
    assert "Traceback" not in unreachable.stderr

    (tmp_path / "stack.yml").write_text("version: 1.0\nfunctions:\n  hello:\n    handler: ./hello\n    memroy_mb: 5\n")
    bad_stack = gpufaas("deploy", "-f", "stack.yml", env=cli_env, cwd=tmp_path)
    assert bad_stack.returncode == 1
    assert "functions.hello.memroy_mb: unknown key" in bad_stack.stderr
    assert "Traceback" not in bad_stack.stderr

    missing = gpufaas("deploy", "-f", "nope.yml", env=cli_env, cwd=tmp_path)
    assert missing.returncode == 1 and "no such stack file" in missing.stderr

    template = gpufaas("new", "x", "--template", "nonsense", env=cli_env, cwd=tmp_path)
    assert template.returncode == 2 and "pytorch-custom" in template.stderr

    status = gpufaas("status", "--gateway", nobody, env=cli_env, cwd=tmp_path)
    assert status.returncode == 1 and "does not answer" in status.stdout
