"""bitserve against llama.cpp on its own K-quant mixes (fixtures from scripts/make_kquant_golden.py): a small
random llama checkpoint requantized by llama_model_quantize to Q4_K_M, Q5_K_M, Q3_K_M, Q6_K and Q2_K (Q2_K,
Q3_K, Q4_K, Q5_K and Q6_K tensors), each file rebuilt here from the F32 conversion and the tensors llama.cpp
wrote.

Teacher-forced: at every position of llama.cpp's prompt + greedy continuation (its F32 KV cache), bitserve's
argmax must be llama.cpp's, except at llama.cpp's own near-ties (top-2 margin under 1% of the logit
range), on the cpu backend in its default activations (q8: per-32 int8 blocks, where llama.cpp rounds the
K-quants' inputs per 256 values) and in ggml mode (llama.cpp's own rounding), and on the reference
backend (f32 activations). Then greedy decoding (the one-call step) gives llama.cpp's continuation up
to its first near-tie."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams
from bitserve.testing.kquant_golden import MIXES, golden_mix_files
from bitserve.testing.teacher_forced import NEAR_TIE, teacher_forced_misses

FIXTURES = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
GOLDEN = json.loads((FIXTURES / "kquant.json").read_text(encoding="utf-8"))
PROMPTS = ["The capital of France is Paris, and", "def add(a, b):\n    return", "émigré 東京 🙂 1 2 3"]


@pytest.fixture(scope="module")
def mix_files(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    pytest.importorskip("transformers")
    sha, files = golden_mix_files(tokenizer_source, FIXTURES, tmp_path_factory.mktemp("kquant"))
    assert sha == GOLDEN["source_sha256"], "the F32 conversion changed: rerun scripts/make_kquant_golden.py"
    return files


def _first_near_tie(expected: dict) -> int:
    """Index in the continuation of llama.cpp's first near-tie (len if none)."""
    start = len(expected["ids"]) - 1  # the position whose argmax is continuation[0]
    for index in range(len(expected["continuation"])):
        if expected["margins"][start + index] < NEAR_TIE * expected["ranges"][start + index]:
            return index
    return len(expected["continuation"])


@pytest.mark.parametrize(
    ("backend", "activations"), [("cpu", "auto"), ("cpu", "ggml"), ("reference", "auto")]
)
@pytest.mark.parametrize("mix", MIXES)
def test_teacher_forced_tokens_equal_llamacpp(
    mix_files: dict[str, Path], mix: str, backend: str, activations: str
) -> None:
    llm = LLM(str(mix_files[mix]), backend=backend, block_activations=activations)
    try:
        decisive, compared, wrong = teacher_forced_misses(llm, PROMPTS, GOLDEN["mixes"][mix]["prompts"])
        assert not wrong, f"{mix}: (prompt, position) {wrong}"
        assert decisive >= compared // 2  # most positions are decisive: the check is not vacuous
    finally:
        llm.close()


@pytest.mark.parametrize("mix", MIXES)
def test_the_one_call_step_generates_llamacpps_continuation(mix_files: dict[str, Path], mix: str) -> None:
    """Greedy decoding through the cpu backend's compiled step (the mixed-format one where the mix has
    several formats) gives llama.cpp's tokens up to llama.cpp's first near-tie."""
    llm = LLM(str(mix_files[mix]), backend="cpu")
    try:
        assert llm.instance.loaded.model.compiled is not None  # Q3_K too: as Q6_K records
        for expected in GOLDEN["mixes"][mix]["prompts"]:
            agree = _first_near_tie(expected)
            params = SamplingParams(
                max_tokens=len(expected["continuation"]), temperature=0.0, ignore_eos=True
            )
            tokens = llm.generate(expected["ids"], params)[0].outputs[0].token_ids
            assert list(tokens[:agree]) == expected["continuation"][:agree], mix
    finally:
        llm.close()


@pytest.mark.crossval
def test_live_llamacpp_equals_committed_kquant_fixtures(tmp_path: Path) -> None:
    """Regenerate the fixtures with the installed llama.cpp: the tensors it writes, its tokens and argmax
    must be the committed ones (margins are informative floats)."""
    pytest.importorskip("llama_cpp")
    from repo_scripts import load_script

    load_script("make_kquant_golden").main(tmp_path)
    live = json.loads((tmp_path / "kquant.json").read_text(encoding="utf-8"))
    assert live["source_sha256"] == GOLDEN["source_sha256"]
    for mix in MIXES:
        assert live["mixes"][mix]["types"] == GOLDEN["mixes"][mix]["types"]
        for live_prompt, prompt in zip(
            live["mixes"][mix]["prompts"], GOLDEN["mixes"][mix]["prompts"], strict=True
        ):
            keys = ("ids", "continuation", "argmax")
            assert {k: live_prompt[k] for k in keys} == {k: prompt[k] for k in keys}
    live_npz, golden = np.load(tmp_path / "kquant_tensors.npz"), np.load(FIXTURES / "kquant_tensors.npz")
    assert sorted(live_npz.files) == sorted(golden.files)
    for key in golden.files:
        assert np.array_equal(live_npz[key], golden[key]), key
