"""Where the tests of the Triton (CUDA) kernels run: a CUDA device, or Triton's CPU interpreter."""

from __future__ import annotations

import os

import torch


def kernel_test_device() -> str:
    """ "cpu" under Triton's interpreter (TRITON_INTERPRET=1, small shapes), else "cuda" where a CUDA
    device is; otherwise, or where triton does not import, the calling test module is skipped. Call it at
    a test module's top level, before importing the kernels."""
    import pytest  # NOTE: deferred: a test dependency, and only test modules call this

    if os.environ.get("TRITON_INTERPRET") == "1":
        device = "cpu"  # the interpreter runs the kernels on the host, on CPU tensors, GPU or not
    elif torch.cuda.is_available():
        device = "cuda"
    else:
        pytest.skip(
            "needs a CUDA device, or TRITON_INTERPRET=1 for Triton's CPU interpreter", allow_module_level=True
        )
    pytest.importorskip("triton", reason="the CUDA kernels are written in Triton")
    return device
