"""The daemons load no client tooling: the CLI (`gpufaas.cli`) and the local cluster, its supervisor
and etcd launcher (`gpufaas.dev`) stay out of the scheduler, the gateway and the node (each checked
in a fresh interpreter)."""

from __future__ import annotations

import subprocess
import sys

import pytest

TOOLING = ("gpufaas.cli", "gpufaas.dev")


@pytest.mark.parametrize("daemon", ["scheduler.__main__", "gateway.__main__", "gpu_manager.__main__"])
def test_a_daemon_imports_no_client_tooling(daemon: str) -> None:
    probe = (
        "import importlib, sys; importlib.import_module(sys.argv[1]); "
        f"print(' '.join(m for m in sorted(sys.modules) if any(m == t or m.startswith(t + '.') for t in {TOOLING!r})))"
    )
    loaded = subprocess.run(
        [sys.executable, "-c", probe, daemon], capture_output=True, text=True, check=True, timeout=120
    ).stdout.split()
    assert loaded == [], f"{daemon} loads {loaded}"
