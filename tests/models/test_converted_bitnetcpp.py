"""bitnet.cpp runs what `bitserve convert` writes: a BitNet checkpoint directory in the 2B-4T release's
layout (packed codes + weight_scale, ReLU², F16 tied embedding), converted to I2_S (`bitnet-b1.58`), against
bitnet.cpp's own llama-cli on the same file (tests/fixtures/bitnetcpp/converted.json, from
scripts/make_converted_bitnetcpp_golden.py; live with BITNET_CPP set). bitnet.cpp tokenizes each prompt as
bitserve does (the tokenizer.json conversion) and its greedy continuation is bitserve's: in the `bitnetcpp`
linear mode (bitnet.cpp's rounding), and in the default `bitnet` mode serving the directory itself, each up
to a near-tie (bitserve's own top-2 margin under 1% of its logit range where the tokens part: llama-cli
gives no logits)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

import numpy as np
import pytest
from repo_scripts import load_script

from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams
from bitserve.testing.teacher_forced import NEAR_TIE

pytest.importorskip("transformers")

ROOT = Path(__file__).resolve().parents[2]
FIXTURE = json.loads(
    (ROOT / "tests" / "fixtures" / "bitnetcpp" / "converted.json").read_text(encoding="utf-8")
)


@pytest.fixture(scope="module")
def converted(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bitserve.testing.hf_checkpoints import converted_bitnet_i2s

    path = converted_bitnet_i2s(tokenizer_source, tmp_path_factory.mktemp("converted-bitnet"))
    assert hashlib.sha256(path.read_bytes()).hexdigest() == FIXTURE["sha256"], (
        "the converted file changed: rerun scripts/make_converted_bitnetcpp_golden.py"
    )
    return path


def _assert_follows(llm: LLM, prompts: list[dict], label: str) -> int:
    """Each prompt's greedy continuation through the engine is bitnet.cpp's, or parts from it where
    bitserve's own top-2 margin (fed bitnet.cpp's tokens up to there) is a near-tie; returns how many
    prompts agreed in full."""
    script = load_script("make_bitnetcpp_golden")
    params = SamplingParams(max_tokens=FIXTURE["num_tokens"], temperature=0.0, ignore_eos=True)
    exact = 0
    for prompt in prompts:
        ids, reference = prompt["prompt_token_ids"], prompt["greedy_token_ids"]
        assert llm.encode(prompt["text"]) == ids, (
            f"{label}: bitnet.cpp tokenized {prompt['text']!r} otherwise"
        )
        ours = list(llm.generate([ids], params)[0].outputs[0].token_ids)  # one at a time, as llama-cli
        first = script.first_divergence(ours, reference)
        if first is None:
            exact += 1
            continue
        model = llm.instance.loaded.model
        row = script.incremental_logits(model, ids, reference[:first], prompt_logits=first == 0)[-1].numpy()
        top2 = np.sort(row)[-2:]
        margin = float((top2[1] - top2[0]) / (row.max() - row.min()))
        assert margin < NEAR_TIE, f"{label} {prompt['text']!r}: step {first} differs, margin {margin:.4f}"
    return exact


def test_bitnetcpp_mode_follows_bitnetcpp_on_the_converted_file(converted: Path) -> None:
    llm = LLM(str(converted), backend="reference", linear_mode="bitnetcpp")
    try:
        assert llm.instance.loaded.spec.architecture == "bitnet-b1.58"
        assert llm.instance.loaded.spec.activation == "relu2"
        # bitnet.cpp's own rounding: every prompt agreed in full when the fixture was made (a C library whose
        # cosf rounds otherwise may move one near-tie)
        assert _assert_follows(llm, FIXTURE["prompts"], "bitnetcpp mode") >= len(FIXTURE["prompts"]) - 1
    finally:
        llm.close()


def test_the_served_directory_follows_bitnetcpp(converted: Path) -> None:
    """The directory itself, served in the default mode on the cpu backend's int8 kernels."""
    llm = LLM(str(converted.parent / "bitnet-packed"), backend="cpu")
    try:
        _assert_follows(llm, FIXTURE["prompts"], "directory, bitnet mode")
    finally:
        llm.close()


@pytest.mark.crossval
def test_live_bitnetcpp_equals_the_fixture(converted: Path) -> None:
    location = os.environ.get("BITNET_CPP")
    if not location:
        pytest.skip("no bitnet.cpp given: set BITNET_CPP to its bin directory (llama-cli)")
    live = load_script("make_converted_bitnetcpp_golden").bitnetcpp_tokens(Path(location), converted)
    assert live == FIXTURE["prompts"]
