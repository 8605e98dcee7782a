"""Decode speed of the architectures beside llama at the same bytes per token (issue 39's speed row):
same-shaped random-init checkpoints of llama, qwen2 (q/k/v biases), qwen3 (per-head q/k RMSNorms) and
gemma3 (q/k head norms, post-norms, GELU-tanh, five sliding layers of six with their own RoPE), each
converted by bitserve's converter to the same projection type, decoded greedily on the cpu backend in one
process, rounds alternating between the architectures so machine noise falls on all of them. Every file's
head is its tied embedding table (the converter drops llama's and qwen2's own head), an F32 table that
`lm_head="q8_0"` quantizes at load: one Q8_0 head for all, whatever the projection type (an untied head is
written in the projection type: a Q2_0 llama head read a quarter of the bytes of the tied models' Q8_0
one, 1.7 ms of a ~6 ms step). gemma3's extra norms are f32 [hidden] vectors, its projections llama's
shapes and type:

    python benchmarks/bench_architectures.py [--type Q8_0] [--rounds 5] [--tokens 64] [--archs llama,gemma3]

The shape is SmolLM2-135M's hidden size, layer count and vocabulary (576, 30, 49,152; 4 query heads over
2 KV heads of 144, FFN 1,152: the checkpoint helper's shape rule). gemma3's window is GEMMA3_WINDOW
(Gemma 3 1B's 512): longer than the 32-token prompt and its continuation, so its sliding layers read the
keys llama's layers read (the tests' 5-position window would read fewer). Prints one JSON line per
architecture: median decode tok/s, its ratio to llama's, and whether the one-call decode step ran it.
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

ARCHITECTURES = ("llama", "qwen2", "qwen3", "gemma3")
WIDTH, LAYERS = 576, 30
GEMMA3_WINDOW = 512  # Gemma 3 1B's sliding window (4B-27B: 1,024)


def make_file(arch: str, weight_type: str, folder: Path) -> Path:
    tokenizer = tokenizer_metadata(resolve_model("smollm2-135m-instruct", fetch=False))
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"][1])
    model = random_checkpoint(arch, vocab_size, num_layers=LAYERS, width=WIDTH)
    model.config.tie_word_embeddings = True  # one head for all: the F32 table, Q8_0 at load (docstring)
    if arch == "gemma3":
        model.config.sliding_window = GEMMA3_WINDOW  # the config only: the weights do not depend on it
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
    parser.add_argument("--archs", default=",".join(ARCHITECTURES), help="comma-separated; llama always")
    args = parser.parse_args()
    archs = ["llama", *(a for a in args.archs.split(",") if a in ARCHITECTURES and a != "llama")]
    with tempfile.TemporaryDirectory(prefix="bench-arch-") as folder:
        llms = {
            arch: LLM(str(make_file(arch, args.type, Path(folder))), backend="cpu", lm_head="q8_0")
            for arch in archs
        }
        fast = {arch: llm.instance.loaded.model.compiled is not None for arch, llm in llms.items()}
        rates: dict[str, list[float]] = {arch: [] for arch in archs}
        for arch, llm in llms.items():
            decode_rate(llm, 8, f"warm-{arch}")  # compile and page in before timing
        for round_index in range(args.rounds):
            for arch, llm in llms.items():
                rates[arch].append(decode_rate(llm, args.tokens, f"{arch}-{round_index}"))
        for llm in llms.values():
            llm.close()
    llama = statistics.median(rates["llama"])
    for arch in archs:
        median = statistics.median(rates[arch])
        row = {
            "arch": arch,
            "type": args.type,
            "decode_tok_s": round(median, 1),
            "vs_llama": round(median / llama, 3),
            "one_call_step": fast[arch],
        }
        sys.stdout.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
