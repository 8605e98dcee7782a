"""AsyncEngine: the asyncio face of one ModelInstance. Admission, fan-out of n choices, streaming of
deltas, cancellation on disconnect, drain and engine death. Runs on the event loop; never blocks on
model compute (the engine has its own thread behind ThreadEngineClient).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from bitserve.config import ServerConfig
from bitserve.core.request import Priority
from bitserve.engine.messages import EngineRequest, StepResult, StepStats
from bitserve.errors import BitserveError, EngineDead, InvalidRequest, ModelUnavailable, QueueFull
from bitserve.frontend.engine_client import ThreadEngineClient
from bitserve.frontend.output_processor import ChoiceDelta, OutputProcessor
from bitserve.lifecycle.instance import ModelInstance
from bitserve.metrics.stats import NullStatsSink, RequestStats, StatsSink
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.sampling_params import SamplingParams, child_params

logger = logging.getLogger(__name__)

# Retry-After bounds (seconds): never tell a client "0", never send it away for minutes
MIN_RETRY_AFTER_S = 1.0
MAX_RETRY_AFTER_S = 60.0


@dataclass(frozen=True, slots=True)
class AdmissionLimits:
    """When new requests get 429: unfinished requests, or their prompt tokens, at these counts.
    The defaults live in ServerConfig (config.py), the one home of defaults."""

    max_num_waiting: int
    max_num_queued_tokens: int

    @classmethod
    def from_config(cls, config: ServerConfig) -> AdmissionLimits:
        return cls(max_num_waiting=config.max_num_waiting, max_num_queued_tokens=config.max_num_queued_tokens)


@dataclass(slots=True)
class _Stream:
    """One client request: its choices' engine ids and the queue its deltas arrive on."""

    request_id: str
    prompt_token_ids: list[int]
    num_choices: int
    queue: asyncio.Queue[ChoiceDelta | BaseException] = field(default_factory=asyncio.Queue)
    unfinished: set[str] = field(default_factory=set)
    arrival: float = field(default_factory=time.monotonic)
    first_token_at: float | None = None
    last_token_at: float | None = None
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    itl_sum: float = 0.0
    itl_count: int = 0


class AsyncEngine:
    def __init__(self, instance: ModelInstance, *, limits: AdmissionLimits | None = None, stats: StatsSink | None = None,
                 name: str | None = None) -> None:  # fmt: skip
        self.instance = instance
        self.name = name or instance.name  # the model label of outputs and metrics (the served alias)
        self.limits = limits or AdmissionLimits.from_config(ServerConfig())
        self.stats = stats or NullStatsSink()
        self.processor = OutputProcessor(instance.tokenizer)
        self._streams: dict[str, _Stream] = {}
        self._choice_owner: dict[str, str] = {}  # engine request id -> client request id
        self._queued_tokens = 0
        self._client: ThreadEngineClient | None = None
        self._dead: BaseException | None = None
        self.is_draining = False
        self.last_stats: StepStats | None = None
        self._tokens_per_s = 0.0  # moving average of batched tokens per second, for Retry-After
        self._busy_since = 0.0  # when the engine last went from idle to having work (liveness)
        self._ids = itertools.count()
        self.itl_sum_s = 0.0  # cumulative over finished requests: the probation's latency signal
        self.itl_count = 0

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        loop = asyncio.get_running_loop()
        self._client = ThreadEngineClient(self.instance.engine, loop, self._on_step, self._on_rejected, self._on_dead)

    async def shutdown(self) -> None:
        if self._client is not None:
            self._client.shutdown()
            await asyncio.get_running_loop().run_in_executor(None, self._client.join, 10.0)

    @property
    def is_alive(self) -> bool:
        return self._dead is None and self._client is not None and self._client.is_alive

    @property
    def num_active_requests(self) -> int:
        return len(self._streams)

    @property
    def seconds_since_progress(self) -> float:
        """0 when idle; else the time since the engine last finished a step or, if later, since work
        arrived at an idle engine (a wedged engine grows it; a long idle spell does not)."""
        if self._client is None or not self._streams:
            return 0.0
        return time.monotonic() - max(self._client.last_progress, self._busy_since)

    def expected_wait_s(self) -> float:
        rate = self._tokens_per_s if self._tokens_per_s > 0 else 50.0
        estimate = (self._queued_tokens + 16 * len(self._streams)) / rate
        return min(MAX_RETRY_AFTER_S, max(MIN_RETRY_AFTER_S, estimate))

    # ----------------------------------------------------------------- requests

    def _admit(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        if self._dead is not None:
            raise EngineDead("the model's engine has failed", hint="the server restarts or routes elsewhere; retry later")
        if self.is_draining:
            raise ModelUnavailable("the server is draining and accepts no new requests", hint="retry on another replica")
        if len(prompt_token_ids) + 1 > self.instance.max_model_len:
            raise InvalidRequest(
                f"the prompt has {len(prompt_token_ids)} tokens; this model serves at most {self.instance.max_model_len} tokens in total",
                param="prompt", hint="shorten the prompt",
            )  # fmt: skip
        params.validate_for_vocab(self.instance.tokenizer.vocab_size)
        if len(self._streams) >= self.limits.max_num_waiting or self._queued_tokens + len(prompt_token_ids) > self.limits.max_num_queued_tokens:
            self.stats.record_rejected("queue_full")
            raise QueueFull("the server is at capacity", retry_after_s=self.expected_wait_s())

    async def generate(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: Priority = Priority.NORMAL,
        deadline: float | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream RequestOutput deltas for one request; the last has finished=True.

        Raises QueueFull / InvalidRequest / ModelUnavailable / EngineDead before the first yield, and
        EngineDead or RequestFailed mid-stream. A consumer that stops iterating (client disconnect)
        aborts the request; the engine frees its blocks before its next step.
        """
        self._admit(prompt_token_ids, params)
        assert self._client is not None, "AsyncEngine.start() was not called"
        request_id = request_id or f"req-{next(self._ids)}"
        stream = _Stream(request_id, list(prompt_token_ids), params.n)
        if not self._streams:
            self._busy_since = time.monotonic()
        self._streams[request_id] = stream
        self._queued_tokens += len(prompt_token_ids)
        for index in range(params.n):
            choice_id = f"{request_id}/{index}"
            choice = child_params(params, index)
            self._choice_owner[choice_id] = request_id
            stream.unfinished.add(choice_id)
            self.processor.add_request(choice_id, request_id, index, choice)
            self._client.add_request(EngineRequest(
                choice_id, tuple(prompt_token_ids), choice, self.instance.tokenizer.eos_token_ids, priority, deadline=deadline,
            ))  # fmt: skip
        finish_reason = "abort"
        try:
            while stream.unfinished:
                output = await self._next_output(stream)
                if output.finished:
                    finish_reason = output.outputs[-1].finish_reason or "stop"
                yield output
        finally:
            if stream.unfinished:  # the consumer went away (disconnect) or an error ended the stream
                self.abort(request_id)
            self._forget(stream, finish_reason)

    async def _next_output(self, stream: _Stream) -> RequestOutput:
        """Wait for at least one delta, then take everything else already queued."""
        items = [await stream.queue.get()]
        while not stream.queue.empty():
            items.append(stream.queue.get_nowait())
        outputs: dict[int, CompletionOutput] = {}
        for item in items:
            if isinstance(item, BaseException):
                raise item
            self._merge(stream, outputs, item)
        return RequestOutput(
            request_id=stream.request_id,
            prompt_token_ids=stream.prompt_token_ids,
            outputs=[outputs[i] for i in sorted(outputs)],
            finished=not stream.unfinished,
            num_cached_tokens=stream.num_cached_tokens,
            model=self.name,
        )

    @staticmethod
    def _merge(stream: _Stream, outputs: dict[int, CompletionOutput], delta: ChoiceDelta) -> None:
        output = outputs.setdefault(delta.index, CompletionOutput(delta.index, "", []))
        output.text += delta.text
        output.token_ids.extend(delta.token_ids)
        if delta.logprobs:
            output.logprobs = (output.logprobs or []) + list(delta.logprobs)
        if delta.finish_reason is not None:
            output.finish_reason, output.stop_reason = delta.finish_reason, delta.stop_reason
            stream.unfinished.discard(f"{stream.request_id}/{delta.index}")
        stream.num_cached_tokens = max(stream.num_cached_tokens, delta.num_cached_tokens)

    def abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is None or self._client is None:
            return
        self._client.abort_requests(sorted(stream.unfinished))
        for choice_id in stream.unfinished:
            self.processor.drop_request(choice_id)
        self.stats.record_aborted("client_disconnect")

    def _forget(self, stream: _Stream, finish_reason: str) -> None:
        if self._streams.pop(stream.request_id, None) is None:
            return
        self._queued_tokens -= len(stream.prompt_token_ids)
        for index in range(stream.num_choices):
            self._choice_owner.pop(f"{stream.request_id}/{index}", None)
        now = time.monotonic()
        self.itl_sum_s += stream.itl_sum
        self.itl_count += stream.itl_count
        self.stats.record_request(RequestStats(
            model=self.name, finish_reason=finish_reason, num_prompt_tokens=len(stream.prompt_token_ids),
            num_output_tokens=stream.num_output_tokens, e2e_s=now - stream.arrival,
            ttft_s=None if stream.first_token_at is None else stream.first_token_at - stream.arrival,
            mean_itl_s=None if not stream.itl_count else stream.itl_sum / stream.itl_count,
        ))  # fmt: skip

    # ----------------------------------------------------------------- engine thread callbacks (on the loop)

    def _on_step(self, result: StepResult) -> None:
        self.last_stats = result.stats
        if result.stats.step_time_s > 0:
            rate = result.stats.num_batched_tokens / result.stats.step_time_s
            self._tokens_per_s = rate if self._tokens_per_s == 0 else 0.9 * self._tokens_per_s + 0.1 * rate
        self.stats.record_step(self.name, result.stats)
        deltas, abort_ids = self.processor.process(result.outputs)
        if abort_ids and self._client is not None:
            self._client.abort_requests(abort_ids)
        now = time.monotonic()
        for delta in deltas:
            stream = self._streams.get(delta.parent_id)
            if stream is None:
                continue
            if delta.token_ids:
                if stream.first_token_at is None:
                    stream.first_token_at = now
                elif stream.last_token_at is not None:
                    stream.itl_sum += now - stream.last_token_at
                    stream.itl_count += 1
                stream.last_token_at = now
                stream.num_output_tokens += len(delta.token_ids)
            stream.queue.put_nowait(delta)

    def _on_rejected(self, choice_id: str, error: BitserveError) -> None:
        owner = self._choice_owner.get(choice_id)
        stream = self._streams.get(owner) if owner else None
        if stream is not None:
            stream.queue.put_nowait(error)

    def _on_dead(self, error: BaseException) -> None:
        self._dead = error
        self.expire(EngineDead(f"the model's engine failed: {type(error).__name__}: {error}", hint="retry; the replica is out of service"))

    def expire(self, error: BaseException) -> int:
        """End every stream still in flight with `error` (a drain deadline); returns how many."""
        for stream in self._streams.values():
            stream.queue.put_nowait(error)
        return len(self._streams)

    def stats_snapshot(self) -> dict[str, object]:
        stats = self.last_stats
        return {
            "model": self.name,
            "num_active_requests": len(self._streams),
            "num_queued_prompt_tokens": self._queued_tokens,
            "tokens_per_s_ema": round(self._tokens_per_s, 2),
            "engine_alive": self.is_alive,
            "draining": self.is_draining,
            "last_step": dataclasses.asdict(stats) if stats is not None else None,
        }
