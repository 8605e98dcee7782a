"""Property tests: random mixes of add / abort / step / time, with the simulated paged runner.

After every operation the ref counts equal the block tables holding each block; at the end, with
everything finished or aborted, every block is free (no leak) and every request finished exactly once.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

from bitserve.core.request import FinishReason, Priority
from bitserve.errors import InvalidRequest

EOS = 2
STOP_ID = 5
VOCAB = 16  # small, so EOS and stop ids come up often
PREFIXES = [[60 + i for i in range(24)], [90 + i for i in range(24)]]


class Workload:
    """One scheduler driven with checked operations; the tests below pick the operations."""

    def __init__(self, helpers: dict[str, Any], **config: Any) -> None:
        self.h = helpers
        self.block_size = config.setdefault("block_size", 4)
        self.scheduler = helpers["make_scheduler"](clock=helpers["clock"], **config)
        base = helpers["model_token"]
        self.model = lambda history: base(history, VOCAB)
        if config.get("speculative") == "ngram":  # a model that copies two times in three: drafts often hold
            self.model = lambda h: h[-4] if len(h) >= 4 and base(h, 3) else base(h, VOCAB)
        self.runner = helpers["make_runner"](block_size=self.block_size, vocab_size=VOCAB, model=self.model)
        self.live: dict[str, Any] = {}  # request id -> Request, until its finish output
        self.emitted: dict[str, list[int]] = {}
        self.num_added = 0
        self.finished: dict[str, FinishReason] = {}
        self.num_drafted = self.num_accepted = 0

    def add(self, prefix: int, num_prefix: int, num_suffix: int, priority: Priority, **params: Any) -> None:
        request_id = f"q{self.num_added}"
        self.num_added += 1
        prompt = PREFIXES[prefix][:num_prefix] + [200 + self.num_added * 50 + i for i in range(num_suffix)]
        request = self.h["make_request"](request_id, prompt, priority=priority, **params)
        config, kv = self.scheduler.config, self.scheduler.kv
        max_len = min(len(prompt) + request.params.max_tokens, config.max_model_len)
        is_impossible = (
            not prompt
            or len(prompt) >= config.max_model_len
            or kv.num_blocks_for(max_len - 1) > kv.num_usable_blocks
        )
        if is_impossible:
            with pytest.raises(InvalidRequest):
                self.scheduler.add_request(request)
            return
        self.scheduler.add_request(request)
        self.live[request_id] = request
        self.emitted[request_id] = []

    def abort(self, index: int) -> None:
        ids = sorted(self.live) + ["never-added"]
        self.scheduler.abort_requests([ids[index % len(ids)]])

    def step(self) -> None:
        output = self.scheduler.schedule()
        self.h["invariants"](self.scheduler, output)
        for engine_output in self.scheduler.update(output, self.runner.execute(output)):
            self._check_output(engine_output)
        stats = self.scheduler.get_stats()
        self.num_drafted += stats.num_draft_tokens
        self.num_accepted += stats.num_accepted_tokens
        # Requests the runner is told to forget have finished, and reported it by now.
        for request_id in output.finished_request_ids:
            assert request_id in self.finished and request_id not in self.live

    def _check_output(self, output: Any) -> None:
        request = self.live.get(output.request_id)
        assert request is not None, f"output for finished or unknown {output.request_id}"
        emitted = self.emitted[output.request_id]
        for token in output.new_token_ids:
            # Each token is the model's next token for the history so far: no token was lost,
            # duplicated or computed from a wrong KV, preemptions included.
            assert token == self.model(list(request.prompt_token_ids) + emitted)
            emitted.append(token)
        params = request.params
        assert len(emitted) <= params.max_tokens
        if output.finish_reason is None:
            return
        del self.live[output.request_id]
        self.finished[output.request_id] = output.finish_reason
        if output.finish_reason == FinishReason.STOP:
            assert len(emitted) >= params.min_tokens
            last = emitted[-1]
            assert (last == EOS and not params.ignore_eos) or last in params.stop_token_ids
        elif output.finish_reason == FinishReason.LENGTH:
            num_tokens = len(request.prompt_token_ids) + len(emitted)
            assert len(emitted) == params.max_tokens or num_tokens >= self.scheduler.config.max_model_len

    def finish(self, abort_rest: bool) -> None:
        if abort_rest:
            self.scheduler.abort_requests(list(self.live))
        for _ in range(5000):
            if not self.scheduler.has_unfinished_requests():
                break
            self.step()
        # Liveness: every admitted request finished (nothing hangs), then no block leaked.
        assert not self.live and not self.scheduler.has_unfinished_requests()
        self.h["no_leak"](self.scheduler)


@pytest.fixture
def helpers(make_scheduler, make_request, make_runner, invariants, no_leak, model_token, clock) -> dict:
    return dict(
        make_scheduler=make_scheduler,
        make_request=make_request,
        make_runner=make_runner,
        invariants=invariants,
        no_leak=no_leak,
        model_token=model_token,
        clock=clock,
    )


def _config(chunked: bool, caching: bool, num_blocks: int, num_drafts: int = 0) -> dict[str, Any]:
    return dict(
        speculative="ngram" if num_drafts else "off",
        num_speculative_tokens=max(1, num_drafts),
        num_blocks=num_blocks,
        max_model_len=48,
        max_num_seqs=4,
        max_num_batched_tokens=16 if chunked else 48,
        long_prefill_token_threshold=6 if chunked else 0,
        enable_chunked_prefill=chunked,
        enable_prefix_caching=caching,
        aging_interval_s=3.0,
    )


def test_random_operations_never_leak_blocks(helpers) -> None:
    run_state_machine_as_test(
        _machine(helpers),
        settings=settings(
            max_examples=60,
            stateful_step_count=40,
            deadline=None,
            suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
        ),
    )


def _machine(helpers: dict) -> type[RuleBasedStateMachine]:
    class SchedulerMachine(RuleBasedStateMachine):
        @initialize(
            chunked=st.booleans(),
            caching=st.booleans(),
            num_blocks=st.integers(6, 20),
            num_drafts=st.sampled_from([0, 0, 1, 3, 6]),
        )
        def start(self, chunked: bool, caching: bool, num_blocks: int, num_drafts: int) -> None:
            self.work = Workload(helpers, **_config(chunked, caching, num_blocks, num_drafts))

        @rule(
            prefix=st.integers(0, 1),
            num_prefix=st.integers(0, 24),
            num_suffix=st.integers(0, 12),
            priority=st.sampled_from(list(Priority)),
            max_tokens=st.integers(1, 20),
            min_tokens=st.integers(0, 3),
            ignore_eos=st.booleans(),
            has_stop=st.booleans(),
            deadline_s=st.none() | st.floats(0.0, 5.0),
        )
        def add(
            self,
            prefix,
            num_prefix,
            num_suffix,
            priority,
            max_tokens,
            min_tokens,
            ignore_eos,
            has_stop,
            deadline_s,
        ):
            self.work.add(
                prefix,
                num_prefix,
                num_suffix,
                priority,
                max_tokens=max_tokens,
                min_tokens=min(min_tokens, max_tokens),
                ignore_eos=ignore_eos,
                stop_token_ids=[STOP_ID] if has_stop else [],
                deadline=None if deadline_s is None else helpers["clock"].now + deadline_s,
            )

        @rule(index=st.integers(0, 50))
        def abort(self, index: int) -> None:
            self.work.abort(index)

        @rule(num_steps=st.integers(1, 4))
        def step(self, num_steps: int) -> None:
            for _ in range(num_steps):
                self.work.step()

        @rule(seconds=st.floats(0.0, 2.0))
        def advance_clock(self, seconds: float) -> None:
            helpers["clock"].advance(seconds)

        @invariant()
        def ref_counts_match_block_tables(self) -> None:
            if hasattr(self, "work"):
                helpers["invariants"](self.work.scheduler)

        def teardown(self) -> None:
            if hasattr(self, "work"):
                self.work.finish(abort_rest=bool(self.work.num_added % 2))

    return SchedulerMachine


@pytest.mark.parametrize("num_drafts", [0, 4])
@pytest.mark.parametrize("seed", range(6))
def test_long_random_workloads_under_memory_pressure(helpers, seed: int, num_drafts: int) -> None:
    rng = random.Random(seed)
    config = _config(chunked=seed % 3 != 0, caching=seed % 2 == 0, num_blocks=13, num_drafts=num_drafts)
    work = Workload(helpers, **config)
    for _ in range(400):
        op = rng.random()
        if op < 0.3:
            work.add(
                rng.randrange(2),
                rng.randrange(25),
                rng.randrange(1, 10),
                rng.choice(list(Priority)),
                max_tokens=rng.randrange(1, 25),
                ignore_eos=rng.random() < 0.5,
                stop_token_ids=[STOP_ID] if rng.random() < 0.3 else [],
                deadline=helpers["clock"].now + rng.uniform(0, 30) if rng.random() < 0.2 else None,
            )
        elif op < 0.35:
            work.abort(rng.randrange(50))
        elif op < 0.4:
            helpers["clock"].advance(rng.uniform(0, 1))
        else:
            work.step()
    assert work.scheduler.get_stats().num_preempted_total > 0  # the pool really was under pressure
    work.finish(abort_rest=False)
    assert {FinishReason.STOP, FinishReason.LENGTH} <= set(work.finished.values())
    if num_drafts:  # speculative decodes ran; drafts held and missed
        assert 0 < work.num_accepted < work.num_drafted
