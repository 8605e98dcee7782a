"""What the OpenAI chat and completions shapes share: the chunk envelope (id, object, created, model,
model_version, system_fingerprint), the usage chunk, and the whole body. Each endpoint adds how one
choice looks (`choice_delta` while streaming, `choice` in the whole body) and its prologue."""

from __future__ import annotations

from typing import Any

from bitserve import __version__
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.pipeline import Generation

SYSTEM_FINGERPRINT = f"bitserve-{__version__}"


class OpenAIFormat:
    """The ResponseFormat of an OpenAI endpoint; subclasses name the objects and shape a choice."""

    object_name = ""
    chunk_object_name = ""

    def __init__(self, generation: Generation) -> None:
        self.tokenizer = generation.tokenizer
        self.include_usage = generation.body.include_usage
        self.envelope = {
            "id": generation.stream.request_id,
            "created": generation.created,
            "model": generation.model_id,
            "model_version": generation.version,
        }

    def chunk(self, choice: dict[str, Any]) -> dict[str, Any]:
        usage = {"usage": None} if self.include_usage else {}
        return {
            **self.envelope,
            "object": self.chunk_object_name,
            "choices": [choice],
            "system_fingerprint": SYSTEM_FINGERPRINT,
            **usage,
        }

    def prologue(self) -> list[dict[str, Any]]:
        return []

    def chunks(self, output: RequestOutput) -> list[dict[str, Any]]:
        return [
            self.chunk(self.choice_delta(delta))
            for delta in output.outputs
            # no text yet (partial UTF-8 or a possible stop string held back): nothing to send
            if delta.text or delta.finish_reason or delta.logprobs
        ]

    def epilogue(self, usage: dict[str, Any]) -> list[dict[str, Any]]:
        if not self.include_usage:
            return []
        return [
            {
                **self.envelope,
                "object": self.chunk_object_name,
                "choices": [],
                "system_fingerprint": SYSTEM_FINGERPRINT,
                "usage": usage,
            }
        ]

    def body(self, result: RequestOutput, usage: dict[str, Any]) -> dict[str, Any]:
        return {
            **self.envelope,
            "object": self.object_name,
            "choices": [self.choice(out) for out in result.outputs],
            "system_fingerprint": SYSTEM_FINGERPRINT,
            "usage": usage,
        }

    def choice_delta(self, delta: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError

    def choice(self, output: CompletionOutput) -> dict[str, Any]:
        raise NotImplementedError
