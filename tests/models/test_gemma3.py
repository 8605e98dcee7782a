"""Gemma 3 (`gemma3`) through the serving path: greedy generation (prefill, then one-token decode steps
over the paged KV cache, several prompts batched, again from the prefix cache) equals llama.cpp's golden
continuation of the converted random-init checkpoint (tests/fixtures/golden/coverage.json), up to
llama.cpp's own near-ties. Its sliding window (5 positions, bitserve/testing/hf_checkpoints.py) is shorter
than every prompt + continuation, so the decode steps' windowed attention is what is checked; the module
forward's full-sequence path is checked against llama.cpp in test_coverage_golden.py and against
transformers in test_hf_architectures.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from bitserve.llm import LLM
from bitserve.testing.teacher_forced import serving_path_disagreements

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "golden" / "coverage.json").read_text(encoding="utf-8"))
CASE = next(c for c in GOLDEN["cases"] if (c["arch"], c["weight_type"]) == ("gemma3", "F32"))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_batched_generation_equals_llamacpp(hf_gguf, backend: str) -> None:  # noqa: ANN001
    _, path = hf_gguf("gemma3")
    llm = LLM(str(path), backend=backend)
    try:
        spec = llm.instance.loaded.model.spec
        assert spec.sliding_window == 5 and spec.sliding_layers == (0, 1, 2, 3, 4)
        assert min(len(case["ids"]) for case in CASE["prompts"]) > spec.sliding_window
        assert serving_path_disagreements(llm, CASE["prompts"], GOLDEN["num_tokens"]) == []
    finally:
        llm.close()


def test_the_window_changes_the_answer(hf_gguf) -> None:  # noqa: ANN001
    """The comparisons could not pass with the window ignored: transformers' logits with every layer
    attending to the whole context differ from the windowed ones by far more than their tolerances."""
    hf_model, _ = hf_gguf("gemma3")
    token_ids = CASE["prompts"][0]["ids"] + CASE["prompts"][0]["continuation"]
    with torch.inference_mode():
        windowed = hf_model(torch.tensor([token_ids])).logits[0]
        hf_model.config.sliding_window = 4096
        try:
            full = hf_model(torch.tensor([token_ids])).logits[0]
        finally:
            hf_model.config.sliding_window = 5
    moved = (windowed - full).abs().max().item()
    assert moved > 0.05 * (windowed.max() - windowed.min()).item()
