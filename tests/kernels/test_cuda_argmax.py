"""Greedy sampling's argmax (kernels/cuda/argmax.py) against torch.argmax: the first index of the
maximum, NaN as the maximum, ties across the programs a row is cut into, and launch after launch (the
arrival counters reset themselves).
Runs on a CUDA device (`pytest -m gpu`), or in Triton's interpreter with TRITON_INTERPRET=1.
"""

from __future__ import annotations

import pytest
import torch

from bitserve.testing.kernel_device import kernel_test_device

pytestmark = pytest.mark.gpu

DEVICE = kernel_test_device()

from bitserve.kernels.cuda.argmax import BLOCK, argmax_rows, cast_argmax_rows  # noqa: E402


def reference(logits: torch.Tensor) -> list[int]:
    return logits.float().cpu().argmax(dim=-1).tolist()


@pytest.mark.parametrize("vocab", [7, BLOCK, BLOCK + 1, 3 * BLOCK + 5, 128256])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_random_rows_match_torch(vocab: int, dtype: torch.dtype) -> None:
    generator = torch.Generator().manual_seed(vocab)
    logits = torch.randn(3, vocab, generator=generator).to(dtype).to(DEVICE)
    assert argmax_rows(logits).tolist() == reference(logits)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_cast_argmax_widens_exactly_and_picks_the_same_rows(dtype: torch.dtype) -> None:
    logits = (torch.randn(2, 2 * BLOCK + 9, generator=torch.Generator().manual_seed(3)) * 30).to(dtype)
    logits[1, [17, BLOCK + 4]] = 500.0  # a tie across parts, exact in every dtype
    widened, ids = cast_argmax_rows(logits.to(DEVICE))
    assert widened.dtype == torch.float32
    assert torch.equal(widened.cpu(), logits.to(torch.float32))
    assert ids.tolist() == reference(logits) and ids.tolist()[1] == 17


def test_ties_take_the_first_index_within_and_across_parts() -> None:
    vocab = 4 * BLOCK
    logits = torch.zeros(4, vocab)
    logits[0, [5, 9]] = 3.0  # within one part
    logits[1, [3 * BLOCK + 1, BLOCK + 7]] = 3.0  # in two parts, the later part written first
    logits[2, :] = float("-inf")  # all -inf: index 0
    logits[3, [2 * BLOCK, 2 * BLOCK + 1]] = 1.0
    logits[3, 2 * BLOCK - 1] = -0.0  # -0.0 equals +0.0 but is below 1.0
    out = argmax_rows(logits.to(DEVICE)).tolist()
    assert out == reference(logits) == [5, BLOCK + 7, 0, 2 * BLOCK]


def test_a_nan_is_the_maximum_and_the_first_nan_wins() -> None:
    logits = torch.randn(2, 3 * BLOCK, generator=torch.Generator().manual_seed(1))
    logits[0, [2 * BLOCK + 3, BLOCK + 9]] = float("nan")
    logits[1, 100] = float("inf")
    assert argmax_rows(logits.to(DEVICE)).tolist() == reference(logits) == [BLOCK + 9, 100]


def test_negative_zero_ties_with_positive_zero_by_index() -> None:
    logits = torch.full((1, 2 * BLOCK), -1.0)
    logits[0, BLOCK + 2] = 0.0
    logits[0, 4] = -0.0
    assert argmax_rows(logits.to(DEVICE)).tolist() == reference(logits) == [4]


def test_launch_after_launch_and_a_strided_row_view() -> None:
    generator = torch.Generator().manual_seed(2)
    for num_rows in (1, 5, 2):  # the same counters, reused; each launch resets them
        logits = torch.randn(num_rows, 2 * BLOCK + 3, generator=generator).to(DEVICE)
        assert argmax_rows(logits).tolist() == reference(logits)
    wide = torch.randn(4, 3 * BLOCK, generator=generator).to(DEVICE)
    rows = wide[1:3, : BLOCK + 11]  # a row stride larger than the width
    assert argmax_rows(rows).tolist() == reference(rows)


def test_outgrown_counters_stay_alive_and_zero() -> None:
    """A launch of more rows than the counters hold makes new ones; the old stay allocated (a captured
    graph points at them) and still read zero, so a replay that uses them starts right."""
    from bitserve.kernels.cuda.argmax import INITIAL_ROWS, Argmax

    argmax = Argmax(torch.device(DEVICE))
    first = argmax._arrivals
    logits = torch.randn(INITIAL_ROWS + 1, 9, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    assert argmax(logits).tolist() == reference(logits)
    assert argmax._arrivals is not first and argmax._outgrown == [first]
    assert int(first.sum()) == 0 and int(argmax._arrivals.sum()) == 0


def test_shapes_it_refuses() -> None:
    with pytest.raises(ValueError, match="unit column stride"):
        argmax_rows(torch.zeros(4, 3, device=DEVICE).t())
    with pytest.raises(ValueError, match="columns"):
        argmax_rows(torch.zeros(2, 0, device=DEVICE))
    assert argmax_rows(torch.zeros(0, 5, device=DEVICE)).tolist() == []
    from bitserve.kernels.cuda.argmax import Argmax

    half = torch.zeros(2, 5, dtype=torch.float16, device=DEVICE)
    with pytest.raises(ValueError, match="widened"):
        Argmax(torch.device(DEVICE))(half, torch.empty_like(half))  # widened must be f32
