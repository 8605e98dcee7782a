#!/usr/bin/env bash
# Wheels for a GPU machine that cannot reach a package index but has a CUDA Python image (torch, triton,
# numpy, numba, tokenizers, jinja2, httpx, prometheus-client): bitserve's serving dependencies and what
# `pytest -m gpu tests/gpu tests/kernels` needs there (the openai client, gguf, pytest), at the versions
# installed in this environment (run scripts/install.sh with EXTRAS=test first), for CPython 3.12 on
# x86_64 Linux by default.
#   bash scripts/offline_wheels.sh [DEST]          # DEST defaults to .whl (git-ignored)
# On the GPU machine, from the checkout:
#   python3 -m pip install --no-index --no-deps --target /tmp/site .whl/*.whl && export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(dirname "$0")/.."
DEST=${1:-.whl}
PYTHON=${PYTHON:-python3}
TARGET_PY=${TARGET_PY:-3.12}
# what the image lacks, with their own dependencies spelled out (pip download --no-deps fetches none):
# FastAPI 0.16x imports opentelemetry-api; openai 3.x speaks httpx2; the server imports redis and PyJWT;
# `bitserve bench` streams with aiohttp
PACKAGES=(
  aiohappyeyeballs aiohttp aiosignal attrs frozenlist idna multidict propcache yarl
  annotated-doc annotated-types anyio click fastapi gguf h11 httpcore2 httptools httpx2 hypothesis
  iniconfig jiter openai opentelemetry-api pluggy pydantic pydantic-core pydantic-settings pyjwt pytest
  python-dotenv python-multipart redis sniffio sortedcontainers starlette truststore typing-extensions
  typing-inspection uvicorn websockets
)
pins=()
for name in "${PACKAGES[@]}"; do
  version=$("$PYTHON" -m pip show "$name" 2>/dev/null | awk '/^Version:/ {print $2}' || true)
  if [[ -z "$version" ]]; then
    echo "offline_wheels: $name is not installed here (run EXTRAS=test bash scripts/install.sh)" >&2
    exit 1
  fi
  pins+=("$name==$version")
done
platforms=()
for tag in manylinux_2_28_x86_64 manylinux_2_27_x86_64 manylinux_2_17_x86_64 manylinux2014_x86_64 \
  manylinux1_x86_64; do
  platforms+=(--platform "$tag")
done
mkdir -p "$DEST"
"$PYTHON" -m pip download -q --no-deps --only-binary=:all: --python-version "$TARGET_PY" \
  --implementation cp "${platforms[@]}" -d "$DEST" "${pins[@]}"
echo "offline_wheels: ${#pins[@]} wheels in $DEST ($(du -sh "$DEST" | cut -f1))"
