"""ModelFiles: which model files may be loaded, by name or by path inside a configured model root.

A model root is a folder of GGUF files; each may have a sidecar `<file>.json` with `alias`, `sha256`,
`default_params` (request fields applied when a request leaves them unset) and `golden` (prompts whose
greedy tokens a new version must reproduce before a swap flips to it). A model is loadable only by a
registered name (a file's alias or stem, or a catalog name) or by a path that, after URL-decoding and
resolving every symlink, lies inside a root. Anything
else is refused with Forbidden and logged: `..` segments, absolute paths elsewhere, symlinks that point
out of a root, and their percent-encoded spellings. sha256 is verified before a load when given.
"""

from __future__ import annotations

import hashlib
import json
import logging
import urllib.parse
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from bitserve.errors import Forbidden, InvalidModelFile, InvalidRequest, ModelNotFound
from bitserve.loader.catalog import CATALOG, resolve_model
from bitserve.loader.checkpoint_dir import checkpoint_files, is_checkpoint_dir
from bitserve.loader.wheel_fetch import sha256_of

logger = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".json"
MAX_SIDECAR_BYTES = 64 * 1024
MAX_DECODE_ROUNDS = 4  # percent-decoding repeated until stable, bounded (%252e -> %2e -> .)
MAX_GOLDEN_PROMPTS = 16
MAX_GOLDEN_TOKENS = 64


def default_alias(reference: str) -> str:
    """The alias a model is served under when none is given: its catalog name, else its file stem."""
    return reference if reference in CATALOG else Path(reference).stem


@dataclass(frozen=True, slots=True)
class GoldenPrompt:
    """A prompt (text, tokenized by the model, or token ids) and the greedy tokens it must produce."""

    prompt: str | tuple[int, ...]
    expected_token_ids: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class ModelFile:
    name: str
    path: Path
    sha256: str | None = None
    default_params: dict[str, Any] = field(default_factory=dict)
    golden: tuple[GoldenPrompt, ...] = ()

    @property
    def version(self) -> str:
        return (self.sha256 or "")[:12] or "unversioned"


def _fully_unquote(text: str) -> str:
    for _ in range(MAX_DECODE_ROUNDS):
        decoded = urllib.parse.unquote(text)
        if decoded == text:
            return decoded
        text = decoded
    raise Forbidden(f"model reference {text!r} is encoded too many times", param="model")


def _read_sidecar(gguf_path: Path) -> dict[str, Any]:
    sidecar = gguf_path.with_name(gguf_path.name + SIDECAR_SUFFIX)
    if not sidecar.is_file():
        return {}
    if sidecar.stat().st_size > MAX_SIDECAR_BYTES:
        raise InvalidModelFile(
            "model sidecar is too large", path=str(sidecar), expected=f"<= {MAX_SIDECAR_BYTES} bytes"
        )
    try:
        data = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModelFile(f"unreadable model sidecar: {exc}", path=str(sidecar)) from exc
    if not isinstance(data, dict):
        raise InvalidModelFile("model sidecar must hold a JSON object", path=str(sidecar))
    return data


def _int_list(value: Any, what: str, path: Path, max_len: int) -> tuple[int, ...]:
    if (
        not isinstance(value, list)
        or not 0 < len(value) <= max_len
        or not all(type(v) is int and v >= 0 for v in value)
    ):
        raise InvalidModelFile(
            f"sidecar {what} must be a list of 1..{max_len} non-negative token ids", path=str(path)
        )
    return tuple(value)


def parse_golden(entries: Any, path: Path) -> tuple[GoldenPrompt, ...]:
    """The sidecar's `golden` list: [{"prompt": str | [ids], "expected_token_ids": [ids]}, ...]."""
    if entries is None:
        return ()
    if not isinstance(entries, list) or len(entries) > MAX_GOLDEN_PROMPTS:
        raise InvalidModelFile(
            f"sidecar golden must be a list of at most {MAX_GOLDEN_PROMPTS} entries", path=str(path)
        )
    prompts = []
    for entry in entries:
        if not isinstance(entry, dict):
            raise InvalidModelFile("each sidecar golden entry must be an object", path=str(path))
        prompt = entry.get("prompt")
        if not isinstance(prompt, str):
            prompt = _int_list(prompt, "golden prompt", path, 4096)
        prompts.append(
            GoldenPrompt(
                prompt,
                _int_list(
                    entry.get("expected_token_ids"), "golden expected_token_ids", path, MAX_GOLDEN_TOKENS
                ),
            )
        )
    return tuple(prompts)


def _registered(name: str, path: Path, sidecar: dict[str, Any], sidecar_path: Path) -> ModelFile:
    sha256 = sidecar.get("sha256")
    if sha256 is not None and not (
        isinstance(sha256, str) and len(sha256) == 64 and all(c in "0123456789abcdefABCDEF" for c in sha256)
    ):
        raise InvalidModelFile("sidecar sha256 must be 64 hex digits", path=str(sidecar_path))
    defaults = sidecar.get("default_params") or {}
    if not isinstance(defaults, dict):
        raise InvalidModelFile("sidecar default_params must be an object", path=str(sidecar_path))
    return ModelFile(name, path, sha256, dict(defaults), parse_golden(sidecar.get("golden"), sidecar_path))


class ModelFiles:
    def __init__(self, roots: Iterable[str | Path]) -> None:
        self.roots = []
        for root in roots:
            if not Path(root).is_dir():
                raise InvalidRequest(f"model root {str(root)!r} is not a folder", param="model_roots")
            self.roots.append(Path(root).resolve(strict=True))
        self._models: dict[str, ModelFile] = {}
        self.refresh()

    def refresh(self) -> None:
        """Discover the GGUF files and checkpoint directories (a folder with a config.json) of every root
        (not following symlinked folders out of it)."""
        models: dict[str, ModelFile] = {}
        for root in self.roots:
            directories = [
                config.parent for config in root.rglob("config.json") if is_checkpoint_dir(config.parent)
            ]
            for path in sorted([*root.rglob("*.gguf"), *directories]):
                if not self._is_inside_roots(path.resolve()):
                    logger.warning("skipping %s: it resolves outside the model roots", path)
                    continue
                try:
                    sidecar = _read_sidecar(path)
                    name = str(sidecar.get("alias") or _model_name(path))
                    model = _registered(name, path.resolve(), sidecar, path)
                except InvalidModelFile as exc:
                    logger.warning("skipping %s: %s", path, exc)
                    continue
                if name in models:
                    logger.warning("model name %r appears twice; keeping %s", name, models[name].path)
                    continue
                models[name] = model
        self._models = models

    @property
    def names(self) -> list[str]:
        return sorted(set(self._models) | set(CATALOG))

    def _is_inside_roots(self, resolved: Path) -> bool:
        return any(resolved == root or root in resolved.parents for root in self.roots)

    def resolve(self, reference: str) -> ModelFile:
        """A registered name, a catalog name, or a path inside a root -> ModelFile.

        Raises Forbidden for paths that escape the roots, ModelNotFound for unknown names.
        """
        if reference in self._models:
            return self._models[reference]
        if reference in CATALOG:  # never downloads here: `bitserve pull NAME` does, ahead of time
            return ModelFile(reference, resolve_model(reference, fetch=False).resolve())
        text = _fully_unquote(reference)
        if "\x00" in text:
            raise Forbidden("model path contains a NUL byte", param="model")
        candidate = Path(text)
        if not candidate.is_absolute():
            if not self.roots:
                raise ModelNotFound(
                    f"unknown model {reference!r}", param="model", hint=f"available: {', '.join(self.names)}"
                )
            candidate = self.roots[0] / candidate
        resolved = candidate.resolve()
        if not self._is_inside_roots(resolved):
            logger.warning("refused model reference %r: resolves outside the model roots", reference)
            raise Forbidden(
                f"model path {reference!r} is outside the configured model roots",
                param="model",
                hint="use a registered model name (the model list shows them) or a path inside a model root",
            )
        if not (resolved.is_file() or is_checkpoint_dir(resolved)):
            raise ModelNotFound(
                f"no model file at {reference!r}", param="model", hint=f"available: {', '.join(self.names)}"
            )
        for model in self._models.values():
            if model.path == resolved:
                return model
        return ModelFile(_model_name(resolved), resolved)

    def trusted(self, reference: str) -> ModelFile:
        """The operator's own startup model (CLI / config): a catalog name (fetched if missing) or any
        path, with its sidecar if it has one. Blocking: call it from a worker thread."""
        if reference in self._models:
            return self._models[reference]
        resolved = resolve_model(reference).resolve()
        for model in self._models.values():
            if model.path == resolved:
                return model
        sidecar = _read_sidecar(resolved)
        name = reference if reference in CATALOG else str(sidecar.get("alias") or _model_name(resolved))
        return _registered(name, resolved, sidecar, resolved)

    @staticmethod
    def verify_sha256(model: ModelFile) -> str:
        """The file's sha256 (hex); raise InvalidModelFile when it does not match the sidecar's."""
        digest = file_sha256(model.path)
        if model.sha256 is not None and digest != model.sha256.lower():
            raise InvalidModelFile(
                "sha256 mismatch",
                path=model.path.name,
                expected=model.sha256,
                hint="the file changed or is corrupt; fix the file or its sidecar",
            )
        return digest


def _model_name(path: Path) -> str:
    """A file's stem (model.gguf -> model); a checkpoint directory's whole name (Qwen3-0.6B)."""
    return path.name if path.is_dir() else path.stem


def file_sha256(path: Path) -> str:
    """The model's version: a file's sha256, or for a checkpoint directory the sha256 of its files'
    names and sha256s (loader/hf_checkpoint.checkpoint_files), so a changed shard or config shows."""
    if path.is_dir():
        listing = "".join(f"{item.name} {file_sha256(item)}\n" for item in checkpoint_files(path))
        return hashlib.sha256(listing.encode()).hexdigest()
    return sha256_of(path)
