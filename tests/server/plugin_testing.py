"""A plugin for the in-process plugin tests, importable as `plugin_testing:Marker` (tests/server is on
sys.path): it rewrites every request to 3 tokens and brackets every output, so each endpoint can be
checked to run both hooks."""

from __future__ import annotations

from bitserve.server.plugins.base import OutputContext, Plugin, RequestContext
from bitserve.server.protocol import GenerationRequest

MAX_TOKENS = 3


class Marker(Plugin):
    name = "marker"

    def pre_inference(self, context: RequestContext) -> GenerationRequest:
        return context.body.model_copy(update={"max_tokens": MAX_TOKENS, "ignore_eos": True})

    async def post_inference(self, context: OutputContext, text: str) -> str:
        return f"<{context.request.endpoint}:{len(text)}>"
