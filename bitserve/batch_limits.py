"""Format-aware batch limits: the defaults of SchedulerConfig's max_num_seqs / max_num_batched_tokens by the
projections' GGUF type and the device, filled in at load where the operator set neither (engine/instance.py).
Defaults like config.py's, apart from it for size; torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from bitserve.core.scheduling_config import SchedulerConfig


# Defaults of SchedulerConfig.max_num_seqs / max_num_batched_tokens by the projections' GGUF type, used
# at load when the operator set neither (None). Measured with `bitserve bench --curve` and picked by
# bench.curve.KneeRule; curves and commands in benchmarks/RESULTS.md ("Format-aware batch limits").
@dataclass(frozen=True, slots=True)
class BatchLimits:
    max_num_seqs: int
    max_num_batched_tokens: int


GENERIC_BATCH_LIMITS = BatchLimits(max_num_seqs=256, max_num_batched_tokens=2048)  # formats not measured
# 2026-11-26, 2-vCPU AMD EPYC, 2 threads (RESULTS.md has the curves). The rule: max_num_seqs is the largest
# concurrency whose tok/s beat the fastest smaller level by >= 10% per doubling, median step <= 1 s;
# max_num_batched_tokens the largest power of two of prefill that runs in <= 1 s. I2_S, TQ1_0, TQ2_0, TL1
# and TL2 are repacked at load into one runtime ternary layout, so they run the same kernels: one row,
# from the three measured curves pooled (TL1 / TL2 share it unmeasured). F16 means float (non-ternary)
# F16 projections on the dense path; Q4_1 is SmolLM2-135M's.
_TERNARY_LIMITS = BatchLimits(max_num_seqs=128, max_num_batched_tokens=1024)
FORMAT_BATCH_LIMITS: dict[str, BatchLimits] = {
    **dict.fromkeys(("I2_S", "TQ1_0", "TQ2_0", "TL1", "TL2"), _TERNARY_LIMITS),
    "Q4_1": BatchLimits(max_num_seqs=128, max_num_batched_tokens=512),
    "F16": BatchLimits(max_num_seqs=32, max_num_batched_tokens=512),
}


# On a GPU a step of 256 decodes costs little more than one (the weights are read once per step), and
# prefill chunks of a few thousand tokens keep the tensor cores busy: one row for every format.
CUDA_BATCH_LIMITS = BatchLimits(max_num_seqs=256, max_num_batched_tokens=4096)


def batch_limits_for(weight_format: str, device_type: str = "cpu") -> BatchLimits:
    """The measured limits of a projection format ("I2_S", "Q4_1", ...) on CPU, else
    GENERIC_BATCH_LIMITS; CUDA_BATCH_LIMITS on a CUDA device."""
    if device_type == "cuda":
        return CUDA_BATCH_LIMITS
    return FORMAT_BATCH_LIMITS.get(weight_format.upper(), GENERIC_BATCH_LIMITS)


def resolve_batch_limits(
    scheduler: SchedulerConfig, weight_format: str, device_type: str = "cpu"
) -> SchedulerConfig:
    """`scheduler` with unset (None) limits filled from the format's table row; set values always win.

    When only one limit is set, the other is adjusted so the pair stays valid (the budget must cover
    max_num_seqs decodes; without chunked prefill it must hold a whole max_model_len sequence).
    """
    limits = batch_limits_for(weight_format, device_type)
    max_num_seqs, budget = scheduler.max_num_seqs, scheduler.max_num_batched_tokens
    if max_num_seqs is None:
        max_num_seqs = limits.max_num_seqs if budget is None else min(limits.max_num_seqs, budget)
    if budget is None:
        budget = max(limits.max_num_batched_tokens, max_num_seqs)
        if not scheduler.enable_chunked_prefill:
            budget = max(budget, scheduler.max_model_len)
    return replace(scheduler, max_num_seqs=max_num_seqs, max_num_batched_tokens=budget)
