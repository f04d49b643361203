#!/usr/bin/env bash
# Installs gpufaas and what it needs into .venv (idempotent): the pinned torch first, then the
# project with its dev tools and its `worker` extra (torch). Sourced by demo.sh and test.sh.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
export PIP_DISABLE_PIP_VERSION_CHECK=1
if [ ! -x .venv/bin/python ]; then
  python3 -m venv .venv
fi
# torch==2.13.0 first: on this project's machines it is a local CPU build; an unpinned torch
# would pull several GB of CUDA packages. Skipped when already there.
.venv/bin/python -c "import torch" 2>/dev/null || .venv/bin/pip install -q torch==2.13.0
.venv/bin/pip install -q -e '.[dev,worker]'
# The decision core compiled with mypyc (gpufaas.native: the simulator runs about twice as fast, a
# scheduler places about 1.3x as many calls; everything runs from source without it). Rebuilt only
# when a source it depends on changed.
if ! .venv/bin/python -m gpufaas.native build; then
  [ "${CI:-}" = true ] && exit 1  # CI tests the compiled build: a failure to build is a failure
  echo "note: the compiled modules were not built; gpufaas runs from source (slower)"
fi
