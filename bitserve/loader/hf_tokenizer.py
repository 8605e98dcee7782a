"""A checkpoint directory's tokenizer files (tokenizer.json, tokenizer_config.json, chat_template.jinja) ->
the GGUF `tokenizer.*` keys llama.cpp's converter (convert_hf_to_gguf.py, `_set_vocab_gpt2` and gguf-py's
SpecialVocab) writes for a byte-level BPE vocabulary, so a directory is tokenized exactly as its converted
GGUF is (tokenizer/gguf_vocab.py reads the keys either way).

- tokens in id order, padded to config.json's vocab_size with `[PAD{i}]` (type UNUSED, as llama.cpp);
  added tokens marked special are CONTROL, other added tokens USER_DEFINED, the rest NORMAL;
- merges as "a b" strings (tokenizer.json holds strings or pairs);
- the pre-tokenizer's llama.cpp name, recognized from tokenizer.json's pre_tokenizer pieces (HF's own
  spellings of the Llama-3, Qwen2, GPT-2 and StarCoder / SmolLM splits, or llama.cpp's regexes as
  bitserve's tables hold them); an unrecognized one is refused unless the caller names it (--tokenizer-pre);
- bos / eos / unk / pad ids from tokenizer_config.json's tokens (a string or {"content": ...}), else
  config.json's ids; add_bos_token / add_eos_token when tokenizer_config.json says;
- the chat template from tokenizer_config.json (a string, or named templates: "default"), else
  chat_template.jinja (transformers 5 writes it there).
Only byte-level BPE is converted; a SentencePiece-style (byte_fallback), Unigram or WordPiece tokenizer.json
is refused by name.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader.checkpoint_dir import read_json
from bitserve.loader.gguf_types import GGUFValueType
from bitserve.tokenizer.backends import SUPPORTED_PRE_TOKENIZERS, pre_tokenizer_spec

MAX_TOKENIZER_BYTES = 64 * 1024 * 1024  # Llama 3's tokenizer.json is 9 MB
MAX_TEMPLATE_BYTES = 1024 * 1024
MetadataValue = tuple[GGUFValueType, Any, GGUFValueType | None]
NORMAL, CONTROL, USER_DEFINED, UNUSED = 1, 3, 4, 5  # llama.cpp's token types

_CONTRACTIONS_HF = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)"
_TAIL = r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
# pre_tokenizer pieces as transformers' tokenizer.json spells them -> llama.cpp's pre-tokenizer name
_HF_PIECES: dict[tuple[tuple[str, Any], ...], str] = {
    (
        ("split", _CONTRACTIONS_HF + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}" + _TAIL),
        ("bytelevel", False),
    ): "llama-bpe",
    (("split", _CONTRACTIONS_HF + r"|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}" + _TAIL), ("bytelevel", False)): "qwen2",
    (("bytelevel", True),): "gpt-2",
    (("digits", True), ("bytelevel", True)): "smollm",
}
# a name picked when several of bitserve's tables hold the same regexes (aliases of one behaviour)
_PREFERRED = ("llama-bpe", "qwen2", "smollm", "gpt-2", "default", "dbrx")


def _pieces(pre_tokenizer: Any) -> tuple[tuple[str, Any], ...]:
    """tokenizer.json's pre_tokenizer -> (kind, setting) per step: Split regexes, ByteLevel's use_regex,
    Digits' individual_digits; any other step is kept by its type name (and matches nothing)."""
    if not isinstance(pre_tokenizer, dict):
        return ()
    if pre_tokenizer.get("type") == "Sequence":
        return tuple(p for step in pre_tokenizer.get("pretokenizers") or [] for p in _pieces(step))
    kind = pre_tokenizer.get("type")
    if kind == "Split":
        pattern = pre_tokenizer.get("pattern") or {}
        return (("split", pattern.get("Regex", pattern.get("String"))),)
    if kind == "ByteLevel":
        return (("bytelevel", bool(pre_tokenizer.get("use_regex", True))),)
    if kind == "Digits":
        return (("digits", bool(pre_tokenizer.get("individual_digits", False))),)
    return ((str(kind), None),)


def detect_pre_tokenizer(pre_tokenizer: Any, ignore_merges: bool) -> str | None:
    """llama.cpp's pre-tokenizer name for tokenizer.json's pre_tokenizer, or None when none matches."""
    pieces = _pieces(pre_tokenizer)
    if pieces in _HF_PIECES:
        return _HF_PIECES[pieces]
    matches = []
    for name in SUPPORTED_PRE_TOKENIZERS:
        spec = pre_tokenizer_spec(name)
        if pieces == (*(("split", regex) for regex in spec.regexes), ("bytelevel", False)):
            matches.append((spec.ignore_merges == ignore_merges, name in _PREFERRED, name))
    return max(matches)[2] if matches else None


def _read_tokenizer_json(directory: Path) -> dict[str, Any]:
    path = directory / "tokenizer.json"
    if not path.is_file():
        raise UnsupportedModel(
            "the checkpoint directory has no tokenizer.json",
            path=str(directory),
            hint="save the tokenizer beside the model (tokenizer.save_pretrained(DIR))",
        )
    data = read_json(path, MAX_TOKENIZER_BYTES)
    model = data.get("model") if isinstance(data, dict) else None
    if not isinstance(model, dict) or not isinstance(model.get("vocab"), dict):
        raise InvalidModelFile("tokenizer.json has no model.vocab", path=str(path))
    if model.get("type") != "BPE" or model.get("byte_fallback") or not _is_byte_level(data):
        found = f"{model.get('type')}{' with byte_fallback' if model.get('byte_fallback') else ''}"
        raise UnsupportedModel(
            f"tokenizer.json holds a {found} tokenizer; only byte-level BPE (GPT-2 style) is converted",
            path=str(path),
            hint="convert the checkpoint with llama.cpp's convert_hf_to_gguf.py and serve the GGUF",
        )
    return data


def _is_byte_level(data: Mapping[str, Any]) -> bool:
    decoder = data.get("decoder") or {}
    return decoder.get("type") == "ByteLevel" or any(
        kind == "bytelevel" for kind, _ in _pieces(data.get("pre_tokenizer"))
    )


def _merges(model: Mapping[str, Any]) -> list[str]:
    merges = model.get("merges") or []
    return [merge if isinstance(merge, str) else " ".join(merge) for merge in merges]


def _tokens(data: Mapping[str, Any], vocab_size: int) -> tuple[list[str], list[int]]:
    """Tokens in id order with their types, padded to vocab_size (llama.cpp's get_vocab_base)."""
    by_id = {int(token_id): token for token, token_id in data["model"]["vocab"].items()}
    types = dict.fromkeys(by_id, NORMAL)
    for added in data.get("added_tokens") or []:
        token_id = int(added["id"])
        by_id[token_id] = str(added["content"])
        types[token_id] = CONTROL if added.get("special") else USER_DEFINED
    size = max(vocab_size, max(by_id) + 1 if by_id else 0)
    tokens = [by_id.get(i, f"[PAD{i}]") for i in range(size)]
    return tokens, [types.get(i, UNUSED) for i in range(size)]


def _token_text(value: Any) -> str | None:
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) else None


def _special_ids(
    tokenizer_config: Mapping[str, Any], config: Mapping[str, Any], id_of: Mapping[str, int]
) -> dict[str, int]:
    ids: dict[str, int] = {}
    for kind, key in (
        ("bos", "bos_token"),
        ("eos", "eos_token"),
        ("unknown", "unk_token"),
        ("padding", "pad_token"),
    ):
        text = _token_text(tokenizer_config.get(key))
        if text is not None and text in id_of:
            ids[kind] = id_of[text]
            continue
        fallback = config.get(f"{key}_id")
        fallback = fallback[0] if isinstance(fallback, list) and fallback else fallback
        if isinstance(fallback, int) and 0 <= fallback < len(id_of):
            ids[kind] = fallback
    return ids


def _chat_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | None:
    template = tokenizer_config.get("chat_template")
    if isinstance(template, list):
        named = {entry.get("name"): entry.get("template") for entry in template if isinstance(entry, dict)}
        template = named.get("default")
    if isinstance(template, str):
        return template
    path = directory / "chat_template.jinja"
    if path.is_file():
        if path.stat().st_size > MAX_TEMPLATE_BYTES:
            raise InvalidModelFile(f"chat_template.jinja is over {MAX_TEMPLATE_BYTES} bytes", path=str(path))
        return path.read_text(encoding="utf-8")
    return None


def tokenizer_metadata_from_dir(
    directory: Path, config: Mapping[str, Any], *, pre: str | None = None
) -> dict[str, MetadataValue]:
    """The GGUF tokenizer.* keys (typed triples, for GGUFBuilder.add_kv) of DIR's tokenizer files; `pre`
    names the pre-tokenizer instead of recognizing it (see the module docstring)."""
    directory = Path(directory)
    data = _read_tokenizer_json(directory)
    config_path = directory / "tokenizer_config.json"
    tokenizer_config = read_json(config_path, MAX_TOKENIZER_BYTES) if config_path.is_file() else {}
    if not isinstance(tokenizer_config, dict):
        raise InvalidModelFile("tokenizer_config.json is not a JSON object", path=str(config_path))
    if pre is None:
        pre = detect_pre_tokenizer(data.get("pre_tokenizer"), bool(data["model"].get("ignore_merges")))
    if pre is None:
        raise UnsupportedModel(
            f"tokenizer.json's pre-tokenizer {_pieces(data.get('pre_tokenizer'))!r} is not recognized",
            path=str(directory / "tokenizer.json"),
            hint="name llama.cpp's pre-tokenizer with --tokenizer-pre (one of "
            f"{', '.join(SUPPORTED_PRE_TOKENIZERS)})",
        )
    pre_tokenizer_spec(pre)  # an unknown name is refused here, listing the known ones
    tokens, types = _tokens(data, int(config.get("vocab_size") or 0))
    string, u32, boolean, i32 = (
        GGUFValueType.STRING,
        GGUFValueType.UINT32,
        GGUFValueType.BOOL,
        GGUFValueType.INT32,
    )
    values: dict[str, MetadataValue] = {
        "tokenizer.ggml.model": (string, "gpt2", None),
        "tokenizer.ggml.pre": (string, pre, None),
        "tokenizer.ggml.tokens": (GGUFValueType.ARRAY, tokens, string),
        "tokenizer.ggml.token_type": (GGUFValueType.ARRAY, types, i32),
        "tokenizer.ggml.merges": (GGUFValueType.ARRAY, _merges(data["model"]), string),
    }
    id_of = {token: token_id for token_id, token in enumerate(tokens)}
    for kind, token_id in _special_ids(tokenizer_config, config, id_of).items():
        values[f"tokenizer.ggml.{kind}_token_id"] = (u32, token_id, None)
    for flag in ("add_bos_token", "add_eos_token"):
        if isinstance(tokenizer_config.get(flag), bool):
            values[f"tokenizer.ggml.{flag}"] = (boolean, tokenizer_config[flag], None)
    template = _chat_template(directory, tokenizer_config)
    if template is not None:
        values["tokenizer.chat_template"] = (string, template, None)
    return values


def plain_metadata(values: Mapping[str, MetadataValue]) -> dict[str, Any]:
    """The keys as GGUFFile.metadata holds them once read back: string arrays as lists, number arrays as
    numpy arrays, scalars as Python values."""
    plain: dict[str, Any] = {}
    for key, (value_type, value, array_type) in values.items():
        if value_type is GGUFValueType.ARRAY and array_type is not GGUFValueType.STRING:
            plain[key] = np.asarray(value, dtype=np.int32 if array_type is GGUFValueType.INT32 else None)
        else:
            plain[key] = value
    return plain
