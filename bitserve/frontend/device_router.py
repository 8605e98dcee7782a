"""DeviceRouter: which replica of a model version serves a request. A version may run on several
devices (one Replica each: its own ModelInstance, engine, scheduler and KV cache); the router ranks the
live ones by predicted completion time, honours a request's `device` hint, skips replicas that are
dead, draining or saturated, and moves a request whose replica fails before its first token to the
next one (RoutedStream). Event-loop only; imports nothing of the lifecycle or the server.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bitserve.engine.devices import AUTO, CUDA, parse_device
from bitserve.engine.messages import Priority
from bitserve.engine.process import ServedModel
from bitserve.errors import BitserveError, DeadlineExceeded, EngineDead, InvalidRequest, ModelUnavailable
from bitserve.frontend.async_engine import AsyncEngine
from bitserve.frontend.generation_stream import GenerationStream, OutputStream, StreamTiming
from bitserve.outputs import RequestOutput
from bitserve.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

# Step time assumed for a replica none of whose steps was measured yet, when no sibling was measured
# either (seconds). Only ties matter then: every replica gets the same guess, and the first listed wins.
UNMEASURED_STEP_TIME_S = 0.05
FAILOVER_REASON = "replica_failover"


@dataclass(eq=False)
class Replica:
    """One engine of a model version on one device. `instance` carries the tokenizer, chat template and
    limits, identical on every replica of a version (same file, same config but the device)."""

    device: str  # "cpu" or "cuda:N"
    instance: ServedModel
    engine: AsyncEngine

    @property
    def is_alive(self) -> bool:
        return self.engine.is_alive

    @property
    def is_accepting(self) -> bool:
        """Alive and not draining: admission would at least look at a request."""
        return self.engine.is_alive and not self.engine.is_draining

    def is_healthy(self, max_stall_s: float | None) -> bool:
        """Accepting, and (with `max_stall_s`) not wedged: work pending but no step for that long."""
        is_stalled = max_stall_s is not None and self.engine.seconds_since_progress > max_stall_s
        return self.is_accepting and not is_stalled


def predicted_completion_s(replica: Replica, fallback_step_s: float) -> float:
    """How long a new request would take on `replica`, up to a factor common to every replica.

    Queue depth × measured step time: the depth counts the requests already there in batch rounds
    (active requests / max_num_seqs; continuous batching runs a whole batch per step, so a request
    waits whole rounds only once the batch is full), the step time is the engine's moving average.
    The request's own length needs the same number of steps on any replica, so it scales every
    estimate alike and drops out of the comparison.
    """
    engine = replica.engine
    step_s = engine.mean_step_time_s if engine.mean_step_time_s is not None else fallback_step_s
    max_num_seqs = max(1, replica.instance.scheduler_config.max_num_seqs or 1)
    return (1.0 + engine.num_active_requests / max_num_seqs) * step_s


@dataclass(frozen=True, slots=True)
class Submission:
    """What it takes to (re)submit one request to any replica."""

    prompt_token_ids: list[int]
    params: SamplingParams
    request_id: str
    priority: Priority
    deadline: float | None
    prompt_param: str


class DeviceRouter:
    """Routes over a slot's replicas (the list is shared with the slot, which fills it while loading).
    `max_stall_s`: a replica with work pending and no step for this long is skipped as wedged (the
    liveness probe's threshold); None never skips one for that."""

    def __init__(self, replicas: list[Replica], max_stall_s: float | None = None) -> None:
        self.replicas = replicas
        self.max_stall_s = max_stall_s

    @property
    def devices(self) -> list[str]:
        return [replica.device for replica in self.replicas]

    def candidates(self, hint: str | None) -> list[Replica]:
        """The replicas a request may use: all of them (no hint, or "auto"), or those matching its
        `device` hint ("cuda" matches every GPU replica, "cuda:1" and "cpu" one each). A hint that is
        not a device, or names none of this version's, is an InvalidRequest (400) naming the devices
        there are."""
        try:
            value = parse_device(hint) if hint is not None else AUTO
        except InvalidRequest:
            value = None  # not a device at all: refused below, with this model's devices
        if value == AUTO:
            return list(self.replicas)
        matches = [
            replica
            for replica in self.replicas
            if replica.device == value or (value == CUDA and replica.device.startswith(f"{CUDA}:"))
        ]
        if not matches:
            raise InvalidRequest(
                f"device {hint[:32]!r} does not serve this model",
                param="device",
                hint=f"this model runs on: {', '.join(self.devices)}; or leave device out",
            )
        return matches

    def rank(self, candidates: Sequence[Replica]) -> list[Replica]:
        """Healthy replicas, lowest predicted completion time first (ties: the order they were listed
        in). Replicas not yet measured borrow the fastest measured sibling's step time."""
        measured = [r.engine.mean_step_time_s for r in self.replicas if r.engine.mean_step_time_s is not None]
        fallback_s = min(measured) if measured else UNMEASURED_STEP_TIME_S
        healthy = [replica for replica in candidates if replica.is_healthy(self.max_stall_s)]
        return sorted(healthy, key=lambda replica: predicted_completion_s(replica, fallback_s))

    def pick(
        self, candidates: Sequence[Replica], num_prompt_tokens: int, priority: Priority = Priority.NORMAL
    ) -> Replica | None:
        """DeviceRouter.pick: the best-ranked replica whose admission has room at this priority, or None."""
        ranked = self.rank(candidates)
        return next((r for r in ranked if r.engine.has_room(num_prompt_tokens, priority)), None)

    def submit(
        self,
        prompt_token_ids: list[int],
        params: SamplingParams,
        *,
        request_id: str,
        priority: Priority = Priority.NORMAL,
        deadline: float | None = None,
        prompt_param: str = "prompt",
        device: str | None = None,
    ) -> RoutedStream:
        """Admit one request on the best replica (see `pick`) and return its stream. Raises, before
        anything is queued: InvalidRequest for a bad hint or request; QueueFull when every candidate is
        saturated; EngineDead / ModelUnavailable when none is alive and accepting."""
        candidates = self.candidates(device)
        submission = Submission(prompt_token_ids, params, request_id, priority, deadline, prompt_param)
        replica, stream = self.admit(submission, candidates)
        return RoutedStream(self, submission, candidates, replica, stream)

    def admit(
        self, submission: Submission, candidates: Sequence[Replica]
    ) -> tuple[Replica, GenerationStream]:
        """Submit to the best candidate with room (see `pick`); the errors of `submit` when none takes it."""
        replica = self.pick(candidates, len(submission.prompt_token_ids), submission.priority)
        if replica is None:
            ranked = self.rank(candidates)
            if not ranked:
                raise self._no_replica_error(candidates)
            # Every healthy candidate is saturated: the one that frees up first refuses the request
            # (QueueFull with its Retry-After, counted once; or the request's own error, which comes first).
            replica = min(ranked, key=lambda r: r.engine.expected_wait_s())
        return replica, self._submit_to(replica, submission)

    def _submit_to(self, replica: Replica, submission: Submission) -> GenerationStream:
        return replica.engine.submit(
            submission.prompt_token_ids,
            submission.params,
            request_id=submission.request_id,
            priority=submission.priority,
            deadline=submission.deadline,
            prompt_param=submission.prompt_param,
        )

    def _no_replica_error(self, candidates: Sequence[Replica]) -> BitserveError:
        devices = ", ".join(replica.device for replica in candidates)
        if any(replica.is_accepting for replica in candidates):
            return ModelUnavailable(
                f"the model's engine on {devices} is not making progress",
                hint="retry after Retry-After seconds",
            )
        if any(replica.is_alive for replica in candidates):
            return ModelUnavailable(
                f"the model's replicas on {devices} are draining", hint="retry after Retry-After seconds"
            )
        return EngineDead(
            f"the model's engine has failed on {devices}", hint="roll back or reload the model; retry later"
        )


def may_fail_over(stream: GenerationStream, error: BaseException) -> bool:
    """A request moves to another replica only before its first token (nothing reached the client, so
    a rerun is invisible), and not for a drain or shutdown (they end every replica alike) nor an expired
    deadline (it has expired on every replica)."""
    return (
        isinstance(error, BitserveError)
        and not isinstance(error, ModelUnavailable | DeadlineExceeded)
        and stream.timing.num_output_tokens == 0
    )


class RoutedStream(OutputStream):
    """The GenerationStream of a routed request, with failover: when its replica fails before the first
    token (engine death, a rejection by that engine), the request is resubmitted, same id and params,
    to the best remaining candidate; the client sees one uninterrupted stream. Same consumer surface as
    GenerationStream: `next`, `async for`, `collect`, `close`, `on_close`."""

    def __init__(
        self,
        router: DeviceRouter,
        submission: Submission,
        candidates: Sequence[Replica],
        replica: Replica,
        stream: GenerationStream,
    ) -> None:
        self.router = router
        self.submission = submission
        self.replica = replica  # the replica serving it now
        self.on_close: Callable[[BaseException | None], None] | None = None
        self._candidates = list(candidates)
        self._tried = [replica]
        self._stream = stream
        self._is_closed = False

    @property
    def request_id(self) -> str:
        return self._stream.request_id

    @property
    def num_prompt_tokens(self) -> int:
        return self._stream.num_prompt_tokens

    @property
    def num_output_tokens(self) -> int:
        """Tokens generated so far, all choices together (token quotas settle on it)."""
        return self._stream.timing.num_output_tokens

    @property
    def timing(self) -> StreamTiming:
        """Arrival, first token and token counts of the stream serving the request now."""
        return self._stream.timing

    @property
    def error(self) -> BaseException | None:
        return self._stream.error

    @property
    def device(self) -> str:
        return self.replica.device

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        """GenerationStream.next, moving to another replica on a failure before the first token."""
        while True:
            try:
                return await self._stream.next(timeout)
            except BitserveError as exc:
                if self._is_closed or not may_fail_over(self._stream, exc) or not self._fail_over(exc):
                    raise

    def _fail_over(self, error: BaseException) -> bool:
        """Resubmit to the best untried candidate; False when none takes it (the error stands)."""
        remaining = [replica for replica in self._candidates if replica not in self._tried]
        if not remaining:
            return False
        try:
            replica, stream = self.router.admit(self.submission, remaining)
        except BitserveError as refusal:
            logger.warning(
                "request %s failed on %s before its first token (%s); no other replica takes it: %s",
                self.request_id,
                self.replica.device,
                error,
                refusal,
            )
            return False
        logger.warning(
            "request %s failed on %s before its first token (%s); moved to %s",
            self.request_id,
            self.replica.device,
            error,
            replica.device,
        )
        self._stream.abort_reason = FAILOVER_REASON
        self._stream.close()
        self._tried.append(replica)
        self.replica, self._stream = replica, stream
        return True

    def empty_result(self) -> RequestOutput:
        return self._stream.empty_result()

    def close(self) -> None:
        """End the stream on its replica (idempotent) and run on_close once with the final error."""
        if self._is_closed:
            return
        self._is_closed = True
        self._stream.close()
        if self.on_close is not None:
            self.on_close(self._stream.error)
