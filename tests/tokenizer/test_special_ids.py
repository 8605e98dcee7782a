"""read_special_ids: keys first, then llama.cpp's detection by text, control promotion, EOG set."""

from __future__ import annotations

import logging
from typing import Any

import pytest

from bitserve.tokenizer.base import TokenType
from bitserve.tokenizer.special_ids import read_special_ids

NORMAL, CONTROL = int(TokenType.NORMAL), int(TokenType.CONTROL)


def _read(
    tokens: list[str], metadata: dict[str, Any] | None = None, *, is_spm: bool = False
) -> tuple[Any, ...]:
    token_types = [CONTROL if t.startswith("<") else NORMAL for t in tokens]
    ids, eog = read_special_ids(metadata or {}, tokens, token_types, is_spm=is_spm)
    return ids, eog, token_types


def test_keys_win_over_text_detection() -> None:
    tokens = ["a", "<|eot_id|>", "<|im_end|>", "<|end_of_text|>"]
    ids, eog, _ = _read(tokens, {"tokenizer.ggml.eot_token_id": 2, "tokenizer.ggml.eos_token_id": 3})
    assert (ids.eot, ids.eos) == (2, 3)
    assert eog == {1, 2, 3}  # every EOG text counts, whatever the keys name


def test_detection_follows_llama_cpp_priority_and_promotes_to_control(
    caplog: pytest.LogCaptureFixture,
) -> None:
    tokens = ["a", "<|im_end|>", "<|eot_id|>"]
    token_types = [NORMAL, NORMAL, NORMAL]
    with caplog.at_level(logging.WARNING):
        ids, eog = read_special_ids({}, tokens, token_types, is_spm=False)
    assert ids.eot == 2  # <|eot_id|> ranks before <|im_end|>
    assert eog == {1, 2}
    assert token_types == [NORMAL, CONTROL, CONTROL]
    assert "looks like a control token" in caplog.text


def test_bpe_has_no_default_ids_but_spm_has_llama_cpp_defaults() -> None:
    ids, eog, _ = _read(["x", "y", "z"])
    assert (ids.bos, ids.eos, ids.unk) == (None, None, None) and eog == frozenset()
    ids, eog, _ = _read(["<unk>", "<s>", "</s>"], is_spm=True)
    assert (ids.bos, ids.eos, ids.unk) == (1, 2, 0) and eog == {2}


def test_out_of_range_or_malformed_ids_are_ignored(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING):
        ids, _, _ = _read(["x", "y"], {"tokenizer.ggml.bos_token_id": 7, "tokenizer.ggml.eos_token_id": True})
    assert ids.bos is None and ids.eos is None
    assert "ignoring tokenizer.ggml.bos_token_id=7" in caplog.text


def test_fim_tokens_end_generation() -> None:
    ids, eog, _ = _read(["x", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<|fim_prefix|>"])
    assert (ids.fim_pad, ids.fim_rep, ids.fim_sep, ids.fim_pre) == (1, 2, 3, 4)
    assert eog == {1, 2, 3}


def test_harmony_end_is_not_eog_and_becomes_user_defined() -> None:
    _, eog, token_types = _read(["x", "<|return|>", "<|call|>", "<|end|>"])
    assert eog == {1, 2}
    assert token_types[3] == TokenType.USER_DEFINED


def test_slash_s_is_not_eog_beside_tool_response() -> None:
    _, eog, token_types = _read(["x", "</s>", "<|tool_response>"])
    assert eog == {2}
    assert token_types[1] == TokenType.NORMAL
