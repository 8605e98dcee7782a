"""Decode speed of the architectures beside llama at the same bytes per token (issue 39's speed row):
same-shaped random-init checkpoints of llama, qwen2 (q/k/v biases) and qwen3 (per-head q/k RMSNorms),
each converted by bitserve's converter to the same projection type, decoded greedily on the cpu backend
in one process, rounds alternating between the architectures so machine noise falls on all of them. The
head is Q8_0 in every file (`lm_head="q8_0"`: qwen3's tied F32 table would otherwise read 4x the bytes a
token of llama's Q8_0 head):

    python benchmarks/bench_architectures.py [--type Q8_0] [--rounds 5] [--tokens 64]

The shape is SmolLM2-135M's hidden size, layer count and vocabulary (576, 30, 49,152; 4 query heads over
2 KV heads of 144, FFN 1,152: the checkpoint helper's shape rule). Prints one JSON line per architecture:
median decode tok/s, and its ratio to llama's.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import bitserve  # noqa: E402, F401  (before torch / numba: sets the OpenMP wait default for libgomp)

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import tempfile  # noqa: E402

import torch  # noqa: E402

from benchmarks.bench_model import bitserve_generate  # noqa: E402
from bitserve.llm import LLM  # noqa: E402
from bitserve.loader.catalog import resolve_model  # noqa: E402
from bitserve.loader.hf_convert import write_gguf  # noqa: E402
from bitserve.testing.hf_checkpoints import checkpoint_config, random_checkpoint  # noqa: E402
from bitserve.testing.synthetic import tokenizer_metadata  # noqa: E402

ARCHITECTURES = ("llama", "qwen2", "qwen3")
WIDTH, LAYERS = 576, 30


def make_file(arch: str, weight_type: str, folder: Path) -> Path:
    tokenizer = tokenizer_metadata(resolve_model("smollm2-135m-instruct", fetch=False))
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"][1])
    model = random_checkpoint(arch, vocab_size, num_layers=LAYERS, width=WIDTH)
    path = folder / f"{arch}-{weight_type}.gguf"
    with torch.no_grad():
        write_gguf(path, checkpoint_config(model), model.state_dict(), tokenizer, weight_type=weight_type)
    return path


def decode_rate(llm: LLM, tokens: int, tag: str) -> float:
    step_times, _ = bitserve_generate(llm, list(range(100, 132)), tokens, tag)
    decode = step_times[1:]  # the first step is the prefill
    return len(decode) / sum(decode)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--type", default="Q8_0", help="projection type the converter writes")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--tokens", type=int, default=64)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench-arch-") as folder:
        llms = {
            arch: LLM(str(make_file(arch, args.type, Path(folder))), backend="cpu", lm_head="q8_0")
            for arch in ARCHITECTURES
        }
        rates: dict[str, list[float]] = {arch: [] for arch in ARCHITECTURES}
        for arch, llm in llms.items():
            decode_rate(llm, 8, f"warm-{arch}")  # compile and page in before timing
        for round_index in range(args.rounds):
            for arch, llm in llms.items():
                rates[arch].append(decode_rate(llm, args.tokens, f"{arch}-{round_index}"))
        for llm in llms.values():
            llm.close()
    llama = statistics.median(rates["llama"])
    for arch in ARCHITECTURES:
        median = statistics.median(rates[arch])
        row = {
            "arch": arch,
            "type": args.type,
            "decode_tok_s": round(median, 1),
            "vs_llama": round(median / llama, 3),
        }
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
