"""bitserve: an inference server for 1-bit / ternary LLMs (BitNet b1.58) and GGUF models.

Public API only: LLM, SamplingParams, RequestOutput, CompletionOutput, and Client / AsyncClient (a
running server's operations). Heavy modules load lazily so that `import bitserve` stays cheap for the
CLI and the server's settings.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Any

# NOTE: how OpenMP threads wait between parallel regions. libgomp (torch's runtime, whose threads numba's
# kernels share) lets a thread that reaches a barrier spin GOMP_SPINCOUNT times before it sleeps. A
# sleeping thread takes a futex wake-up per parallel region, and a decode step has hundreds of regions:
# with OMP_WAIT_POLICY=PASSIVE (no spin) a 2-vCPU VM decoded SmolLM2 at 23-41 tok/s and the 2B ternary
# model at 8.7-10.9, against 74-88 and 12.9 with a bounded spin of OMP_SPIN_COUNT (benchmarks/RESULTS.md,
# "OpenMP wait policy"). The bound keeps the cost of spinning on a machine whose cores are busy with
# other work to ~0.5 ms a region (unbounded spinning cost ~8 ms a kernel call there). Must be set before
# torch loads; an OMP_WAIT_POLICY or GOMP_SPINCOUNT in the environment wins (PASSIVE for a machine
# shared with other heavy processes).
OMP_SPIN_COUNT = "20000"
if "OMP_WAIT_POLICY" not in os.environ:
    os.environ.setdefault("GOMP_SPINCOUNT", OMP_SPIN_COUNT)

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
