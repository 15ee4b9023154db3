#!/usr/bin/env bash
# A python:3.11-slim stand-in built from Debian's packages alone, for machines that reach Debian's
# mirrors but no image registry: debootstrap a minimal bookworm, add python3.11 with venv and its
# C headers (python:*-slim ships them; torch's inductor compiles against them), libnuma1 and the
# CA certificates with apt, and commit the tree as a buildah image.
#   deploy/image/debian-base.sh [TAG]        (root; storage from CONTAINERS_STORAGE_CONF)
set -euo pipefail

tag=${1:-localhost/llm-gateway-base:bookworm-py3.11}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
work=${IMAGE_WORK:-/var/tmp/llm-gateway-image}
rootfs=$work/rootfs
mkdir -p "$work"
rm -rf "$rootfs"
trap 'rm -rf "$rootfs"' EXIT

debootstrap --variant=minbase bookworm "$rootfs" "$mirror"
# Point-release and security updates too, as Debian's own images do (debootstrap sets main only).
cat > "$rootfs/etc/apt/sources.list" <<SOURCES
deb $mirror bookworm main
deb $mirror bookworm-updates main
deb ${SECURITY_MIRROR:-http://deb.debian.org/debian-security} bookworm-security main
SOURCES
cp /etc/resolv.conf "$rootfs/etc/resolv.conf"
chroot "$rootfs" apt-get update -q
chroot "$rootfs" apt-get upgrade -y -q
# With apt, not debootstrap --include: that does not resolve python3.11-venv's dependencies.
chroot "$rootfs" apt-get install -y -q --no-install-recommends \
    python3.11 python3.11-venv libpython3.11-dev libnuma1 ca-certificates
chroot "$rootfs" apt-get clean
rm -rf "$rootfs"/var/lib/apt/lists/* "$rootfs/etc/resolv.conf"
# The python:*-slim convention the Dockerfile relies on: `python` on PATH.
ln -sf /usr/bin/python3.11 "$rootfs/usr/local/bin/python"
ln -sf /usr/bin/python3.11 "$rootfs/usr/local/bin/python3"

container=$(buildah from scratch)
mount=$(buildah mount "$container")
cp -a "$rootfs/." "$mount/"
buildah umount "$container"
buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin \
    --env LANG=C.UTF-8 --cmd python \
    --label org.opencontainers.image.description="Debian bookworm + python3.11 (debootstrap)" \
    "$container"
buildah commit --rm "$container" "$tag"
