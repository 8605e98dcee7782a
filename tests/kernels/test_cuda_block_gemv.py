"""The CUDA block-quantized GEMV (kernels/cuda/block_gemv.py) and CudaBlockLinear against the gguf package's
numpy dequantizer and torch: norm(act(x)) @ W^T + residual within fp32 summation-order error.

Runs on a CUDA device (`pytest -m gpu`), or in Triton's CPU interpreter when TRITON_INTERPRET=1 is set
and no CUDA device exists.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitserve.kernels.cuda.block_layout import FORMS, HELD_AS, block_tile, form_values, repack_for_gemv
from bitserve.kernels.packed import Layout
from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu
DEVICE = kernel_test_device()
gguf = pytest.importorskip("gguf", reason="the gguf package's quantizers are the reference")

from bitserve.kernels.cuda.backend import CudaBackend  # noqa: E402
from bitserve.kernels.cuda.block_gemv import block_gemv  # noqa: E402
from bitserve.kernels.cuda.linears import CudaBlockLinear  # noqa: E402
from bitserve.kernels.packed import PackedWeight  # noqa: E402
from bitserve.layers.activation import GATED_ACTIVATIONS  # noqa: E402

LAYOUTS = [Layout.Q4_0, Layout.Q4_1, Layout.Q8_0]
EPS = 1e-6


def _file_rows(layout: Layout, rows: int, cols: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(uint8 [M, row bytes] as a GGUF file holds them, their f32 [M, K] values from gguf's dequantizer)."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 1.0 / np.sqrt(cols), size=(rows, cols)).astype(np.float32)
    qtype = gguf.GGMLQuantizationType[layout.name]
    blocks = gguf.quants.quantize(values, qtype)
    dense = gguf.quants.dequantize(blocks, qtype).reshape(rows, cols).astype(np.float32)
    return torch.from_numpy(np.ascontiguousarray(blocks)).reshape(rows, -1), torch.from_numpy(dense)


def _reference(
    x: torch.Tensor,
    dense: torch.Tensor,
    norm_weight: torch.Tensor | None,
    activation: str | None,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """The separate ops in f64 on the CPU: act(gate) * up -> RMSNorm -> x @ W^T -> + residual."""
    x = x.double()
    if activation is not None:
        width = x.shape[1] // 2
        x = GATED_ACTIVATIONS[activation](x[:, :width].float(), x[:, width:].float()).double()
    if norm_weight is not None:
        x = x * torch.rsqrt(x.pow(2).mean(dim=1, keepdim=True) + EPS) * norm_weight.double()
    y = x @ dense.double().T
    return y if residual is None else y + residual.double()


def _check(actual: torch.Tensor, expected: torch.Tensor) -> None:
    """Within fp32 summation-order error: 1e-5 of the output's scale (a wrong block, nibble or scale is
    off by the weight's own magnitude, ~1e-1 of it)."""
    scale = expected.abs().max().item()
    torch.testing.assert_close(actual.double().cpu(), expected, rtol=0, atol=1e-5 * scale)


def _device_parts(rows: torch.Tensor, layout: Layout, cols: int) -> dict[str, torch.Tensor]:
    return {name: t.to(DEVICE) for name, t in repack_for_gemv(rows, layout, cols)[1].items()}


@pytest.mark.parametrize("layout", LAYOUTS)
def test_repacked_blocks_hold_the_file_values(layout: Layout) -> None:
    """codes, d (and m) rebuild exactly the values gguf dequantizes."""
    rows, dense = _file_rows(layout, 5, 96, seed=1)
    _, parts = repack_for_gemv(rows, layout, 96)
    torch.testing.assert_close(form_values(parts, 96), dense, rtol=0, atol=0)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("num_rows", "num_cols"), [(37, 96), (130, 576)])
@pytest.mark.parametrize("num_tokens", [1, 3])
def test_block_gemv_matches_the_dequantized_weight(
    layout: Layout, num_rows: int, num_cols: int, num_tokens: int
) -> None:
    rows, dense = _file_rows(layout, num_rows, num_cols, seed=num_rows + num_tokens)
    gen = torch.Generator().manual_seed(num_cols)
    x = torch.randn(num_tokens, num_cols, generator=gen) * 3.0
    y = block_gemv(x.to(DEVICE), _device_parts(rows, layout, num_cols), num_rows)
    assert y.shape == (num_tokens, num_rows) and y.dtype == torch.float32
    _check(y, _reference(x, dense, None, None, None))


@pytest.mark.parametrize("layout", [Layout.Q4_1, Layout.Q8_0])
@pytest.mark.parametrize("activation", [None, "silu", "relu2", "gelu"])
@pytest.mark.parametrize("with_norm", [False, True])
def test_block_gemv_prologue_and_residual(layout: Layout, activation: str | None, with_norm: bool) -> None:
    """The gated activation (x holds gate then up), the RMSNorm and the residual, in the kernel."""
    num_rows, num_cols, num_tokens = 70, 160, 2
    rows, dense = _file_rows(layout, num_rows, num_cols, seed=7)
    gen = torch.Generator().manual_seed(3)
    width = 2 * num_cols if activation is not None else num_cols
    x = torch.randn(num_tokens, width, generator=gen) * 2.0
    norm_weight = torch.rand(num_cols, generator=gen) + 0.5 if with_norm else None
    residual = torch.randn(num_tokens, num_rows, generator=gen)
    y = block_gemv(
        x.to(DEVICE),
        _device_parts(rows, layout, num_cols),
        num_rows,
        norm_weight=None if norm_weight is None else norm_weight.to(DEVICE),
        eps=EPS,
        activation=activation,
        residual=residual.to(DEVICE),
    )
    _check(y, _reference(x, dense, norm_weight, activation, residual))


def test_block_gemv_refuses_steps_past_its_range() -> None:
    rows, _ = _file_rows(Layout.Q8_0, 8, 64, seed=0)
    parts = _device_parts(rows, Layout.Q8_0, 64)
    with pytest.raises(ValueError, match="outside the kernel's range"):
        block_gemv(torch.zeros(5, 64, device=DEVICE), parts, 8)


def test_tile_config_fills_the_grid_and_bounds_the_tile() -> None:
    """A layer: two rows a token (many small programs: more loads in flight at batch 1), K padded to a
    power of two of blocks, 8 warps from 2,048 values. A head: up to 4 rows, 4 warps. A K whose padded
    row alone exceeds the tile has no tile (cuBLAS runs it)."""
    assert block_tile(960, 576) == (2, 32, 4)
    assert block_tile(960, 576, num_tokens=3) == (8, 32, 4)
    assert block_tile(576, 1536) == (2, 64, 8)
    assert block_tile(2560, 8192, num_tokens=4) == (2, 256, 8)
    assert block_tile(49152, 576) == (4, 32, 4)
    assert block_tile(128256, 2560) == (2, 128, 4)
    assert block_tile(64, 32768) is None
    assert block_tile(262144, 8192) is None  # 2^31 values: past the kernel's int32 offsets


def _packed(layout: Layout, rows: torch.Tensor, num_rows: int, num_cols: int) -> PackedWeight:
    return PackedWeight(rows.reshape(-1).contiguous(), (num_rows, num_cols), layout, layout.name)


@pytest.mark.parametrize("num_tokens", [1, 4, 6])
def test_backend_block_linear_stacks_and_falls_back_past_the_gemv(num_tokens: int) -> None:
    """prepare_block keeps Q4_1 packed, fuse_group stacks q/k/v row-wise, and steps of more tokens than the
    GEMV takes run the f32 copy (norm and residual applied the same way)."""
    backend = CudaBackend(DEVICE)
    shapes = [(64, 96), (32, 96), (32, 96)]
    files = [_file_rows(Layout.Q4_1, m, k, seed=i) for i, (m, k) in enumerate(shapes)]
    prepared = [
        backend.prepare_block(_packed(Layout.Q4_1, rows, m, k))
        for (rows, _), (m, k) in zip(files, shapes, strict=True)
    ]
    assert all(isinstance(p, CudaBlockLinear) for p in prepared)
    fused = backend.fuse_group(prepared)  # type: ignore[arg-type]
    assert fused is not None
    stacked, offsets = fused
    assert offsets == [0, 64, 96] and stacked.out_features == 128
    dense = torch.cat([d for _, d in files])
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 96, generator=gen)
    norm_weight = torch.rand(96, generator=gen) + 0.5
    residual = torch.randn(num_tokens, 128, generator=gen)
    y = stacked.run_fused(  # type: ignore[attr-defined]
        x.to(DEVICE), norm_weight.to(DEVICE), EPS, residual=residual.to(DEVICE).clone()
    )
    _check(y, _reference(x, dense, norm_weight, None, residual))
    _check(stacked(x.to(DEVICE)), _reference(x, dense, None, None, None))


def test_backend_block_linear_rejects_a_short_tensor() -> None:
    from bitserve.errors import InvalidModelFile

    rows, _ = _file_rows(Layout.Q4_1, 4, 64, seed=0)
    short = PackedWeight(rows.reshape(-1)[:-1].contiguous(), (4, 64), Layout.Q4_1, "Q4_1")
    with pytest.raises(InvalidModelFile):
        CudaBackend(DEVICE).prepare_block(short)


@pytest.mark.parametrize("form", list(FORMS), ids=lambda form: form.name)
@pytest.mark.parametrize("num_tokens", [1, 3, 6])
def test_every_layout_runs_the_gemv_in_its_form_and_stacks(form: Layout, num_tokens: int) -> None:
    """Every layout a form holds (block_layout.HELD_AS: Q2_0 / Q1_0 / Q4_K in the Q4_1 form, Q2_K / Q3_K with
    scales per 16, Q5_0 as Q8_0, Q5_1 / Q5_K int8 with a min, Q6_K int8 per 16) runs the block GEMV (the f32
    copy past it), with the RMSNorm and the residual; the weights of one form stack into one. Against the
    reference decoders' values."""
    from bitserve.kernels.reference.dequant import dequantize
    from bitserve.testing.block_files import block_file_rows

    backend = CudaBackend(DEVICE)
    prepared, dense = [], []
    for index, layout in enumerate(layout for layout, held in HELD_AS.items() if held is form):
        m, k = 32 * (index + 1), 512
        rows = torch.from_numpy(block_file_rows(layout, m, k, seed=index))
        weight = PackedWeight(rows.reshape(-1).contiguous(), (m, k), layout, layout.name)
        prepared.append(backend.prepare_block(weight))
        dense.append(dequantize(weight))
    assert all(isinstance(p, CudaBlockLinear) and p.layout is form for p in prepared)
    fused = backend.fuse_group(prepared) if len(prepared) > 1 else (prepared[0], [0])  # type: ignore[arg-type]
    assert fused is not None
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, 512, generator=gen)
    norm_weight = torch.rand(512, generator=gen) + 0.5
    residual = torch.randn(num_tokens, fused[0].out_features, generator=gen)
    y = fused[0].run_fused(  # type: ignore[attr-defined]
        x.to(DEVICE), norm_weight.to(DEVICE), EPS, residual=residual.to(DEVICE).clone()
    )
    _check(y, _reference(x, torch.cat(dense), norm_weight, None, residual))
