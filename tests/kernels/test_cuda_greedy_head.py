"""The greedy head (kernels/cuda/greedy_head.py): the argmax of an F16 / BF16 head's logits from an int8 copy
plus the exact logits of the rows that could reach the maximum, against float64 logits rounded to the
head's dtype; ties, near-ties the int8 copy cannot order, NaN and non-finite rows.
Runs on a CUDA device (`pytest -m gpu`), or in Triton's interpreter with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu

DEVICE = kernel_test_device()

from bitserve.kernels.cuda.argmax import cast_argmax_rows  # noqa: E402
from bitserve.kernels.cuda.greedy_head import (  # noqa: E402
    GreedyHead,
    error_factor,
    quantize_rows,
    supports_hidden,
)

VOCAB, HIDDEN = 2000, 256


def _head(dtype: torch.dtype, seed: int = 0, vocab: int = VOCAB, hidden: int = HIDDEN) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return (torch.randn(vocab, hidden, generator=generator) * 0.05).to(dtype)


def _inputs(rows: int, dtype: torch.dtype, seed: int = 1, hidden: int = HIDDEN) -> torch.Tensor:
    return torch.randn(rows, hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)


def _exact(weight: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """float64 logits [n, V] of the head's own values."""
    return x.double() @ weight.double().T


def _rounded(logits: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """float64 logits rounded to the head's dtype as the kernel stores them, widened to f32. Triton 3.6's
    interpreter truncates f32 -> bf16 where a GPU rounds to nearest: there the reference truncates too."""
    if dtype == torch.bfloat16 and DEVICE == "cpu":
        bits = logits.float().view(torch.int32) & -65536  # keep the top 16 bits: sign, exponent, 7 of 23
        return bits.view(torch.float32)
    return logits.to(dtype).float()


def _greedy(weight: torch.Tensor, x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    head = GreedyHead(weight.to(DEVICE))
    logits = head(x.to(DEVICE))
    _, ids = cast_argmax_rows(logits)
    return logits.cpu(), ids.tolist()


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 2])
def test_argmax_matches_the_full_head_and_few_rows_are_scored(dtype: torch.dtype, rows: int) -> None:
    weight, x = _head(dtype), _inputs(rows, dtype)
    logits, ids = _greedy(weight, x)
    rounded = _rounded(_exact(weight, x), dtype)
    assert ids == rounded.argmax(dim=1).tolist()
    scored = torch.isfinite(logits.float())
    # the candidates' logits are the head's, rounded to its dtype (f32 sums in another order than float64:
    # at most one rounding step apart)
    step = {torch.float16: 2**-10, torch.bfloat16: 2**-7, torch.float32: 2**-20}[dtype]
    assert torch.allclose(logits.float()[scored], rounded[scored], rtol=step, atol=1e-6)
    # the int8 bound prunes: a handful of rows out of 2,000 are scored exactly, not the whole head
    assert int(scored.sum(dim=1).max()) < VOCAB // 20
    # and every row within a rounding step of the maximum is among them
    top = rounded.max(dim=1, keepdim=True).values
    assert bool(scored[rounded >= top - top.abs() * 2**-6].all())


def test_identical_rows_tie_to_the_first_index() -> None:
    weight, x = _head(torch.float16), _inputs(1, torch.float16)
    best = int(_exact(weight, x).argmax())
    weight[[7, 1500]] = weight[best].clone()  # three equal rows: the first (7) wins, as torch.argmax
    _, ids = _greedy(weight, x)
    assert ids == [7]


def test_rows_the_int8_copy_cannot_order_are_scored_exactly() -> None:
    """Two rows whose int8 copies are equal but whose F16 logits differ (5.0 and 5.3, well apart in F16):
    the exact rescoring of both picks the larger, wherever it lies."""
    weight = _head(torch.float16, seed=3)
    weight[:, 1] *= 0.01  # column 1 carries the logits below: the other rows' stay near 0
    x = torch.full((1, HIDDEN), 0.001, dtype=torch.float16)
    x[0, 0], x[0, 1] = 0, 100
    row = torch.full((HIDDEN,), 0.01, dtype=torch.float16)
    row[0] = 1.27  # the row's absmax: its int8 step is 0.01
    for low, high in ((11, 900), (900, 11)):
        weight[low], weight[high] = row, row
        weight[low, 1], weight[high, 1] = 0.05, 0.053  # both 5 steps in the int8 copy
        q, _ = quantize_rows(weight)
        assert torch.equal(q[low], q[high])  # indistinguishable to the approximate pass
        _, ids = _greedy(weight, x)
        assert ids == [high] == _exact(weight, x).to(torch.float16).float().argmax(dim=1).tolist()


def test_nan_input_gives_the_full_heads_first_nan() -> None:
    weight, x = _head(torch.float16), _inputs(2, torch.float16)
    x[1, 5] = float("nan")
    logits, ids = _greedy(weight, x)
    assert torch.isnan(logits[1].float()).all()  # every row scored: all NaN, as the full head's
    assert ids == [int(_exact(weight, x[:1]).argmax()), 0]  # torch.argmax: the first NaN


def test_zero_input_scores_every_row_and_picks_the_first() -> None:
    weight, x = _head(torch.float16), torch.zeros(1, HIDDEN, dtype=torch.float16)
    logits, ids = _greedy(weight, x)
    assert ids == [0] and bool((logits.float() == 0).all())


@pytest.mark.parametrize("vocab", [VOCAB, 2001])
def test_one_head_rescores_every_launch_afresh(vocab: int) -> None:
    """Launches of one head share its scratch (the approximate logits, the candidate lists). Before each
    launch the lists are filled with the input's worst row (never a candidate) and the approximate logits
    with NaN (a NaN row is always a candidate): a launch that read either from an earlier launch would
    score that row or too many. An all-candidates launch (a zero input: every row, many 16-row tiles a
    program, a partial last tile at 2,001 rows) and launches with few after it each give their input's
    argmax, their worst row -inf, and only a handful of rows scored."""
    weight = _head(torch.float16, vocab=vocab)
    head = GreedyHead(weight.to(DEVICE))
    zeros = torch.zeros(2, HIDDEN, dtype=torch.float16)
    for x in (zeros, _inputs(2, torch.float16), _inputs(1, torch.float16, seed=7), zeros[:1]):
        exact = _exact(weight, x)
        worst = exact.argmin(dim=1)
        head._candidate_rows.fill_(int(worst[0]))
        head._approx.fill_(float("nan"))
        out = head(x.to(DEVICE))
        _, ids = cast_argmax_rows(out)  # on the head's device (a CUDA kernel on a GPU)
        logits = out.cpu().float()
        rounded = _rounded(exact, torch.float16)
        assert ids.tolist() == rounded.argmax(dim=1).tolist()
        scored = torch.isfinite(logits).sum(dim=1).tolist()
        if x.any():
            assert max(scored) < vocab // 20
            assert logits[0, worst[0]] == float("-inf")
        else:
            assert scored == [vocab] * x.shape[0] and bool((logits == 0).all())


def test_a_row_holding_an_infinity_is_always_scored() -> None:
    weight, x = _head(torch.float16), _inputs(1, torch.float16)
    weight[42, 3] = float("inf")
    q, scales = quantize_rows(weight)
    assert scales[42] == float("inf") and not q[42].any()
    logits, ids = _greedy(weight, x)
    expected = _exact(weight, x).to(torch.float16).float()
    assert logits[0, 42].float() == expected[0, 42]  # +-inf, as the full head's
    assert ids == expected.argmax(dim=1).tolist()


def test_quantized_rows_lie_within_half_a_step() -> None:
    weight = _head(torch.bfloat16)
    weight[3] = 0
    q, scales = quantize_rows(weight)
    assert q.dtype == torch.int8 and int(q.abs().max()) == 127 and scales[3] == 0
    error = (weight.double() - scales.double()[:, None] * q.double()).abs()
    # half a step, and the f32 division's rounding (127 units of 2^-24 of a step): error_factor's slack
    assert bool((error <= scales.double()[:, None] * (0.5 + 127 * 2.0**-24)).all())
    assert 0.5 < error_factor(2560) < 0.6
    # a row so small that its scale would be subnormal in f32 is scored exactly every step (s = inf)
    tiny = torch.full((1, HIDDEN), 1e-37, dtype=torch.float32)
    assert quantize_rows(tiny)[1].tolist() == [float("inf")]


def test_rows_past_the_launch_limit_and_unsupported_widths_are_refused() -> None:
    head = GreedyHead(_head(torch.float16).to(DEVICE))
    with pytest.raises(ValueError, match="rows"):
        head(_inputs(3, torch.float16).to(DEVICE))
    with pytest.raises(ValueError, match="contiguous"):
        head(_inputs(1, torch.float32).to(DEVICE))
    assert supports_hidden(2560) and supports_hidden(4096)
    assert not supports_hidden(576) and not supports_hidden(5120)  # SmolLM2's width; past MAX_HIDDEN
    with pytest.raises(ValueError, match="hidden size"):
        GreedyHead(_head(torch.float16, hidden=576).to(DEVICE))


@pytest.mark.skipif(DEVICE != "cuda", reason="the 2B head's size: GPU only")
def test_the_2b_head_matches_cublas() -> None:
    """128,256 x 2,560 F16 (the 2B-4T head): the greedy head's argmax is cuBLAS's over many inputs."""
    weight = (torch.randn(128256, 2560, device=DEVICE) * 0.02).half()
    head = GreedyHead(weight)
    for seed in range(8):
        x = torch.randn(2, 2560, generator=torch.Generator().manual_seed(seed)).half().to(DEVICE)
        _, expected = cast_argmax_rows(torch.nn.functional.linear(x, weight))
        _, ids = cast_argmax_rows(head(x))
        assert ids.tolist() == expected.tolist()
        assert int(head.candidates(x).max()) < 128256 // 50
