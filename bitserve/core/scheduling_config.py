"""SchedulerConfig and CacheConfig: the scheduling and KV-cache knobs, each default written once.

`bitserve/config.py` re-exports these; they live here so `core/` depends on nothing above it.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

SPECULATIVE_CHOICES = ("off", "ngram")  # --speculative: no drafts, or prompt lookup (core/ngram_draft.py)
MAX_NUM_SPECULATIVE_TOKENS = 16


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    """How one engine replica batches requests. Invalid combinations raise ValueError."""

    # None = unset: the model's weight format picks it at load (batch_limits.FORMAT_BATCH_LIMITS); the
    # scheduler only ever sees a resolved config (batch_limits.resolve_batch_limits).
    max_num_seqs: int | None = field(
        default=None,
        metadata={"help": "Most requests running (holding KV blocks) at once (default: per weight format)."},
    )
    max_num_batched_tokens: int | None = field(
        default=None,
        metadata={
            "help": "Token budget of one step: decodes plus prefill chunks (default: per weight format)."
        },
    )
    max_model_len: int = field(
        default=4096,
        metadata={
            "help": "Most tokens (prompt + output) in one sequence; the engine caps it at the model's."
        },
    )
    long_prefill_token_threshold: int = field(
        default=0,
        metadata={"help": "Largest prefill chunk one request gets per step (0 = only the budget caps it)."},
    )
    aging_interval_s: float = field(
        default=5.0,
        metadata={
            "help": "Seconds of waiting that raise a request one priority class (inf = strict priority)."
        },
    )
    enable_chunked_prefill: bool = field(
        default=True, metadata={"help": "Split long prompts across steps so decodes never stall."}
    )
    # A burst of requests reaching an idle engine (100 clients at once) arrives over ~0.1 s while the
    # event loop parses them; stepping on the first one made that step wait for the GIL behind the
    # parsing (142-237 ms for one 32-token prompt on an H100 replica) and prefilled the rest in a second
    # step (benchmarks/RESULTS.md). Only an idle engine waits: nothing running is held back.
    burst_gap_s: float = field(
        default=0.002,
        metadata={
            "help": "An idle engine's first step waits until no request has arrived for this long (at "
            "most burst_wait_max_s), so a burst is prefilled together (0 = step at once)."
        },
    )
    burst_wait_max_s: float = field(
        default=0.1, metadata={"help": "The longest an idle engine waits for a burst to finish arriving."}
    )
    # NOTE: off by default: on the cpu backend a verify step of 1 + k tokens costs more than a plain decode
    # step, so speculation pays only where drafts are accepted (text the answer copies from its prompt);
    # benchmarks/bench_speculative.py measures both sides
    speculative: str = field(
        default="off",
        metadata={
            "help": "Speculative decoding: off, or ngram (draft tokens by prompt lookup, verified in one "
            "step; exact: the same tokens and distribution as plain decoding; cpu backend only)."
        },
    )
    num_speculative_tokens: int = field(
        default=4,
        metadata={
            "help": f"Most draft tokens verified per request and step with --speculative ngram "
            f"(1..{MAX_NUM_SPECULATIVE_TOKENS}; each request shrinks its own when drafts miss)."
        },
    )

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
        if self.max_model_len < 2:
            raise ValueError("max_model_len must be >= 2 (a prompt token plus one output token)")
        if self.long_prefill_token_threshold < 0:
            raise ValueError("long_prefill_token_threshold must be >= 0")
        for name in ("burst_gap_s", "burst_wait_max_s"):
            value = getattr(self, name)
            if not 0 <= value < math.inf:  # NaN fails too
                raise ValueError(f"{name} must be a finite number of seconds >= 0, got {value}")
        if not self.aging_interval_s > 0 or math.isnan(self.aging_interval_s):
            raise ValueError(f"aging_interval_s must be > 0, got {self.aging_interval_s}")
        if self.speculative not in SPECULATIVE_CHOICES:
            choices = ", ".join(SPECULATIVE_CHOICES)
            raise ValueError(f"speculative must be one of {choices}, got {self.speculative!r}")
        if not 1 <= self.num_speculative_tokens <= MAX_NUM_SPECULATIVE_TOKENS:
            raise ValueError(
                f"num_speculative_tokens must be in 1..{MAX_NUM_SPECULATIVE_TOKENS}, "
                f"got {self.num_speculative_tokens}"
            )
        if self.max_num_seqs is None or self.max_num_batched_tokens is None:
            return  # checked again once resolved at load
        # Every running request must be able to take its decode token in the same step.
        if self.max_num_batched_tokens < self.max_num_seqs:
            raise ValueError(
                f"max_num_batched_tokens ({self.max_num_batched_tokens}) must be >= max_num_seqs "
                f"({self.max_num_seqs}) so every running decode fits in one step"
            )
        # Without chunking a whole sequence (a recomputed one included) must fit in one step.
        if not self.enable_chunked_prefill and self.max_num_batched_tokens < self.max_model_len:
            raise ValueError(
                "with enable_chunked_prefill=False, max_num_batched_tokens must be >= max_model_len"
            )


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Shape and policy of the paged KV cache."""

    block_size: int = field(default=16, metadata={"help": "Token slots per KV block."})
    num_blocks: int | None = field(
        default=None,
        metadata={"help": "KV blocks per replica, including the reserved null block (None = from memory)."},
    )
    enable_prefix_caching: bool = field(
        default=True, metadata={"help": "Reuse the KV of identical prompt prefixes across requests."}
    )

    def __post_init__(self) -> None:
        if self.block_size < 1:
            raise ValueError(f"block_size must be >= 1, got {self.block_size}")
        if self.num_blocks is not None and self.num_blocks < 2:
            raise ValueError(f"num_blocks must be >= 2 (block 0 is reserved), got {self.num_blocks}")
