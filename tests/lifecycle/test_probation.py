"""Probation thresholds: engine death, error rate and inter-token latency, counted from the flip."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace
from typing import Any

from bitserve.lifecycle.model_files import ModelFile
from bitserve.lifecycle.probation import ProbationPolicy, probation_failure
from bitserve.lifecycle.slot import ModelSlot

POLICY = ProbationPolicy(window_s=10.0, max_error_rate=0.25, min_requests=4, max_itl_s=0.1)


def replica(device: str, *, is_alive: bool = True, itl_sum_s: float = 0.0, itl_count: int = 0) -> Any:
    engine = SimpleNamespace(is_alive=is_alive, itl_sum_s=itl_sum_s, itl_count=itl_count)
    return SimpleNamespace(device=device, engine=engine, is_alive=is_alive)


def make_slot(*, is_alive: bool = True, itl_sum_s: float = 0.0, itl_count: int = 0) -> ModelSlot:
    slot = ModelSlot("a@v#1", "a", ModelFile("a", Path("a.gguf")))
    slot.replicas.append(replica("cpu", is_alive=is_alive, itl_sum_s=itl_sum_s, itl_count=itl_count))
    return slot


def finish(slot: ModelSlot, num_ok: int, num_failed: int) -> None:
    for has_failed in [False] * num_ok + [True] * num_failed:
        slot.acquire().release(has_failed=has_failed)


def test_a_dead_engine_fails_at_once() -> None:
    assert probation_failure(make_slot(is_alive=False), POLICY, 0, 0, (0.0, 0)) == "its engine died (cpu)"


def test_one_dead_replica_fails_probation_and_latency_counts_every_replica() -> None:
    slot: Any = make_slot(itl_sum_s=1.0, itl_count=20)
    slot.replicas.append(replica("cuda:0", itl_sum_s=3.0, itl_count=20))
    finish(slot, 4, 0)
    assert slot.itl_totals == (4.0, 40)  # 100 ms mean over both: at the limit, not past it
    assert probation_failure(slot, POLICY, 0, 0, (0.0, 0)) is None
    slot.replicas[1] = replica("cuda:0", is_alive=False)
    assert probation_failure(slot, POLICY, 0, 0, (0.0, 0)) == "its engine died (cuda:0)"


def test_error_rate_needs_enough_requests_and_counts_from_the_flip() -> None:
    slot = make_slot()
    finish(slot, 0, 3)
    assert probation_failure(slot, POLICY, 0, 0, (0.0, 0)) is None  # 3 < min_requests
    finish(slot, 1, 0)
    assert "3 of 4 requests failed" in str(probation_failure(slot, POLICY, 0, 0, (0.0, 0)))
    assert (
        probation_failure(slot, POLICY, base_finished=3, base_failed=3, base_itl=(0.0, 0)) is None
    )  # before the flip


def test_inter_token_latency_threshold() -> None:
    slot: Any = make_slot(itl_sum_s=1.0, itl_count=20)  # 50 ms mean
    finish(slot, 4, 0)
    assert probation_failure(slot, POLICY, 0, 0, (0.0, 0)) is None
    slot.replicas[0].engine.itl_sum_s, slot.replicas[0].engine.itl_count = 5.0, 40  # last 20 gaps: 200 ms
    assert "exceeds 100 ms" in str(probation_failure(slot, POLICY, 0, 0, (1.0, 20)))
    assert (
        probation_failure(slot, ProbationPolicy(10.0, 0.25, 4, None), 0, 0, (1.0, 20)) is None
    )  # off when unset
