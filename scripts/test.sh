#!/usr/bin/env bash
# The whole test suite on a fresh machine: installs what it needs, then lint, types and pytest
# (unit, property and integration tests: real etcd, processes, gRPC and HTTP on loopback).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
bash scripts/setup.sh
# docker-compose (Debian's) validates docker-compose.yml without an engine; skipped if absent.
if ! command -v docker-compose >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  (apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq docker-compose) >/dev/null 2>&1 \
    || echo "note: could not install docker-compose; the compose check will be skipped"
fi
.venv/bin/ruff check .
.venv/bin/ruff format --check .
.venv/bin/mypy
.venv/bin/python -m pytest -q "$@"
