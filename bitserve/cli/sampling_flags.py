"""CLI flags generated from SamplingParams' fields (name, type, help), so the CLI has no defaults or
bounds of its own: an unset flag keeps SamplingParams' default, a bad value gets its error."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from typing import Any

from bitserve.sampling_params import SamplingParams

NOT_FLAGS = ("skip_special_tokens", "guide")  # text output detail; structured output is an API feature


def _flag(name: str) -> str:
    return "--" + name.replace("_", "-")


def _scalar(annotation: Any) -> Any:
    """int | None -> int; tuple[str, ...] -> tuple (the caller appends items)."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return next(arg for arg in typing.get_args(annotation) if arg is not type(None))
    return annotation


def _logit_bias_pair(text: str) -> tuple[int, float]:
    token_id, sep, bias = text.partition("=")
    try:
        if not sep:
            raise ValueError(text)
        return int(token_id), float(bias)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected TOKEN_ID=BIAS, got {text!r}") from None


def add_sampling_arguments(parser: argparse.ArgumentParser) -> None:
    hints = typing.get_type_hints(SamplingParams)
    for field in dataclasses.fields(SamplingParams):
        if field.name in NOT_FLAGS:
            continue
        kind, help_text = _scalar(hints[field.name]), field.metadata["help"]
        if kind is bool:
            parser.add_argument(_flag(field.name), action="store_true", default=None, help=help_text)
        elif field.name == "logit_bias":
            parser.add_argument(
                _flag(field.name),
                action="append",
                type=_logit_bias_pair,
                metavar="ID=BIAS",
                help=help_text + " (repeatable)",
            )
        elif typing.get_origin(kind) is tuple:
            item_type = typing.get_args(kind)[0]
            parser.add_argument(
                _flag(field.name), action="append", type=item_type, help=help_text + " (repeatable)"
            )
        else:
            parser.add_argument(_flag(field.name), type=kind, default=None, help=help_text)


def sampling_params_from_args(args: argparse.Namespace) -> SamplingParams:
    """The flags that were given; SamplingParams fills in (and checks) the rest."""
    given = {
        field.name: getattr(args, field.name)
        for field in dataclasses.fields(SamplingParams)
        if field.name not in NOT_FLAGS and getattr(args, field.name) is not None
    }
    return SamplingParams(**given)
