"""Live cross-check against llama.cpp (marker `crossval`, needs llama-cpp-python): our ids equal
llama.cpp's on freshly written GGUFs, so the committed fixtures cannot hide a drift."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

from bitserve.tokenizer.gguf_vocab import GGUFTokenizer


@pytest.mark.crossval
def test_ids_match_live_llama_cpp(
    variant: str,
    build_variant: Callable[[str], tuple[GGUFTokenizer, dict[str, Any]]],
    fixture_script: ModuleType,
    tmp_path: Path,
) -> None:
    pytest.importorskip("llama_cpp")
    builder, _ = fixture_script.VARIANTS[variant]
    tokenizer, metadata = build_variant(variant)
    path = fixture_script.smollm2_path()
    if builder is not None:
        path = tmp_path / f"{variant}.gguf"
        fixture_script.write_vocab_gguf(metadata, path)
    record = fixture_script.llama_cpp_record_for(path, fixture_script.STRINGS)
    assert tokenizer.eos_token_ids == frozenset(record["eog_ids"])
    assert (tokenizer.bos_token_id, tokenizer.add_bos) == (record["bos"], record["add_bos"])
    for case in record["cases"]:
        assert tokenizer.encode(case["text"]) == case["ids_special"], case["text"]
        assert tokenizer.encode(case["text"], add_special=False, parse_special=False) == case["ids_plain"]
