"""MiniCPM (`minicpm`) through the serving path: greedy generation (prefill, one-token decode steps over
the paged KV cache, prompts batched, then again from the prefix cache) equals llama.cpp's golden
continuation of the converted checkpoint (a Llama with MiniCPM's scales: bitserve/testing/hf_checkpoints.py)
up to llama.cpp's near-ties; the three scales are read from the file as llama.cpp derives them."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from bitserve.llm import LLM
from bitserve.testing.teacher_forced import serving_path_disagreements

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
GOLDEN = json.loads((ROOT / "tests" / "fixtures" / "golden" / "coverage.json").read_text(encoding="utf-8"))
CASE = next(c for c in GOLDEN["cases"] if (c["arch"], c["weight_type"]) == ("minicpm", "F32"))


@pytest.mark.parametrize("backend", ["reference", "cpu"])
def test_batched_generation_equals_llamacpp(hf_gguf, backend: str) -> None:  # noqa: ANN001
    hf_model, path = hf_gguf("minicpm")
    config = hf_model.config
    llm = LLM(str(path), backend=backend)
    try:
        spec = llm.instance.loaded.model.spec
        assert spec.embedding_scale == config.scale_emb
        residual_scale = config.scale_depth / math.sqrt(config.num_hidden_layers)
        assert math.isclose(spec.residual_scale, residual_scale, rel_tol=1e-7)  # stored as an f32
        assert spec.logit_scale == config.hidden_size / config.dim_model_base
        assert serving_path_disagreements(llm, CASE["prompts"], GOLDEN["num_tokens"]) == []
    finally:
        llm.close()
