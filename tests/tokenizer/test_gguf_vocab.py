"""GGUFTokenizer behaviour that holds without llama.cpp: special tokens, policies, errors, bytes."""

from __future__ import annotations

import logging
from typing import Any

import numpy as np
import pytest

from bitserve.errors import InvalidModelFile, InvalidRequest, UnsupportedModel
from bitserve.tokenizer.base import Tokenizer, TokenType
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer, tokenizer_from_gguf


def _tiny_bpe_metadata(**overrides: Any) -> dict[str, Any]:
    """A byte-level vocabulary small enough to write by hand: all 256 byte chars, two merges."""
    from bitserve.tokenizer.backends import gpt2_byte_to_unicode

    tokens = ["<|endoftext|>", "<|user|>", *gpt2_byte_to_unicode(), "he", "hel"]
    metadata: dict[str, Any] = {
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.pre": "gpt-2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array([3, 4] + [1] * (len(tokens) - 2), dtype=np.int32),
        "tokenizer.ggml.merges": ["h e", "he l"],
        "tokenizer.ggml.bos_token_id": 0,
        "tokenizer.ggml.eos_token_id": 0,
    }
    metadata.update(overrides)
    return metadata


def test_smollm2_special_ids_and_flags(smollm2_tokenizer: GGUFTokenizer) -> None:
    assert isinstance(smollm2_tokenizer, Tokenizer)
    assert smollm2_tokenizer.vocab_size == 49152
    assert (smollm2_tokenizer.bos_token_id, smollm2_tokenizer.eos_token_id) == (1, 2)
    assert smollm2_tokenizer.add_bos is False
    # As in llama.cpp: <|im_end|> (eos), <|endoftext|> and the FIM repo-name token <reponame>.
    assert smollm2_tokenizer.eos_token_ids == {0, 2, 4}
    assert smollm2_tokenizer.special_ids.fim_rep == 4


def test_control_tokens_match_only_with_parse_special(smollm2_tokenizer: GGUFTokenizer) -> None:
    text = "<|im_start|>user\nHi<|im_end|>"
    ids = smollm2_tokenizer.encode(text)
    assert ids[0] == 1 and ids[-1] == 2
    assert smollm2_tokenizer.decode(ids, skip_special=False) == text
    assert smollm2_tokenizer.decode(ids) == "user\nHi"
    plain = smollm2_tokenizer.encode(text, parse_special=False)
    assert 1 not in plain and 2 not in plain
    assert smollm2_tokenizer.decode(plain) == text


def test_bitnet_shaped_vocab_stops_on_eos_and_eot(llama3_tokenizer: GGUFTokenizer) -> None:
    """docs/formats.md §5.1: the 2B-4T stop ids are exactly {128001, 128009}; BOS 128000 is added."""
    assert llama3_tokenizer.eos_token_ids == {128001, 128009}
    assert llama3_tokenizer.special_ids.eot == 128009
    assert llama3_tokenizer.pre_tokenizer == "llama-bpe"
    assert llama3_tokenizer.encode("Hi")[0] == 128000
    assert 128000 not in llama3_tokenizer.encode("Hi", add_special=False)


def test_user_defined_tokens_always_match(llama3_tokenizer: GGUFTokenizer) -> None:
    assert llama3_tokenizer.token_type(60000) == TokenType.USER_DEFINED
    assert llama3_tokenizer.encode("<|pad_60000|>", add_special=False, parse_special=False) == [60000]
    # ...and decode as text even with skip_special, unlike control tokens.
    assert llama3_tokenizer.decode([60000, 128009]) == "<|pad_60000|>"
    assert 128009 not in llama3_tokenizer.encode("<|eot_id|>", add_special=False, parse_special=False)


def test_missing_pre_defaults_to_llama_bpe_with_a_warning(
    smollm2_metadata: dict[str, Any], build_variant: Any, caplog: pytest.LogCaptureFixture
) -> None:
    metadata = {k: v for k, v in smollm2_metadata.items() if k != "tokenizer.ggml.pre"}
    with caplog.at_level(logging.WARNING, logger="bitserve.tokenizer.gguf_vocab"):
        tokenizer = tokenizer_from_gguf(metadata)
    assert tokenizer.pre_tokenizer == "llama-bpe"
    assert any("tokenizer.ggml.pre" in record.getMessage() for record in caplog.records)
    # docs/formats.md §5.2: " (" is one Llama-3 piece; llama.cpp's default set splits punctuation off first.
    assert tokenizer.encode(" (x", add_special=False)[0] == tokenizer.piece_to_id("Ġ(")
    compat = build_variant("llama3_nopre")[0]  # built with pre_policy="default"
    assert compat.pre_tokenizer == "default"
    assert compat.encode(" (x", add_special=False)[:2] == [compat.piece_to_id("Ġ"), compat.piece_to_id("(")]


def test_pre_policy_overrides_a_named_pre(caplog: pytest.LogCaptureFixture) -> None:
    """--tokenizer-pre works on a file whose key is present and wrong, or unknown to bitserve, and says so."""
    with caplog.at_level(logging.WARNING, logger="bitserve.tokenizer.gguf_vocab"):
        assert tokenizer_from_gguf(_tiny_bpe_metadata(), pre_policy="default").pre_tokenizer == "default"
    assert any("overridden" in record.getMessage() for record in caplog.records)
    unknown = _tiny_bpe_metadata(**{"tokenizer.ggml.pre": "qwen-unknown"})
    assert tokenizer_from_gguf(unknown, pre_policy="llama-bpe").pre_tokenizer == "llama-bpe"
    assert tokenizer_from_gguf(_tiny_bpe_metadata()).pre_tokenizer == "gpt-2"  # no override: the file's


def test_falcon_e_files_split_as_llama3() -> None:
    """TII's Falcon-E GGUFs name `falcon_e` (bitnet.cpp's converter); ik_llama.cpp splits it as Llama-3
    (ignore_merges, BOS added by default): the same spec as llama-bpe, under the file's name."""
    falcon_e = tokenizer_from_gguf(_tiny_bpe_metadata(**{"tokenizer.ggml.pre": "falcon_e"}))
    llama3 = tokenizer_from_gguf(_tiny_bpe_metadata(**{"tokenizer.ggml.pre": "llama-bpe"}))
    assert falcon_e.pre_tokenizer == "falcon_e"
    text = "hello (world) 12345 émigré"
    assert falcon_e.encode(text) == llama3.encode(text)


def test_qwen2_splits_digits_one_by_one() -> None:
    """Qwen2's split (Qwen2.5, Qwen3, Bonsai; llama.cpp's QWEN2 type) is Llama-3's with single digits and
    neither ignore_merges nor a BOS by default: "12345" is five digits where llama-bpe splits "123" + "45"."""
    from bitserve.tokenizer.backends import gpt2_byte_to_unicode

    tokens = ["<|endoftext|>", "<|user|>", *gpt2_byte_to_unicode(), "he", "hel", "12", "123", "45"]
    metadata = _tiny_bpe_metadata(
        **{
            "tokenizer.ggml.tokens": tokens,
            "tokenizer.ggml.token_type": np.array([3, 4] + [1] * (len(tokens) - 2), dtype=np.int32),
            "tokenizer.ggml.merges": ["h e", "he l", "1 2", "12 3", "4 5"],
        }
    )
    qwen2 = tokenizer_from_gguf(metadata | {"tokenizer.ggml.pre": "qwen2"})
    llama3 = tokenizer_from_gguf(metadata | {"tokenizer.ggml.pre": "llama-bpe"})
    pieces = [qwen2.id_to_piece(i) for i in qwen2.encode("x 12345", add_special=False)]
    assert pieces == ["x", "Ġ", *"12345"]
    pieces = [llama3.id_to_piece(i) for i in llama3.encode("x 12345", add_special=False)]
    assert pieces == ["x", "Ġ", "123", "45"]
    alias = tokenizer_from_gguf(metadata | {"tokenizer.ggml.pre": "deepseek-r1-qwen"})
    assert alias.encode("hello 2024's 12345") == qwen2.encode("hello 2024's 12345")
    assert (qwen2.add_bos, llama3.add_bos) == (False, True)


@pytest.mark.parametrize(
    ("overrides", "error", "fragment"),
    [
        ({"tokenizer.ggml.pre": "qwen-unknown"}, UnsupportedModel, "llama-bpe"),
        ({"tokenizer.ggml.model": "bert"}, UnsupportedModel, "gpt2"),
        ({"tokenizer.ggml.model": None}, InvalidModelFile, "tokenizer.ggml.model"),
        ({"tokenizer.ggml.tokens": []}, InvalidModelFile, "tokenizer.ggml.tokens"),
        ({"tokenizer.ggml.tokens": ["a", "b", "a"]}, InvalidModelFile, "duplicate"),
        ({"tokenizer.ggml.token_type": np.array([1, 1], dtype=np.int32)}, InvalidModelFile, "entries"),
        ({"tokenizer.ggml.merges": None}, InvalidModelFile, "merges"),
        (
            {"tokenizer.ggml.bos_token_id": None, "tokenizer.ggml.add_bos_token": True},
            InvalidModelFile,
            "bos",
        ),
        ({"tokenizer.ggml.add_bos_token": "yes"}, InvalidModelFile, "boolean"),
    ],
)
def test_bad_metadata_is_a_clear_error(
    overrides: dict[str, Any], error: type[Exception], fragment: str
) -> None:
    metadata = {k: v for k, v in _tiny_bpe_metadata(**overrides).items() if v is not None}
    with pytest.raises(error, match=fragment):
        tokenizer_from_gguf(metadata)


def test_unknown_pre_policy_is_rejected() -> None:
    with pytest.raises(InvalidRequest, match="pre_policy"):
        tokenizer_from_gguf(_tiny_bpe_metadata(), pre_policy="nonsense")


def test_merges_apply_by_rank_and_bad_ones_are_dropped(caplog: pytest.LogCaptureFixture) -> None:
    metadata = _tiny_bpe_metadata(**{"tokenizer.ggml.merges": ["h e", "he l", "x y", "nospace", "h e"]})
    with caplog.at_level(logging.WARNING):
        tokenizer = tokenizer_from_gguf(metadata)
    assert "dropped 3 of 5" in caplog.text
    hel = tokenizer.piece_to_id("hel")
    assert tokenizer.encode("help", add_special=False) == [hel, tokenizer.piece_to_id("p")]


def test_decode_rejects_out_of_range_ids(smollm2_tokenizer: GGUFTokenizer) -> None:
    for bad in (-1, 49152, 2**40, True, 3.0, "7"):
        with pytest.raises(InvalidRequest, match="out of range"):
            smollm2_tokenizer.decode([bad])


def test_invalid_utf8_decodes_to_replacement_characters(smollm2_tokenizer: GGUFTokenizer) -> None:
    emoji_ids = smollm2_tokenizer.encode("😀", add_special=False)
    assert len(emoji_ids) > 1  # the emoji's 4 bytes span several byte-level tokens
    assert smollm2_tokenizer.decode(emoji_ids[:1]) == "\ufffd"
    assert smollm2_tokenizer.decode(emoji_ids) == "😀"


def test_lone_surrogates_encode_as_replacement_character(smollm2_tokenizer: GGUFTokenizer) -> None:
    assert smollm2_tokenizer.encode("a\ud800b") == smollm2_tokenizer.encode("a\ufffdb")


def test_byte_level_token_bytes_undo_the_byte_map(smollm2_tokenizer: GGUFTokenizer) -> None:
    assert smollm2_tokenizer.token_bytes(smollm2_tokenizer.piece_to_id("Ġthe")) == b" the"
    assert smollm2_tokenizer.token_bytes(smollm2_tokenizer.piece_to_id("Ċ")) == b"\n"
    assert smollm2_tokenizer.token_bytes(1) == b"<|im_start|>"
    assert smollm2_tokenizer.token_bytes(1, skip_special=True) == b""
    assert smollm2_tokenizer.id_to_piece(1) == "<|im_start|>"
    assert smollm2_tokenizer.is_special(1) and not smollm2_tokenizer.is_special(100)


def test_spm_space_prefix_byte_fallback_and_pieces(spm_tokenizer: GGUFTokenizer, build_variant: Any) -> None:
    tok = spm_tokenizer
    assert tok.kind == "spm" and tok.add_bos and tok.add_space_prefix
    hello = tok.piece_to_id("\u2581hello")
    assert hello is not None and tok.token_bytes(hello) == b" hello"
    assert tok.encode("hello", add_special=False) == [hello]
    # After a special token the next text gets the prefix space again (llama.cpp's rule).
    assert tok.encode("<start_of_turn>hello", add_special=False) == [
        tok.piece_to_id("<start_of_turn>"),
        hello,
    ]
    # A character outside the vocabulary falls back to its UTF-8 bytes as <0xNN> tokens.
    clef = "\U0001d11e"
    assert tok.piece_to_id(clef) is None
    clef_ids = tok.encode(clef, add_special=False)[1:]
    assert [tok.id_to_piece(i) for i in clef_ids] == ["<0xF0>", "<0x9D>", "<0x84>", "<0x9E>"]
    assert tok.decode(tok.encode(f"a {clef}")) == f" a {clef}"
    no_prefix = build_variant("spm_no_prefix")[0]
    assert no_prefix.encode("hello", add_special=False) == [no_prefix.piece_to_id("hello")]


def test_spm_merges_follow_scores_not_length() -> None:
    """llama.cpp's SPM joins the highest-scoring pair first: "ab"+"c" beats "a"+"bc" when "ab"
    scores higher, even though "bc" would also be a token."""
    tokens = ["<unk>", "<s>", "</s>", "a", "b", "c", "ab", "bc", "abc", "\u2581"]
    metadata = {
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.scores": np.array([0, 0, 0, -10, -10, -10, -1, -2, -5, -3], dtype=np.float32),
        "tokenizer.ggml.token_type": np.array([2, 3, 3, 1, 1, 1, 1, 1, 1, 1], dtype=np.int32),
        "tokenizer.ggml.add_space_prefix": False,
    }
    tokenizer = tokenizer_from_gguf(metadata)
    assert tokenizer.encode("abc", add_special=False) == [8]  # ab, then ab+c = abc
    assert tokenizer.encode("bcab", add_special=False) == [7, 6]
    assert tokenizer.encode("abc") == [1, 8]  # SPM adds BOS by default (bos 1)
