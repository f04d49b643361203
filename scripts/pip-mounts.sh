# Sourced by scripts/worker-image.sh and deploy/local-images.sh: `docker run` arguments that let pip
# inside a build container see what the host's pip sees: its configuration, CA bundle and local
# wheels (read-only mounts, in `mounts`) and its PIP_* environment (in `envs`).
mounts=()
for path in /etc/pip.conf /etc/xdg/pip /opt/wheels /opt/pypi /opt/pypi-more /etc/ssl/certs; do
  [ -e "$path" ] && mounts+=(-v "$path:$path:ro")
done
envs=()
while IFS='=' read -r name _; do envs+=(-e "$name"); done < <(env | grep '^PIP_' || true)
