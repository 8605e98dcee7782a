"""CUDA ternary kernels (bitserve/kernels/cuda, Triton) against the torch reference: bit-exact.

Runs on a CUDA device (`pytest -m gpu`), or in Triton's CPU interpreter when TRITON_INTERPRET=1 is set
and no CUDA device exists (small shapes only there; the full model shapes need CUDA).
"""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.cuda.ternary_pack import pack_ternary_planes
from bitserve.kernels.reference.ternary import bitnet_epilogue, integer_matmul, quantize_activations
from bitserve.layers.activation import GATED_ACTIVATIONS
from bitserve.layers.norm import RMSNorm
from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu

DEVICE = kernel_test_device()
HAS_CUDA = DEVICE == "cuda"

from bitserve.kernels.cuda.quantize import norm_quantize  # noqa: E402
from bitserve.kernels.cuda.ternary_gemm import GemmConfig, launch_gemm  # noqa: E402
from bitserve.kernels.cuda.ternary_matmul import (  # noqa: E402
    GEMV_MAX_T,
    GemvConfig,
    launch_gemv,
    ternary_linear,
)

cuda_only = pytest.mark.skipif(not HAS_CUDA, reason="full model shapes are too slow in the interpreter")


# ---------------------------------------------------------------- norm_quantize


def _rows(num_tokens: int, width: int, gen: torch.Generator) -> torch.Tensor:
    """f32 [T, width] rows of mixed magnitudes: ordinary, tiny (under the 1e-5 amax floor), large, zero."""
    x = torch.randn(num_tokens, width, generator=gen)
    magnitudes = torch.tensor([1.0, 3e-3, 1e-30, 1e4, 0.0, 17.0, 1e-7, 250.0])
    x *= magnitudes.repeat(num_tokens // len(magnitudes) + 1)[:num_tokens, None]
    x[-1, : width // 2] = 0.0  # a half-zero row
    return x


def _reference_quantize(
    x: torch.Tensor, norm_weight: torch.Tensor | None, eps: float, activation: str | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """The torch path on CPU: act(gate, up) -> RMSNorm -> quantize_activations."""
    if activation is not None:
        k = x.shape[1] // 2
        x = GATED_ACTIVATIONS[activation](x[:, :k], x[:, k:])
    if norm_weight is not None:
        x = RMSNorm(norm_weight, eps)(x)
    return quantize_activations(x)


@pytest.mark.parametrize("k", [256, 768, 2560, 6912, 8320])
@pytest.mark.parametrize("activation", [None, "relu2", "silu"])
@pytest.mark.parametrize("has_norm", [False, True])
def test_norm_quantize_matches_reference(k: int, activation: str | None, has_norm: bool) -> None:
    gen = torch.Generator().manual_seed(k * 7 + (activation is None) * 3 + has_norm)
    width = 2 * k if activation is not None else k
    x = _rows(9, width, gen)
    norm_weight = (torch.rand(k, generator=gen) * 2 - 0.5) if has_norm else None
    eps = 1e-6 if has_norm and k % 512 else 1e-5
    q, s_act = norm_quantize(
        x.to(DEVICE), norm_weight.to(DEVICE) if norm_weight is not None else None, eps, activation=activation
    )
    ref_q, ref_s = _reference_quantize(x, norm_weight, eps, activation)
    assert q.dtype == torch.int8 and q.shape == (9, k) and s_act.dtype == torch.float32
    q, s_act = q.cpu(), s_act.cpu()
    if activation != "silu":
        assert torch.equal(s_act, ref_s)
        assert torch.equal(q, ref_q)
        return
    # NOTE: silu's exp is not correctly rounded anywhere (torch CPU uses Sleef, the GPU libdevice expf,
    # the interpreter numpy): an ulp in exp(-g) moves h by an ulp, which can move s_act by an ulp and
    # flip a q whose product sits at a rounding boundary. The rest of the pipeline is exact.
    assert torch.allclose(s_act, ref_s, rtol=1e-6, atol=0)
    diff = (q.to(torch.int32) - ref_q.to(torch.int32)).abs()
    assert int(diff.max()) <= 1
    assert float((diff == 0).float().mean()) >= 0.99


def test_norm_quantize_writes_preallocated_outputs() -> None:
    x = torch.randn(5, 512).to(DEVICE)
    out_q = torch.full((5, 256), 99, dtype=torch.int8, device=DEVICE)
    out_scale = torch.full((5,), -1.0, device=DEVICE)
    q, s_act = norm_quantize(x, None, 1e-6, activation="relu2", out_q=out_q, out_scale=out_scale)
    assert q is out_q and s_act is out_scale
    ref_q, ref_s = _reference_quantize(x.cpu(), None, 1e-6, "relu2")
    assert torch.equal(out_q.cpu(), ref_q) and torch.equal(out_scale.cpu(), ref_s)


def test_norm_quantize_rejects_bad_inputs() -> None:
    x = torch.randn(2, 256).to(DEVICE)
    with pytest.raises(ValueError, match="activation"):
        norm_quantize(x, None, 1e-6, activation="gelu_tanh")
    with pytest.raises(ValueError, match="norm_weight"):
        norm_quantize(x, torch.ones(128, device=DEVICE), 1e-6)
    with pytest.raises(ValueError, match="contiguous f32"):
        norm_quantize(x.double(), None, 1e-6)
    q, s_act = norm_quantize(x[:0], None, 1e-6)
    assert q.shape == (0, 256) and s_act.shape == (0,)


# ---------------------------------------------------------------- ternary_linear


def _weights(m: int, k: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(values int8 [M, K], packed uint8 [M, K // 4], scale f32 [M]): three row bands of different
    scales (like a stacked q/k/v weight) with per-row jitter, and a sparse band of zeros."""
    values = torch.randint(-1, 2, (m, k), dtype=torch.int8, generator=gen)
    values[: m // 8, : k // 2] = 0
    bands = torch.tensor([0.71, 1.93, 0.0137])[torch.arange(m) * 3 // m]
    scale = bands * (1 + torch.rand(m, generator=gen) * 0.01)
    return values, pack_ternary_planes(values), scale.float()


def _reference_linear(
    q: torch.Tensor,
    s_act: torch.Tensor,
    values: torch.Tensor,
    scale: torch.Tensor,
    residual: torch.Tensor | None,
) -> torch.Tensor:
    """bitnet_epilogue(integer_matmul(q, values), s_act, scale) (+ residual): the exact integer product
    runs in float64 on the kernel's device (exact on either), the epilogue on CPU."""
    d = integer_matmul(q.to(DEVICE), values.to(DEVICE)).cpu()
    y = bitnet_epilogue(d, s_act, scale[None, :])
    return y + residual if residual is not None else y


def _check_linear(m: int, k: int, num_tokens: int, with_residual: bool, seed: int) -> None:
    gen = torch.Generator().manual_seed(seed)
    values, packed, scale = _weights(m, k, gen)
    x = torch.randn(num_tokens, k, generator=gen) * torch.logspace(-2, 2, num_tokens)[:, None]
    q, s_act = quantize_activations(x)
    q[0, :128] = 127  # extremes of the int8 range
    q[-1, 128:256] = -128
    residual = torch.randn(num_tokens, m, generator=gen) if with_residual else None
    out = ternary_linear(
        q.to(DEVICE),
        s_act.to(DEVICE),
        packed.to(DEVICE),
        scale.to(DEVICE),
        residual=residual.to(DEVICE) if residual is not None else None,
    )
    expected = _reference_linear(q, s_act, values, scale, residual)
    assert out.shape == (num_tokens, m) and out.dtype == torch.float32
    out = out.cpu()
    mismatches = int((out != expected).sum())
    assert mismatches == 0, f"{mismatches} of {out.numel()} outputs differ (M={m}, K={k}, T={num_tokens})"


TOKENS = [1, 2, 3, 7, 8, 16, 33, 128]


@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("m", "k"), [(256, 256), (768, 256), (256, 768), (200, 384)])
def test_ternary_linear_small_shapes(m: int, k: int, num_tokens: int) -> None:
    _check_linear(m, k, num_tokens, with_residual=num_tokens % 2 == 1, seed=m + k + num_tokens)


@pytest.mark.parametrize("with_residual", [False, True])
def test_ternary_linear_residual_both_paths(with_residual: bool) -> None:
    for num_tokens in (GEMV_MAX_T, GEMV_MAX_T + 1):
        _check_linear(384, 512, num_tokens, with_residual=with_residual, seed=num_tokens)


def test_gemv_config_overrides_come_first() -> None:
    from bitserve.kernels.cuda import ternary_matmul
    from bitserve.kernels.tuning import KernelTuning

    default = ternary_matmul.gemv_config(3840, 2560, 1)
    tuning = KernelTuning(cuda_gemv_tiles=((3840, 2560, 1, 8, 64, 2), (3840, 2560, 2, 2, 128, 1)))
    overrides = tuning.gemv_overrides()
    assert ternary_matmul.gemv_config(3840, 2560, 1, overrides) == GemvConfig(8, 64, 2) != default
    assert ternary_matmul.gemv_config(3840, 2560, 2, overrides) == GemvConfig(2, 128, 1)  # keyed by T too
    assert ternary_matmul.gemv_config(2560, 2560, 1, overrides) == ternary_matmul.gemv_config(2560, 2560, 1)


@pytest.mark.parametrize(
    ("m", "k", "num_tokens", "cfg"),
    [
        (40, 2560, 1, GemvConfig(4, 128, 1)),  # KW 160: a 32-word tail (the 2B's q|k|v, o, gate/up)
        (48, 2560, 3, GemvConfig(16, 64, 4)),
        (20, 6912, 1, GemvConfig(2, 128, 1)),  # KW 432: a 64-word tail of 48 (the 2B's Wdown)
        (24, 384, 2, GemvConfig(4, 128, 1)),  # KW 24: no whole chunk, the tail alone
        (16, 512, 1, GemvConfig(4, 32, 1)),  # chunks divide KW: no tail
    ],
)
@pytest.mark.parametrize("pair", [False, True])
def test_gemv_tail_is_exact(
    m: int, k: int, num_tokens: int, cfg: GemvConfig, pair: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The last KW % BLOCK_W words as a narrower chunk of their own (gemv_tail), with and without the
    residual, and through the gated pair epilogue."""
    from bitserve.kernels.cuda import ternary_matmul
    from bitserve.kernels.cuda.pair_epilogue import GATED_PAIRS, PAIR_NONE

    expected_tails = [ternary_matmul.gemv_tail(k // 16, cfg.block_w)]
    tails: list[int] = []  # the tail width each launch asked for: the path under test did run
    kernel = ternary_matmul._gemv_kernel

    class Spy:
        def __getitem__(self, grid: tuple[int]):  # noqa: ANN204
            def launch(*args: object, **kwargs: object) -> object:
                tails.append(kwargs["TAIL_W"])  # type: ignore[arg-type]
                return kernel[grid](*args, **kwargs)

            return launch

    monkeypatch.setattr(ternary_matmul, "_gemv_kernel", Spy())
    gen = torch.Generator().manual_seed(m + k + num_tokens)
    values, packed, scale = _weights(m, k, gen)
    q, s_act = quantize_activations(torch.randn(num_tokens, k, generator=gen))
    d = [t.to(DEVICE) for t in (q, s_act, packed, scale)]
    expected = _reference_linear(q, s_act, values, scale, None)
    if pair:  # rows 2p, 2p + 1 are gate and up of pair p: relu2(gate) * up, quantize.py's op order (exact)
        out = torch.full((num_tokens, m // 2), float("nan"), device=DEVICE)
        launch_gemv(*d, None, out, cfg, GATED_PAIRS["relu2"])
        gate, up = expected[:, 0::2], expected[:, 1::2]
        assert torch.equal(out.cpu(), (torch.relu(gate) * torch.relu(gate)) * up)
        assert tails == expected_tails and (tails[0] > 0) == (k != 512)
        return
    residual = torch.randn(num_tokens, m, generator=gen)
    out = torch.full((num_tokens, m), float("nan"), device=DEVICE)
    launch_gemv(*d, residual.to(DEVICE), out, cfg, PAIR_NONE)
    assert torch.equal(out.cpu(), expected + residual)
    assert tails == expected_tails and (tails[0] > 0) == (k != 512)


@pytest.mark.parametrize(
    ("num_tokens", "cfg"),
    [
        (1, GemvConfig(1, 128, 1)),
        (5, GemvConfig(4, 64, 2)),
        (GEMV_MAX_T, GemvConfig(4, 256, 2)),
        (2, GemmConfig(16, 64, 4, 2, 1)),
        (17, GemmConfig(16, 32, 4, 3, 2)),
        (40, GemmConfig(32, 64, 4, 3, 4)),
    ],
)
def test_every_path_and_split_is_exact(num_tokens: int, cfg: GemvConfig | GemmConfig) -> None:
    """Both paths at T the heuristics would not send them, odd row counts, explicit split-K."""
    gen = torch.Generator().manual_seed(num_tokens)
    values, packed, scale = _weights(200, 512, gen)
    q, s_act = quantize_activations(torch.randn(num_tokens, 512, generator=gen))
    residual = torch.randn(num_tokens, 200, generator=gen)
    out = torch.full((num_tokens, 200), float("nan"), device=DEVICE)
    launch = launch_gemv if isinstance(cfg, GemvConfig) else launch_gemm
    launch(q.to(DEVICE), s_act.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), residual.to(DEVICE), out, cfg)
    assert torch.equal(out.cpu(), _reference_linear(q, s_act, values, scale, residual))


@cuda_only
@pytest.mark.parametrize("num_tokens", TOKENS)
@pytest.mark.parametrize(("m", "k"), [(3840, 2560), (2560, 6912), (13824, 2560), (2560, 2560)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_ternary_linear_model_shapes(m: int, k: int, num_tokens: int, with_residual: bool) -> None:
    _check_linear(m, k, num_tokens, with_residual=with_residual, seed=m * 3 + k + num_tokens)


def test_ternary_linear_writes_out_in_place() -> None:
    gen = torch.Generator().manual_seed(5)
    values, packed, scale = _weights(256, 256, gen)
    for num_tokens in (2, 24):
        q, s_act = quantize_activations(torch.randn(num_tokens, 256, generator=gen))
        out = torch.full((num_tokens, 256), float("nan"), device=DEVICE)
        result = ternary_linear(q.to(DEVICE), s_act.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), out=out)
        assert result is out
        assert torch.equal(out.cpu(), _reference_linear(q, s_act, values, scale, None))
        if not HAS_CUDA:
            continue  # the interpreter copies each argument to the host separately: no aliasing there
        # in place on the residual stream: out may be the residual itself
        residual = torch.randn(num_tokens, 256, generator=gen)
        stream = residual.to(DEVICE)
        ternary_linear(
            q.to(DEVICE), s_act.to(DEVICE), packed.to(DEVICE), scale.to(DEVICE), stream, out=stream
        )
        assert torch.equal(stream.cpu(), _reference_linear(q, s_act, values, scale, residual))


def test_ternary_linear_rejects_bad_operands() -> None:
    q = torch.zeros(2, 256, dtype=torch.int8, device=DEVICE)
    s_act = torch.ones(2, device=DEVICE)
    packed = torch.zeros(8, 64, dtype=torch.uint8, device=DEVICE)
    scale = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="packed width"):
        ternary_linear(q, s_act, packed[:, :32].contiguous(), scale)
    with pytest.raises(ValueError, match="scale"):
        ternary_linear(q, s_act, packed, torch.ones((), device=DEVICE))
    with pytest.raises(ValueError, match="multiple of 128"):
        ternary_linear(q[:, :64].contiguous(), s_act, packed[:, :16].contiguous(), scale)
    with pytest.raises(ValueError, match="residual"):
        ternary_linear(q, s_act, packed, scale, residual=torch.zeros(2, 4, device=DEVICE))
    assert ternary_linear(q[:0], s_act[:0], packed, scale).shape == (0, 8)


@cuda_only
def test_kernels_replay_in_a_cuda_graph() -> None:
    """Warm-up first, then capture quantize + linear (GEMV and GEMM) and replay on new inputs."""
    gen = torch.Generator().manual_seed(11)
    values, packed, scale = _weights(2560, 2560, gen)
    packed, scale_d = packed.cuda(), scale.cuda()
    norm_weight = torch.rand(2560, generator=gen).cuda()
    for num_tokens in (1, 64):
        x = torch.randn(num_tokens, 2560, generator=gen).cuda()
        res = torch.randn(num_tokens, 2560, generator=gen).cuda()

        def step(x: torch.Tensor = x, res: torch.Tensor = res) -> torch.Tensor:
            q, s_act = norm_quantize(x, norm_weight, 1e-5)
            return ternary_linear(q, s_act, packed, scale_d, residual=res)

        step()  # compiles the kernels outside the capture
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = step()
        x.copy_(torch.randn(num_tokens, 2560, generator=gen).cuda())
        graph.replay()
        torch.cuda.synchronize()
        q, s_act = _reference_quantize(x.cpu(), norm_weight.cpu(), 1e-5, None)
        assert torch.equal(out.cpu(), _reference_linear(q, s_act, values, scale, res.cpu()))
