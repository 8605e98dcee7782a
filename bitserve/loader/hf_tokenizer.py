"""A checkpoint directory's tokenizer files -> the GGUF `tokenizer.*` keys llama.cpp's converter
(convert_hf_to_gguf.py: `_set_vocab_gpt2` = `get_vocab_base` + gguf-py's SpecialVocab) writes for a byte-level
BPE vocabulary, so a directory is served, and converted, with the tokenizer its llama.cpp GGUF would have
(tokenizer/gguf_vocab.py reads the keys either way).

- tokens in id order (the BPE vocabulary with tokenizer.json's added tokens over it), padded to config.json's
  vocab_size with `[PAD{i}]` tokens of type UNUSED; an added token marked special, or that looks special
  (`<|...|>`, `<｜...｜>`, `<unused...>`, `<pad>`, `<mask>`...), is CONTROL, any other added token
  USER_DEFINED with U+2581 written as a space; a non-normalized added token is written as it decodes (the
  byte-level decoder: "café" becomes "caf" + U+FFFD), as get_vocab_base's encode/decode round trip has it;
  tokenizer_config.json's added_tokens_decoder overrides tokenizer.json's special / normalized flags, as
  transformers does when it loads the tokenizer;
- merges as "a b" strings (tokenizer.json holds strings or pairs; a space inside a pair's part is written
  as U+0120), else merges.txt's;
- `tokenizer.ggml.pre`: llama.cpp names the pre-tokenizer by hashing the tokenizer's output for known
  models; here it is recognized from tokenizer.json's pre_tokenizer steps, compared with the regexes of
  bitserve's pre-tokenizer table (tokenizer/backends.py) and the model's ignore_merges. An unrecognized
  one is refused unless the caller names it (`pre`, the CLI's --tokenizer-pre);
- special ids, add_*_token flags and chat templates: loader/hf_special_vocab.py (SpecialVocab's rules).
Only byte-level BPE is converted: a SentencePiece-style BPE (byte_fallback), Unigram or WordPiece
tokenizer.json is refused, naming what it holds.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader.checkpoint_dir import read_json
from bitserve.loader.gguf_types import SCALAR_FORMATS, GGUFValueType
from bitserve.loader.hf_special_vocab import read_special_vocab, read_text, special_vocab_metadata
from bitserve.tokenizer.backends import (
    GPT2_REGEX,
    SUPPORTED_PRE_TOKENIZERS,
    gpt2_byte_to_unicode,
    pre_tokenizer_spec,
)
from bitserve.tokenizer.base import TokenType

logger = logging.getLogger(__name__)

MAX_TOKENIZER_JSON_BYTES = 64 * 1024 * 1024  # Gemma 3's, among the largest published, is ~33 MB
MAX_TOKENIZER_CONFIG_BYTES = 16 * 1024 * 1024  # one with a full added_tokens_decoder reaches a few MB
MAX_MERGES_TXT_BYTES = 64 * 1024 * 1024
MAX_VOCAB_SIZE = 1 << 22  # token ids at or over this are refused (the largest vocabularies hold ~262k)
MetadataValue = tuple[GGUFValueType, Any, GGUFValueType | None]

_STRING, _ARRAY = GGUFValueType.STRING, GGUFValueType.ARRAY
# llama.cpp's regex engine has no (?i:...) groups: it spells tokenizer.json's contraction group case by case
# (ASCII only, where HF's Oniguruma also folds e.g. U+017F to s); the GGUF tokenizes llama.cpp's way
_HF_CONTRACTIONS = "(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_LLAMA_CONTRACTIONS = "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
_BYTE_LEVEL = ("byte_level",)
# the name picked when several names of bitserve's table split alike (aliases of one behaviour)
_PREFERRED = ("llama-bpe", "qwen2", "smollm", "gpt-2", "default", "dbrx")
# added tokens get_vocab_base treats as control tokens whatever their `special` flag says
_SPECIAL_LOOKING = frozenset(("<pad>", "<mask>", "<2mass>", "[@BOS@]"))
_SPECIAL_LOOKING_ENDS = (("<|", "|>"), ("<｜", "｜>"), ("<unused", ">"))


def tokenizer_metadata_from_dir(
    directory: Path, config: Mapping[str, Any], *, pre: str | None = None
) -> dict[str, MetadataValue]:
    """GGUF tokenizer.* keys (typed triples, ready for GGUFBuilder.add_kv) from DIR's tokenizer.json,
    tokenizer_config.json (optional), chat_template.jinja (optional), and `config` (config.json's dict, for
    vocab_size and the bos_token_id / eos_token_id fallbacks). `pre` names llama.cpp's pre-tokenizer
    instead of recognizing it. Raises UnsupportedModel / InvalidModelFile (see the module docstring)."""
    directory = Path(directory)
    path = directory / "tokenizer.json"
    data = _read_tokenizer_json(directory)
    tokenizer_config = _read_tokenizer_config(directory)
    model = data["model"]
    if pre is None:
        pre = _recognized_pre(data, path)
    pre_tokenizer_spec(pre)  # an unknown name is refused here, listing the known ones
    if data.get("normalizer"):
        logger.warning(
            "tokenizer.json's normalizer (%s) is not applied: llama.cpp's byte-level BPE applies none",
            _describe(data["normalizer"]),
        )
    tokens, token_types = _vocab(data, tokenizer_config, _config_vocab_size(config), path)
    values: dict[str, MetadataValue] = {
        "tokenizer.ggml.model": (_STRING, "gpt2", None),
        "tokenizer.ggml.pre": (_STRING, pre, None),
        "tokenizer.ggml.tokens": (_ARRAY, tokens, _STRING),
        "tokenizer.ggml.token_type": (_ARRAY, token_types, GGUFValueType.INT32),
    }
    merges = _merges(directory, model, path)
    if merges:
        values["tokenizer.ggml.merges"] = (_ARRAY, merges, _STRING)
    else:
        logger.warning("%s has no BPE merges (nor merges.txt): the vocabulary cannot tokenize", path)
    values |= special_vocab_metadata(read_special_vocab(directory, data, tokenizer_config, config))
    return values


def plain_metadata(values: Mapping[str, MetadataValue]) -> dict[str, Any]:
    """The keys as GGUFFile.metadata holds them once written and read back (gguf_cursor.py): scalars as
    Python values, string arrays as lists of str, bool arrays and number arrays as numpy arrays of the
    element type (little-endian)."""
    plain: dict[str, Any] = {}
    for key, (value_type, value, array_type) in values.items():
        if value_type is _ARRAY:
            plain[key] = _plain_array(value, array_type)
        elif value_type is GGUFValueType.BOOL:
            plain[key] = bool(value)
        elif value_type is _STRING:
            plain[key] = str(value)
        else:
            plain[key] = value
    return plain


def detect_pre_tokenizer(pre_tokenizer: Any, ignore_merges: bool) -> str | None:
    """llama.cpp's pre-tokenizer name for tokenizer.json's `pre_tokenizer` (with the BPE model's
    ignore_merges): the one of bitserve's table that splits the same way, or None."""
    names = _names_splitting_as(_steps(pre_tokenizer))
    return _preferred([name for name in names if pre_tokenizer_spec(name).ignore_merges == ignore_merges])


def _plain_array(value: Any, array_type: GGUFValueType | None) -> Any:
    if array_type is GGUFValueType.BOOL:
        return np.asarray(value, dtype=np.bool_)
    if array_type is not None and array_type in SCALAR_FORMATS:
        return np.asarray(value, dtype=np.dtype(SCALAR_FORMATS[array_type][0]))
    return list(value)  # strings (and nested arrays, which the tokenizer keys never hold)


def _read_tokenizer_json(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModel(
            "the checkpoint directory has no tokenizer.json",
            path=str(directory),
            hint="save the (fast) tokenizer beside the model: tokenizer.save_pretrained(DIR)",
        )
    data = read_json(path, MAX_TOKENIZER_JSON_BYTES)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict):
        raise InvalidModelFile("tokenizer.json has no model object", path=str(path))
    kind = model.get("type", "BPE" if "merges" in model else None)  # old files may leave out the type
    byte_fallback = bool(model.get("byte_fallback"))
    if kind != "BPE" or byte_fallback or not _is_byte_level(data):
        if kind != "BPE":
            found = f"a {kind} model" if isinstance(kind, str) else "a model of no known type"
        elif byte_fallback:
            found = "a SentencePiece-style BPE model (byte_fallback)"
        else:
            found = "a BPE model without a ByteLevel pre-tokenizer or decoder"
        raise UnsupportedModel(
            f"tokenizer.json holds {found}; only byte-level BPE (GPT-2 style, llama.cpp's 'gpt2' "
            "vocabulary) is converted from a checkpoint directory",
            path=str(path),
            hint="convert the checkpoint with llama.cpp's convert_hf_to_gguf.py and serve the GGUF",
        )
    if not isinstance(model.get("vocab"), dict):
        raise InvalidModelFile("tokenizer.json's BPE model has no vocab object", path=str(path))
    return data


def _read_tokenizer_config(directory: Path) -> dict[str, Any] | None:
    path = directory / "tokenizer_config.json"
    if not path.is_file():
        return None
    tokenizer_config = read_json(path, MAX_TOKENIZER_CONFIG_BYTES)
    if not isinstance(tokenizer_config, dict):
        raise InvalidModelFile("tokenizer_config.json is not a JSON object", path=str(path))
    return tokenizer_config


def _types_in(node: Any, nested: str) -> list[Any]:
    """The `type` of a tokenizer.json component and of its steps when it is a Sequence."""
    if not isinstance(node, dict):
        return []
    steps = node.get(nested) if node.get("type") == "Sequence" else None
    if isinstance(steps, list):
        return [kind for step in steps for kind in _types_in(step, nested)]
    return [node.get("type")]


def _is_byte_level(data: Mapping[str, Any]) -> bool:
    return "ByteLevel" in _types_in(data.get("pre_tokenizer"), "pretokenizers") or _decodes_byte_level(data)


def _decodes_byte_level(data: Mapping[str, Any]) -> bool:
    return "ByteLevel" in _types_in(data.get("decoder"), "decoders")


def _config_vocab_size(config: Mapping[str, Any]) -> int:
    """config.json's vocab_size (its text_config's for multimodal configs); 0 when it has none."""
    size = config.get("vocab_size")
    text_config = config.get("text_config")
    if size is None and isinstance(text_config, Mapping):
        size = text_config.get("vocab_size")
    if size is None:
        return 0
    if isinstance(size, bool) or not isinstance(size, int) or not 0 <= size <= MAX_VOCAB_SIZE:
        raise InvalidModelFile(
            f"config.json vocab_size={size!r}", expected=f"an int in [0, {MAX_VOCAB_SIZE}]"
        )
    return size


# --- pre-tokenizer recognition ---------------------------------------------------------------------------


def _canonical_regex(regex: str) -> str:
    """A split regex in llama.cpp's spelling. GPT-2 style patterns lose their final `|\\s+`, which llama.cpp
    leaves out and isolated splitting does not need (a lone unmatched whitespace is its own piece anyway)."""
    regex = regex.replace(_HF_CONTRACTIONS, _LLAMA_CONTRACTIONS)
    return regex.removesuffix(r"|\s+") if regex.endswith(r"\s+(?!\S)|\s+") else regex


def _steps(pre_tokenizer: Any) -> list[tuple[str, ...]]:
    """tokenizer.json's pre_tokenizer as llama.cpp's steps: ("split", regex) for each isolated regex split,
    ("byte_level",) for the byte map; a step llama.cpp has no equivalent of is ("unmatched", its JSON)."""
    if pre_tokenizer is None:
        return []
    if not isinstance(pre_tokenizer, dict):
        return [("unmatched", _describe(pre_tokenizer))]
    kind = pre_tokenizer.get("type")
    if kind == "Sequence" and isinstance(pre_tokenizer.get("pretokenizers"), list):
        return [step for inner in pre_tokenizer["pretokenizers"] for step in _steps(inner)]
    if kind == "Split":
        pattern = pre_tokenizer.get("pattern")
        regex = pattern.get("Regex") if isinstance(pattern, dict) else None
        if (
            isinstance(regex, str)
            and pre_tokenizer.get("behavior") == "Isolated"
            and not pre_tokenizer.get("invert")
        ):
            return [("split", _canonical_regex(regex))]
    elif kind == "ByteLevel" and not pre_tokenizer.get("add_prefix_space", True):
        # use_regex: GPT-2's split first, in its own ByteLevel step
        split = [("split", _canonical_regex(GPT2_REGEX))] if pre_tokenizer.get("use_regex", True) else []
        return [*split, _BYTE_LEVEL]
    elif kind == "Digits":  # Rust's char::is_numeric is \p{N}
        return [("split", r"\p{N}" if pre_tokenizer.get("individual_digits") else r"\p{N}+")]
    return [("unmatched", _describe(pre_tokenizer))]


def _names_splitting_as(steps: list[tuple[str, ...]]) -> list[str]:
    """The names of bitserve's table whose regexes (then the byte map) are exactly `steps`."""
    return [
        name
        for name in SUPPORTED_PRE_TOKENIZERS
        if steps == [*(("split", _canonical_regex(r)) for r in pre_tokenizer_spec(name).regexes), _BYTE_LEVEL]
    ]


def _preferred(names: list[str]) -> str | None:
    return next((name for name in _PREFERRED if name in names), names[0] if names else None)


def _recognized_pre(data: Mapping[str, Any], path: Path) -> str:
    """The pre-tokenizer name for tokenizer.json, or UnsupportedModel naming what it holds."""
    ignore_merges = bool(data["model"].get("ignore_merges"))
    name = detect_pre_tokenizer(data.get("pre_tokenizer"), ignore_merges)
    if name is not None:
        return name
    steps = _steps(data.get("pre_tokenizer"))
    alike = _preferred(_names_splitting_as(steps))
    if alike is not None:
        message = (
            f"tokenizer.json's pre-tokenizer splits as {alike!r} does, but its BPE model has "
            f"ignore_merges={ignore_merges} where {alike!r} has {not ignore_merges}"
        )
    else:
        found = "; ".join(f"Split {s[1]!r}" if s[0] == "split" else " ".join(s) for s in steps) or "none"
        message = f"tokenizer.json's pre-tokenizer is not one bitserve recognizes: {found}"
    raise UnsupportedModel(
        message,
        path=str(path),
        hint="if it splits text as one of llama.cpp's pre-tokenizers, name that one with --tokenizer-pre "
        f"(one of {', '.join(SUPPORTED_PRE_TOKENIZERS)})",
    )


def _describe(node: Any) -> str:
    text = json.dumps(node, ensure_ascii=False, sort_keys=True)
    return text if len(text) <= 300 else text[:297] + "..."


# --- tokens, types, merges ------------------------------------------------------------------------------


def _added_tokens(
    data: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None, path: Path
) -> dict[int, dict[str, Any]]:
    """tokenizer.json's added tokens by id ({content, special, normalized}), with tokenizer_config.json's
    added_tokens_decoder flags over them where it names the same token (transformers' precedence)."""
    entries = data.get("added_tokens") or []
    if not isinstance(entries, list):
        raise InvalidModelFile("tokenizer.json's added_tokens is not a list", path=str(path))
    added: dict[int, dict[str, Any]] = {}
    for entry in entries:
        token_id = entry.get("id") if isinstance(entry, dict) else None
        if (
            isinstance(token_id, bool)
            or not isinstance(token_id, int)
            or not isinstance(entry.get("content"), str)
        ):
            raise InvalidModelFile(f"tokenizer.json added token {_describe(entry)}", path=str(path))
        special = bool(entry.get("special"))
        added[token_id] = {
            "content": entry["content"],
            "special": special,
            "normalized": bool(entry.get("normalized", not special)),
        }
    overrides = (tokenizer_config or {}).get("added_tokens_decoder")
    for key, entry in overrides.items() if isinstance(overrides, dict) else ():
        token_id = int(key) if isinstance(key, str) and key.isdigit() else None
        if (
            token_id in added
            and isinstance(entry, dict)
            and entry.get("content") == added[token_id]["content"]
        ):
            for flag in ("special", "normalized"):
                if isinstance(entry.get(flag), bool):
                    added[token_id][flag] = entry[flag]
    return added


def _id_to_token(
    vocab: Mapping[str, Any], added: Mapping[int, Mapping[str, Any]], path: Path
) -> dict[int, str]:
    """transformers' get_vocab() reversed: the BPE vocabulary with the added tokens over it (an id whose
    text an added token took elsewhere ends up with no token: a [PAD] entry, as in llama.cpp)."""
    id_of = dict(vocab)
    id_of.update((entry["content"], token_id) for token_id, entry in added.items())
    by_id: dict[int, str] = {}
    for token, token_id in id_of.items():
        if isinstance(token_id, bool) or not isinstance(token_id, int) or not 0 <= token_id < MAX_VOCAB_SIZE:
            raise InvalidModelFile(
                f"tokenizer.json token {token!r} has id {token_id!r}",
                path=str(path),
                expected=f"an int in [0, {MAX_VOCAB_SIZE})",
            )
        by_id[token_id] = token
    return by_id


def _vocab(
    data: Mapping[str, Any], tokenizer_config: Mapping[str, Any] | None, vocab_size: int, path: Path
) -> tuple[list[str], list[int]]:
    """get_vocab_base: tokens in id order with their llama.cpp token types, padded to vocab_size."""
    added = _added_tokens(data, tokenizer_config, path)
    by_id = _id_to_token(data["model"]["vocab"], added, path)
    round_trip = _decodes_byte_level(data)
    tokens: list[str] = []
    token_types: list[int] = []
    for token_id in range(max(vocab_size, max(by_id, default=-1) + 1)):
        token = by_id.get(token_id)
        entry = added.get(token_id)
        if token is None:
            token, token_type = f"[PAD{token_id}]", TokenType.UNUSED
        elif entry is None or entry["content"] != token:
            token_type = TokenType.NORMAL
        else:
            if not entry["normalized"] and round_trip:
                token = _byte_level_decoded(token)
            if entry["special"] or _looks_special(token):
                token_type = TokenType.CONTROL
            else:
                token, token_type = token.replace("\u2581", " "), TokenType.USER_DEFINED
        tokens.append(token)
        token_types.append(int(token_type))
    return tokens, token_types


_BYTE_OF_CHAR = {char: byte for byte, char in enumerate(gpt2_byte_to_unicode())}


def _byte_level_decoded(token: str) -> str:
    """The text HF's ByteLevel decoder gives for one token: the bytes its characters stand for (invalid
    UTF-8 as U+FFFD); a token with a character outside the byte map is kept as it is."""
    if all(char in _BYTE_OF_CHAR for char in token):
        return bytes(_BYTE_OF_CHAR[char] for char in token).decode("utf-8", errors="replace")
    return token


def _looks_special(token: str) -> bool:
    """get_vocab_base's does_token_look_special: added tokens some models forget to mark special."""
    return token in _SPECIAL_LOOKING or any(
        token.startswith(head) and token.endswith(tail) for head, tail in _SPECIAL_LOOKING_ENDS
    )


def _merges(directory: Path, model: Mapping[str, Any], path: Path) -> list[str]:
    """SpecialVocab's merges: model.merges as "a b" strings (pairs joined, a space in a part as U+0120,
    the byte map's space), else merges.txt's lines."""
    merges = model.get("merges")
    if isinstance(merges, list) and merges:
        if all(isinstance(merge, str) for merge in merges):
            return list(merges)
        if all(
            isinstance(merge, list) and len(merge) == 2 and all(isinstance(part, str) for part in merge)
            for merge in merges
        ):
            return [" ".join(part.replace(" ", "\u0120") for part in merge) for merge in merges]
        raise InvalidModelFile(
            'tokenizer.json\'s model.merges is neither "a b" strings nor [a, b] pairs', path=str(path)
        )
    return _merges_txt(directory / "merges.txt")


def _merges_txt(path: Path) -> list[str]:
    """merges.txt: one "a b" per line, a leading "#version" line skipped, malformed lines dropped."""
    if not path.is_file():
        return []
    lines = read_text(path, MAX_MERGES_TXT_BYTES).replace("\r\n", "\n").replace("\r", "\n").split("\n")
    if lines and lines[0].strip().startswith("#"):
        lines = lines[1:]
    merges = []
    for line in lines:
        parts = line.strip().split(None, 3)
        if len(parts) == 2:
            merges.append(f"{parts[0]} {parts[1]}")
    return merges
