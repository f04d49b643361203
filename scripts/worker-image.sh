#!/usr/bin/env bash
# Builds the image the `docker` worker runtime runs functions in, from local parts only (no image
# registry is needed): the Debian bookworm base of scripts/base-image.sh (debootstrap), then the
# project and torch installed into /opt/gpufaas inside it, committed as $IMAGE.
#
#   bash scripts/worker-image.sh [IMAGE]      # default gpufaas/worker:latest; needs root, dockerd
#
# The base image (gpufaas/base:bookworm) is kept and reused; the worker image is rebuilt each time
# (the project changes). pip inside the build sees the host's pip configuration, CA bundle and local
# wheels (read-only mounts), as the host's own pip does.
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
IMAGE=${1:-gpufaas/worker:latest}
BASE=gpufaas/base:bookworm
TORCH=torch==2.13.0

bash scripts/base-image.sh

source scripts/pip-mounts.sh  # mounts, envs: what pip in the build container needs

name=gpufaas-worker-build-$$
docker rm -f "$name" >/dev/null 2>&1 || true
docker run --name "$name" --network host "${mounts[@]}" "${envs[@]}" -v "$PWD:/src:ro" "$BASE" sh -ec "
  python3 -m venv /opt/gpufaas
  /opt/gpufaas/bin/pip install -q $TORCH
  mkdir /tmp/src && tar -C /src --exclude=./.venv --exclude=./.git --exclude=./.whl -c . | tar -C /tmp/src -x
  /opt/gpufaas/bin/pip install -q /tmp/src
  rm -rf /tmp/src /root/.cache
  /opt/gpufaas/bin/python -c 'import torch, gpu_manager.worker'
"
docker commit \
  --change 'ENV PATH=/opt/gpufaas/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' \
  --change 'ENV PYTHONUNBUFFERED=1' \
  --change 'USER 65534:65534' \
  --change 'WORKDIR /' \
  "$name" "$IMAGE" >/dev/null
docker rm "$name" >/dev/null
echo "built $IMAGE"
