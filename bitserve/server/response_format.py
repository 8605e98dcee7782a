"""ResponseFormat: an endpoint's wire shapes, which the pipeline (pipeline.py) and the SSE framing
(streaming.py) both take; apart from both so that neither imports the other for it."""

from __future__ import annotations

from typing import Any, Protocol

from bitserve.outputs import RequestOutput


class ResponseFormat(Protocol):
    """An endpoint's wire shapes: SSE chunks while streaming, or the whole JSON body."""

    def prologue(self) -> list[dict[str, Any]]: ...

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]: ...

    def epilogue(self, usage: dict[str, Any]) -> list[dict[str, Any]]: ...

    def body(self, result: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]: ...
