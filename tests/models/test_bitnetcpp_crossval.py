"""Live crossval of bitserve's `bitnetcpp` numerics against bitnet.cpp (`BITNET_CPP=<its bin dir>`).

    BITNET_CPP=/tmp/bitnetcpp/BitNet/build/bin pytest -m crossval tests/models/test_bitnetcpp_crossval.py
    bitserve crossval --bitnet-cpp /tmp/bitnetcpp/BitNet/build/bin

On each small peaked bitnet-b1.58 I2_S file (the golden cases, scripts/make_bitnetcpp_golden.py) and
every prompt, in one of two modes, chosen by what the directory holds:
- `bnc-probe` (a small llama.cpp program built next to bitnet.cpp's binaries: greedy decode from given
  prompt ids, the logits of every position written as f32 rows): greedy tokens equal for 32 tokens, or
  the first divergence where bitnet.cpp's top-2 margin is below 1% of its logit range; logit cosine
  >= 0.9999 at every position up to there (bit-identical logits measured);
- `llama-cli` only (what the shared build script makes): the same token check against llama-cli's
  greedy continuation (`-v` logs every evaluated token id); no logits there, so a divergence is
  allowed where bitserve's own top-2 margin is below 1% (its logits equal bitnet.cpp's in probe mode).

TL2 (TL2_CASES): one-layer files with the 3B projection shapes, the only ones this bitnet.cpp build has
TL2 kernels for (codegen preset bitnet_b1_58-3B, given to bitserve as --tl-config). bitnet.cpp's TL2
matmul computes what its I2_S one does (per-row f32 absmax, 127/amax, RNE, exact integer sums, the
same divide-then-multiply epilogue), but its generated batch kernels (8 or more rows in one ubatch)
write every row's result to the first row's slots, so a prompt of 8+ tokens gives garbage there (with
`-ub 1` llama-cli agrees with bitserve again); TL2 prompts of 8+ tokens are skipped, saying so.
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path
from types import ModuleType

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from repo_scripts import load_script

from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

pytestmark = pytest.mark.crossval
ROOT = Path(__file__).resolve().parents[2]

NEAR_TIE = 0.01
MIN_COSINE = 0.9999
TL2_BATCH_KERNEL_ROWS = 8  # bitnet.cpp's TL2 ubatches of this many rows or more take its broken kernels


@pytest.fixture(scope="module")
def bitnet_cpp() -> tuple[Path, str]:
    """(bin dir, mode): mode "probe" (tokens and logits) or "llama-cli" (tokens only)."""
    location = os.environ.get("BITNET_CPP")
    if not location:
        pytest.skip(
            "no bitnet.cpp given: set BITNET_CPP (or bitserve crossval --bitnet-cpp DIR) to its bin dir"
        )
    script = load_script("make_bitnetcpp_golden")
    if script.probe_binary(location) is not None:
        return Path(location), "probe"
    if script.llama_cli_binary(location) is not None:
        return Path(location), "llama-cli"
    pytest.skip(f"BITNET_CPP={location} holds neither bnc-probe nor llama-cli")


@pytest.fixture(scope="module")
def script() -> ModuleType:
    return load_script("make_bitnetcpp_golden")


def relative_margin(row: np.ndarray) -> float:
    top2 = np.sort(row)[-2:]
    return float((top2[1] - top2[0]) / (row.max() - row.min()))


_GOLDEN = load_script("make_bitnetcpp_golden")
ALL_CASES = _GOLDEN.CASES + _GOLDEN.TL2_CASES


@pytest.mark.parametrize("case_index", range(len(ALL_CASES)), ids=[case.name for case in ALL_CASES])
def test_bitnetcpp_crossval(
    case_index: int, bitnet_cpp: tuple[Path, str], script: ModuleType, smollm2_path: Path, tmp_path: Path
) -> None:
    bin_dir, mode = bitnet_cpp
    case = (script.CASES + script.TL2_CASES)[case_index]
    tokenizer = script.tokenizer_metadata(smollm2_path)
    path = script.write_bitnet_b158(tmp_path / f"{case.name}.gguf", case, tokenizer)
    llm = LLM(str(path), backend="reference", linear_mode="bitnetcpp", tl_config=case.tl_config())
    skipped = []
    try:
        params = SamplingParams(max_tokens=script.NUM_TOKENS, temperature=0.0, ignore_eos=True)
        for text in script.PROMPTS:
            ids = llm.encode(text)
            if case.weight_type == "TL2" and len(ids) >= TL2_BATCH_KERNEL_ROWS:
                skipped.append(text)
                continue
            ours = llm.generate([ids], params)[0].outputs[0].token_ids  # one prompt at a time, as llama-cli
            label = f"[{mode}] {case.name} {text!r}"
            if mode == "probe":
                check_probe(script, bin_dir, path, llm, ids, ours, label)
            else:
                check_llama_cli(script, bin_dir, path, llm, text, ids, ours, label)
    finally:
        llm.close()
    if skipped:
        warnings.warn(
            f"{case.name}: not run on {skipped} (8+ tokens: bitnet.cpp's TL2 batch kernels)", stacklevel=1
        )


def check_probe(
    script: ModuleType, bin_dir: Path, path: Path, llm: LLM, ids: list[int], ours: list[int], label: str
) -> None:
    reference, reference_logits = script.run_bitnetcpp(bin_dir, path, ids, script.NUM_TOKENS)
    first = script.first_divergence(ours, reference)
    if first is not None:
        margin = relative_margin(reference_logits[len(ids) - 1 + first])
        assert margin < NEAR_TIE, f"{label}: step {first} differs, bitnet.cpp's margin {margin:.4f}"
    logits = script.incremental_logits(llm.instance.loaded.model, ids, reference[:-1])
    rows = len(ids) + (first if first is not None else len(reference)) - 1
    reference_rows = torch.from_numpy(np.ascontiguousarray(reference_logits[:rows]))
    cosine = F.cosine_similarity(logits[:rows].double(), reference_rows.double(), dim=1)  # [rows]
    assert cosine.min() >= MIN_COSINE, f"{label}: min logit cosine {cosine.min():.6f}"


def check_llama_cli(
    script: ModuleType,
    bin_dir: Path,
    path: Path,
    llm: LLM,
    text: str,
    ids: list[int],
    ours: list[int],
    label: str,
) -> None:
    prompt, reference = script.run_llama_cli(bin_dir, path, text, script.NUM_TOKENS)
    assert prompt == ids, f"{label}: llama-cli tokenized the prompt as {prompt}, bitserve as {ids}"
    first = script.first_divergence(ours, reference)
    if first is not None:
        # no bitnet.cpp logits here: bitserve's own at that step, fed llama-cli's tokens up to it
        model = llm.instance.loaded.model
        logits = script.incremental_logits(model, ids, reference[:first], prompt_logits=first == 0)
        margin = relative_margin(logits[-1].numpy())
        assert margin < NEAR_TIE, f"{label}: step {first} differs, bitserve's margin {margin:.4f}"
