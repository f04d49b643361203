#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, then lint, types, a secret scan and pytest
# (unit, property and integration tests: real etcd, processes, sockets, HTTP and a Docker engine).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# As root on Debian: docker-compose (validates docker-compose.yml), a Docker engine and debootstrap
# (the docker worker runtime's tests: scripts/worker-image.sh builds their image from local parts),
# Chromium (the dashboard's browser test, driven by Playwright; Playwright's own browser
# download is not reachable here), and iproute2, nftables and iptables (tests/integration/test_hosts.py:
# a host per network namespace, faults by nft, delay by netem or an NFQUEUE), HAProxy (several gateways
# behind it: tests/integration/test_gateways.py) and tcpdump (captures between namespace hosts).
# Elsewhere those tests say why they skip; under CI=true they must run.
if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
  missing=()
  for tool in docker-compose dockerd debootstrap chromium ip nft iptables haproxy tcpdump; do
    command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
  done
  if [ ${#missing[@]} -gt 0 ]; then
    (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose docker.io debootstrap \
      chromium iproute2 nftables iptables haproxy tcpdump) >/dev/null 2>&1 \
      || echo "note: could not install docker-compose, docker.io, debootstrap, chromium, iproute2, nftables," \
        "iptables, haproxy or tcpdump"
  fi
  if command -v dockerd >/dev/null 2>&1 && ! docker info >/dev/null 2>&1; then
    # No bridge or iptables: worker containers have no network at all (network_mode none).
    dockerd --iptables=false --bridge=none >/tmp/gpufaas-test-dockerd.log 2>&1 &
    dockerd_pid=$!
    trap 'kill "$dockerd_pid" 2>/dev/null; wait "$dockerd_pid" 2>/dev/null || true' EXIT
    for _ in $(seq 60); do docker info >/dev/null 2>&1 && break; sleep 0.5; done
  fi
  if docker info >/dev/null 2>&1; then
    bash scripts/worker-image.sh
    [ "${CI:-}" = true ] && export GPUFAAS_REQUIRE_DOCKER=1
  fi
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
bash scripts/secret-scan.sh  # a tracked file with a secret that .secrets.baseline does not list fails
.venv/bin/python -m pytest -q "$@"
# The suite above ran the decision core compiled (gpufaas.native); the wheel and the images run it
# from source: the scheduler's and the simulator's logic again that way (about a minute).
if [ $# -eq 0 ]; then
  GPUFAAS_NATIVE=0 .venv/bin/python -m pytest -q tests/property tests/unit/test_simulation.py \
    tests/unit/test_lalb.py tests/unit/test_calls.py tests/unit/test_queues.py tests/unit/test_cache_manager.py
fi
# gpufaas as a user installs it (the wheel in a fresh virtualenv outside the repository, its extras,
# the README's path from up to down; 3.5 to 6.5 minutes here, most of it installing torch): under CI.
if [ "${CI:-}" = true ]; then
  bash scripts/install-test.sh
fi
# The compose stack for real (local images, cpu backend; about 2 minutes with the base images
# cached, 3 from nothing): under CI, where the Docker engine above runs.
if [ "${CI:-}" = true ] && [ "$(id -u)" = 0 ] && docker info >/dev/null 2>&1; then
  bash deploy/compose-e2e.sh
fi
