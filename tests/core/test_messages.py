"""Engine seam messages: frozen, picklable, and EngineRequest → Request keeps every field."""

from __future__ import annotations

import dataclasses
import pickle

import pytest

from bitserve.core.request import RequestStatus
from bitserve.engine.messages import (
    AbortRequests,
    AddRequest,
    EngineOutput,
    EngineRequest,
    FinishReason,
    Priority,
    Shutdown,
    StepResult,
    StepStats,
)
from bitserve.sampling_params import SamplingParams


def test_engine_request_to_request() -> None:
    message = EngineRequest(
        "r1", (1, 2, 3), SamplingParams(max_tokens=4), frozenset({2}), Priority.LOW, 12.5, 20.0
    )
    request = message.to_request()
    assert (request.request_id, request.prompt_token_ids, request.all_token_ids) == (
        "r1",
        (1, 2, 3),
        [1, 2, 3],
    )
    assert request.eos_token_ids == frozenset({2}) and request.priority is Priority.LOW
    assert (request.arrival_time, request.deadline) == (12.5, 20.0)
    assert request.status == RequestStatus.WAITING and request.num_computed_tokens == 0
    assert request.output_token_ids == [] and not request.is_finished
    with pytest.raises(dataclasses.FrozenInstanceError):
        message.request_id = "other"  # type: ignore[misc]


def test_messages_round_trip_through_pickle() -> None:
    stats = StepStats(1, 2, 0, 0.5, 10, 8, 2, 4, 16)
    messages = [
        AddRequest(EngineRequest("r1", (1, 2), SamplingParams(), frozenset({2}))),
        AbortRequests(("r1", "r2"), FinishReason.DEADLINE),
        Shutdown(),
        StepResult([EngineOutput("r1", [5], None, FinishReason.STOP, 0, 5)], stats),
    ]
    for message in messages:
        assert pickle.loads(pickle.dumps(message)) == message
    assert dataclasses.replace(stats, step_time_s=0.25).step_time_s == 0.25
    assert FinishReason.LENGTH.value == "length" and Priority.HIGH < Priority.NORMAL < Priority.LOW


def test_engine_output_pickles_every_field() -> None:
    """EngineOutput's own __reduce__ (the pipe's fast path) must carry each field, defaults included."""
    from bitserve.core.step_outputs import TokenLogprobs

    values = {
        "request_id": "r7/0",
        "new_token_ids": [5, 6],
        "new_logprobs": [TokenLogprobs(5, -0.5, 1, ((5, -0.5),)), TokenLogprobs(6, -1.0, 2, ())],
        "finish_reason": FinishReason.STOP,
        "num_cached_tokens": 16,
        "stop_token_id": 6,
        "queue_s": 0.125,
    }
    assert set(values) == {field.name for field in dataclasses.fields(EngineOutput)}
    output = EngineOutput(**values)
    copy = pickle.loads(pickle.dumps(output, protocol=pickle.HIGHEST_PROTOCOL))
    assert copy == output and {name: getattr(copy, name) for name in values} == values
