"""Decode lookahead on CUDA: the next decode step's graph is launched before the host has read this one's
tokens, so the GPU does not idle while the host finishes the step.

At batch 1 a 2B decode graph replays in ~1.2 ms, and the host spends ~0.3 ms between the step's one sync
and the next replay (reading the tokens, the scheduler's update and next schedule, building and copying the
next inputs, the caller's output processing): the GPU idled for a fifth of every step (benchmarks/
RESULTS.md). Here, once a plain greedy decode step is launched, its tokens are taken on the device
(argmax, as the sampler does for greedy rows; the graph itself writes them and the next positions into
its inputs: runner/cuda_graphs.py) and a replay of the same graph computes the next step; only then does
the host wait for this step's tokens. If the scheduler's next step is exactly
that one (same sequences in the same order, each fed the token it sampled, at the next position, with the
blocks it was launched with, perhaps more appended), its tokens are already computed (or in flight);
otherwise the guess is dropped and the step runs as usual. A guess needs the next position's block: the
scheduler reserves one slot ahead for every decode (CudaRunner.num_lookahead_tokens; not with
KernelTuning.cuda_lookahead_slot off: BITSERVE_CUDA_LOOKAHEAD_SLOT=0), where it can without preempting
anyone; without it every 16th step (a block's worth) cannot be guessed and the GPU idles through that
step's host work (2B on an H200: 508 of 512 launches ahead used with the reservation, 480 of 480 without).

No step is launched after one whose token is a sequence's last by max_tokens (it would be dropped: one
whole wasted step a request, ~1 ms of GPU time at batch 1 on the 2B model).

A dropped guess is harmless: it wrote only the KV slot of each sequence's next position, inside a block
the sequence already owned and had not filled (a guess is made only when the next position falls in an
allocated block), so no full, prefix-cached block changes; a sequence that goes on rewrites that slot in its
real step before anything reads it; a sequence that ended gave back a block whose next owner writes every
slot before it reads it, in stream order after the guess. Only plain greedy rows are guessed (no logprobs,
penalties, logit bias, min_tokens, grammar): their token is the argmax of the step's logits, which is what
the sampler computes for them, so the tokens are the same to the bit with lookahead on or off.

KernelTuning.cuda_lookahead off (BITSERVE_CUDA_LOOKAHEAD=0, or ModelConfig(cuda_lookahead=False)) turns it
off; measured on (2B on an H200, 2026-11-28: 1.040 -> 1.027 ms a step with the reserved slot too).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from bitserve.core.scheduler_output import ScheduledRequest

if TYPE_CHECKING:
    from bitserve.runner.cuda_graphs import TokenReadback


def is_plain_greedy(request: ScheduledRequest) -> bool:
    """A decode row whose token is the argmax of its logits: the sampler changes nothing else for it."""
    params = request.params
    return (
        request.sample
        and len(request.token_ids) == 1
        and params.is_greedy
        and params.logprobs is None
        and not params.logit_bias
        and not params.has_penalties
        and params.min_tokens == 0
        and params.guide is None
    )


def ends_with_this_step(request: ScheduledRequest) -> bool:
    """The token this step samples is the request's last by max_tokens (the scheduler then finishes it):
    a step launched after it would be dropped, for this sequence and for a batch that loses it."""
    max_tokens = request.params.max_tokens
    return max_tokens is not None and len(request.output_token_ids) + 1 >= max_tokens


def next_positions(
    requests: Sequence[ScheduledRequest], max_model_len: int, block_size: int
) -> list[int] | None:
    """Each sequence's position in the step after this one, or None where one of them would need a block
    it does not own yet (or run past the model's context)."""
    positions = []
    for request in requests:
        position = request.start_position + 1
        if position >= max_model_len or position // block_size >= len(request.block_ids):
            return None
        positions.append(position)
    return positions


@dataclass(slots=True)
class Lookahead:
    """A decode step launched ahead: which step it computed, and where the host reads its tokens."""

    request_ids: tuple[str, ...]
    positions: tuple[int, ...]
    # each sequence's block count when launched: a running sequence's blocks are only appended, so a step
    # whose table holds at least these is one whose first blocks are the ones the launch read
    num_blocks: tuple[int, ...]
    readback: TokenReadback  # its tokens (each row's argmax), for the host once it is done
    fed_token_ids: list[int] = field(default_factory=list)  # what it was fed: the step before's tokens

    def matches(self, requests: Sequence[ScheduledRequest]) -> bool:
        """True when `requests` is the step this lookahead computed."""
        if len(requests) != len(self.request_ids) or len(self.fed_token_ids) != len(requests):
            return False
        for i, request in enumerate(requests):
            if (
                request.request_id != self.request_ids[i]
                or request.start_position != self.positions[i]
                or len(request.block_ids) < self.num_blocks[i]  # blocks only grow: a prefix, as launched
                or not is_plain_greedy(request)  # a one-token decode row, so token_ids[0] is all it was fed
                or request.token_ids[0] != self.fed_token_ids[i]
            ):
                return False
        return True


@dataclass(slots=True)
class LookaheadStats:
    launched: int = 0  # steps launched ahead
    hits: int = 0  # of them, steps the scheduler then asked for
