"""SamplingParams: the user-facing, engine-level description of how to pick tokens for one request.

Frozen and hashable; validated on construction (every bad value raises `InvalidRequest` naming the
field and its allowed range). Imports no torch: the sampler in `layers/sampler.py` consumes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from bitserve.errors import InvalidRequest
from bitserve.structured.guide import Guide

# The one home of every sampling bound: SamplingParams checks them and the HTTP request models
# (server/protocol.py) declare the same ones as field bounds, so a client sees the limit in a 400.
MAX_N = 16
MAX_MAX_TOKENS = 1_000_000
MAX_TEMPERATURE = 2.0  # as in the OpenAI API
MAX_TOP_K = 1_000_000  # a top_k at or above the vocabulary size simply keeps every token
MAX_ABS_PENALTY = 2.0  # presence / frequency, as in the OpenAI API
MAX_REPETITION_PENALTY = 10.0
MAX_SEED = 2**63 - 1
MAX_NUM_STOP = 16
MAX_STOP_CHARS = 256
MAX_NUM_STOP_TOKEN_IDS = 64
MAX_LOGPROBS = 20
MAX_NUM_LOGIT_BIAS = 300
MAX_ABS_LOGIT_BIAS = 100.0
MAX_LOGIT_BIAS_KEY_DIGITS = 10  # token ids as JSON object keys; also keeps int() off huge strings
# NOTE: below this temperature logits / T can overflow float32; such rows are sampled greedily
# (vLLM uses the same threshold), which is what a near-zero temperature means anyway.
GREEDY_TEMPERATURE_EPS = 1e-5


def _help(text: str) -> dict[str, str]:
    return {"help": text}


@dataclass(frozen=True, slots=True)
class SamplingParams:
    """How to sample one request's completion(s).

    `stop` strings are matched by the frontend on text; `stop_token_ids` (and EOS unless
    `ignore_eos`) by the scheduler on ids. `logit_bias` may be given as a dict {token_id: bias}
    (keys may be decimal strings, as in OpenAI JSON) or pairs; it is stored as sorted pairs so the
    object stays hashable. `stop` / `stop_token_ids` accept lists (and `stop` a single string).
    `logprobs=None` means no logprobs; k in 0..20 means the chosen token's logprob plus the top k
    alternatives, taken from the raw model distribution (see `layers/sampler.py`).

    `max_tokens=None` is the one default policy, the same for the CLI, `LLM` and every endpoint:
    generate until EOS, a stop condition or the end of the model's context. A request that sets
    max_tokens must fit it in the context with its prompt (frontend/admission.py says so with a 400).
    Each field's `metadata["help"]` is the text of its CLI flag (cli/main.py generates them).
    """

    n: int = field(default=1, metadata=_help("completions to generate for the prompt"))
    max_tokens: int | None = field(
        default=None,
        metadata=_help("most tokens to generate (default: until a stop condition or the end of the context)"),
    )
    min_tokens: int = field(default=0, metadata=_help("tokens to generate before EOS or stop ids may end"))
    temperature: float = field(default=1.0, metadata=_help("sampling temperature; 0 = greedy"))
    top_p: float = field(default=1.0, metadata=_help("nucleus sampling: keep the smallest set of this mass"))
    top_k: int = field(default=0, metadata=_help("keep the k most likely tokens (0 = off)"))
    min_p: float = field(
        default=0.0, metadata=_help("drop tokens below this fraction of the top probability")
    )
    presence_penalty: float = field(default=0.0, metadata=_help("penalty for tokens already generated"))
    frequency_penalty: float = field(
        default=0.0, metadata=_help("penalty per occurrence of a generated token")
    )
    repetition_penalty: float = field(default=1.0, metadata=_help("divide logits of seen tokens (1 = off)"))
    seed: int | None = field(default=None, metadata=_help("seed for reproducible sampling"))
    stop: tuple[str, ...] = field(default=(), metadata=_help("stop strings (the text ends before them)"))
    stop_token_ids: tuple[int, ...] = field(default=(), metadata=_help("token ids that end the completion"))
    ignore_eos: bool = field(default=False, metadata=_help("keep generating past the end-of-sequence token"))
    logprobs: int | None = field(default=None, metadata=_help("also return this many top logprobs per token"))
    logit_bias: tuple[tuple[int, float], ...] = field(default=(), metadata=_help("(token id, bias) pairs"))
    skip_special_tokens: bool = field(default=True, metadata=_help("leave special tokens out of the text"))
    guide: Guide | None = field(
        default=None, metadata=_help("constrain the output to a JSON schema, regex, choice or grammar")
    )

    def __post_init__(self) -> None:
        _check_int("n", self.n, 1, MAX_N)
        if self.max_tokens is not None:
            _check_int(
                "max_tokens", self.max_tokens, 1, MAX_MAX_TOKENS, hint="null: until the end of the context"
            )
        _check_int("min_tokens", self.min_tokens, 0, self.max_tokens or MAX_MAX_TOKENS)
        self._set("temperature", _check_float("temperature", self.temperature, 0.0, MAX_TEMPERATURE))
        self._set("top_p", _check_float("top_p", self.top_p, 0.0, 1.0, low_open=True))
        _check_int("top_k", self.top_k, 0, MAX_TOP_K, hint="0 disables top-k")
        self._set("min_p", _check_float("min_p", self.min_p, 0.0, 1.0))
        for name in ("presence_penalty", "frequency_penalty"):
            value = _check_float(name, getattr(self, name), -MAX_ABS_PENALTY, MAX_ABS_PENALTY)
            self._set(name, value)
        self._set(
            "repetition_penalty",
            _check_float(
                "repetition_penalty",
                self.repetition_penalty,
                0.0,
                MAX_REPETITION_PENALTY,
                low_open=True,
                hint="1.0 disables it; values above 1 discourage repeats",
            ),
        )
        if self.seed is not None:
            _check_int("seed", self.seed, 0, MAX_SEED)
        self._set("stop", _normalise_stop(self.stop))
        self._set("stop_token_ids", _normalise_stop_token_ids(self.stop_token_ids))
        _check_bool("ignore_eos", self.ignore_eos)
        if self.logprobs is not None:
            _check_int("logprobs", self.logprobs, 0, MAX_LOGPROBS, hint="use null for no logprobs")
        self._set("logit_bias", _normalise_logit_bias(self.logit_bias))
        _check_bool("skip_special_tokens", self.skip_special_tokens)
        if self.guide is not None:
            _check_guide(self)

    def _set(self, name: str, value: Any) -> None:
        # The dataclass is frozen; normalisation happens once, here, before anyone sees the object.
        object.__setattr__(self, name, value)

    @property
    def is_greedy(self) -> bool:
        """True when sampling reduces to argmax: temperature 0 (or below 1e-5) or top_k == 1."""
        return self.temperature < GREEDY_TEMPERATURE_EPS or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """True when any of the presence, frequency or repetition penalties changes logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    def validate_for_vocab(self, vocab_size: int) -> None:
        """Check token ids in `logit_bias` and `stop_token_ids` against a model's vocabulary size."""
        for token_id, _ in self.logit_bias:
            if token_id >= vocab_size:
                raise InvalidRequest(
                    f"logit_bias token id {token_id} is out of range for this model's vocabulary "
                    f"(valid ids are 0..{vocab_size - 1})",
                    param="logit_bias",
                    hint="use token ids produced by this model's tokenizer",
                )
        for token_id in self.stop_token_ids:
            if token_id >= vocab_size:
                raise InvalidRequest(
                    f"stop_token_ids contains {token_id}, out of range for this model's vocabulary "
                    f"(valid ids are 0..{vocab_size - 1})",
                    param="stop_token_ids",
                    hint="use token ids produced by this model's tokenizer",
                )


def _check_guide(params: SamplingParams) -> None:
    """A guided output ends with EOS where its grammar is complete: nothing may forbid that EOS."""
    if not isinstance(params.guide, Guide):
        raise InvalidRequest(f"guide must be a Guide, got {type(params.guide).__name__}", param="guide")
    for name, value in (("ignore_eos", params.ignore_eos), ("min_tokens", params.min_tokens)):
        if value:
            raise InvalidRequest(
                f"{name} cannot be combined with structured output ({params.guide.param}): the grammar "
                "decides where the output ends",
                param=name,
                hint=f"remove {name}",
            )


def _range_text(low: float, high: float, low_open: bool) -> str:
    return f"{'(' if low_open else '['}{low:g}, {high:g}]"


def _check_int(name: str, value: object, low: int, high: int, *, hint: str | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise InvalidRequest(
            f"{name} must be an integer in [{low}, {high}], got {value!r}", param=name, hint=hint
        )
    if not low <= value <= high:
        raise InvalidRequest(f"{name} must be in [{low}, {high}], got {value}", param=name, hint=hint)
    return value


def _check_float(
    name: str,
    value: object,
    low: float,
    high: float,
    *,
    low_open: bool = False,
    hint: str | None = None,
) -> float:
    """Accept an int or float (never bool), reject NaN / inf, check the range; return a float."""
    allowed = _range_text(low, high, low_open)
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise InvalidRequest(f"{name} must be a number in {allowed}, got {value!r}", param=name, hint=hint)
    number = float(value)
    if not math.isfinite(number):
        raise InvalidRequest(
            f"{name} must be a finite number in {allowed}, got {value}", param=name, hint=hint
        )
    is_low_ok = number > low if low_open else number >= low
    if not (is_low_ok and number <= high):
        raise InvalidRequest(f"{name} must be in {allowed}, got {value}", param=name, hint=hint)
    return number


def _check_bool(name: str, value: object) -> None:
    if not isinstance(value, bool):
        raise InvalidRequest(f"{name} must be true or false, got {value!r}", param=name)


def _as_tuple(name: str, value: object) -> tuple[Any, ...]:
    if isinstance(value, (list, tuple)):
        return tuple(value)
    raise InvalidRequest(f"{name} must be a list, got {type(value).__name__}", param=name)


def _normalise_stop(value: object) -> tuple[str, ...]:
    items = (value,) if isinstance(value, str) else _as_tuple("stop", value)
    if len(items) > MAX_NUM_STOP:
        raise InvalidRequest(
            f"stop may hold at most {MAX_NUM_STOP} strings, got {len(items)}",
            param="stop",
            hint="keep the stop sequences that matter most",
        )
    for item in items:
        if not isinstance(item, str) or not 1 <= len(item) <= MAX_STOP_CHARS:
            raise InvalidRequest(
                f"each stop entry must be a string of 1..{MAX_STOP_CHARS} characters, got {item!r:.80}",
                param="stop",
            )
    return items


def _normalise_stop_token_ids(value: object) -> tuple[int, ...]:
    items = _as_tuple("stop_token_ids", value)
    if len(items) > MAX_NUM_STOP_TOKEN_IDS:
        raise InvalidRequest(
            f"stop_token_ids may hold at most {MAX_NUM_STOP_TOKEN_IDS} ids, got {len(items)}",
            param="stop_token_ids",
        )
    for item in items:
        if isinstance(item, bool) or not isinstance(item, int) or item < 0:
            raise InvalidRequest(
                f"stop_token_ids entries must be integers >= 0, got {item!r}", param="stop_token_ids"
            )
    return items


def _logit_bias_key(key: object) -> int:
    # OpenAI sends logit_bias as a JSON object, whose keys are strings such as "50256".
    if isinstance(key, str) and key.isascii() and key.isdigit() and len(key) <= MAX_LOGIT_BIAS_KEY_DIGITS:
        return int(key)
    if isinstance(key, bool) or not isinstance(key, int) or key < 0:
        raise InvalidRequest(
            f"logit_bias keys must be token ids (integers >= 0), got {key!r:.40}", param="logit_bias"
        )
    return key


def _normalise_logit_bias(value: object) -> tuple[tuple[int, float], ...]:
    """dict {id: bias} or pairs → pairs sorted by token id; ids unique, biases in [-100, 100]."""
    if isinstance(value, Mapping):
        pairs = tuple(value.items())
    else:
        pairs = _as_tuple("logit_bias", value)
    if len(pairs) > MAX_NUM_LOGIT_BIAS:
        raise InvalidRequest(
            f"logit_bias may hold at most {MAX_NUM_LOGIT_BIAS} entries, got {len(pairs)}", param="logit_bias"
        )
    biases: dict[int, float] = {}
    for pair in pairs:
        if not isinstance(pair, (tuple, list)) or len(pair) != 2:
            raise InvalidRequest(
                f"logit_bias entries must be (token_id, bias) pairs, got {pair!r:.40}", param="logit_bias"
            )
        token_id = _logit_bias_key(pair[0])
        if token_id in biases:
            raise InvalidRequest(f"logit_bias names token id {token_id} twice", param="logit_bias")
        biases[token_id] = _check_float(
            "logit_bias", pair[1], -MAX_ABS_LOGIT_BIAS, MAX_ABS_LOGIT_BIAS, hint="-100 bans, 100 forces"
        )
    return tuple(sorted(biases.items()))


def child_params(params: SamplingParams, index: int) -> SamplingParams:
    """The params of choice `index` of an n-choice request: distinct seeds keep choices distinct."""
    if params.seed is None or index == 0:
        return params
    return dataclasses.replace(params, seed=(params.seed + index) % (2**63))
