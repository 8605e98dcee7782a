"""Tokenizer test fixtures: SmolLM2's GGUF metadata (read once per session) and the synthetic
vocabularies of scripts/make_tokenizer_fixtures.py, rebuilt here from the same builders."""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest
from repo_scripts import load_script

from bitserve.loader.gguf_reader import read_gguf
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer, tokenizer_from_gguf

REPO_ROOT = Path(__file__).resolve().parents[2]
FIXTURE_DIR = REPO_ROOT / "tests" / "fixtures" / "tokenizer"


def load_fixture_script() -> ModuleType:
    """scripts/make_tokenizer_fixtures.py as a module (it imports neither llama_cpp nor gguf)."""
    return load_script("make_tokenizer_fixtures")


def pytest_generate_tests(metafunc: pytest.Metafunc) -> None:
    """A test taking `variant` runs once per vocabulary of the fixture script."""
    if "variant" in metafunc.fixturenames:
        metafunc.parametrize("variant", list(load_fixture_script().VARIANTS))


@pytest.fixture(scope="session")
def llama_cpp_record() -> Callable[[str], dict[str, Any]]:
    """variant -> llama.cpp's recorded view of it; skips the test when no fixture was written."""

    def load(variant: str) -> dict[str, Any]:
        path = FIXTURE_DIR / f"{variant}.json"
        if not path.exists():
            pytest.skip(f"no llama.cpp fixture {path.name}: run scripts/make_tokenizer_fixtures.py")
        return json.loads(path.read_text(encoding="utf-8"))

    return load


@pytest.fixture(scope="session")
def fixture_script() -> ModuleType:
    return load_fixture_script()


@pytest.fixture(scope="session")
def smollm2_metadata(fixture_script: ModuleType) -> dict[str, Any]:
    """SmolLM2-135M-Instruct's metadata, read once per session by bitserve's own GGUF reader."""
    try:
        path = fixture_script.smollm2_path()
    except FileNotFoundError as exc:
        pytest.skip(str(exc))
    if not path.exists():
        pytest.skip(f"{path} is missing")
    with read_gguf(path) as gguf_file:
        return dict(gguf_file.metadata)


@pytest.fixture(scope="session")
def build_variant(
    smollm2_metadata: dict[str, Any], fixture_script: ModuleType
) -> Callable[[str], tuple[GGUFTokenizer, dict[str, Any]]]:
    """name -> (tokenizer, metadata) for each fixture-script variant, built once per session."""
    built: dict[str, tuple[GGUFTokenizer, dict[str, Any]]] = {}

    def build(name: str) -> tuple[GGUFTokenizer, dict[str, Any]]:
        if name not in built:
            builder, kwargs = fixture_script.VARIANTS[name]
            metadata = smollm2_metadata if builder is None else builder(smollm2_metadata)
            built[name] = (tokenizer_from_gguf(metadata, **kwargs), metadata)
        return built[name]

    return build


@pytest.fixture(scope="session")
def smollm2_tokenizer(build_variant: Callable[[str], tuple[GGUFTokenizer, dict[str, Any]]]) -> GGUFTokenizer:
    return build_variant("smollm2")[0]


@pytest.fixture(scope="session")
def llama3_tokenizer(build_variant: Callable[[str], tuple[GGUFTokenizer, dict[str, Any]]]) -> GGUFTokenizer:
    """The 2B-4T-shaped vocabulary (pre llama-bpe, bos 128000, eos 128001, eot 128009)."""
    return build_variant("llama3_bpe")[0]


@pytest.fixture(scope="session")
def spm_tokenizer(build_variant: Callable[[str], tuple[GGUFTokenizer, dict[str, Any]]]) -> GGUFTokenizer:
    return build_variant("spm")[0]
