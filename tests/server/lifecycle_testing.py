"""Helpers for the model-lifecycle tests: tiny synthetic model versions in a model root, an in-process
uvicorn server on a real socket (so the test can reach its ModelManager), and a streaming client."""

from __future__ import annotations

import asyncio
import hashlib
import json
import shutil
import threading
import time
from collections.abc import Coroutine, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import httpx
import uvicorn
from http_testing import free_port, wait_until_ready

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
from bitserve.testing.synthetic import (
    SyntheticConfig,
    make_weights,
    tokenizer_metadata,
    write_synthetic_model,
)

T = TypeVar("T")
TINY = dict(
    num_layers=1, hidden_size=256, intermediate_size=256, num_heads=4, num_kv_heads=4, embedding_type="Q8_0"
)  # TQ2_0 needs K % 256 == 0
KV_CACHE_BYTES = 4 * 1024 * 1024
MAX_MODEL_LEN = 256


@dataclass
class ModelRoot:
    root: Path
    outside: Path  # a valid model file outside the root
    files: dict[str, Path] = field(default_factory=dict)


def write_version(path: Path, tokenizer: dict[str, Any], seed: int, architecture: str = "bitnet") -> Path:
    config = SyntheticConfig(seed=seed, architecture=architecture, **TINY)
    weights = make_weights(config, len(tokenizer["tokenizer.ggml.tokens"][1]))
    return write_synthetic_model(path, "TQ2_0", config=config, weights=weights, tokenizer=tokenizer)


def build_model_root(base: Path, smollm2_path: Path) -> ModelRoot:
    """v1 and v2 (different weights), a truncated file, a wrong-architecture file, v2 under a sidecar
    whose golden tokens it does not produce and under one with a wrong sha256; plus a file outside the
    root and a symlink in the root escaping to it."""
    tokenizer = tokenizer_metadata(smollm2_path)
    root, outside = base / "models", base / "outside"
    root.mkdir()
    outside.mkdir()
    files = {
        "v1": write_version(root / "v1.gguf", tokenizer, seed=1),
        "v2": write_version(root / "v2.gguf", tokenizer, seed=2),
    }
    data = files["v1"].read_bytes()
    files["truncated"] = root / "truncated.gguf"
    files["truncated"].write_bytes(data[: len(data) // 2])
    files["wrongarch"] = write_version(root / "wrongarch.gguf", tokenizer, seed=3, architecture="mamba")
    files["badgolden"] = root / "badgolden.gguf"
    shutil.copyfile(files["v2"], files["badgolden"])
    golden = [{"prompt": "Hello world", "expected_token_ids": [0, 0, 0, 0]}]
    (root / "badgolden.gguf.json").write_text(json.dumps({"golden": golden}))
    files["badsha"] = root / "badsha.gguf"
    shutil.copyfile(files["v2"], files["badsha"])
    (root / "badsha.gguf.json").write_text(json.dumps({"sha256": "0" * 64}))
    secret = outside / "secret.gguf"
    shutil.copyfile(files["v1"], secret)
    (root / "escape.gguf").symlink_to(secret)
    return ModelRoot(root, secret, files)


class ThreadServer:
    """uvicorn serving build_app() in a thread on 127.0.0.1; `run()` executes a coroutine on its loop."""

    def __init__(
        self,
        server_config: ServerConfig,
        engine_config: EngineConfig,
        *,
        access_log: bool = False,
        **app_options: Any,
    ) -> None:
        from bitserve.server.app import build_app

        self.app = build_app(server_config, engine_config, **app_options)
        config = uvicorn.Config(
            self.app,
            host="127.0.0.1",
            port=server_config.port,
            log_config=None,
            lifespan="on",
            access_log=access_log,
            timeout_keep_alive=server_config.keep_alive_timeout_s,
        )
        self.server = uvicorn.Server(config)
        self.url = f"http://127.0.0.1:{server_config.port}"
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._serve, daemon=True)

    def _serve(self) -> None:
        asyncio.set_event_loop(self.loop)
        self.loop.run_until_complete(self.server.serve())

    @property
    def state(self) -> Any:
        return self.app.state.bitserve

    def start(self, timeout_s: float = 120.0) -> None:
        self._thread.start()
        if not wait_until_ready(self.url, timeout_s):
            raise RuntimeError("lifecycle test server not ready")

    def run(self, coroutine: Coroutine[Any, Any, T], timeout_s: float = 60.0) -> T:
        """Run `coroutine` on the server's event loop (where the ModelManager lives)."""
        return asyncio.run_coroutine_threadsafe(coroutine, self.loop).result(timeout_s)

    def stop(self) -> None:
        self.server.should_exit = True
        self._thread.join(60)


@contextmanager
def lifecycle_server(model_root: ModelRoot, **server_options: Any) -> Iterator[ThreadServer]:
    options: dict[str, Any] = {
        "port": free_port(),
        "model_roots": str(model_root.root),
        "swap_probation_s": 0.0,
        "sse_keepalive_s": 1.0,
        "max_num_waiting": 1024,
        **server_options,
    }
    engine = EngineConfig(
        model=ModelConfig(model=str(model_root.files["v1"])),
        scheduler=SchedulerConfig(max_model_len=MAX_MODEL_LEN),
        kv_cache_memory_bytes=KV_CACHE_BYTES,
    )
    server = ThreadServer(ServerConfig(**options), engine)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@dataclass
class StreamResult:
    status: int
    header_version: str | None
    versions: set[str]
    text: str
    finish_reason: str | None
    has_done: bool
    error: Any = None


async def stream_completion(
    client: httpx.AsyncClient, prompt: str, max_tokens: int, model: str | None = None
) -> StreamResult:
    body: dict[str, Any] = {"prompt": prompt, "max_tokens": max_tokens, "stream": True, "temperature": 0.0}
    if model is not None:
        body["model"] = model
    async with client.stream("POST", "/v1/completions", json=body) as response:
        if response.status_code != 200:
            await response.aread()
            return StreamResult(
                response.status_code, None, set(), "", None, False, response.json().get("error")
            )
        result = StreamResult(200, response.headers.get("x-model-version"), set(), "", None, False)
        async for line in response.aiter_lines():
            if not line.startswith("data: "):
                continue
            payload = line[len("data: ") :]
            if payload == "[DONE]":
                result.has_done = True
                continue
            chunk = json.loads(payload)
            if "error" in chunk:
                result.error = chunk["error"]
                continue
            result.versions.add(chunk["model_version"])
            for choice in chunk["choices"]:
                result.text += choice.get("text") or ""
                result.finish_reason = choice.get("finish_reason") or result.finish_reason
        return result


def version_of(path: Path) -> str:
    return hashlib.sha256(path.read_bytes()).hexdigest()[:12]


def admin(url: str, path: str, body: dict[str, Any] | None = None) -> httpx.Response:
    return httpx.post(f"{url}{path}", json=body if body is not None else {}, timeout=120.0)


def metric_value(url: str, name: str, **labels: str) -> float:
    text = httpx.get(f"{url}/metrics", timeout=10.0).text
    wanted = ",".join(f'{key}="{value}"' for key, value in sorted(labels.items()))
    for line in text.splitlines():
        if line.startswith(f"{name}{{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
            return float(line.rsplit(" ", 1)[1])
    raise AssertionError(f"no sample {name}{{{wanted}}}")


async def run_clients(
    url: str,
    num_clients: int,
    stop: asyncio.Event,
    results: list[Any],
    *,
    model: str | None = None,
    max_tokens: int = 4,
) -> None:
    limits = httpx.Limits(max_connections=num_clients + 8, max_keepalive_connections=num_clients + 8)
    async with httpx.AsyncClient(base_url=url, timeout=120.0, limits=limits) as client:

        async def one(index: int) -> None:
            count = 0
            while not stop.is_set():
                started = time.monotonic()
                try:
                    result = await stream_completion(
                        client, f"client {index} request {count}", max_tokens, model
                    )
                except (
                    httpx.HTTPError,
                    ValueError,
                    KeyError,
                ) as exc:  # a broken stream is a failed request, not a hang
                    result = StreamResult(-1, None, set(), "", None, False, f"{type(exc).__name__}: {exc}")
                results.append((started, time.monotonic(), result))
                count += 1

        await asyncio.gather(*(one(i) for i in range(num_clients)))


def failed(results: list[Any]) -> list[Any]:
    return [
        r
        for _, _, r in results
        if r.status != 200
        or r.error is not None
        or not r.has_done
        or r.finish_reason not in ("length", "stop")
    ]
