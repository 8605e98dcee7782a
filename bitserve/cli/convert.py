"""`bitserve convert DIR OUT.gguf --type T`: a Hugging Face checkpoint directory to a GGUF file
(loader/hf_convert.py), with a progress bar on stderr and a one-line summary (or --json) on stdout."""

from __future__ import annotations

import argparse
import time
from pathlib import Path

from bitserve.cli.console import emit, emit_json, emit_progress

CONVERT_TYPES = ("I2_S", "TQ2_0", "Q2_0", "Q1_0", "Q8_0", "F16", "F32")


def add_convert_parser(sub: argparse._SubParsersAction) -> None:
    convert = sub.add_parser(
        "convert",
        help="convert a Hugging Face checkpoint directory (config.json, safetensors, tokenizer.json) to GGUF",
    )
    convert.add_argument("checkpoint", help="the checkpoint directory (save_pretrained's layout)")
    convert.add_argument("target", help="the GGUF file to write")
    convert.add_argument(
        "--type",
        dest="weight_type",
        default="F16",
        choices=CONVERT_TYPES,
        help="the projections' type: I2_S (bitnet.cpp) and TQ2_0 only from ternary weights; default F16",
    )
    convert.add_argument(
        "--tokenizer-pre",
        default=None,
        help="llama.cpp pre-tokenizer name to write when tokenizer.json's pattern is not recognized",
    )
    convert.add_argument("--no-progress", action="store_true", help="no progress bar on stderr")
    convert.add_argument("--json", action="store_true")


def run_convert(args: argparse.Namespace) -> int:
    from bitserve.loader.hf_convert import convert_checkpoint

    def progress(done: int, total: int, name: str) -> None:
        emit_progress(name, done / total, done=done == total)

    start = time.perf_counter()
    path = convert_checkpoint(
        Path(args.checkpoint),
        Path(args.target),
        weight_type=args.weight_type,
        pre=args.tokenizer_pre,
        progress=None if args.no_progress or args.json else progress,
    )
    summary = {
        "path": str(path),
        "type": args.weight_type,
        "bytes": path.stat().st_size,
        "seconds": round(time.perf_counter() - start, 2),
    }
    if args.json:
        emit_json(summary)
    else:
        megabytes = summary["bytes"] / 1e6
        emit(f"wrote {path} ({megabytes:.1f} MB, projections {args.weight_type}) in {summary['seconds']} s")
    return 0
