"""IncrementalDetokenizer: deltas add up to the full decode and never split a UTF-8 character."""

from __future__ import annotations

import pytest
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from bitserve.tokenizer.backends import gpt2_byte_to_unicode
from bitserve.tokenizer.detokenizer import IncrementalDetokenizer
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer

SMOLLM2_VOCAB_SIZE = 49152
PROPERTY_SETTINGS = settings(
    max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)


@pytest.fixture(scope="module")
def partial_utf8_ids(smollm2_tokenizer: GGUFTokenizer) -> list[int]:
    """Tokens whose bytes are not whole UTF-8 (pieces of emoji, CJK, accented letters)."""
    ids = []
    for token_id in range(smollm2_tokenizer.vocab_size):
        try:
            smollm2_tokenizer.token_bytes(token_id).decode("utf-8")
        except UnicodeDecodeError:
            ids.append(token_id)
    assert len(ids) > 100
    return ids


@pytest.fixture(scope="module")
def representable_bytes(smollm2_tokenizer: GGUFTokenizer) -> frozenset[int]:
    """Bytes with a byte-level token. SmolLM2 lacks 21 (e.g. 0x1d, 0xf1): text using them cannot
    round-trip, in llama.cpp either (both drop them)."""
    byte_chars = gpt2_byte_to_unicode()
    return frozenset(b for b in range(256) if smollm2_tokenizer.piece_to_id(byte_chars[b]) is not None)


def _stream(tokenizer: GGUFTokenizer, ids: list[int], skip_special: bool) -> list[str]:
    detokenizer = IncrementalDetokenizer(tokenizer, skip_special=skip_special)
    return [detokenizer.add_token(token_id) for token_id in ids] + [detokenizer.finish()]


@PROPERTY_SETTINGS
@given(data=st.data(), skip_special=st.booleans())
def test_deltas_concatenate_to_the_full_decode(
    smollm2_tokenizer: GGUFTokenizer, partial_utf8_ids: list[int], data: st.DataObject, skip_special: bool
) -> None:
    """Random ids, biased toward partial-character tokens and the control tokens 0..16."""
    token_id = st.one_of(
        st.integers(0, SMOLLM2_VOCAB_SIZE - 1), st.sampled_from(partial_utf8_ids), st.integers(0, 16)
    )
    ids = data.draw(st.lists(token_id, max_size=48))
    deltas = _stream(smollm2_tokenizer, ids, skip_special)
    assert "".join(deltas) == smollm2_tokenizer.decode(ids, skip_special=skip_special)


@PROPERTY_SETTINGS
@given(text=st.text(alphabet=st.characters(exclude_categories=("Cs",), max_codepoint=0x3FFFF), max_size=40))
def test_streaming_real_text_never_emits_a_broken_character(
    smollm2_tokenizer: GGUFTokenizer, representable_bytes: frozenset[int], text: str
) -> None:
    """For ids of valid text (emoji, CJK, ZWJ sequences), every delta is whole characters: no
    U+FFFD ever appears, and the deltas rebuild the text."""
    assume(all(b in representable_bytes for b in text.encode("utf-8")))
    ids = smollm2_tokenizer.encode(text, parse_special=False)
    deltas = _stream(smollm2_tokenizer, ids, skip_special=True)
    assert all("\ufffd" not in delta for delta in deltas) or "\ufffd" in text
    assert "".join(deltas) == text


@pytest.mark.parametrize("text", ["👨\u200d👩\u200d👧\u200d👦 family", "日本語のテキスト", "naïve café 🎉"])
def test_multibyte_characters_are_held_back_until_complete(
    smollm2_tokenizer: GGUFTokenizer, text: str
) -> None:
    ids = smollm2_tokenizer.encode(text)
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer)
    saw_pending = False
    for token_id in ids:
        delta = detokenizer.add_token(token_id)
        saw_pending |= detokenizer.num_pending_bytes > 0
        assert text.startswith(detokenizer.text)
        assert "\ufffd" not in delta
    assert saw_pending, "expected at least one token ending inside a character"
    assert detokenizer.finish() == ""
    assert detokenizer.text == text and detokenizer.num_tokens == len(ids)


def test_finish_flushes_an_incomplete_character(smollm2_tokenizer: GGUFTokenizer) -> None:
    first_byte_token = smollm2_tokenizer.encode("😀")[0]
    detokenizer = IncrementalDetokenizer(smollm2_tokenizer)
    assert detokenizer.add_token(first_byte_token) == ""
    assert detokenizer.finish() == "\ufffd"
    assert detokenizer.finish() == ""
    with pytest.raises(RuntimeError):
        detokenizer.add_token(first_byte_token)


def test_special_tokens_follow_skip_special(smollm2_tokenizer: GGUFTokenizer) -> None:
    ids = smollm2_tokenizer.encode("Hi<|im_end|>")
    assert IncrementalDetokenizer(smollm2_tokenizer).add_tokens(ids) == "Hi"
    assert IncrementalDetokenizer(smollm2_tokenizer, skip_special=False).add_tokens(ids) == "Hi<|im_end|>"
