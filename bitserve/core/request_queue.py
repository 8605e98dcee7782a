"""Waiting queue: priority classes (HIGH, NORMAL, LOW), FCFS within a class, with aging.

Aging keeps LOW from starving under a steady stream of HIGH: a request climbs one class per
`aging_interval_s` spent waiting, continuously. Pure Python, no clock of its own.
"""

from __future__ import annotations

import heapq
import itertools
import math
from collections.abc import Iterator

from bitserve.core.request import Priority, Request


def priority_key(
    priority: Priority, enqueue_time: float, arrival_seq: int, aging_interval_s: float
) -> tuple[float, float, int]:
    """The static sort key of a request: smaller is served first.

    With aging, a request of class c that entered at time t ranks as a HIGH request entering at
    t + c * aging_interval_s. Ranking by that "virtual arrival" is the same as letting each
    request's class drop by one per aging_interval_s of waiting (continuously), but it never
    changes after enqueue, so one heap orders everything. With aging_interval_s = inf the order is
    strict priority, then FCFS. `arrival_seq` breaks ties (equal clock readings) in add order.
    """
    if math.isinf(aging_interval_s):
        return (float(priority), enqueue_time, arrival_seq)
    return (0.0, enqueue_time + float(priority) * aging_interval_s, arrival_seq)


class RequestQueue:
    """Min-heap of waiting requests by `Request.priority_key`, with O(1) lazy removal.

    A preempted request goes back with its original key, so it resumes before every request of its
    class that arrived after it (and before newer requests of lower classes, aging permitting).
    """

    def __init__(self) -> None:
        # Entries are (key, token, request); `token` is unique per add so stale entries (removed
        # or re-added requests) are recognised and skipped without comparing Request objects.
        self._heap: list[tuple[tuple[float, float, int], int, Request]] = []
        self._live_tokens: dict[str, int] = {}
        self._tokens = itertools.count()

    def __len__(self) -> int:
        return len(self._live_tokens)

    def __bool__(self) -> bool:
        return bool(self._live_tokens)

    def __contains__(self, request_id: object) -> bool:
        return request_id in self._live_tokens

    def add(self, request: Request) -> None:
        """Queue `request` at the place its `priority_key` gives it. O(log n)."""
        if request.request_id in self._live_tokens:
            raise ValueError(f"request {request.request_id!r} is already queued")
        token = next(self._tokens)
        self._live_tokens[request.request_id] = token
        heapq.heappush(self._heap, (request.priority_key, token, request))

    def peek(self) -> Request | None:
        """The request `pop` would return, or None when empty. O(1) amortised."""
        self._drop_stale_head()
        return self._heap[0][2] if self._heap else None

    def pop(self) -> Request:
        """Remove and return the most urgent request. O(log n) amortised."""
        self._drop_stale_head()
        if not self._heap:
            raise IndexError("pop from an empty RequestQueue")
        _, _, request = heapq.heappop(self._heap)
        del self._live_tokens[request.request_id]
        return request

    def remove(self, request_id: str) -> bool:
        """Drop a queued request (abort). O(1); its heap entry is skipped later. False if absent."""
        if self._live_tokens.pop(request_id, None) is None:
            return False
        # Rebuild when stale entries dominate, so memory stays O(live) under abort storms.
        if len(self._heap) > 64 and len(self._heap) > 2 * len(self._live_tokens):
            self._heap = [e for e in self._heap if self._live_tokens.get(e[2].request_id) == e[1]]
            heapq.heapify(self._heap)
        return True

    def __iter__(self) -> Iterator[Request]:
        """Live requests in service order (sorts a copy: for stats and debugging, not the hot path)."""
        live = [e for e in self._heap if self._live_tokens.get(e[2].request_id) == e[1]]
        return iter([e[2] for e in sorted(live, key=lambda e: (e[0], e[1]))])

    def _drop_stale_head(self) -> None:
        heap = self._heap
        while heap and self._live_tokens.get(heap[0][2].request_id) != heap[0][1]:
            heapq.heappop(heap)
