"""Scheduler: token budget, chunked prefill, seats, preemption and resume, priorities, aging, prefix hits."""

from __future__ import annotations

import pytest

from bitserve.core.request import Priority, RequestStatus
from bitserve.core.scheduler_output import RunnerOutput


def test_token_budget_and_seats_hold_every_step(make_scheduler, make_request, run_step, invariants) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=40, max_num_seqs=6, num_blocks=200)
    for i in range(12):
        scheduler.add_request(make_request(f"r{i}", range(1000 * i, 1000 * i + 3 + 5 * i), max_tokens=5))
    num_steps = 0
    num_outputs: dict[str, int] = {}
    while scheduler.has_unfinished_requests():
        output, outputs = run_step(scheduler)
        invariants(scheduler, output)
        assert output.num_scheduled_tokens == sum(len(r.token_ids) for r in output.requests)
        assert 0 < output.num_scheduled_tokens <= 40 and len(output.requests) <= 6
        for engine_output in outputs:
            num_outputs[engine_output.request_id] = num_outputs.get(engine_output.request_id, 0) + len(
                engine_output.new_token_ids
            )
        num_steps += 1
        assert num_steps < 200
    assert num_outputs == {f"r{i}": 5 for i in range(12)}
    assert scheduler.kv.num_free_blocks == scheduler.kv.num_usable_blocks


def test_long_prompt_is_chunked_while_a_decode_gets_a_token_every_step(
    make_scheduler, make_request, run_step
) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, max_model_len=2048, block_size=16, num_blocks=80)
    scheduler.add_request(make_request("short", [5, 6, 7], max_tokens=100))
    run_step(scheduler)  # prefill of the short prompt; it now decodes
    long_prompt = list(range(1000, 2000))
    scheduler.add_request(make_request("long", long_prompt, max_tokens=4))
    next_position = 0
    num_steps = 0
    while True:
        output, _ = run_step(scheduler)
        num_steps += 1
        by_id = {r.request_id: r for r in output.requests}
        assert len(by_id["short"].token_ids) == 1 and by_id["short"].sample  # never stalled
        chunk = by_id["long"]
        assert chunk.start_position == next_position
        assert chunk.token_ids == long_prompt[next_position : next_position + len(chunk.token_ids)]
        assert len(chunk.token_ids) == min(63, 1000 - next_position)
        assert output.num_scheduled_tokens <= 64
        next_position += len(chunk.token_ids)
        assert chunk.sample == (next_position == 1000)
        if chunk.sample:
            break
    assert num_steps == -(-1000 // 63)
    stats = scheduler.get_stats()
    assert stats.num_decode_tokens == 1 and stats.num_prefill_tokens == 1000 - 63 * (num_steps - 1)


def test_long_prefill_threshold_caps_each_chunk(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=64, long_prefill_token_threshold=10)
    scheduler.add_request(make_request("a", range(30)))
    scheduler.add_request(make_request("b", range(100, 130)))
    output = scheduler.schedule()
    assert [len(r.token_ids) for r in output.requests] == [10, 10]
    assert not any(r.sample for r in output.requests)


def test_chunking_disabled_schedules_whole_prompts_only(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(max_num_batched_tokens=512, enable_chunked_prefill=False, num_blocks=200)
    scheduler.add_request(make_request("a", range(300)))
    scheduler.add_request(make_request("b", range(1000, 1300)))
    output = scheduler.schedule()
    assert [(r.request_id, len(r.token_ids), r.sample) for r in output.requests] == [("a", 300, True)]


def test_max_num_seqs_limits_running_requests(make_scheduler, make_requests, run_step) -> None:
    scheduler = make_scheduler(max_num_seqs=2)
    for request in make_requests(4, 5, max_tokens=2):
        scheduler.add_request(request)
    output, _ = run_step(scheduler)
    assert [r.request_id for r in output.requests] == ["r0", "r1"]
    assert scheduler.num_running == 2 and scheduler.num_waiting == 2
    output, outputs = run_step(scheduler)  # r0, r1 decode their second token and finish
    assert {o.request_id for o in outputs if o.is_finished} == {"r0", "r1"}
    output, _ = run_step(scheduler)
    assert [r.request_id for r in output.requests] == ["r2", "r3"]
    assert output.finished_request_ids == ["r0", "r1"]


def _run_to_completion(scheduler, runner, invariants) -> tuple[dict[str, list[int]], list, list]:
    """Drive the scheduler with the simulated runner; return histories, preemptions, resume chunks."""
    histories: dict[str, list[int]] = {"low": [], "high": []}
    preempted: list[str] = []
    resumes = []
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        invariants(scheduler, output)
        for scheduled in output.requests:
            if scheduled.request_id in preempted and scheduled.request_id not in [r[0] for r in resumes]:
                expected = list(range(10, 18)) + histories[scheduled.request_id]
                resumes.append((scheduled.request_id, scheduled, expected))
        preempted += output.preempted_request_ids
        for engine_output in scheduler.update(output, runner.execute(output)):
            histories[engine_output.request_id] += engine_output.new_token_ids
    return histories, preempted, resumes


@pytest.mark.parametrize("enable_prefix_caching", [True, False])
def test_preemption_frees_the_lowest_priority_and_resumes_by_recompute(
    make_scheduler, make_request, make_runner, invariants, enable_prefix_caching
) -> None:
    # 6 usable blocks of 4 tokens; two 8-token prompts that each grow to 16 tokens of KV.
    scheduler = make_scheduler(
        block_size=4, num_blocks=7, max_model_len=64, enable_prefix_caching=enable_prefix_caching
    )
    scheduler.add_request(
        make_request("low", range(10, 18), priority=Priority.LOW, max_tokens=9, ignore_eos=True)
    )
    scheduler.add_request(
        make_request("high", range(20, 28), priority=Priority.HIGH, max_tokens=9, ignore_eos=True)
    )
    histories, preempted, resumes = _run_to_completion(scheduler, make_runner(block_size=4), invariants)
    assert preempted == ["low"]  # the LOW request, although it arrived first
    # It resumed by recomputing its prompt and the outputs it had produced before preemption
    # (from position 0, or from its own blocks still in the prefix cache).
    ((_, resume, expected),) = resumes
    assert resume.sample and len(expected) > 8
    assert resume.token_ids == expected[resume.start_position :]
    if not enable_prefix_caching:
        assert resume.start_position == 0
    assert scheduler.get_stats().num_preempted_total == 1
    assert scheduler.kv.num_free_blocks == 6
    # The same histories as without memory pressure.
    roomy = make_scheduler(block_size=4, num_blocks=64, max_model_len=64)
    roomy.add_request(
        make_request("low", range(10, 18), priority=Priority.LOW, max_tokens=9, ignore_eos=True)
    )
    roomy.add_request(
        make_request("high", range(20, 28), priority=Priority.HIGH, max_tokens=9, ignore_eos=True)
    )
    roomy_histories, roomy_preempted, _ = _run_to_completion(roomy, make_runner(block_size=4), invariants)
    assert not roomy_preempted
    assert histories == roomy_histories and all(len(h) == 9 for h in histories.values())


def test_a_request_preempts_itself_when_it_is_the_lowest_priority(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=5, max_model_len=64)  # 4 usable blocks
    scheduler.add_request(make_request("high", range(7), priority=Priority.HIGH, max_tokens=8))
    scheduler.add_request(make_request("low", range(100, 108), priority=Priority.LOW, max_tokens=8))
    output = scheduler.schedule()
    assert [r.request_id for r in output.requests] == ["high", "low"]
    tokens = {r.request_id: [3] for r in output.requests}
    scheduler.update(output, RunnerOutput(tokens))
    # high's next token fits its second block; low's needs a third block and none is free, and
    # low is itself the lowest-priority running request.
    output = scheduler.schedule()
    assert output.preempted_request_ids == ["low"]
    assert [r.request_id for r in output.requests] == ["high"]
    low = scheduler.waiting.peek()
    assert low is not None and low.status == RequestStatus.PREEMPTED
    assert low.num_computed_tokens == 0 and low.output_token_ids == [3]


@pytest.mark.parametrize("lookahead", [0, 1])
def test_a_decode_reserves_the_lookahead_slot_ahead_of_its_block_boundary(
    make_scheduler, make_request, make_runner, invariants, no_leak, lookahead: int
) -> None:
    """A runner that launches the next decode step early (CUDA lookahead) writes that step's KV slot:
    the scheduler gives each decode the block of position + 1 one step before the token needs it."""
    scheduler = make_scheduler(block_size=4, num_blocks=20, num_lookahead_tokens=lookahead)
    runner = make_runner(block_size=4)
    scheduler.add_request(make_request("a", [11, 12, 13], max_tokens=9, ignore_eos=True))
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        invariants(scheduler, output)
        (request,) = output.requests
        end = request.start_position + len(request.token_ids)
        if len(request.token_ids) == 1:  # a decode: the next position's block is there when asked for
            assert len(request.block_ids) == -(-(end + lookahead) // 4)
        scheduler.update(output, runner.execute(output))
    no_leak(scheduler)


def test_lookahead_slots_never_preempt(make_scheduler, make_request) -> None:
    """Where the decode token fits and its lookahead slot would need a block nobody has free, the
    decode runs without the slot and nothing is preempted."""
    scheduler = make_scheduler(block_size=4, num_blocks=3, max_model_len=8, num_lookahead_tokens=1)
    scheduler.add_request(make_request("a", range(3), max_tokens=5, ignore_eos=True))
    scheduler.add_request(make_request("b", range(100, 103), max_tokens=5, ignore_eos=True))
    output = scheduler.schedule()  # both prefills: one block each, the two usable blocks
    assert [r.request_id for r in output.requests] == ["a", "b"]
    scheduler.update(output, RunnerOutput({"a": [3], "b": [3]}))
    output = scheduler.schedule()  # position 3 of each: the last slot of the block each holds
    assert [r.request_id for r in output.requests] == ["a", "b"] and not output.preempted_request_ids
    assert [len(r.block_ids) for r in output.requests] == [1, 1]


def test_priority_order_with_one_seat(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler(max_num_seqs=1)
    scheduler.add_request(make_request("low", [1, 2], priority=Priority.LOW, max_tokens=1))
    scheduler.add_request(make_request("normal", [3, 4], priority=Priority.NORMAL, max_tokens=1))
    scheduler.add_request(make_request("high", [5, 6], priority=Priority.HIGH, max_tokens=1))
    order = []
    while scheduler.has_unfinished_requests():
        output, _ = run_step(scheduler)
        order += [r.request_id for r in output.requests]
    assert order == ["high", "normal", "low"]


def test_aging_lets_low_run_despite_a_stream_of_high(make_scheduler, make_request, run_step, clock) -> None:
    scheduler = make_scheduler(max_num_seqs=1, clock=clock, aging_interval_s=5.0)
    scheduler.add_request(make_request("low", [1, 2], priority=Priority.LOW, max_tokens=1))
    scheduled_at = None
    for step_index in range(40):
        # Two new HIGH requests per second: always more HIGH work than the single seat serves.
        for k in range(2):
            scheduler.add_request(
                make_request(f"h{step_index}.{k}", [3, 4], priority=Priority.HIGH, max_tokens=1)
            )
        output, _ = run_step(scheduler)
        if any(r.request_id == "low" for r in output.requests):
            scheduled_at = step_index
            break
        clock.advance(1.0)
    # LOW ranks as a HIGH arriving 2 * 5 s later: it runs once the HIGHs queued before t = 10 s are served.
    assert scheduled_at is not None and 10 <= scheduled_at <= 25
    # Without aging it would starve for the whole run.
    strict = make_scheduler(max_num_seqs=1, clock=clock, aging_interval_s=float("inf"))
    strict.add_request(make_request("low", [1, 2], priority=Priority.LOW, max_tokens=1))
    for step_index in range(40):
        strict.add_request(make_request(f"h{step_index}", [3, 4], priority=Priority.HIGH, max_tokens=1))
        output, _ = run_step(strict)
        assert all(r.request_id != "low" for r in output.requests)
        clock.advance(1.0)


def test_prefix_hit_reuses_blocks_and_reports_cached_tokens(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=33)
    prompt = list(range(500, 512))  # 12 tokens: 3 full blocks
    scheduler.add_request(make_request("first", prompt, max_tokens=3))
    output, outputs = run_step(scheduler)
    first_blocks = output.requests[0].block_ids
    assert outputs[0].num_cached_tokens == 0
    scheduler.add_request(make_request("second", prompt, max_tokens=3))
    output, outputs = run_step(scheduler)
    second = next(r for r in output.requests if r.request_id == "second")
    # Capped below the whole prompt: 2 of 3 blocks hit, the last block is recomputed for logits.
    assert second.start_position == 8 and second.token_ids == prompt[8:] and second.sample
    assert second.block_ids[:2] == first_blocks[:2] and second.block_ids[2] != first_blocks[2]
    assert next(o for o in outputs if o.request_id == "second").num_cached_tokens == 8
    stats = scheduler.get_stats()
    assert (stats.num_prefix_hit_tokens, stats.num_prefix_query_tokens) == (8, 12)
    # After both finish, a third request still hits the freed (cached) blocks.
    while scheduler.has_unfinished_requests():
        run_step(scheduler)
    scheduler.add_request(make_request("third", prompt + [1, 2, 3, 4, 5], max_tokens=1))
    output, outputs = run_step(scheduler)
    assert output.requests[0].start_position == 12 and outputs[0].num_cached_tokens == 12


def test_waiting_head_blocks_the_queue_when_it_does_not_fit(make_scheduler, make_request, run_step) -> None:
    scheduler = make_scheduler(block_size=4, num_blocks=9, max_model_len=64)  # 8 usable blocks
    scheduler.add_request(make_request("a", range(20), max_tokens=4))  # 5 blocks
    run_step(scheduler)
    scheduler.add_request(make_request("big", range(100, 120), max_tokens=4))  # needs 5, 3 free
    scheduler.add_request(make_request("small", [1, 2], max_tokens=4))
    output, _ = run_step(scheduler)
    # FCFS: the small request does not overtake the big one (that could starve big requests).
    assert [r.request_id for r in output.requests] == ["a"]


def test_preempting_an_already_scheduled_decode_unschedules_it(
    make_scheduler, make_request, run_step, invariants
) -> None:
    # 11 usable blocks of 4. A HIGH 40-token prompt prefills 8 tokens a step while a LOW request
    # decodes; at the fifth step the prefill needs blocks only the (already scheduled) decode holds.
    scheduler = make_scheduler(block_size=4, num_blocks=12, max_model_len=64, long_prefill_token_threshold=8)
    scheduler.add_request(make_request("high", range(100, 140), priority=Priority.HIGH, max_tokens=1))
    scheduler.add_request(make_request("low", [1, 2, 3, 4], priority=Priority.LOW, max_tokens=20))
    for _ in range(4):
        output, _ = run_step(scheduler)
        assert {r.request_id for r in output.requests} == {"high", "low"}
    scheduler.add_request(make_request("tiny", [9], priority=Priority.HIGH, max_tokens=1))
    output, _ = run_step(scheduler)
    invariants(scheduler, output)
    assert output.preempted_request_ids == ["low"]
    # The decode scheduled earlier in this step is gone, its token back in the budget; and after a
    # preemption no waiting request is admitted in the same step (memory is tight).
    assert [(r.request_id, len(r.token_ids)) for r in output.requests] == [("high", 8)]
    assert output.num_scheduled_tokens == 8
    output, _ = run_step(scheduler)
    assert [r.request_id for r in output.requests] == ["tiny", "low"]


def test_queue_time_is_reported_once_with_the_first_output(
    make_scheduler, make_request, run_step, clock
) -> None:
    scheduler = make_scheduler(max_num_seqs=1, clock=clock)
    for request_id in ("first", "second"):
        request = make_request(request_id, [1, 2, 3], max_tokens=2, ignore_eos=True)
        request.arrival_time = clock()
        scheduler.add_request(request)
    reported: dict[str, list[float | None]] = {"first": [], "second": []}
    for _ in range(6):
        _, outputs = run_step(scheduler)
        for output in outputs:
            reported[output.request_id].append(output.queue_s)
        clock.advance(1.5)
    assert reported["first"] == [0.0, None]  # scheduled at once: no wait, then never again
    assert reported["second"][0] == 3.0 and reported["second"][1:] == [None]  # waited two steps of 1.5 s
