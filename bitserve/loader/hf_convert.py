"""A Hugging Face checkpoint directory -> a GGUF file bitserve, llama.cpp and (for I2_S) bitnet.cpp load
(`bitserve convert DIR OUT.gguf --type T`), by the architecture's two name maps and the transforms of
loader/hf_checkpoint.py (q/k permuted for NORM RoPE, tied head dropped, BitNet projections to ternary codes).

Projections are written in the chosen type: F32, F16, Q8_0 (ggml's reference rounding, loader/requantize.py),
llama.cpp's Q1_0 / Q2_0 (loader/low_bit_quantize.py, bytes equal to llama.cpp's), or the ternary TQ2_0
(llama.cpp) / I2_S (bitnet.cpp, variant A). A ternary type is written only from weights that are ternary
(one scale per tensor): anything else is refused by the tensor's name, never silently widened. Norms and
biases are F32; the token embedding keeps its stored float type (a lossless copy). The FFN activation is
always written (`<arch>.hidden_act`): a BitNet model converted to llama.cpp's `bitnet` architecture must not
be read with that architecture's SiLU default. The tokenizer keys come from tokenizer.json
(loader/hf_tokenizer.py) unless the caller gives them.
"""

from __future__ import annotations

import contextlib
import json
import tempfile
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import torch

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes, ternary_codes_of
from bitserve.kernels.reference.dequant import i2s_geometry_error
from bitserve.loader.gguf_types import GGMLType, GGUFValueType
from bitserve.loader.gguf_writer import GGUFBuilder
from bitserve.loader.hf_checkpoint import Checkpoint, WeightValue
from bitserve.loader.hf_config import MetadataValue, gguf_metadata
from bitserve.loader.hf_tokenizer import tokenizer_metadata_from_dir
from bitserve.loader.low_bit_quantize import QUANTIZERS
from bitserve.loader.requantize import quantize_q8_0
from bitserve.loader.ternary_pack import i2s_from_codes, tq2_0_from_codes

WEIGHT_TYPES = {
    "F32": GGMLType.F32,
    "F16": GGMLType.F16,
    "Q8_0": GGMLType.Q8_0,
    "Q1_0": GGMLType.Q1_0,
    "Q2_0": GGMLType.Q2_0,
    "TQ2_0": GGMLType.TQ2_0,
    "I2_S": GGMLType.I2_S,
}
TERNARY_WEIGHT_TYPES = ("TQ2_0", "I2_S")
STORED_FLOAT_TYPES = {torch.float32: GGMLType.F32, torch.float16: GGMLType.F16, torch.bfloat16: GGMLType.BF16}
EncodedTensor = tuple[str, tuple[int, ...], int, bytes]
Progress = Callable[[int, int, str], None]  # (tensors done, total, name just written)


def output_architecture(checkpoint: Checkpoint, weight_type: str) -> str:
    """The GGUF architecture written: a BitNet checkpoint is bitnet.cpp's `bitnet-b1.58` in I2_S (the only
    reader of I2_S), llama.cpp's `bitnet` in its own types."""
    if checkpoint.architecture == "bitnet-b1.58" and weight_type != "I2_S":
        return "bitnet"
    return checkpoint.architecture


def checkpoint_metadata(
    checkpoint: Checkpoint,
    *,
    weight_type: str | None = None,
    tokenizer: Mapping[str, MetadataValue] | None = None,
    pre: str | None = None,
) -> dict[str, MetadataValue]:
    """Every GGUF key of the checkpoint: architecture keys, then the tokenizer's (from tokenizer.json
    unless `tokenizer` is given)."""
    arch = checkpoint.architecture if weight_type is None else output_architecture(checkpoint, weight_type)
    if tokenizer is None:
        tokenizer = tokenizer_metadata_from_dir(checkpoint.directory, checkpoint.config, pre=pre)
    return gguf_metadata(arch, checkpoint.config) | dict(tokenizer)


def _ternary_or_refuse(name: str, value: WeightValue, weight_type: str) -> TernaryCodes:
    if isinstance(value, TernaryCodes):
        return value
    codes = ternary_codes_of(value.to(torch.float32))
    if codes is None:
        raise InvalidModelFile(
            f"{name} is not ternary (its values are not -s, 0, +s for one s): it cannot be written as "
            f"{weight_type}",
            hint="convert a ternary (BitNet) checkpoint, or pick F16, Q8_0, Q2_0 or Q1_0",
        )
    return codes


def _encode_ternary(name: str, codes: TernaryCodes, weight_type: str) -> bytes:
    values = codes.values.numpy()
    if not codes.is_per_tensor:
        raise InvalidModelFile(
            f"{name}: ternary codes with per-block scales cannot be written as {weight_type}"
        )
    if weight_type == "I2_S":
        problem = i2s_geometry_error("A", *values.shape)
        if problem:
            raise UnsupportedModel(f"{name} cannot be written as I2_S: {problem}")
        return i2s_from_codes(values, float(codes.scale))
    if values.shape[1] % 256:
        raise UnsupportedModel(f"{name} cannot be written as TQ2_0: rows of {values.shape[1]} values")
    return tq2_0_from_codes(values, float(codes.scale))


def _encode_float(values: torch.Tensor, weight_type: str) -> bytes:
    """f32 [M, K] -> bytes of weight_type (F32, F16, Q8_0, Q1_0, Q2_0)."""
    if weight_type == "F32":
        return values.numpy().tobytes()
    if weight_type == "F16":
        return values.to(torch.float16).numpy().tobytes()
    if weight_type in QUANTIZERS:  # llama.cpp's 1- and 2-bit types, its reference rounding
        return QUANTIZERS[weight_type](values.numpy()).tobytes()
    rows, cols = values.shape
    packed = PackedWeight(values.view(torch.uint8).reshape(-1), (rows, cols), Layout.F32, "F32")
    return quantize_q8_0(packed).data.numpy().tobytes()


def encode_tensor(checkpoint: Checkpoint, name: str, weight_type: str) -> EncodedTensor:
    """(name, ggml shape, type id, bytes) of one GGUF-named tensor of the checkpoint in weight_type."""
    value = checkpoint.value(name)
    shape = tuple(reversed(checkpoint.matrix_shape(name)))  # ggml order: ne[0] is the row length
    if name == checkpoint.recipe.names.token_embedding and isinstance(value, torch.Tensor):
        stored = STORED_FLOAT_TYPES.get(value.dtype, GGMLType.F32)
        kept = value if value.dtype in STORED_FLOAT_TYPES else value.to(torch.float32)
        return name, shape, int(stored), kept.contiguous().view(torch.uint8).numpy().tobytes()
    is_matrix = len(shape) == 2
    if is_matrix and weight_type in TERNARY_WEIGHT_TYPES:
        if not checkpoint.is_projection(name):  # an untied head is not BitLinear: F16, as bitnet.cpp's
            return encode_tensor_as(name, value, shape, "F16")
        codes = _ternary_or_refuse(checkpoint.source_name(name), value, weight_type)
        return name, shape, int(WEIGHT_TYPES[weight_type]), _encode_ternary(name, codes, weight_type)
    return encode_tensor_as(name, value, shape, weight_type)


def encode_tensor_as(
    name: str, value: WeightValue, shape: tuple[int, ...], weight_type: str
) -> EncodedTensor:
    """A tensor as floats: vectors F32, matrices in weight_type (F32, F16, Q8_0, Q1_0, Q2_0)."""
    is_matrix = len(shape) == 2
    if isinstance(value, TernaryCodes):
        value = value.values.to(torch.float32) * value.scale
    values = value.detach().to(torch.float32).contiguous()
    if not is_matrix:
        return name, shape, int(GGMLType.F32), values.numpy().tobytes()
    return name, shape, int(WEIGHT_TYPES[weight_type]), _encode_float(values, weight_type)


def checkpoint_tensors(checkpoint: Checkpoint, weight_type: str) -> Iterator[EncodedTensor]:
    for name in checkpoint.gguf_names:
        yield encode_tensor(checkpoint, name, weight_type)


def _check_weight_type(weight_type: str) -> None:
    if weight_type not in WEIGHT_TYPES:
        raise ValueError(f"weight_type {weight_type!r}: one of {', '.join(WEIGHT_TYPES)}")


def convert_checkpoint(
    directory: str | Path,
    out: str | Path,
    *,
    weight_type: str = "F16",
    tokenizer: Mapping[str, MetadataValue] | None = None,
    pre: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write the checkpoint directory as a GGUF (see the module docstring); returns the path written."""
    _check_weight_type(weight_type)
    checkpoint = Checkpoint(directory)
    try:
        return write_checkpoint(
            checkpoint, out, weight_type=weight_type, tokenizer=tokenizer, pre=pre, progress=progress
        )
    finally:
        checkpoint.close()


def write_checkpoint(
    checkpoint: Checkpoint,
    out: str | Path,
    *,
    weight_type: str,
    tokenizer: Mapping[str, MetadataValue] | None = None,
    pre: str | None = None,
    progress: Progress | None = None,
) -> Path:
    """Write an open checkpoint as a GGUF of weight_type."""
    _check_weight_type(weight_type)
    builder = GGUFBuilder()
    metadata = checkpoint_metadata(checkpoint, weight_type=weight_type, tokenizer=tokenizer, pre=pre)
    arch = output_architecture(checkpoint, weight_type)
    if f"{arch}.hidden_act" not in metadata:  # always written: `bitnet`'s default is not the model's
        activation = checkpoint.config.get("hidden_act") or checkpoint.recipe.default_activation
        metadata[f"{arch}.hidden_act"] = (GGUFValueType.STRING, str(activation), None)
    for key, (value_type, value, array_type) in metadata.items():
        builder.add_kv(key, value_type, value, array_type)
    names = checkpoint.gguf_names
    for done, name in enumerate(names, start=1):
        _, shape, type_id, data = encode_tensor(checkpoint, name, weight_type)
        builder.add_tensor(name, shape, type_id, np.frombuffer(data, dtype=np.uint8))
        if progress is not None:
            progress(done, len(names), name)
    return builder.write(out)


@contextlib.contextmanager
def saved_checkpoint(config: Mapping[str, Any], state: Mapping[str, torch.Tensor]) -> Iterator[Checkpoint]:
    """An in-memory config and state dict as an open Checkpoint (a temporary save_pretrained-style
    directory), so tests and scripts convert through the same path as a directory on disk."""
    from safetensors.torch import save_file

    with tempfile.TemporaryDirectory(prefix="bitserve-checkpoint-") as folder:
        Path(folder, "config.json").write_text(json.dumps(dict(config)))
        # save_file refuses tensors sharing storage (a tied head): each is saved as its own copy
        save_file(
            {name: tensor.detach().contiguous().clone() for name, tensor in state.items()},
            Path(folder, "model.safetensors"),
        )
        checkpoint = Checkpoint(folder, order=list(state))
        try:
            yield checkpoint
        finally:
            checkpoint.close()


def write_gguf(
    path: str | Path,
    config: Mapping[str, Any],
    state: Mapping[str, torch.Tensor],
    tokenizer: Mapping[str, MetadataValue],
    *,
    weight_type: str = "F32",
) -> Path:
    """Write an in-memory checkpoint as a GGUF of its architecture with `tokenizer`'s keys."""
    _check_weight_type(weight_type)
    with saved_checkpoint(config, state) as checkpoint:
        return write_checkpoint(checkpoint, path, weight_type=weight_type, tokenizer=tokenizer)
