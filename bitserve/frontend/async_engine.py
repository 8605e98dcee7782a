"""AsyncEngine: the asyncio face of one ModelInstance. Admission, the n-choice fan-out, one
GenerationStream per request, cancellation, drain and engine death. Runs on the event loop; never
blocks on model compute: the engine runs in a thread of its own (ThreadEngineClient) or a process of
its own (ProcessEngineClient).
"""

from __future__ import annotations

import asyncio
import itertools
import time
from collections.abc import Sequence
from dataclasses import dataclass

from bitserve.config import ServerConfig
from bitserve.engine.instance import ModelInstance
from bitserve.engine.messages import Embed, EngineOutput, KVCacheStats, Priority, StepResult, StepStats
from bitserve.engine.process import RemoteModelInstance, ServedModel
from bitserve.errors import BitserveError, EngineDead, ModelUnavailable, QueueFull
from bitserve.frontend.admission import AdmissionLimits, check_request
from bitserve.frontend.engine_client import EngineCallbacks, EngineClient, ThreadEngineClient
from bitserve.frontend.generation_stream import DEADLINE_REASON, GenerationStream, deadline_error
from bitserve.frontend.output_processor import OutputProcessor, choice_request_id
from bitserve.frontend.process_client import ProcessEngineClient
from bitserve.metrics.stats import NullStatsSink, RequestStats, StatsSink
from bitserve.sampling_params import SamplingParams

# Batched tokens per second assumed before the first step was measured (queue-wait estimates).
INITIAL_TOKENS_PER_S = 50.0
# Tokens a running request is assumed to still need, for the queue-wait estimate.
TOKENS_PER_RUNNING_REQUEST = 16
# Weight of the newest decode step in the step-time moving average the router reads: about the last
# ten count, so a replica that slows down (a bigger batch, a throttled device) is seen within a
# fraction of a second of decode, while one odd step does not swing the choice.
STEP_TIME_EWMA_WEIGHT = 0.1


@dataclass(frozen=True, slots=True)
class EngineSnapshot:
    """What /v1/stats and /health show of one engine: counters only, read on the event loop."""

    model: str
    device: str
    num_active_requests: int
    num_queued_prompt_tokens: int
    tokens_per_s: float
    mean_step_time_s: float | None
    is_alive: bool
    is_draining: bool
    seconds_since_progress: float
    last_step: StepStats | None
    kv_cache: KVCacheStats


def replica_limits(config: ServerConfig, instance: ServedModel) -> AdmissionLimits:
    """The admission limits of the replica serving `instance`: `config`'s, else scaled to its batch and KV
    cache (AdmissionLimits.for_replica)."""
    assert instance.scheduler_config.max_num_seqs is not None, "resolved at load"
    return AdmissionLimits.for_replica(
        config, instance.scheduler_config.max_num_seqs, int(instance.kv_cache_description["num_tokens"])
    )


class AsyncEngine:
    def __init__(
        self,
        instance: ServedModel,
        *,
        limits: AdmissionLimits | None = None,
        stats: StatsSink | None = None,
        name: str | None = None,
        device: str | None = None,
    ) -> None:
        self.instance = instance
        self.name = name or instance.name  # the model label of outputs and metrics (the served alias)
        self.device = device or instance.config.model.device  # the replica's device: a metrics label
        self.quant_format = instance.quant_format  # the version's weight format: a metrics label
        self.limits = limits or replica_limits(ServerConfig(), instance)
        self.stats = stats or NullStatsSink()
        self.processor = OutputProcessor(instance.tokenizer)
        self._streams: dict[str, GenerationStream] = {}
        self._queued_tokens = 0
        self._client: EngineClient | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # request id -> the timer that ends its stream at its deadline (the engine checks deadlines only
        # between steps; this one fires on time even during a long prefill or a stalled engine)
        self._deadline_timers: dict[str, asyncio.TimerHandle] = {}
        self._embeds: dict[str, asyncio.Future[list[list[float]]]] = {}  # request id -> its answer
        self._dead: BaseException | None = None
        self.is_draining = False
        self.last_stats: StepStats | None = None
        self._tokens_per_s = 0.0  # moving average of batched tokens per second (queue-wait estimate)
        # moving average of decode steps (no prefill in them): the router's measure of this replica's
        # speed; prefill chunks are left out, their time is the prompt's, not the device's pace
        self.mean_step_time_s: float | None = None
        self._busy_since = 0.0  # when the engine last went from idle to having work (liveness)
        self._ids = itertools.count()
        self.itl_sum_s = 0.0  # cumulative over finished requests: the probation's latency signal
        self.itl_count = 0
        self.ttft_sum_s = 0.0  # and their time to first token (a canary's comparison)
        self.ttft_count = 0

    # ----------------------------------------------------------------- lifecycle

    def start(self) -> None:
        loop = self._loop = asyncio.get_running_loop()
        callbacks = EngineCallbacks(self._on_step, self._on_rejected, self._on_dead, self._on_embedded)
        if isinstance(self.instance, RemoteModelInstance):  # the engine runs in its own process
            self._client = ProcessEngineClient(self.instance.engine_process, loop, callbacks)
        else:
            self._client = ThreadEngineClient(self.instance.engine, loop, callbacks)

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

    def forget_step_times(self) -> None:
        """Drop the measured step time (after warm-up: its steps paid for lazy initialisation, JIT
        compilation or CUDA-graph capture, and would make a fast replica look slow until traffic
        that it would then not get remeasures it)."""
        self.mean_step_time_s = None

    def expected_wait_s(self) -> float:
        """Seconds until the queued and running work is likely done (unbounded: callers clamp)."""
        rate = self._tokens_per_s if self._tokens_per_s > 0 else INITIAL_TOKENS_PER_S
        return (self._queued_tokens + TOKENS_PER_RUNNING_REQUEST * len(self._streams)) / rate

    # ----------------------------------------------------------------- requests

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str | None = None,
        priority: Priority = Priority.NORMAL,
        deadline: float | None = None,
        prompt_param: str = "prompt",
    ) -> GenerationStream:
        """Admit one request and return its stream. Raises QueueFull / InvalidRequest /
        ContextLengthExceeded / ModelUnavailable / EngineDead before anything is queued."""
        self._admit(prompt_token_ids, params, prompt_param, priority)
        assert self._client is not None, "AsyncEngine.start() was not called"
        request_id = request_id or f"req-{next(self._ids)}"
        stream = GenerationStream(
            request_id, list(prompt_token_ids), params.n, model=self.name, end=self._end
        )
        if not self._streams:
            self._busy_since = time.monotonic()
        self._streams[request_id] = stream
        self._queued_tokens += len(prompt_token_ids)
        for request in self.processor.add_choices(
            request_id, prompt_token_ids, params, priority=priority, deadline=deadline
        ):
            self._client.add_request(request)
        if deadline is not None and self._loop is not None:
            delay_s = max(0.0, deadline - time.monotonic())
            self._deadline_timers[request_id] = self._loop.call_later(delay_s, self._expire_deadline, stream)
        return stream

    def _expire_deadline(self, stream: GenerationStream) -> None:
        """The deadline passed: end the stream with DeadlineExceeded (its close aborts the choices)."""
        self._deadline_timers.pop(stream.request_id, None)
        if self._streams.get(stream.request_id) is stream and stream.unfinished:
            stream.abort_reason = DEADLINE_REASON
            stream.put(deadline_error())

    def _admit(
        self, prompt_token_ids: list[int], params: SamplingParams, prompt_param: str, priority: Priority
    ) -> None:
        if self._dead is not None:
            raise EngineDead(
                "the model's engine has failed", hint="the server restarts or routes elsewhere; retry later"
            )
        if self.is_draining:
            raise ModelUnavailable(
                "the server is draining and accepts no new requests", hint="retry on another replica"
            )
        check_request(
            prompt_token_ids,
            params,
            max_model_len=self.instance.max_model_len,
            vocab_size=self.instance.tokenizer.vocab_size,
            prompt_param=prompt_param,
        )
        if not self.has_room(len(prompt_token_ids), priority):
            self.stats.record_rejected("queue_full")
            raise QueueFull("the server is at capacity", retry_after_s=self.expected_wait_s())

    def has_room(self, num_prompt_tokens: int, priority: Priority = Priority.NORMAL) -> bool:
        """Whether admission would take one more request of this many prompt tokens at this priority
        (AdmissionLimits.caps: low is shed first, a share stays for high). The router asks before it
        submits, so a full replica is skipped without counting a refusal."""
        max_waiting, max_tokens = self.limits.caps(priority)
        return len(self._streams) < max_waiting and self._queued_tokens + num_prompt_tokens <= max_tokens

    def _end(self, stream: GenerationStream) -> None:
        """A stream closed: abort its unfinished choices, forget it, record its stats (once)."""
        if self._streams.pop(stream.request_id, None) is None:
            return
        timer = self._deadline_timers.pop(stream.request_id, None)
        if timer is not None:
            timer.cancel()
        if stream.unfinished and self._client is not None:
            choice_ids = [choice_request_id(stream.request_id, index) for index in sorted(stream.unfinished)]
            self._client.abort_requests(choice_ids)
            for choice_id in choice_ids:
                self.processor.drop_request(choice_id)
            self.stats.record_aborted(stream.abort_reason)
        self._queued_tokens -= stream.num_prompt_tokens
        timing, now = stream.timing, time.monotonic()
        self.itl_sum_s += timing.itl_sum_s
        self.itl_count += timing.itl_count
        if timing.first_token_at is not None:
            self.ttft_sum_s += timing.first_token_at - timing.arrival
            self.ttft_count += 1
        self.stats.record_request(
            RequestStats(
                model=self.name,
                device=self.device,
                quant_format=self.quant_format,
                finish_reason=stream.finish_reason if stream.is_finished else "abort",
                num_prompt_tokens=stream.num_prompt_tokens,
                num_output_tokens=timing.num_output_tokens,
                e2e_s=now - timing.arrival,
                ttft_s=None if timing.first_token_at is None else timing.first_token_at - timing.arrival,
                mean_itl_s=None if not timing.itl_count else timing.itl_sum_s / timing.itl_count,
                queue_s=timing.queue_s,
            )
        )

    def expire(self, error: BaseException) -> int:
        """The one "end every stream": deliver `error` to every stream in flight (a drain deadline,
        an unload, engine death); returns how many there were."""
        for stream in self._streams.values():
            stream.put(error)
        return len(self._streams)

    # ----------------------------------------------------------------- engine thread callbacks (on the loop)

    def _on_step(self, result: StepResult) -> None:
        self.last_stats = result.stats
        if result.stats.step_time_s > 0:
            rate = result.stats.num_batched_tokens / result.stats.step_time_s
            self._tokens_per_s = rate if self._tokens_per_s == 0 else 0.9 * self._tokens_per_s + 0.1 * rate
            if result.stats.num_decode_tokens > 0 and result.stats.num_prefill_tokens == 0:
                last, weight = self.mean_step_time_s, STEP_TIME_EWMA_WEIGHT
                step_s = result.stats.step_time_s
                self.mean_step_time_s = step_s if last is None else (1 - weight) * last + weight * step_s
        self.stats.record_step(self.name, self.device, self.quant_format, result.stats)
        self._record_queue_times(result.outputs)
        deltas, abort_ids = self.processor.process(result.outputs)
        if abort_ids and self._client is not None:
            self._client.abort_requests(abort_ids)
        now = time.monotonic()
        for delta in deltas:
            stream = self._streams.get(delta.parent_id)
            if stream is None:
                continue
            if delta.output.token_ids:
                stream.timing.record_tokens(len(delta.output.token_ids), now)
            stream.put(delta)

    def _record_queue_times(self, outputs: Sequence[EngineOutput]) -> None:
        """A choice's first output carries its time in the queue; a request keeps its first choice's."""
        for output in outputs:
            if output.queue_s is None:
                continue
            stream = self._streams.get(output.request_id.rpartition("/")[0])
            if stream is not None and stream.timing.queue_s is None:
                stream.timing.queue_s = output.queue_s

    async def embed(
        self, request_id: str, inputs: list[list[int]], dimensions: int | None = None
    ) -> list[list[float]]:
        """Normalised embeddings of `inputs` (token ids, each checked to fit the context by the caller),
        computed on the engine thread between steps with the model's own pooling."""
        if self._dead is not None or self._client is None:
            raise EngineDead("the model's engine has failed", hint="retry later")
        if len(self._embeds) >= self.limits.max_num_waiting:  # each waits its turn on the engine thread
            self.stats.record_rejected("queue_full")
            raise QueueFull("the server is at capacity", retry_after_s=self.expected_wait_s())
        future: asyncio.Future[list[list[float]]] = asyncio.get_running_loop().create_future()
        self._embeds[request_id] = future
        command = Embed(request_id, tuple(tuple(ids) for ids in inputs), self.instance.pooling, dimensions)
        self._client.embed(command)
        try:
            return await future  # cancelled (client gone): the engine still answers; the answer is dropped
        finally:
            self._embeds.pop(request_id, None)

    def _on_embedded(self, request_id: str, result: list[list[float]] | BitserveError) -> None:
        future = self._embeds.get(request_id)
        if future is None or future.done():
            return
        if isinstance(result, BitserveError):
            future.set_exception(result)
        else:
            future.set_result(result)

    def _on_rejected(self, choice_id: str, error: BitserveError) -> None:
        parent_id = choice_id.rpartition("/")[0]
        stream = self._streams.get(parent_id)
        if stream is not None:
            stream.put(error)

    def _on_dead(self, error: BaseException) -> None:
        self._dead = error
        for future in self._embeds.values():
            if not future.done():
                future.set_exception(EngineDead("the model's engine failed", hint="retry"))
        self.expire(
            EngineDead(
                f"the model's engine failed: {type(error).__name__}: {error}",
                hint="retry; the replica is out of service",
            )
        )

    def _kv_cache_stats(self) -> KVCacheStats:
        if self._client is not None:
            return self._client.kv_cache_stats()
        assert isinstance(self.instance, ModelInstance), "a remote instance is always started"
        return self.instance.engine.kv_cache_stats()

    def snapshot(self) -> EngineSnapshot:
        return EngineSnapshot(
            model=self.name,
            device=self.device,
            num_active_requests=len(self._streams),
            num_queued_prompt_tokens=self._queued_tokens,
            tokens_per_s=round(self._tokens_per_s, 2),
            mean_step_time_s=None if self.mean_step_time_s is None else round(self.mean_step_time_s, 6),
            is_alive=self.is_alive,
            is_draining=self.is_draining,
            seconds_since_progress=round(self.seconds_since_progress, 3),
            last_step=self.last_stats,
            kv_cache=self._kv_cache_stats(),
        )
