"""ProcessEngineClient over a real pipe, with this test standing in for the engine process (its other end):
commands of one event-loop iteration travel as one message, step results are handed to the callbacks in
order and a few at a time (the event loop's other tasks run between), a pipe that closes without a
Shutdown is the engine's death, and one closed after Shutdown is not."""

from __future__ import annotations

import asyncio
import multiprocessing
from dataclasses import dataclass, field
from typing import Any

import pytest

from bitserve.core.step_outputs import KVCacheStats, StepStats
from bitserve.engine.messages import AbortRequests, AddRequest, EngineRequest, Shutdown, StepResult
from bitserve.engine.process import EngineFacts, EngineProcess, Stepped
from bitserve.errors import EngineDead
from bitserve.frontend.engine_client import EngineCallbacks
from bitserve.frontend.process_client import MESSAGES_PER_READ, ProcessEngineClient
from bitserve.sampling_params import SamplingParams

KV = KVCacheStats(usage=0.0, num_free_blocks=8, num_usable_blocks=8, block_size=16, num_resident_blocks=0)


@dataclass
class StandInProcess:
    """The multiprocessing.Process surface the client reads (isolates the client from a real child)."""

    pid: int = 4242
    exitcode: int | None = None
    alive: bool = True

    def is_alive(self) -> bool:
        return self.alive

    def join(self, timeout: float | None = None) -> None:
        return None


@dataclass
class Recorder:
    steps: list[int] = field(default_factory=list)  # num_running of each step, in arrival order
    dead: list[BaseException] = field(default_factory=list)

    def callbacks(self) -> EngineCallbacks:
        return EngineCallbacks(
            on_step=lambda result: self.steps.append(result.stats.num_running),
            on_rejected=lambda request_id, error: None,
            on_dead=self.dead.append,
            on_embedded=lambda request_id, result: None,
        )


def step(index: int) -> Stepped:
    stats = StepStats(index, 0, 0, 0.0, 1, 0, 1, 0, 0)
    return Stepped(StepResult(outputs=[], stats=stats), KV)


def make_client(loop: asyncio.AbstractEventLoop, recorder: Recorder) -> tuple[ProcessEngineClient, Any]:
    ours, theirs = multiprocessing.get_context("spawn").Pipe(duplex=True)
    facts: Any = EngineFacts(None, 0, None, "cpu", {}, {}, 0, KV)  # type: ignore[arg-type]
    client = ProcessEngineClient(EngineProcess(StandInProcess(), ours, facts), loop, recorder.callbacks())  # type: ignore[arg-type]
    return client, theirs


def request(index: int) -> EngineRequest:
    return EngineRequest(f"r{index}/0", (1, 2, 3), SamplingParams(max_tokens=4))


def test_commands_of_one_iteration_are_one_message() -> None:
    async def scenario() -> list[Any]:
        client, engine_end = make_client(asyncio.get_running_loop(), Recorder())
        for index in range(3):
            client.add_request(request(index))
        client.abort_requests(["r0/0"])
        await asyncio.sleep(0)  # the flush runs on the next iteration
        client.add_request(request(3))
        client.shutdown()  # flushes at once
        return [engine_end.recv(), engine_end.recv()]

    first, second = asyncio.run(scenario())
    assert [type(c) for c in first] == [AddRequest] * 3 + [AbortRequests]
    assert [c.request.request_id for c in first[:3]] == ["r0/0", "r1/0", "r2/0"]
    assert [type(c) for c in second] == [AddRequest, Shutdown]


def test_step_results_arrive_in_order_a_few_an_iteration() -> None:
    num_steps = 12  # more than one read's worth (MESSAGES_PER_READ), well under the pipe's buffer
    assert num_steps > 2 * MESSAGES_PER_READ
    recorder = Recorder()
    seen_between: list[int] = []

    async def scenario() -> None:
        client, engine_end = make_client(asyncio.get_running_loop(), recorder)
        for index in range(num_steps):
            engine_end.send(step(index))

        async def other_task() -> None:  # runs between reads: the event loop is not starved
            while len(recorder.steps) < num_steps:
                seen_between.append(len(recorder.steps))
                await asyncio.sleep(0)

        await asyncio.wait_for(other_task(), timeout=5.0)
        assert client.num_steps == num_steps and client.is_alive

    asyncio.run(scenario())
    assert recorder.steps == list(range(num_steps))
    assert any(0 < seen < num_steps for seen in seen_between), seen_between


@pytest.mark.parametrize("stopping", [False, True])
def test_a_closed_pipe_is_death_unless_shutdown_was_sent(stopping: bool) -> None:
    recorder = Recorder()

    async def scenario() -> bool:
        client, engine_end = make_client(asyncio.get_running_loop(), recorder)
        if stopping:
            client.shutdown()
        engine_end.close()
        for _ in range(20):
            await asyncio.sleep(0.01)
        return client.is_alive

    is_alive = asyncio.run(scenario())
    if stopping:
        assert recorder.dead == []
    else:
        assert not is_alive and len(recorder.dead) == 1 and isinstance(recorder.dead[0], EngineDead)
        assert "exited" in str(recorder.dead[0])
