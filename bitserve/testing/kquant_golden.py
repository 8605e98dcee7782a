"""The K-quant golden files (scripts/make_kquant_golden.py): their F32 source, a small random llama
checkpoint converted by loader/hf_convert.py, and each mix rebuilt from it and the tensors llama.cpp wrote
(tests/fixtures/golden/kquant_tensors.npz). Needs `transformers` (a test dependency)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import numpy as np

MIXES = ("Q4_K_M", "Q5_K_M", "Q3_K_M", "Q6_K", "Q2_K")  # llama.cpp ftypes (LLAMA_FTYPE_MOSTLY_<mix>)
WIDTH = 256  # every projection's input whole 256-value super-blocks: no type falls back
# llama.h's llama_ftype numbers
FILE_TYPES = {"Q4_K_M": 15, "Q5_K_M": 17, "Q3_K_M": 12, "Q6_K": 18, "Q2_K": 10}


def f32_source(tokenizer_source: Path, folder: Path) -> Path:
    """The random-init llama checkpoint (WIDTH wide, 2 layers) with the vocabulary of `tokenizer_source`,
    written as F32 to `folder`/kquant-f32.gguf."""
    from bitserve.loader.hf_convert import write_gguf
    from bitserve.testing.hf_checkpoints import checkpoint_config, random_checkpoint
    from bitserve.testing.synthetic import tokenizer_metadata

    tokenizer = tokenizer_metadata(tokenizer_source)
    model = random_checkpoint("llama", len(tokenizer["tokenizer.ggml.tokens"][1]), width=WIDTH)
    path = Path(folder) / "kquant-f32.gguf"
    return write_gguf(path, checkpoint_config(model), model.state_dict(), tokenizer, weight_type="F32")


def rebuild_mix(
    source: Path, mix: str, types: Mapping[str, int], tensors: Mapping[str, np.ndarray], target: Path
) -> Path:
    """`source` with the tensors llama.cpp changed for `mix` (types: name -> ggml type id; tensors:
    "<mix>/<name>" -> bytes) in place of its own."""
    from bitserve.loader.quantize_file import rewrite_gguf

    def encode(name: str, info: object, data: np.ndarray) -> tuple[int, bytes] | None:
        if name not in types:
            return None
        return types[name], tensors[f"{mix}/{name}"].tobytes()

    rewrite_gguf(source, target, encode, FILE_TYPES[mix])
    return target


def golden_mix_files(tokenizer_source: Path, fixtures: Path, folder: Path) -> tuple[str, dict[str, Path]]:
    """(the F32 source's sha256, every mix's file) rebuilt in `folder` from the fixtures in `fixtures`
    (kquant.json, kquant_tensors.npz: scripts/make_kquant_golden.py)."""
    import hashlib
    import json

    golden = json.loads((fixtures / "kquant.json").read_text(encoding="utf-8"))
    source = f32_source(tokenizer_source, folder)
    tensors = np.load(fixtures / "kquant_tensors.npz")
    files = {
        mix: rebuild_mix(source, mix, golden["mixes"][mix]["types"], tensors, folder / f"{mix}.gguf")
        for mix in MIXES
    }
    return hashlib.sha256(source.read_bytes()).hexdigest(), files
