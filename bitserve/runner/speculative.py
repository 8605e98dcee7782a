"""Speculative decoding in the runner: the sampling rows of a verify step and its acceptance rule.

A speculative decode (ScheduledRequest.draft_token_ids = d_1 .. d_k) computes its last token and its k
drafts in one step and is sampled at all 1 + k positions. Row i holds the logits after the sequence plus
d_1 .. d_i and is sampled with the request's own state as plain decoding would sample there: its outputs
are outputs + d_1 .. d_i (penalties, min_tokens), its seeded draws the ones plain decoding would make.

Acceptance (exact, one rule for greedy and sampled rows): t_0 .. t_k are the tokens the sampler chose for
the rows (argmax for greedy rows, a draw from the processed distribution otherwise); d_{i+1} is accepted
while t_i == d_{i+1}, and the step returns t_0 .. t_a, a the first index with t_a != d_{a+1} (or k).
While drafts match, row i's context is exactly the plain path's, so t_i is what plain decoding would have
produced there: greedy output is token-identical (up to float summation order), and a sampled t_i is a
draw from the plain path's distribution (the rejection rule of a one-hot drafter; rows past the first
mismatch are dropped unseen). A seeded request's generator is rewound after the step and advanced by one
draw per returned token, so seeded sampling gives the tokens it gives without speculation.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from bitserve.core.scheduler_output import RunnerOutput, ScheduledRequest
from bitserve.layers.sampler import SamplerOutput, SamplingRequestState, row_uniform


def num_rows(request: ScheduledRequest) -> int:
    """Sampled rows of a request that samples: 1, or 1 + k for a speculative decode."""
    return 1 + len(request.draft_token_ids)


def sampling_rows(request: ScheduledRequest, generator: torch.Generator | None) -> list[SamplingRequestState]:
    """The request's sampling state for each of its rows: row i sees outputs + drafts[:i]."""
    drafts = request.draft_token_ids
    rows = []
    for i in range(num_rows(request)):
        outputs = request.output_token_ids + drafts[:i] if i else request.output_token_ids
        rows.append(
            SamplingRequestState(
                params=request.params,
                prompt_token_ids=request.prompt_token_ids,
                output_token_ids=outputs,
                generator=generator,
                eos_token_ids=tuple(request.eos_token_ids),
            )
        )
    return rows


def num_accepted(row_tokens: Sequence[int], drafts: Sequence[int]) -> int:
    """The drafts accepted: the longest a with row_tokens[i] == drafts[i] for every i < a (row i's
    token is what follows the sequence plus drafts[:i]); the step returns row_tokens[: a + 1]."""
    accepted = 0
    while accepted < len(drafts) and row_tokens[accepted] == drafts[accepted]:
        accepted += 1
    return accepted


def save_generators(
    requests: Sequence[ScheduledRequest], generators: dict[str, torch.Generator | None]
) -> dict[str, torch.Tensor]:
    """The states, before sampling, of the generators that a verify step draws from more than once: the
    seeded, sampled (not greedy) speculative decodes'. CPU generator state: 5 KB, a copy."""
    states = {}
    for request in requests:
        generator = generators.get(request.request_id)
        if request.draft_token_ids and generator is not None and not request.params.is_greedy:
            states[request.request_id] = generator.get_state()
    return states


def collect(
    requests: Sequence[ScheduledRequest],
    sampled: SamplerOutput,
    generators: dict[str, torch.Generator | None],
    saved_states: dict[str, torch.Tensor],
) -> RunnerOutput:
    """RunnerOutput from the sampler's rows (`requests`' rows in order): each request's accepted tokens
    and their logprobs; the saved generators rewound and advanced by one draw per returned token."""
    token_ids: dict[str, list[int]] = {}
    logprobs: dict[str, list] | None = None if sampled.logprobs is None else {}
    row = 0
    for request in requests:
        rows = num_rows(request)
        row_tokens = sampled.token_ids[row : row + rows]
        drafts = request.draft_token_ids
        accepted = num_accepted(row_tokens, drafts)
        num_kept = 1 + accepted
        token_ids[request.request_id] = [*drafts[:accepted], row_tokens[accepted]]  # == row_tokens[:num_kept]
        if logprobs is not None and sampled.logprobs is not None and sampled.logprobs[row] is not None:
            logprobs[request.request_id] = sampled.logprobs[row : row + num_kept]
        state = saved_states.get(request.request_id)
        generator = generators.get(request.request_id)
        if state is not None and generator is not None:
            # the sampler drew one uniform per row, in row order; plain decoding would have drawn one per
            # returned token: rewind, then draw those, so the stream continues where plain decoding's would
            generator.set_state(state)
            for _ in range(num_kept):
                row_uniform(generator, generator.device)
        row += rows
    return RunnerOutput(sampled_token_ids=token_ids, logprobs=logprobs)
