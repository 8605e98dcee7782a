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
