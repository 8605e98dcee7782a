"""Live crossval of bitserve's `bitnetcpp` numerics against bitnet.cpp (`BITNET_CPP=<its bin dir>`).

    BITNET_CPP=/tmp/bitnetcpp/BitNet/build/bin pytest -m crossval tests/models/test_bitnetcpp_crossval.py

The directory must hold `bnc-probe`, a small llama.cpp program built next to bitnet.cpp's binaries
(greedy decode from given prompt ids, the logits of every position written as f32 rows; see
scripts/make_bitnetcpp_golden.py). On each small peaked bitnet-b1.58 I2_S file (the golden cases) and
every prompt: greedy tokens equal for 32 tokens, or the first divergence is where bitnet.cpp's top-2
margin is below 1% of its logit range; logit cosine >= 0.9999 at every position up to there.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

pytestmark = pytest.mark.crossval
ROOT = Path(__file__).resolve().parents[2]

NEAR_TIE = 0.01
MIN_COSINE = 0.9999


def load_script() -> ModuleType:
    """scripts/make_bitnetcpp_golden.py as a module (registered first: its dataclasses need it)."""
    name = "make_bitnetcpp_golden"
    if name not in sys.modules:
        spec = importlib.util.spec_from_file_location(name, ROOT / "scripts" / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return sys.modules[name]


@pytest.fixture(scope="module")
def bitnet_cpp() -> Path:
    location = os.environ.get("BITNET_CPP")
    if not location:
        pytest.skip("no bitnet.cpp given: set BITNET_CPP to the bin directory holding bnc-probe")
    script = load_script()
    if script.probe_binary(location) is None:
        pytest.skip(f"BITNET_CPP={location} has no bnc-probe (build it next to llama-cli)")
    return Path(location)


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script()


@pytest.mark.parametrize("case_index", range(len(load_script().CASES)))
def test_bitnetcpp_crossval(
    case_index: int, bitnet_cpp: Path, script: ModuleType, smollm2_path: Path, tmp_path: Path
) -> None:
    case = script.CASES[case_index]
    tokenizer = script.tokenizer_metadata(smollm2_path)
    path = script.write_bitnet_b158(tmp_path / f"{case.name}.gguf", case, tokenizer)
    llm = LLM(str(path), backend="reference", linear_mode="bitnetcpp")
    try:
        params = SamplingParams(max_tokens=script.NUM_TOKENS, temperature=0.0, ignore_eos=True)
        for text in script.PROMPTS:
            ids = llm.encode(text)
            reference, reference_logits = script.run_bitnetcpp(bitnet_cpp, path, ids, script.NUM_TOKENS)
            ours = llm.generate([ids], params)[0].outputs[0].token_ids  # one prompt at a time, as llama-cli
            steps = reference_logits[len(ids) - 1 :]  # [num_tokens, vocab]
            first = script.first_divergence(ours, reference)
            if first is not None:
                top2 = np.sort(steps[first])[-2:]
                margin = (top2[1] - top2[0]) / (steps[first].max() - steps[first].min())
                assert margin < NEAR_TIE, f"{case.name} {text!r}: step {first} differs, margin {margin:.4f}"
            logits = script.incremental_logits(llm.instance.loaded.model, ids, reference[:-1])
            rows = len(ids) + (first if first is not None else len(reference)) - 1
            reference_rows = torch.from_numpy(np.ascontiguousarray(reference_logits[:rows]))
            cosine = F.cosine_similarity(logits[:rows], reference_rows, dim=1)  # [rows]
            assert cosine.min() >= MIN_COSINE, f"{case.name} {text!r}: min logit cosine {cosine.min():.6f}"
    finally:
        llm.close()
