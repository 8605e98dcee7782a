"""bitserve: an inference server for 1-bit / ternary LLMs (BitNet b1.58) and GGUF models.

Public API only: LLM, SamplingParams, RequestOutput, CompletionOutput. Heavy modules load lazily so
that `import bitserve` stays cheap for the CLI and the server's settings.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"
__all__ = ["LLM", "CompletionOutput", "RequestOutput", "SamplingParams", "__version__"]

if TYPE_CHECKING:
    from bitserve.llm import LLM
    from bitserve.outputs import CompletionOutput, RequestOutput
    from bitserve.sampling_params import SamplingParams

_LAZY = {
    "LLM": "bitserve.llm",
    "SamplingParams": "bitserve.sampling_params",
    "RequestOutput": "bitserve.outputs",
    "CompletionOutput": "bitserve.outputs",
}


def __getattr__(name: str) -> Any:
    module_name = _LAZY.get(name)
    if module_name is None:
        raise AttributeError(f"module 'bitserve' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module_name), name)
