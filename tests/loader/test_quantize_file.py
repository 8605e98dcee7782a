"""loader/quantize_file.py (`bitserve quantize`): a GGUF's projections rewritten in Q1_0 / Q2_0.

The reference is the converter's own Q1_0 / Q2_0 file of the same checkpoint (loader/hf_convert.py, whose
quantizers write llama.cpp's bytes: tests/models/test_coverage_golden.py): quantizing its F32 twin must give
every projection the same bytes, keep every other tensor and key, and load and generate."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from bitserve.cli.main import main
from bitserve.llm import LLM
from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.quantize_file import FILE_TYPES, PROJECTION, quantize_gguf
from bitserve.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def wide_checkpoint_files(
    tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory
) -> dict[str, Path]:
    """The wide random qwen3 checkpoint (every projection's input a multiple of 128) as F32, Q2_0, Q1_0."""
    pytest.importorskip("transformers")
    from bitserve.loader.hf_convert import write_gguf
    from bitserve.testing.hf_checkpoints import checkpoint_config, random_checkpoint
    from bitserve.testing.synthetic import tokenizer_metadata

    folder = tmp_path_factory.mktemp("quantize")
    tokenizer = tokenizer_metadata(tokenizer_source)
    model = random_checkpoint("qwen3", len(tokenizer["tokenizer.ggml.tokens"][1]), wide=True)
    config, state = checkpoint_config(model), model.state_dict()
    return {
        weight_type: write_gguf(
            folder / f"{weight_type}.gguf", config, state, tokenizer, weight_type=weight_type
        )
        for weight_type in ("F32", "Q2_0", "Q1_0")
    }


@pytest.mark.parametrize("target", ["Q2_0", "Q1_0"])
def test_projections_get_the_converters_bytes_and_the_rest_is_kept(
    wide_checkpoint_files: dict[str, Path], tmp_path: Path, target: str
) -> None:
    out = quantize_gguf(wide_checkpoint_files["F32"], tmp_path / "out.gguf", target)
    assert out.rewritten and all(PROJECTION.match(name) for name in out.rewritten)
    with (
        read_gguf(out.path) as ours,
        read_gguf(wide_checkpoint_files[target]) as converted,
        read_gguf(wide_checkpoint_files["F32"]) as source,
    ):
        assert set(ours.tensors) == set(source.tensors)
        for name, info in ours.tensors.items():
            expected = converted if name in out.rewritten else source
            assert info.ggml_type == expected.tensors[name].ggml_type, name
            assert np.array_equal(ours.tensor_data(name), expected.tensor_data(name)), name
        assert ours.metadata["general.file_type"] == FILE_TYPES[target]
        assert set(ours.metadata) == set(source.metadata) | {"general.file_type"}
        for key, value in source.metadata.items():
            assert np.array_equal(np.asarray(ours.metadata[key]), np.asarray(value)), key
            assert ours.value_types[key] == source.value_types[key], key
    assert len(out.rewritten) == 2 * 7  # every projection of both layers
    llm = LLM(str(out.path), backend="cpu")
    try:
        result = llm.generate("Hello", SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
        assert len(result[0].outputs[0].token_ids) == 4
    finally:
        llm.close()


def test_cli_reports_what_it_wrote_and_refuses_a_file_with_nothing_to_rewrite(
    wide_checkpoint_files: dict[str, Path], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    target = tmp_path / "q2.gguf"
    assert main(["quantize", str(wide_checkpoint_files["F32"]), str(target), "--type", "Q2_0", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["rewritten"] == 14 and report["bytes"] == target.stat().st_size
    assert set(report["kept"].values()) == {"not a projection"}
    again = tmp_path / "again.gguf"
    assert main(["quantize", str(target), str(again), "--type", "Q2_0"]) == 2  # every projection already Q2_0
    assert "no projection could be written as Q2_0" in capsys.readouterr().err
    assert not again.exists()
