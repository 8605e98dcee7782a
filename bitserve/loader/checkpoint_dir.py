"""Where a Hugging Face checkpoint directory keeps its files (config.json, tokenizer files, safetensors
shards), with no torch import: the catalog and the model roots ask whether a path is a checkpoint."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from bitserve.errors import InvalidModelFile

MAX_INDEX_BYTES = 64 * 1024 * 1024
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


def is_checkpoint_dir(path: Path) -> bool:
    """A directory holding a config.json: a Hugging Face checkpoint to serve or convert."""
    return path.is_dir() and (path / "config.json").is_file()


def checkpoint_files(directory: Path) -> list[Path]:
    """The files a checkpoint is served from (its version hashes them): config, tokenizer, weights."""
    names = ["config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja", INDEX_FILE]
    return [directory / name for name in names + shard_names(directory) if (directory / name).is_file()]


def fail(
    path: Path, message: str, hint: str = "the file is damaged or not a safetensors file"
) -> InvalidModelFile:
    return InvalidModelFile(message, path=str(path), hint=hint)


def read_json(path: Path, limit: int) -> Any:
    """A JSON file of at most `limit` bytes; InvalidModelFile (with the path) when it is not."""
    try:
        size = path.stat().st_size
        if size > limit:
            raise fail(path, f"{size} bytes of JSON, over the {limit} bytes allowed")
        return json.loads(path.read_bytes())
    except OSError as exc:
        raise fail(path, f"cannot read: {exc.strerror or exc}", "check the path and its permissions") from exc
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise fail(path, f"malformed JSON: {exc}", "the file is damaged") from exc


def shard_names(directory: Path) -> list[str]:
    """The safetensors files holding the checkpoint, in the index's order (or the single file)."""
    index = directory / INDEX_FILE
    if index.exists():
        index_json = read_json(index, MAX_INDEX_BYTES)
        weight_map = index_json.get("weight_map") if isinstance(index_json, dict) else None
        if not isinstance(weight_map, dict) or not weight_map:
            raise fail(index, "no weight_map in the index")
        names = list(dict.fromkeys(weight_map.values()))
        for name in names:
            # a shard name is a file of this directory: no path may lead out of it
            if not isinstance(name, str) or Path(name).name != name or name in ("", ".", ".."):
                raise fail(index, f"shard name {name!r} is not a file name in the checkpoint directory")
        return names
    if (directory / SINGLE_FILE).exists():
        return [SINGLE_FILE]
    raise InvalidModelFile(
        f"no {SINGLE_FILE} or {INDEX_FILE}",
        path=str(directory),
        hint="a checkpoint directory holds its weights as safetensors (save_pretrained's layout)",
    )
