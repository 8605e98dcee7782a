"""Synthetic BitNet GGUF files (docs/formats.md §6.3): the same random ternary weights in any storage format.

Upstream `bitnet` semantics (SiLU-gated FFN, sub-norms, NEOX RoPE, tied head, a scalar `.scale` per
projection), so llama.cpp reads the F32 / TQ1_0 / TQ2_0 / Q2_0 files too. F32 and TQ files are written with
the `gguf` package's writer (an independent writer, as the tests want); I2_S / TL1 / TL2 / Q2_0, which gguf
cannot write, with bitserve's own GGUFBuilder. Deterministic in `seed`. Needs the `gguf` package.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.gguf_types import GGMLType, GGUFValueType
from bitserve.loader.gguf_writer import GGUFBuilder
from bitserve.loader.low_bit_quantize import quantize_q2_0
from bitserve.loader.ternary_pack import pack_tl1, pack_tl2, quantize_i2s
from bitserve.loader.tl_config import TileConfig, sidecar_path

FORMATS = ("F32", "TQ1_0", "TQ2_0", "I2_S", "TL1", "TL2", "Q2_0")
PROJECTIONS = ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down")
TOKENIZER_KEYS = (
    "tokenizer.ggml.model",
    "tokenizer.ggml.pre",
    "tokenizer.ggml.tokens",
    "tokenizer.ggml.token_type",
    "tokenizer.ggml.merges",
    "tokenizer.ggml.bos_token_id",
    "tokenizer.ggml.eos_token_id",
    "tokenizer.ggml.unknown_token_id",
    "tokenizer.ggml.padding_token_id",
    "tokenizer.ggml.add_bos_token",
)


@dataclass(frozen=True, slots=True)
class SyntheticConfig:
    num_layers: int = 2
    hidden_size: int = 256
    intermediate_size: int = 768
    num_heads: int = 4
    num_kv_heads: int = 4
    context_length: int = 4096
    rope_theta: float = 500000.0
    rms_eps: float = 1e-5
    seed: int = 0
    embedding_std: float = 0.02
    projection_scale: float = 0.05
    architecture: str = "bitnet"
    # F32 keeps llama.cpp's LM head free of activation quantization (a Q8_0 head quantizes its input)
    embedding_type: str = "F32"

    def projection_shape(self, name: str) -> tuple[int, int]:
        """(out, in) of a projection."""
        head_dim = self.hidden_size // self.num_heads
        kv_size = head_dim * self.num_kv_heads
        return {
            "attn_q": (self.hidden_size, self.hidden_size),
            "attn_k": (kv_size, self.hidden_size),
            "attn_v": (kv_size, self.hidden_size),
            "attn_output": (self.hidden_size, self.hidden_size),
            "ffn_gate": (self.intermediate_size, self.hidden_size),
            "ffn_up": (self.intermediate_size, self.hidden_size),
            "ffn_down": (self.hidden_size, self.intermediate_size),
        }[name]


@dataclass
class SyntheticWeights:
    """Float weights: embedding [vocab, hidden] (exactly as stored), ternary int8 projections, norms."""

    embedding: np.ndarray
    embedding_bytes: bytes  # the stored token_embd (F32 or Q8_0)
    embedding_type: GGMLType
    ternary: dict[str, np.ndarray]  # "blk.N.attn_q" -> int8 [out, in]
    scales: dict[str, float]  # "blk.N.attn_q" -> projection output multiplier
    norms: dict[str, np.ndarray]  # tensor name -> f32 vector


def tokenizer_metadata(source: str | Path) -> dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]:
    """The tokenizer keys of a real GGUF (e.g. SmolLM2), with their stored types, ready to re-write."""
    with read_gguf(source) as gguf:
        out = {}
        for key in TOKENIZER_KEYS:
            if key in gguf.metadata:
                value = gguf.metadata[key]
                value = list(value) if isinstance(value, np.ndarray) else value
                out[key] = (gguf.value_types[key], value, gguf.array_types.get(key))
        return out


def make_weights(config: SyntheticConfig, vocab_size: int) -> SyntheticWeights:
    import gguf  # writer-side dependency only

    rng = np.random.default_rng(config.seed)
    raw = rng.normal(0.0, config.embedding_std, size=(vocab_size, config.hidden_size)).astype(np.float32)
    embedding_type = GGMLType[config.embedding_type]
    if embedding_type is GGMLType.F32:
        embedding, embedding_bytes = raw, raw.tobytes()
    elif embedding_type is GGMLType.F16:
        half = raw.astype(np.float16)
        embedding, embedding_bytes = half.astype(np.float32), half.tobytes()
    elif embedding_type is GGMLType.Q8_0:
        packed = gguf.quants.quantize(raw, gguf.GGMLQuantizationType.Q8_0)
        embedding = gguf.quants.dequantize(packed, gguf.GGMLQuantizationType.Q8_0).astype(np.float32)
        embedding_bytes = packed.tobytes()
    else:
        raise ValueError(f"embedding_type must be F32, F16 or Q8_0, got {config.embedding_type!r}")
    ternary, scales, norms = {}, {}, {}
    for layer in range(config.num_layers):
        for name in PROJECTIONS:
            key = f"blk.{layer}.{name}"
            ternary[key] = rng.integers(-1, 2, size=config.projection_shape(name), dtype=np.int8)
            scales[key] = config.projection_scale
        for name, width in (
            ("attn_norm", config.hidden_size),
            ("ffn_norm", config.hidden_size),
            ("attn_sub_norm", config.hidden_size),
            ("ffn_sub_norm", config.intermediate_size),
        ):
            norms[f"blk.{layer}.{name}.weight"] = np.ones(width, dtype=np.float32)
    norms["output_norm.weight"] = np.ones(config.hidden_size, dtype=np.float32)
    return SyntheticWeights(embedding, embedding_bytes, embedding_type, ternary, scales, norms)


def model_metadata(
    config: SyntheticConfig, vocab_size: int
) -> dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]:
    arch = config.architecture
    u32, f32 = GGUFValueType.UINT32, GGUFValueType.FLOAT32
    return {
        "general.architecture": (GGUFValueType.STRING, arch, None),
        "general.name": (
            GGUFValueType.STRING,
            f"synthetic-{arch}-{config.num_layers}L-{config.hidden_size}",
            None,
        ),
        f"{arch}.context_length": (u32, config.context_length, None),
        f"{arch}.embedding_length": (u32, config.hidden_size, None),
        f"{arch}.block_count": (u32, config.num_layers, None),
        f"{arch}.feed_forward_length": (u32, config.intermediate_size, None),
        f"{arch}.attention.head_count": (u32, config.num_heads, None),
        f"{arch}.attention.head_count_kv": (u32, config.num_kv_heads, None),
        f"{arch}.attention.layer_norm_rms_epsilon": (f32, config.rms_eps, None),
        f"{arch}.rope.freq_base": (f32, config.rope_theta, None),
        f"{arch}.rope.dimension_count": (u32, config.hidden_size // config.num_heads, None),
        f"{arch}.vocab_size": (u32, vocab_size, None),
    }


def _tensors(
    weights: SyntheticWeights, fmt: str, tl_tiles: Mapping[tuple[int, int], TileConfig]
) -> Iterator[tuple[str, tuple[int, ...], int, bytes]]:
    """(name, ggml shape, type id, bytes) for every tensor in file order."""
    import gguf

    vocab, hidden = weights.embedding.shape
    yield "token_embd.weight", (hidden, vocab), int(weights.embedding_type), weights.embedding_bytes
    for name, vector in weights.norms.items():
        yield name, (vector.size,), int(GGMLType.F32), vector.tobytes()
    for key, values in weights.ternary.items():
        rows, cols = values.shape
        if fmt == "F32":
            data, type_id = values.astype(np.float32).tobytes(), int(GGMLType.F32)
        elif fmt in ("TQ1_0", "TQ2_0"):
            qtype = gguf.GGMLQuantizationType[fmt]
            data, type_id = gguf.quants.quantize(values.astype(np.float32), qtype).tobytes(), int(qtype)
        elif fmt == "I2_S":
            data, type_id = quantize_i2s(values.astype(np.float32)), int(GGMLType.I2_S)
        elif fmt == "Q2_0":  # llama.cpp's own 2-bit type: d = 1, codes t + 1 (bytes equal to llama.cpp's)
            data, type_id = quantize_q2_0(values.astype(np.float32)).tobytes(), int(GGMLType.Q2_0)
        elif fmt == "TL1":
            data, type_id = pack_tl1(values, 1.0, tl_tiles[(rows, cols)]), int(GGMLType.TL1)
        elif fmt == "TL2":
            data, type_id = pack_tl2(values, 1.0, tl_tiles[(rows, cols)]), int(GGMLType.TL2)
        else:
            raise ValueError(f"unknown format {fmt!r}; one of {FORMATS}")
        yield f"{key}.weight", (cols, rows), type_id, data
        yield f"{key}.scale", (1,), int(GGMLType.F32), np.float32(weights.scales[key]).tobytes()


def tl_tile_table(config: SyntheticConfig, fmt: str) -> dict[tuple[int, int], TileConfig]:
    """A tile config per projection shape that satisfies the TL1 / TL2 geometry rules."""
    tiles = {}
    for name in PROJECTIONS:
        rows, cols = config.projection_shape(name)
        if fmt == "TL1":
            tiles[(rows, cols)] = TileConfig(BM=min(rows, 128), BK=128, bm=32)
        else:
            tiles[(rows, cols)] = TileConfig(BM=min(rows, 128), BK=96, bm=32)
    return tiles


def write_kernel_config_ini(path: Path, tiles: Mapping[tuple[int, int], TileConfig]) -> None:
    sections = [
        f"[Kernels_{i}]\nm = {m}\nk = {k}\nbm = {t.BM}\nbk = {t.BK}\nbmm = {t.bm}\n"
        for i, ((m, k), t) in enumerate(tiles.items())
    ]
    path.write_text("\n".join(sections), encoding="utf-8")


def write_synthetic_model(
    path: str | Path,
    fmt: str,
    *,
    config: SyntheticConfig,
    weights: SyntheticWeights,
    tokenizer: Mapping[str, tuple[GGUFValueType, Any, GGUFValueType | None]],
) -> Path:
    """Write `weights` stored as `fmt`. TL formats also get their `<model>.kernel_config.ini` sidecar."""
    path = Path(path)
    vocab = weights.embedding.shape[0]
    metadata = model_metadata(config, vocab) | dict(tokenizer)
    tiles = tl_tile_table(config, fmt) if fmt in ("TL1", "TL2") else {}
    if fmt in ("TL1", "TL2"):
        write_kernel_config_ini(sidecar_path(path), tiles)
    if fmt in ("F32", "TQ1_0", "TQ2_0"):
        _write_with_gguf(path, config, metadata, _tensors(weights, fmt, tiles))
    else:
        builder = GGUFBuilder()
        for key, (value_type, value, array_type) in metadata.items():
            builder.add_kv(key, value_type, value, array_type)
        for name, shape, type_id, data in _tensors(weights, fmt, tiles):
            builder.add_tensor(name, shape, type_id, data)
        builder.write(path)
    return path


def _write_with_gguf(
    path: Path,
    config: SyntheticConfig,
    metadata: Mapping[str, tuple[GGUFValueType, Any, GGUFValueType | None]],
    tensors: Iterator[tuple[str, tuple[int, ...], int, bytes]],
) -> None:
    import gguf

    writer = gguf.GGUFWriter(str(path), config.architecture)
    for key, (value_type, value, array_type) in metadata.items():
        if key == "general.architecture":
            continue  # the writer adds it
        sub_type = gguf.GGUFValueType(int(array_type)) if array_type is not None else None
        writer.add_key_value(key, value, gguf.GGUFValueType(int(value_type)), sub_type)
    for name, shape, type_id, data in tensors:
        raw = np.frombuffer(data, dtype=np.uint8)
        qtype = gguf.GGMLQuantizationType(type_id)
        if qtype == gguf.GGMLQuantizationType.F32:
            writer.add_tensor(name, raw.view(np.float32).reshape(tuple(reversed(shape))))
        else:
            num_rows = int(np.prod(shape[1:]))
            writer.add_tensor(
                name, raw.reshape(num_rows, -1), raw_dtype=qtype
            )  # byte shape [rows, row bytes]
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
