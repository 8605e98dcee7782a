"""Scheduler: continuous batching under a token budget, chunked prefill, preemption by recompute,
priorities with aging, speculative decodes (n-gram drafts), and the integer finish checks (EOS, stop
ids, lengths, deadlines).

Plain Python; imports no torch and nothing above `core/`.
"""

from __future__ import annotations

import bisect
import heapq
import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from bitserve.core.kv_cache_manager import KVCacheManager
from bitserve.core.ngram_draft import DraftState
from bitserve.core.request import FinishReason, Request, RequestStatus, finished_status
from bitserve.core.request_queue import RequestQueue, priority_key
from bitserve.core.scheduler_output import RunnerOutput, ScheduledRequest, SchedulerOutput
from bitserve.core.scheduling_config import SchedulerConfig
from bitserve.core.step_outputs import EngineOutput, StepStats
from bitserve.errors import InvalidRequest

logger = logging.getLogger(__name__)


def _key(request: Request) -> tuple[float, float, int]:
    return request.priority_key


@dataclass(slots=True)
class _StepPlan:
    """Working state of one `schedule()` call."""

    budget: int
    entries: dict[str, tuple[Request, int]] = field(default_factory=dict)
    # request id -> the drafts a speculative decode verifies (its entry counts 1 + len(drafts) tokens)
    drafts: dict[str, list[int]] = field(default_factory=dict)
    preempted_ids: list[str] = field(default_factory=list)
    num_prefix_hit_tokens: int = 0
    num_prefix_query_tokens: int = 0

    def add(self, request: Request, num_tokens: int) -> None:
        self.entries[request.request_id] = (request, num_tokens)
        self.budget -= num_tokens

    def drop(self, request: Request) -> None:
        """Unschedule a request preempted after it was given tokens; its tokens return to the budget."""
        entry = self.entries.pop(request.request_id, None)
        self.drafts.pop(request.request_id, None)
        if entry is not None:
            self.budget += entry[1]


class Scheduler:
    """Decides, each step, which tokens of which requests the runner computes.

    Call order per step: `schedule()`, then the runner, then `update()` with the runner's output;
    `update()` must follow every `schedule()`, even an empty one, because it also delivers the
    finishes (abort, deadline) recorded since the previous step. `add_request` and
    `abort_requests` are called between steps. Not thread-safe: the engine thread owns it.
    """

    def __init__(
        self,
        config: SchedulerConfig,
        kv: KVCacheManager,
        clock: Callable[[], float] = time.monotonic,
        num_lookahead_tokens: int = 0,
    ) -> None:
        self.config = config
        self.kv = kv
        # slots reserved past each decode's token, where free blocks allow without preempting: a runner
        # that launches the next step before this one ends (runner/cuda_lookahead.py) writes there
        self.num_lookahead_tokens = num_lookahead_tokens
        self._clock = clock
        self.requests: dict[str, Request] = {}  # every live (not finished) request
        self.waiting = RequestQueue()
        # Sorted by priority_key: most urgent first, so running[-1] is the preemption victim.
        self.running: list[Request] = []
        self._deadlines: list[tuple[float, int, str]] = []  # (deadline, seq, request_id) min-heap
        self._num_added = 0
        self._finished_ids: list[str] = []  # finished since the last schedule(), for the runner
        self._pending_outputs: list[EngineOutput] = []  # finishes decided outside update()
        self._num_preempted_total = 0
        self._last_plan = _StepPlan(budget=0)
        self._last_num_prefill_tokens = 0
        self._last_num_decode_tokens = 0
        self._speculative = config.speculative == "ngram"
        self._last_num_draft_tokens = 0  # drafts scheduled by the last schedule()
        self._last_num_accepted_tokens = 0  # drafts accepted in the last update()

    # ------------------------------------------------------------------ requests in and out

    @property
    def num_waiting(self) -> int:
        return len(self.waiting)

    @property
    def num_running(self) -> int:
        return len(self.running)

    def has_unfinished_requests(self) -> bool:
        """True while a request is live or a finish (abort, deadline) still awaits `update()`."""
        return bool(self.requests) or bool(self._pending_outputs)

    def add_request(self, request: Request) -> None:
        """Queue a new request. Raises InvalidRequest when it could never be served, so it cannot hang."""
        self._validate(request)
        arrival_seq = self._num_added
        self._num_added += 1
        request.priority_key = priority_key(
            request.priority, self._clock(), arrival_seq, self.config.aging_interval_s
        )
        request.status = RequestStatus.WAITING
        self.requests[request.request_id] = request
        self.waiting.add(request)
        if request.deadline is not None:
            heapq.heappush(self._deadlines, (request.deadline, arrival_seq, request.request_id))

    def abort_requests(self, request_ids: Iterable[str], reason: FinishReason = FinishReason.ABORT) -> None:
        """Finish live requests now with `reason`, freeing their blocks at once.

        Unknown or already finished ids are ignored (aborts race with natural finishes). Each
        aborted request gets one EngineOutput carrying `reason` from the next `update()`.
        """
        for request_id in request_ids:
            request = self.requests.get(request_id)
            if request is None:
                continue
            self._finish(request, reason)
            self._pending_outputs.append(
                EngineOutput(request_id, [], None, reason, request.num_cached_tokens)
            )

    def _validate(self, request: Request) -> None:
        if request.request_id in self.requests:
            raise InvalidRequest(f"request id {request.request_id!r} is already in use", param="request_id")
        num_prompt = request.num_prompt_tokens
        max_model_len = self.config.max_model_len
        if num_prompt == 0:
            raise InvalidRequest("the prompt has no tokens", param="prompt")
        if num_prompt >= max_model_len:
            raise InvalidRequest(
                f"the prompt has {num_prompt} tokens; this model's context of {max_model_len} tokens "
                "leaves no room for output",
                param="prompt",
                hint=f"shorten the prompt to at most {max_model_len - 1} tokens",
            )
        # The last sampled token is never fed back, so the most KV slots a request needs is its
        # longest possible sequence minus one. If even the whole pool cannot hold that, the request
        # would preempt itself forever: refuse it now. max_tokens None runs to the end of the context.
        max_tokens = request.params.max_tokens
        max_len = max_model_len if max_tokens is None else min(num_prompt + max_tokens, max_model_len)
        num_blocks_needed = self.kv.num_blocks_for(max(num_prompt, max_len - 1))
        if num_blocks_needed > self.kv.num_usable_blocks:
            raise InvalidRequest(
                f"the request may need {num_blocks_needed} KV blocks but the cache has only "
                f"{self.kv.num_usable_blocks}",
                param="max_tokens",
                hint="lower max_tokens or shorten the prompt",
            )

    # ------------------------------------------------------------------ schedule

    def schedule(self) -> SchedulerOutput:
        """Plan one step under the token budget.

        Running decodes first (one token each, plus drafts with speculative decoding; the budget
        covers max_num_seqs of them), then running prefills (a chunk each), then waiting requests in
        priority order while seats and budget remain. A running request that cannot get blocks
        preempts the lowest-priority running request (possibly itself); drafts never preempt. Keeps:
        scheduled tokens <= max_num_batched_tokens; running requests <= max_num_seqs.
        """
        self._expire_deadlines(self._clock())
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        self._schedule_running(plan)
        # After a preemption memory is tight: admitting new work now would only thrash.
        if not plan.preempted_ids:
            self._schedule_waiting(plan)
        return self._build_output(plan)

    def _chunk_size(self, num_remaining: int, budget: int) -> int:
        """Tokens to schedule for a request with `num_remaining` uncomputed tokens; 0 = not now."""
        if not self.config.enable_chunked_prefill:
            return num_remaining if num_remaining <= budget else 0
        num_tokens = min(num_remaining, budget)
        threshold = self.config.long_prefill_token_threshold
        return min(num_tokens, threshold) if threshold > 0 else num_tokens

    def _schedule_running(self, plan: _StepPlan) -> None:
        decodes = [r for r in self.running if r.num_tokens - r.num_computed_tokens == 1]
        prefills = [r for r in self.running if r.num_tokens - r.num_computed_tokens > 1]
        for index, request in enumerate(decodes + prefills):
            if request.status != RequestStatus.RUNNING:
                continue  # preempted earlier in this pass
            if plan.budget <= 0:
                break
            # a decode's drafts leave one token of budget for each decode after it
            drafts = (
                self._drafts(request, plan.budget - (len(decodes) - index)) if index < len(decodes) else []
            )
            num_remaining = request.num_tokens - request.num_computed_tokens
            assert num_remaining >= 1, "a running request always has a token to compute"
            num_new = self._chunk_size(num_remaining, plan.budget)
            if num_new > 0 and self._allocate_or_preempt(request, num_new, plan):
                plan.add(request, num_new + len(drafts))
                if drafts:
                    plan.drafts[request.request_id] = drafts
        self._allocate_drafts(plan)

    def _allocate_drafts(self, plan: _StepPlan) -> None:
        """Give the drafts their KV slots from the blocks left once every running request has its own
        tokens' slots: drafts never preempt; a request they do not fit decodes plain (its tokens return)."""
        for request_id, drafts in list(plan.drafts.items()):
            request, num_new = plan.entries[request_id]
            if self.kv.allocate_slots(request, num_new) is None:
                del plan.drafts[request_id]
                plan.entries[request_id] = (request, num_new - len(drafts))
                plan.budget += len(drafts)

    def _drafts(self, request: Request, max_drafts: int) -> list[int]:
        """Draft tokens for the decode of `request`, at most `max_drafts`; [] where it decodes plain.

        Eligible: every decode (outputs started) without a grammar guide. A guide's matcher advances one
        accepted token at a time and has no way to take back rejected drafts, so guided requests decode
        plain. The rest need nothing here: `n` choices are requests of their own; the runner samples draft
        row i with the outputs plus drafts[:i], so penalties, min_tokens, logit_bias and logprobs see what
        plain decoding would, and it keeps seeded generators in step (runner/speculative.py).
        """
        if not self._speculative or request.num_output_tokens == 0 or request.params.guide is not None:
            return []
        # up to 1 + k tokens come back: the last may reach max_tokens or the context, as a plain decode's does
        limit = min(max_drafts, self.config.max_model_len - request.num_tokens - 1)
        max_tokens = request.params.max_tokens
        if max_tokens is not None:
            limit = min(limit, max_tokens - request.num_output_tokens - 1)
        if limit < 1:
            return []
        if request.draft is None:
            request.draft = DraftState(self.config.num_speculative_tokens)
        return request.draft.propose(request.all_token_ids, limit)

    def _allocate_or_preempt(self, request: Request, num_new: int, plan: _StepPlan) -> bool:
        """Allocate slots for `request`, preempting lowest-priority requests until it fits.

        Returns False when `request` itself was the lowest priority left and got preempted. A decode's
        lookahead slots are taken only from free blocks: they never preempt.
        """
        lookahead = self.num_lookahead_tokens if num_new == 1 else 0
        if lookahead and self.kv.allocate_slots(request, num_new, num_lookahead_tokens=lookahead) is not None:
            return True
        while self.kv.allocate_slots(request, num_new) is None:
            victim = self.running[-1]
            self._preempt(victim, plan)
            if victim is request:
                return False
        return True

    def _preempt(self, request: Request, plan: _StepPlan) -> None:
        """Take a running request's blocks back; it will recompute from position 0 when resumed."""
        plan.drop(request)
        self.kv.free(request)
        self.running.remove(request)
        request.status = RequestStatus.PREEMPTED
        request.num_computed_tokens = 0
        request.num_preemptions += 1
        self._num_preempted_total += 1
        self.waiting.add(request)  # its original key: ahead of every later request of its class
        plan.preempted_ids.append(request.request_id)
        logger.debug("preempted %s (%d tokens) to free KV blocks", request.request_id, request.num_tokens)

    def _schedule_waiting(self, plan: _StepPlan) -> None:
        while self.waiting and plan.budget > 0 and len(self.running) < self.config.max_num_seqs:
            request = self.waiting.peek()
            assert request is not None
            hits, num_hit_tokens = self.kv.get_computed_blocks(request)
            num_new = self._chunk_size(request.num_tokens - num_hit_tokens, plan.budget)
            # Head-of-line: skipping a request that does not fit would let a stream of smaller
            # ones starve it, so the queue waits for blocks or budget instead.
            if num_new == 0 or self.kv.allocate_slots(request, num_new, hits) is None:
                break
            self.waiting.pop()
            if request.status == RequestStatus.WAITING:
                request.num_cached_tokens = num_hit_tokens
                request.queue_s = max(0.0, self._clock() - request.arrival_time)
            request.num_computed_tokens = num_hit_tokens
            request.status = RequestStatus.RUNNING
            bisect.insort(self.running, request, key=_key)
            plan.add(request, num_new)
            plan.num_prefix_query_tokens += request.num_tokens
            plan.num_prefix_hit_tokens += num_hit_tokens

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        scheduled = []
        num_prefill = num_decode = num_draft = 0
        for request, num_new in plan.entries.values():
            drafts = plan.drafts.get(request.request_id, [])
            start = request.num_computed_tokens
            end = start + num_new - len(drafts)
            # Invariant: num_computed_tokens + scheduled tokens (drafts aside) <= num_tokens.
            assert end <= request.num_tokens
            sample = end == request.num_tokens
            is_decode = num_new == 1 + len(drafts) and sample and request.num_output_tokens > 0
            num_decode += num_new if is_decode else 0
            num_prefill += 0 if is_decode else num_new
            num_draft += len(drafts)
            outputs = tuple(request.all_token_ids[request.num_prompt_tokens :]) if sample else ()
            scheduled.append(
                ScheduledRequest(
                    request_id=request.request_id,
                    token_ids=request.all_token_ids[start:end] + drafts,
                    start_position=start,
                    block_ids=self.kv.block_ids(request.request_id),
                    sample=sample,
                    params=request.params,
                    num_computed_tokens_before=start,
                    prompt_token_ids=request.prompt_token_ids,
                    output_token_ids=outputs,
                    eos_token_ids=request.eos_token_ids,
                    draft_token_ids=tuple(drafts),
                )
            )
        finished_ids, self._finished_ids = self._finished_ids, []
        self._last_plan = plan
        self._last_num_prefill_tokens = num_prefill
        self._last_num_decode_tokens = num_decode
        self._last_num_draft_tokens = num_draft
        return SchedulerOutput(
            requests=scheduled,
            num_scheduled_tokens=num_prefill + num_decode,
            finished_request_ids=finished_ids,
            preempted_request_ids=list(plan.preempted_ids),
        )

    # ------------------------------------------------------------------ update

    def update(self, scheduler_output: SchedulerOutput, runner_output: RunnerOutput) -> list[EngineOutput]:
        """Apply one executed step: advance progress, append sampled tokens, cache full blocks,
        finish requests (stop / EOS / length / deadline) and free their blocks.

        Returns one EngineOutput per request that produced tokens or finished, finishes recorded
        since the previous update (aborts, expired deadlines) first.
        """
        outputs, self._pending_outputs = self._pending_outputs, []
        now = self._clock()
        self._last_num_accepted_tokens = 0
        for scheduled in scheduler_output.requests:
            request = self.requests.get(scheduled.request_id)
            if request is None or request.status != RequestStatus.RUNNING:
                continue  # finished (aborted) after it was scheduled
            output = self._update_request(request, scheduled, runner_output, now)
            if output is not None:
                outputs.append(output)
        return outputs

    def _update_request(
        self, request: Request, scheduled: ScheduledRequest, runner_output: RunnerOutput, now: float
    ) -> EngineOutput | None:
        if request.num_computed_tokens != scheduled.start_position:
            raise RuntimeError(f"update() for {request.request_id} does not match its schedule()")
        sampled = runner_output.sampled_token_ids.get(request.request_id, [])
        self._check_sampled(request.request_id, scheduled, sampled)
        new_token_ids: list[int] = []
        reason: FinishReason | None = None
        stop_token_id: int | None = None
        for token_id in sampled:  # a stop ends the request at its token: what follows it is dropped
            request.append_output_token(token_id)
            new_token_ids.append(token_id)
            reason, stop_token_id = self._check_stop(request, token_id)
            if reason is not None:
                break
        # A speculative decode's progress is its last token plus the drafts accepted, one less than the
        # tokens kept: the rejected drafts' KV is garbage past it, which the next step overwrites, and
        # cache_full_blocks (after the appends, before a finish frees the blocks) sees accepted tokens only.
        drafts = scheduled.draft_token_ids
        request.num_computed_tokens += len(new_token_ids) if drafts else len(scheduled.token_ids)
        assert request.num_computed_tokens <= request.num_tokens
        self.kv.cache_full_blocks(request)
        if drafts and request.draft is not None:
            request.draft.record(len(drafts), len(sampled) - 1)
            self._last_num_accepted_tokens += len(sampled) - 1
        if reason is None and request.deadline is not None and now >= request.deadline:
            reason = FinishReason.DEADLINE
        if reason is not None:
            self._finish(request, reason)
        if not new_token_ids and reason is None:
            return None
        logprobs = None
        if runner_output.logprobs is not None and request.request_id in runner_output.logprobs:
            logprobs = runner_output.logprobs[request.request_id][: len(new_token_ids)]
        queue_s = None
        if not request.queue_reported:  # the time in the queue, once, with the request's first output
            request.queue_reported, queue_s = True, request.queue_s
        return EngineOutput(
            request.request_id,
            new_token_ids,
            logprobs,
            reason,
            request.num_cached_tokens,
            stop_token_id,
            queue_s=queue_s,
        )

    @staticmethod
    def _check_sampled(request_id: str, scheduled: ScheduledRequest, sampled: list[int]) -> None:
        """RuntimeError where the runner's tokens cannot be this schedule's (the engine then stops)."""
        if scheduled.sample != bool(sampled):
            raise RuntimeError(
                f"runner returned {len(sampled)} tokens for {request_id} (sample={scheduled.sample})"
            )
        drafts = scheduled.draft_token_ids
        # a verify returns the drafts it accepted, in order, and one token more
        if drafts and (len(sampled) > 1 + len(drafts) or tuple(sampled[:-1]) != drafts[: len(sampled) - 1]):
            raise RuntimeError(
                f"runner returned {sampled} for {request_id}: not a run of its drafts {drafts}"
            )

    def _check_stop(self, request: Request, token_id: int) -> tuple[FinishReason | None, int | None]:
        """Finish check after appending `token_id`. Returns (reason, stop token id).

        NOTE: a stop (EOS or stop id) wins over a length cap hit by the same token. EOS and stop ids
        do not count before min_tokens outputs; the token that ends the request is in its output.
        """
        params = request.params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return FinishReason.STOP, None
            if token_id in params.stop_token_ids:
                return FinishReason.STOP, token_id
        is_at_max_tokens = params.max_tokens is not None and request.num_output_tokens >= params.max_tokens
        if is_at_max_tokens or request.num_tokens >= self.config.max_model_len:
            return FinishReason.LENGTH, None
        return None, None

    def _expire_deadlines(self, now: float) -> None:
        while self._deadlines and self._deadlines[0][0] <= now:
            _, arrival_seq, request_id = heapq.heappop(self._deadlines)
            request = self.requests.get(request_id)
            # The seq check skips a stale entry of an earlier request that reused this id.
            if request is not None and request.priority_key[2] == arrival_seq:
                self.abort_requests([request_id], FinishReason.DEADLINE)

    def _finish(self, request: Request, reason: FinishReason) -> None:
        """Move a live request to its terminal status and free everything it holds."""
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
        else:
            self.waiting.remove(request.request_id)
        self.kv.free(request)
        request.status = finished_status(reason)
        del self.requests[request.request_id]
        self._finished_ids.append(request.request_id)

    # ------------------------------------------------------------------ stats

    def get_stats(self) -> StepStats:
        """Counts after the last schedule/update; `step_time_s` is left for the engine to fill."""
        plan = self._last_plan
        return StepStats(
            num_running=len(self.running),
            num_waiting=len(self.waiting),
            num_preempted_total=self._num_preempted_total,
            kv_usage=self.kv.usage,
            num_batched_tokens=self._last_num_prefill_tokens + self._last_num_decode_tokens,
            num_prefill_tokens=self._last_num_prefill_tokens,
            num_decode_tokens=self._last_num_decode_tokens,
            num_prefix_hit_tokens=plan.num_prefix_hit_tokens,
            num_prefix_query_tokens=plan.num_prefix_query_tokens,
            num_draft_tokens=self._last_num_draft_tokens,
            num_accepted_tokens=self._last_num_accepted_tokens,
        )
