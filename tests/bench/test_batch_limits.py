"""Format-aware batch limits: the knee rule that picks them from a curve, the per-format table's
resolution at load, and that an operator's explicit value always wins (config, settings, a loaded model)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from bitserve.batch_limits import (
    FORMAT_BATCH_LIMITS,
    GENERIC_BATCH_LIMITS,
    batch_limits_for,
    resolve_batch_limits,
)
from bitserve.bench.curve import CurvePoint, KneeRule, pick_max_num_batched_tokens, pick_max_num_seqs
from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig
from bitserve.engine.instance import ModelInstance, projection_format
from bitserve.server.settings import build_configs


def curve(*rows: tuple[int, float, float]) -> list[CurvePoint]:
    return [CurvePoint(concurrency, 10, tok_s, step_ms) for concurrency, tok_s, step_ms in rows]


# ----------------------------------------------------------------- the knee rule


def test_knee_is_where_doubling_stops_paying() -> None:
    points = curve((1, 10.0, 100.0), (2, 19.0, 105.0), (4, 35.0, 114.0), (8, 37.0, 216.0), (16, 38.0, 420.0))
    assert pick_max_num_seqs(points, KneeRule()) == 4  # 8 gains 6% over 4: below 10%


def test_knee_survives_a_noisy_dip() -> None:
    # 8 is slower than 4 (noise, or a kernel path switch); 16 still beats the best smaller level (4)
    # by 21% over two doublings, so it counts
    points = curve((1, 10.0, 50.0), (2, 18.0, 55.0), (4, 40.0, 100.0), (8, 30.0, 266.0), (16, 60.0, 266.0))
    assert pick_max_num_seqs(points, KneeRule()) == 16
    # at 25% per doubling, 16 would need 40 * 1.25 ** 2 = 62.5 tok/s
    assert pick_max_num_seqs(points, KneeRule(min_gain_per_doubling=0.25)) == 4


def test_knee_stops_at_the_step_latency_cap() -> None:
    points = curve(
        (1, 10.0, 100.0), (2, 20.0, 100.0), (4, 40.0, 100.0), (8, 80.0, 100.0), (16, 160.0, 1200.0)
    )
    assert pick_max_num_seqs(points, KneeRule()) == 8
    assert pick_max_num_seqs(points, KneeRule(max_step_ms=2000.0)) == 16


def test_knee_of_a_flat_curve_is_its_smallest_level_and_order_does_not_matter() -> None:
    points = curve((8, 50.0, 10.0), (2, 50.0, 10.0), (4, 50.0, 10.0))
    assert pick_max_num_seqs(points, KneeRule()) == 2
    with pytest.raises(ValueError):
        pick_max_num_seqs([], KneeRule())


def test_budget_is_the_power_of_two_prefill_that_fits_the_stall() -> None:
    rule = KneeRule(max_prefill_stall_s=1.0, max_budget=2048)
    assert pick_max_num_batched_tokens(700.0, 4, rule) == 512
    assert pick_max_num_batched_tokens(1024.0, 4, rule) == 1024
    assert pick_max_num_batched_tokens(50_000.0, 4, rule) == 2048  # capped
    assert pick_max_num_batched_tokens(30.0, 64, rule) == 64  # never below max_num_seqs


# ----------------------------------------------------------------- the table and its resolution


def test_every_table_row_is_a_valid_pair_and_unknown_formats_get_the_generic_row() -> None:
    assert FORMAT_BATCH_LIMITS, "the per-format table is empty"
    for name, limits in FORMAT_BATCH_LIMITS.items():
        assert name == name.upper()
        SchedulerConfig(
            max_num_seqs=limits.max_num_seqs, max_num_batched_tokens=limits.max_num_batched_tokens
        )
    assert batch_limits_for("no-such-format") == GENERIC_BATCH_LIMITS
    assert batch_limits_for("i2_s") == FORMAT_BATCH_LIMITS["I2_S"]


@pytest.mark.parametrize("fmt", ["I2_S", "Q4_1", "other"])
def test_unset_limits_come_from_the_format_row(fmt: str) -> None:
    resolved = resolve_batch_limits(SchedulerConfig(), fmt)
    limits = batch_limits_for(fmt)
    assert (resolved.max_num_seqs, resolved.max_num_batched_tokens) == (
        limits.max_num_seqs,
        max(limits.max_num_batched_tokens, limits.max_num_seqs),
    )


def test_explicit_values_win_and_the_other_limit_adjusts_to_stay_valid() -> None:
    limits = batch_limits_for("I2_S")
    both = resolve_batch_limits(SchedulerConfig(max_num_seqs=3, max_num_batched_tokens=5), "I2_S")
    assert (both.max_num_seqs, both.max_num_batched_tokens) == (3, 5)
    # an explicit value equal to the old generic default still wins over the table
    seqs = resolve_batch_limits(SchedulerConfig(max_num_seqs=256), "I2_S")
    assert seqs.max_num_seqs == 256 and seqs.max_num_batched_tokens == max(256, limits.max_num_batched_tokens)
    budget = resolve_batch_limits(SchedulerConfig(max_num_batched_tokens=2), "I2_S")
    assert budget.max_num_batched_tokens == 2 and budget.max_num_seqs == min(2, limits.max_num_seqs)
    no_chunking = resolve_batch_limits(
        SchedulerConfig(enable_chunked_prefill=False, max_model_len=4096), "I2_S"
    )
    assert no_chunking.max_num_batched_tokens >= 4096


def test_settings_leave_unset_limits_unset_and_keep_set_ones() -> None:
    engine, _ = build_configs({})
    assert engine.scheduler.max_num_seqs is None and engine.scheduler.max_num_batched_tokens is None
    engine, _ = build_configs({"max_num_seqs": 256})
    assert engine.scheduler.max_num_seqs == 256 and engine.scheduler.max_num_batched_tokens is None


# ----------------------------------------------------------------- applied at model load


@pytest.fixture(scope="module")
def i2s_model(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Path:
    from bitserve.testing.synthetic import (
        SyntheticConfig,
        make_weights,
        tokenizer_metadata,
        write_synthetic_model,
    )

    config = SyntheticConfig(
        num_layers=1, hidden_size=128, intermediate_size=256, num_heads=2, num_kv_heads=2
    )
    tokenizer = tokenizer_metadata(smollm2_path)
    weights = make_weights(config, len(tokenizer["tokenizer.ggml.tokens"][1]))
    path = tmp_path_factory.mktemp("limits") / "tiny-i2s.gguf"
    return write_synthetic_model(path, "I2_S", config=config, weights=weights, tokenizer=tokenizer)


def load(path: Path, scheduler: SchedulerConfig) -> ModelInstance:
    model = ModelConfig(model=str(path), backend="reference")
    return ModelInstance.load(
        EngineConfig(model=model, scheduler=dataclasses.replace(scheduler, max_model_len=64))
    )


def test_a_loaded_model_gets_its_format_row_unless_the_operator_set_the_limits(i2s_model: Path) -> None:
    instance = load(i2s_model, SchedulerConfig())
    try:
        assert projection_format(instance.loaded.gguf) == "I2_S"
        running = instance.engine.scheduler.config
        expected = batch_limits_for("I2_S")
        assert (running.max_num_seqs, running.max_num_batched_tokens) == (
            expected.max_num_seqs,
            expected.max_num_batched_tokens,
        )
        assert instance.scheduler_config == running  # what runs is what the instance reports
        assert instance.config.scheduler.max_num_seqs is None  # the operator's config is never rewritten
    finally:
        instance.close()
    explicit, _ = build_configs({"max_num_seqs": 5, "max_num_batched_tokens": 7})
    instance = load(i2s_model, explicit.scheduler)
    try:
        running = instance.engine.scheduler.config
        assert (running.max_num_seqs, running.max_num_batched_tokens) == (5, 7)
    finally:
        instance.close()
