"""A Hugging Face checkpoint directory served as if it were its converted GGUF: the same metadata keys and
tensor names, so the loader, the spec and the tokenizer take one path for both (loader/model_loader.py).

What the loader reads of a GGUFFile, this has: `metadata` (config.json's keys as hf_convert.gguf_metadata
writes them, the tokenizer's from tokenizer.json), `tensors` (TensorInfo under GGUF names and GGML types),
`tensor_bytes`, `release_pages`, `read_rows`, `close`. The bytes of a tensor the checkpoint stores as the
GGUF would (an unpermuted F32 / F16 / BF16 tensor) are the mapped safetensors bytes, not a copy; a permuted
q/k is a copy in its stored dtype; a BitNet projection is packed as I2_S (2 bits a weight) from its ternary
codes (loader/hf_checkpoint.py), or F32 where its shape does not fit I2_S's blocks.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import Any

import numpy as np
import torch

from bitserve.errors import InvalidModelFile
from bitserve.kernels.packed import TernaryCodes
from bitserve.kernels.reference.dequant import i2s_geometry_error
from bitserve.loader.checkpoint_dir import checkpoint_files
from bitserve.loader.gguf_reader import GGUFFile, TensorInfo, read_gguf
from bitserve.loader.gguf_types import Dialect, GGMLType, tensor_nbytes
from bitserve.loader.hf_checkpoint import Checkpoint
from bitserve.loader.hf_convert import checkpoint_metadata
from bitserve.loader.hf_tokenizer import plain_metadata
from bitserve.loader.ternary_pack import i2s_from_codes

FLOAT_TYPES = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16, torch.bfloat16: GGMLType.BF16}
I2S_SCALE_BYTES = 32


def open_model_file(
    path: str | Path, *, i2s_variant: str = "A", tokenizer_pre: str | None = None
) -> GGUFFile | CheckpointFile:
    """A GGUF file, or a Hugging Face checkpoint directory (config.json + safetensors) in its shape."""
    if Path(path).is_dir():
        return CheckpointFile(path, i2s_variant=i2s_variant, tokenizer_pre=tokenizer_pre)
    return read_gguf(path)


class CheckpointFile:
    """An open checkpoint directory in GGUFFile's shape (see the module docstring)."""

    version = 3  # the GGUF version a conversion writes
    dialect = Dialect.BITNET_CPP  # I2_S is bitnet.cpp's type id
    alignment = 32

    def __init__(
        self, directory: str | Path, *, i2s_variant: str = "A", tokenizer_pre: str | None = None
    ) -> None:
        self.path = str(directory)
        self.checkpoint = Checkpoint(directory)
        try:
            typed = checkpoint_metadata(self.checkpoint, pre=tokenizer_pre)
            self.metadata: dict[str, Any] = plain_metadata(typed)
            self.value_types = {key: value_type for key, (value_type, _, _) in typed.items()}
            self.array_types = {key: array for key, (_, _, array) in typed.items() if array is not None}
            self._i2s_variant = i2s_variant
            self.tensors = {name: self._info(name) for name in self.checkpoint.gguf_names}
        except BaseException:
            self.checkpoint.close()
            raise
        self._made: dict[str, torch.Tensor] = {}  # bytes of transformed tensors, made on first use
        self.file_size = sum(path.stat().st_size for path in checkpoint_files(Path(directory)))

    def _packs_as_i2s(self, name: str) -> bool:
        if not self.checkpoint.is_ternary(name):
            return False
        rows, cols = self.checkpoint.matrix_shape(name)
        return not i2s_geometry_error(self._i2s_variant, rows, cols)

    def _info(self, name: str) -> TensorInfo:
        shape = tuple(reversed(self.checkpoint.matrix_shape(name)))  # ggml order
        if self._packs_as_i2s(name):
            ggml_type = GGMLType.I2_S
            nbytes = shape[0] * shape[1] // 4 + I2S_SCALE_BYTES
        else:
            stored = self.checkpoint.stored(name).dtype
            ggml_type = GGMLType.F32 if self.checkpoint.is_ternary(name) else FLOAT_TYPES.get(stored)  # type: ignore[assignment]
            if ggml_type is None:
                raise InvalidModelFile(
                    f"tensor {self.checkpoint.source_name(name)!r} is stored as {stored}, not a float type",
                    path=self.path,
                )
            nbytes = tensor_nbytes(ggml_type, shape)
        return TensorInfo(name, shape, int(ggml_type), ggml_type, 0, -1, nbytes)

    def tensor_bytes(self, name: str) -> torch.Tensor:
        """uint8 [nbytes] of the tensor in its TensorInfo type: a view of the mapping where it can be."""
        if self.checkpoint.is_view(name):
            return self.checkpoint.store.raw(self.checkpoint.source_name(name))
        made = self._made.get(name)
        if made is None:
            made = self._made[name] = self._transformed_bytes(name)
        return made

    def _transformed_bytes(self, name: str) -> torch.Tensor:
        value = self.checkpoint.value(name)
        if isinstance(value, TernaryCodes):
            if self._packs_as_i2s(name):
                packed = i2s_from_codes(value.values.numpy(), float(value.scale), self._i2s_variant)
                return torch.frombuffer(bytearray(packed), dtype=torch.uint8)
            value = value.values.to(torch.float32) * value.scale
        return value.contiguous().reshape(-1).view(torch.uint8)

    def release_pages(self, name: str) -> None:
        """The caller copied the tensor out: a made tensor is dropped, a mapped one's pages given back."""
        if self._made.pop(name, None) is None and self.checkpoint.is_view(name):
            self.checkpoint.store.release_pages(self.checkpoint.source_name(name))

    def read_rows(self, name: str, row_ids: Sequence[int], row_bytes: int) -> np.ndarray:
        """uint8 [len(row_ids), row_bytes] read from the file (GGUFFile.read_rows: no page faults)."""
        info = self.tensors[name]
        num_rows = info.nbytes // row_bytes
        out = np.empty((len(row_ids), row_bytes), dtype=np.uint8)
        for index, row in enumerate(row_ids):
            if not 0 <= row < num_rows:
                raise IndexError(f"row {row} of {name!r} is outside [0, {num_rows})")
            if self.checkpoint.is_view(name):
                data = self.checkpoint.store.pread(
                    self.checkpoint.source_name(name), row * row_bytes, row_bytes
                )
                out[index] = np.frombuffer(data, dtype=np.uint8)
            else:
                out[index] = self.tensor_bytes(name)[row * row_bytes : (row + 1) * row_bytes].numpy()
        return out

    def architecture(self) -> str:
        return self.checkpoint.architecture

    def close(self) -> None:
        self._made.clear()
        self.checkpoint.close()

    def __enter__(self) -> CheckpointFile:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()


ModelFile = GGUFFile | CheckpointFile  # what a model is loaded from: a GGUF, or an HF checkpoint directory
