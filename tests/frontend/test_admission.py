"""Admission: every user error a step would otherwise meet is refused before the engine sees it."""

from __future__ import annotations

import pytest

from bitserve.errors import ContextLengthExceeded, InvalidRequest
from bitserve.frontend.admission import check_request
from bitserve.sampling_params import SamplingParams


def check(prompt: list[int], params: SamplingParams | None = None, *, max_model_len: int = 16) -> None:
    check_request(prompt, params or SamplingParams(), max_model_len=max_model_len, vocab_size=100)


def test_a_prompt_that_fits_with_max_tokens_unset_is_admitted() -> None:
    check([1] * 15)  # one slot of room left: max_tokens unset runs to the end of the context
    check([1] * 10, SamplingParams(max_tokens=6))


@pytest.mark.parametrize(
    ("prompt", "params", "param"),
    [
        ([], SamplingParams(), "prompt"),
        ([1] * 16, SamplingParams(), "prompt"),  # no room for one output token
        ([1] * 10, SamplingParams(max_tokens=7), "max_tokens"),  # 10 + 7 > 16
        ([1, 100], SamplingParams(), "prompt"),  # outside the vocabulary
        ([1, -1], SamplingParams(), "prompt"),
        ([1], SamplingParams(logit_bias={100: 1.0}), "logit_bias"),
        ([1], SamplingParams(stop_token_ids=[100]), "stop_token_ids"),
    ],
)
def test_refusals_name_the_field(prompt: list[int], params: SamplingParams, param: str) -> None:
    with pytest.raises(InvalidRequest) as caught:
        check(prompt, params)
    assert caught.value.param == param


def test_context_overflow_is_context_length_exceeded_with_the_room_left() -> None:
    with pytest.raises(ContextLengthExceeded, match="at most 6"):
        check([1] * 10, SamplingParams(max_tokens=7))
