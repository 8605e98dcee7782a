"""bitserve against llama.cpp on the 2026 coverage cases (fixtures from scripts/make_coverage_golden.py):
the qwen2 / qwen3 / llama / gemma3 / minicpm architectures converted from transformers checkpoints (minicpm:
a Llama checkpoint with MiniCPM's three scales), a BitNet checkpoint (SiLU, as llama.cpp's `bitnet` graph
runs) converted to TQ2_0, and llama.cpp's 1- and
2-bit weight types Q1_0 / Q2_0, byte for byte and token for token.

Tokens are teacher-forced: at every position of llama.cpp's prompt + greedy continuation, bitserve's
argmax must be llama.cpp's, except at llama.cpp's own near-ties (top-2 margin under 1% of the logit
range): llama.cpp runs Q1_0 / Q2_0 on Q8_0-quantized activations where bitserve's f32 path does not
(measured max |diff| ~1% of the range), and its f32 sums in another order."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import numpy as np
import pytest
import torch
from repo_scripts import load_script

from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.dequant import dequantize
from bitserve.llm import LLM
from bitserve.loader.low_bit_quantize import QUANTIZERS
from bitserve.testing.teacher_forced import logit_range_error, teacher_forced_misses

ROOT = Path(__file__).resolve().parents[2]
FIXTURES = ROOT / "tests" / "fixtures" / "golden"
GOLDEN = json.loads((FIXTURES / "coverage.json").read_text(encoding="utf-8"))
CASES = [(case["arch"], case["weight_type"]) for case in GOLDEN["cases"]]
# bitserve's logit range (max - min) at each position against llama.cpp's: F32 files agree to ~1e-6 of it
# (gemma3 8e-4: llama.cpp's GELU reads an f16 table), Q1_0 / Q2_0 to 0.6% (llama.cpp's Q8_0 activations);
# a logit scale or soft-cap missed moves it by tens of percent (MiniCPM's logit_scale is 2 here)
MAX_RANGE_ERROR = 0.01


def _fixture_case(arch: str, weight_type: str) -> dict:
    return next(c for c in GOLDEN["cases"] if (c["arch"], c["weight_type"]) == (arch, weight_type))


@pytest.mark.parametrize("name", ["q1_0", "q2_0"])
def test_low_bit_quantizers_write_llamacpp_bytes(name: str) -> None:
    golden = np.load(FIXTURES / "low_bit_formats.npz")
    assert np.array_equal(QUANTIZERS[name.upper()](golden["x"]), golden[f"{name}_bytes"])


def test_q2_0_codes_round_as_c_roundf_at_half_the_scale() -> None:
    """Values at exactly +-d / 2: their f32 product with 1 / d (rounded down for most d) is +-0.49999997,
    which C's roundf takes to 0 (code 1). An emulation by floor(|s| + 0.5) took it to +-1, its f32 sum
    being 1.0; llama.cpp's own Q2_0 requantization of SmolLM2's Q4_1 weights, whose values sit at d / 2
    of many blocks, showed it. The expected codes round the same f32 products in f64, where |s| + 0.5 is
    exact."""
    rng = np.random.default_rng(2)
    x = (rng.standard_normal((64, 64)) * 0.3).astype(np.float32)
    amax = np.abs(x).max(axis=1)
    x[:, 5], x[:, 9] = -amax / 2, amax / 2  # exact halves of each block's scale
    qs = QUANTIZERS["Q2_0"](x).reshape(64, 18)[:, 2:]
    codes = np.stack([(qs >> (2 * k)) & 3 for k in range(4)], axis=2).reshape(64, 64)
    scaled = x * (np.float32(1.0) / amax)[:, None]  # f32, as w * id in C
    roundf = np.sign(scaled) * np.floor(np.abs(scaled.astype(np.float64)) + 0.5)
    np.testing.assert_array_equal(codes, np.clip(roundf + 1, 0, 3))
    assert (codes[:, 5] == 1).any() and (codes[:, 5] == 0).any()  # products just under 0.5, and at it


@pytest.mark.parametrize("name", ["q1_0", "q2_0"])
def test_low_bit_dequantize_equals_llamacpp_bit_for_bit(name: str) -> None:
    golden = np.load(FIXTURES / "low_bit_formats.npz")
    data = torch.from_numpy(golden[f"{name}_bytes"].copy())
    weight = PackedWeight(data, golden["x"].shape, Layout[name.upper()], name.upper())
    values = dequantize(weight).numpy()
    assert np.array_equal(values.view(np.uint32), golden[f"{name}_values"].view(np.uint32))
    if name == "q2_0":
        assert (values[4, :64] > values[4, :64].max() / 2 * 1.5).any()  # code 3: the +2 d value occurs


@pytest.mark.parametrize("backend", ["reference", "cpu"])
@pytest.mark.parametrize(("arch", "weight_type"), CASES)
def test_teacher_forced_tokens_equal_llamacpp(hf_gguf, arch: str, weight_type: str, backend: str) -> None:  # noqa: ANN001
    case = _fixture_case(arch, weight_type)
    _, path = hf_gguf(arch, weight_type)
    sha = hashlib.sha256(path.read_bytes()).hexdigest()
    assert sha == case["sha256"], "the converted file changed: rerun scripts/make_coverage_golden.py"
    llm = LLM(str(path), backend=backend)
    try:
        decisive, compared, wrong = teacher_forced_misses(llm, GOLDEN["prompts"], case["prompts"])
        assert not wrong, f"{arch} {weight_type}: (prompt, position) {wrong}"
        assert decisive >= compared // 2  # most positions are decisive: the check is not vacuous
        assert logit_range_error(llm, GOLDEN["prompts"], case["prompts"]) <= MAX_RANGE_ERROR
    finally:
        llm.close()


@pytest.mark.crossval
def test_live_llamacpp_equals_committed_coverage_fixtures(tmp_path: Path, smollm2_path: Path) -> None:
    """Regenerate both fixtures with the installed llama.cpp: tokens, argmax and bytes must be the
    committed ones (margins are informative floats)."""
    pytest.importorskip("llama_cpp")
    load_script("make_coverage_golden").main(tmp_path)
    live = json.loads((tmp_path / "coverage.json").read_text(encoding="utf-8"))
    for live_case, case in zip(live["cases"], GOLDEN["cases"], strict=True):
        assert live_case["sha256"] == case["sha256"]
        for live_prompt, prompt in zip(live_case["prompts"], case["prompts"], strict=True):
            assert {k: live_prompt[k] for k in ("ids", "continuation", "argmax")} == {
                k: prompt[k] for k in ("ids", "continuation", "argmax")
            }
    live_npz, golden = np.load(tmp_path / "low_bit_formats.npz"), np.load(FIXTURES / "low_bit_formats.npz")
    for key in golden.files:
        assert np.array_equal(live_npz[key], golden[key]), key
