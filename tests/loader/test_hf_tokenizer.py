"""loader/hf_tokenizer.py: a checkpoint's tokenizer.json becomes the GGUF tokenizer keys llama.cpp's
converter writes, and the tokenizer built from those keys encodes text exactly as the `tokenizers` library
does from tokenizer.json itself (and as the GGUF the files were made from)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.hf_tokenizer import detect_pre_tokenizer, plain_metadata, tokenizer_metadata_from_dir
from bitserve.tokenizer.gguf_vocab import tokenizer_from_gguf

TEXTS = [
    "Hello world",
    "émigré 東京 🙂",
    "12345 + 678 = 999",
    "def f(x):\n\treturn x  # ok",
    "  spaces   and\n\nlines",
]
LLAMA3_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)


@pytest.fixture(scope="module")
def tokenizer_dir(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    from bitserve.testing.hf_checkpoints import write_tokenizer_files

    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(tokenizer_source, folder)
    return folder


def test_keys_encode_like_tokenizer_json_and_the_source_gguf(
    tokenizer_dir: Path, tokenizer_source: Path
) -> None:
    from tokenizers import Tokenizer

    with read_gguf(tokenizer_source) as gguf:
        source_metadata = dict(gguf.metadata)
    vocab_size = len(source_metadata["tokenizer.ggml.tokens"])
    values = tokenizer_metadata_from_dir(tokenizer_dir, {"vocab_size": vocab_size})
    metadata = plain_metadata(values)
    assert metadata["tokenizer.ggml.tokens"] == list(source_metadata["tokenizer.ggml.tokens"])
    assert list(metadata["tokenizer.ggml.token_type"]) == list(source_metadata["tokenizer.ggml.token_type"])
    for key in ("tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.chat_template"):
        assert metadata[key] == source_metadata[key], key
    ours, source = tokenizer_from_gguf(metadata), tokenizer_from_gguf(source_metadata)
    reference = Tokenizer.from_file(str(tokenizer_dir / "tokenizer.json"))
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False).ids
        got, from_source = ours.encode(text, add_special=False), source.encode(text, add_special=False)
        assert got == expected == from_source, text


@pytest.mark.parametrize(
    ("pre_tokenizer", "ignore_merges", "name"),
    [
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LLAMA3_HF}},
                    {"type": "ByteLevel", "use_regex": False},
                ],
            },
            True,
            "llama-bpe",
        ),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Split", "pattern": {"Regex": LLAMA3_HF.replace(r"\p{N}{1,3}", r"\p{N}")}},
                    {"type": "ByteLevel", "use_regex": False},
                ],
            },
            False,
            "qwen2",
        ),
        ({"type": "ByteLevel", "use_regex": True}, False, "gpt-2"),
        (
            {
                "type": "Sequence",
                "pretokenizers": [
                    {"type": "Digits", "individual_digits": True},
                    {"type": "ByteLevel", "use_regex": True},
                ],
            },
            False,
            "smollm",
        ),
        ({"type": "Split", "pattern": {"Regex": "x+"}}, False, None),
    ],
)
def test_pre_tokenizer_detection(pre_tokenizer: dict, ignore_merges: bool, name: str | None) -> None:
    assert detect_pre_tokenizer(pre_tokenizer, ignore_merges) == name


def _rewrite(folder: Path, target: Path, change) -> Path:  # noqa: ANN001
    target.mkdir()
    data = json.loads((folder / "tokenizer.json").read_text())
    change(data)
    (target / "tokenizer.json").write_text(json.dumps(data))
    return target


def test_unknown_pattern_needs_an_explicit_name(tokenizer_dir: Path, tmp_path: Path) -> None:
    def odd(data: dict) -> None:
        data["pre_tokenizer"] = {"type": "Split", "pattern": {"Regex": "x+"}, "behavior": "Isolated"}

    folder = _rewrite(tokenizer_dir, tmp_path / "odd", odd)
    with pytest.raises(UnsupportedModel, match="--tokenizer-pre"):
        tokenizer_metadata_from_dir(folder, {})
    assert tokenizer_metadata_from_dir(folder, {}, pre="gpt2")["tokenizer.ggml.pre"][1] == "gpt2"


def test_refusals(tokenizer_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(UnsupportedModel, match="no tokenizer.json"):
        tokenizer_metadata_from_dir(tmp_path, {})
    unigram = _rewrite(tokenizer_dir, tmp_path / "unigram", lambda data: data["model"].update(type="Unigram"))
    with pytest.raises(UnsupportedModel, match="Unigram"):
        tokenizer_metadata_from_dir(unigram, {})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidModelFile, match="malformed JSON"):
        tokenizer_metadata_from_dir(broken, {})


def test_special_ids_templates_and_padding(tokenizer_dir: Path, tmp_path: Path) -> None:
    folder = _rewrite(tokenizer_dir, tmp_path / "special", lambda data: None)
    config = json.loads((tokenizer_dir / "tokenizer_config.json").read_text())
    config["eos_token"] = {"content": config["eos_token"], "special": True}
    config["chat_template"] = [
        {"name": "default", "template": "{{ messages }}"},
        {"name": "tool_use", "template": "x"},
    ]
    del config["bos_token"]
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    size = len(json.loads((folder / "tokenizer.json").read_text())["model"]["vocab"]) + 3
    values = tokenizer_metadata_from_dir(folder, {"vocab_size": size, "bos_token_id": [7, 8]})
    metadata = plain_metadata(values)
    tokens = metadata["tokenizer.ggml.tokens"]
    assert tokens[metadata["tokenizer.ggml.eos_token_id"]] == config["eos_token"]["content"]
    assert metadata["tokenizer.ggml.bos_token_id"] == 7  # config.json's first id, as SpecialVocab takes
    assert metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert (
        len(tokens) == size
        and tokens[-1] == f"[PAD{size - 1}]"
        and metadata["tokenizer.ggml.token_type"][-1] == 5
    )
    (folder / "tokenizer_config.json").write_text("{}")
    (folder / "chat_template.jinja").write_text("{{ bos_token }}")
    assert tokenizer_metadata_from_dir(folder, {})["tokenizer.chat_template"][1] == "{{ bos_token }}"


def test_qwen2_splits_digits_one_by_one() -> None:
    """Qwen2's split is Llama-3's with single digits (llama.cpp's QWEN2 pre-tokenizer)."""
    from tokenizers import Regex, pre_tokenizers

    from bitserve.tokenizer.backends import pre_tokenizer_spec

    def pieces(name: str) -> list[str]:
        (regex,) = pre_tokenizer_spec(name).regexes
        split = pre_tokenizers.Split(Regex(regex), behavior="isolated")
        return [piece for piece, _ in split.pre_tokenize_str("x 12345")]

    assert pieces("qwen2") == ["x", " ", "1", "2", "3", "4", "5"]
    assert pieces("llama-bpe") == ["x", " ", "123", "45"]
