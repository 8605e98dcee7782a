"""One set of random ternary weights stored in seven formats (llama.cpp's Q2_0 among them: a BitNet model in
it runs as ternary codes with one scale, loader/model_loader.linear) must run identically in bitserve."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitserve.kernels.select import available_backends
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

PROMPTS = ["Hello world, this is", "1 2 3 4 5 6", "Ternary weights are {-1, 0, +1}; émigré 東京 🙂"]
GREEDY = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)


def prompt_logits(llm: LLM, text: str) -> torch.Tensor:
    model = llm.instance.loaded.model
    ids = torch.tensor(llm.encode(text))
    with torch.inference_mode():
        return model.compute_logits(model(ids, torch.arange(len(ids))))


@pytest.fixture(scope="module")
def reference_results(synthetic_models: dict[str, Path]) -> dict[str, tuple[list[list[int]], torch.Tensor]]:
    results = {}
    for fmt, path in synthetic_models.items():
        llm = LLM(str(path), backend="reference")
        tokens = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        results[fmt] = (tokens, prompt_logits(llm, PROMPTS[2]))
        llm.close()
    return results


@pytest.mark.parametrize("fmt", ["TQ1_0", "TQ2_0", "I2_S", "TL1", "TL2", "Q2_0"])
def test_every_format_matches_f32_bit_for_bit(reference_results, fmt: str) -> None:  # noqa: ANN001
    f32_tokens, f32_logits = reference_results["F32"]
    tokens, logits = reference_results[fmt]
    assert tokens == f32_tokens
    assert len(tokens[0]) == GREEDY.max_tokens
    # same ternary codes and scale -> the same integer matmuls -> identical logits
    assert torch.equal(logits, f32_logits)


def test_tokens_are_not_degenerate(reference_results) -> None:  # noqa: ANN001
    tokens, logits = reference_results["F32"]
    assert len({tuple(t) for t in tokens}) == len(PROMPTS), "different prompts should continue differently"
    assert torch.isfinite(logits).all()


@pytest.mark.parametrize("backend", [b for b in available_backends() if b != "reference"])
@pytest.mark.parametrize("fmt", ["I2_S", "TQ2_0", "Q2_0"])
def test_fast_backend_matches_reference(synthetic_models, reference_results, backend: str, fmt: str) -> None:  # noqa: ANN001
    llm = LLM(str(synthetic_models[fmt]), backend=backend)
    try:
        tokens = [out.outputs[0].token_ids for out in llm.generate(PROMPTS, GREEDY)]
        assert tokens == reference_results[fmt][0]
    finally:
        llm.close()
