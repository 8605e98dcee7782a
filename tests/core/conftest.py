"""Helpers for the torch-free scheduler and KV tests: a fake clock, scheduler and request builders,
and a simulated runner that stores token ids in paged "KV" so block-table mistakes show up."""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

import pytest

from bitserve.core.kv_cache_manager import KVCacheManager
from bitserve.core.request import Priority, Request
from bitserve.core.scheduler import Scheduler
from bitserve.core.scheduler_output import RunnerOutput, SchedulerOutput
from bitserve.core.scheduling_config import SchedulerConfig
from bitserve.core.step_outputs import EngineOutput
from bitserve.sampling_params import SamplingParams

EOS = 2
DEFAULT_TOKEN = 7


class FakeClock:
    def __init__(self, now: float = 1000.0) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def build_scheduler(
    *,
    block_size: int = 4,
    num_blocks: int = 65,
    enable_prefix_caching: bool = True,
    clock: Callable[[], float] | None = None,
    num_lookahead_tokens: int = 0,
    **overrides: Any,
) -> Scheduler:
    settings: dict[str, Any] = dict(
        max_num_seqs=8, max_num_batched_tokens=64, max_model_len=512, aging_interval_s=10.0
    )
    settings.update(overrides)
    kv = KVCacheManager(block_size, num_blocks, enable_prefix_caching)
    return Scheduler(
        SchedulerConfig(**settings), kv, clock=clock or FakeClock(), num_lookahead_tokens=num_lookahead_tokens
    )


def build_request(
    request_id: str,
    prompt_token_ids: Iterable[int],
    *,
    priority: Priority = Priority.NORMAL,
    deadline: float | None = None,
    eos_token_ids: frozenset[int] = frozenset({EOS}),
    **params: Any,
) -> Request:
    params.setdefault("max_tokens", 16)
    return Request(
        request_id=request_id,
        prompt_token_ids=tuple(prompt_token_ids),
        params=SamplingParams(**params),
        eos_token_ids=eos_token_ids,
        priority=priority,
        deadline=deadline,
    )


def build_requests(n: int, num_tokens: int, *, prefix: str = "r", **kwargs: Any) -> list[Request]:
    """`n` requests with distinct prompts (no accidental prefix hits) of `num_tokens` tokens."""
    return [
        build_request(f"{prefix}{i}", [100 + 1000 * i + j for j in range(num_tokens)], **kwargs)
        for i in range(n)
    ]


def step(
    scheduler: Scheduler, token_for: Callable[[str], int] | None = None
) -> tuple[SchedulerOutput, list[EngineOutput]]:
    """One schedule → fake execute → update; every sampled request gets `token_for(id)`."""
    output = scheduler.schedule()
    sampled = {
        r.request_id: [token_for(r.request_id) if token_for else DEFAULT_TOKEN]
        for r in output.requests
        if r.sample
    }
    return output, scheduler.update(output, RunnerOutput(sampled_token_ids=sampled))


def next_token(history: list[int], vocab_size: int) -> int:
    """A deterministic stand-in for a model: the next token is a function of the whole history."""
    value = 17
    for token in history:
        value = (value * 1_000_003 + token) % 2_147_483_647
    return value % vocab_size


def accepted_run(row_tokens: list[int], drafts: tuple[int, ...]) -> list[int]:
    """The speculative acceptance rule (runner/speculative.py), re-stated so these tests stay torch-free:
    the drafts the rows confirmed, in order, and the token after them."""
    accepted = 0
    while accepted < len(drafts) and row_tokens[accepted] == drafts[accepted]:
        accepted += 1
    return row_tokens[: accepted + 1]


@dataclass
class SimulatedRunner:
    """Writes each scheduled token id into its KV slot and samples from what it reads back.

    Sampling reads positions 0..end-1 through the block table and asserts they equal the request's
    prompt + outputs, so a wrong table, a block shared while written, an evicted block still in
    use or a bad prefix hit fails loudly. The sample is `model(history)` (default
    `next_token(history, vocab_size)`). A speculative decode is sampled at each of its 1 + k rows, row i
    after reading back prompt + outputs + drafts[:i] (so stale KV of rejected drafts that a later step
    failed to overwrite fails too), and returns the accepted run.
    """

    block_size: int
    vocab_size: int = 64
    model: Callable[[list[int]], int] | None = None
    slots: dict[tuple[int, int], int] = field(default_factory=dict)

    def execute(self, output: SchedulerOutput) -> RunnerOutput:
        total = sum(len(r.token_ids) for r in output.requests)
        assert total == output.num_scheduled_tokens
        for request in output.requests:
            for offset, token in enumerate(request.token_ids):
                self.slots[self._slot(request.block_ids, request.start_position + offset)] = token
        sampled = {}
        for request in output.requests:
            if not request.sample:
                assert request.output_token_ids == () and request.draft_token_ids == ()
                continue
            drafts = request.draft_token_ids
            end = request.start_position + len(request.token_ids) - len(drafts)
            expected = list(request.prompt_token_ids) + list(request.output_token_ids)
            row_tokens = []
            for i in range(1 + len(drafts)):
                row = expected + list(drafts[:i])
                history = [self.slots.get(self._slot(request.block_ids, p)) for p in range(end + i)]
                assert history == row, f"KV of {request.request_id} (row {i}) does not match its tokens"
                row_tokens.append(self.model(row) if self.model else next_token(row, self.vocab_size))
            sampled[request.request_id] = accepted_run(row_tokens, drafts)
        return RunnerOutput(sampled_token_ids=sampled)

    def _slot(self, block_ids: list[int], position: int) -> tuple[int, int]:
        block_id = block_ids[position // self.block_size]
        assert block_id != 0, "the null block is never in a block table"
        return block_id, position % self.block_size


def check_invariants(scheduler: Scheduler, output: SchedulerOutput | None = None) -> None:
    """Budget, seats, progress bounds, and ref counts == number of block tables holding each block."""
    config = scheduler.config
    kv = scheduler.kv
    if output is not None:
        assert output.num_scheduled_tokens <= config.max_num_batched_tokens
        assert len(output.requests) <= config.max_num_seqs
        for scheduled in output.requests:
            end = scheduled.start_position + len(scheduled.token_ids)
            assert len(scheduled.block_ids) * kv.block_size >= end
    assert len(scheduler.running) <= config.max_num_seqs
    expected_refs = [0] * kv.num_blocks
    for request in scheduler.running:
        assert 0 <= request.num_computed_tokens <= request.num_tokens
        table = kv.block_ids(request.request_id)
        assert len(set(table)) == len(table)
        for block_id in table:
            expected_refs[block_id] += 1
    for request in scheduler.waiting:
        assert request.num_computed_tokens == 0
        assert kv.block_ids(request.request_id) == []
    for block in kv.pool.blocks:
        assert block.ref_count == expected_refs[block.block_id] >= 0
        if block.block_id != 0:
            assert kv.pool.is_free(block.block_id) == (block.ref_count == 0)
    assert not kv.pool.is_free(0) and kv.pool.blocks[0].ref_count == 0


def assert_no_leak(scheduler: Scheduler) -> None:
    kv = scheduler.kv
    assert not scheduler.running and not scheduler.waiting and not scheduler.requests
    assert kv.num_free_blocks == kv.num_blocks - 1
    assert all(block.ref_count == 0 for block in kv.pool.blocks)
    assert kv.usage == 0.0


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


# Helpers are handed out as fixtures (not imported from this conftest, which is ambiguous when
# several test folders have one).
@pytest.fixture
def make_scheduler() -> Callable[..., Scheduler]:
    return build_scheduler


@pytest.fixture
def make_requests() -> Callable[..., list[Request]]:
    return build_requests


@pytest.fixture
def make_request() -> Callable[..., Request]:
    return build_request


@pytest.fixture
def run_step() -> Callable[..., tuple[SchedulerOutput, list[EngineOutput]]]:
    return step


@pytest.fixture
def invariants() -> Callable[..., None]:
    return check_invariants


@pytest.fixture
def no_leak() -> Callable[[Scheduler], None]:
    return assert_no_leak


@pytest.fixture
def make_runner() -> Callable[..., SimulatedRunner]:
    return SimulatedRunner


@pytest.fixture
def model_token() -> Callable[[list[int], int], int]:
    return next_token
