"""ModelRegistry: which model files may be loaded, by name or by path inside a configured model root.

A model root is a folder of GGUF files; each may have a sidecar `<file>.json` with `alias`, `sha256` and
`default_params`. A model is loadable only by a registered name (a file's alias or stem, or a catalog
name) or by a path that, after URL-decoding and resolving every symlink, lies inside a root. Anything
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

from bitserve.catalog import CATALOG, resolve_model
from bitserve.errors import Forbidden, InvalidModelFile, ModelNotFound

logger = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".json"
MAX_SIDECAR_BYTES = 64 * 1024
MAX_DECODE_ROUNDS = 4  # percent-decoding repeated until stable, bounded (%252e -> %2e -> .)


@dataclass(frozen=True, slots=True)
class RegisteredModel:
    name: str
    path: Path
    sha256: str | None = None
    default_params: dict[str, Any] = field(default_factory=dict)

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
        raise InvalidModelFile("model sidecar is too large", path=str(sidecar), expected=f"<= {MAX_SIDECAR_BYTES} bytes")
    try:
        data = json.loads(sidecar.read_text(encoding="utf-8"))
    except (OSError, ValueError) as exc:
        raise InvalidModelFile(f"unreadable model sidecar: {exc}", path=str(sidecar)) from exc
    if not isinstance(data, dict):
        raise InvalidModelFile("model sidecar must hold a JSON object", path=str(sidecar))
    return data


class ModelRegistry:
    def __init__(self, roots: Iterable[str | Path]) -> None:
        self.roots = [Path(root).resolve(strict=True) for root in roots]
        self._models: dict[str, RegisteredModel] = {}
        self.refresh()

    def refresh(self) -> None:
        """Discover the GGUF files of every root (not following symlinked folders out of it)."""
        models: dict[str, RegisteredModel] = {}
        for root in self.roots:
            for path in sorted(root.rglob("*.gguf")):
                if not self._is_inside_roots(path.resolve()):
                    logger.warning("skipping %s: it resolves outside the model roots", path)
                    continue
                sidecar = _read_sidecar(path)
                name = str(sidecar.get("alias") or path.stem)
                if name in models:
                    logger.warning("model name %r appears twice; keeping %s", name, models[name].path)
                    continue
                models[name] = RegisteredModel(name, path.resolve(), sidecar.get("sha256"), dict(sidecar.get("default_params") or {}))
        self._models = models

    @property
    def names(self) -> list[str]:
        return sorted(set(self._models) | set(CATALOG))

    def _is_inside_roots(self, resolved: Path) -> bool:
        return any(resolved == root or root in resolved.parents for root in self.roots)

    def resolve(self, reference: str) -> RegisteredModel:
        """A registered name, a catalog name, or a path inside a root -> RegisteredModel.

        Raises Forbidden for paths that escape the roots, ModelNotFound for unknown names.
        """
        if reference in self._models:
            return self._models[reference]
        if reference in CATALOG:
            return RegisteredModel(reference, resolve_model(reference))
        text = _fully_unquote(reference)
        if "\x00" in text:
            raise Forbidden("model path contains a NUL byte", param="model")
        candidate = Path(text)
        if not candidate.is_absolute():
            if not self.roots:
                raise ModelNotFound(f"unknown model {reference!r}", param="model", hint=f"available: {', '.join(self.names)}")
            candidate = self.roots[0] / candidate
        resolved = candidate.resolve()
        if not self._is_inside_roots(resolved):
            logger.warning("refused model reference %r: resolves outside the model roots", reference)
            raise Forbidden(f"model path {reference!r} is outside the configured model roots", param="model",
                            hint="use a registered model name (GET /v1/models) or a path inside a model root")  # fmt: skip
        if not resolved.is_file():
            raise ModelNotFound(f"no model file at {reference!r}", param="model", hint=f"available: {', '.join(self.names)}")
        for model in self._models.values():
            if model.path == resolved:
                return model
        return RegisteredModel(resolved.stem, resolved)

    @staticmethod
    def verify_sha256(model: RegisteredModel) -> None:
        """Raise InvalidModelFile when the file does not match its sidecar's sha256."""
        if model.sha256 is None:
            return
        digest = hashlib.sha256()
        with open(model.path, "rb") as handle:
            while chunk := handle.read(1 << 22):
                digest.update(chunk)
        if digest.hexdigest() != model.sha256.lower():
            raise InvalidModelFile("sha256 mismatch", path=str(model.path), expected=model.sha256,
                                   hint="the file changed or is corrupt; fix the file or its sidecar")  # fmt: skip
