"""models/cpu_fast_decode.py: the lean decode step against the module forward it stands in for.

Each decode step runs both ways from the same KV cache (snapshotted and restored) and their logits must be
equal to the bit: the two forwards make the same operations with the same kernels (the q8 mode's module
forward uses the fast step's SiLU for this reason: with int8 activations a last-bit difference anywhere
flips a rounding that later layers amplify, to cosine ~0.996 here with torch's SiLU). Greedy tokens are
then compared with llama.cpp's native Q4_1 run (the golden fixture).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bitserve.kernels.cpu.isa import BLOCK_ACTIVATIONS_ENV_VAR, Isa, supported_isas
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

pytestmark = pytest.mark.skipif(supported_isas()[0] is Isa.GENERIC, reason="needs the avx2 or vnni kernels")
GOLDEN = Path(__file__).resolve().parent.parent / "fixtures" / "golden" / "smollm2.json"
NATIVE_NEAR_TIE = 1.5  # as tests/models/test_llamacpp_golden.py: llama.cpp's own rounding noise


@pytest.fixture(scope="module")
def smollm2_q8(smollm2_path: Path) -> LLM:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BLOCK_ACTIVATIONS_ENV_VAR, "q8")
        llm = LLM(str(smollm2_path), backend="cpu")
    yield llm
    llm.close()


def test_fast_step_logits_match_the_module_forward(smollm2_q8: LLM) -> None:
    model = smollm2_q8.instance.loaded.model
    runner = smollm2_q8.engine.runner
    fast = model.fast_decode
    assert fast is not None
    forward_logits = runner.forward_logits
    compared: list[int] = []

    def both_ways(requests):  # noqa: ANN001, ANN202 - the runner's own signature
        snapshot = [cache.clone() for cache in runner.kv_caches]
        model.fast_decode = None
        module_logits = forward_logits(requests)
        for cache, saved in zip(runner.kv_caches, snapshot, strict=True):
            cache.copy_(saved)
        model.fast_decode = fast
        fast_logits = forward_logits(requests)
        if all(len(r.token_ids) == 1 for r in requests):
            compared.append(len(requests))
        assert torch.equal(fast_logits, module_logits)  # prefill steps run the module forward either way
        return fast_logits

    runner.forward_logits = both_ways
    try:
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        smollm2_q8.generate(["The capital of France is", "def add(a, b):", "Once upon a time"], params)
        smollm2_q8.generate(["Hello"], params)
    finally:
        runner.forward_logits = forward_logits
    assert 3 in compared and 1 in compared  # batched and single decode steps both took the fast path


def test_fast_step_is_built_only_for_the_q8_mode(smollm2_path: Path) -> None:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv(BLOCK_ACTIVATIONS_ENV_VAR, "f32")
        llm = LLM(str(smollm2_path), backend="cpu")
    try:
        assert llm.instance.loaded.model.fast_decode is None
    finally:
        llm.close()


def test_greedy_tokens_follow_llamacpp_native_q4_1(smollm2_q8: LLM) -> None:
    """Every greedy divergence from llama.cpp on the Q4_1 file starts at a near-tie of its logits (the
    criterion tests/models/test_llamacpp_golden.py applies to the exact-f32 reference). Measured here:
    agreeing prefixes of 253 of 640 tokens in q8 mode, 299 in f32 mode: rounding activations as llama.cpp
    does (but keeping the scales in f32, and an f32 KV cache) does not by itself follow its greedy path."""
    golden = json.loads(GOLDEN.read_text(encoding="utf-8"))
    cases = golden["references"]["native"]
    params = SamplingParams(max_tokens=golden["num_tokens"], temperature=0.0, ignore_eos=True)
    outputs = smollm2_q8.generate([case["prompt_token_ids"] for case in cases], params)
    for index, (case, output) in enumerate(zip(cases, outputs, strict=True)):
        ours, theirs = output.outputs[0].token_ids, case["greedy_token_ids"]
        first = next((i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b), None)
        if first is not None:
            assert case["greedy_margins"][first] < NATIVE_NEAR_TIE, (
                f"prompt {index} diverges at a clear choice"
            )
