"""Requantize a GGUF with llama.cpp's own `llama_model_quantize` (llama-cpp-python 0.3.36), e.g. SmolLM2 to
llama.cpp's Q2_0 for a same-file speed row beside llama.cpp:

    python benchmarks/requantize_llamacpp.py SmolLM2-135M-Instruct.Q4_1.gguf \
        benchmarks/out/smollm2-q2_0.gguf --type Q2_0

Already-quantized tensors are requantized (allow_requantize); llama.cpp chooses the embedding / output
types of the mix itself. Prints the output path.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("source", type=Path)
    parser.add_argument("target", type=Path)
    parser.add_argument(
        "--type", default="Q2_0", help="a LLAMA_FTYPE_MOSTLY_<TYPE> name, e.g. Q2_0, Q1_0, Q4_K_M"
    )
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args()
    import llama_cpp

    ftype = getattr(llama_cpp, f"LLAMA_FTYPE_MOSTLY_{args.type.upper()}")
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = ftype
    params.allow_requantize = True
    params.nthread = args.threads
    args.target.parent.mkdir(parents=True, exist_ok=True)
    status = llama_cpp.llama_model_quantize(str(args.source).encode(), str(args.target).encode(), params)
    if status != 0:
        sys.stderr.write(f"llama_model_quantize failed with {status}\n")
        return 1
    sys.stdout.write(f"{args.target}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
