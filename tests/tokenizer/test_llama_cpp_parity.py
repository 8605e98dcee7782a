"""Token ids must equal llama.cpp's, recorded by scripts/make_tokenizer_fixtures.py, exactly.

Each test runs once per vocabulary variant (`variant` is parametrized in conftest.py).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from types import ModuleType
from typing import Any

from bitserve.tokenizer.gguf_vocab import GGUFTokenizer

BuildVariant = Callable[[str], tuple[GGUFTokenizer, dict[str, Any]]]
LoadRecord = Callable[[str], dict[str, Any]]


def test_ids_match_llama_cpp(
    variant: str, build_variant: BuildVariant, llama_cpp_record: LoadRecord, fixture_script: ModuleType
) -> None:
    record = llama_cpp_record(variant)
    assert record["tokenizer_kwargs"] == fixture_script.VARIANTS[variant][1]
    assert [case["text"] for case in record["cases"]] == list(fixture_script.STRINGS), (
        "stale fixture: regenerate"
    )
    tokenizer, _ = build_variant(variant)
    mismatches = []
    for case in record["cases"]:
        text = case["text"]
        ours_special = tokenizer.encode(text, add_special=True, parse_special=True)
        ours_plain = tokenizer.encode(text, add_special=False, parse_special=False)
        if ours_special != case["ids_special"]:
            mismatches.append(f"{text!r} [special]: ours {ours_special} llama.cpp {case['ids_special']}")
        if ours_plain != case["ids_plain"]:
            mismatches.append(f"{text!r} [plain]: ours {ours_plain} llama.cpp {case['ids_plain']}")
    assert not mismatches, "\n".join(mismatches)


def test_special_ids_match_llama_cpp(
    variant: str, build_variant: BuildVariant, llama_cpp_record: LoadRecord
) -> None:
    record = llama_cpp_record(variant)
    tokenizer, _ = build_variant(variant)
    assert tokenizer.vocab_size == record["vocab_size"]
    assert tokenizer.bos_token_id == record["bos"]
    assert tokenizer.eos_token_id == record["eos"]
    assert tokenizer.add_bos == record["add_bos"]
    assert tokenizer.eos_token_ids == frozenset(record["eog_ids"])


def test_token_bytes_match_llama_cpp_pieces(
    variant: str, build_variant: BuildVariant, llama_cpp_record: LoadRecord
) -> None:
    """Every token's bytes equal llama.cpp's token_to_piece(special=True), compared by digest."""
    record = llama_cpp_record(variant)
    tokenizer, _ = build_variant(variant)
    digest = hashlib.sha256()
    for token_id in range(tokenizer.vocab_size):
        piece = tokenizer.token_bytes(token_id)
        digest.update(len(piece).to_bytes(4, "little") + piece)
    assert digest.hexdigest() == record["piece_sha256"]


def test_decoding_llama_cpp_ids_gives_the_text_back(
    variant: str, build_variant: BuildVariant, llama_cpp_record: LoadRecord
) -> None:
    """Decoding is lossless: llama.cpp's ids decode back to every input string. SPM's space
    prefix adds a leading space, and another after a matched user-defined token, so SPM cases
    holding one are left out."""
    record = llama_cpp_record(variant)
    tokenizer, _ = build_variant(variant)
    for case in record["cases"]:
        text, decoded = case["text"], tokenizer.decode(case["ids_plain"], skip_special=False)
        if tokenizer.kind != "spm":
            assert decoded == text
        elif "<special_user>" not in text:
            assert decoded == (" " + text if tokenizer.add_space_prefix and text else text)
