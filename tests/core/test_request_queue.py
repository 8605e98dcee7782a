"""RequestQueue: priority classes, FCFS within a class, aging, lazy removal, preempted re-entry."""

from __future__ import annotations

import math

import pytest

from bitserve.core.request import Priority, Request
from bitserve.core.request_queue import RequestQueue, priority_key
from bitserve.sampling_params import SamplingParams

_seq = iter(range(1_000_000))


def _request(request_id: str, priority: Priority, enqueue_time: float, aging_s: float = 10.0) -> Request:
    request = Request(request_id, (1, 2, 3), SamplingParams(), priority=priority)
    request.priority_key = priority_key(priority, enqueue_time, next(_seq), aging_s)
    return request


def _drain(queue: RequestQueue) -> list[str]:
    return [queue.pop().request_id for _ in range(len(queue))]


def test_high_before_normal_before_low_and_fcfs_within_a_class() -> None:
    queue = RequestQueue()
    for request in [
        _request("low", Priority.LOW, 0.0),
        _request("n1", Priority.NORMAL, 0.1),
        _request("h1", Priority.HIGH, 0.2),
        _request("n2", Priority.NORMAL, 0.3),
        _request("h2", Priority.HIGH, 0.4),
    ]:
        queue.add(request)
    assert [r.request_id for r in queue] == ["h1", "h2", "n1", "n2", "low"]
    assert _drain(queue) == ["h1", "h2", "n1", "n2", "low"]
    assert queue.peek() is None
    with pytest.raises(IndexError):
        queue.pop()


def test_aging_promotes_one_class_per_interval() -> None:
    queue = RequestQueue()
    queue.add(_request("low", Priority.LOW, 0.0))
    # A HIGH request entering before 2 intervals have passed still goes first ...
    queue.add(_request("early-high", Priority.HIGH, 19.0))
    # ... but after 2 intervals the LOW request ranks as HIGH and is older.
    queue.add(_request("late-high", Priority.HIGH, 21.0))
    # A NORMAL request entering 10.5 s in ranks as HIGH at 20.5 s: behind LOW, ahead of late-high.
    queue.add(_request("normal", Priority.NORMAL, 10.5))
    assert _drain(queue) == ["early-high", "low", "normal", "late-high"]


def test_infinite_aging_interval_is_strict_priority() -> None:
    queue = RequestQueue()
    queue.add(_request("low", Priority.LOW, 0.0, math.inf))
    queue.add(_request("high", Priority.HIGH, 1e9, math.inf))
    assert _drain(queue) == ["high", "low"]


def test_remove_is_lazy_but_exact() -> None:
    queue = RequestQueue()
    requests = [_request(f"r{i}", Priority.NORMAL, float(i)) for i in range(200)]
    for request in requests:
        queue.add(request)
    for request in requests[:150]:
        assert queue.remove(request.request_id)
    assert not queue.remove("r0") and not queue.remove("missing")
    assert len(queue) == 50 and "r150" in queue and "r0" not in queue
    assert len(queue._heap) <= 2 * 50 + 64  # stale entries are compacted
    assert _drain(queue) == [f"r{i}" for i in range(150, 200)]


def test_removed_then_readded_request_appears_once() -> None:
    queue = RequestQueue()
    request = _request("a", Priority.NORMAL, 0.0)
    queue.add(request)
    queue.remove("a")
    queue.add(request)
    assert len(queue) == 1 and _drain(queue) == ["a"] and queue.peek() is None
    queue.add(request)
    with pytest.raises(ValueError):
        queue.add(request)  # already queued


def test_preempted_request_resumes_before_newer_requests_of_its_class() -> None:
    queue = RequestQueue()
    running = _request("old", Priority.NORMAL, 0.0)  # popped earlier, now preempted
    queue.add(_request("newer", Priority.NORMAL, 5.0))
    queue.add(running)  # re-added with its original key
    assert _drain(queue) == ["old", "newer"]
