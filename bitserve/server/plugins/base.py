"""What a server plugin is: a `Plugin` with ordered, typed hooks around one generation, and the contexts
they see. Pre-inference sees the validated request body before admission and may return a rewritten
body or raise a 4xx error (a refusal); post-inference sees a choice's whole output text and returns what
the client gets; a stream sees each choice's text through a `StreamFilter` (what to emit now, and a flush
at the end). Every hook may return its value or an awaitable of it. Imports nothing of the engine."""

from __future__ import annotations

from collections.abc import Awaitable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol, TypeVar

from bitserve.server.protocol import GenerationRequest, PromptInput

if TYPE_CHECKING:
    from bitserve.server.plugins.config import PluginConfig
    from bitserve.tokenizer.base import Tokenizer

T = TypeVar("T")
MaybeAwaitable = T | Awaitable[T]
DEFAULT_ORDER = 100


class RequestContext:
    """One generation request as plugins see it: the endpoint (its id prefix: chatcmpl, cmpl, inf, ...),
    the model serving it, the caller's principal name, the validated body, and its prompts' texts."""

    def __init__(
        self,
        endpoint: str,
        model: str,
        body: GenerationRequest,
        tokenizer: Tokenizer,
        principal: str | None = None,
    ) -> None:
        self.endpoint = endpoint
        self.model = model
        self.body = body
        self.principal = principal  # e.g. "key:alice"; None when the app runs without security
        self._tokenizer = tokenizer
        self._prompt_texts: tuple[str, ...] | None = None

    def with_body(self, body: GenerationRequest) -> RequestContext:
        """The same request after a plugin rewrote its body (the next plugin sees the new one)."""
        return RequestContext(self.endpoint, self.model, body, self._tokenizer, self.principal)

    def prompt_texts(self) -> tuple[str, ...]:
        """Every piece of prompt text the client sent: each text prompt, each chat message's text, and
        token-id prompts decoded. Computed once, on first use (a plugin that never reads it pays nothing)."""
        if self._prompt_texts is None:
            texts: list[str] = []
            for prompt in self.body.prompt_inputs():
                texts.extend(_texts_of(prompt, self._tokenizer))
            self._prompt_texts = tuple(texts)
        return self._prompt_texts


def _texts_of(prompt: PromptInput, tokenizer: Tokenizer) -> list[str]:
    if prompt.text is not None:
        return [prompt.text]
    if prompt.token_ids is not None:
        return [tokenizer.decode(prompt.token_ids)]
    texts = []
    for message in prompt.messages or ():
        # NOTE: read as data, not through ChatMessage.text(): that refuses non-text parts, which is the
        # template's job later; a filter must still see every text part of any message shape.
        content = getattr(message, "content", None)
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part.text for part in content if isinstance(getattr(part, "text", None), str))
    return texts


@dataclass(frozen=True, slots=True)
class OutputContext:
    """One choice of a generation, for the post-inference hooks: its request and its choice index."""

    request: RequestContext
    index: int


class StreamFilter(Protocol):
    """A plugin's view of one streamed choice: `feed(delta)` returns the text to emit now (it may hold
    some back), `flush()` what is left once the choice finished. Each may return an awaitable."""

    def feed(self, text: str) -> MaybeAwaitable[str]: ...

    def flush(self) -> MaybeAwaitable[str]: ...


class WholeTextFilter:
    """The stream filter of a plugin that rewrites only whole outputs: the choice's text is held until
    it finished, then its post_inference runs on all of it (streamed clients get it in one delta)."""

    def __init__(self, plugin: Plugin, context: OutputContext) -> None:
        self.plugin = plugin
        self.context = context
        self.parts: list[str] = []

    def feed(self, text: str) -> str:
        self.parts.append(text)
        return ""

    def flush(self) -> MaybeAwaitable[str]:
        text, self.parts = "".join(self.parts), []
        return self.plugin.post_inference(self.context, text)


class Plugin:
    """Base of a server plugin (the `bitserve.plugins` entry-point group names a subclass, or a factory
    `(PluginConfig) -> Plugin`). Override what the plugin needs; the defaults change nothing.

    Hooks run in ascending `order`, plugins of equal order in the order `--plugin` lists them; each has
    `plugin_timeout_s` (a hook over it fails its request). A hook that raises a 4xx BitserveError refuses
    the request with that error (RequestRefused: 400); anything else it raises fails that request with a
    500 naming the plugin, and no other request."""

    name: str = ""
    order: int = DEFAULT_ORDER

    def __init__(self, config: PluginConfig | None = None) -> None:
        self.config = config

    def pre_inference(self, context: RequestContext) -> MaybeAwaitable[GenerationRequest | None]:
        """Before admission: None keeps the body; a body of the same type replaces it (validated again
        like a client's); raise a 4xx error to refuse."""
        return None

    def post_inference(self, context: OutputContext, text: str) -> MaybeAwaitable[str]:
        """A choice's whole output text (non-streamed); returns the text the client gets."""
        return text

    def stream_filter(self, context: OutputContext) -> StreamFilter | None:
        """A filter for one streamed choice; None lets its deltas through unchanged. By default, a
        plugin that overrides post_inference holds the stream back and rewrites it whole at the end."""
        return WholeTextFilter(self, context) if self.rewrites_output else None

    @property
    def rewrites_output(self) -> bool:
        """Whether any output hook is overridden (then logprobs, which carry the raw tokens, are refused)."""
        cls = type(self)
        return (
            cls.post_inference is not Plugin.post_inference or cls.stream_filter is not Plugin.stream_filter
        )
