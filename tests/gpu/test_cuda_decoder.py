"""CudaDecoder (the CUDA backend's compiled forward, kernels/cuda/decoder.py) against the reference
backend's full-sequence forward.

Runs on a CUDA device, or on the CPU in Triton's interpreter (`TRITON_INTERPRET=1`, triton importable):
the same kernels, slowly, so the integration is checked on machines without a GPU.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bitserve.kernels.backend import LinearMode
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.loader.model_loader import LoadOptions, load_model
from bitserve.testing.kernel_device import kernel_test_device
from bitserve.testing.kquant_golden import MIXES, golden_mix_files

pytestmark = pytest.mark.gpu


def kernel_device() -> torch.device:
    return torch.device(kernel_test_device())


def metadata_for(start: int, num_new: int, block_size: int, device: torch.device):  # noqa: ANN201
    """One sequence whose blocks are 0, 1, 2, ... in order; tokens start..start+num_new-1 this step."""
    from bitserve.kernels.attention_metadata import AttentionMetadata

    seq_len = start + num_new
    num_blocks = -(-seq_len // block_size)
    return AttentionMetadata.one_sequence(
        torch.arange(start, seq_len, dtype=torch.int64, device=device),
        torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
        seq_len,
        block_size,
    )


def prefill_then_decode_logits(
    path: Path, kv_dtype: torch.dtype
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(the compiled forward's logits of 7 tokens: a 5-token prefill, then two decode steps over the
    paged cache, the reference backend's full-sequence logits of the same tokens, the CudaDecoder)."""
    return chunked_logits(path, kv_dtype, [5, 900, 17, 4242, 31, 77, 1000], (5, 1, 1))


def chunked_logits(
    path: Path, kv_dtype: torch.dtype, ids: list[int], chunks: tuple[int, ...]
) -> tuple[torch.Tensor, torch.Tensor, object]:
    """(the compiled forward's logits of `ids` run as consecutive steps of `chunks` tokens over one paged
    cache of 4-token blocks: a prefill, chunks over the cached prefix, one-token decode steps; the
    reference backend's full-sequence logits of the same tokens; the CudaDecoder)."""
    device = kernel_device()  # first: skips where neither CUDA nor the interpreter can run Triton
    from bitserve.kernels.cuda.backend import CudaBackend
    from bitserve.kernels.cuda.decoder import CudaDecoder

    assert sum(chunks) == len(ids)
    reference = load_model(path, LoadOptions(backend=ReferenceBackend(), linear_mode=LinearMode.BITNET))
    loaded = load_model(path, LoadOptions(backend=CudaBackend(device), linear_mode=LinearMode.BITNET))
    decoder = loaded.model.compiled  # compiled at load by the cuda backend
    assert isinstance(decoder, CudaDecoder)
    spec = loaded.spec
    block_size = 4
    num_blocks = -(-len(ids) // block_size) + 1
    caches = [
        torch.zeros(
            2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim, dtype=kv_dtype, device=device
        )
        for _ in range(spec.num_layers)
    ]
    got, start = [], 0
    with torch.inference_mode():
        expected = reference.model.compute_logits(reference.model(torch.tensor(ids), torch.arange(len(ids))))
        for size in chunks:
            tokens = torch.tensor(ids[start : start + size], device=device)
            positions = torch.arange(start, start + size, device=device)
            hidden = decoder(tokens, positions, caches, metadata_for(start, size, block_size, device))
            got.append(decoder.compute_logits(hidden).cpu())
            start += size
    reference.close()
    loaded.close()
    return torch.cat(got), expected, decoder


@pytest.mark.parametrize("kv_dtype", [torch.float32, torch.float16])
def test_prefill_then_decode_matches_full_forward(b158_file: Path, kv_dtype: torch.dtype) -> None:
    got, expected, decoder = prefill_then_decode_logits(b158_file, kv_dtype)
    # the ternary gate/up projections write relu2(gate) * up from their epilogue (pair_epilogue.py)
    assert all(layer.gate_pair is not None for layer in decoder.layers)
    # f32 pages: only summation order differs. f16 pages round K and V to 11 significant bits (relative
    # 2^-12 per element), which moves logits of magnitude ~10 by a few 1e-2 (measured max 0.035); the
    # f32-reference argmax must still hold, and test_cuda_engine.py compares f16 tokens with an f16 CPU run
    tolerance = 1e-4 if kv_dtype == torch.float32 else 0.1
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))


# Q8_0's block_gemv steps take ~4 min in Triton's interpreter (its kernel has interpreter tests of its own
# in tests/kernels): on a CUDA device only
ON_DEVICE_ONLY = pytest.mark.skipif(not torch.cuda.is_available(), reason="minutes in the interpreter")


@pytest.mark.parametrize("weight_type", ["F32", pytest.param("Q8_0", marks=ON_DEVICE_ONLY)])
@pytest.mark.parametrize("arch", ["qwen2", "qwen3"])
def test_qkv_biases_and_head_norms_match_the_full_forward(hf_gguf, arch: str, weight_type: str) -> None:  # noqa: ANN001
    """Qwen2's q/k/v biases (added to qkv_out's output) and Qwen3's per-head q/k norms (normed_heads,
    before RoPE) on the dense (cuBLAS) and block (block_gemv) paths: logits of a prefill and decode
    steps equal the reference's full forward within f32 summation-order tolerance."""
    _, path = hf_gguf(arch, weight_type)
    got, expected, decoder = prefill_then_decode_logits(path, torch.float32)
    layer = decoder.layers[0]
    assert (layer.qkv_bias is not None) == (arch == "qwen2") and (layer.q_norm is not None) == (
        arch == "qwen3"
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))


def test_embeddings_on_the_compiled_forward_equal_the_reference(b158_file: Path) -> None:
    """CUDA replicas serve /v1/embeddings from the compiled forward (CudaDecoder.forward_sequence, a
    temporary cache of its own): the pooled vectors equal the reference backend's module forward within
    f32 summation-order tolerance, for a length that fills several blocks and one that is a single token."""
    device = kernel_device()
    from bitserve.kernels.cuda.backend import CudaBackend
    from bitserve.runner.embeddings import CLS, MEAN, embed, module_forward

    reference = load_model(b158_file, LoadOptions(backend=ReferenceBackend(), linear_mode=LinearMode.BITNET))
    loaded = load_model(b158_file, LoadOptions(backend=CudaBackend(device), linear_mode=LinearMode.BITNET))
    decoder = loaded.model.compiled

    def on_device(input_ids: torch.Tensor) -> torch.Tensor:
        return decoder.forward_sequence(input_ids.to(device), torch.float32, 4)

    inputs = [[5, 900, 17, 4242, 31, 77, 1000, 3, 9, 12], [42]]
    for pooling in (MEAN, CLS):
        got = embed(on_device, inputs, pooling, None)
        expected = embed(module_forward(reference.model), inputs, pooling, None)
        torch.testing.assert_close(torch.tensor(got), torch.tensor(expected), rtol=1e-4, atol=1e-5)
    reference.close()
    loaded.close()


@pytest.fixture(scope="module")
def kquant_mix_files(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """The K-quant golden files (llama.cpp's own Q4_K_M / Q5_K_M / Q3_K_M / Q6_K / Q2_K tensors,
    tests/fixtures/golden), rebuilt from their F32 source."""
    pytest.importorskip("transformers")
    fixtures = Path(__file__).resolve().parents[1] / "fixtures" / "golden"
    return golden_mix_files(tokenizer_source, fixtures, tmp_path_factory.mktemp("kquant-cuda"))[1]


@ON_DEVICE_ONLY
@pytest.mark.parametrize("mix", MIXES)
def test_kquant_mixes_run_the_block_gemv_and_match_the_full_forward(kquant_mix_files, mix: str) -> None:  # noqa: ANN001
    """Every K-quant (and Q5_x / Q8_0) projection of llama.cpp's mixes is held in a block GEMV form
    (kernels/cuda/block_layout.py): logits of a prefill and two decode steps equal the reference backend's
    full forward within f32 summation-order tolerance, and so do the argmaxes."""
    from bitserve.kernels.cuda.block_layout import FORMS

    got, expected, decoder = prefill_then_decode_logits(kquant_mix_files[mix], torch.float32)
    blocks = [w for layer in decoder.layers for w in layer.block.values() if w is not None]
    assert blocks and all(w.layout in FORMS for w in blocks)
    assert any(layer.block["down"] is not None for layer in decoder.layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))


@ON_DEVICE_ONLY
def test_eleven_block_formats_in_one_model_match_the_full_forward(
    tokenizer_source: Path, tmp_path: Path
) -> None:
    """bitserve/testing/mixed_formats.py's model (q / k / v of three formats side by side, Q1_0 / Q2_0 /
    Q5_x / Q2_K .. Q6_K): the compiled CUDA forward equals the reference's full forward."""
    pytest.importorskip("transformers")
    from bitserve.testing.mixed_formats import mixed_format_gguf

    got, expected, _ = prefill_then_decode_logits(
        mixed_format_gguf("llama", tokenizer_source, tmp_path), torch.float32
    )
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))


@ON_DEVICE_ONLY
@pytest.mark.parametrize(
    ("arch", "layout"), [("qwen3", None), ("llama", None), ("bitnet", "packed"), ("llama", "packed")]
)
def test_checkpoint_directories_on_the_compiled_forward(
    hf_checkpoint_dir, arch: str, layout: str | None
) -> None:  # noqa: ANN001
    """A Hugging Face checkpoint directory served on CUDA (loader/checkpoint_file.py: the same tensors the
    CPU serves, BitNet packed as I2_S): the compiled forward's prefill and decode logits equal the
    reference backend's full forward of the same directory."""
    _, folder = hf_checkpoint_dir(arch, layout)
    got, expected, _ = prefill_then_decode_logits(folder, torch.float32)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))


GEMMA3_IDS = [5, 900, 17, 4242, 31, 77, 1000, 3, 9, 12, 4000, 250, 60, 8, 321]  # 15 tokens, window 5


@pytest.mark.parametrize("weight_type", ["F32", pytest.param("Q8_0", marks=ON_DEVICE_ONLY)])
@pytest.mark.parametrize(
    "chunks",
    [(9, 1, 1, 1, 1, 1, 1), (3, 6, 4, 1, 1)],
    ids=["prefill-then-decode", "chunks-over-a-prefix"],
)
def test_gemma3_matches_the_full_forward(hf_gguf, weight_type: str, chunks: tuple[int, ...]) -> None:  # noqa: ANN001
    """Gemma 3 (random-init, 6 layers, layers 0-4 sliding over 5 positions with their own RoPE base,
    post-norms, GELU-tanh, sqrt(hidden)-scaled embeddings, per-head q/k norms) on the dense (cuBLAS) and
    block (block_gemv) paths: a prompt longer than the window, chunks over a cached prefix and decode
    steps past the window give the reference backend's full-forward logits within f32 summation-order
    tolerance, and its argmaxes."""
    _, path = hf_gguf("gemma3", weight_type)
    got, expected, decoder = chunked_logits(path, torch.float32, GEMMA3_IDS, chunks)
    assert [layer.window for layer in decoder.layers] == [5, 5, 5, 5, 5, 0]
    assert all(
        layer.attn_post_norm is not None and layer.ffn_post_norm is not None for layer in decoder.layers
    )
    assert decoder.embedding_scale == pytest.approx(8.0)  # sqrt(64)
    sliding_cos, full_cos = decoder.layer_ropes[0][0], decoder.layer_ropes[5][0]
    assert full_cos is decoder.cos and not torch.equal(sliding_cos, full_cos)  # bases 10000 and 1e6
    if weight_type == "Q8_0":
        assert all(layer.block["down"] is not None for layer in decoder.layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))


def test_gemma3_soft_cap_and_logit_scale(hf_gguf) -> None:  # noqa: ANN001
    """A plan's final_logit_softcap caps every logit handed back (compute_logits, and the decode graphs'
    norm_logits_and_argmax, whose argmax is the capped logits'); a logit_scale (MiniCPM) divides them
    first, as the module forward does."""
    import dataclasses

    from bitserve.kernels.cuda.backend import CudaBackend
    from bitserve.kernels.cuda.decoder import CudaDecoder

    device = kernel_device()
    _, path = hf_gguf("gemma3", "F32")
    loaded = load_model(path, LoadOptions(backend=CudaBackend(device), linear_mode=LinearMode.BITNET))
    plan = loaded.model.plan()
    plain, cap = loaded.model.compiled, 0.05  # a cap below the random model's logits: it moves them
    capped = CudaDecoder(dataclasses.replace(plan, final_logit_softcap=cap), torch.device(device))
    hidden = torch.randn(3, plan.final_norm.shape[0], generator=torch.Generator().manual_seed(0)).to(device)
    with torch.inference_mode():
        raw = plain.compute_logits(plain.final_norm(hidden))
        expected = torch.tanh(raw / cap) * cap
        assert not torch.allclose(raw, expected)
        assert torch.equal(capped.compute_logits(capped.final_norm(hidden)), expected)
        logits, tokens = capped.norm_logits_and_argmax(hidden)
        assert torch.equal(logits, expected) and torch.equal(tokens, expected.argmax(dim=1))
        scaled = CudaDecoder(
            dataclasses.replace(plan, logit_scale=2.0, final_logit_softcap=cap), torch.device(device)
        )
        both = torch.tanh(raw / 2.0 / cap) * cap
        assert torch.equal(scaled.compute_logits(scaled.final_norm(hidden)), both)
        assert torch.equal(scaled.norm_logits_and_argmax(hidden)[0], both)
    loaded.close()


@pytest.mark.parametrize(
    "chunks", [(9, 1, 1, 1, 1, 1, 1), (3, 6, 4, 1, 1)], ids=["prefill-then-decode", "chunks-over-a-prefix"]
)
def test_minicpm_matches_the_full_forward(hf_gguf, chunks: tuple[int, ...]) -> None:  # noqa: ANN001
    """MiniCPM (a Llama with embeddings x 0.5, each block's output x 5.66 before its add, logits / 2):
    the compiled forward's logits are the reference backend's full forward's within f32 tolerance."""
    _, path = hf_gguf("minicpm", "F32")
    got, expected, decoder = chunked_logits(path, torch.float32, GEMMA3_IDS, chunks)
    assert decoder.embedding_scale == pytest.approx(0.5) and decoder.logit_scale == pytest.approx(2.0)
    assert all(layer.residual_scale == pytest.approx(8.0 / 2**0.5) for layer in decoder.layers)
    torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)
    assert torch.equal(got.argmax(dim=1), expected.argmax(dim=1))
