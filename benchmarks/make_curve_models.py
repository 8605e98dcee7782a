"""Write the bitnet models the batch-limit curves run on: the same seeded ternary weights stored as I2_S,
TQ2_0, TQ1_0 and F16 (upstream `bitnet` arch, SmolLM2's tokenizer, F32 tied embedding).

    python benchmarks/make_curve_models.py benchmarks/out/curve            # the curve shape (below)
    python benchmarks/make_curve_models.py /tmp/tiny --layers 1 --hidden 256 --intermediate 768 --heads 4

Default shape (a ~0.1B bitnet, sized to run a 1..32 concurrency curve in minutes on 2 cores): 8 layers,
hidden 1024, intermediate 2816, 16 heads / 4 KV heads (head dim 64), vocab 49,152; 89 M ternary weights.
Files: <prefix>-<fmt>.gguf. F16 stores the ternary values plus N(0, 0.01) noise (the synthetic writer
has no F16, so this script writes those tensors itself): exactly ternary F16 weights would be detected
at load and run the ternary kernels, while a float model's F16 weights run the dense (f32 sgemm) path,
which is what this file measures.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.make_2b4t_model import smollm2_path  # noqa: E402
from bitserve.loader.gguf_types import GGMLType  # noqa: E402
from bitserve.loader.gguf_writer import GGUFBuilder  # noqa: E402
from bitserve.testing.synthetic import (  # noqa: E402
    SyntheticConfig,
    SyntheticWeights,
    make_weights,
    model_metadata,
    tokenizer_metadata,
    write_synthetic_model,
)

FORMATS = ("I2_S", "TQ2_0", "TQ1_0", "F16")


def dense_f16(values: np.ndarray, rng: np.random.Generator) -> bytes:
    """int8 ternary [rows, cols] -> F16 bytes of values + N(0, 0.01): not ternary, so loaded as dense."""
    return (values.astype(np.float32) + rng.normal(0.0, 0.01, size=values.shape)).astype(np.float16).tobytes()


def write_f16(path: Path, config: SyntheticConfig, weights: SyntheticWeights, tokenizer: dict) -> Path:
    """The synthetic model with F16 projections: the ternary values plus small noise (a dense float model)."""
    rng = np.random.default_rng(config.seed + 1)
    vocab, hidden = weights.embedding.shape
    builder = GGUFBuilder()
    for key, (value_type, value, array_type) in (model_metadata(config, vocab) | tokenizer).items():
        builder.add_kv(key, value_type, value, array_type)
    builder.add_tensor(
        "token_embd.weight", (hidden, vocab), int(weights.embedding_type), weights.embedding_bytes
    )
    for name, vector in weights.norms.items():
        builder.add_tensor(name, (vector.size,), int(GGMLType.F32), vector.tobytes())
    for key, values in weights.ternary.items():
        rows, cols = values.shape
        builder.add_tensor(f"{key}.weight", (cols, rows), int(GGMLType.F16), dense_f16(values, rng))
        builder.add_tensor(f"{key}.scale", (1,), int(GGMLType.F32), np.float32(weights.scales[key]).tobytes())
    builder.write(path)
    return path


def make_models(prefix: Path, config: SyntheticConfig, formats: tuple[str, ...] = FORMATS) -> dict[str, Path]:
    """Write `<prefix>-<fmt>.gguf` for each format (skipping files that exist); returns the paths."""
    tokenizer = tokenizer_metadata(smollm2_path())
    vocab = len(tokenizer["tokenizer.ggml.tokens"][1])
    weights = make_weights(config, vocab)
    paths = {}
    for fmt in formats:
        path = Path(f"{prefix}-{fmt.lower()}.gguf")
        if not path.exists():
            path.parent.mkdir(parents=True, exist_ok=True)
            if fmt == "F16":
                write_f16(path, config, weights, tokenizer)
            else:
                write_synthetic_model(path, fmt, config=config, weights=weights, tokenizer=tokenizer)
        paths[fmt] = path
    return paths


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("prefix", type=Path, help="files are <prefix>-<format>.gguf")
    parser.add_argument("--layers", type=int, default=8)
    parser.add_argument("--hidden", type=int, default=1024)
    parser.add_argument("--intermediate", type=int, default=2816, help="a multiple of 256 (TQ blocks)")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--kv-heads", type=int, default=4)
    parser.add_argument("--formats", default=",".join(FORMATS))
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    config = SyntheticConfig(
        num_layers=args.layers,
        hidden_size=args.hidden,
        intermediate_size=args.intermediate,
        num_heads=args.heads,
        num_kv_heads=args.kv_heads,
        seed=args.seed,
    )
    for fmt, path in make_models(args.prefix, config, tuple(args.formats.split(","))).items():
        print(f"{fmt:6} {path} {path.stat().st_size / 1e6:.1f} MB")


if __name__ == "__main__":
    main()
