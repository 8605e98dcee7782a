"""`bitserve bench`: its flags and its handler (argparse.Namespace in, exit code out).

Defaults live on bench.runner.BenchConfig; output goes through console.py.
"""

from __future__ import annotations

import argparse
import asyncio
from typing import Any

from bitserve.bench.report import format_table, summarise
from bitserve.bench.runner import BenchConfig, run_bench_async
from bitserve.cli.console import emit, emit_json
from bitserve.config import ModelConfig
from bitserve.errors import InvalidRequest

_FIELDS = BenchConfig.__dataclass_fields__


def _default(name: str) -> Any:
    return _FIELDS[name].default


def parse_levels(text: str) -> tuple[int, ...]:
    """ "1,4,16" -> (1, 4, 16); range checks happen in validate_config."""
    try:
        levels = tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from exc
    if not levels:
        raise argparse.ArgumentTypeError("expected at least one concurrency level")
    return levels


def add_bench_arguments(parser: argparse.ArgumentParser, *, has_url: bool = True) -> None:
    """The bench flags; `has_url=False` leaves --url out (benchmarks/bench_serving.py takes two URLs)."""
    if has_url:
        parser.add_argument(
            "--url", default="http://127.0.0.1:8000", help="server base URL (loopback unless --allow-remote)"
        )
    parser.add_argument("--endpoint", choices=["completions", "chat"], default=_default("endpoint"))
    parser.add_argument("--model", default=None, help="model name (default: the first of GET /v1/models)")
    _add_request_arguments(parser)
    _add_run_arguments(parser)


def _add_request_arguments(parser: argparse.ArgumentParser) -> None:
    """What the load test sends: concurrency levels, request counts, prompts and sampling."""
    parser.add_argument(
        "--concurrency",
        type=parse_levels,
        default=_default("concurrency_levels"),
        help="concurrency levels, comma-separated, e.g. 1,4,16,100",
    )
    parser.add_argument(
        "--num-requests",
        type=int,
        default=None,
        help="requests per level (default: 4 x concurrency, bounded)",
    )
    parser.add_argument("--max-tokens", type=int, default=_default("max_tokens"))
    prompt = parser.add_mutually_exclusive_group()
    prompt.add_argument("--prompt", default=None, help="the same prompt text for every request")
    prompt.add_argument(
        "--prompt-tokens",
        type=int,
        default=_default("num_prompt_words"),
        help="synthetic prompts of about this many words, distinct per request",
    )
    parser.add_argument(
        "--prompt-seed",
        default=_default("prompt_seed"),
        help="vary the synthetic prompts (a seed no run used before meets no server's prompt cache)",
    )
    parser.add_argument("--temperature", type=float, default=_default("temperature"))
    parser.add_argument(
        "--ignore-eos", action="store_true", help="send ignore_eos: true so requests run to max_tokens"
    )
    parser.add_argument(
        "--no-usage", action="store_true", help="do not send stream_options.include_usage (count chunks)"
    )


def _add_run_arguments(parser: argparse.ArgumentParser) -> None:
    """How a level runs and is judged: timeouts, duration, warm-up, SLOs; credentials and output."""
    parser.add_argument(
        "--timeout", type=float, default=_default("timeout_s"), help="seconds per request, start to [DONE]"
    )
    parser.add_argument(
        "--duration-s",
        type=float,
        default=_default("duration_s"),
        help="per level: start no request after this",
    )
    parser.add_argument(
        "--num-warmup",
        type=int,
        default=_default("num_warmup"),
        help="unmeasured requests before the first level",
    )
    parser.add_argument(
        "--goodput-ttft-s", type=float, default=None, help="SLO: time to first token (seconds)"
    )
    parser.add_argument("--goodput-e2e-s", type=float, default=None, help="SLO: end-to-end latency (seconds)")
    parser.add_argument("--api-key", default=None, help="sent as 'Authorization: Bearer <key>'")
    parser.add_argument("--allow-remote", action="store_true", help="allow a non-loopback --url")
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def add_curve_arguments(parser: argparse.ArgumentParser) -> None:
    """`--curve MODEL`: the offline throughput / step-latency curve instead of an HTTP load test."""
    group = parser.add_argument_group("offline curve (--curve): in-process engine, no server")
    group.add_argument(
        "--curve",
        metavar="MODEL",
        default=None,
        help="catalog name or GGUF path: print tok/s and ms/step per --concurrency level "
        "(decode steps, greedy, ignore_eos; --max-tokens tokens per sequence)",
    )
    group.add_argument("--curve-prompt-tokens", type=int, default=8, help="prompt tokens per sequence")
    group.add_argument("--curve-prefill-tokens", type=int, default=128, help="prompt of the prefill-rate run")
    group.add_argument(
        "--curve-repeats", type=int, default=1, help="runs of every level; the fastest is kept"
    )
    group.add_argument("--backend", default="auto", help="kernel backend: auto, cpu or reference")
    group.add_argument(
        "--device", default=None, help=ModelConfig.__dataclass_fields__["device"].metadata["help"]
    )
    group.add_argument("--threads", type=int, default=None, help="torch threads (default: all cores)")


def run_curve_command(args: argparse.Namespace) -> int:
    from bitserve.bench.curve import format_curve, run_curve

    if (
        min(args.concurrency) < 1
        or args.max_tokens < 3
        or min(args.curve_prompt_tokens, args.curve_repeats) < 1
    ):
        raise InvalidRequest(
            "--curve needs concurrency >= 1, --max-tokens >= 3, "
            "--curve-prompt-tokens and --curve-repeats >= 1"
        )
    result = run_curve(
        args.curve,
        args.concurrency,
        num_prompt_tokens=args.curve_prompt_tokens,
        num_output_tokens=args.max_tokens,
        prefill_tokens=args.curve_prefill_tokens,
        backend=args.backend,
        num_threads=args.threads,
        num_repeats=args.curve_repeats,
        device=args.device,
    )
    if args.json:
        emit_json(result.to_dict())
    else:
        for line in format_curve(result):
            emit(line)
    return 0


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register `bench` on the CLI's subparsers (the action add_subparsers returned)."""
    parser = subparsers.add_parser(
        "bench",
        help="load-test an OpenAI-compatible server (TTFT, ITL, throughput), or --curve MODEL offline",
    )
    add_bench_arguments(parser)
    add_curve_arguments(parser)
    return parser


def config_from_args(args: argparse.Namespace, url: str | None = None) -> BenchConfig:
    return BenchConfig(
        url=url if url is not None else args.url,
        endpoint=args.endpoint,
        model=args.model,
        concurrency_levels=tuple(args.concurrency),
        num_requests=args.num_requests,
        max_tokens=args.max_tokens,
        prompt=args.prompt,
        num_prompt_words=args.prompt_tokens,
        prompt_seed=args.prompt_seed,
        temperature=args.temperature,
        ignore_eos=args.ignore_eos,
        include_usage=not args.no_usage,
        timeout_s=args.timeout,
        duration_s=args.duration_s,
        num_warmup=args.num_warmup,
        goodput_ttft_s=args.goodput_ttft_s,
        goodput_e2e_s=args.goodput_e2e_s,
        api_key=args.api_key,
        allow_remote=args.allow_remote,
    )


def run_bench(args: argparse.Namespace) -> int:
    """Run every level, print the table (or JSON). Exit 0 if any request succeeded, 1 if none did.

    Bad flags and an unreachable model list raise BitserveError (the CLI prints it, exit 2).
    With --curve, runs the offline curve instead (no server).
    """
    if getattr(args, "curve", None) is not None:
        return run_curve_command(args)
    summary = summarise(asyncio.run(run_bench_async(config_from_args(args))))
    if args.json:
        emit_json(summary)
    else:
        for line in format_table(summary):
            emit(line)
    return 0 if any(level["num_ok"] for level in summary["levels"]) else 1
