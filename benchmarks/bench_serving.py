"""Serving benchmark: the same `bitserve bench` load against bitserve and a peer OpenAI-compatible server.

    bitserve serve --model smollm2 --port 8000 &
    python -m llama_cpp.server --model SmolLM2-135M-Instruct.Q4_1.gguf --interrupt_requests False \
        --port 8001 &
    python benchmarks/bench_serving.py http://127.0.0.1:8000 http://127.0.0.1:8001 --concurrency 1,4,16 \
        --max-tokens 100 --ignore-eos --prompt-tokens 64

Runs every level against the first URL, then against the second, with identical prompts and
settings, and prints one row per level with the ratio first/second for throughput and for p50 / p99
latency (throughput: higher is better; latency: lower is better). Give both servers the same
threads and model file. A peer that ignores `ignore_eos` ends requests early: the "short" column
shows it, and its tokens/s are then not comparable. Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
from pathlib import Path
from typing import Any

from bitserve.bench.report import format_table, render_rows, summarise
from bitserve.bench.runner import run_bench_async
from bitserve.cli.bench import add_bench_arguments, config_from_args
from bitserve.cli.console import emit, emit_error, emit_json
from bitserve.errors import BitserveError


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="bitserve base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument("peer_url", help="peer base URL, e.g. http://127.0.0.1:8001")
    parser.add_argument(
        "--peer-model", default=None, help="model name on the peer (default: its first of /v1/models)"
    )
    parser.add_argument("--names", default="bitserve,peer", help="column labels for the two servers")
    parser.add_argument("--out", type=Path, default=None, help="also write both full summaries as JSON here")
    add_bench_arguments(parser, has_url=False)
    return parser


def _ratio(first: float | None, second: float | None) -> str:
    if first is None or second is None or second == 0:
        return "-"
    return f"{first / second:.2f}"


def _fmt(value: float | None, scale: float = 1.0, digits: int = 1) -> str:
    return "-" if value is None else f"{value * scale:.{digits}f}"


def compare(first: dict[str, Any], second: dict[str, Any], names: tuple[str, str]) -> list[str]:
    """Side-by-side rows per concurrency level; latencies in ms."""
    a, b = names
    header = (
        "conc",
        f"tok/s {a}",
        f"tok/s {b}",
        "ratio",
        f"e2e50 {a}",
        f"e2e50 {b}",
        "ratio",
        f"e2e99 {a}",
        f"e2e99 {b}",
        "ratio",
        f"ttft50 {a}",
        f"ttft50 {b}",
        "ratio",
        f"err {a}/{b}",
        f"short {a}/{b}",
    )
    rows = [header]
    for left, right in zip(first["levels"], second["levels"], strict=True):
        cells = [str(left["concurrency"])]
        x, y = left["output_tokens_per_s"], right["output_tokens_per_s"]
        cells += [_fmt(x), _fmt(y), _ratio(x, y)]
        for metric, q in (("e2e_s", "p50"), ("e2e_s", "p99"), ("ttft_s", "p50")):
            x, y = left[metric][q], right[metric][q]
            cells += [_fmt(x, 1000.0), _fmt(y, 1000.0), _ratio(x, y)]
        cells += [f"{left['num_errors']}/{right['num_errors']}", f"{left['num_short']}/{right['num_short']}"]
        rows.append(tuple(cells))
    return render_rows(rows)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    first_name, _, second_name = args.names.partition(",")
    names = (first_name, second_name or "peer")
    try:
        first = summarise(asyncio.run(run_bench_async(config_from_args(args, url=args.url))))
        peer_args = argparse.Namespace(**{**vars(args), "model": args.peer_model})
        second = summarise(asyncio.run(run_bench_async(config_from_args(peer_args, url=args.peer_url))))
    except BitserveError as exc:
        emit_error(str(exc))
        return 2
    if args.out is not None:
        args.out.write_text(json.dumps({names[0]: first, names[1]: second}, indent=2))
    if args.json:
        emit_json({names[0]: first, names[1]: second})
        return 0
    for summary in (first, second):
        for line in format_table(summary):
            emit(line)
        emit()
    emit(f"{names[0]} vs {names[1]} (ratio = {names[0]} / {names[1]}; tok/s higher is better, latency lower)")
    for line in compare(first, second, names):
        emit(line)
    return 0


if __name__ == "__main__":
    sys.exit(main())
