"""Teacher-forced agreement of bitserve with llama.cpp on one GGUF file (a live crossval for files CI
cannot make, such as llama.cpp's own requantizations of SmolLM2):

    python scripts/teacher_forced_llamacpp.py benchmarks/out/smollm2-q3_k_m.gguf [--tokens 48] \
        [--block-activations ggml]

llama.cpp (llama-cpp-python 0.3.36) greedily continues each prompt; bitserve's cpu backend then reads
prompt + continuation in one forward, and at every position its argmax must be llama.cpp's, except at
llama.cpp's own near-ties (top-2 margin under 1% of that position's logit range). Prints per prompt the
positions, the decisive ones and those it got wrong, and exits 1 when any decisive position differs.
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import torch

NEAR_TIE = 0.01  # of the logit range
PROMPTS = ("The capital of France is", "def fibonacci(n):", "Once upon a time, in a land far away,")


def llamacpp_run(llama: object, ids: list[int], num_tokens: int) -> tuple[list[int], np.ndarray]:
    """(prompt + greedy continuation, llama.cpp's logits f32 [positions, vocab] before each next token)."""
    llama.reset()  # type: ignore[attr-defined]
    llama.eval(ids)  # type: ignore[attr-defined]
    sequence = list(ids)
    for _ in range(num_tokens):
        token = int(np.argmax(llama.scores[len(sequence) - 1]))  # type: ignore[attr-defined]
        sequence.append(token)
        llama.eval([token])  # type: ignore[attr-defined]
    return sequence, np.array(llama.scores[: len(sequence) - 1])  # type: ignore[attr-defined]


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument(
        "--block-activations",
        default="auto",
        help="bitserve's block-weight activations: auto (q8), ggml (llama.cpp's own rounding) or f32",
    )
    parser.add_argument(
        "--kv-cache-dtype", default="auto", help="bitserve's KV cache dtype (llama.cpp's: f16)"
    )
    parser.add_argument(
        "--llama-kv",
        default="f16",
        choices=["f16", "f32"],
        help="llama.cpp's KV cache type (its default: f16)",
    )
    args = parser.parse_args()
    import llama_cpp

    from bitserve.llm import LLM

    kv_type = {"f16": 1, "f32": 0}[args.llama_kv]  # ggml type ids: llama.cpp's default cache is F16
    llama = llama_cpp.Llama(
        args.model, logits_all=True, verbose=False, n_threads=2, n_ctx=512, type_k=kv_type, type_v=kv_type
    )
    llm = LLM(
        args.model,
        backend="cpu",
        block_activations=args.block_activations,
        kv_cache_dtype=args.kv_cache_dtype,
    )
    model = llm.instance.loaded.model
    wrong_total = 0
    try:
        for prompt in PROMPTS:
            sequence, theirs = llamacpp_run(llama, llm.encode(prompt), args.tokens)
            with torch.inference_mode():
                ours = model.compute_logits(
                    model(torch.tensor(sequence[:-1]), torch.arange(len(sequence) - 1))
                )
            top2 = np.sort(theirs, axis=-1)[:, -2:]
            margin = (top2[:, 1] - top2[:, 0]) / (theirs.max(-1) - theirs.min(-1))  # of the logit range
            decisive = margin >= NEAR_TIE
            agree = ours.argmax(-1).numpy() == theirs.argmax(-1)
            wrong = [f"{i} (margin {100 * margin[i]:.2f}%)" for i in np.flatnonzero(decisive & ~agree)]
            wrong_total += len(wrong)
            sys.stdout.write(
                f"{prompt!r}: {len(agree)} positions, {int(decisive.sum())} decisive, wrong {wrong}\n"
            )
    finally:
        llm.close()
    return 1 if wrong_total else 0


if __name__ == "__main__":
    sys.exit(main())
