"""Special token ids of a GGUF vocabulary and its end-of-generation set, as llama.cpp derives them.

Ids come from `tokenizer.ggml.*_token_id` keys; missing ones are detected by token text, and the
tokens found that way are promoted to control tokens, exactly like llama.cpp's llama_vocab::load.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from numbers import Integral
from typing import Any

from bitserve.tokenizer.base import TokenType

logger = logging.getLogger(__name__)

# Per id that llama.cpp detects by text when its key is absent: the texts, first match wins
# (llama.cpp scans a hash map, so with several matches its pick is arbitrary).
_DETECTED_BY_TEXT: tuple[tuple[str, tuple[str, ...]], ...] = (
    (
        "eot",
        (
            "<|eot_id|>",
            "<|im_end|>",
            "<|end|>",
            "<end_of_turn>",
            "<|endoftext|>",
            "<|end_of_text|>",
            "<EOT>",
            "_<EOT>",
            "[EOT]",
            "<｜end▁of▁sentence｜>",
            "<end_of_utterance>",
        ),
    ),
    ("eom", ("<|eom_id|>",)),
    (
        "fim_pre",
        (
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ),
    ),
    (
        "fim_suf",
        (
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ),
    ),
    (
        "fim_mid",
        (
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ),
    ),
    ("fim_pad", ("<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]")),
    ("fim_rep", ("<|fim_repo|>", "<|repo_name|>", "<fim-repo>", "<REPO>", "<reponame>")),
    ("fim_sep", ("<|file_sep|>",)),
)
# Every token with one of these texts ends generation (llama.cpp's special_eog_ids).
_EOG_TEXTS = frozenset(
    (
        "<|eot_id|>",
        "<|im_end|>",
        "<|end|>",
        "<|return|>",
        "<|call|>",
        "<|flush|>",
        "<|calls|>",
        "<end_of_turn>",
        "<|endoftext|>",
        "</s>",
        "<|eom_id|>",
        "<EOT>",
        "_<EOT>",
        "[EOT]",
        "[EOS]",
        "<|end_of_text|>",
        "<end_of_utterance>",
        "<eos>",
        "<turn|>",
        "<|tool_response>",
        "<｜end▁of▁sentence｜>",
        "[e~[",
    )
)


@dataclass(frozen=True)
class SpecialTokenIds:
    """Ids named by the vocabulary; None where it names none (and no default applies)."""

    bos: int | None = None
    eos: int | None = None
    eot: int | None = None
    eom: int | None = None
    unk: int | None = None
    pad: int | None = None
    fim_pre: int | None = None
    fim_suf: int | None = None
    fim_mid: int | None = None
    fim_pad: int | None = None
    fim_rep: int | None = None
    fim_sep: int | None = None


def read_special_ids(
    metadata: Mapping[str, Any], tokens: Sequence[str], token_types: list[int], *, is_spm: bool
) -> tuple[SpecialTokenIds, frozenset[int]]:
    """The vocabulary's special ids and end-of-generation ids. Mutates `token_types`: tokens found
    by text become control tokens (so parse_special / skip_special treat them as llama.cpp does)."""
    num_tokens = len(tokens)
    # SPM defaults are llama.cpp's (bos 1, eos 2, unk 0). For BPE llama.cpp defaults bos/eos to 11,
    # a legacy of one model; bitserve leaves them unset instead.
    ids: dict[str, int | None] = {
        "bos": _read_id(metadata, "bos", 1 if is_spm else None, num_tokens),
        "eos": _read_id(metadata, "eos", 2 if is_spm else None, num_tokens),
        "unk": _read_id(metadata, "unknown", 0 if is_spm else None, num_tokens),
        "pad": _read_id(metadata, "padding", None, num_tokens),
    }
    wanted = {text for _, texts in _DETECTED_BY_TEXT for text in texts} | _EOG_TEXTS
    id_of_text = {token: token_id for token_id, token in enumerate(tokens) if token in wanted}
    for name, texts in _DETECTED_BY_TEXT:
        ids[name] = _read_id(metadata, name, None, num_tokens)
        if ids[name] is None:
            ids[name] = next((id_of_text[text] for text in texts if text in id_of_text), None)
            _promote_to_control(ids[name], tokens, token_types)
    named = (ids[name] for name in ("fim_pad", "fim_rep", "fim_sep", "eos", "eot", "eom"))
    eog = {token_id for token_id in named if token_id is not None}
    for text, token_id in id_of_text.items():
        if text in _EOG_TEXTS:
            eog.add(token_id)
            _promote_to_control(token_id, tokens, token_types)
    _apply_eog_workarounds(eog, id_of_text, token_types)
    return SpecialTokenIds(**ids), frozenset(eog)


def _read_id(metadata: Mapping[str, Any], name: str, default: int | None, num_tokens: int) -> int | None:
    key = f"tokenizer.ggml.{name}_token_id"
    default = default if default is not None and default < num_tokens else None
    value = metadata.get(key)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, Integral) or not 0 <= value < num_tokens:
        logger.warning("ignoring %s=%r (the vocabulary has %d tokens)", key, value, num_tokens)
        return default
    return int(value)


def _promote_to_control(token_id: int | None, tokens: Sequence[str], token_types: list[int]) -> None:
    if token_id is not None and token_types[token_id] != TokenType.CONTROL:
        logger.warning(
            "token %d %r looks like a control token; treating it as one", token_id, tokens[token_id]
        )
        token_types[token_id] = int(TokenType.CONTROL)


def _apply_eog_workarounds(eog: set[int], id_of_text: Mapping[str, int], token_types: list[int]) -> None:
    """llama.cpp's two exceptions: with <|return|> + <|call|> (or <|calls|> + <|flush|>), <|end|>
    is a user-defined token, not EOG; with <|tool_response>, </s> is a normal token, not EOG."""
    eog_texts = {text for text, token_id in id_of_text.items() if token_id in eog}
    end_id = id_of_text.get("<|end|>")
    has_call = bool(eog_texts & {"<|call|>", "<|calls|>"})
    if end_id in eog and has_call and eog_texts & {"<|return|>", "<|flush|>"}:
        eog.discard(end_id)
        token_types[end_id] = int(TokenType.USER_DEFINED)
    slash_s_id = id_of_text.get("</s>")
    if slash_s_id in eog and "<|tool_response>" in eog_texts:
        eog.discard(slash_s_id)
        token_types[slash_s_id] = int(TokenType.NORMAL)
