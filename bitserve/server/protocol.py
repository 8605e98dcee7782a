"""Pydantic models of the request bodies (OpenAI chat / completions, native inference, tokenize):
every field bounded, unknown fields tolerated with a warning, known-but-unimplemented fields
refused with 400. `to_sampling_params()` is the only road from a request to the engine; no pydantic
object goes past the serving modules. The values responses carry (token text, usage, request ids) are
server/response_fields.py's, re-exported here.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from bitserve.engine.devices import MAX_DEVICE_CHARS
from bitserve.engine.messages import Priority
from bitserve.errors import InvalidRequest
from bitserve.sampling_params import (
    MAX_ABS_LOGIT_BIAS,
    MAX_ABS_PENALTY,
    MAX_LOGPROBS,
    MAX_MAX_TOKENS,
    MAX_N,
    MAX_NUM_STOP,
    MAX_NUM_STOP_TOKEN_IDS,
    MAX_REPETITION_PENALTY,
    MAX_SEED,
    MAX_STOP_CHARS,
    MAX_TEMPERATURE,
    MAX_TOP_K,
    SamplingParams,
)
from bitserve.server.deadlines import MAX_REQUEST_TIMEOUT_S
from bitserve.server.errors import UnsupportedParameter
from bitserve.server.response_fields import (  # noqa: F401 - re-exported for the serving modules
    LOGPROB_FLOOR,
    MAX_REQUEST_ID_CHARS,
    finite_logprob,
    new_request_id,
    token_text,
    usage_payload,
    valid_request_id,
)
from bitserve.structured.guide import MAX_CHOICES, MAX_GUIDE_CHARS, Guide
from bitserve.structured.request_fields import extension_guides, one_guide, response_format_guide
from bitserve.structured.tool_formats import JSON_CONVENTION, ToolFormat, ToolRequest
from bitserve.structured.tools import assistant_tool_calls, parse_tool_choice, parse_tools

logger = logging.getLogger(__name__)

MAX_MODEL_NAME_CHARS = 256
MAX_NUM_MESSAGES = 512
MAX_CONTENT_CHARS = 1_048_576  # one message; the body limit (4 MiB by default) caps the total
MAX_NUM_CONTENT_PARTS = 64
MAX_NAME_CHARS = 64
MAX_USER_CHARS = 256
MAX_PROMPT_CHARS = 4 * 1024 * 1024
MAX_PROMPT_TOKEN_IDS = 1_048_576
MAX_BATCH_PROMPTS = 32  # prompts in one /v1/completions request
MAX_BATCH_CHOICES = 64  # prompts x n in one request (each choice is one engine sequence)

PRIORITIES = {"high": Priority.HIGH, "normal": Priority.NORMAL, "low": Priority.LOW}


# ----------------------------------------------------------------- shared pieces


class StrictModel(BaseModel):
    # strict: no "5" -> 5 coercion; extra="allow": unknown fields are kept aside and logged.
    model_config = ConfigDict(strict=True, extra="allow", allow_inf_nan=False)

    def check_supported(self) -> None:
        """Refuse fields bitserve knows but does not implement (UnsupportedParameter)."""


def _unsupported(param: str, value: Any, allowed: Callable[[Any], bool], what: str) -> None:
    if not allowed(value):
        raise UnsupportedParameter(
            f"{param} is not supported by bitserve ({what})",
            param=param,
            hint=f"remove {param} from the request",
        )


class TextPart(StrictModel):
    type: str = Field(max_length=64)
    text: str | None = Field(None, max_length=MAX_CONTENT_CHARS)


class ChatMessage(StrictModel):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: (
        Annotated[str, Field(max_length=MAX_CONTENT_CHARS)]
        | Annotated[list[TextPart], Field(max_length=MAX_NUM_CONTENT_PARTS)]
        | None
    ) = None
    name: str | None = Field(None, max_length=MAX_NAME_CHARS)
    tool_calls: Any = None
    tool_call_id: Any = None

    def template_fields(self, index: int, tool_format: ToolFormat) -> dict[str, Any]:
        """The message's fields for the chat template: its text, or an assistant's tool calls as
        `tool_format` writes them back (structured/tool_formats.py)."""
        where = f"messages[{index}]"
        if self.tool_calls is None:
            fields: dict[str, Any] = {"content": self.text(index)}
            if self.role == "tool" and isinstance(self.tool_call_id, str):
                fields["tool_call_id"] = self.tool_call_id
            return fields
        if self.role != "assistant":
            raise InvalidRequest(f"{where}: only assistant messages carry tool_calls", param=where)
        return tool_format.assistant_fields(assistant_tool_calls(self.tool_calls, where))

    def text(self, index: int) -> str:
        """The message's text; non-text parts are refused (UnsupportedParameter)."""
        where = f"messages[{index}]"
        if self.tool_call_id is not None and self.role != "tool":
            raise InvalidRequest(f"{where}: only tool messages carry tool_call_id", param=where)
        if self.content is None:
            if self.role != "assistant":
                raise InvalidRequest(
                    f"{where}.content is required for role {self.role}", param=f"{where}.content"
                )
            return ""
        if isinstance(self.content, str):
            return self.content
        texts = []
        for j, part in enumerate(self.content):
            if part.type != "text" or part.text is None:
                raise UnsupportedParameter(
                    f"{where}.content[{j}]: content of type {part.type[:40]!r} is not supported by bitserve",
                    param=f"{where}.content[{j}].type",
                    hint="send text parts only",
                )
            texts.append(part.text)
        return "".join(texts)


def template_messages(
    messages: list[ChatMessage], tool_format: ToolFormat = JSON_CONVENTION
) -> list[dict[str, Any]]:
    """Plain dicts for the chat template ("developer" is OpenAI's newer name for "system"); earlier
    tool calls as `tool_format` writes them back."""
    rendered: list[dict[str, Any]] = []
    for index, message in enumerate(messages):
        entry = {"role": "system" if message.role == "developer" else message.role}
        entry.update(message.template_fields(index, tool_format))
        if message.name is not None:
            entry["name"] = message.name
        rendered.append(entry)
    return rendered


class StreamOptions(StrictModel):
    include_usage: bool = False


StopText = Annotated[str, Field(max_length=MAX_STOP_CHARS)]


class SamplingFields(StrictModel):
    """Sampling fields shared by every generation endpoint (None = SamplingParams' default)."""

    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    n: int = Field(1, ge=1, le=MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1, le=MAX_TOP_K)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    frequency_penalty: float | None = Field(None, ge=-MAX_ABS_PENALTY, le=MAX_ABS_PENALTY)
    repetition_penalty: float | None = Field(None, gt=0.0, le=MAX_REPETITION_PENALTY)
    seed: int | None = Field(None, ge=0, le=MAX_SEED)
    # Bounds declared with SamplingParams' constants; the entries' content (empty strings, logit_bias
    # keys, duplicate ids) is SamplingParams' check alone, run by to_sampling_params before admission.
    stop: StopText | Annotated[list[StopText], Field(max_length=MAX_NUM_STOP)] | None = None
    stop_token_ids: list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_NUM_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0, le=MAX_MAX_TOKENS)
    logit_bias: dict[str, Annotated[float, Field(ge=-MAX_ABS_LOGIT_BIAS, le=MAX_ABS_LOGIT_BIAS)]] | None = (
        None
    )
    skip_special_tokens: bool = True
    priority: Literal["high", "normal", "low"] = "normal"
    user: str | None = Field(None, max_length=MAX_USER_CHARS)

    @property
    def priority_class(self) -> Priority:
        return PRIORITIES[self.priority]


@dataclass(frozen=True, slots=True)
class PromptInput:
    """What a request gives as its prompt: exactly one of text, token ids or chat messages. `param`
    names the request field it came from, for errors."""

    param: str
    text: str | None = None
    token_ids: list[int] | None = None
    messages: list[ChatMessage] | None = None
    tools: ToolRequest | None = None  # chat with tools: the model's tool format puts them in the prompt


class GenerationRequest(SamplingFields):
    """What every generation endpoint's body has beyond the sampling fields; subclasses say where
    their prompt and logprobs come from."""

    max_tokens: int | None = Field(None, ge=1, le=MAX_MAX_TOKENS)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Extension: run on this replica of the model ("cpu", "cuda", "cuda:N"); unset, the router picks.
    device: str | None = Field(None, min_length=1, max_length=MAX_DEVICE_CHARS)
    # Extension: seconds from arrival; past it the request is aborted (504, or an error event when streaming).
    # The X-Request-Timeout header does the same; with both, the stricter wins.
    timeout: float | None = Field(None, gt=0.0, le=MAX_REQUEST_TIMEOUT_S)
    # Structured output (structured/): OpenAI's response_format and vLLM's guided_* extensions.
    response_format: Any = None
    guided_regex: str | None = Field(None, min_length=1, max_length=MAX_GUIDE_CHARS)
    guided_choice: list[str] | None = Field(None, min_length=1, max_length=MAX_CHOICES)
    guided_grammar: str | None = Field(None, min_length=1, max_length=MAX_GUIDE_CHARS)

    def prompt_input(self) -> PromptInput:
        raise NotImplementedError

    def guide(self, tool_format: ToolFormat = JSON_CONVENTION) -> Guide | None:
        """What the output is constrained to (at most one field may ask); shapes checked here, whether
        it compiles by the grammar engine before admission (server/pipeline.py). `tool_format`: the
        model's, for chat requests with tools."""
        extensions = extension_guides(self.guided_regex, self.guided_choice, self.guided_grammar)
        return one_guide([response_format_guide(self.response_format), *extensions])

    def prompt_inputs(self) -> list[PromptInput]:
        """Every prompt, in order: one, except a batched /v1/completions request."""
        return [self.prompt_input()]

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        """SamplingParams.logprobs: None, or the number of alternatives per token."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    def check_stream_options(self) -> None:
        if self.stream_options is not None and not self.stream:
            raise InvalidRequest("stream_options is only allowed when stream is true", param="stream_options")

    def to_sampling_params(self, tool_format: ToolFormat = JSON_CONVENTION) -> SamplingParams:
        """The engine's SamplingParams; unset fields keep SamplingParams' defaults (one source).
        `tool_format`: the serving model's (structured/tool_formats.py), for a chat request's tools."""
        kwargs: dict[str, Any] = {
            "n": self.n,
            "max_tokens": self.requested_max_tokens,
            "min_tokens": self.min_tokens,
            "ignore_eos": self.ignore_eos,
            "logprobs": self.num_logprobs,
            "skip_special_tokens": self.skip_special_tokens,
        }
        for name in (
            "temperature",
            "top_p",
            "min_p",
            "presence_penalty",
            "frequency_penalty",
            "repetition_penalty",
            "seed",
            "stop",
            "logit_bias",
        ):
            value = getattr(self, name)
            if value is not None:
                kwargs[name] = value
        if self.top_k is not None:
            kwargs["top_k"] = max(0, self.top_k)  # -1 (vLLM's "off") and 0 both disable top-k
        if self.stop_token_ids:
            kwargs["stop_token_ids"] = tuple(self.stop_token_ids)
        return SamplingParams(**kwargs, guide=self.guide(tool_format))


# ----------------------------------------------------------------- OpenAI chat / completions

_NO_FUNCTIONS = "the legacy functions API is not implemented: send tools and tool_choice"


class ChatCompletionRequest(GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_NUM_MESSAGES)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_MAX_TOKENS)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    # Tool calls (structured/tools.py): checked in check_supported, which keeps the parsed forms.
    tools: Any = None
    tool_choice: Any = None
    parallel_tool_calls: bool = True
    # Known OpenAI fields without an implementation: anything but their no-op value gets 400.
    functions: Any = None
    function_call: Any = None
    audio: Any = None
    modalities: Any = None
    prediction: Any = None
    store: Any = None
    web_search_options: Any = None
    reasoning_effort: Any = None

    def check_supported(self) -> None:
        _unsupported("functions", self.functions, lambda v: v in (None, []), _NO_FUNCTIONS)
        _unsupported("function_call", self.function_call, lambda v: v in (None, "none"), _NO_FUNCTIONS)
        _unsupported("audio", self.audio, lambda v: v is None, "text only")
        _unsupported("modalities", self.modalities, lambda v: v in (None, ["text"]), "text only")
        _unsupported(
            "prediction", self.prediction, lambda v: v is None, "predicted outputs are not implemented"
        )
        _unsupported("store", self.store, lambda v: v in (None, False), "completions are never stored")
        _unsupported("web_search_options", self.web_search_options, lambda v: v is None, "no web search")
        _unsupported("reasoning_effort", self.reasoning_effort, lambda v: v is None, "not a reasoning model")
        if self.top_logprobs is not None and not self.logprobs:
            raise InvalidRequest("top_logprobs requires logprobs to be true", param="top_logprobs")
        self.check_stream_options()

    def prompt_input(self) -> PromptInput:
        return PromptInput("messages", messages=self.messages, tools=self.tool_request())

    def tool_request(self) -> ToolRequest:
        """The parsed tools, tool_choice and parallel_tool_calls (InvalidRequest naming the field
        when malformed)."""
        tools = parse_tools(self.tools)
        return ToolRequest(tools, parse_tool_choice(self.tool_choice, tools), self.parallel_tool_calls)

    def guide(self, tool_format: ToolFormat = JSON_CONVENTION) -> Guide | None:
        return one_guide([super().guide(), tool_format.guide(self.tool_request())])

    @property
    def requested_max_tokens(self) -> int | None:
        return self.max_completion_tokens if self.max_completion_tokens is not None else self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


def _check_prompt(value: Any) -> Any:
    """str | [int, ...] | [str, ...] | [[int, ...], ...]: one prompt or a batch, as text or token ids."""
    if isinstance(value, str):
        return value
    is_batch = isinstance(value, list) and bool(value) and isinstance(value[0], (str, list))
    if is_batch and len(value) > MAX_BATCH_PROMPTS:
        # said here: the union's own errors would list every member's complaint instead
        raise ValueError(f"a batch holds at most {MAX_BATCH_PROMPTS} prompts, got {len(value)}")
    if isinstance(value, list) and value and all(isinstance(item, list) for item in value):
        return value
    if isinstance(value, list) and all(isinstance(item, str) for item in value) and value:
        return value
    if isinstance(value, list) and all(
        isinstance(item, int) and not isinstance(item, bool) for item in value
    ):
        return value
    raise ValueError(
        "prompt must be a string, a list of token ids, or a list of strings or of token-id lists"
    )


PromptText = Annotated[str, Field(max_length=MAX_PROMPT_CHARS)]
PromptIds = Annotated[list[int], Field(max_length=MAX_PROMPT_TOKEN_IDS)]


class CompletionRequest(GenerationRequest):
    # a batch is bounded twice: MAX_BATCH_PROMPTS prompts, and MAX_BATCH_CHOICES prompts x n (check_supported)
    prompt: (
        PromptText
        | Annotated[list[PromptText], Field(max_length=MAX_BATCH_PROMPTS)]
        | PromptIds
        | Annotated[list[PromptIds], Field(max_length=MAX_BATCH_PROMPTS)]
    )
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=MAX_N)
    suffix: Any = None

    _check_prompt = field_validator("prompt", mode="before")(_check_prompt)

    def check_supported(self) -> None:
        _unsupported(
            "suffix",
            self.suffix,
            lambda v: v in (None, ""),
            "insertion (fill-in-the-middle) is not implemented: no served template defines FIM tokens",
        )
        if self.best_of is not None and self.best_of > self.n:
            raise UnsupportedParameter(
                f"best_of={self.best_of} > n={self.n} is not supported by bitserve",
                param="best_of",
                hint="set best_of equal to n or leave it out",
            )
        if self.echo and self.logprobs is not None:
            raise UnsupportedParameter(
                "echo with logprobs is not supported by bitserve (it computes no prompt logprobs)",
                param="echo",
                hint="use echo or logprobs, not both",
            )
        num_choices = len(self.prompt_inputs()) * self.n
        if num_choices > MAX_BATCH_CHOICES:
            raise InvalidRequest(
                f"{len(self.prompt_inputs())} prompts x n={self.n} is {num_choices} choices; the most is "
                f"{MAX_BATCH_CHOICES}",
                param="prompt",
                hint="split the batch over several requests",
            )
        self.check_stream_options()

    def prompt_inputs(self) -> list[PromptInput]:
        """Every prompt of the request, in order (one, unless `prompt` is a batch)."""
        prompt = self.prompt
        if isinstance(prompt, list) and prompt and isinstance(prompt[0], (str, list)):
            return [_one_prompt(item, f"prompt[{i}]") for i, item in enumerate(prompt)]  # type: ignore[arg-type]
        return [_one_prompt(prompt, "prompt")]  # type: ignore[arg-type]

    def prompt_input(self) -> PromptInput:
        return self.prompt_inputs()[0]

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


def _one_prompt(prompt: str | list[int], param: str) -> PromptInput:
    if isinstance(prompt, str):
        return PromptInput(param, text=prompt)
    return PromptInput(param, token_ids=prompt)


# ----------------------------------------------------------------- native API and tokenizer


class InferenceRequest(GenerationRequest):
    """POST /v1/inference[/stream]: exactly one of `prompt` (text or token ids) or `messages`. The
    route, not a `stream` field, decides streaming."""

    prompt: str | list[Annotated[int, Field(ge=0)]] | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_NUM_MESSAGES)
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("send exactly one of prompt or messages", param="prompt")

    def prompt_input(self) -> PromptInput:
        if self.messages is not None:
            return PromptInput("messages", messages=self.messages)
        if isinstance(self.prompt, str):
            return PromptInput("prompt", text=self.prompt)
        return PromptInput("prompt", token_ids=self.prompt or [])

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


class TokenizeRequest(StrictModel):
    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    prompt: str | None = Field(None, max_length=MAX_PROMPT_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=MAX_NUM_MESSAGES)
    add_special_tokens: bool = True

    def check_supported(self) -> None:
        if (self.prompt is None) == (self.messages is None):
            raise InvalidRequest("send exactly one of prompt or messages", param="prompt")


class DetokenizeRequest(StrictModel):
    model: str | None = Field(None, max_length=MAX_MODEL_NAME_CHARS)
    tokens: list[Annotated[int, Field(ge=0)]] = Field(max_length=MAX_PROMPT_TOKEN_IDS)


def check_token_ids(token_ids: list[int], vocab_size: int, param: str) -> None:
    """Token ids from a client must index the vocabulary (an out-of-range id would crash the engine)."""
    if not token_ids:
        raise InvalidRequest(f"{param} holds no tokens", param=param)
    if len(token_ids) > MAX_PROMPT_TOKEN_IDS:
        raise InvalidRequest(f"{param} holds more than {MAX_PROMPT_TOKEN_IDS} token ids", param=param)
    bad = next((token_id for token_id in token_ids if not 0 <= token_id < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"{param} contains token id {bad}, outside this model's vocabulary (0..{vocab_size - 1})",
            param=param,
            hint="use ids from this model's /tokenize",
        )
