"""Admission: what a request must satisfy before an engine sees it (context room, queue limits).

Runs on the caller's side of the engine seam (event loop or the offline LLM); raises the request's
error before any token is generated. Knows nothing of HTTP: the server maps the errors to statuses.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from bitserve.config import ADMISSION_BATCHES, MIN_NUM_QUEUED_TOKENS, MIN_NUM_WAITING, ServerConfig
from bitserve.engine.messages import Priority
from bitserve.errors import ContextLengthExceeded, InvalidRequest
from bitserve.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """When new requests get 429: unfinished requests, or their prompt tokens, at these counts. Set in
    ServerConfig (config.py, the one home of defaults), or left to scale with the replica (`for_replica`)."""

    max_num_waiting: int
    max_num_queued_tokens: int
    normal_share: float = 1.0  # of both limits, for priority normal (high always gets the whole)
    low_share: float = 1.0  # of both limits, for priority low

    @classmethod
    def for_replica(cls, config: ServerConfig, max_num_seqs: int, kv_cache_tokens: int) -> AdmissionLimits:
        """The limits of one replica: those set in `config`, else ADMISSION_BATCHES x its max_num_seqs
        unfinished requests and its KV cache's tokens of prompt, never under the floors: a burst the
        replica can hold (a GPU's 256-sequence batch and as many waiting) is queued, not refused."""
        waiting, queued = config.max_num_waiting, config.max_num_queued_tokens
        return cls(
            max_num_waiting=max(MIN_NUM_WAITING, ADMISSION_BATCHES * max_num_seqs)
            if waiting is None
            else waiting,
            max_num_queued_tokens=max(MIN_NUM_QUEUED_TOKENS, kv_cache_tokens) if queued is None else queued,
            normal_share=1.0 - config.high_priority_reserve,
            low_share=config.low_priority_share,
        )

    def caps(self, priority: Priority) -> tuple[int, int]:
        """(unfinished requests, their prompt tokens) a request of this priority may find admitted: under
        saturation low is refused first, then normal, and the last share stays for high."""
        share = {Priority.HIGH: 1.0, Priority.NORMAL: self.normal_share}.get(priority, self.low_share)
        return max(1, int(self.max_num_waiting * share)), max(1, int(self.max_num_queued_tokens * share))


def check_request(
    prompt_token_ids: Sequence[int],
    params: SamplingParams,
    *,
    max_model_len: int,
    vocab_size: int,
    prompt_param: str = "prompt",
) -> None:
    """The prompt must leave room for one output token, and prompt + max_tokens (when set) must fit
    the context: a 400 rather than a silently shortened answer, as OpenAI does. Token ids in the
    prompt and the params must index the vocabulary (the engine step relies on it: an id outside it
    would address another row's logits). `prompt_param` names the field at fault (prompt / messages)."""
    num_prompt_tokens = len(prompt_token_ids)
    if num_prompt_tokens == 0:
        raise InvalidRequest(
            "the prompt is empty (it has no tokens)", param=prompt_param, hint="send some text"
        )
    room = max_model_len - num_prompt_tokens
    if room < 1:
        raise ContextLengthExceeded(
            f"the prompt has {num_prompt_tokens} tokens; this model's context is {max_model_len} tokens, "
            "which leaves no room for output",
            param=prompt_param,
            hint=f"shorten the prompt to at most {max_model_len - 1} tokens",
        )
    if params.max_tokens is not None and params.max_tokens > room:
        raise ContextLengthExceeded(
            f"the prompt ({num_prompt_tokens} tokens) plus max_tokens ({params.max_tokens}) exceeds this "
            f"model's context of {max_model_len} tokens",
            param="max_tokens",
            hint=f"lower max_tokens to at most {room} or shorten the prompt",
        )
    if min(prompt_token_ids) < 0 or max(prompt_token_ids) >= vocab_size:
        raise InvalidRequest(
            f"{prompt_param} holds a token id outside 0..{vocab_size - 1}, this model's vocabulary",
            param=prompt_param,
            hint="token ids must come from this model's tokenizer",
        )
    params.validate_for_vocab(vocab_size)
