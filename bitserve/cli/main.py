"""`bitserve` command line: generate | inspect | verify | crossval | bench | models | pull | keys | audit.

`serve` comes with the server (cli/serve.py)."""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence

from bitserve.cli.console import emit_error
from bitserve.cli.sampling_flags import add_sampling_arguments
from bitserve.cli.serve import add_serve_parser, run_serve
from bitserve.errors import BitserveError
from bitserve.loader.catalog import DEFAULT_MODEL

# SchedulerConfig fields `generate` takes as flags too (serve has every setting: cli/serve.py)
GENERATE_SCHEDULER_FLAGS = ("speculative", "num_speculative_tokens")


def _add_scheduler_options(parser: argparse.ArgumentParser) -> None:
    from bitserve.config import SPECULATIVE_CHOICES, SchedulerConfig

    fields = SchedulerConfig.__dataclass_fields__
    choices = {"speculative": list(SPECULATIVE_CHOICES)}
    for name in GENERATE_SCHEDULER_FLAGS:
        field = fields[name]
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=type(field.default),
            default=field.default,
            choices=choices.get(name),
            help=field.metadata["help"],
        )


def _add_model_options(parser: argparse.ArgumentParser) -> None:
    from bitserve.config import LM_HEAD_CHOICES, ModelConfig

    fields = ModelConfig.__dataclass_fields__
    parser.add_argument(
        "--backend", default=fields["backend"].default, help=fields["backend"].metadata["help"]
    )
    parser.add_argument("--device", default=fields["device"].default, help=fields["device"].metadata["help"])
    parser.add_argument(
        "--linear-mode", default=fields["linear_mode"].default, help=fields["linear_mode"].metadata["help"]
    )
    parser.add_argument(
        "--lm-head",
        default=fields["lm_head"].default,
        choices=list(LM_HEAD_CHOICES),
        help=fields["lm_head"].metadata["help"],
    )
    parser.add_argument(
        "--i2s-variant",
        default=fields["i2s_variant"].default,
        choices=["A", "B", "C"],
        help=fields["i2s_variant"].metadata["help"],
    )
    parser.add_argument("--tl-config", default=None, help=fields["tl_config"].metadata["help"])
    parser.add_argument("--tokenizer-pre", default=None, help=fields["tokenizer_pre"].metadata["help"])
    parser.add_argument("--hidden-act", default=None, help=fields["hidden_act"].metadata["help"])
    parser.add_argument("--threads", type=int, default=None, help=fields["num_threads"].metadata["help"])


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bitserve", description="Serve and run ternary (BitNet b1.58) and GGUF LLMs"
    )
    parser.add_argument("--log-level", default="WARNING", help="logging level (DEBUG, INFO, WARNING, ...)")
    sub = parser.add_subparsers(dest="command", required=True)

    generate = sub.add_parser("generate", help="generate text offline")
    generate.add_argument("--model", default=DEFAULT_MODEL, help="catalog name, GGUF path or HF directory")
    generate.add_argument("--prompt", required=True, help="prompt text (a user message with --chat)")
    generate.add_argument("--chat", action="store_true", help="wrap the prompt in the model's chat template")
    generate.add_argument("--system", default=None, help="system message (with --chat)")
    add_sampling_arguments(generate)
    generate.add_argument("--json", action="store_true", help="print one JSON object")
    _add_scheduler_options(generate)
    _add_model_options(generate)

    inspect = sub.add_parser("inspect", help="summarize a GGUF file")
    inspect.add_argument("model", help="catalog name or GGUF path")
    inspect.add_argument("--json", action="store_true")

    verify = sub.add_parser("verify", help="validate a GGUF file fully and check that it generates")
    verify.add_argument("model", help="catalog name or GGUF path")
    verify.add_argument("--json", action="store_true")
    verify.add_argument("--num-tokens", type=int, default=8, help="greedy tokens in the generation check")
    _add_model_options(verify)

    quantize = sub.add_parser(
        "quantize",
        help="rewrite a GGUF's projections in llama.cpp's Q1_0 or Q2_0 (bytes equal to llama.cpp's), "
        "every other tensor and key as it is",
    )
    quantize.add_argument("source", help="catalog name or GGUF path")
    quantize.add_argument("target", help="the GGUF file to write")
    quantize.add_argument("--type", dest="weight_type", default="Q2_0", choices=["Q2_0", "Q1_0"])
    quantize.add_argument("--json", action="store_true")

    crossval = sub.add_parser(
        "crossval",
        help="live comparison against llama.cpp (needs llama-cpp-python), or with --bitnet-cpp against "
        "bitnet.cpp; other arguments go to pytest (e.g. -q -k smollm2)",
    )
    crossval.add_argument(
        "--bitnet-cpp",
        metavar="DIR",
        help="bitnet.cpp's bin dir: compare the bitnetcpp numerics mode with it (tokens and logits with its "
        "bnc-probe, greedy tokens with llama-cli alone) instead of llama.cpp",
    )

    from bitserve.cli.bench import add_bench_parser
    from bitserve.cli.convert import add_convert_parser
    from bitserve.cli.keys import add_keys_parsers
    from bitserve.cli.models import add_models_parsers

    add_bench_parser(sub)
    add_convert_parser(sub)
    add_models_parsers(sub)
    add_keys_parsers(sub)
    add_serve_parser(sub)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    # crossval passes unknown options through to pytest; every other command rejects them
    args, extra = parser.parse_known_args(argv)
    if extra and args.command != "crossval":
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    args.pytest_args = extra
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    from bitserve.cli import bench, commands, convert, keys, models

    handlers = {
        "bench": bench.run_bench,
        "generate": commands.run_generate,
        "inspect": commands.run_inspect,
        "verify": commands.run_verify,
        "quantize": commands.run_quantize,
        "convert": convert.run_convert,
        "crossval": commands.run_crossval,
        "serve": run_serve,
        "models": models.run_models,
        "pull": models.run_pull,
        "keys": keys.run_keys,
        "audit": keys.run_audit,
    }
    try:
        return handlers[args.command](args)
    except BitserveError as exc:
        emit_error(str(exc))
        return 2
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
