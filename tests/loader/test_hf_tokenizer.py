"""loader/hf_tokenizer.py: a checkpoint's tokenizer.json becomes the GGUF tokenizer keys llama.cpp's converter
writes. The tokenizer built from those keys encodes text as the `tokenizers` library does from tokenizer.json
and as the GGUF the files were made from (SmolLM2's vocabulary), and the keys equal what llama.cpp's
get_vocab_base (run here through transformers) plus gguf-py's own SpecialVocab write for the same folder."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from tokenizers import AddedToken, Regex, Tokenizer, pre_tokenizers, processors

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.loader import hf_tokenizer
from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.gguf_types import GGMLType
from bitserve.loader.gguf_writer import GGUFBuilder
from bitserve.loader.hf_tokenizer import detect_pre_tokenizer, plain_metadata, tokenizer_metadata_from_dir
from bitserve.tokenizer.gguf_vocab import tokenizer_from_gguf

TEXTS = [
    "Hello world",
    "émigré 東京 🙂 naïve Ünïcödé ßẞ",
    "12345 + 678 = 999, 3.14159e-10",
    "def f(x):\n\treturn x  # ok\n",
    "  spaces   and\n\n\nlines \t\t end  ",
    "I'm sure we'll see; they've DON'T it's",
    "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
    'https://example.com/a?q=1&x=[2]; {"k": null}',
    "\u200bzero\u00a0width — dash… “quotes”",
]
# pre-tokenizer regexes as tokenizer.json files spell them (transformers' Llama 3 and Qwen2 tokenizers)
LLAMA3_HF = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+"
    r"|\s+(?!\S)|\s+"
)
QWEN2_HF = LLAMA3_HF.replace(r"\p{N}{1,3}", r"\p{N}")
SMOLLM2_CONFIG = {  # SmolLM2-135M-Instruct's special tokens, as its tokenizer_config.json names them
    "bos_token": "<|im_start|>",
    "eos_token": "<|im_end|>",
    "unk_token": "<|endoftext|>",
    "pad_token": "<|im_end|>",
    "add_bos_token": False,
}


def hf_pre_tokenizer(*steps: Any) -> dict[str, Any]:
    """`steps` (tokenizers objects) serialized as tokenizer.json holds a pre_tokenizer."""
    tokenizer = Tokenizer.from_str(
        json.dumps({"version": "1.0", "model": {"type": "BPE", "vocab": {}, "merges": []}})
    )
    tokenizer.pre_tokenizer = steps[0] if len(steps) == 1 else pre_tokenizers.Sequence(list(steps))
    return json.loads(tokenizer.to_str())["pre_tokenizer"]


def isolated(regex: str) -> pre_tokenizers.Split:
    return pre_tokenizers.Split(Regex(regex), behavior="isolated")


def byte_level(**settings: Any) -> pre_tokenizers.ByteLevel:
    return pre_tokenizers.ByteLevel(**{"add_prefix_space": False, "use_regex": False, **settings})


@pytest.fixture(scope="module")
def source_metadata(tokenizer_source: Path) -> dict[str, Any]:
    with read_gguf(tokenizer_source) as gguf:
        return dict(gguf.metadata)


@pytest.fixture(scope="module")
def base_dir(tokenizer_source: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """tokenizer.json (SmolLM2's vocabulary, merges and split, as HF tokenizers saves it) with SmolLM2's
    tokenizer_config.json and a config.json."""
    from bitserve.testing.hf_checkpoints import write_tokenizer_files

    folder = tmp_path_factory.mktemp("tokenizer")
    write_tokenizer_files(tokenizer_source, folder)
    tokenizer_config = json.loads((folder / "tokenizer_config.json").read_text())
    (folder / "tokenizer_config.json").write_text(json.dumps(tokenizer_config | SMOLLM2_CONFIG))
    (folder / "config.json").write_text(json.dumps({"vocab_size": 49152}))
    return folder


def make_dir(
    base: Path,
    target: Path,
    *,
    change: Callable[[Tokenizer], None] | None = None,
    edit: Callable[[dict[str, Any]], None] | None = None,
    tokenizer_config: Callable[[dict[str, Any]], dict[str, Any] | None] | None = None,
    config: dict[str, Any] | None = None,
    files: dict[str, str] | None = None,
) -> Path:
    """A copy of `base` with tokenizer.json changed (`change` on the Tokenizer, then `edit` on its JSON),
    tokenizer_config.json rewritten (None: removed), config.json replaced and extra text files."""
    target.mkdir(parents=True)
    tokenizer = Tokenizer.from_file(str(base / "tokenizer.json"))
    if change is not None:
        change(tokenizer)
    data = json.loads(tokenizer.to_str())
    if edit is not None:
        edit(data)
    (target / "tokenizer.json").write_text(json.dumps(data, ensure_ascii=False))
    tc = json.loads((base / "tokenizer_config.json").read_text())
    tc = tokenizer_config(tc) if tokenizer_config is not None else tc
    if tc is not None:
        (target / "tokenizer_config.json").write_text(json.dumps(tc, ensure_ascii=False))
    shutil.copy(base / "config.json", target / "config.json")
    if config is not None:
        (target / "config.json").write_text(json.dumps(config))
    for name, text in (files or {}).items():
        (target / name).parent.mkdir(parents=True, exist_ok=True)
        (target / name).write_text(text, encoding="utf-8")
    return target


def metadata_of(folder: Path, **kwargs: Any) -> dict[str, Any]:
    config = json.loads((folder / "config.json").read_text())
    return plain_metadata(tokenizer_metadata_from_dir(folder, config, **kwargs))


def test_keys_encode_like_tokenizer_json_and_the_source_gguf(
    base_dir: Path, source_metadata: dict[str, Any]
) -> None:
    metadata = metadata_of(base_dir)
    for key in (
        "tokenizer.ggml.model",
        "tokenizer.ggml.pre",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.merges",
    ):
        assert metadata[key] == source_metadata[key], key
    assert metadata["tokenizer.ggml.pre"] == "smollm"
    token_types = metadata["tokenizer.ggml.token_type"]
    assert token_types.dtype == np.int32 and np.array_equal(
        token_types, source_metadata["tokenizer.ggml.token_type"]
    )
    for kind in ("bos", "eos", "unknown", "padding"):
        key = f"tokenizer.ggml.{kind}_token_id"
        assert metadata[key] == source_metadata[key], key
    assert metadata["tokenizer.ggml.add_bos_token"] is False
    assert metadata["tokenizer.chat_template"] == source_metadata["tokenizer.chat_template"]
    ours, source = tokenizer_from_gguf(metadata), tokenizer_from_gguf(source_metadata)
    reference = Tokenizer.from_file(str(base_dir / "tokenizer.json"))
    for text in TEXTS:
        expected = reference.encode(text, add_special_tokens=False).ids
        assert ours.encode(text, add_special=False) == expected == source.encode(text, add_special=False), (
            text
        )
    assert (ours.bos_token_id, ours.eos_token_id, ours.eos_token_ids) == (1, 2, source.eos_token_ids)


def test_written_gguf_reads_back_the_same(base_dir: Path, tmp_path: Path) -> None:
    values = tokenizer_metadata_from_dir(base_dir, {"vocab_size": 49152})
    builder = GGUFBuilder()
    builder.add_architecture("llama")
    for key, (value_type, value, array_type) in values.items():
        builder.add_kv(key, value_type, value, array_type)
    builder.add_tensor("token_embd.weight", (4, 2), GGMLType.F32, np.zeros((2, 4), dtype=np.float32))
    with read_gguf(builder.write(tmp_path / "vocab.gguf")) as gguf:
        assert comparable(gguf.metadata, values) == comparable(plain_metadata(values), values)
        for key, (value_type, _, array_type) in values.items():
            assert (gguf.value_types[key], gguf.array_types.get(key)) == (value_type, array_type), key


def comparable(metadata: Any, keys: Any) -> dict[str, Any]:
    """Values with numpy arrays as (dtype, list), so dicts compare by value and element type."""
    out = {}
    for key in keys:
        value = metadata[key]
        out[key] = (
            (value.dtype.str, value.tolist()) if isinstance(value, np.ndarray) else (type(value), value)
        )
    return out


# --- the same keys as llama.cpp's converter ------------------------------------------------------------


def looks_special(token: str) -> bool:
    """convert_hf_to_gguf.py's does_token_look_special."""
    return (
        token in ("<pad>", "<mask>", "<2mass>", "[@BOS@]")
        or (token.startswith("<|") and token.endswith("|>"))
        or (token.startswith("<｜") and token.endswith("｜>"))
        or (token.startswith("<unused") and token.endswith(">"))
    )


def llama_cpp_keys(folder: Path, pre: str) -> dict[str, tuple[int, Any, int | None]]:
    """The tokenizer keys llama.cpp's `_set_vocab_gpt2` writes for `folder` (type, value, element type):
    get_vocab_base's loop over the transformers tokenizer, then gguf-py's own SpecialVocab and writer."""
    gguf = pytest.importorskip("gguf")
    transformers = pytest.importorskip("transformers")
    tokenizer = transformers.PreTrainedTokenizerFast.from_pretrained(str(folder))
    vocab = tokenizer.vocab
    vocab_size = json.loads((folder / "config.json").read_text()).get("vocab_size", len(vocab))
    by_id = {token_id: token for token, token_id in vocab.items()}
    added, decoder = tokenizer.get_added_vocab(), tokenizer.added_tokens_decoder
    tokens, token_types = [], []
    for token_id in range(vocab_size):
        token = by_id.get(token_id)
        token_type = 1
        if token is None:
            token, token_type = f"[PAD{token_id}]", 5
        elif token in added:
            if not decoder[token_id].normalized:
                token = tokenizer.decode(tokenizer.encode(token, add_special_tokens=False))
            token_type = 3 if decoder[token_id].special or looks_special(token) else 4
            token = token if token_type == 3 else token.replace("\u2581", " ")
        tokens.append(token)
        token_types.append(token_type)
    writer = gguf.GGUFWriter(None, arch="llama")  # its keys are read, never written out (slow for 49k tokens)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre(pre)
    writer.add_token_list(tokens)
    writer.add_token_types(token_types)
    gguf.SpecialVocab(folder, load_merges=True).add_to_gguf(writer, quiet=True)
    keys = {}
    for key, kv in writer.kv_data[0].items():
        element = kv.sub_type if kv.sub_type is not None else None
        if kv.type == gguf.GGUFValueType.ARRAY and element is None:
            element = gguf.GGUFValueType.get_type(kv.value[0])  # what the writer packs them as
        keys[key] = (int(kv.type), kv.value, None if element is None else int(element))
    return {key: value for key, value in keys.items() if key.startswith("tokenizer.")}


def with_added_tokens(tokenizer: Tokenizer) -> None:
    tokenizer.add_tokens(
        [
            AddedToken("<think>", special=False, normalized=False),  # made special by added_tokens_decoder
            AddedToken("<|fim_x|>", special=False, normalized=False),  # looks special
            AddedToken("café", special=False, normalized=False),  # byte-level decoded: caf\ufffd
            AddedToken("x\u2581y", special=False, normalized=True),  # user-defined, U+2581 as a space
        ]
    )
    tokenizer.add_special_tokens([AddedToken("[ROLE]", special=True)])


def added_tokens_config(tc: dict[str, Any]) -> dict[str, Any]:
    think = {
        "content": "<think>",
        "lstrip": False,
        "normalized": False,
        "rstrip": False,
        "single_word": False,
    }
    return tc | {
        "bos_token": {"__type": "AddedToken", "content": "<|im_start|>", "special": True},
        "eos_token": {"__type": "AddedToken", "content": "<|im_end|>", "normalized": False},
        "pad_token": None,
        "added_tokens_decoder": {"49152": think | {"special": True}},
        "chat_template": [
            {"name": "default", "template": "{{ messages }}"},
            {"name": "tool-use", "template": "{{ tools }}"},
        ],
    }


def with_template(single: str, pair: str, special: tuple[str, int]) -> Callable[[Any], None]:
    """A change that gives the tokenizer a TemplateProcessing post-processor."""

    def change(tokenizer: Any) -> None:
        tokenizer.post_processor = processors.TemplateProcessing(
            single=single, pair=pair, special_tokens=[special]
        )

    return change


SCENARIOS: dict[str, dict[str, Any]] = {
    "smollm2": {},
    "added_tokens_and_padding": {
        "change": with_added_tokens,
        "tokenizer_config": added_tokens_config,
        "config": {"vocab_size": 49160},
    },
    "template_adds_bos": {
        "change": with_template("<|im_start|> $A", "<|im_start|> $A <|im_start|> $B", ("<|im_start|>", 1)),
        "tokenizer_config": lambda tc: {
            k: v for k, v in tc.items() if k not in ("eos_token", "pad_token", "add_bos_token")
        },
        "config": {"vocab_size": 49152, "eos_token_id": [2, 0], "pad_token_id": 0},  # a list is ignored
    },
    "template_appends_another_eos": {
        "change": with_template(
            "$A <|endoftext|>", "$A <|endoftext|> $B:1 <|endoftext|>:1", ("<|endoftext|>", 0)
        ),
    },
    "roberta_processing": {
        "change": lambda t: setattr(
            t, "post_processor", processors.RobertaProcessing(("<|im_end|>", 2), ("<|endoftext|>", 0))
        ),
    },
    "no_tokenizer_config": {
        "tokenizer_config": lambda tc: None,
        "config": {"vocab_size": 49152, "bos_token_id": 1, "text_config": {"eos_token_id": 2}},
    },
    "jinja_templates": {
        "tokenizer_config": lambda tc: {k: v for k, v in tc.items() if k != "chat_template"},
        "files": {
            "chat_template.jinja": "{{ bos_token }}",
            "additional_chat_templates/rag.jinja": "{{ docs }}",
        },
    },
    "merges_as_strings": {
        "edit": lambda data: data["model"].update(
            merges=[" ".join(pair) for pair in data["model"]["merges"]]
        ),
    },
}


@pytest.mark.parametrize("scenario", list(SCENARIOS))
def test_keys_equal_llama_cpp_converters(base_dir: Path, tmp_path: Path, scenario: str) -> None:
    folder = make_dir(base_dir, tmp_path / scenario, **SCENARIOS[scenario])
    values = tokenizer_metadata_from_dir(folder, json.loads((folder / "config.json").read_text()))
    expected = llama_cpp_keys(folder, values["tokenizer.ggml.pre"][1])
    assert list(values) == list(expected)  # the same keys, in the writer's order
    for key, (value_type, value, array_type) in values.items():
        assert (int(value_type), value, None if array_type is None else int(array_type)) == expected[key], key


def test_added_tokens_special_ids_and_templates(base_dir: Path, tmp_path: Path) -> None:
    """What test_keys_equal_llama_cpp_converters checks wholesale, spelled out for the added-token case."""
    metadata = metadata_of(make_dir(base_dir, tmp_path / "added", **SCENARIOS["added_tokens_and_padding"]))
    tokens, token_types = metadata["tokenizer.ggml.tokens"], metadata["tokenizer.ggml.token_type"].tolist()
    assert list(zip(tokens[49152:], token_types[49152:], strict=True)) == [
        ("<think>", 3),
        ("<|fim_x|>", 3),
        ("caf\ufffd", 4),
        ("x y", 4),
        ("[ROLE]", 3),
        ("[PAD49157]", 5),
        ("[PAD49158]", 5),
        ("[PAD49159]", 5),
    ]
    assert (metadata["tokenizer.ggml.bos_token_id"], metadata["tokenizer.ggml.eos_token_id"]) == (1, 2)
    assert "tokenizer.ggml.padding_token_id" not in metadata  # pad_token: null
    assert metadata["tokenizer.chat_template"] == "{{ messages }}"
    assert metadata["tokenizer.chat_template.tool_use"] == "{{ tools }}"
    assert metadata["tokenizer.chat_templates"] == ["tool_use"]
    tokenizer = tokenizer_from_gguf(metadata)
    assert tokenizer.encode("a<think>b", add_special=False)[1] == 49152
    assert tokenizer.decode(tokenizer.encode("<|im_start|>x y", add_special=False)) == "x y"


def test_config_ids_and_template_flags(base_dir: Path, tmp_path: Path) -> None:
    """A list eos_token_id in config.json is ignored (SpecialVocab takes only an int); a template that puts
    a bos first turns add_bos on; one that appends another eos makes it the eos and the configured one eot."""
    bos_first = metadata_of(make_dir(base_dir, tmp_path / "bos", **SCENARIOS["template_adds_bos"]))
    assert bos_first["tokenizer.ggml.add_bos_token"] is True
    assert "tokenizer.ggml.eos_token_id" not in bos_first
    assert bos_first["tokenizer.ggml.padding_token_id"] == 0
    assert tokenizer_from_gguf(bos_first).encode("hi")[0] == 1
    eos_last = metadata_of(make_dir(base_dir, tmp_path / "eos", **SCENARIOS["template_appends_another_eos"]))
    assert (eos_last["tokenizer.ggml.eos_token_id"], eos_last["tokenizer.ggml.eot_token_id"]) == (0, 2)
    assert eos_last["tokenizer.ggml.add_eos_token"] is True


def test_chat_template_jinja_without_tokenizer_config(base_dir: Path, tmp_path: Path) -> None:
    """gguf-py reads chat_template.jinja only beside a tokenizer_config.json; bitserve reads it anyway."""
    folder = make_dir(
        base_dir,
        tmp_path / "jinja",
        tokenizer_config=lambda tc: None,
        files={"chat_template.jinja": "{{ x }}"},
    )
    metadata = metadata_of(folder)
    assert metadata["tokenizer.chat_template"] == "{{ x }}"
    assert "tokenizer.ggml.bos_token_id" not in metadata  # no tokenizer_config.json, no config.json ids


# --- pre-tokenizer recognition -------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("steps", "ignore_merges", "name"),
    [
        ((isolated(LLAMA3_HF), byte_level(trim_offsets=True)), True, "llama-bpe"),
        ((isolated(LLAMA3_HF), byte_level()), False, "dbrx"),  # Llama 3's split without ignore_merges
        ((isolated(QWEN2_HF), byte_level(trim_offsets=False)), False, "qwen2"),
        ((byte_level(use_regex=True),), False, "gpt-2"),
        ((pre_tokenizers.Digits(individual_digits=True), byte_level(use_regex=True)), False, "smollm"),
        ((byte_level(use_regex=True, add_prefix_space=True),), False, None),  # HF adds a space, llama.cpp not
        ((pre_tokenizers.Split(Regex(QWEN2_HF), behavior="removed"), byte_level()), False, None),
        ((isolated(QWEN2_HF), byte_level()), True, None),
        ((isolated(r"\p{L}+|\p{N}{1,4}"), byte_level()), False, None),
    ],
)
def test_pre_tokenizer_detection(steps: tuple[Any, ...], ignore_merges: bool, name: str | None) -> None:
    assert detect_pre_tokenizer(hf_pre_tokenizer(*steps), ignore_merges) == name


@pytest.mark.parametrize(
    ("steps", "ignore_merges", "name"),
    [
        ((isolated(LLAMA3_HF), byte_level()), True, "llama-bpe"),
        ((isolated(QWEN2_HF), byte_level()), False, "qwen2"),
        ((pre_tokenizers.Digits(individual_digits=True), byte_level(use_regex=True)), False, "smollm"),
    ],
)
def test_recognized_splits_encode_as_tokenizer_json(
    base_dir: Path, tmp_path: Path, steps: tuple[Any, ...], ignore_merges: bool, name: str
) -> None:
    """HF's spelling of a split and bitserve's spec of the name it is recognized as give the same ids."""

    def respell(data: dict[str, Any]) -> None:
        data["pre_tokenizer"] = hf_pre_tokenizer(*steps)
        data["model"]["ignore_merges"] = ignore_merges

    folder = make_dir(base_dir, tmp_path / name, edit=respell)
    metadata = metadata_of(folder)
    assert metadata["tokenizer.ggml.pre"] == name
    ours, reference = tokenizer_from_gguf(metadata), Tokenizer.from_file(str(folder / "tokenizer.json"))
    for text in TEXTS:
        assert ours.encode(text, add_special=False) == reference.encode(text, add_special_tokens=False).ids, (
            text
        )


def test_unknown_split_needs_an_explicit_name(base_dir: Path, tmp_path: Path) -> None:
    odd = hf_pre_tokenizer(isolated(r"x+"), byte_level())
    folder = make_dir(base_dir, tmp_path / "odd", edit=lambda data: data.update(pre_tokenizer=odd))
    with pytest.raises(UnsupportedModel, match=r"not one bitserve recognizes: Split 'x\+'.*--tokenizer-pre"):
        metadata_of(folder)
    assert metadata_of(folder, pre="gpt-2")["tokenizer.ggml.pre"] == "gpt-2"
    with pytest.raises(UnsupportedModel, match="llama-bpe"):  # an unknown name lists the known ones
        metadata_of(folder, pre="no-such-split")
    merging = make_dir(
        base_dir, tmp_path / "merging", edit=lambda data: data["model"].update(ignore_merges=True)
    )
    with pytest.raises(UnsupportedModel, match="splits as 'smollm' does, but .* ignore_merges=True"):
        metadata_of(merging)


# --- refusals ------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("edit", "fragment"),
    [
        (lambda data: data.update(model={"type": "Unigram", "vocab": [["a", 0.0]]}), "holds a Unigram model"),
        (lambda data: data.update(model={"type": "WordPiece", "vocab": {"a": 0}}), "holds a WordPiece model"),
        (lambda data: data["model"].update(byte_fallback=True), "SentencePiece-style BPE model"),
        (lambda data: data.update(pre_tokenizer=None, decoder=None), "without a ByteLevel"),
    ],
)
def test_other_tokenizer_models_are_refused(
    base_dir: Path, tmp_path: Path, edit: Callable[[dict[str, Any]], None], fragment: str
) -> None:
    with pytest.raises(UnsupportedModel, match=fragment):
        metadata_of(make_dir(base_dir, tmp_path / "other", edit=edit))


def test_unreadable_files_are_refused(
    base_dir: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    with pytest.raises(UnsupportedModel, match="no tokenizer.json"):
        tokenizer_metadata_from_dir(tmp_path, {})
    broken = tmp_path / "broken"
    broken.mkdir()
    (broken / "tokenizer.json").write_text("{not json")
    with pytest.raises(InvalidModelFile, match="malformed JSON") as caught:
        tokenizer_metadata_from_dir(broken, {})
    assert not isinstance(caught.value, UnsupportedModel) and str(broken / "tokenizer.json") in str(
        caught.value
    )
    bad_config = make_dir(base_dir, tmp_path / "bad_config", tokenizer_config=lambda tc: None)
    (bad_config / "tokenizer_config.json").write_text("[1, 2]")
    with pytest.raises(InvalidModelFile, match="not a JSON object"):
        metadata_of(bad_config)
    monkeypatch.setattr(hf_tokenizer, "MAX_TOKENIZER_JSON_BYTES", 1024)
    with pytest.raises(InvalidModelFile, match="over the 1024 bytes allowed"):
        metadata_of(base_dir)
