#!/usr/bin/env bash
# Build the repository's Dockerfile without a daemon: buildah, chroot isolation, vfs storage
# (CONTAINERS_STORAGE_CONF, set by `make image`). Prints the build's wall-clock time and the
# image's size.
#   IMAGE_BASE=auto|python|debian   auto (default): python:3.11-slim if it can be pulled, else a
#                                   Debian bookworm base from debootstrap (debian-base.sh)
#   IMAGE_TAG                       default localhost/llm-gateway:latest
#   WHEELS                          wheel folder for torch when the PyTorch index is out of reach
#                                   (default /opt/wheels)
#   BUILD_CA                        CA bundle pip trusts during the build (default: the host's)
set -euo pipefail

here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
base=${IMAGE_BASE:-auto}
tag=${IMAGE_TAG:-localhost/llm-gateway:latest}
python_base=${PYTHON_BASE:-docker.io/library/python:3.11-slim}
debian_base=localhost/llm-gateway-base:bookworm-py3.11
wheels=${WHEELS:-/opt/wheels}
build_ca=${BUILD_CA:-/etc/ssl/certs/ca-certificates.crt}
torch_index=https://download.pytorch.org/whl/cpu

reachable() {  # reachable URL: does an HTTPS GET answer at all (any status)?
    python3 - "$1" <<'PY'
import sys, urllib.error, urllib.request
try:
    urllib.request.urlopen(sys.argv[1], timeout=15)
except urllib.error.HTTPError:
    pass
except OSError:
    sys.exit(1)
PY
}

# Debian's packages: buildah 1.28 and debootstrap on bookworm.
if ! command -v buildah >/dev/null || ! command -v debootstrap >/dev/null; then
    apt-get update -q && apt-get install -y -q --no-install-recommends buildah debootstrap
fi

if [[ $base == auto ]]; then
    if buildah pull -q "$python_base" >/dev/null 2>&1; then base=python; else
        echo "image: cannot pull $python_base; using a Debian base from debootstrap" >&2
        base=debian
    fi
fi
case $base in
    python) base_image=$python_base ;;
    debian) base_image=$debian_base
            buildah inspect --type image "$debian_base" >/dev/null 2>&1 \
                || "$here/debian-base.sh" "$debian_base" ;;
    *) echo "IMAGE_BASE must be auto, python or debian, got '$base'" >&2; exit 2 ;;
esac

args=(--build-arg "BASE_IMAGE=$base_image")
if ! reachable "$torch_index/"; then
    if ! compgen -G "$wheels/torch-*.whl" >/dev/null; then
        echo "image: $torch_index is out of reach and $wheels has no torch wheel" >&2; exit 1
    fi
    echo "image: $torch_index is out of reach; torch from $wheels" >&2
    args+=(--volume "$wheels:/wheels:ro" --build-arg TORCH_INDEX= --build-arg WHEELS=/wheels)
fi
if [[ -f $build_ca ]]; then
    args+=(--volume "$build_ca:/run/build-ca.pem:ro" --build-arg PIP_CA=/run/build-ca.pem)
fi

start=$(date +%s)
# docker format: OCI image configs have no HEALTHCHECK.
buildah build --isolation chroot --format docker --pull=false "${args[@]}" \
    --tag "$tag" --file "$root/Dockerfile" "$root"
seconds=$(( $(date +%s) - start ))
size=$(buildah images --format '{{.Size}}' "$tag")
echo "image: $tag on $base_image built in ${seconds}s, size $size"
