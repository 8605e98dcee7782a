"""benchmarks/profile_gpu_step.py's step timeline: steps cut at the graph's last kernel, idle gaps, and
what runs outside the layer chain (synthetic GPU events, µs)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from profile_gpu_step import STEP_END_KERNEL, step_timeline  # noqa: E402


def one_step(start: float, chain_kernels: int, head_gap: float) -> list[dict[str, object]]:
    """A step from `start`: a copy after a 3 µs gap, `chain_kernels` back-to-back 1 µs kernels, the head
    after `head_gap`, then the argmax that ends the step."""
    events: list[dict[str, object]] = [{"name": "Memcpy HtoD", "ts": start + 3.0, "dur": 1.0}]
    t = start + 4.0
    for _ in range(chain_kernels):
        events.append({"name": "_gemv_kernel", "ts": t, "dur": 1.0})
        t += 1.0
    events.append({"name": "head", "ts": t + head_gap, "dur": 10.0})
    t += head_gap + 10.0
    events.append({"name": STEP_END_KERNEL, "ts": t, "dur": 2.0})
    return events


def test_steps_idle_time_and_the_operations_outside_the_chain() -> None:
    events, t = [], 0.0
    for head_gap in (0.5, 1.0, 1.5, 2.0, 2.5):  # five steps; the first two are not measured
        step = one_step(t, chain_kernels=40, head_gap=head_gap)
        events += step
        t = float(step[-1]["ts"]) + float(step[-1]["dur"])
    timeline = step_timeline(events)
    assert timeline["steps"] == 3
    # a step: 3 gap + 1 copy + 40 chain + gap + 10 head + 2 argmax; of steps 2-4, the median head gap is 2.0
    assert timeline["period_us_median"] == 3 + 1 + 40 + 2.0 + 10 + 2
    assert timeline["idle_us_median"] == 3 + 2.0
    outside = timeline["outside_chain"]
    assert set(outside) == {"Memcpy HtoD", "head", STEP_END_KERNEL}  # 40 a step is the chain
    assert outside["Memcpy HtoD"] == {"us": 1.0, "gap_before_us": 3.0, "per_step": 1.0}
    assert outside["head"]["gap_before_us"] == 2.0


def test_too_few_steps_to_measure() -> None:
    assert step_timeline(one_step(0.0, 3, 0.0)) == {"steps": 0}
