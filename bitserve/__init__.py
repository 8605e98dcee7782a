"""bitserve: an inference server for 1-bit / ternary LLMs (BitNet b1.58) and GGUF models.

Public API only: LLM, SamplingParams, RequestOutput, CompletionOutput, and Client / AsyncClient (a
running server's operations). Heavy modules load lazily so that `import bitserve` stays cheap for the
CLI and the server's settings.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# NOTE: OpenMP threads that spin while waiting steal the few cores a CPU server has from the numba
# and torch kernels of the next op (measured: ~8 ms instead of ~0.5 ms per parallel kernel call on a
# busy 2-core box). Passive waiting costs ~0.03 ms per call when idle. Must be set before torch loads;
# an explicit OMP_WAIT_POLICY in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

__version__ = "0.1.0"
__all__ = [
    "LLM",
    "AsyncClient",
    "Client",
    "CompletionOutput",
    "RequestOutput",
    "SamplingParams",
    "__version__",
]

if TYPE_CHECKING:
    from bitserve.client import AsyncClient, Client
    from bitserve.llm import LLM
    from bitserve.outputs import CompletionOutput, RequestOutput
    from bitserve.sampling_params import SamplingParams

_LAZY = {
    "LLM": "bitserve.llm",
    "SamplingParams": "bitserve.sampling_params",
    "RequestOutput": "bitserve.outputs",
    "CompletionOutput": "bitserve.outputs",
    "Client": "bitserve.client",
    "AsyncClient": "bitserve.client",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'bitserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
