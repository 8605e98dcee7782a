"""A small GGUF whose projections mix block formats the way llama.cpp's K-quant mixes do (SmolLM2's Q4_K_M:
Q5_0 q/k, Q8_0 or Q5_0 v, Q4_K or Q6_K down, by layer), for tests of the cpu backend's mixed one-call
decode step (kernels/cpu/block_step.MixedBlockStep) against its module forward. Needs `gguf` and
`transformers` (test dependencies).

The weights are hf_checkpoints.random_checkpoint's (wide: every projection's input a multiple of 128, and
down's of 256 as the K-quants need) encoded by gguf-py's quantizers (Q4_0, Q4_1, Q5_0, Q5_1, Q8_0) and
bitserve's Q1_0 / Q2_0 writer; gguf-py has no K-quant quantizer, so the K-quant tensors are random
super-blocks (codes and scales drawn from a seeded generator, f16 d and dmin kept small): valid blocks of
the format, which is what a kernel test needs.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

# GGUF tensor name (blk.N.<name>.weight) -> its type in layers 0 .. 3: q/k/v and gate/up of several
# formats (they run side by side), and of one (one stacked weight: layer 1's gate/up, layer 2's q/k/v)
MIXED_TYPES: dict[str, tuple[str, ...]] = {
    "attn_q": ("Q5_0", "Q4_0", "Q8_0", "Q4_0"),
    "attn_k": ("Q8_0", "Q5_0", "Q8_0", "Q4_0"),
    "attn_v": ("Q5_1", "Q8_0", "Q8_0", "Q4_0"),
    "attn_output": ("Q4_1", "Q1_0", "Q5_0", "Q4_0"),
    "ffn_gate": ("Q4_0", "Q5_1", "Q2_0", "Q4_0"),
    "ffn_up": ("Q2_0", "Q5_1", "Q4_1", "Q4_0"),
    "ffn_down": ("Q4_K", "Q6_K", "Q5_K", "Q2_K"),
}
NUM_LAYERS = 4
# K-quant type -> (bytes of a 256-value super-block, offsets of its f16 fields: d, and dmin where it has one)
K_QUANT_BLOCKS = {
    "Q2_K": (84, (80, 82)),
    "Q3_K": (110, (108,)),
    "Q4_K": (144, (0, 2)),
    "Q5_K": (176, (0, 2)),
    "Q6_K": (210, (208,)),
}
K_QUANT_VALUES = 256


def random_k_quant(num_rows: int, num_cols: int, type_name: str, seed: int) -> np.ndarray:
    """Random super-blocks of a K-quant type for an [M, K] weight, uint8 [M, K / 256 * type size]: random
    codes and scales, |N(0, 0.002)| f16 d (and dmin)."""
    type_size, f16_fields = K_QUANT_BLOCKS[type_name]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, size=(num_rows * num_cols // K_QUANT_VALUES, type_size), dtype=np.uint8)
    for at in f16_fields:
        small = np.abs(rng.normal(0.0, 0.002, raw.shape[0])).astype(np.float16)
        raw[:, at : at + 2] = small.view(np.uint8).reshape(-1, 2)
    return raw.reshape(num_rows, -1)


def encode(values: np.ndarray, type_name: str, seed: int) -> bytes:
    """f32 [M, K] -> the tensor's bytes in `type_name`."""
    import gguf

    from bitserve.loader.low_bit_quantize import QUANTIZERS

    if type_name in QUANTIZERS:
        return QUANTIZERS[type_name](values).tobytes()
    if type_name in K_QUANT_BLOCKS:
        return random_k_quant(*values.shape, type_name, seed).tobytes()
    return gguf.quantize(values, gguf.GGMLQuantizationType[type_name]).tobytes()


def mixed_format_gguf(arch: str, tokenizer_source: Path, folder: Path) -> Path:
    """The random-init `arch` checkpoint (NUM_LAYERS layers) with the vocabulary of the GGUF
    `tokenizer_source`, written to `folder`/<arch>-mixed.gguf with each projection in its MIXED_TYPES
    format (embedding, head, norms F32)."""
    from bitserve.loader.gguf_types import GGMLType
    from bitserve.loader.gguf_writer import GGUFBuilder
    from bitserve.loader.hf_convert import checkpoint_metadata, checkpoint_tensors, saved_checkpoint
    from bitserve.testing.hf_checkpoints import checkpoint_config, random_checkpoint
    from bitserve.testing.synthetic import tokenizer_metadata

    tokenizer = tokenizer_metadata(tokenizer_source)
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"][1])
    model = random_checkpoint(arch, vocab_size, wide=True, num_layers=NUM_LAYERS)
    builder = GGUFBuilder()
    with torch.no_grad(), saved_checkpoint(checkpoint_config(model), model.state_dict()) as checkpoint:
        for key, (value_type, value, array_type) in checkpoint_metadata(
            checkpoint, tokenizer=tokenizer
        ).items():
            builder.add_kv(key, value_type, value, array_type)
        tensors = list(checkpoint_tensors(checkpoint, "F32"))
    for seed, (name, shape, type_id, data) in enumerate(tensors):
        parts = name.split(".")
        if parts[0] == "blk" and parts[2] in MIXED_TYPES:
            type_name = MIXED_TYPES[parts[2]][int(parts[1])]
            values = np.frombuffer(data, dtype=np.float32).reshape(shape[1], shape[0])
            data, type_id = encode(values, type_name, seed), int(GGMLType[type_name])
        builder.add_tensor(name, shape, type_id, np.frombuffer(data, dtype=np.uint8))
    return builder.write(Path(folder) / f"{arch}-mixed.gguf")
