"""CpuBackend.prepare_block (packed Q4_0 / Q4_1 / Q8_0 kernels) vs F.linear on the dequantized weight.

Two activation numerics (CpuBackend block_activations, every test runs both where the CPU allows):
- "f32": exact f32 activations; the packed kernels sum in their own fixed f32 order, so outputs must
  agree with F.linear(x, dequantized w) within RTOL of max |y| (fp32 summation-order error ~1e-6 here);
- "q8" (avx2 / vnni): activations rounded to int8 per 32-value block first (blockdot.quantize_block_q8,
  llama.cpp's Q8_1 scheme); the integer dots are exact, so outputs must agree within the same RTOL with
  F.linear(dequantized q8 activations, dequantized w), for every batch size (batches of
  block_gemm_min_tokens or more take the chunked dequantize + sgemm path on those same activations).
On the real SmolLM2 file, greedy tokens of backend "cpu" in f32 mode must equal those of backend
"reference"; the q8 mode is checked against llama.cpp's native Q4_1 run in tests/models.
"""

from __future__ import annotations

from pathlib import Path

import gguf
import numpy as np
import pytest
import torch
import torch.nn.functional as F

from bitserve.kernels.cpu import blockdot
from bitserve.kernels.cpu.backend import CpuBackend
from bitserve.kernels.cpu.isa import Isa, supported_isas
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.reference.dequant import dequantize
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

RTOL = 1e-5
GGML_TYPES = {
    Layout.Q4_0: gguf.GGMLQuantizationType.Q4_0,
    Layout.Q4_1: gguf.GGMLQuantizationType.Q4_1,
    Layout.Q8_0: gguf.GGMLQuantizationType.Q8_0,
}
TOKEN_COUNTS = (1, 2, 3, 7, 8, 33, 64)
# "q8" needs integer-dot kernels; on a generic-only CPU just "f32" runs
ACTIVATIONS = ["f32"] + (["q8"] if supported_isas()[0] is not Isa.GENERIC else [])


def q8_roundtrip(x: torch.Tensor) -> torch.Tensor:
    """x f32 [T, K] -> the values the q8 kernels multiply: int8 codes times their block scale."""
    q, dx, _ = blockdot.quantize_block_q8(x.numpy(), x.shape[0])
    blocks = torch.from_numpy(q).double().view(x.shape[0], -1, blockdot.QK)
    return (blocks * torch.from_numpy(dx).double().unsqueeze(-1)).view(x.shape).float()


def expected_output(backend: CpuBackend, x: torch.Tensor, dense: torch.Tensor) -> torch.Tensor:
    """What backend.linear(x, block weight) computes up to f32 summation order."""
    if backend.block_activations == "q8":  # every batch size: the sgemm path rounds activations too
        return F.linear(q8_roundtrip(x).double(), dense.double()).float()
    return F.linear(x, dense)


def make_weight(layout: Layout, num_rows: int, num_cols: int, seed: int) -> PackedWeight:
    """A random [M, K] weight quantized by gguf-py, as the loader would hand it over."""
    rng = np.random.default_rng(seed)
    dense = (rng.standard_normal((num_rows, num_cols)) * 0.05 + 0.01).astype(np.float32)
    raw = gguf.quants.quantize(dense, GGML_TYPES[layout]).reshape(-1)
    return PackedWeight(torch.from_numpy(raw.copy()), (num_rows, num_cols), layout, layout.name)


def assert_close(actual: torch.Tensor, expected: torch.Tensor) -> None:
    assert actual.dtype == torch.float32 and actual.shape == expected.shape
    scale = expected.abs().max().item()
    err = (actual - expected).abs().max().item()
    assert err <= RTOL * scale, f"max error {err:.3g} > {RTOL} * {scale:.3g}"


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("layout", [Layout.Q4_1, Layout.Q8_0, Layout.Q4_0])
@pytest.mark.parametrize("shape", [(576, 1536), (1536, 576), (37, 64), (130, 96)])
def test_packed_linear_matches_dequantized_dense(
    layout: Layout, shape: tuple[int, int], activations: str
) -> None:
    backend = CpuBackend(block_activations=activations)
    weight = make_weight(layout, *shape, seed=shape[0] * 7 + shape[1])
    prepared = backend.prepare_block(weight)
    assert prepared is not None and prepared.backend == "cpu" and prepared.mode is None
    assert (prepared.out_features, prepared.in_features) == shape
    assert prepared.nbytes < shape[0] * shape[1] * 4 // 2  # really packed, not an f32 copy
    dense = dequantize(weight)  # [M, K]
    gen = torch.Generator().manual_seed(shape[0])
    for num_tokens in TOKEN_COUNTS:
        x = torch.randn(num_tokens, shape[1], generator=gen)
        assert_close(backend.linear(x, prepared), expected_output(backend, x, dense))


@pytest.mark.parametrize("activations", ACTIVATIONS)
def test_linear_group_mixes_packed_and_dense_and_is_batch_invariant(activations: str) -> None:
    backend = CpuBackend(block_activations=activations)
    q4 = make_weight(Layout.Q4_1, 192, 576, seed=1)
    q8 = make_weight(Layout.Q8_0, 64, 576, seed=2)
    weights = [backend.prepare_block(q4), backend.prepare_block(q8), backend.prepare_dense(dequantize(q8))]
    x = torch.randn(5, 576, generator=torch.Generator().manual_seed(3))
    outs = backend.linear_group(x, weights)
    for out, dense in zip(outs, (dequantize(q4), dequantize(q8)), strict=False):
        assert_close(out, expected_output(backend, x, dense))
    assert_close(outs[2], F.linear(x, dequantize(q8)))  # the dense weight runs on f32 activations
    # small-T kernel: each row of the output depends only on its own row of x, in a fixed order
    assert torch.equal(backend.linear(x[2:3], weights[0]), outs[0][2:3])
    assert backend.linear(x[:0], weights[0]).shape == (0, 192)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("layout", [Layout.Q4_1, Layout.Q8_0])
def test_dense_copies_within_the_budget_serve_batched_steps(layout: Layout, activations: str) -> None:
    """With max_dense_weight_bytes, weights get an f32 copy (in load order, while the budget lasts) that
    batches of block_gemm_min_tokens or more multiply; smaller batches still read the packed blocks."""
    shapes = [(96, 128), (64, 128), (32, 128)]
    budget = 4 * (96 + 64) * 128 + 100  # room for the first two only
    backend = CpuBackend(max_dense_weight_bytes=budget, block_activations=activations)
    weights = [make_weight(layout, *shape, seed=10 + i) for i, shape in enumerate(shapes)]
    prepared = [backend.prepare_block(weight) for weight in weights]
    assert ["dense" in p.extras for p in prepared] == [True, True, False]  # type: ignore[union-attr]
    assert backend.dense_bytes_left == 100
    gen = torch.Generator().manual_seed(5)
    for weight, prep in zip(weights, prepared, strict=True):
        assert prep is not None
        if "dense" in prep.extras:
            assert torch.equal(prep.extras["dense"], dequantize(weight))  # decoded exactly as ggml
        for num_tokens in TOKEN_COUNTS:
            x = torch.randn(num_tokens, 128, generator=gen)
            assert_close(backend.linear(x, prep), expected_output(backend, x, dequantize(weight)))
    with pytest.raises(ValueError, match="max_dense_weight_bytes"):
        CpuBackend(max_dense_weight_bytes=-1)


@pytest.mark.parametrize("activations", ACTIVATIONS)
@pytest.mark.parametrize("layout", [Layout.Q4_1, Layout.Q8_0, Layout.Q4_0])
@pytest.mark.parametrize("dense_budget", [0, 1 << 30])
def test_a_stacked_group_equals_its_weights_run_one_by_one(
    layout: Layout, dense_budget: int, activations: str
) -> None:
    """fuse_group (q/k/v, gate/up): one stacked weight; each slice of its output equals the weight run
    alone, bit for bit, for every batch size (rows are computed independently, in the same order)."""
    from bitserve.layers.linear import LinearGroup

    backend = CpuBackend(max_dense_weight_bytes=dense_budget, block_activations=activations)
    weights = [backend.prepare_block(make_weight(layout, rows, 256, seed=rows)) for rows in (256, 64, 100)]
    group = LinearGroup(backend, weights)  # type: ignore[arg-type]
    assert group.row_offsets == [0, 256, 320] and len(group.weights) == 1
    gen = torch.Generator().manual_seed(9)
    for num_tokens in TOKEN_COUNTS:
        x = torch.randn(num_tokens, 256, generator=gen)
        for out, weight in zip(group(x), weights, strict=True):
            assert torch.equal(out, backend.linear(x, weight))  # type: ignore[arg-type]
    mixed = [
        weights[0],
        backend.prepare_block(
            make_weight(Layout.Q4_0 if layout is Layout.Q8_0 else Layout.Q8_0, 64, 256, seed=1)
        ),
    ]
    assert backend.fuse_group(mixed) is None  # type: ignore[arg-type]


def test_unsupported_layouts_and_switches_fall_back_to_dense() -> None:
    weight = make_weight(Layout.Q4_1, 32, 64, seed=4)
    assert ReferenceBackend().prepare_block(weight) is None
    assert CpuBackend(block_kernels=False).prepare_block(weight) is None
    f32 = PackedWeight(torch.zeros(32 * 64 * 4, dtype=torch.uint8), (32, 64), Layout.F32, "F32")
    assert CpuBackend().prepare_block(f32) is None


@pytest.fixture(scope="module")
def smollm2_pair(smollm2_path: Path):  # noqa: ANN201 - yields (reference LLM, cpu LLM)
    reference = LLM(str(smollm2_path), backend="reference")
    cpu = LLM(str(smollm2_path), backend="cpu", block_activations="f32")  # exact f32: equal to the reference
    yield reference, cpu
    reference.close()
    cpu.close()


def test_smollm2_cpu_greedy_tokens_equal_reference(smollm2_pair: tuple[LLM, LLM]) -> None:
    reference, cpu = smollm2_pair
    layouts = _linear_layouts(cpu)
    assert Layout.Q4_1 in layouts and Layout.DENSE not in layouts, layouts  # Q4_1 / Q8_0 stay packed
    assert _linear_layouts(reference) == {Layout.DENSE}
    params = SamplingParams(max_tokens=16, temperature=0.0, ignore_eos=True)
    prompts = ["The capital of France is", "def fibonacci(n):"]
    expected = [out.outputs[0].token_ids for out in reference.generate(prompts, params)]
    actual = [out.outputs[0].token_ids for out in cpu.generate(prompts, params)]
    assert actual == expected


def _linear_layouts(llm: LLM) -> set[Layout]:
    """Runtime layouts of every PreparedLinear held by the model's linear layers."""
    return {
        weight.layout
        for module in llm.instance.loaded.model.modules()
        for weight in getattr(module, "weights", ())
    }
