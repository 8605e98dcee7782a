"""Sampler: greedy == argmax, seeded runs repeat whatever shares the batch, each truncation keeps the
right tokens, temperature gives softmax(logits / T) (chi-square), penalties and logit_bias follow
their formulas, logprobs come from the raw distribution."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Sequence

import pytest
import torch

from bitserve.errors import InvalidRequest
from bitserve.layers.sampler import (
    Sampler,
    SamplingRequestState,
    _apply_penalties,
    _mask_top_p,
    make_generator,
)
from bitserve.sampling_params import SamplingParams

# chi-square critical values at p = 0.001 by degrees of freedom: a false failure is 1 in 1000
# for a fresh seed, and the seeds below are fixed, so the tests are deterministic.
CHI2_CRITICAL_0001 = {2: 13.82, 3: 16.27, 5: 20.52}


def make_row(
    params: SamplingParams,
    prompt: Sequence[int] | torch.Tensor = (),
    output: Sequence[int] | torch.Tensor = (),
    eos: Sequence[int] = (),
) -> SamplingRequestState:
    return SamplingRequestState(params, prompt, output, make_generator(params.seed), eos)


def sample(logits: torch.Tensor, rows: Sequence[SamplingRequestState], seed: int = 0) -> list[int]:
    return Sampler(seed=seed)(logits.clone(), rows).token_ids


def chi_square(counts: Counter[int], probs: torch.Tensor, num_samples: int) -> float:
    """Pearson's statistic over the tokens of nonzero probability; fails on any other token."""
    support = {int(i) for i in torch.nonzero(probs > 0).flatten()}
    assert set(counts) <= support, f"sampled outside the support: {set(counts) - support}"
    return sum(
        (counts[i] - num_samples * float(probs[i])) ** 2 / (num_samples * float(probs[i])) for i in support
    )


def seeded_draws(logits: torch.Tensor, params: SamplingParams, num_samples: int) -> Counter[int]:
    """num_samples rows, row i seeded with seed i, all with one logits vector: one call."""
    rows = [make_row(SamplingParams(**{**_fields(params), "seed": i})) for i in range(num_samples)]
    return Counter(sample(logits.expand(num_samples, -1), rows))


def _fields(params: SamplingParams) -> dict[str, object]:
    return {name: getattr(params, name) for name in params.__slots__}


# --- greedy ------------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ties_take_the_lowest_id() -> None:
    logits = torch.randn(6, 500, generator=torch.Generator().manual_seed(1))
    logits[2, 7] = logits[2, 400] = 50.0  # a tie
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(6)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()
    assert sample(logits, rows)[2] == 7


def test_greedy_takes_torch_argmax_choice_at_nan_and_all_minus_inf_rows() -> None:
    """The CPU greedy path goes through NumPy (faster); a NaN still wins and an all -inf row gives id 0,
    as torch's argmax does."""
    logits = torch.randn(3, 64, generator=torch.Generator().manual_seed(2))
    logits[0, 9] = float("nan")
    logits[1] = float("-inf")
    logits[2, 5] = logits[2, 60] = float("inf")
    rows = [make_row(SamplingParams(temperature=0)) for _ in range(3)]
    expected = logits.argmax(dim=-1).tolist()
    assert expected == [9, 0, 5]
    assert sample(logits, rows) == expected


def test_greedy_ignores_seed_and_leaves_its_generator_untouched() -> None:
    logits = torch.randn(1, 300, generator=torch.Generator().manual_seed(2))
    row = make_row(SamplingParams(temperature=0, seed=5))
    assert row.generator is not None
    state = row.generator.get_state()
    for _ in range(3):
        assert sample(logits, [row]) == [int(logits.argmax())]
    assert torch.equal(row.generator.get_state(), state)


def test_top_k_one_is_greedy_even_hot() -> None:
    logits = torch.randn(4, 300, generator=torch.Generator().manual_seed(3))
    rows = [make_row(SamplingParams(temperature=2.0, top_k=1, seed=i)) for i in range(4)]
    assert sample(logits, rows) == logits.argmax(dim=-1).tolist()


# --- seeds -------------------------------------------------------------------------------------


def run_steps(
    sampler: Sampler, logits: torch.Tensor, rows: list[SamplingRequestState], num_steps: int
) -> list[list[int]]:
    """Decode num_steps steps on fixed logits, appending each token to its row's output."""
    outputs: list[list[int]] = [[] for _ in rows]
    for _ in range(num_steps):
        for row, output in zip(rows, outputs, strict=True):
            row.output_token_ids = list(output)
        for output, token_id in zip(outputs, sampler(logits.clone(), rows).token_ids, strict=True):
            output.append(token_id)
    return outputs


SEEDED = SamplingParams(temperature=0.9, top_p=0.95, repetition_penalty=1.2, presence_penalty=0.3, seed=1234)


def test_seeded_runs_repeat_exactly() -> None:
    logits = torch.randn(1, 1000, generator=torch.Generator().manual_seed(4))
    first = run_steps(Sampler(), logits, [make_row(SEEDED, prompt=[1, 2, 3])], 20)
    second = run_steps(Sampler(), logits, [make_row(SEEDED, prompt=[1, 2, 3])], 20)
    assert first == second
    assert len(set(first[0])) > 5  # it really sampled


def test_seeded_row_independent_of_batch_composition_and_position() -> None:
    vocab_size = 3000  # more than one inverse-CDF block
    gen = torch.Generator().manual_seed(5)
    target_logits = torch.randn(1, vocab_size, generator=gen)
    alone = run_steps(Sampler(seed=1), target_logits, [make_row(SEEDED, prompt=[7, 8])], 15)[0]
    others = [
        SamplingParams(temperature=0),
        SamplingParams(temperature=1.5),
        SamplingParams(temperature=0.5, top_k=20, seed=99),
        SamplingParams(top_p=0.3, min_p=0.1, frequency_penalty=1.0),
        SamplingParams(temperature=0.8, top_k=300, top_p=0.9, logit_bias={5: 3.0}),
    ]
    for position in (0, 3, 5):
        params = others[:position] + [SEEDED] + others[position:]
        logits = torch.randn(len(params), vocab_size, generator=gen)
        logits[position] = target_logits[0]
        rows = [make_row(p, prompt=[7, 8]) for p in params]
        outputs = run_steps(Sampler(seed=position + 10), logits, rows, 15)
        assert outputs[position] == alone


def test_different_seeds_differ() -> None:
    logits = torch.zeros(1, 1000)  # uniform: two seeds agree on a token with probability 1/1000
    runs = [run_steps(Sampler(), logits, [make_row(SamplingParams(seed=s))], 10)[0] for s in range(4)]
    for a in range(4):
        for b in range(a + 1, 4):
            assert sum(x == y for x, y in zip(runs[a], runs[b], strict=True)) <= 2


def test_seeded_row_without_generator_is_refused() -> None:
    row = SamplingRequestState(SamplingParams(seed=3), [], [], None)
    with pytest.raises(ValueError, match="make_generator"):
        sample(torch.zeros(1, 10), [row])


# --- distribution and truncation ----------------------------------------------------------------


@pytest.mark.parametrize("temperature", [0.7, 1.0, 1.6])
def test_temperature_gives_softmax_of_scaled_logits(temperature: float) -> None:
    logits = torch.tensor([2.0, 1.0, 0.5, 0.0, -0.5, -1.5])
    num_samples = 4000
    counts = seeded_draws(logits, SamplingParams(temperature=temperature), num_samples)
    expected = torch.softmax(logits.double() / temperature, dim=-1)
    assert chi_square(counts, expected, num_samples) < CHI2_CRITICAL_0001[5]


def test_unseeded_rows_share_the_sampler_generator_and_follow_softmax() -> None:
    logits = torch.tensor([1.0, 0.0, -1.0, 0.5])
    num_samples = 4000
    rows = [make_row(SamplingParams()) for _ in range(num_samples)]
    counts = Counter(sample(logits.expand(num_samples, -1), rows, seed=7))
    assert chi_square(counts, torch.softmax(logits.double(), dim=-1), num_samples) < CHI2_CRITICAL_0001[3]


def test_distribution_across_cdf_blocks() -> None:
    """Mass spread over block edges and the partial last block of a 3000-token vocabulary."""
    logits = torch.full((3000,), -math.inf)
    support = [3, 1023, 1024, 2047, 2048, 2999]
    logits[support] = torch.tensor([0.0, 1.0, -0.5, 0.3, 0.8, -1.0])
    num_samples = 4000
    counts = seeded_draws(logits, SamplingParams(), num_samples)
    assert chi_square(counts, torch.softmax(logits.double(), dim=-1), num_samples) < CHI2_CRITICAL_0001[5]


PROBS_4 = torch.tensor([0.5, 0.3, 0.15, 0.05])


def test_top_p_small_keeps_only_the_top_token() -> None:
    logits = torch.log(torch.tensor([0.3, 0.25, 0.2, 0.15, 0.1]))
    counts = seeded_draws(logits, SamplingParams(top_p=0.01), 300)
    assert set(counts) == {0}


def test_top_p_keeps_the_nucleus_renormalised() -> None:
    # mass before token 1 is 0.5 < 0.7 (kept), before token 2 is 0.8 >= 0.7 (dropped)
    num_samples = 4000
    counts = seeded_draws(torch.log(PROBS_4), SamplingParams(top_p=0.7), num_samples)
    expected = torch.tensor([0.5, 0.3, 0.0, 0.0], dtype=torch.float64) / 0.8
    assert chi_square(counts, expected, num_samples) < CHI2_CRITICAL_0001[2]


def test_top_p_after_top_k_uses_the_renormalised_distribution() -> None:
    # top_k=3 renormalises to [0.526, 0.316, 0.158]; top_p=0.8: before token 2 the mass is 0.842
    counts = seeded_draws(torch.log(PROBS_4), SamplingParams(top_k=3, top_p=0.8), 2000)
    assert set(counts) == {0, 1}


def test_top_p_candidate_path_matches_full_sort() -> None:
    """The CPU partial top-k and its sort fallback cut exactly where a full sort does."""
    gen = torch.Generator().manual_seed(6)
    logits = torch.randn(8, 5000, generator=gen) * torch.tensor([0.1, 0.5, 1, 2, 4, 8, 16, 0.01]).unsqueeze(1)
    probs = logits.softmax(dim=-1)
    top_p = torch.tensor([0.5, 0.9, 0.95, 0.3, 0.99, 0.6, 0.9, 0.2]).unsqueeze(1)
    by_candidates, by_sort = probs.clone(), probs.clone()
    _mask_top_p(by_candidates, top_p, 64)
    _mask_top_p(by_sort, top_p, 5000)
    assert torch.equal(by_candidates, by_sort)
    kept = (by_sort > 0).sum(dim=-1)
    assert kept.min() >= 1 and kept.max() > 64  # both paths (cut inside and beyond 64) were taken
    # the kept mass reaches p, and dropping the least likely kept token falls below it
    for row in range(8):
        mass = by_sort[row].double().sum()
        smallest = by_sort[row][by_sort[row] > 0].min().double()
        assert mass >= top_p[row] - 1e-6 and mass - smallest < top_p[row]


@pytest.mark.parametrize(("min_p", "allowed"), [(0.2, {0, 1, 2}), (0.5, {0, 1}), (1.0, {0})])
def test_min_p_keeps_tokens_above_a_fraction_of_the_top(min_p: float, allowed: set[int]) -> None:
    counts = seeded_draws(torch.log(PROBS_4), SamplingParams(min_p=min_p), 3000)
    assert set(counts) == allowed  # every allowed token shows up in 3000 draws


def test_top_k_keeps_the_k_most_likely() -> None:
    logits = torch.randn(1000, generator=torch.Generator().manual_seed(8))
    counts = seeded_draws(logits, SamplingParams(temperature=2.0, top_k=5), 2000)
    assert set(counts) == set(logits.topk(5).indices.tolist())


def test_mixed_greedy_and_sampled_batch() -> None:
    gen = torch.Generator().manual_seed(9)
    logits = torch.randn(8, 700, generator=gen)
    params = [
        SamplingParams(temperature=0) if i % 2 else SamplingParams(temperature=1.0, top_k=3, seed=i)
        for i in range(8)
    ]
    rows = [make_row(p) for p in params]
    token_ids = sample(logits, rows)
    for i, token_id in enumerate(token_ids):
        if i % 2:
            assert token_id == int(logits[i].argmax())
        else:
            assert token_id in logits[i].topk(3).indices.tolist()
    rows = [make_row(p) for p in params]
    assert sample(logits, rows) == token_ids  # seeded rows and greedy rows repeat


# --- penalties, bias, min_tokens ----------------------------------------------------------------


def test_repetition_penalty_divides_positive_multiplies_negative_over_prompt_and_output() -> None:
    logits = torch.tensor([[2.0, -1.0, 0.5, 3.0, -2.0, 1.0]])
    row = make_row(SamplingParams(repetition_penalty=2.0), prompt=[0, 1, 0], output=[4, 4])
    _apply_penalties(logits, [row])
    assert torch.equal(logits, torch.tensor([[1.0, -2.0, 0.5, 3.0, -4.0, 1.0]]))


def test_presence_and_frequency_count_output_tokens_only() -> None:
    logits = torch.zeros(1, 6)
    params = SamplingParams(presence_penalty=0.5, frequency_penalty=0.25)
    _apply_penalties(logits, [make_row(params, prompt=[0, 0, 1], output=[2, 2, 3, 2])])
    # token 2: 0.5 + 3 * 0.25; token 3: 0.5 + 0.25; prompt-only tokens untouched
    assert torch.allclose(logits, torch.tensor([[0.0, 0.0, -1.25, -0.75, 0.0, 0.0]]))


def test_penalties_match_a_dense_reference_on_a_batch() -> None:
    gen = torch.Generator().manual_seed(10)
    vocab_size = 400
    logits = torch.randn(6, vocab_size, generator=gen) * 3
    params = [
        SamplingParams(repetition_penalty=1.3, presence_penalty=0.4, frequency_penalty=-0.2),
        SamplingParams(),  # no penalty: must stay untouched
        SamplingParams(repetition_penalty=0.8),
        SamplingParams(frequency_penalty=1.5),
        SamplingParams(presence_penalty=-1.0, repetition_penalty=1.1),
        SamplingParams(repetition_penalty=2.0),
    ]
    rows = []
    for i, p in enumerate(params):
        prompt = torch.randint(0, vocab_size, (50,), generator=gen)
        output = torch.randint(0, vocab_size, (30 * (i % 3),), generator=gen).tolist()
        rows.append(make_row(p, prompt=prompt if i % 2 else prompt.tolist(), output=output))
    expected = logits.clone()
    for i, row in enumerate(rows):
        seen = set(torch.as_tensor(row.prompt_token_ids).tolist()) | set(row.output_token_ids)
        r = row.params.repetition_penalty
        for token in seen:
            value = expected[i, token]
            expected[i, token] = value / r if value > 0 else value * r
        for token, count in Counter(row.output_token_ids).items():
            expected[i, token] -= row.params.presence_penalty + row.params.frequency_penalty * count
    _apply_penalties(logits, rows)
    assert torch.allclose(logits, expected, atol=1e-6)
    assert torch.equal(logits[1], expected[1])


def test_repetition_penalty_changes_the_greedy_choice() -> None:
    logits = torch.tensor([[3.0, 2.0, 0.0]])
    params = SamplingParams(temperature=0, repetition_penalty=2.0)
    assert sample(logits, [make_row(params, prompt=[1])]) == [0]
    assert sample(logits, [make_row(params, output=[0])]) == [1]  # 3 / 2 < 2


def test_logit_bias_forces_and_bans() -> None:
    logits = torch.randn(1, 100, generator=torch.Generator().manual_seed(11))
    top = int(logits.argmax())
    assert sample(logits, [make_row(SamplingParams(temperature=0, logit_bias={42: 100}))]) == [42]
    assert sample(logits, [make_row(SamplingParams(temperature=0, logit_bias={top: -100}))]) != [top]
    counts = seeded_draws(logits[0], SamplingParams(temperature=1.0, logit_bias={42: 100}), 200)
    assert set(counts) == {42}


def test_logit_bias_outside_vocab_is_refused_at_admission_not_in_the_step() -> None:
    params = SamplingParams(logit_bias={10: 1.0})
    with pytest.raises(InvalidRequest, match="logit_bias"):
        params.validate_for_vocab(10)  # admission: a user error, answered with a 400
    with pytest.raises(AssertionError):  # the step only asserts the invariant admission established
        sample(torch.zeros(1, 10), [make_row(params)])


def test_min_tokens_bans_eos_and_stop_ids_until_reached() -> None:
    logits = torch.tensor([[0.0, 5.0, 4.0, 3.0]])  # EOS=1 is the argmax, stop id 2 next
    params = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2])
    assert sample(logits, [make_row(params, output=[0], eos=[1])]) == [3]
    assert sample(logits, [make_row(params, output=[0, 0], eos=[1])]) == [1]
    ignore = SamplingParams(temperature=0, min_tokens=2, stop_token_ids=[2], ignore_eos=True)
    assert sample(logits, [make_row(ignore, output=[0], eos=[1])]) == [1]  # EOS does not stop: allowed


# --- logprobs ------------------------------------------------------------------------------------


def test_logprobs_from_the_raw_distribution() -> None:
    gen = torch.Generator().manual_seed(12)
    logits = torch.randn(3, 200, generator=gen) * 2
    raw = torch.log_softmax(logits, dim=-1)
    params = [
        SamplingParams(temperature=0.5, top_k=10, repetition_penalty=1.5, logprobs=5, seed=1),
        SamplingParams(temperature=0),  # no logprobs asked
        SamplingParams(temperature=0, logprobs=0, logit_bias={3: 100}),
    ]
    rows = [make_row(p, prompt=[int(logits[0].argmax())]) for p in params]
    output = Sampler(seed=0)(logits.clone(), rows)
    assert output.logprobs is not None and output.logprobs[1] is None
    first, third = output.logprobs[0], output.logprobs[2]
    assert first is not None and third is not None
    assert first.token_id == output.token_ids[0]
    assert first.logprob == pytest.approx(float(raw[0, first.token_id]), abs=1e-5)
    assert first.rank == 1 + int((raw[0] > raw[0, first.token_id]).sum())
    assert len(first.top_logprobs) == 5
    top_ids = [token_id for token_id, _ in first.top_logprobs]
    assert top_ids == raw[0].topk(5).indices.tolist()
    values = [value for _, value in first.top_logprobs]
    assert values == sorted(values, reverse=True)
    assert values == pytest.approx(raw[0].topk(5).values.tolist(), abs=1e-5)
    # forced by logit_bias: reported with its raw (unbiased) logprob, no alternatives
    assert third.token_id == 3 and third.top_logprobs == ()
    assert third.logprob == pytest.approx(float(raw[2, 3]), abs=1e-5)


def test_no_logprobs_requested_gives_none() -> None:
    output = Sampler(seed=0)(torch.zeros(2, 5), [make_row(SamplingParams()) for _ in range(2)])
    assert output.logprobs is None and len(output.token_ids) == 2


def test_shape_mismatch_is_an_error() -> None:
    with pytest.raises(ValueError, match="num_rows"):
        Sampler()(torch.zeros(2, 5), [make_row(SamplingParams())])
