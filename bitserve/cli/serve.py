"""`bitserve serve`: flags generated from the config dataclasses, settings merged (CLI > env > TOML >
default), JSON logs, and a uvicorn server (hypercorn with --http2) whose SIGTERM / SIGINT drain instead of
dropping work:
readiness fails at once, new requests get 503 + Retry-After, in-flight requests get
`drain_timeout_s` to finish (streams still running then end with an SSE error event), the engine
thread is joined, and the process exits 0.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import socket
from types import FrameType
from typing import TYPE_CHECKING, Any

import uvicorn

from bitserve import heap
from bitserve.config import ServerConfig
from bitserve.log import configure_logging
from bitserve.server.settings import PROFILES, Settings, load_settings, setting_fields

if TYPE_CHECKING:
    from bitserve.server.http2_serving import DrainingHypercorn
    from bitserve.server.state import AppState

logger = logging.getLogger(__name__)

FLAG_ALIASES = {
    "num_threads": ("--threads",),
    "model_roots": ("--model-root",),
    "cors_origins": ("--cors-origin",),
    "allow_cidrs": ("--allow-cidr",),
    "trusted_proxies": ("--trusted-proxy",),
    "plugins": ("--plugin",),
}
# repeatable flags, joined as the env var spells them: paths with os.pathsep, the rest with commas
REPEATABLE_LISTS = {
    "model_roots": os.pathsep,
    "cors_origins": ",",
    "allow_cidrs": ",",
    "trusted_proxies": ",",
    "plugins": ",",
}
DEST_PREFIX = "setting_"  # argparse dests, so no flag collides with the top-level parser's
# After the drain, uvicorn waits this long for connections to finish their last bytes.
POST_DRAIN_GRACE_S = 5


def add_serve_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Add `serve` to the CLI's subparsers; one flag per setting (default None = not given)."""
    parser = subparsers.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=(
            "Serve a model over HTTP. Each flag may also be set as BITSERVE_<NAME> or in a TOML file."
        ),
    )
    parser.add_argument(
        "--config", default=None, help="TOML settings file (top-level keys and [dev]/[staging]/[prod] tables)"
    )
    parser.add_argument(
        "--profile", default=None, choices=PROFILES, help="profile table of the config file to apply"
    )
    for name, field in setting_fields().items():
        flags = (f"--{name.replace('_', '-')}", *FLAG_ALIASES.get(name, ()))
        options: dict[str, Any] = {"dest": DEST_PREFIX + name, "default": None, "help": field.help}
        if field.value_type is bool:
            options["action"] = argparse.BooleanOptionalAction
        else:
            options.update(type=field.value_type, metavar=name.upper())
        if name in REPEATABLE_LISTS:
            options.update(action="append", metavar="DIR" if name == "model_roots" else "VALUE")
        parser.add_argument(*flags, **options)
    return parser


def cli_values(args: argparse.Namespace) -> dict[str, Any]:
    values = {name: getattr(args, DEST_PREFIX + name, None) for name in setting_fields()}
    for name, separator in REPEATABLE_LISTS.items():
        if values.get(name) is not None:
            values[name] = separator.join(values[name])
    return values


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM / SIGINT drains before exiting; a second one exits now."""

    def __init__(self, config: uvicorn.Config, state: AppState) -> None:
        super().__init__(config)
        self.state = state
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_task: asyncio.Task[None] | None = None

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def request_exit(self) -> None:
        """Stop without a drain (the model failed to load)."""
        self.should_exit = True

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # NOTE: not appended to _captured_signals, so uvicorn does not re-raise it after shutdown
        # (that would kill the process with the signal instead of exiting 0).
        if self._drain_task is not None or self._loop is None:
            logger.warning("second signal %d: exiting without waiting", sig)
            self.should_exit = True
            self.force_exit = True
            return
        logger.info("signal %d: draining for up to %g s", sig, self.state.server_config.drain_timeout_s)
        self.state.begin_drain()  # readiness fails at once
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        self._drain_task = asyncio.ensure_future(self._drain())

    async def _drain(self) -> None:
        try:
            await self.state.drain(self.state.server_config.drain_timeout_s)
        finally:
            self.should_exit = True


def uvicorn_config(config: ServerConfig, app: Any) -> uvicorn.Config:
    """uvicorn's Config for the HTTP/1.1 server (uvicorn + httptools by default), TLS when a cert is given."""
    from bitserve.server.http_protocols import http_protocol, resolve_http_parser

    parser = resolve_http_parser(config.http_parser)
    logger.info("HTTP parser %s, event loop %s", parser, config.event_loop)
    return uvicorn.Config(
        app,
        host=config.host,
        port=config.port,
        loop=config.event_loop,
        lifespan="on",
        log_config=None,
        access_log=config.access_log,
        http=http_protocol(parser, config.header_read_timeout_s, config.max_header_bytes),
        h11_max_incomplete_event_size=config.max_header_bytes,
        timeout_keep_alive=config.keep_alive_timeout_s,
        ws_max_size=config.ws_max_message_bytes,
        timeout_graceful_shutdown=POST_DRAIN_GRACE_S,
        server_header=False,  # no `Server: uvicorn`: the stack's name helps only an attacker
        ssl_certfile=config.ssl_certfile,
        ssl_keyfile=config.ssl_keyfile,
    )


def serve(settings: Settings) -> int:
    """Run the server until it is drained; 0 on a clean exit, 1 when the model failed to load."""
    from bitserve.server.app import build_app

    config = settings.server
    exit_code = 0
    server: DrainingServer | DrainingHypercorn | None = None

    def on_fatal() -> None:
        nonlocal exit_code
        exit_code = 1
        if server is not None:
            server.request_exit()

    app = build_app(
        config,
        settings.engine,
        on_fatal=on_fatal,
        security=settings.security,
        batch=settings.batch,
        plugins=settings.plugins,
    )
    if config.http2:  # hypercorn: HTTP/1.1 + h2c, or h2 / http/1.1 by ALPN over TLS (server/http2_serving.py)
        from bitserve.server.http2_serving import DrainingHypercorn

        server = DrainingHypercorn(app, app.state.bitserve, POST_DRAIN_GRACE_S)
    else:
        server = DrainingServer(uvicorn_config(config, app), app.state.bitserve)
    heap.manage_heap()
    server.run()
    logger.info("server stopped (exit code %d)", exit_code)
    return exit_code


def run_serve(args: argparse.Namespace) -> int:
    settings = load_settings(cli_values(args), config_path=args.config, profile=args.profile)
    configure_logging(settings.server.log_level, settings.server.log_format)
    if settings.server.kernel_cache_seed:  # before any kernel loads: kernels/cpu/cache_seed.py
        from bitserve.kernels.cpu.cache_seed import seed_numba_cache

        seed_numba_cache(settings.server.kernel_cache_seed)
    set_values = {name: source for name, source in sorted(settings.sources.items())}
    logger.info(
        "starting bitserve on %s:%d; settings given: %s",
        settings.server.host,
        settings.server.port,
        set_values or "none",
    )
    return serve(settings)
