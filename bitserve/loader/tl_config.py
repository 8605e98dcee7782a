"""TL1/TL2 tile configurations: BitNet's kernel_config.ini sidecar, the codegen presets, the lookup table.

TL files do not record their tiling (docs/formats.md §2.3); the converter looked (M, K) up in
`include/kernel_config.ini`, so bitserve needs the same table, from a sidecar ini next to the model or
from a named preset.
"""

from __future__ import annotations

import configparser
import logging
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import MappingProxyType
from typing import Literal

from bitserve.errors import InvalidModelFile, InvalidRequest

logger = logging.getLogger(__name__)

SIDECAR_SUFFIX = ".kernel_config.ini"


@dataclass(frozen=True, slots=True)
class TileConfig:
    """One shape's tiling: BM rows per tile, BK columns per tile, bm rows per SIMD block (the ini's `bmm`)."""

    BM: int
    BK: int
    bm: int


class TLConfigTable(Mapping[tuple[int, int], TileConfig]):
    """Read-only mapping (M, K) -> TileConfig. `source` names where it came from (for error messages)."""

    __slots__ = ("_configs", "source")

    def __init__(self, configs: Mapping[tuple[int, int], TileConfig], source: str) -> None:
        self._configs: Mapping[tuple[int, int], TileConfig] = MappingProxyType(dict(configs))
        self.source = source

    def __getitem__(self, key: tuple[int, int]) -> TileConfig:
        return self._configs[key]

    def __iter__(self) -> Iterator[tuple[int, int]]:
        return iter(self._configs)

    def __len__(self) -> int:
        return len(self._configs)

    def __repr__(self) -> str:
        return f"TLConfigTable({dict(self._configs)!r}, source={self.source!r})"


# docs/formats.md §2.3 presets: the codegen arguments that setup_env.py passes (they rewrite the ini, so
# they are the effective configs). Values are (M, K) -> (BM, BK, bm).
_PRESETS: dict[str, dict[str, dict[tuple[int, int], tuple[int, int, int]]]] = {
    "bitnet_b1_58-large": {
        "tl1": {(1536, 4096): (256, 128, 32), (1536, 1536): (128, 64, 64), (4096, 1536): (256, 128, 32)},
        "tl2": {(1536, 4096): (256, 96, 32), (1536, 1536): (128, 192, 32), (4096, 1536): (256, 96, 32)},
    },
    "bitnet_b1_58-3B": {
        "tl1": {(3200, 8640): (160, 64, 32), (3200, 3200): (320, 128, 64), (8640, 3200): (320, 64, 32)},
        "tl2": {(3200, 8640): (160, 96, 32), (3200, 3200): (320, 96, 32), (8640, 3200): (320, 96, 32)},
    },
    "Llama3-8B-1.58-100B-tokens": {
        "tl1": {
            (14336, 4096): (256, 128, 32),
            (4096, 14336): (128, 64, 64),
            (1024, 4096): (256, 128, 32),
            (4096, 4096): (128, 64, 64),
        },
        "tl2": {
            (14336, 4096): (256, 96, 32),
            (4096, 14336): (128, 96, 32),
            (1024, 4096): (256, 96, 32),
            (4096, 4096): (128, 96, 32),
        },
    },
}


def preset_names() -> list[str]:
    return sorted(_PRESETS)


def preset(name: str, kind: Literal["tl1", "tl2"]) -> TLConfigTable:
    """The codegen preset `name` for TL1 or TL2 (docs/formats.md §2.3).

    Unknown name or kind -> InvalidRequest (a ValueError) listing the presets.
    """
    if kind not in ("tl1", "tl2"):
        raise InvalidRequest(f"TL kind must be 'tl1' or 'tl2', got {kind!r}", param="tl_config")
    shapes = _PRESETS.get(name)
    if shapes is None:
        raise InvalidRequest(
            f"unknown TL preset {name!r}; known presets: {', '.join(preset_names())}",
            param="tl_config",
            hint="or pass a kernel_config.ini path",
        )
    configs = {mk: TileConfig(*tile) for mk, tile in shapes[kind].items()}
    return TLConfigTable(configs, source=f"preset {name!r} ({kind})")


def _ini_int(parser: configparser.ConfigParser, section: str, key: str, path: Path) -> int:
    # configparser lower-cases keys, as BitNet's own reader does: codegen writes M/K/BM/BK/bmm, the
    # converter reads m/k/bm/bk/bmm.
    if not parser.has_option(section, key):
        raise InvalidModelFile(
            f"section [{section}] has no key {key!r}",
            path=str(path),
            expected="keys m, k, bm (=BM), bk (=BK), bmm (=bm)",
        )
    text = parser.get(section, key).strip()
    try:
        value = int(text)
    except ValueError:
        raise InvalidModelFile(f"[{section}] {key} = {text!r} is not an integer", path=str(path)) from None
    if value <= 0:
        raise InvalidModelFile(f"[{section}] {key} = {value} must be positive", path=str(path))
    return value


def load_kernel_config_ini(path: str | Path) -> TLConfigTable:
    """Parse BitNet's include/kernel_config.ini: one section per shape with keys m, k, bm (BM), bk (BK),
    bmm (bm).

    As in BitNet's converter, the first section naming a shape wins; a later, different one is logged.
    """
    path = Path(path)
    parser = configparser.ConfigParser()
    try:
        with path.open(encoding="utf-8") as handle:
            parser.read_file(handle)
    except OSError as exc:
        raise InvalidModelFile(f"cannot read TL kernel config: {exc}", path=str(path)) from exc
    except configparser.Error as exc:
        raise InvalidModelFile(f"malformed TL kernel config: {exc}", path=str(path)) from exc
    configs: dict[tuple[int, int], TileConfig] = {}
    for section in parser.sections():
        shape = (_ini_int(parser, section, "m", path), _ini_int(parser, section, "k", path))
        tile = TileConfig(
            BM=_ini_int(parser, section, "bm", path),
            BK=_ini_int(parser, section, "bk", path),
            bm=_ini_int(parser, section, "bmm", path),
        )
        if shape in configs:
            if configs[shape] != tile:
                logger.warning(
                    "%s: [%s] repeats shape %s with %s; keeping the first, %s",
                    path,
                    section,
                    shape,
                    tile,
                    configs[shape],
                )
            continue
        configs[shape] = tile
    if not configs:
        raise InvalidModelFile(
            "TL kernel config has no sections",
            path=str(path),
            expected="sections with keys m, k, bm, bk, bmm",
        )
    return TLConfigTable(configs, source=str(path))


def sidecar_path(model_path: str | Path) -> Path:
    """`<model>.kernel_config.ini` beside the model: `dir/model.gguf` -> `dir/model.kernel_config.ini`.

    A name without a `.gguf` extension keeps its full name: `dir/model` -> `dir/model.kernel_config.ini`.
    """
    model_path = Path(model_path)
    if model_path.suffix.lower() == ".gguf":
        return model_path.with_name(model_path.stem + SIDECAR_SUFFIX)
    return model_path.with_name(model_path.name + SIDECAR_SUFFIX)
