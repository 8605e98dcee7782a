"""`bitserve bench --curve MODEL`: offline throughput and step latency versus concurrency, in-process.

Drives one Engine directly (no HTTP, no detokenization): for each concurrency level c, c greedy
`ignore_eos` requests with short distinct prompts start together; the decode steps (every request
past its prompt) are timed. `pick_batch_limits` turns a curve into max_num_seqs /
max_num_batched_tokens by an explicit rule (KneeRule); batch_limits.FORMAT_BATCH_LIMITS holds its results.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CurvePoint:
    """One concurrency level: decode-only rates (the prompt step is excluded)."""

    concurrency: int
    num_decode_steps: int
    output_tokens_per_s: float  # all sequences' decode tokens / summed decode step time
    median_step_ms: float  # = median inter-token latency of every stream


@dataclass(frozen=True, slots=True)
class KneeRule:
    """The rule that turns a measured curve into batch limits (the numbers are the rule, stated once).

    max_num_seqs: the largest measured concurrency c whose output tok/s beats the best smaller level by
    at least `min_gain_per_doubling` per doubling between them (1.10x for 16 over 8, 1.21x for 16 over
    4) and whose median decode step is <= `max_step_ms` (every stream still gets >= 1000 / max_step_ms
    tok/s); the smallest level when none does. Comparing with the best smaller level, not only the
    previous one, keeps one noisy dip on a shared machine from ending the curve early.
    max_num_batched_tokens: the largest power of two, at least max_num_seqs, whose prefill chunk takes
    <= `max_prefill_stall_s` at the measured prefill rate (how long one step of prompt work may stall
    every running stream), capped at `max_budget`.
    """

    min_gain_per_doubling: float = 0.10
    max_step_ms: float = 1000.0
    max_prefill_stall_s: float = 1.0
    max_budget: int = 2048


@dataclass(frozen=True, slots=True)
class CurveResult:
    model: str
    weight_format: str
    points: list[CurvePoint]
    prefill_tokens: int
    prefill_tokens_per_s: float
    max_num_seqs: int  # chosen by the rule
    max_num_batched_tokens: int

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def pick_max_num_seqs(points: Sequence[CurvePoint], rule: KneeRule) -> int:
    """The knee of the curve by `rule` (see KneeRule). Points are sorted by concurrency."""
    ordered = sorted(points, key=lambda p: p.concurrency)
    if not ordered:
        raise ValueError("an empty curve has no knee")
    chosen = ordered[0].concurrency
    best = ordered[0]  # the fastest level so far
    for point in ordered[1:]:
        doublings = math.log2(point.concurrency / best.concurrency)
        needed = best.output_tokens_per_s * (1.0 + rule.min_gain_per_doubling) ** doublings
        if point.output_tokens_per_s >= needed and point.median_step_ms <= rule.max_step_ms:
            chosen = point.concurrency
        if point.output_tokens_per_s > best.output_tokens_per_s:
            best = point
    return chosen


def pick_max_num_batched_tokens(prefill_tokens_per_s: float, max_num_seqs: int, rule: KneeRule) -> int:
    """Largest power of two >= max_num_seqs whose prefill fits `rule.max_prefill_stall_s`, capped."""
    budget = 1
    while budget * 2 <= rule.max_budget and budget * 2 <= prefill_tokens_per_s * rule.max_prefill_stall_s:
        budget *= 2
    return max(budget, max_num_seqs)


def _prompt_ids(base_ids: Sequence[int], length: int, variant: int) -> tuple[int, ...]:
    """`length` ids from `base_ids`, rotated per variant: no two prompts share a prefix-cache block."""
    ids = [base_ids[(variant * 7 + i) % len(base_ids)] for i in range(length)]
    ids[0] = base_ids[variant % len(base_ids)]
    return tuple(ids)


def run_level(
    llm: Any,
    base_ids: Sequence[int],
    concurrency: int,
    num_prompt_tokens: int,
    num_output_tokens: int,
    tag: str,
) -> CurvePoint:
    """Start `concurrency` requests together and time the steps where all of them decode."""
    from bitserve.engine.messages import EngineRequest
    from bitserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=num_output_tokens, temperature=0.0, ignore_eos=True)
    for index in range(concurrency):
        ids = _prompt_ids(base_ids, num_prompt_tokens, 1000 * concurrency + index)
        engine.add_request(EngineRequest(f"{tag}-{index}", ids, params, llm.tokenizer.eos_token_ids))
    step_times: list[float] = []
    num_tokens = 0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        result = engine.step()
        elapsed = time.perf_counter() - start
        new_tokens = sum(len(output.new_token_ids) for output in result.outputs)
        # a decode step: every request is running and took exactly one token (no prompt work in it)
        if result.stats.num_prefill_tokens == 0 and result.stats.num_decode_tokens == concurrency:
            step_times.append(elapsed)
            num_tokens += new_tokens
    if not step_times:
        raise RuntimeError(f"no pure decode step at concurrency {concurrency}: raise --max-tokens")
    return CurvePoint(
        concurrency, len(step_times), num_tokens / sum(step_times), statistics.median(step_times) * 1e3
    )


def measure_prefill(llm: Any, base_ids: Sequence[int], num_tokens: int, tag: str) -> float:
    """Prompt tokens / wall time of one fresh prompt's forward (max_tokens 1: prefill + one sample)."""
    from bitserve.engine.messages import EngineRequest
    from bitserve.sampling_params import SamplingParams

    engine = llm.engine
    params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)
    engine.add_request(
        EngineRequest(tag, _prompt_ids(base_ids, num_tokens, 99_991), params, llm.tokenizer.eos_token_ids)
    )
    start = time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
    return num_tokens / (time.perf_counter() - start)


def curve_engine_config(
    model: str,
    levels: Sequence[int],
    num_prompt_tokens: int,
    prefill_tokens: int,
    backend: str,
    num_threads: int | None,
    device: str | None = None,
) -> Any:
    """An EngineConfig whose limits never bind during the curve (they are what the curve measures).
    `device` None: ModelConfig's default."""
    from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig

    max_seqs = max(levels)
    budget = max(max_seqs * num_prompt_tokens, prefill_tokens, max_seqs)
    device_option = {} if device is None else {"device": device}
    return EngineConfig(
        model=ModelConfig(model=model, backend=backend, num_threads=num_threads, **device_option),
        scheduler=SchedulerConfig(max_num_seqs=max_seqs, max_num_batched_tokens=budget),
    )


def run_curve(
    model: str,
    levels: Sequence[int],
    *,
    num_prompt_tokens: int = 8,
    num_output_tokens: int = 16,
    prefill_tokens: int = 128,
    backend: str = "auto",
    num_threads: int | None = None,
    num_repeats: int = 1,
    rule: KneeRule | None = None,
    device: str | None = None,
) -> CurveResult:
    """Load `model`, warm up, measure every level `num_repeats` times (all levels in turn, so each
    level sees the same stretches of machine load; the fastest run of a level is kept: noise on a
    shared machine only slows a run down) and the prefill rate; apply `rule`."""
    from bitserve.engine.instance import projection_format
    from bitserve.llm import LLM

    rule = rule or KneeRule()
    llm = LLM(
        config=curve_engine_config(
            model, levels, num_prompt_tokens, prefill_tokens, backend, num_threads, device
        )
    )
    try:
        # ordinary token ids (past the specials at the start of the vocabulary); prompts are cut from them
        base_ids = list(range(llm.tokenizer.vocab_size // 4, llm.tokenizer.vocab_size))[:4096]
        # warm-up: numba compilation / cache load of the GEMV (1 token) and GEMM (many tokens) paths
        run_level(llm, base_ids, min(2, max(levels)), num_prompt_tokens, 3, "warm-a")
        measure_prefill(llm, base_ids, prefill_tokens, "warm-b")
        points, prefill_tok_s = _measure_repeats(
            llm, base_ids, levels, num_prompt_tokens, num_output_tokens, prefill_tokens, num_repeats
        )
        weight_format = projection_format(llm.instance.loaded.gguf)
    finally:
        llm.close()
    max_num_seqs = pick_max_num_seqs(points, rule)
    return CurveResult(
        model,
        weight_format,
        points,
        prefill_tokens,
        prefill_tok_s,
        max_num_seqs,
        pick_max_num_batched_tokens(prefill_tok_s, max_num_seqs, rule),
    )


def _measure_repeats(
    llm: Any,
    base_ids: Sequence[int],
    levels: Sequence[int],
    num_prompt_tokens: int,
    num_output_tokens: int,
    prefill_tokens: int,
    num_repeats: int,
) -> tuple[list[CurvePoint], float]:
    """Every level `num_repeats` times, all levels in turn: the fastest run of each level (by
    concurrency), and the fastest prefill rate measured after each round."""
    best: dict[int, CurvePoint] = {}
    prefill_tok_s = 0.0
    for repeat in range(num_repeats):
        for concurrency in levels:
            point = run_level(
                llm,
                base_ids,
                concurrency,
                num_prompt_tokens,
                num_output_tokens,
                f"r{repeat}c{concurrency}",
            )
            logger.info(
                "concurrency %d: %.1f tok/s, %.1f ms/step",
                concurrency,
                point.output_tokens_per_s,
                point.median_step_ms,
            )
            if concurrency not in best or point.output_tokens_per_s > best[concurrency].output_tokens_per_s:
                best[concurrency] = point
        prefill_rate = measure_prefill(llm, base_ids, prefill_tokens, f"prefill-{repeat}")
        prefill_tok_s = max(prefill_tok_s, prefill_rate)
    return [best[concurrency] for concurrency in sorted(best)], prefill_tok_s


def format_curve(result: CurveResult, rule: KneeRule | None = None) -> list[str]:
    """The curve as a table, then the limits the rule picks from it."""
    from bitserve.bench.report import render_rows

    rule = rule or KneeRule()
    base = sorted(result.points, key=lambda p: p.concurrency)[0]
    rows: list[tuple[str, ...]] = [("concurrency", "tok/s", "ms/step", "ratio to c=1", "decode steps")]
    for point in result.points:
        rows.append(
            (
                str(point.concurrency),
                f"{point.output_tokens_per_s:.1f}",
                f"{point.median_step_ms:.1f}",
                f"{point.output_tokens_per_s / base.output_tokens_per_s:.2f}",
                str(point.num_decode_steps),
            )
        )
    return [
        f"curve: {result.model} (projections {result.weight_format}), offline engine, greedy, "
        "decode steps only",
        *render_rows(rows),
        f"prefill: {result.prefill_tokens} tokens at {result.prefill_tokens_per_s:.1f} tok/s",
        f"rule: gain over the best smaller level >= {rule.min_gain_per_doubling:.0%} per doubling "
        f"and step <= {rule.max_step_ms:.0f} ms; "
        f"budget = power of two of prefill <= {rule.max_prefill_stall_s:g} s, cap {rule.max_budget}",
        f"picked: max_num_seqs {result.max_num_seqs}, max_num_batched_tokens {result.max_num_batched_tokens}",
    ]
