"""Speculative decoding end to end on the embedded SmolLM2 (cpu backend): with `speculative="ngram"` the
engine gives plain decoding's greedy tokens (one prompt at a time, batched, and again from the prefix
cache), its stops and lengths, its logprobs, its seeded samples, and its sampling distribution."""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig
from bitserve.engine.instance import ModelInstance, make_runner
from bitserve.errors import InvalidRequest
from bitserve.layers.sampler import Sampler
from bitserve.llm import LLM
from bitserve.runner import speculative
from bitserve.sampling_params import SamplingParams

CODE = "def area(width, height):\n    result = width * height\n    return result"
GROUNDED = [
    "Repeat the following text exactly: The library opens at nine and closes at six. Members may "
    "borrow ten books at a time.",
    "Fix the typos and write the text again: The wether was realy nice, so we went to the beech.",
    f"Rename the variable result to value and show the whole code:\n\n{CODE}",
    f"Copy this code exactly:\n\n{CODE}",
    'Copy this JSON and change the age to 31: {"name": "Alice", "age": 30, "city": "Paris"}',
    "Write this list again in the same order, one item per line: apples, pears, plums, grapes, figs",
    "Correct the grammar and repeat the sentence: Me and him goes to the shop every days.",
]
OPEN_CHAT = ["Why is the sky blue?", "Give me two tips for sleeping better.", "Write a haiku about rain."]
MAX_TOKENS = 40


@pytest.fixture(scope="module")
def llms(smollm2_path: Path) -> Iterator[tuple[LLM, LLM]]:
    plain = LLM(str(smollm2_path))
    spec = LLM(str(smollm2_path), speculative="ngram", num_speculative_tokens=4)
    yield plain, spec
    plain.close()
    spec.close()


class StepStats:
    """Sums the drafts verified and accepted over the steps an LLM runs while active."""

    def __init__(self, llm: LLM) -> None:
        self.engine, self.drafted, self.accepted = llm.engine, 0, 0

    def __enter__(self) -> StepStats:
        step = self._step = self.engine.step

        def counting_step():  # noqa: ANN202
            result = step()
            self.drafted += result.stats.num_draft_tokens
            self.accepted += result.stats.num_accepted_tokens
            return result

        self.engine.step = counting_step  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc: object) -> None:
        self.engine.step = self._step  # type: ignore[method-assign]


@pytest.fixture
def uncached(llms: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch) -> tuple[LLM, LLM]:
    """Both engines without prefix-cache hits for one test. NOTE: a prefill's numerics follow its step's
    shape (a chunk after cached blocks, the batch beside it: logprobs move by ~1e-2), and the two engines'
    caches hold different blocks (drafts take blocks of their own, so other blocks are evicted); comparing
    logprobs or seeded samples needs both to prefill alike."""
    for llm in llms:
        monkeypatch.setattr(llm.engine.scheduler.kv, "enable_prefix_caching", False)
    return llms


def chat_ids(llm: LLM, prompts: list[str]) -> list[list[int]]:
    return [llm.encode_chat([{"role": "user", "content": p}]) for p in prompts]


def token_ids(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [output.outputs[0].token_ids for output in llm.generate(prompts, params)]


GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0)


def test_greedy_tokens_equal_plain_one_prompt_at_a_time(llms: tuple[LLM, LLM]) -> None:
    plain, spec = llms
    prompts = chat_ids(plain, GROUNDED + OPEN_CHAT)
    with StepStats(spec) as stats:
        for prompt in prompts:
            assert token_ids(spec, [prompt], GREEDY) == token_ids(plain, [prompt], GREEDY)
    assert stats.accepted > 0.3 * stats.drafted > 0  # the grounded prompts' drafts mostly hold


def test_greedy_tokens_equal_plain_batched_and_from_the_prefix_cache(llms: tuple[LLM, LLM]) -> None:
    plain, spec = llms
    prompts = chat_ids(plain, GROUNDED + OPEN_CHAT)
    expected = token_ids(plain, prompts, GREEDY)
    with StepStats(spec) as stats:
        first = spec.generate(prompts, GREEDY)
        again = spec.generate(prompts, GREEDY)  # prompts (and answers) now in the prefix cache
    assert [o.outputs[0].token_ids for o in first] == expected
    assert [o.outputs[0].token_ids for o in again] == expected
    assert all(o.num_cached_tokens > 0 for o in again) and stats.accepted > 0


def test_stop_token_ids_and_max_tokens_end_where_plain_decoding_ends(llms: tuple[LLM, LLM]) -> None:
    plain, spec = llms
    prompt = chat_ids(plain, [GROUNDED[0]])
    reference = token_ids(plain, prompt, GREEDY)[0]
    stop_id = reference[12]  # inside a copied run: drafts go past it
    stop_params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop_token_ids=[stop_id])
    for llm in llms:
        (output,) = llm.generate(prompt, stop_params)[0].outputs
        assert output.token_ids == reference[: reference.index(stop_id) + 1]
        assert output.finish_reason == "stop" and output.stop_reason == stop_id
    for max_tokens in (1, 2, 5, 13):
        params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True)
        outputs = [llm.generate(prompt, params)[0].outputs[0] for llm in llms]
        assert outputs[0].token_ids == outputs[1].token_ids == reference[:max_tokens]
        assert outputs[1].finish_reason == "length"


def test_stop_strings_cut_a_speculative_run_at_their_token(llms: tuple[LLM, LLM]) -> None:
    plain, spec = llms
    prompt = chat_ids(plain, [GROUNDED[0]])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, stop=["ten books"])
    outputs = [llm.generate(prompt, params)[0].outputs[0] for llm in llms]
    assert outputs[0].finish_reason == "stop" and "ten" not in outputs[0].text
    assert (outputs[1].text, outputs[1].token_ids) == (outputs[0].text, outputs[0].token_ids)


def test_logprobs_equal_plain(uncached: tuple[LLM, LLM]) -> None:
    llms = plain, spec = uncached
    prompts = chat_ids(plain, GROUNDED[:3])
    params = SamplingParams(max_tokens=24, temperature=0, logprobs=3)
    with StepStats(spec) as stats:
        results = [llm.generate(prompts, params) for llm in llms]
    assert stats.accepted > 0
    for plain_out, spec_out in zip(*results, strict=True):
        a, b = plain_out.outputs[0], spec_out.outputs[0]
        assert a.token_ids == b.token_ids and len(b.logprobs) == len(b.token_ids)
        for x, y in zip(a.logprobs, b.logprobs, strict=True):
            assert (x.token_id, x.rank) == (y.token_id, y.rank)
            assert math.isclose(x.logprob, y.logprob, abs_tol=1e-4)
            for (id_x, lp_x), (id_y, lp_y) in zip(x.top_logprobs, y.top_logprobs, strict=True):
                assert math.isclose(lp_x, lp_y, abs_tol=1e-4)
                assert id_x == id_y or math.isclose(lp_x, lp_y, abs_tol=1e-4)  # equal, or a near tie


def test_seeded_sampling_is_reproducible_and_equals_plain(uncached: tuple[LLM, LLM]) -> None:
    plain, spec = uncached
    prompts = chat_ids(plain, GROUNDED[:4])
    params = SamplingParams(max_tokens=MAX_TOKENS, temperature=0.7, top_p=0.95, seed=1234, n=2)
    with StepStats(spec) as stats:
        first, second = spec.generate(prompts, params), spec.generate(prompts, params)
    expected = plain.generate(prompts, params)

    def ids(results: list[Any]) -> list[list[list[int]]]:
        return [[choice.token_ids for choice in r.outputs] for r in results]

    assert ids(first) == ids(second) == ids(expected)
    assert stats.accepted > 0


# ---------------------------------------------------------------------------------------------
# The sampling distribution: the first three tokens of many unseeded samples against the model's own
# probabilities (temperature 1, the whole vocabulary: no top-k, whose cut-off a near tie can move between
# the engine's numerics and a plain forward's), with speculation on (the second token is verified against
# a draft, which mostly misses here), off, and with a wrong acceptance rule that the test must catch.

DIST_TEXT = "red blue, red green, red blue, red green, red blue, red green, red"
NUM_SAMPLES = 160  # 10 prompt copies x n=16
# 3 tokens: after the prefill's first token, one draft (max_tokens caps it) for the second
DIST_PARAMS = SamplingParams(max_tokens=3, temperature=1.0, ignore_eos=True, n=16)


def exact_probabilities(llm: LLM, prompt: list[int], depth: int = 3) -> dict[tuple[int, ...], float]:
    """P(t_1 .. t_depth) at temperature 1 for every outcome of probability >= 1e-3, from full-sequence
    forwards (no cache)."""
    model = llm.instance.loaded.model
    probabilities: dict[tuple[int, ...], float] = {}

    def expand(prefix: tuple[int, ...], mass: float) -> None:
        if len(prefix) == depth:
            probabilities[prefix] = mass
            return
        ids = torch.tensor(prompt + list(prefix))
        with torch.inference_mode():
            probs = model.compute_logits(model(ids, torch.arange(len(ids)))[-1:])[0].softmax(-1)
        top = probs.topk(64)
        for token_id, p in zip(top.indices.tolist(), top.values.tolist(), strict=True):
            if mass * p >= 1e-3:
                expand((*prefix, token_id), mass * p)

    expand((), 1.0)
    return probabilities


def chi_square(
    samples: list[tuple[int, ...]], probabilities: dict[tuple[int, ...], float]
) -> tuple[float, int]:
    """Pearson's statistic of `samples` against `probabilities` and its degrees of freedom: one cell per
    outcome expected >= 5 times, and one for everything else (its expected count what the cells leave)."""
    counts, n = Counter(samples), len(samples)
    statistic, num_cells, observed_in, mass_in = 0.0, 0, 0, 0.0
    for outcome, p in probabilities.items():
        if n * p >= 5:
            observed = counts.get(outcome, 0)
            statistic += (observed - n * p) ** 2 / (n * p)
            num_cells, observed_in, mass_in = num_cells + 1, observed_in + observed, mass_in + p
    rest = n * (1 - mass_in)
    statistic += (n - observed_in - rest) ** 2 / max(rest, 1e-3)
    return statistic, num_cells  # num_cells + 1 cells, one constraint


def chi_square_critical(df: int, z: float = 3.719) -> float:
    """The upper 1e-4 point of chi-square(df), Wilson-Hilferty (z = 3.719 is N(0, 1)'s 1e-4 point)."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def sample_first_tokens(llm: LLM, prompt: list[int]) -> tuple[list[tuple[int, ...]], StepStats]:
    """NUM_SAMPLES samples' three tokens. The prompt's first block is cached first, so each sample
    prefills one token; the shared generator (unseeded rows) is seeded, so a run repeats exactly."""
    llm.generate([prompt], SamplingParams(max_tokens=1))
    llm.engine.runner.sampler = Sampler(seed=20240601)
    with StepStats(llm) as stats:
        results = llm.generate([prompt] * (NUM_SAMPLES // DIST_PARAMS.n), DIST_PARAMS)
    assert all(r.num_cached_tokens == 16 for r in results)
    return [tuple(choice.token_ids) for r in results for choice in r.outputs], stats


def test_sampling_keeps_the_model_distribution(
    llms: tuple[LLM, LLM], monkeypatch: pytest.MonkeyPatch
) -> None:
    plain, spec = llms
    prompt = plain.encode(DIST_TEXT)[:17]  # one full block of 16, and one token to prefill
    assert plain.engine.runner.layout.block_size == 16
    probabilities = exact_probabilities(plain, prompt)
    for llm, label in ((plain, "plain"), (spec, "speculative")):
        samples, stats = sample_first_tokens(llm, prompt)
        statistic, df = chi_square(samples, probabilities)
        assert statistic < chi_square_critical(df), (label, statistic, df)
    assert 0 < stats.accepted < stats.drafted  # every second token was verified; many drafts missed
    # a wrong rule (keep every draft unverified) moves the second token's mass onto the drafts
    monkeypatch.setattr(speculative, "num_accepted", lambda row_tokens, drafts: len(drafts))
    samples, _ = sample_first_tokens(spec, prompt)
    statistic, df = chi_square(samples, probabilities)
    assert statistic > 10 * chi_square_critical(df), (statistic, df)


# ---------------------------------------------------------------------------------------------


def test_speculation_is_refused_on_a_cuda_device(smollm2_path: Path) -> None:
    config = EngineConfig(
        model=ModelConfig(model=str(smollm2_path), device="cuda"),
        scheduler=SchedulerConfig(speculative="ngram"),
    )
    with pytest.raises(InvalidRequest, match="cpu backend only"):
        ModelInstance.load(config)  # before any weight is loaded (no GPU needed to see the refusal)
    scheduler = SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16, speculative="ngram")
    with pytest.raises(InvalidRequest, match="cpu backend only"):
        make_runner(None, None, torch.device("cuda"), scheduler, 64, model_config=None, tuning=None)  # type: ignore[arg-type]


def test_the_knobs_are_checked_and_reach_the_scheduler(llms: tuple[LLM, LLM]) -> None:
    assert llms[1].engine.scheduler.config.speculative == "ngram"
    assert llms[0].engine.scheduler.config.speculative == "off"  # the default
    for bad in ({"speculative": "eagle"}, {"num_speculative_tokens": 0}, {"num_speculative_tokens": 17}):
        with pytest.raises(ValueError):
            SchedulerConfig(**bad)
