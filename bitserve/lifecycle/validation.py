"""Checks a freshly loaded model must pass before an alias flips to it. The structural ones (GGUF
compliance, known architecture and formats, tensor extents and alignment) already ran in the loader;
here: vocabulary agreement, a smoke generation with finite logprobs, and the golden prompts.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from bitserve.errors import ModelLoadError
from bitserve.frontend.async_engine import AsyncEngine
from bitserve.lifecycle.model_files import GoldenPrompt
from bitserve.sampling_params import SamplingParams

NUM_SMOKE_TOKENS = 4
SMOKE_PROMPT = "Hello"


class ModelValidationFailed(ModelLoadError):
    """A loaded model failed a check before the flip; nothing changed."""


async def _greedy(
    engine: AsyncEngine, prompt_ids: list[int], num_tokens: int, request_id: str
) -> tuple[list[int], list[float]]:
    params = SamplingParams(max_tokens=num_tokens, temperature=0.0, ignore_eos=True, logprobs=0)
    choice = (await engine.submit(prompt_ids, params, request_id=request_id).collect()).outputs[0]
    return choice.token_ids, [entry.logprob for entry in choice.logprobs or ()]


async def smoke_generation(engine: AsyncEngine, request_id: str) -> None:
    """A few greedy tokens: they arrive, lie in the vocabulary and have finite logprobs."""
    prompt_ids = engine.instance.tokenizer.encode(SMOKE_PROMPT) or [0]
    token_ids, logprobs = await _greedy(engine, prompt_ids, NUM_SMOKE_TOKENS, request_id)
    if len(token_ids) != NUM_SMOKE_TOKENS:
        raise ModelValidationFailed(
            f"smoke generation returned {len(token_ids)} of {NUM_SMOKE_TOKENS} tokens"
        )
    if not all(math.isfinite(value) for value in logprobs) or len(logprobs) != len(token_ids):
        raise ModelValidationFailed(
            "smoke generation produced non-finite logits", hint="the weights hold NaN or Inf"
        )


async def golden_check(engine: AsyncEngine, golden: Sequence[GoldenPrompt], request_id: str) -> None:
    """Each golden prompt's greedy tokens equal the expected ones (the first mismatch is reported)."""
    tokenizer = engine.instance.tokenizer
    for index, case in enumerate(golden):
        prompt_ids = tokenizer.encode(case.prompt) if isinstance(case.prompt, str) else list(case.prompt)
        if not prompt_ids or max(prompt_ids) >= tokenizer.vocab_size:
            raise ModelValidationFailed(f"golden prompt {index} is empty or outside the vocabulary")
        expected = list(case.expected_token_ids)
        token_ids, _ = await _greedy(engine, prompt_ids, len(expected), f"{request_id}-golden-{index}")
        if token_ids != expected:
            first = next(
                (i for i, (a, b) in enumerate(zip(token_ids, expected, strict=False)) if a != b),
                min(len(token_ids), len(expected)),
            )
            raise ModelValidationFailed(
                f"golden prompt {index}: greedy tokens differ from the expected ones at position {first}",
                hint=(
                    "the new file does not reproduce the recorded outputs; "
                    "check the file or update its sidecar's golden list"
                ),
            )


async def validate_engine(engine: AsyncEngine, golden: Sequence[GoldenPrompt], request_id: str) -> None:
    """Raise ModelValidationFailed on the first failed check."""
    await smoke_generation(engine, request_id)
    await golden_check(engine, golden, request_id)
