"""--lm-head q8_0: a float LM head quantized to Q8_0 at load (loader/requantize.py).

The bytes must equal gguf-py's Q8_0 quantizer (an independent implementation of ggml's reference); a model
loaded with the option runs its head on the cpu backend's Q8_0 kernels, and its logits stay close to the
float head's (the quality cost, measured here on a synthetic model with an F16 tied head).
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitserve.config import ModelConfig
from bitserve.errors import UnsupportedModel
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.llm import LLM
from bitserve.loader.requantize import quantize_q8_0
from bitserve.sampling_params import SamplingParams


@pytest.mark.parametrize("layout", [Layout.F16, Layout.F32, Layout.BF16])
def test_bytes_equal_gguf_q8_0(layout: Layout) -> None:
    rng = np.random.default_rng(3)
    values = torch.from_numpy((rng.standard_normal((70, 128)) * 0.07).astype(np.float32))
    values[4, 32:64] = 0.0  # an all-zero block: d = 0, codes 0
    dtype = {Layout.F16: torch.float16, Layout.F32: torch.float32, Layout.BF16: torch.bfloat16}[layout]
    stored = values.to(dtype)
    weight = PackedWeight(stored.view(torch.uint8).reshape(-1).clone(), (70, 128), layout, layout.name)
    ours = quantize_q8_0(weight)
    assert ours.layout is Layout.Q8_0 and ours.shape == (70, 128)
    theirs = gguf.quantize(stored.float().numpy(), gguf.GGMLQuantizationType.Q8_0).reshape(-1)
    np.testing.assert_array_equal(ours.data.numpy(), theirs.view(np.uint8))


def test_refuses_what_it_cannot_quantize() -> None:
    odd = PackedWeight(torch.zeros(4 * 40 * 2, dtype=torch.uint8), (4, 40), Layout.F16, "F16")
    with pytest.raises(UnsupportedModel, match="multiple of 32"):
        quantize_q8_0(odd)
    with pytest.raises(ValueError, match="lm_head"):
        ModelConfig(lm_head="q4_0")


@pytest.fixture(scope="module")
def f16_head_model(tmp_path_factory: pytest.TempPathFactory, tokenizer_source: Path) -> Path:
    from bitserve.testing.synthetic import (
        SyntheticConfig,
        make_weights,
        tokenizer_metadata,
        write_synthetic_model,
    )

    config = SyntheticConfig(embedding_type="F16", seed=5)
    tokenizer = tokenizer_metadata(tokenizer_source)
    weights = make_weights(config, len(tokenizer["tokenizer.ggml.tokens"][1]))
    path = tmp_path_factory.mktemp("f16head") / "bitnet-f16-head.gguf"
    return write_synthetic_model(path, "TQ2_0", config=config, weights=weights, tokenizer=tokenizer)


def test_a_q8_0_head_runs_on_the_block_kernels_and_stays_close(f16_head_model: Path) -> None:
    float_head = LLM(str(f16_head_model), backend="cpu")
    q8_head = LLM(str(f16_head_model), backend="cpu", lm_head="q8_0")
    try:
        head = q8_head.instance.loaded.model.lm_head.weight
        assert head.layout is Layout.Q8_0 and head.backend == "cpu"
        assert isinstance(float_head.instance.loaded.model.lm_head.weight, torch.Tensor)
        ids = float_head.encode("The quick brown fox jumps over the lazy dog, and then")
        logits = []
        for llm in (float_head, q8_head):
            model = llm.instance.loaded.model
            with torch.inference_mode():
                logits.append(model.compute_logits(model(torch.tensor(ids), torch.arange(len(ids)))))
        cosine = F.cosine_similarity(logits[0], logits[1], dim=1)
        assert cosine.min() > 0.999, cosine
        params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
        outputs = [llm.generate([ids], params)[0].outputs[0].token_ids for llm in (float_head, q8_head)]
        assert outputs[0][:4] == outputs[1][:4]
    finally:
        float_head.close()
        q8_head.close()


def test_q8_0_head_needs_block_kernels(f16_head_model: Path) -> None:
    with pytest.raises(UnsupportedModel, match="lm-head q8_0"):
        LLM(str(f16_head_model), backend="reference", lm_head="q8_0")


def _resident_pages(mapping: np.ndarray, offset: int, num_bytes: int) -> int:
    """Pages of [offset, offset + num_bytes) of `mapping` (a GGUFFile's file_bytes(): this model's own
    mapping, not another model's of the same file) that are mapped in now (/proc/self/pagemap's present
    bit, readable without privileges)."""
    start = mapping.ctypes.data
    first, last = (start + offset) // 4096, (start + offset + num_bytes) // 4096
    with open("/proc/self/pagemap", "rb") as pagemap:
        pagemap.seek(first * 8)
        entries = np.frombuffer(pagemap.read((last - first) * 8), dtype=np.uint64)
    return int(np.count_nonzero(entries >> np.uint64(63)))


@pytest.mark.skipif(not Path("/proc/self/pagemap").exists(), reason="needs Linux's /proc/self/pagemap")
def test_a_q8_0_head_gives_back_the_tied_tables_pages(f16_head_model: Path) -> None:
    """The float table leaves the process's RSS once quantized, and embedding lookups read its rows from
    the file (a fault in the mapping would map back a whole page-cache folio per row), bit for bit."""
    float_head = LLM(str(f16_head_model), backend="cpu")
    q8_head = LLM(str(f16_head_model), backend="cpu", lm_head="q8_0")
    try:
        embedding = q8_head.instance.loaded.model.embed_tokens
        assert embedding.read_rows is not None
        assert float_head.instance.loaded.model.embed_tokens.read_rows is None
        info = q8_head.instance.loaded.gguf.tensors["token_embd.weight"]
        assert info.nbytes > 64 * 4096, "the table must span many pages for the check to mean anything"
        ids = torch.tensor([0, 7, 7, 1000, embedding.vocab_size - 1, 3])
        torch.testing.assert_close(
            embedding(ids), float_head.instance.loaded.model.embed_tokens(ids), rtol=0, atol=0
        )
        params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
        q8_head.generate(["The quick brown fox jumps over the lazy dog"], params)
        # the two boundary pages may be shared with neighbouring tensors that are still read in place
        mapping = q8_head.instance.loaded.gguf.file_bytes()
        assert _resident_pages(mapping, info.file_offset, info.nbytes) <= 2
        with pytest.raises(IndexError, match="outside"):
            embedding(torch.tensor([embedding.vocab_size]))
    finally:
        float_head.close()
        q8_head.close()
