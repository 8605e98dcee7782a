"""gguf-py's SpecialVocab (llama.cpp gguf-py/gguf/vocab.py), as convert_hf_to_gguf.py's `_set_vocab_gpt2` runs
it, over a checkpoint directory's already-read tokenizer files: the special token ids, the add_*_token flags
and the chat templates a converted GGUF carries (loader/hf_tokenizer.py writes the vocabulary itself).

Its rules, kept here because they decide which ids a converted file names:
- tokenizer_config.json's `<type>_token` (a string or {"content": ...}) resolves to an id only through
  tokenizer.json's added_tokens (first entry with that content), never through the BPE vocabulary;
- config.json's `<type>_token_id` (or its text_config's) fills the types still unset, and only a plain int
  counts: a list (e.g. Llama 3.1's eos_token_id) is ignored;
- `add_<type>_token` comes from the post_processor (TemplateProcessing / RobertaProcessing) and is then
  overridden by tokenizer_config.json's boolean; a template ending in a token other than the configured eos
  makes that token the eos and the configured one the eot;
- without a (non-empty) tokenizer_config.json no id comes from token text, only from config.json.
Two deliberate differences, both where gguf-py would crash or drop information: a negative or over-32-bit id
is skipped with a warning (gguf-py raises), and chat_template.jinja / chat_template.json are read even
without a tokenizer_config.json (gguf-py reads them only beside one).
"""

from __future__ import annotations

import logging
import string
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitserve.errors import InvalidModelFile
from bitserve.loader.checkpoint_dir import read_json
from bitserve.loader.gguf_types import GGUFValueType

logger = logging.getLogger(__name__)

MAX_TEMPLATE_BYTES = 4 * 1024 * 1024  # the largest chat templates published are ~100 KB
MAX_EXTRA_TEMPLATES = 64  # files in additional_chat_templates/
TOKEN_TYPES = ("bos", "eos", "unk", "sep", "pad", "cls", "mask")  # SpecialVocab's default types
# the types gguf-py's writer has a key for; SpecialVocab skips the others (cls) with a warning
ID_KEYS = {
    "bos": "tokenizer.ggml.bos_token_id",
    "eos": "tokenizer.ggml.eos_token_id",
    "eot": "tokenizer.ggml.eot_token_id",
    "eom": "tokenizer.ggml.eom_token_id",
    "unk": "tokenizer.ggml.unknown_token_id",
    "sep": "tokenizer.ggml.seperator_token_id",  # sic: llama.cpp's spelling
    "pad": "tokenizer.ggml.padding_token_id",
    "mask": "tokenizer.ggml.mask_token_id",
}
ADD_KEYS = {
    "bos": "tokenizer.ggml.add_bos_token",
    "eos": "tokenizer.ggml.add_eos_token",
    "sep": "tokenizer.ggml.add_sep_token",
}
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"
_TEMPLATE_NAME_CHARS = frozenset(string.ascii_letters + string.digits)
_MAX_UINT32 = (1 << 32) - 1


@dataclass
class SpecialVocab:
    """What SpecialVocab would add to a GGUF: ids by type, add_* flags by type, the chat template(s)."""

    ids: dict[str, int] = field(default_factory=dict)
    add: dict[str, bool] = field(default_factory=dict)
    chat_template: str | list[Any] | None = None


@dataclass
class _State:
    """SpecialVocab's working state while it reads the post_processor: a copy of tokenizer_config.json
    (None when there is none; its keys get rewritten), the token types, the add flags, and the bos / cls /
    eos / sep token texts (strings, or whatever tokenizer_config.json holds, dicts included)."""

    config: dict[str, Any] | None
    types: list[str]
    add: dict[str, bool]
    bos: Any
    cls: Any
    eos: Any
    sep: Any

    @classmethod
    def start(cls, tokenizer_config: Mapping[str, Any] | None) -> _State:
        config = dict(tokenizer_config) if tokenizer_config is not None else None
        get = (config or {}).get
        state = cls(
            config,
            list(TOKEN_TYPES),
            {},
            get("bos_token"),
            get("cls_token"),
            get("eos_token"),
            get("sep_token"),
        )
        if not state.bos and state.cls and config:  # BERT-style vocabularies name cls / sep only
            config["bos_token"] = state.bos = state.cls
        if not state.eos and state.sep and config:
            config["eos_token"] = state.eos = state.sep
        return state


def read_special_vocab(
    directory: Path,
    tokenizer_json: Mapping[str, Any],
    tokenizer_config: Mapping[str, Any] | None,
    config: Mapping[str, Any],
) -> SpecialVocab:
    """SpecialVocab's result for DIR (see the module docstring); `config` is config.json's dict."""
    state = _State.start(tokenizer_config)
    post = tokenizer_json.get("post_processor")
    if isinstance(post, dict) and post:
        processors = post.get("processors", [post])
        for processor in processors if isinstance(processors, list) else []:
            kind = processor.get("type") if isinstance(processor, dict) else None
            if kind == "RobertaProcessing":
                _roberta(state, processor)
            elif kind == "TemplateProcessing":
                first, last = _template_single(state, processor.get("single") or [])
                _template_pair(state, processor.get("pair") or [], first, last)
    vocab = SpecialVocab(add=state.add)
    added = tokenizer_json.get("added_tokens") or []
    if state.config:
        vocab.chat_template = _configured_template(directory, state.config)
        for typ in state.types:
            flag = state.config.get(f"add_{typ}_token")
            if isinstance(flag, bool):
                vocab.add[typ] = flag
            content = _content(state.config.get(f"{typ}_token"))
            if content is not None:
                matches = (t.get("id") for t in added if isinstance(t, dict) and t.get("content") == content)
                _set_id(vocab.ids, typ, next(matches, None))
    else:
        vocab.chat_template = _file_template(directory)
    text_config = config.get("text_config")
    for typ in state.types:
        token_id = config.get(f"{typ}_token_id")
        if token_id is None and isinstance(text_config, Mapping):  # multimodal configs (Kimi-VL)
            token_id = text_config.get(f"{typ}_token_id")
        _set_id(vocab.ids, typ, token_id)
    return vocab


def special_vocab_metadata(vocab: SpecialVocab) -> dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]:
    """The GGUF keys gguf-py's writer makes of `vocab` (types without a key are skipped, as it does)."""
    values: dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]] = {}
    for typ, token_id in vocab.ids.items():
        if typ in ID_KEYS:
            values[ID_KEYS[typ]] = (GGUFValueType.UINT32, token_id, None)
    for typ, flag in vocab.add.items():
        if typ in ADD_KEYS:
            values[ADD_KEYS[typ]] = (GGUFValueType.BOOL, flag, None)
    return values | chat_template_metadata(vocab.chat_template)


def chat_template_metadata(
    template: str | Sequence[Any] | None,
) -> dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]:
    """gguf-py's add_chat_template: a string is `tokenizer.chat_template`; named templates give
    `tokenizer.chat_template.<name>` each (name with non-alphanumerics as `_`), their names in
    `tokenizer.chat_templates`, and the one named "default" as `tokenizer.chat_template`."""
    string_type = GGUFValueType.STRING
    if template is None:
        return {}
    if isinstance(template, str):
        return {KEY_CHAT_TEMPLATE: (string_type, template, None)}
    values: dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]] = {}
    names: list[str] = []
    default = None
    for choice in template:
        if not isinstance(choice, Mapping):
            continue
        name = "".join(c if c in _TEMPLATE_NAME_CHARS else "_" for c in str(choice.get("name", "")))
        text = choice.get("template")
        if not name or not isinstance(text, str):
            continue
        if name == "default":
            default = text
            continue
        if name not in names:
            names.append(name)
        values[f"{KEY_CHAT_TEMPLATE}.{name}"] = (string_type, text, None)
    if names:
        values["tokenizer.chat_templates"] = (GGUFValueType.ARRAY, names, string_type)
    if default is not None:
        values[KEY_CHAT_TEMPLATE] = (string_type, default, None)
    return values


def read_text(path: Path, limit: int) -> str:
    """A UTF-8 text file of at most `limit` bytes; InvalidModelFile (with the path) when it is not."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise InvalidModelFile(f"{size} bytes, over the {limit} bytes allowed", path=str(path))
        return path.read_bytes().decode("utf-8")
    except OSError as exc:
        raise InvalidModelFile(f"cannot read: {exc.strerror or exc}", path=str(path)) from exc
    except UnicodeDecodeError as exc:
        raise InvalidModelFile(f"not UTF-8 text: {exc}", path=str(path)) from exc


def _content(entry: Any) -> str | None:
    """A tokenizer_config.json token: its text, from a string or an AddedToken dict."""
    if isinstance(entry, dict):
        entry = entry.get("content")
    return entry if isinstance(entry, str) else None


def _set_id(ids: dict[str, int], typ: str, token_id: Any) -> None:
    """SpecialVocab's _set_special_token: plain ints only, the first value set for a type wins."""
    if isinstance(token_id, bool) or not isinstance(token_id, int) or typ in ids:
        return
    if not 0 <= token_id <= _MAX_UINT32:
        logger.warning("ignoring special token %s id %d (not a GGUF uint32)", typ, token_id)
        return
    ids[typ] = token_id


def _special_id(item: Any) -> Any:
    """A template piece's special token text ({"SpecialToken": {"id": ...}}), else None."""
    piece = item.get("SpecialToken") if isinstance(item, dict) else None
    return piece.get("id") if isinstance(piece, dict) else None


def _sequence_id(item: Any) -> Any:
    """A template piece's sequence name ({"Sequence": {"id": "A"}}), else None."""
    piece = item.get("Sequence") if isinstance(item, dict) else None
    return piece.get("id") if isinstance(piece, dict) else None


def _first(value: Any, default: Any) -> Any:
    """RobertaProcessing's ["<s>", 0] pairs: the token text (`default` where the key is absent)."""
    if value is None:
        return default
    return value[0] if isinstance(value, list | tuple) and value else None


def _roberta(state: _State, processor: Mapping[str, Any]) -> None:
    """RobertaProcessing adds bos, eos and sep, and names cls / sep where the config does not."""
    state.add.update(bos=True, eos=True, sep=True)
    if not state.cls and state.config:
        state.cls = state.config["cls_token"] = _first(processor.get("cls"), state.bos)
    if not state.sep and state.config:
        state.sep = state.config["sep_token"] = _first(processor.get("sep"), state.eos)


def _template_single(state: _State, single: Sequence[Any]) -> tuple[Any, Any]:
    """TemplateProcessing's single-sequence template: a leading special token means add_bos (when it is
    the bos / cls), a trailing one add_eos (it becomes the eos; a different configured eos moves to eot,
    else eom). Returns the leading and trailing special token texts."""
    first = last = None
    if len(single) <= 1:
        return first, last
    first = _special_id(single[0])
    if first:
        if not state.config:
            state.bos = first
        state.add["bos"] = first in (state.bos, state.cls)
        if not state.add["bos"]:
            logger.warning("unknown leading special token %r in TemplateProcessing<single>", first)
    last = _special_id(single[-1])
    if last:
        if not state.config:
            state.eos = last
        elif last != state.eos:
            spare = next((typ for typ in ("eot", "eom") if typ not in state.types), None)
            if spare is None:
                logger.warning("overriding eos %r with %r without an eot / eom fallback", state.eos, last)
            else:
                state.types.append(spare)
                state.config[f"{spare}_token"] = state.eos
            state.config["eos_token"] = state.eos = last
        state.add["eos"] = last == state.eos
    return first, last


def _template_pair(state: _State, pair: Sequence[Any], first: Any, last: Any) -> None:
    """TemplateProcessing's pair template, for add_sep: `A [sep] B` (or `A [sep] [sep] B`) between the
    single template's leading / trailing tokens; a separator that is the sep or the eos means add_sep."""
    if not pair:
        return
    start = 1 if first and _special_id(pair[0]) == first else 0
    stop = -1 if last and _special_id(pair[-1]) == last else None
    middle = list(pair[start:stop])
    if not middle or _sequence_id(middle[0]) != "A" or _sequence_id(middle[-1]) != "B":
        return
    inner = middle[1:-1]
    if not inner:
        return
    add_sep = False
    entry = _special_id(inner[0])
    if entry and entry in (state.sep, state.eos) and not last:
        add_sep = True
    if len(inner) == 2:
        entry = _special_id(inner[1])
        if entry and entry in (state.sep, state.eos):
            add_sep = True
    state.add["sep"] = add_sep
    if add_sep and not state.sep and state.config:
        state.config["sep_token"] = state.eos


def _configured_template(directory: Path, tokenizer_config: Mapping[str, Any]) -> str | list[Any] | None:
    """tokenizer_config.json's chat_template (present, even null, it wins), else the template files."""
    template = tokenizer_config.get("chat_template", _file_template(directory))
    if template is None or isinstance(template, str | list):
        return template
    logger.warning("chat_template in tokenizer_config.json is a %s: ignored", type(template).__name__)
    return None


def _file_template(directory: Path) -> str | list[Any] | None:
    """chat_template.jinja (with additional_chat_templates/*.jinja: named templates, it "default"), else
    chat_template.json's "chat_template" (transformers' save_pretrained writes one of them)."""
    jinja = directory / "chat_template.jinja"
    if jinja.is_file():
        template = read_text(jinja, MAX_TEMPLATE_BYTES)
        extra = sorted((directory / "additional_chat_templates").glob("*.jinja"))
        if len(extra) > MAX_EXTRA_TEMPLATES:
            raise InvalidModelFile(
                f"{len(extra)} files in additional_chat_templates/, over the {MAX_EXTRA_TEMPLATES} allowed",
                path=str(directory),
            )
        if not extra:
            return template
        named = [{"name": path.stem, "template": read_text(path, MAX_TEMPLATE_BYTES)} for path in extra]
        return [{"name": "default", "template": template}, *named]
    json_file = directory / "chat_template.json"
    if json_file.is_file():
        data = read_json(json_file, MAX_TEMPLATE_BYTES)
        return data.get("chat_template") if isinstance(data, dict) else None
    return None
