"""The ternary linear's gated pair epilogue (kernels/cuda/pair_epilogue.py) against the plain kernel.

A [gate | up] weight with interleaved rows must give through its epilogue exactly act(gate) * up of the
plain weight's output, with quantize.py's arithmetic (what Wdown's norm_quantize computed before), on
the GEMV and the GEMM path (split-K too); and the un-permuting generic path of a permuted weight must
still answer in the original row order.
Runs on a CUDA device (`pytest -m gpu`), or in Triton's interpreter with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.cuda.ternary_pack import pack_ternary_planes
from bitserve.kernels.packed import Layout
from bitserve.kernels.reference.ternary import quantize_activations
from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu

DEVICE = kernel_test_device()

from bitserve.kernels.cuda.linears import CudaTernaryLinear  # noqa: E402
from bitserve.kernels.cuda.pair_epilogue import (  # noqa: E402
    GATED_PAIRS,
    PAIR_NONE,
    gated_row_order,
    out_width,
)
from bitserve.kernels.cuda.ternary_gemm import GemmConfig, launch_gemm  # noqa: E402
from bitserve.kernels.cuda.ternary_matmul import (  # noqa: E402
    GEMV_MAX_T,
    GemvConfig,
    launch_gemv,
    ternary_linear,
)

# None: ternary_linear's own choice of path; else an explicit GEMV / GEMM tile config
PATHS = [
    (1, None),
    (3, None),
    (GEMV_MAX_T, GemvConfig(4, 64, 2)),
    (2, GemmConfig(16, 64, 4, 2, 1)),
    (19, GemmConfig(16, 32, 4, 3, 2)),
    (40, None),
]


def _weights(m: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """(values int8 [M, K] in {-1, 0, 1}, scale f32 [M] of three bands with per-row jitter)."""
    values = torch.randint(-1, 2, (m, k), dtype=torch.int8, generator=gen)
    bands = torch.tensor([0.71, 1.93, 0.0137])[torch.arange(m) * 3 // m]
    return values, (bands * (1 + torch.rand(m, generator=gen) / 100)).float()


def _activations(num_tokens: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(num_tokens, k, generator=gen) * torch.logspace(-1, 1, num_tokens)[:, None]
    q, s_act = quantize_activations(x)
    return q.to(DEVICE), s_act.to(DEVICE)


@pytest.mark.parametrize("activation", ["relu2", "silu"])
@pytest.mark.parametrize(("num_tokens", "cfg"), PATHS)
def test_gated_pairs_give_act_gate_times_up(activation: str, num_tokens: int, cfg: object) -> None:
    intermediate, k = 96, 256
    gen = torch.Generator().manual_seed(num_tokens * 7 + len(activation))
    values, scale = _weights(2 * intermediate, k, gen)  # [gate | up]
    q, s_act = _activations(num_tokens, k, gen)
    plain = ternary_linear(q, s_act, pack_ternary_planes(values).to(DEVICE), scale.to(DEVICE)).cpu()
    gate, up = plain[:, :intermediate], plain[:, intermediate:]
    order = gated_row_order(intermediate)
    packed, row_scale = pack_ternary_planes(values[order]).to(DEVICE), scale[order].to(DEVICE)
    pair = GATED_PAIRS[activation]
    out = torch.full((num_tokens, intermediate), float("nan"), device=DEVICE)
    if cfg is None:
        ternary_linear(q, s_act, packed, row_scale, out=out, pair=pair)
    else:
        launch = launch_gemv if isinstance(cfg, GemvConfig) else launch_gemm
        launch(q, s_act, packed, row_scale, None, out, cfg, pair)
    h = out.cpu()
    if activation == "relu2":  # quantize.py's op order: exact
        assert torch.equal(h, (torch.relu(gate) * torch.relu(gate)) * up)
    else:  # the exp of the device (libdevice) or of numpy may differ from torch's by an ulp
        torch.testing.assert_close(h, gate / (1 + torch.exp(-gate)) * up, rtol=2e-6, atol=0)


def test_permuted_weight_answers_in_original_order() -> None:
    """CudaTernaryLinear.permute_rows: the pair path sees interleaved rows, the generic path does not."""
    gen = torch.Generator().manual_seed(3)
    values, scale = _weights(64, 128, gen)
    weight = CudaTernaryLinear(
        64, 128, Layout.TERNARY_2BIT, None, pack_ternary_planes(values).to(DEVICE), scale.to(DEVICE), "cuda"
    )
    q, s_act = _activations(2, 128, gen)
    residual = torch.randn(2, 64, generator=gen).to(DEVICE)
    before = weight.run_quantized(q, s_act, residual).cpu()
    weight.permute_rows(gated_row_order(32))
    assert torch.equal(weight.run_quantized(q, s_act, residual).cpu(), before)
    with pytest.raises(ValueError, match="once"):
        weight.permute_rows(gated_row_order(32))


def test_row_order_and_widths() -> None:
    assert gated_row_order(3).tolist() == [0, 3, 1, 4, 2, 5]
    assert out_width(PAIR_NONE, 7) == 7 and out_width(GATED_PAIRS["silu"], 8) == 4
    with pytest.raises(ValueError, match="even"):
        out_width(GATED_PAIRS["relu2"], 7)
    q = torch.zeros(1, 128, dtype=torch.int8, device=DEVICE)
    packed = torch.zeros(4, 32, dtype=torch.uint8, device=DEVICE)
    ones = torch.ones(4, device=DEVICE)
    relu2 = GATED_PAIRS["relu2"]
    with pytest.raises(ValueError, match="residual"):
        ternary_linear(q, ones[:1], packed, ones, residual=torch.zeros(1, 4, device=DEVICE), pair=relu2)
    with pytest.raises(ValueError, match="out must be"):
        ternary_linear(q, ones[:1], packed, ones, out=torch.zeros(1, 4, device=DEVICE), pair=relu2)
