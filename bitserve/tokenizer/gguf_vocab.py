"""GGUF `tokenizer.*` metadata -> GGUFTokenizer: llama.cpp's token ids, computed by HF `tokenizers`.

Byte-level BPE (`gpt2`) and SentencePiece-style (`llama`) vocabularies. Takes the plain metadata
mapping of bitserve.loader.gguf_reader; never imports the `gguf` package.
"""

from __future__ import annotations

import array
import itertools
import logging
import re
from collections.abc import Mapping, Sequence
from numbers import Integral, Real
from typing import Any

from tokenizers import Tokenizer as HFTokenizer

from bitserve.errors import InvalidModelFile, InvalidRequest, UnsupportedModel
from bitserve.tokenizer.backends import (
    SUPPORTED_PRE_TOKENIZERS,
    PreTokenizerSpec,
    build_byte_level_bpe,
    build_spm_bpe,
    gpt2_byte_to_unicode,
    pre_tokenizer_spec,
)
from bitserve.tokenizer.base import TokenType
from bitserve.tokenizer.special_ids import SpecialTokenIds, read_special_ids
from bitserve.tokenizer.special_tokens import Fragment, SpecialTokenMatcher

logger = logging.getLogger(__name__)

KEY_MODEL = "tokenizer.ggml.model"
KEY_PRE = "tokenizer.ggml.pre"
KEY_TOKENS = "tokenizer.ggml.tokens"
KEY_SCORES = "tokenizer.ggml.scores"
KEY_TOKEN_TYPE = "tokenizer.ggml.token_type"
KEY_MERGES = "tokenizer.ggml.merges"
KEY_ADD_BOS = "tokenizer.ggml.add_bos_token"
KEY_ADD_EOS = "tokenizer.ggml.add_eos_token"
KEY_ADD_SPACE_PREFIX = "tokenizer.ggml.add_space_prefix"
KEY_CHAT_TEMPLATE = "tokenizer.chat_template"

# What a file without `tokenizer.ggml.pre` is tokenized as (docs/formats.md §5.2): the Llama-3 split that
# BitNet b1.58 2B-4T was trained with. llama.cpp / bitnet.cpp use "default" instead.
MISSING_PRE_POLICY = "llama-bpe"
SUPPORTED_MODELS = ("gpt2", "llama")

_SURROGATES = re.compile("[\ud800-\udfff]")
_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


class GGUFTokenizer:
    """A GGUF vocabulary's tokenizer. Encoding matches llama.cpp's `llama_tokenize` token for token.

    Built by `tokenizer_from_gguf`; immutable after construction and safe to share across threads.
    """

    def __init__(
        self,
        *,
        kind: str,
        pre_tokenizer: str | None,
        backend: HFTokenizer,
        tokens: list[str],
        token_types: list[int],
        special_ids: SpecialTokenIds,
        eos_token_ids: frozenset[int],
        add_bos: bool,
        add_eos: bool,
        add_space_prefix: bool,
        chat_template: str | None,
    ) -> None:
        self.kind = kind  # "bpe" (byte-level) or "spm"
        self.pre_tokenizer = pre_tokenizer
        self.special_ids = special_ids
        self.chat_template = chat_template
        self._backend = backend
        self._tokens = tokens
        self._token_types = token_types
        self._eos_token_ids = eos_token_ids
        self._add_bos = add_bos
        self._add_eos = add_eos
        # What add_special puts around the text; the factory guarantees the ids exist when asked.
        self._bos_ids = (special_ids.bos,) if add_bos and special_ids.bos is not None else ()
        self._eos_ids = (special_ids.eos,) if add_eos and special_ids.eos is not None else ()
        self._add_space_prefix = add_space_prefix
        # every token's bytes in one buffer, token i at [offsets[i], offsets[i + 1]): ~1 MB for a
        # 128,256-token vocabulary where a list of bytes objects took 6.7 MB
        pieces = _piece_bytes(tokens, token_types, is_spm=kind == "spm")
        self._piece_offsets = array.array("Q", itertools.accumulate(map(len, pieces), initial=0))
        self._piece_buffer = b"".join(pieces)
        hidden = (TokenType.CONTROL, TokenType.UNKNOWN)
        self._is_hidden = bytes(t in hidden for t in token_types)  # 1 where skip_special hides it
        self._matcher = SpecialTokenMatcher(
            (tokens[i], i, t in hidden)
            for i, t in enumerate(token_types)
            if t in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED)
        )

    @property
    def vocab_size(self) -> int:
        return len(self._tokens)

    @property
    def bos_token_id(self) -> int | None:
        return self.special_ids.bos

    @property
    def eos_token_id(self) -> int | None:
        return self.special_ids.eos

    @property
    def eos_token_ids(self) -> frozenset[int]:
        return self._eos_token_ids

    @property
    def add_bos(self) -> bool:
        return self._add_bos

    @property
    def add_eos(self) -> bool:
        return self._add_eos

    @property
    def add_space_prefix(self) -> bool:
        """SPM only: a space is put before text at the start and after each special token."""
        return self._add_space_prefix

    def encode(self, text: str, *, add_special: bool = True, parse_special: bool = True) -> list[int]:
        """Token ids for `text`, as llama.cpp's llama_tokenize(text, add_special, parse_special).

        Lone UTF-16 surrogates (possible in JSON input) are encoded as U+FFFD.
        """
        if not isinstance(text, str):
            raise InvalidRequest(
                f"text to tokenize must be a string, not {type(text).__name__}", param="prompt"
            )
        if _SURROGATES.search(text):
            text = _SURROGATES.sub("\ufffd", text)
        ids = list(self._bos_ids) if add_special else []
        for fragment in self._prepare_fragments(self._matcher.split(text, parse_special=parse_special)):
            if isinstance(fragment, int):
                ids.append(fragment)
            else:
                ids.extend(self._backend.encode(fragment, add_special_tokens=False).ids)
        if add_special:
            ids.extend(self._eos_ids)
        return ids

    def _prepare_fragments(self, fragments: list[Fragment]) -> list[Fragment]:
        """Raw text as the backend wants it. SPM: spaces become U+2581 and, with add_space_prefix,
        text at the start or right after a special token gets a leading space (llama.cpp's rule)."""
        if self.kind != "spm":
            return fragments
        prepared: list[Fragment] = []
        is_prev_special = True
        for fragment in fragments:
            if isinstance(fragment, str):
                if self._add_space_prefix and is_prev_special:
                    fragment = " " + fragment
                fragment = fragment.replace(" ", "\u2581")
            prepared.append(fragment)
            is_prev_special = isinstance(fragment, int)
        return prepared

    def decode(self, token_ids: Sequence[int], *, skip_special: bool = True) -> str:
        """UTF-8 text of the tokens' bytes (invalid sequences -> U+FFFD); no spaces are cleaned."""
        pieces = [self.token_bytes(token_id, skip_special=skip_special) for token_id in token_ids]
        return b"".join(pieces).decode("utf-8", errors="replace")

    def token_bytes(self, token_id: int, *, skip_special: bool = False) -> bytes:
        """Bytes `token_id` adds to decoded text: byte-level BPE undoes the GPT-2 byte map, SPM turns
        U+2581 into a space and `<0xNN>` into its byte; special tokens give their text unless
        skipped. Unused / undefined tokens give nothing (llama.cpp's token_to_piece)."""
        self._check_id(token_id)
        if skip_special and self._is_hidden[token_id]:
            return b""
        return self._piece_buffer[self._piece_offsets[token_id] : self._piece_offsets[token_id + 1]]

    def id_to_piece(self, token_id: int) -> str:
        self._check_id(token_id)
        return self._tokens[token_id]

    def piece_to_id(self, piece: str) -> int | None:
        """The id of the vocabulary entry `piece` (stored form, e.g. `Ġthe`), or None."""
        return self._backend.token_to_id(piece)

    def token_type(self, token_id: int) -> TokenType:
        self._check_id(token_id)
        try:
            return TokenType(self._token_types[token_id])
        except ValueError:  # llama.cpp reads unknown type values as undefined
            return TokenType.UNDEFINED

    def is_special(self, token_id: int) -> bool:
        self._check_id(token_id)
        return bool(self._is_hidden[token_id])

    def _check_id(self, token_id: int) -> None:
        # the common case first: a plain int in range (the ABC check below costs ~1 us, and the stream
        # path calls this for every generated token: 5.7% of the API process under a 256-stream burst)
        if type(token_id) is int and 0 <= token_id < len(self._tokens):
            return
        if (
            isinstance(token_id, bool)
            or not isinstance(token_id, Integral)
            or not 0 <= token_id < len(self._tokens)
        ):
            raise InvalidRequest(
                f"token id {token_id!r} is out of range",
                param="token_ids",
                hint=f"token ids are integers in [0, {len(self._tokens)})",
            )

    def __repr__(self) -> str:
        return (
            f"GGUFTokenizer(kind={self.kind!r}, pre={self.pre_tokenizer!r}, vocab_size={self.vocab_size}, "
            f"bos={self.bos_token_id}, eos_ids={sorted(self._eos_token_ids)}, add_bos={self._add_bos})"
        )


def tokenizer_from_gguf(metadata: Mapping[str, Any], *, pre_policy: str | None = None) -> GGUFTokenizer:
    """Build the tokenizer a GGUF file describes.

    pre_policy: the pre-tokenizer of a byte-level BPE file, overriding the one it names (a file whose
    `tokenizer.ggml.pre` is wrong, or one bitserve does not know); for a file that names none, it is the
    choice (default "llama-bpe", docs/formats.md §5.2; "default" reproduces llama.cpp / bitnet.cpp).
    Raises InvalidModelFile / UnsupportedModel.
    """
    if pre_policy is not None and pre_policy not in SUPPORTED_PRE_TOKENIZERS:
        raise InvalidRequest(
            f"unknown pre_policy {pre_policy!r}",
            param="pre_policy",
            hint=f"one of {', '.join(SUPPORTED_PRE_TOKENIZERS)}",
        )
    is_spm = _read_model(metadata) == "llama"
    tokens = _read_tokens(metadata)
    token_types = _read_number_array(metadata, KEY_TOKEN_TYPE, len(tokens), default=int(TokenType.NORMAL))
    pre_spec = None if is_spm else _resolve_pre(metadata, pre_policy)
    special_ids, eos_token_ids = read_special_ids(metadata, tokens, token_types, is_spm=is_spm)
    default_add_bos = is_spm or (pre_spec is not None and pre_spec.default_add_bos)
    add_bos = _resolve_add_flag(metadata, KEY_ADD_BOS, default_add_bos, special_ids.bos, "bos")
    add_eos = _resolve_add_flag(metadata, KEY_ADD_EOS, False, special_ids.eos, "eos")
    add_space_prefix = _get_bool(metadata, KEY_ADD_SPACE_PREFIX)
    tokenizer = GGUFTokenizer(
        kind="spm" if is_spm else "bpe",
        pre_tokenizer=None if pre_spec is None else pre_spec.name,
        backend=_build_backend(metadata, tokens, pre_spec, special_ids.unk),
        tokens=tokens,
        token_types=token_types,
        special_ids=special_ids,
        eos_token_ids=eos_token_ids,
        add_bos=add_bos,
        add_eos=add_eos,
        add_space_prefix=is_spm if add_space_prefix is None else add_space_prefix,
        chat_template=_get_str(metadata, KEY_CHAT_TEMPLATE),
    )
    logger.info("loaded tokenizer %r", tokenizer)
    return tokenizer


def _read_model(metadata: Mapping[str, Any]) -> str:
    model = _get_str(metadata, KEY_MODEL)
    if model is None:
        raise InvalidModelFile(f"missing metadata key {KEY_MODEL!r}", hint="the file carries no tokenizer")
    if model not in SUPPORTED_MODELS:
        raise UnsupportedModel(
            f"unsupported tokenizer model {KEY_MODEL}={model!r}", expected=f"one of {SUPPORTED_MODELS}"
        )
    return model


def _build_backend(
    metadata: Mapping[str, Any], tokens: list[str], pre_spec: PreTokenizerSpec | None, unk: int | None
) -> HFTokenizer:
    """Byte-level BPE with `pre_spec`'s splitting, or SPM (pre_spec None) from the scores."""
    if pre_spec is None:
        scores = _read_number_array(metadata, KEY_SCORES, len(tokens), default=0.0)
        return build_spm_bpe(tokens, scores, tokens[unk] if unk is not None else None)
    merges = metadata.get(KEY_MERGES)
    if not isinstance(merges, Sequence) or isinstance(merges, str):
        raise InvalidModelFile(
            f"byte-level BPE vocabulary without {KEY_MERGES!r}", expected="a list of merges"
        )
    return build_byte_level_bpe(tokens, merges, pre_spec)


def _resolve_pre(metadata: Mapping[str, Any], pre_policy: str | None) -> PreTokenizerSpec:
    pre = _get_str(metadata, KEY_PRE)
    if not pre:
        policy = pre_policy or MISSING_PRE_POLICY
        logger.warning(
            "GGUF has no %s: tokenizing with the %r pre-tokenizer (pre_policy=%r; 'default' matches "
            "llama.cpp / bitnet.cpp, 'llama-bpe' the Llama-3 split)",
            KEY_PRE,
            policy,
            pre_policy,
        )
        return pre_tokenizer_spec(policy)
    if pre_policy is not None and pre_policy != pre:
        logger.warning("%s=%r in the file is overridden: tokenizing with %r", KEY_PRE, pre, pre_policy)
        return pre_tokenizer_spec(pre_policy)
    return pre_tokenizer_spec(pre)


def _read_tokens(metadata: Mapping[str, Any]) -> list[str]:
    tokens = metadata.get(KEY_TOKENS)
    if not isinstance(tokens, Sequence) or isinstance(tokens, str) or len(tokens) == 0:
        raise InvalidModelFile(f"missing or empty {KEY_TOKENS!r}", expected="a non-empty list of strings")
    result: list[str] = []
    seen: dict[str, int] = {}
    for token_id, token in enumerate(tokens):
        if not isinstance(token, str):
            raise InvalidModelFile(f"{KEY_TOKENS}[{token_id}] is {type(token).__name__}", expected="a string")
        if not token:
            logger.warning("empty token at index %d", token_id)
            token = f"[EMPTY_{token_id}]"  # llama.cpp's placeholder
        first_id = seen.setdefault(token, token_id)
        if first_id != token_id:
            raise InvalidModelFile(
                f"duplicate token {token!r} in the vocabulary: ids {first_id} and {token_id}"
            )
        result.append(token)
    return result


def _read_number_array(metadata: Mapping[str, Any], key: str, num_tokens: int, *, default: Any) -> list[Any]:
    """A per-token numeric array (token types, scores): at least one entry per token (llama.cpp)."""
    values = metadata.get(key)
    if values is None:
        return [default] * num_tokens
    values = values.tolist() if hasattr(values, "tolist") else list(values)
    if len(values) < num_tokens:
        raise InvalidModelFile(
            f"{key!r} has {len(values)} entries for {num_tokens} tokens", expected="one per token"
        )
    kind = type(default)
    if not all(isinstance(v, Real) and not isinstance(v, bool) for v in values[:num_tokens]):
        raise InvalidModelFile(f"{key!r} holds non-numeric values", expected=f"{kind.__name__} per token")
    return [kind(v) for v in values[:num_tokens]]


def _resolve_add_flag(
    metadata: Mapping[str, Any], key: str, default: bool, token_id: int | None, name: str
) -> bool:
    explicit = _get_bool(metadata, key)
    value = default if explicit is None else explicit
    if value and token_id is None:
        if explicit:
            raise InvalidModelFile(f"{key} is true, but tokenizer.ggml.{name}_token_id is not set")
        logger.warning("no %s token in the vocabulary: not adding one", name)
        return False
    return value


def _piece_bytes(tokens: list[str], token_types: list[int], *, is_spm: bool) -> list[bytes]:
    """Per token, the bytes llama.cpp's token_to_piece(special=True) gives."""
    byte_of_char = {ch: byte for byte, ch in enumerate(gpt2_byte_to_unicode())}
    result: list[bytes] = []
    for token, token_type in zip(tokens, token_types, strict=True):
        if token_type in (TokenType.CONTROL, TokenType.UNKNOWN, TokenType.USER_DEFINED):
            piece = _utf8(token)
        elif token_type == TokenType.NORMAL:
            if is_spm:
                piece = _utf8(token.replace("\u2581", " "))
            elif all(ch in byte_of_char for ch in token):
                piece = bytes(byte_of_char[ch] for ch in token)
            else:  # not GPT-2 byte form; llama.cpp prints an [UNK_BYTE_..] marker, we keep the text
                piece = _utf8(token)
        elif token_type == TokenType.BYTE:
            match = _BYTE_TOKEN.fullmatch(token)
            piece = bytes([int(match.group(1), 16)]) if match else _utf8(token)
        else:  # UNUSED, UNDEFINED and unknown types print nothing
            piece = b""
        result.append(piece)
    return result


def _utf8(text: str) -> bytes:
    try:
        return text.encode("utf-8", "surrogateescape")  # undoes a reader's surrogateescape decoding
    except UnicodeEncodeError:
        return text.encode("utf-8", "replace")


def _get_str(metadata: Mapping[str, Any], key: str) -> str | None:
    value = metadata.get(key)
    if value is not None and not isinstance(value, str):
        raise InvalidModelFile(f"metadata {key!r} is {type(value).__name__}", expected="a string")
    return value


def _get_bool(metadata: Mapping[str, Any], key: str) -> bool | None:
    value = metadata.get(key)
    if value is None:
        return None
    if hasattr(value, "item") and getattr(value, "shape", None) == ():  # a numpy scalar
        value = value.item()
    if not isinstance(value, bool) and not (isinstance(value, Integral) and value in (0, 1)):
        raise InvalidModelFile(f"metadata {key!r} = {value!r}", expected="a boolean")
    return bool(value)
