"""The runner's grammar masks over SmolLM2's real vocabulary: only guided rows change, a guided row
allows exactly the tokens its grammar can take next, the matcher advances with the outputs it is
shown, EOS is allowed only where the grammar may end, and a refused token ends the request (EOS only)
instead of the engine."""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.errors import InvalidRequest
from bitserve.loader.gguf_reader import read_gguf
from bitserve.sampling_params import SamplingParams
from bitserve.structured.grammars import GrammarCompiler
from bitserve.structured.guide import Guide, GuideKind
from bitserve.structured.masks import GuidedRows
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer, tokenizer_from_gguf


@pytest.fixture(scope="module")
def tokenizer(smollm2_path: Path) -> GGUFTokenizer:
    return tokenizer_from_gguf(read_gguf(smollm2_path).metadata)


@pytest.fixture(scope="module")
def guided(tokenizer: GGUFTokenizer) -> GuidedRows:
    return GuidedRows(GrammarCompiler(tokenizer, tokenizer.vocab_size))


def scheduled(request_id: str, guide: Guide | None, outputs: tuple[int, ...] = ()) -> ScheduledRequest:
    return ScheduledRequest(
        request_id=request_id,
        token_ids=[1],
        start_position=0,
        block_ids=[0],
        sample=True,
        params=SamplingParams(guide=guide),
        num_computed_tokens_before=0,
        prompt_token_ids=(1,),
        output_token_ids=outputs,
    )


def allowed_ids(row: torch.Tensor) -> set[int]:
    return set(torch.isfinite(row).nonzero().squeeze(1).tolist())


def test_only_guided_rows_are_masked_and_eos_waits_for_the_grammar(
    guided: GuidedRows, tokenizer: GGUFTokenizer
) -> None:
    choice = Guide.choice(["yes", "no"])
    yes = tokenizer.encode("yes", add_special=False)
    logits = torch.randn(3, tokenizer.vocab_size)
    original = logits.clone()
    guided.mask_logits(logits, [scheduled("free", None), scheduled("c", choice), scheduled("free-2", None)])
    assert torch.equal(logits[0], original[0]) and torch.equal(logits[2], original[2])
    first = allowed_ids(logits[1])
    assert first and all(
        "yes".startswith(t) or "no".startswith(t) for t in (tokenizer.decode([i]) for i in first)
    )
    assert not first & tokenizer.eos_token_ids  # the grammar cannot end before a choice is complete
    done = torch.randn(1, tokenizer.vocab_size)
    guided.mask_logits(done, [scheduled("c", choice, tuple(yes))])  # caught up with "yes": only EOS is left
    assert allowed_ids(done[0]) == tokenizer.eos_token_ids


def test_a_refused_token_ends_the_request_not_the_engine(
    guided: GuidedRows, tokenizer: GGUFTokenizer
) -> None:
    digits = Guide(GuideKind.REGEX, r"\d+", "guided_regex")
    letter = tokenizer.encode("x", add_special=False)
    logits = torch.randn(1, tokenizer.vocab_size)
    guided.mask_logits(logits, [scheduled("r", digits, tuple(letter))])
    assert allowed_ids(logits[0]) == tokenizer.eos_token_ids
    guided.free(["r", "c"])
    assert not math.isnan(logits[0].softmax(-1).sum().item())


def test_a_grammar_that_matches_nothing_is_refused_before_admission(guided: GuidedRows) -> None:
    with pytest.raises(InvalidRequest, match="matches no text"):
        guided.compiler.validate(Guide(GuideKind.GRAMMAR, "root ::= root", "guided_grammar"))
