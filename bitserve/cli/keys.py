"""`bitserve keys create`: a new random API key, printed once, with the [[keys]] block (its SHA-256,
never the key) to paste into the --auth-file. `bitserve audit verify PATH...`: check an audit log's
hash chain (rotated files oldest first), exit 1 naming the first bad line."""

from __future__ import annotations

import argparse
from typing import Any

from bitserve.cli.console import emit, emit_error, emit_json
from bitserve.server.security.audit import verify_chain
from bitserve.server.security.config import split_list
from bitserve.server.security.keys import generate_key, hash_key
from bitserve.server.security.principal import SCOPES, check_scopes

LIMIT_FLAGS = ("requests_per_minute", "tokens_per_minute", "tokens_per_day")


def add_keys_parsers(sub: Any) -> None:
    keys = sub.add_parser("keys", help="create API keys for --auth-file")
    actions = keys.add_subparsers(dest="action", required=True)
    create = actions.add_parser("create", help="print a new random key once, with the TOML block to paste")
    create.add_argument("--name", required=True, help="the key's name (shown in logs and the audit log)")
    create.add_argument(
        "--scopes", required=True, help=f"comma-separated scopes: {', '.join(SCOPES)} (admin grants all)"
    )
    create.add_argument(
        "--models", default=None, help="comma-separated aliases the key may use (default all)"
    )
    for name in LIMIT_FLAGS:
        create.add_argument(
            f"--{name.replace('_', '-')}", type=int, default=None, help="limit (default none)"
        )
    create.add_argument("--json", action="store_true", help="print {key, toml} as JSON")

    audit = sub.add_parser("audit", help="check a hash-chained audit log")
    audit_actions = audit.add_subparsers(dest="action", required=True)
    verify = audit_actions.add_parser(
        "verify", help="exit non-zero naming the first edited, dropped or moved line"
    )
    verify.add_argument(
        "paths", nargs="+", metavar="PATH", help="the log; rotated files first (PATH.2 PATH.1 PATH)"
    )


def _toml_list(values: tuple[str, ...] | list[str]) -> str:
    return "[" + ", ".join(f'"{value}"' for value in values) + "]"


def key_block(args: argparse.Namespace, key: str) -> str:
    lines = [
        "[[keys]]",
        f'name = "{args.name}"',
        f'hash = "{hash_key(key)}"',
        f"scopes = {_toml_list(sorted(check_scopes(split_list(args.scopes), '--scopes')))}",
    ]
    if args.models is not None:
        lines.append(f"models = {_toml_list(split_list(args.models))}")
    for name in LIMIT_FLAGS:
        if getattr(args, name) is not None:
            lines.append(f"{name} = {getattr(args, name)}")
    return "\n".join(lines)


def run_keys(args: argparse.Namespace) -> int:
    if any(char in args.name + (args.models or "") for char in '"\\\n'):
        emit_error("--name and --models may not contain quotes, backslashes or newlines")
        return 2
    try:
        key = generate_key()
        block = key_block(args, key)
    except ValueError as exc:
        emit_error(str(exc))
        return 2
    if args.json:
        emit_json({"key": key, "toml": block})
        return 0
    emit(f"API key (shown once; store it now): {key}")
    emit("")
    emit("Add to the --auth-file:")
    emit("")
    emit(block)
    return 0


def run_audit(args: argparse.Namespace) -> int:
    result = verify_chain(args.paths)
    if result.error is not None:
        emit_error(f"audit chain broken at {result.error}")
        return 1
    emit(f"ok: {result.num_lines} line(s), chain intact")
    return 0
