"""loader/safetensors_dir.py: the mapped tensors equal the safetensors library's, across shards, and a
hostile header (bounds, overlaps, dtypes, sizes, shard names leading out of the directory) is refused
with InvalidModelFile naming the problem, never read past the file."""

from __future__ import annotations

import json
import struct
from pathlib import Path

import pytest
import torch

from bitserve.errors import InvalidModelFile
from bitserve.loader.safetensors_dir import SafetensorsDir

safetensors_torch = pytest.importorskip("safetensors.torch")


def _tensors() -> dict[str, torch.Tensor]:
    generator = torch.Generator().manual_seed(0)
    return {
        "a.weight": torch.randn(6, 8, generator=generator).to(torch.bfloat16),
        "b.weight": torch.randn(3, 5, generator=generator),
        "c.bias": torch.randn(7, generator=generator).to(torch.float16),
        "d.packed": torch.randint(0, 255, (2, 9), dtype=torch.uint8, generator=generator),
        "e.scale": torch.tensor([0.5]),
    }


def test_tensors_equal_the_safetensors_library(tmp_path: Path) -> None:
    tensors = _tensors()
    safetensors_torch.save_file(tensors, tmp_path / "model.safetensors")
    expected = safetensors_torch.load_file(tmp_path / "model.safetensors")
    with SafetensorsDir(tmp_path) as store:
        assert set(store.tensors) == set(expected)
        for name, value in expected.items():
            got = store.tensor(name)
            assert got.dtype == value.dtype and got.shape == value.shape
            assert torch.equal(got, value), name


def test_sharded_checkpoint_reads_every_shard(tmp_path: Path) -> None:
    tensors = _tensors()
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[:2], "model-00002-of-00002.safetensors": names[2:]}
    weight_map = {}
    for shard, members in shards.items():
        safetensors_torch.save_file({n: tensors[n] for n in members}, tmp_path / shard)
        weight_map |= dict.fromkeys(members, shard)
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    with SafetensorsDir(tmp_path) as store:
        assert set(store.tensors) == set(tensors)
        assert all(torch.equal(store.tensor(n), tensors[n]) for n in tensors)
        assert store.pread("b.weight", 4, 8) == tensors["b.weight"].numpy().tobytes()[4:12]


def _write_raw(path: Path, header: dict, data: bytes) -> None:
    body = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(body)) + body + data)


@pytest.mark.parametrize(
    ("header", "data", "message"),
    [
        ({"x": {"dtype": "F32", "shape": [4], "data_offsets": [0, 16]}}, b"\0" * 8, "do not hold"),
        ({"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 12]}}, b"\0" * 12, "do not hold"),
        ({"x": {"dtype": "F32", "shape": [-1], "data_offsets": [0, 4]}}, b"\0" * 4, "shape"),
        ({"x": {"dtype": "Q9", "shape": [1], "data_offsets": [0, 4]}}, b"\0" * 4, "dtype"),
        ({"x": {"dtype": "F32", "shape": [1], "data_offsets": [4]}}, b"\0" * 4, "data_offsets"),
        ({"x": ["not", "an", "object"]}, b"", "not an object"),
        (
            {
                "x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]},
                "y": {"dtype": "F32", "shape": [2], "data_offsets": [4, 12]},
            },
            b"\0" * 12,
            "overlap",
        ),
    ],
)
def test_hostile_headers_are_refused(tmp_path: Path, header: dict, data: bytes, message: str) -> None:
    _write_raw(tmp_path / "model.safetensors", header, data)
    with pytest.raises(InvalidModelFile, match=message):
        SafetensorsDir(tmp_path)


def test_header_length_past_the_file_is_refused(tmp_path: Path) -> None:
    (tmp_path / "model.safetensors").write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    with pytest.raises(InvalidModelFile, match="does not fit"):
        SafetensorsDir(tmp_path)


@pytest.mark.parametrize("shard", ["../outside.safetensors", "/etc/passwd", "sub/model.safetensors"])
def test_index_shard_names_cannot_leave_the_directory(tmp_path: Path, shard: str) -> None:
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"x": shard}}))
    with pytest.raises(InvalidModelFile, match="not a file name"):
        SafetensorsDir(tmp_path)


def test_a_directory_without_weights_is_refused(tmp_path: Path) -> None:
    with pytest.raises(InvalidModelFile, match="model.safetensors"):
        SafetensorsDir(tmp_path)
