"""SamplingParams: every bound (just inside accepted, just outside refused naming the field), NaN /
inf, type checks, normalisation of stop / stop_token_ids / logit_bias, validate_for_vocab, frozen."""

from __future__ import annotations

import dataclasses
import math
import re

import pytest

from bitserve.errors import InvalidRequest
from bitserve.sampling_params import SamplingParams

# field → (values just inside the bounds, values just outside)
BOUNDS: dict[str, tuple[list[object], list[object]]] = {
    "n": ([1, 16], [0, 17]),
    "max_tokens": ([1, 1_000_000], [0, 1_000_001]),
    "temperature": ([0, 0.0, 1, 2.0], [-1e-9, 2.000001]),
    "top_p": ([1e-9, 1, 1.0], [0.0, 1.0000001]),
    "top_k": ([0, 1, 1_000_000], [-1, 1_000_001]),
    "min_p": ([0, 0.0, 1.0], [-1e-9, 1.0000001]),
    "presence_penalty": ([-2, -2.0, 2.0], [-2.0000001, 2.0000001]),
    "frequency_penalty": ([-2.0, 2], [-2.0000001, 2.0000001]),
    "repetition_penalty": ([1e-9, 10, 10.0], [0, 0.0, 10.000001]),
    "seed": ([0, 2**63 - 1, None], [-1, 2**63]),
    "logprobs": ([0, 20, None], [-1, 21]),
}
FLOAT_FIELDS = [
    "temperature",
    "top_p",
    "min_p",
    "presence_penalty",
    "frequency_penalty",
    "repetition_penalty",
]
INT_FIELDS = ["n", "max_tokens", "min_tokens", "top_k", "seed", "logprobs"]


def _refused(param: str, **kwargs: object) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(**kwargs)
    assert info.value.param == param
    return info.value


def test_defaults_are_valid() -> None:
    params = SamplingParams()
    assert (
        params.n == 1 and params.max_tokens is None and params.temperature == 1.0
    )  # None: to the end of the context
    assert params.top_k == 0 and params.logprobs is None and params.stop == () and params.logit_bias == ()
    assert not params.is_greedy and not params.has_penalties and params.skip_special_tokens


@pytest.mark.parametrize("field", sorted(BOUNDS))
def test_bounds_inside_accepted_outside_refused_with_range(field: str) -> None:
    inside, outside = BOUNDS[field]
    for value in inside:
        assert getattr(SamplingParams(**{field: value}), field) == value
    for value in outside:
        error = _refused(field, **{field: value})
        assert field in error.message and re.search(r"[\[(]-?[\d.e+-]+, [\d.e+-]+\]", error.message)


def test_min_tokens_bounded_by_max_tokens() -> None:
    assert SamplingParams(max_tokens=5, min_tokens=5).min_tokens == 5
    assert SamplingParams(max_tokens=5, min_tokens=0).min_tokens == 0
    assert "[0, 5]" in _refused("min_tokens", max_tokens=5, min_tokens=6).message
    _refused("min_tokens", min_tokens=-1)


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [math.nan, math.inf, -math.inf])
def test_non_finite_floats_refused(field: str, value: float) -> None:
    assert "finite" in _refused(field, **{field: value}).message


@pytest.mark.parametrize("value", [math.nan, math.inf])
def test_non_finite_logit_bias_refused(value: float) -> None:
    _refused("logit_bias", logit_bias={5: value})


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_floats_accept_ints_and_store_floats(field: str) -> None:
    value = 1 if field not in ("presence_penalty", "frequency_penalty", "min_p") else 0
    stored = getattr(SamplingParams(**{field: value}), field)
    assert isinstance(stored, float) and stored == value


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize("value", [True, "0.5", None])
def test_floats_refuse_bool_str_none(field: str, value: object) -> None:
    _refused(field, **{field: value})


@pytest.mark.parametrize("field", INT_FIELDS)
@pytest.mark.parametrize("value", [True, 1.0, "1"])
def test_ints_refuse_bool_float_str(field: str, value: object) -> None:
    _refused(field, **{field: value})


@pytest.mark.parametrize("field", ["ignore_eos", "skip_special_tokens"])
def test_bools_refuse_ints(field: str) -> None:
    _refused(field, **{field: 1})


def test_is_greedy() -> None:
    assert SamplingParams(temperature=0).is_greedy
    assert SamplingParams(temperature=1e-6).is_greedy  # would overflow logits / T in float32
    assert SamplingParams(temperature=1.3, top_k=1).is_greedy
    assert not SamplingParams(temperature=1e-5).is_greedy
    assert not SamplingParams(temperature=0.7, top_k=2).is_greedy


def test_has_penalties() -> None:
    assert SamplingParams(presence_penalty=0.1).has_penalties
    assert SamplingParams(frequency_penalty=-0.1).has_penalties
    assert SamplingParams(repetition_penalty=1.1).has_penalties
    assert not SamplingParams(repetition_penalty=1.0).has_penalties


def test_stop_normalised_and_bounded() -> None:
    assert SamplingParams(stop="\n").stop == ("\n",)
    assert SamplingParams(stop=["a", "bc"]).stop == ("a", "bc")
    assert SamplingParams(stop=["x"] * 16).stop == ("x",) * 16
    assert SamplingParams(stop=["y" * 256]).stop == ("y" * 256,)
    _refused("stop", stop=["x"] * 17)
    _refused("stop", stop=[""])
    _refused("stop", stop=["y" * 257])
    _refused("stop", stop=[3])
    _refused("stop", stop=None)


def test_stop_token_ids_normalised_and_bounded() -> None:
    assert SamplingParams(stop_token_ids=[2, 0]).stop_token_ids == (2, 0)
    assert len(SamplingParams(stop_token_ids=list(range(64))).stop_token_ids) == 64
    _refused("stop_token_ids", stop_token_ids=list(range(65)))
    _refused("stop_token_ids", stop_token_ids=[-1])
    _refused("stop_token_ids", stop_token_ids=[True])
    _refused("stop_token_ids", stop_token_ids=[1.0])


def test_logit_bias_dict_normalised_to_sorted_pairs() -> None:
    params = SamplingParams(logit_bias={9: 1, "3": -2.5, 0: 100})
    assert params.logit_bias == ((0, 100.0), (3, -2.5), (9, 1.0))
    assert all(isinstance(bias, float) for _, bias in params.logit_bias)
    assert params == SamplingParams(logit_bias=[(9, 1.0), (0, 100.0), (3, -2.5)])
    assert hash(params) == hash(SamplingParams(logit_bias=((0, 100), (3, -2.5), (9, 1))))


def test_logit_bias_bounds() -> None:
    assert len(SamplingParams(logit_bias={i: 0.0 for i in range(300)}).logit_bias) == 300
    assert SamplingParams(logit_bias={1: -100, 2: 100}).logit_bias == ((1, -100.0), (2, 100.0))
    _refused("logit_bias", logit_bias={i: 0.0 for i in range(301)})
    _refused("logit_bias", logit_bias={1: 100.001})
    _refused("logit_bias", logit_bias={1: -100.001})
    _refused("logit_bias", logit_bias={-1: 1.0})
    _refused("logit_bias", logit_bias={"x": 1.0})
    _refused("logit_bias", logit_bias={"-1": 1.0})
    _refused("logit_bias", logit_bias={True: 1.0})
    _refused("logit_bias", logit_bias={1: "1"})
    _refused("logit_bias", logit_bias={1: 1.0, "1": 2.0})  # the same token twice
    _refused("logit_bias", logit_bias=[(1, 2.0, 3.0)])
    _refused("logit_bias", logit_bias=5)


def test_validate_for_vocab() -> None:
    params = SamplingParams(logit_bias={99: 1.0}, stop_token_ids=[99])
    params.validate_for_vocab(100)
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(logit_bias={100: 1.0}).validate_for_vocab(100)
    assert info.value.param == "logit_bias" and "0..99" in info.value.message
    with pytest.raises(InvalidRequest) as info:
        SamplingParams(stop_token_ids=[5, 100]).validate_for_vocab(100)
    assert info.value.param == "stop_token_ids"


def test_frozen_and_hashable() -> None:
    params = SamplingParams(stop=["x"], stop_token_ids=[1], logit_bias={2: 1.0})
    with pytest.raises(dataclasses.FrozenInstanceError):
        params.temperature = 0.5  # type: ignore[misc]
    assert {params: 1}[SamplingParams(stop=("x",), stop_token_ids=(1,), logit_bias=((2, 1.0),))] == 1
    changed = dataclasses.replace(params, temperature=0.0)
    assert changed.is_greedy and changed.stop == ("x",)
    with pytest.raises(InvalidRequest):
        dataclasses.replace(params, temperature=11.0)


def test_error_has_hint_where_useful() -> None:
    error = _refused("repetition_penalty", repetition_penalty=0)
    assert error.hint and "1.0" in error.hint
