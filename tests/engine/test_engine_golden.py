"""Golden engine test: the batched, paged, prefix-cached engine gives each request exactly the greedy
tokens of a plain full-sequence forward (no cache) of that request alone."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from bitserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from bitserve.engine.messages import EngineRequest
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

NUM_NEW_TOKENS = 10


def full_sequence_greedy(llm: LLM, prompt_ids: list[int], num_tokens: int) -> list[int]:
    """Recompute the whole sequence every token: no KV cache, no batching."""
    model = llm.instance.loaded.model
    ids = list(prompt_ids)
    with torch.inference_mode():
        for _ in range(num_tokens):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))
            ids.append(int(model.compute_logits(hidden[-1:])[0].argmax()))
    return ids[len(prompt_ids) :]


def make_prompts(llm: LLM) -> list[list[int]]:
    shared = llm.encode("A shared system preamble that several requests start with, long enough for blocks. ")
    texts = [
        "Hi",
        "The weather today is",
        "1, 2, 3,",
        "Ternary networks",
        "émigré 東京 🙂 and more text to fill a block or two",
    ]
    prompts = [llm.encode(t) for t in texts]
    prompts += [shared + llm.encode(t) for t in texts[:3]]  # prefix-cache hits
    prompts.append(shared + llm.encode(texts[0]))  # an exact duplicate
    return prompts


def run_engine_staggered(llm: LLM, prompts: list[list[int]]) -> dict[str, list[int]]:
    """Requests arrive at different steps; returns each request's generated tokens."""
    engine = llm.engine
    params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
    tokens: dict[str, list[int]] = {}
    pending = list(enumerate(prompts))
    step = 0
    while pending or engine.has_unfinished_requests():
        if pending and step % 2 == 0:  # two new arrivals every other step
            for index, ids in pending[:2]:
                engine.add_request(EngineRequest(f"r{index}", tuple(ids), params, frozenset()))
                tokens[f"r{index}"] = []
            pending = pending[2:]
        for output in engine.step().outputs:
            tokens[output.request_id].extend(output.new_token_ids)
        step += 1
    return tokens


def small_batch_config(path: Path, *, prefix_caching: bool) -> EngineConfig:
    # a tight token budget forces chunked prefill mixed with decodes; block_size 4 makes many blocks
    return EngineConfig(
        model=ModelConfig(model=str(path), backend="reference"),
        cache=CacheConfig(block_size=4, enable_prefix_caching=prefix_caching),
        scheduler=SchedulerConfig(max_num_seqs=4, max_num_batched_tokens=16),
    )


@pytest.fixture(scope="module")
def tq2_path(synthetic_models: dict[str, Path]) -> Path:
    return synthetic_models["TQ2_0"]


@pytest.mark.parametrize("prefix_caching", [True, False])
def test_batched_paged_engine_equals_full_forward(tq2_path: Path, prefix_caching: bool) -> None:
    llm = LLM(config=small_batch_config(tq2_path, prefix_caching=prefix_caching))
    try:
        prompts = make_prompts(llm)
        generated = run_engine_staggered(llm, prompts)
        for index, ids in enumerate(prompts):
            assert generated[f"r{index}"] == full_sequence_greedy(llm, ids, NUM_NEW_TOKENS), (
                f"request {index}"
            )
        if prefix_caching:
            stats = llm.engine.scheduler.get_stats()
            assert stats.num_preempted_total >= 0
    finally:
        llm.close()


def test_prefix_cache_hits_happen_and_change_nothing(tq2_path: Path) -> None:
    llm = LLM(
        config=dataclasses.replace(
            small_batch_config(tq2_path, prefix_caching=True),
            scheduler=SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=256),
        )
    )
    try:
        prompt = make_prompts(llm)[5]
        params = SamplingParams(max_tokens=NUM_NEW_TOKENS, temperature=0.0, ignore_eos=True)
        first = llm.generate([prompt], params)[0]
        second = llm.generate([prompt], params)[0]
        assert second.num_cached_tokens > 0
        assert second.outputs[0].token_ids == first.outputs[0].token_ids
    finally:
        llm.close()


def test_preemption_under_a_tiny_cache_changes_nothing(tq2_path: Path) -> None:
    config = small_batch_config(tq2_path, prefix_caching=False)
    config = dataclasses.replace(
        config, cache=CacheConfig(block_size=4, num_blocks=12, enable_prefix_caching=False)
    )
    llm = LLM(config=config)
    try:
        prompts = make_prompts(llm)[:5]
        generated = run_engine_staggered(llm, prompts)
        assert llm.engine.scheduler.get_stats().num_preempted_total > 0, (
            "the cache should be too small to avoid preemption"
        )
        for index, ids in enumerate(prompts):
            assert generated[f"r{index}"] == full_sequence_greedy(llm, ids, NUM_NEW_TOKENS)
    finally:
        llm.close()
