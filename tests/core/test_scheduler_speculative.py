"""Speculative decodes in the scheduler: drafts scheduled with their slots, capped by max_tokens, the
context and the budget, never preempting; progress by the tokens returned; stops inside an accepted run;
the prefix cache holding accepted tokens only. The runner is simulated: it stores token ids as "KV" and
checks every row reads exactly its sequence, so stale KV of rejected drafts that was not overwritten, a
wrong block table or a garbage block in the prefix cache fails loudly."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import pytest

from bitserve.core.request import FinishReason, Request
from bitserve.core.scheduler import Scheduler
from bitserve.core.scheduler_output import RunnerOutput, SchedulerOutput
from bitserve.core.step_outputs import EngineOutput
from bitserve.structured.guide import Guide

Model = Callable[[list[int]], int]


def copy_model(period: int, deviate_every: int = 0) -> Model:
    """A model that repeats the token `period` back, except at every `deviate_every`-th position, where
    it says something new: prompt lookup guesses right until a deviation."""

    def model(history: list[int]) -> int:
        n = len(history)
        if deviate_every and n % deviate_every == 0:
            return 500 + n % 37
        return history[n - period]

    return model


def run_to_end(
    scheduler: Scheduler, runner: Any, invariants: Callable[..., None], max_steps: int = 500
) -> tuple[dict[str, list[int]], dict[str, FinishReason], list[SchedulerOutput], int, int]:
    """Step until idle: (tokens, finish reasons, schedules, drafts verified, drafts accepted)."""
    tokens: dict[str, list[int]] = {}
    reasons: dict[str, FinishReason] = {}
    outputs: list[SchedulerOutput] = []
    num_drafted = num_accepted = 0
    while scheduler.has_unfinished_requests():
        output = scheduler.schedule()
        invariants(scheduler, output)
        outputs.append(output)
        engine_outputs: list[EngineOutput] = scheduler.update(output, runner.execute(output))
        invariants(scheduler)
        stats = scheduler.get_stats()
        num_drafted += stats.num_draft_tokens
        num_accepted += stats.num_accepted_tokens
        for engine_output in engine_outputs:
            tokens.setdefault(engine_output.request_id, []).extend(engine_output.new_token_ids)
            if engine_output.finish_reason is not None:
                reasons[engine_output.request_id] = engine_output.finish_reason
        assert len(outputs) < max_steps
    return tokens, reasons, outputs, num_drafted, num_accepted


def periodic_prompt(period: int, offset: int = 10, repeats: int = 3) -> list[int]:
    return [offset + i % period for i in range(period * repeats)]


@pytest.mark.parametrize("deviate_every", [0, 9, 5])
def test_speculation_gives_the_plain_tokens_in_fewer_steps(
    make_runner, make_scheduler, make_request, invariants, no_leak, deviate_every: int
) -> None:
    results = {}
    for speculative in ("off", "ngram"):
        scheduler = make_scheduler(speculative=speculative, num_speculative_tokens=5)
        runner = make_runner(scheduler.kv.block_size, model=copy_model(4, deviate_every))
        for i, period in enumerate((4, 4, 4)):
            prompt = periodic_prompt(period, offset=10 + 100 * i)
            scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=40, ignore_eos=True))
        results[speculative] = run_to_end(scheduler, runner, invariants)
        no_leak(scheduler)
    plain, spec = results["off"], results["ngram"]
    assert spec[0] == plain[0] and all(len(t) == 40 for t in plain[0].values())
    assert spec[1] == plain[1] == dict.fromkeys(("r0", "r1", "r2"), FinishReason.LENGTH)
    assert plain[3] == 0 and spec[3] > 0 and spec[4] > 0
    assert len(spec[2]) < len(plain[2])
    if deviate_every == 0:  # every draft right: about 1 + k tokens a step after the first ones
        assert spec[4] == spec[3] and len(spec[2]) <= 12


def test_a_verify_schedules_last_token_and_drafts_with_slots_and_advances_by_tokens_returned(
    make_scheduler, make_request, invariants
) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=4, block_size=4)
    prompt = [1, 2, 3, 4, 5, 6, 7, 1, 2]
    scheduler.add_request(make_request("a", prompt, max_tokens=20, ignore_eos=True))
    first = scheduler.schedule()
    scheduler.update(first, RunnerOutput({"a": [3]}))  # prefill -> "3"
    request = scheduler.requests["a"]
    output = scheduler.schedule()
    (verify,) = output.requests
    assert verify.draft_token_ids == (4, 5, 6, 7)  # what followed "1 2 3" in the prompt
    assert verify.token_ids == [3, 4, 5, 6, 7] and verify.start_position == 9 and verify.sample
    assert len(verify.block_ids) * 4 >= 9 + 5  # a slot for every verified position
    assert output.num_scheduled_tokens == 5 and verify.output_token_ids == (3,)
    stats = scheduler.get_stats()
    assert (stats.num_decode_tokens, stats.num_draft_tokens) == (5, 4)
    scheduler.update(output, RunnerOutput({"a": [4, 5, 9]}))  # drafts 4, 5 accepted, then 9
    assert scheduler.get_stats().num_accepted_tokens == 2
    assert request.output_token_ids == [3, 4, 5, 9]
    assert request.num_computed_tokens == 9 + 3  # the last token and two accepted drafts
    assert request.num_tokens == request.num_computed_tokens + 1
    invariants(scheduler)
    next_output = scheduler.schedule()
    assert next_output.requests[0].start_position == 12 and next_output.requests[0].token_ids[0] == 9


def test_runner_tokens_that_are_not_a_run_of_the_drafts_stop_the_engine(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(speculative="ngram")
    scheduler.add_request(make_request("a", [1, 2, 3, 1, 2], max_tokens=20))
    scheduler.update(scheduler.schedule(), RunnerOutput({"a": [3]}))
    output = scheduler.schedule()
    assert output.requests[0].draft_token_ids[:1] == (1,)
    with pytest.raises(RuntimeError, match="not a run of its drafts"):
        scheduler.update(output, RunnerOutput({"a": [8, 8]}))  # 8 is not the first draft


@pytest.mark.parametrize("max_tokens", [1, 2, 3, 6, 11])
def test_drafts_never_pass_max_tokens(
    make_runner, make_scheduler, make_request, invariants, max_tokens: int
) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=8)
    runner = make_runner(scheduler.kv.block_size, model=copy_model(3))
    scheduler.add_request(make_request("a", periodic_prompt(3), max_tokens=max_tokens, ignore_eos=True))
    tokens, reasons, outputs, _, _ = run_to_end(scheduler, runner, invariants)
    assert len(tokens["a"]) == max_tokens and reasons["a"] == FinishReason.LENGTH
    for output in outputs:
        for scheduled in output.requests:
            assert len(scheduled.output_token_ids) + 1 + len(scheduled.draft_token_ids) <= max_tokens


def test_drafts_never_pass_the_context(make_runner, make_scheduler, make_request, invariants) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=8, max_model_len=20)
    runner = make_runner(scheduler.kv.block_size, model=copy_model(3))
    prompt = periodic_prompt(3)  # 9 tokens: 11 more fit
    scheduler.add_request(make_request("a", prompt, max_tokens=None, ignore_eos=True))
    tokens, reasons, outputs, drafted, _ = run_to_end(scheduler, runner, invariants)
    assert len(tokens["a"]) == 11 and reasons["a"] == FinishReason.LENGTH and drafted > 0
    for output in outputs:
        for scheduled in output.requests:
            # the verified positions and the token each returns stay inside max_model_len
            assert scheduled.start_position + len(scheduled.token_ids) + 1 <= 20


def test_drafts_leave_a_token_of_budget_for_every_decode(
    make_runner, make_scheduler, make_request, invariants
) -> None:
    scheduler = make_scheduler(
        speculative="ngram", num_speculative_tokens=6, max_num_batched_tokens=8, max_num_seqs=4
    )
    runner = make_runner(scheduler.kv.block_size, model=copy_model(3))
    for i in range(4):
        prompt = periodic_prompt(3, offset=10 + 100 * i, repeats=1)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=40, ignore_eos=True))
    num_drafted = num_steps = 0
    while scheduler.has_unfinished_requests():
        decoding = {r.request_id for r in scheduler.running if r.num_tokens - r.num_computed_tokens == 1}
        output = scheduler.schedule()
        invariants(scheduler, output)
        assert output.num_scheduled_tokens <= 8
        assert decoding <= {r.request_id for r in output.requests}  # no decode waits for another's drafts
        num_drafted += sum(len(r.draft_token_ids) for r in output.requests)
        scheduler.update(output, runner.execute(output))
        num_steps += 1
        assert num_steps < 100
    assert num_drafted > 0


def test_drafts_never_preempt(make_runner, make_scheduler, make_request, invariants) -> None:
    # 6 usable blocks of 4 slots: a and b hold 3 each after their 11-token prefills, none is free
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=4, block_size=4, num_blocks=7)
    runner = make_runner(4, model=copy_model(4))
    scheduler.add_request(make_request("a", periodic_prompt(4, 10, 2) + [10, 11, 12], max_tokens=6))
    scheduler.add_request(make_request("b", periodic_prompt(4, 50, 2) + [50, 51, 52], max_tokens=6))
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))  # both prefilled: 11 tokens each, 3 blocks each
    assert scheduler.kv.num_free_blocks == 0
    output = scheduler.schedule()  # 12 slots each: the decodes fit, drafts would need a fourth block
    assert [r.draft_token_ids for r in output.requests] == [(), ()]
    assert output.num_scheduled_tokens == 2 and not output.preempted_request_ids
    assert scheduler.get_stats().num_preempted_total == 0
    scheduler.update(output, runner.execute(output))
    invariants(scheduler)


def test_drafts_take_no_block_another_decode_needs(
    make_runner, make_scheduler, make_request, invariants
) -> None:
    # 8 usable blocks of 4 slots: a's 10-token prompt holds 3, b's 16-token one 4, one is free
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=4, block_size=4, num_blocks=9)
    runner = make_runner(4, model=copy_model(4))
    scheduler.add_request(make_request("a", periodic_prompt(4, 10, 2) + [10, 11], max_tokens=8))
    scheduler.add_request(make_request("b", periodic_prompt(4, 50, 4), max_tokens=8))
    output = scheduler.schedule()
    scheduler.update(output, runner.execute(output))
    assert scheduler.kv.num_free_blocks == 1
    output = scheduler.schedule()
    # a (first) decodes at position 10 in its third block, its drafts would take the free block; b's
    # decode at position 16 needs that block: b gets it, a's drafts go, and no one is preempted
    assert not output.preempted_request_ids and scheduler.get_stats().num_preempted_total == 0
    assert [(r.request_id, r.draft_token_ids) for r in output.requests] == [("a", ()), ("b", ())]
    assert scheduler.kv.num_free_blocks == 0
    scheduler.update(output, runner.execute(output))
    invariants(scheduler)


@pytest.mark.parametrize("stop", ["stop_token", "eos"])
def test_a_stop_inside_an_accepted_run_ends_the_request_at_its_token(
    make_runner, make_scheduler, make_request, invariants, no_leak, stop: str
) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=6)
    runner = make_runner(scheduler.kv.block_size, model=copy_model(5))
    prompt = [20, 21, 22, 23, 24] * 2  # the model repeats it: 20 21 22 23 24 20 ...
    options = {"stop_token_ids": [23]} if stop == "stop_token" else {"eos_token_ids": frozenset({23})}
    scheduler.add_request(make_request("a", prompt, max_tokens=30, **options))
    tokens, reasons, outputs, drafted, accepted = run_to_end(scheduler, runner, invariants)
    assert tokens["a"] == [20, 21, 22, 23] and reasons["a"] == FinishReason.STOP
    # the stop token came inside a verify whose run went on past it: those tokens were dropped
    assert any(r.draft_token_ids[:3] == (21, 22, 23) for o in outputs for r in o.requests)
    assert accepted >= 3
    no_leak(scheduler)


def test_min_tokens_is_left_to_the_runner_and_stops_count_after_it(
    make_runner, make_scheduler, make_request, invariants
) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=6)
    runner = make_runner(scheduler.kv.block_size, model=copy_model(5))
    prompt = [20, 21, 22, 23, 24] * 2
    scheduler.add_request(make_request("a", prompt, max_tokens=30, min_tokens=5, stop_token_ids=[23]))
    tokens, reasons, _, _, _ = run_to_end(scheduler, runner, invariants)
    # the 23 at output 4 does not stop (min_tokens 5), the next one, at output 9, does
    assert tokens["a"] == [20, 21, 22, 23, 24, 20, 21, 22, 23] and reasons["a"] == FinishReason.STOP


def test_the_prefix_cache_holds_only_accepted_tokens(
    make_runner, make_scheduler, make_request, invariants, no_leak
) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=5, block_size=4)
    runner = make_runner(4, model=copy_model(4, deviate_every=5))  # many rejections: garbage KV each time
    prompt = periodic_prompt(4, 10, 2)
    scheduler.add_request(make_request("a", prompt, max_tokens=25, ignore_eos=True))
    tokens, _, _, drafted, accepted = run_to_end(scheduler, runner, invariants)
    assert 0 < accepted < drafted
    # the whole first sequence as a prompt: its full blocks come from the cache, and the runner reads
    # them back (a block cached with a rejected draft's KV in it would not match)
    second = make_request("b", prompt + tokens["a"], max_tokens=4, ignore_eos=True)
    scheduler.add_request(second)
    output = scheduler.schedule()
    assert second.num_cached_tokens == 32  # 8 + 25 tokens, the last never computed: 8 full blocks
    scheduler.update(output, runner.execute(output))
    run_to_end(scheduler, runner, invariants)
    no_leak(scheduler)


def test_guided_requests_and_the_off_switch_schedule_no_drafts(
    make_runner, make_scheduler, make_request, invariants
) -> None:
    guide = Guide.choice(["yes", "no"])
    for speculative, options in (("ngram", {"guide": guide}), ("off", {})):
        scheduler = make_scheduler(speculative=speculative)
        runner = make_runner(scheduler.kv.block_size, model=copy_model(3))
        scheduler.add_request(make_request("a", periodic_prompt(3), max_tokens=10, **options))
        _, _, outputs, drafted, _ = run_to_end(scheduler, runner, invariants)
        assert drafted == 0 and all(not r.draft_token_ids for o in outputs for r in o.requests)


def test_a_preempted_request_resumes_and_drafts_again(
    make_runner, make_scheduler, make_request, invariants, no_leak
) -> None:
    scheduler = make_scheduler(speculative="ngram", num_speculative_tokens=4, block_size=4, num_blocks=10)
    runner = make_runner(4, model=copy_model(4, deviate_every=6))
    for i in range(3):
        prompt = periodic_prompt(4, 10 + 100 * i, 2)
        scheduler.add_request(make_request(f"r{i}", prompt, max_tokens=20, ignore_eos=True))
    tokens, _, _, drafted, accepted = run_to_end(scheduler, runner, invariants)
    assert scheduler.get_stats().num_preempted_total > 0 and accepted > 0
    assert all(len(t) == 20 for t in tokens.values())
    plain = make_scheduler(block_size=4, num_blocks=10)
    plain_runner = make_runner(4, model=copy_model(4, deviate_every=6))
    for i in range(3):
        plain.add_request(
            make_request(f"r{i}", periodic_prompt(4, 10 + 100 * i, 2), max_tokens=20, ignore_eos=True)
        )
    assert run_to_end(plain, plain_runner, invariants)[0] == tokens
    no_leak(scheduler)


def test_request_state_is_created_only_for_drafting_decodes(make_scheduler, make_request) -> None:
    scheduler = make_scheduler(speculative="ngram")
    request: Request = make_request("a", [1, 2, 3], max_tokens=5)
    scheduler.add_request(request)
    scheduler.update(scheduler.schedule(), RunnerOutput({"a": [4]}))
    assert request.draft is None  # the prefill drafted nothing
    scheduler.schedule()
    assert request.draft is not None and request.draft.max_drafts == scheduler.config.num_speculative_tokens
