"""Scheduler finishes: EOS, stop ids, ignore_eos, min_tokens, lengths, aborts, deadlines, rejection."""

from __future__ import annotations

import pytest

from bitserve.core.request import FinishReason
from bitserve.core.scheduler_output import RunnerOutput
from bitserve.errors import InvalidRequest

EOS = 2  # the conftest's default eos_token_ids


def _generate(scheduler, run_step, tokens: list[int]) -> list:
    """Feed `tokens` one per step to the only request; return its EngineOutputs."""
    feed = iter(tokens)
    outputs = []
    while scheduler.has_unfinished_requests():
        _, step_outputs = run_step(scheduler, lambda _: next(feed))
        outputs += step_outputs
    return outputs


def _tokens(outputs: list) -> list[int]:
    return [t for o in outputs for t in o.new_token_ids]


def test_eos_stops_and_is_the_last_output_token(make_scheduler, make_request, run_step, no_leak) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 5, 9], max_tokens=10))
    outputs = _generate(scheduler, run_step, [4, 5, EOS, 6])
    assert _tokens(outputs) == [4, 5, EOS]
    assert [o.finish_reason for o in outputs] == [None, None, FinishReason.STOP]
    assert outputs[-1].stop_token_id is None
    no_leak(scheduler)
    # The runner learns about the finish in the next schedule.
    assert scheduler.schedule().finished_request_ids == ["a"]


def test_ignore_eos_runs_to_max_tokens(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 5, 9], max_tokens=4, ignore_eos=True))
    outputs = _generate(scheduler, run_step, [EOS, EOS, EOS, EOS, EOS])
    assert _tokens(outputs) == [EOS] * 4 and outputs[-1].finish_reason == FinishReason.LENGTH


def test_min_tokens_delays_eos_and_stop_ids(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 5, 9], max_tokens=10, min_tokens=3, stop_token_ids=[8]))
    outputs = _generate(scheduler, run_step, [EOS, 8, EOS, 6])
    # The 3rd output may end the request: min_tokens counts the stopping token.
    assert _tokens(outputs) == [EOS, 8, EOS] and outputs[-1].finish_reason == FinishReason.STOP


def test_stop_token_id_reports_which_token(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 5, 9], max_tokens=10, stop_token_ids=[11, 12]))
    outputs = _generate(scheduler, run_step, [4, 12, 5])
    assert _tokens(outputs) == [4, 12]
    assert outputs[-1].finish_reason == FinishReason.STOP and outputs[-1].stop_token_id == 12


def test_eos_set_comes_from_the_request(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1], max_tokens=10, eos_token_ids=frozenset({40, 41})))
    outputs = _generate(scheduler, run_step, [EOS, 41, 3])
    assert _tokens(outputs) == [EOS, 41] and outputs[-1].finish_reason == FinishReason.STOP


def test_max_tokens_finishes_with_length(make_scheduler, make_request, run_step, no_leak) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 5, 9], max_tokens=3))
    outputs = _generate(scheduler, run_step, [4, 4, 4, 4])
    assert _tokens(outputs) == [4, 4, 4] and outputs[-1].finish_reason == FinishReason.LENGTH
    no_leak(scheduler)


def test_stop_wins_over_length_on_the_same_token(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1], max_tokens=2))
    outputs = _generate(scheduler, run_step, [4, EOS])
    assert outputs[-1].finish_reason == FinishReason.STOP


def test_max_model_len_finishes_with_length(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler(max_model_len=8)
    scheduler.add_request(make_request("a", [1, 2, 3, 4, 5], max_tokens=100))
    outputs = _generate(scheduler, run_step, [4] * 10)
    assert _tokens(outputs) == [4, 4, 4] and outputs[-1].finish_reason == FinishReason.LENGTH


def test_abort_waiting_and_running_requests(make_scheduler, make_requests, run_step, no_leak) -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    running, waiting = make_requests(2, 6)
    scheduler.add_request(running)
    scheduler.add_request(waiting)
    run_step(scheduler)
    assert scheduler.num_running == 1 and scheduler.num_waiting == 1
    assert scheduler.kv.num_free_blocks < scheduler.kv.num_usable_blocks
    scheduler.abort_requests(["r0", "r1", "unknown"])
    # Blocks come back at once, before any further step.
    no_leak(scheduler)
    assert scheduler.has_unfinished_requests()  # the abort outputs are still to be reported
    output, outputs = run_step(scheduler)
    assert output.requests == [] and output.finished_request_ids == ["r0", "r1"]
    assert [(o.request_id, o.new_token_ids, o.finish_reason) for o in outputs] == [
        ("r0", [], FinishReason.ABORT),
        ("r1", [], FinishReason.ABORT),
    ]
    assert not scheduler.has_unfinished_requests()
    # Aborting again (a race with a natural finish) reports nothing more.
    scheduler.abort_requests(["r0"])
    assert run_step(scheduler)[1] == []


def test_abort_reason_is_reported(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2]))
    run_step(scheduler)
    scheduler.abort_requests(["a"], FinishReason.STOP)  # the frontend matched a stop string
    assert [o.finish_reason for o in run_step(scheduler)[1]] == [FinishReason.STOP]


def test_abort_between_schedule_and_update_is_reported_once(make_scheduler, make_request) -> None:
    scheduler = make_scheduler()
    scheduler.add_request(make_request("a", [1, 2]))
    output = scheduler.schedule()
    scheduler.abort_requests(["a"])
    outputs = scheduler.update(output, RunnerOutput({"a": [5]}))
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([], FinishReason.ABORT)]


def test_deadline_of_a_waiting_request(make_scheduler, make_request, run_step, clock, no_leak) -> None:
    scheduler = make_scheduler(max_num_seqs=1, clock=clock)
    scheduler.add_request(make_request("busy", [1, 2], max_tokens=50))
    scheduler.add_request(make_request("late", [3, 4], deadline=clock.now + 5.0))
    run_step(scheduler)
    clock.advance(6.0)
    output, outputs = run_step(scheduler)
    assert [r.request_id for r in output.requests] == ["busy"]
    late = [o for o in outputs if o.request_id == "late"]
    assert [(o.new_token_ids, o.finish_reason) for o in late] == [([], FinishReason.DEADLINE)]
    scheduler.abort_requests(["busy"])
    run_step(scheduler)
    no_leak(scheduler)


def test_deadline_of_a_running_request_keeps_its_last_token(make_scheduler, make_request, clock) -> None:
    scheduler = make_scheduler(clock=clock)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=50, deadline=clock.now + 2.5))
    outputs = []
    for _ in range(3):
        output = scheduler.schedule()
        clock.advance(1.0)  # the step itself takes a second
        outputs += scheduler.update(output, RunnerOutput({"a": [7]}))
    # Expired during the third step: its token is delivered together with the finish.
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [
        ([7], None),
        ([7], None),
        ([7], FinishReason.DEADLINE),
    ]
    assert not scheduler.has_unfinished_requests() and scheduler.kv.usage == 0.0


def test_deadline_expiring_between_steps_finishes_at_schedule(
    make_scheduler, make_request, run_step, clock
) -> None:
    scheduler = make_scheduler(clock=clock)
    scheduler.add_request(make_request("a", [1, 2], max_tokens=50, deadline=clock.now + 1.5))
    assert run_step(scheduler)[1][0].finish_reason is None
    clock.advance(2.0)
    output, outputs = run_step(scheduler)
    assert output.requests == [] and output.finished_request_ids == ["a"]
    assert [(o.new_token_ids, o.finish_reason) for o in outputs] == [([], FinishReason.DEADLINE)]


def test_impossible_requests_are_rejected_at_add(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(max_model_len=32, block_size=4, num_blocks=6)  # 5 usable blocks
    with pytest.raises(InvalidRequest, match="no room for output"):
        scheduler.add_request(make_request("long", range(32)))
    with pytest.raises(InvalidRequest, match="KV blocks"):
        scheduler.add_request(make_request("big", range(24)))  # 23+ slots need 6 blocks
    with pytest.raises(InvalidRequest, match="KV blocks"):
        scheduler.add_request(make_request("grows", range(4), max_tokens=20))
    with pytest.raises(InvalidRequest, match="no tokens"):
        scheduler.add_request(make_request("empty", []))
    scheduler.add_request(make_request("fits", range(4), max_tokens=17))  # 20 slots = 5 blocks
    with pytest.raises(InvalidRequest, match="already in use"):
        scheduler.add_request(make_request("fits", range(4)))
    assert scheduler.num_waiting == 1


def test_step_stats(make_scheduler, make_requests, run_step) -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=17)
    for request in make_requests(2, 8):
        scheduler.add_request(request)
    run_step(scheduler)
    stats = scheduler.get_stats()
    assert (stats.num_running, stats.num_waiting) == (2, 0)
    assert (stats.num_batched_tokens, stats.num_prefill_tokens, stats.num_decode_tokens) == (16, 16, 0)
    assert stats.kv_usage == pytest.approx(4 / 16)  # 8 tokens = 2 blocks each, of 16 usable
    run_step(scheduler)
    stats = scheduler.get_stats()
    assert (stats.num_batched_tokens, stats.num_prefill_tokens, stats.num_decode_tokens) == (2, 0, 2)
    assert stats.kv_usage == pytest.approx(6 / 16)  # position 8 opened a third block each
    assert stats.step_time_s == 0.0 and stats.num_preempted_total == 0
