#!/usr/bin/env bash
# Builds gpufaas/base:bookworm once from local parts only (no image registry is needed): a Debian
# bookworm root filesystem made with debootstrap (with python3), imported as an image. Kept and
# reused by scripts/worker-image.sh and deploy/local-images.sh.
#
#   bash scripts/base-image.sh      # needs root, dockerd, debootstrap; a no-op when the image exists
set -euo pipefail
BASE=gpufaas/base:bookworm

docker image inspect "$BASE" >/dev/null 2>&1 && exit 0
command -v debootstrap >/dev/null || { echo "debootstrap is missing: apt-get install -y debootstrap" >&2; exit 1; }
rootfs=$(mktemp -d)
trap 'rm -rf "$rootfs"' EXIT
debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$rootfs" \
  http://deb.debian.org/debian >/dev/null
tar -C "$rootfs" -c . | docker import - "$BASE" >/dev/null
echo "built $BASE"
