"""Teacher-forced comparison with llama.cpp's golden tokens (tests/models/test_coverage_golden.py,
test_kquant_golden.py): at every position of llama.cpp's prompt + greedy continuation, bitserve's argmax
must be llama.cpp's, except at llama.cpp's own near-ties (top-2 margin under NEAR_TIE of the logit range)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

NEAR_TIE = 0.01  # of the logit range


def teacher_forced_misses(
    llm: object, prompts: Sequence[str], expected: Sequence[dict]
) -> tuple[int, int, list]:
    """(decisive positions, positions compared, the decisive positions bitserve got wrong as (prompt,
    position)); `expected` per prompt as the golden scripts write it: ids, continuation, argmax, margins,
    ranges. Raises AssertionError where bitserve's tokenizer gives other ids."""
    model = llm.instance.loaded.model  # type: ignore[attr-defined]
    decisive = compared = 0
    wrong = []
    for prompt, case in zip(prompts, expected, strict=True):
        ids = llm.encode(prompt)  # type: ignore[attr-defined]
        assert ids == case["ids"], f"{prompt!r}: token ids differ from llama.cpp's"
        sequence = case["ids"] + case["continuation"][:-1]
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(sequence), torch.arange(len(sequence))))
        ours = logits.argmax(dim=-1).tolist()
        for position, (theirs, margin, spread) in enumerate(
            zip(case["argmax"], case["margins"], case["ranges"], strict=True)
        ):
            compared += 1
            if margin < NEAR_TIE * spread:
                continue
            decisive += 1
            if ours[position] != theirs:
                wrong.append((prompt, position))
    return decisive, compared, wrong


def logit_range_error(llm: object, prompts: Sequence[str], expected: Sequence[dict]) -> float:
    """The largest |bitserve's logit range - llama.cpp's| / llama.cpp's over every teacher-forced position:
    what the argmax cannot show (a logit scale or soft-cap applied or not moves every range)."""
    model = llm.instance.loaded.model  # type: ignore[attr-defined]
    worst = 0.0
    for _prompt, case in zip(prompts, expected, strict=True):
        sequence = case["ids"] + case["continuation"][:-1]
        with torch.inference_mode():
            logits = model.compute_logits(model(torch.tensor(sequence), torch.arange(len(sequence))))
        ours = (logits.max(dim=-1).values - logits.min(dim=-1).values).tolist()
        for mine, theirs in zip(ours, case["ranges"], strict=True):
            worst = max(worst, abs(mine - theirs) / theirs)
    return worst


def continuation_agrees(ours: Sequence[int], golden: dict) -> bool:
    """A greedy continuation through the serving path is llama.cpp's (`golden`: one prompt's ids,
    continuation, margins, ranges), or leaves it first where llama.cpp's own top-2 margin is under
    NEAR_TIE of its logit range (after that the two continue from different tokens)."""
    prompt_length = len(golden["ids"])
    for step, (mine, theirs) in enumerate(zip(ours, golden["continuation"], strict=True)):
        if mine != theirs:
            position = prompt_length - 1 + step
            return golden["margins"][position] < NEAR_TIE * golden["ranges"][position]
    return True


def serving_path_disagreements(llm: object, golden_prompts: Sequence[dict], num_tokens: int) -> list[str]:
    """Greedy continuations of every golden prompt, generated together (batched prefill, one-token decode
    steps over the paged KV cache), cold and then again from the prefix cache: what does not agree with
    llama.cpp (continuation_agrees), and a round in which fewer than two prompts match it exactly (near-ties
    excuse a prompt, never the whole batch). Empty when the serving path answers as llama.cpp."""
    from bitserve.sampling_params import SamplingParams

    prompts = [case["ids"] for case in golden_prompts]
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True)
    problems = []
    for attempt in ("cold", "prefix cache"):
        results = llm.generate(prompts, params)  # type: ignore[attr-defined]
        num_exact = 0
        for result, golden in zip(results, golden_prompts, strict=True):
            ours = list(result.outputs[0].token_ids)
            num_exact += ours == golden["continuation"]
            if not continuation_agrees(ours, golden):
                problems.append(f"{attempt}: {ours} vs {golden['continuation']}")
        if num_exact < 2:
            problems.append(f"{attempt}: fewer than two continuations are exactly llama.cpp's")
    return problems
