"""HF `tokenizers` models that reproduce llama.cpp's BPE and SPM tokenization of raw text.

Pre-tokenizer regexes are llama.cpp's (src/llama-vocab.cpp, llm_tokenizer_bpe). Special tokens are
not registered here: gguf_vocab.py splits them out first, as llama.cpp does.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from types import MappingProxyType

from tokenizers import Regex, models, pre_tokenizers
from tokenizers import Tokenizer as HFTokenizer

from bitserve.errors import InvalidModelFile, UnsupportedModel

logger = logging.getLogger(__name__)

# GPT-2's pre-tokenizer regex. llama.cpp lists it without the final `|\s+` but its hand-written
# matcher does match a lone whitespace run; with "isolated" splitting both give the same pieces.
GPT2_REGEX = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"
# Llama-3 (tiktoken) regex in llama.cpp's adapted form: ASCII-only case folding of contractions.
LLAMA3_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen2's (Qwen2.5, Qwen3, PrismML's Bonsai): Llama-3's with single digits. llama.cpp's QWEN2 type, which
# sets neither ignore_merges nor add_bos (only clean_spaces = false, a detokenizer option bitserve has not)
QWEN2_REGEX = (
    r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
    r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class PreTokenizerSpec:
    """One llama.cpp pre-tokenizer: regexes applied in turn, each splitting the previous pieces.

    ignore_merges: a piece that is itself a vocabulary entry is taken whole (tiktoken behaviour).
    default_add_bos: llama.cpp's BOS default for this type when `add_bos_token` is absent.
    """

    name: str
    regexes: tuple[str, ...]
    ignore_merges: bool = False
    default_add_bos: bool = False


_DEFAULT = PreTokenizerSpec("default", (r"[\p{P}\$\+<=>\^~\|]+", GPT2_REGEX, r"\p{N}+", "[0-9][0-9][0-9]"))
_LLAMA3 = PreTokenizerSpec("llama-bpe", (LLAMA3_REGEX,), ignore_merges=True, default_add_bos=True)
_LLAMA3_REGEX_ONLY = PreTokenizerSpec("dbrx", (LLAMA3_REGEX,))
_SMOLLM = PreTokenizerSpec("smollm", (r"\p{N}", GPT2_REGEX))
_QWEN2 = PreTokenizerSpec("qwen2", (QWEN2_REGEX,))
_GPT2 = PreTokenizerSpec("gpt-2", (GPT2_REGEX,))

# `tokenizer.ggml.pre` value -> spec. Only names whose llama.cpp behaviour (regexes, ignore_merges,
# BOS default) is exactly one of the specs above; `gpt2` is our own alias for `gpt-2`.
_PRE_TOKENIZERS: Mapping[str, PreTokenizerSpec] = MappingProxyType(
    {
        "default": _DEFAULT,
        **dict.fromkeys(
            # falcon_e: TII's Falcon-E (ternary) files; bitnet.cpp's converter writes it, mainline llama.cpp
            # does not know it, ik_llama.cpp reads it as the Llama-3 split
            (
                "llama-bpe",
                "llama3",
                "llama-v3",
                "falcon3",
                "falcon_e",
                "falcon-h1",
                "pixtral",
                "midm-2.0",
                "lfm2",
            ),
            _LLAMA3,
        ),
        **dict.fromkeys(("dbrx", "smaug-bpe"), _LLAMA3_REGEX_ONLY),
        # the names llama.cpp's vocabulary loader maps to its QWEN2 type
        **dict.fromkeys(("qwen2", "deepseek-r1-qwen", "kormo", "megrez"), _QWEN2),
        **dict.fromkeys(
            ("smollm", "starcoder", "refact", "command-r", "codeshell", "exaone", "minerva-7b", "mellum2"),
            _SMOLLM,
        ),
        **dict.fromkeys(
            ("gpt2", "gpt-2", "phi-2", "mpt", "olmo", "jais", "exaone4", "trillion", "granite-docling"), _GPT2
        ),
    }
)
SUPPORTED_PRE_TOKENIZERS: tuple[str, ...] = tuple(sorted(_PRE_TOKENIZERS))


def pre_tokenizer_spec(name: str) -> PreTokenizerSpec:
    """The spec for a `tokenizer.ggml.pre` value, carrying that name; an unknown name is an
    UnsupportedModel error listing the supported ones."""
    spec = _PRE_TOKENIZERS.get(name)
    if spec is None:
        raise UnsupportedModel(
            f"unsupported pre-tokenizer tokenizer.ggml.pre={name!r}",
            expected=f"one of {', '.join(SUPPORTED_PRE_TOKENIZERS)}",
            hint="bitserve reproduces llama.cpp's splitting only for these pre-tokenizer types",
        )
    return replace(spec, name=name)


def gpt2_byte_to_unicode() -> tuple[str, ...]:
    """GPT-2's reversible byte -> printable character map (index = byte value)."""
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {b: chr(b) for b in printable}
    num_shifted = 0
    for b in range(256):
        if b not in table:
            table[b] = chr(256 + num_shifted)
            num_shifted += 1
    return tuple(table[b] for b in range(256))


def _parse_merges(merges: Sequence[str], vocab: Mapping[str, int]) -> list[tuple[str, str]]:
    """`"left right"` strings -> pairs, in rank order, keeping the first of duplicates (llama.cpp).

    HF's BPE refuses a merge whose parts or result are not in the vocabulary; llama.cpp would merge
    and then fall back to bytes. Such merges cannot change real files' output, so they are dropped.
    """
    pairs: list[tuple[str, str]] = []
    seen: set[tuple[str, str]] = set()
    num_dropped = 0
    for index, merge in enumerate(merges):
        if not isinstance(merge, str):
            raise InvalidModelFile(
                f"tokenizer.ggml.merges[{index}] is {type(merge).__name__}", expected="a string"
            )
        split_at = merge.find(" ", 1)  # the first space after position 0, as llama.cpp splits
        left, right = merge[:split_at], merge[split_at + 1 :]
        pair = (left, right)
        if (
            split_at < 0
            or pair in seen
            or left not in vocab
            or right not in vocab
            or left + right not in vocab
        ):
            num_dropped += 1
            continue
        seen.add(pair)
        pairs.append(pair)
    if num_dropped:
        logger.warning(
            "dropped %d of %d BPE merges (malformed, duplicate or out of vocabulary)",
            num_dropped,
            len(merges),
        )
    return pairs


def build_byte_level_bpe(tokens: Sequence[str], merges: Sequence[str], spec: PreTokenizerSpec) -> HFTokenizer:
    """Byte-level BPE over `tokens` (GPT-2 byte form) with llama.cpp's regex pre-splitting."""
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    model = models.BPE(vocab=vocab, merges=_parse_merges(merges, vocab), ignore_merges=spec.ignore_merges)
    backend = HFTokenizer(model)
    splits = [pre_tokenizers.Split(Regex(regex), behavior="isolated") for regex in spec.regexes]
    backend.pre_tokenizer = pre_tokenizers.Sequence(
        [*splits, pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)]
    )
    return backend


def _spm_merges(tokens: Sequence[str], scores: Sequence[float]) -> list[tuple[str, str]]:
    """Merges equivalent to llama.cpp's SPM tokenizer: every split of a token into two tokens.

    llama.cpp repeatedly joins the adjacent pair whose concatenation is the highest-scoring token,
    leftmost first on ties. Ranking each split by its token's score (higher first) gives HF's BPE
    the same order. Equal scores are ranked by (token id, split point) here instead of by position;
    that can change the result only when equal-score merges overlap and feed each other (rare;
    not seen on the test vocabularies, whose scores are distinct).
    """
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    merges: list[tuple[str, str]] = []
    for token_id in sorted(range(len(tokens)), key=lambda i: (-scores[i], i)):
        token = tokens[token_id]
        for split_at in range(1, len(token)):
            left, right = token[:split_at], token[split_at:]
            if left in vocab and right in vocab:
                merges.append((left, right))
    return merges


def build_spm_bpe(tokens: Sequence[str], scores: Sequence[float], unk_token: str | None) -> HFTokenizer:
    """SentencePiece-style BPE: input must already have spaces escaped to U+2581; no pre-splitting.

    Characters missing from the vocabulary fall back to `<0xNN>` byte tokens, as in llama.cpp.
    """
    vocab = {token: token_id for token_id, token in enumerate(tokens)}
    model = models.BPE(
        vocab=vocab,
        merges=_spm_merges(tokens, scores),
        unk_token=unk_token,
        byte_fallback=True,
        fuse_unk=False,
    )
    return HFTokenizer(model)
