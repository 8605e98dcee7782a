"""`bitserve bench`: the SSE parser on tricky streams, and the load runner end to end against a small
in-process fake OpenAI-compatible server (uvicorn on 127.0.0.1) whose chunks, delays and failures are known.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.util
import json
import socket
import threading
import time
from collections import Counter
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from bitserve.bench.client import check_url
from bitserve.bench.report import distribution, percentile, summarise
from bitserve.bench.runner import BenchConfig, run_bench_async, synthetic_prompt
from bitserve.bench.sse import SSEEvent, SSEParser
from bitserve.cli.bench import add_bench_parser, run_bench
from bitserve.errors import InvalidRequest

REPO_ROOT = Path(__file__).resolve().parents[2]

# ----------------------------------------------------------------- SSE parser


def parse_all(chunks: list[bytes]) -> list[SSEEvent]:
    parser = SSEParser()
    events = [event for chunk in chunks for event in parser.feed(chunk)]
    return events + parser.close()


TRICKY = (
    "\ufeffdata: first\n\n"  # BOM at the start
    ": a comment line\n"
    "data: line one\r\ndata:line two\r\n\r\n"  # CRLF, no space after the colon, two data lines
    'event: error\rdata: {"x": 1}\r\r'  # bare CR line ends, an event type
    "id: 7\ndata\n\n"  # a field with no colon: empty data
    "event: lonely\n\n"  # no data: dispatches nothing
    "data:  two spaces\nretry: 10\nunknown: field\n\n"  # only one leading space is dropped
    "data: é€𝄞 utf-8\n\n"
    "data: [DONE]\n\n"
    "data: never dispatched"  # no blank line at the end of the stream
)
EXPECTED = [
    SSEEvent("first"),
    SSEEvent("line one\nline two"),
    SSEEvent('{"x": 1}', "error"),
    SSEEvent("", "message", "7"),
    SSEEvent(" two spaces", "message", "7"),
    SSEEvent("é€𝄞 utf-8", "message", "7"),
    SSEEvent("[DONE]", "message", "7"),
]


def test_sse_parser_whole_stream() -> None:
    assert parse_all([TRICKY.encode()]) == EXPECTED


def test_sse_parser_any_split_gives_the_same_events() -> None:
    data = TRICKY.encode()
    assert parse_all([data[i : i + 1] for i in range(len(data))]) == EXPECTED  # byte by byte, UTF-8 split too
    for cut in range(len(data)):
        assert parse_all([data[:cut], data[cut:]]) == EXPECTED, cut


def test_sse_parser_cr_at_chunk_end_is_one_line_break() -> None:
    # "\r" ends one chunk and "\n" starts the next: one line end, not an extra blank line
    assert parse_all([b"data: a\r", b"\ndata: b\r", b"\n\r", b"\n"]) == [SSEEvent("a\nb")]
    assert parse_all([b"data: a\n\r"]) == [SSEEvent("a")]  # a trailing CR at close is a line end


# ----------------------------------------------------------------- small pure helpers


def test_check_url_allows_loopback_only_by_default() -> None:
    for url in ("http://127.0.0.1:8000/", "http://localhost:1", "http://[::1]:8000", "https://127.8.9.1"):
        assert check_url(url, allow_remote=False) == url.rstrip("/")
    for url in ("http://example.com", "http://10.0.0.1:8000", "http://127.0.0.1.example.com"):
        with pytest.raises(InvalidRequest, match="loopback"):
            check_url(url, allow_remote=False)
    assert check_url("http://example.com", allow_remote=True) == "http://example.com"
    with pytest.raises(InvalidRequest, match="http"):
        check_url("ftp://127.0.0.1/", allow_remote=True)


def test_percentiles_match_numpy_and_are_ordered() -> None:
    values = sorted(np.random.default_rng(0).exponential(size=37).tolist())
    for q in (0, 50, 90, 99, 100):
        assert percentile(values, q) == pytest.approx(np.percentile(values, q))
    summary = distribution(values)
    assert summary["p50"] <= summary["p90"] <= summary["p99"]
    assert distribution([])["p50"] is None


def test_synthetic_prompts_are_deterministic_and_distinct() -> None:
    assert synthetic_prompt(3, 20) == synthetic_prompt(3, 20)
    assert synthetic_prompt(3, 20) != synthetic_prompt(4, 20)
    assert len(synthetic_prompt(5, 64).split()) == 64
    assert synthetic_prompt(3, 20, seed="run2") == synthetic_prompt(3, 20, seed="run2")
    assert synthetic_prompt(3, 20, seed="run2") != synthetic_prompt(3, 20)


# ----------------------------------------------------------------- fake OpenAI-compatible server

CHUNK_DELAY_S = 0.002


class FakeState:
    """What the fake server saw: request bodies, and a per-model arrival counter that picks failures."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.bodies: list[dict[str, Any]] = []
        self.counts: Counter[str] = Counter()

    def arrive(self, body: dict[str, Any]) -> int:
        with self.lock:
            self.bodies.append(body)
            index = self.counts[body["model"]]
            self.counts[body["model"]] += 1
            return index


def sse(payload: dict[str, Any], *, is_split: bool = False) -> str:
    text = json.dumps(payload)
    if is_split:  # the JSON over two data lines (joined with "\n", still valid JSON) after a comment
        half = text.index(",") + 1
        return f": keep-alive\ndata: {text[:half]}\ndata: {text[half:]}\n\n"
    return f"data: {text}\n\n"


def make_fake_app(state: FakeState) -> Starlette:
    """Model names pick behaviour: ok, coalesce (2 tokens a chunk), slow, mixed (ok/500/truncate/drop)."""

    async def models(request: Request) -> Response:
        return JSONResponse({"object": "list", "data": [{"id": "ok"}, {"id": "mixed"}]})

    async def serve(request: Request) -> Response:
        body = await request.json()
        index = state.arrive(body)
        is_chat = request.url.path.endswith("/chat/completions")
        kind = ("ok", "500", "truncate", "drop")[index % 4] if body["model"] == "mixed" else body["model"]
        if kind == "500":
            return JSONResponse({"error": {"message": "boom", "type": "internal_error"}}, status_code=500)
        return StreamingResponse(stream(body, kind, is_chat), media_type="text/event-stream")

    async def stream(body: dict[str, Any], kind: str, is_chat: bool) -> AsyncIterator[str]:
        max_tokens = body["max_tokens"]
        tokens_per_chunk = 2 if kind == "coalesce" else 1
        delay = 0.3 if kind == "slow" else CHUNK_DELAY_S
        if is_chat:  # role-only first chunk: not a token, must not set TTFT
            yield sse({"choices": [{"index": 0, "delta": {"role": "assistant"}}]})
        for i in range(max_tokens // tokens_per_chunk):
            if kind == "truncate" and i == 3:
                return  # a clean end of the body, but no [DONE]
            if kind == "drop" and i == 3:
                raise RuntimeError("connection dropped mid-stream")  # uvicorn aborts the chunked body
            await asyncio.sleep(delay)
            choice = {"index": 0, "delta": {"content": "tok "}} if is_chat else {"index": 0, "text": "tok "}
            yield sse({"choices": [choice]}, is_split=i % 3 == 1)
        yield sse({"choices": [{"index": 0, "text": "", "finish_reason": "length"}]})
        if (body.get("stream_options") or {}).get("include_usage"):
            yield sse(
                {
                    "choices": [],
                    "usage": {
                        "prompt_tokens": 9,
                        "completion_tokens": max_tokens,
                        "total_tokens": 9 + max_tokens,
                    },
                }
            )
        yield "data: [DONE]\n\n"

    return Starlette(
        routes=[
            Route("/v1/models", models),
            Route("/v1/completions", serve, methods=["POST"]),
            Route("/v1/chat/completions", serve, methods=["POST"]),
        ]
    )


@pytest.fixture(scope="module")
def fake_server() -> Iterator[tuple[str, FakeState]]:
    state = FakeState()
    # IPPROTO_TCP as getaddrinfo gives it when uvicorn binds by itself: asyncio sets TCP_NODELAY only on
    # connections of such a socket, and without it a reused connection's chunks wait out Nagle's algorithm
    # (measured: a whole 8-chunk stream arriving at once after ~41 ms, every inter-token gap 0)
    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    config = uvicorn.Config(
        make_fake_app(state), log_level="critical", lifespan="off", timeout_graceful_shutdown=2
    )
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + 20
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the fake server did not start"
        time.sleep(0.01)
    yield f"http://127.0.0.1:{port}", state
    server.should_exit = True
    thread.join(10)
    sock.close()


def bench(url: str, **overrides: Any) -> dict[str, Any]:
    fields: dict[str, Any] = dict(
        url=url,
        endpoint="completions",  # the fake server's prompts are plain; chat has its own test below
        concurrency_levels=(1, 3),
        num_requests=6,
        max_tokens=8,
        num_warmup=0,
        timeout_s=10.0,
    )
    fields.update(overrides)
    return summarise(asyncio.run(run_bench_async(BenchConfig(**fields))))


def test_bench_defaults_to_the_chat_endpoint_users_serve() -> None:
    from bitserve.cli.main import build_parser

    assert BenchConfig(url="http://127.0.0.1:1").endpoint == "chat"
    assert build_parser().parse_args(["bench", "--url", "http://127.0.0.1:1"]).endpoint == "chat"


def test_load_run_counts_tokens_and_orders_percentiles(fake_server: tuple[str, FakeState]) -> None:
    url, state = fake_server
    before = len(state.bodies)
    summary = bench(url, ignore_eos=True, num_warmup=1, goodput_e2e_s=60.0)
    assert summary["model"] == "ok"  # the first of /v1/models
    bodies = state.bodies[before:]
    assert len(bodies) == 1 + 6 + 6  # warm-up, then two levels of six
    assert all(
        b["ignore_eos"] is True and b["stream"] is True and b["stream_options"] == {"include_usage": True}
        for b in bodies
    )
    assert len({b["prompt"] for b in bodies}) == len(bodies)  # synthetic prompts differ per request
    for level in summary["levels"]:
        assert (level["num_requests"], level["num_ok"], level["num_errors"]) == (6, 6, 0)
        assert level["num_output_tokens"] == 6 * 8 and level["token_count_source"] == "usage"
        assert level["num_short"] == 0
        assert level["itl_s"]["count"] == 6 * 7  # gaps between the 8 content chunks of each stream
        assert level["tpot_s"]["count"] == 6 and level["ttft_s"]["count"] == 6
        for name in ("ttft_s", "itl_s", "tpot_s", "e2e_s"):
            dist = level[name]
            assert 0 < dist["p50"] <= dist["p90"] <= dist["p99"], name
        assert level["ttft_s"]["p99"] < level["e2e_s"]["p99"]
        assert level["output_tokens_per_s"] == pytest.approx(48 / level["wall_s"])
        assert level["goodput_requests_per_s"] == pytest.approx(
            level["requests_per_s"]
        )  # every request within 60 s


def test_usage_is_preferred_over_chunk_count(fake_server: tuple[str, FakeState]) -> None:
    url, state = fake_server
    with_usage = bench(url, model="coalesce", concurrency_levels=(2,), num_requests=2)["levels"][0]
    assert with_usage["num_output_tokens"] == 2 * 8 and with_usage["token_count_source"] == "usage"
    before = len(state.bodies)
    chunks = bench(url, model="coalesce", concurrency_levels=(2,), num_requests=2, include_usage=False)[
        "levels"
    ][0]
    assert all("stream_options" not in b and "ignore_eos" not in b for b in state.bodies[before:])
    assert (
        chunks["num_output_tokens"] == 2 * 4 and chunks["token_count_source"] == "chunks"
    )  # 4 chunks of 2 tokens
    assert chunks["num_short"] == 2  # as far as the client can tell, 4 < max_tokens


def test_errors_are_counted_by_kind(fake_server: tuple[str, FakeState]) -> None:
    url, _ = fake_server
    level = bench(url, model="mixed", concurrency_levels=(2,), num_requests=8, goodput_ttft_s=30.0)["levels"][
        0
    ]
    # arrival order i % 4: ok, 500, truncated (clean end without [DONE]), dropped connection
    assert level["errors"] == {"http_500": 2, "truncated": 4}
    assert (level["num_ok"], level["num_errors"]) == (2, 6)
    assert "boom" in level["error_samples"]["http_500"]
    assert level["num_output_tokens"] == 2 * 8  # failed requests add no tokens
    assert level["goodput_requests_per_s"] == pytest.approx(level["requests_per_s"])


def test_a_slow_stream_times_out(fake_server: tuple[str, FakeState]) -> None:
    url, _ = fake_server
    level = bench(url, model="slow", concurrency_levels=(1,), num_requests=1, timeout_s=0.2)["levels"][0]
    assert level["errors"] == {"timeout": 1} and level["num_ok"] == 0
    assert level["e2e_s"]["p50"] is None


def test_chat_endpoint_skips_the_role_chunk(fake_server: tuple[str, FakeState]) -> None:
    url, state = fake_server
    before = len(state.bodies)
    level = bench(url, endpoint="chat", prompt="Hello there", concurrency_levels=(2,), num_requests=2)[
        "levels"
    ][0]
    assert all(b["messages"] == [{"role": "user", "content": "Hello there"}] for b in state.bodies[before:])
    assert level["num_ok"] == 2 and level["num_output_tokens"] == 16
    assert level["itl_s"]["count"] == 2 * 7  # 8 content chunks each; the role chunk is not a token


def test_cli_bench_json_and_remote_refusal(
    fake_server: tuple[str, FakeState], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    parser = argparse.ArgumentParser()
    add_bench_parser(parser.add_subparsers(dest="command"))
    args = parser.parse_args(
        [
            "bench",
            "--url",
            url,
            "--concurrency",
            "1,2",
            "--num-requests",
            "2",
            "--max-tokens",
            "4",
            "--prompt-tokens",
            "16",
            "--num-warmup",
            "0",
            "--json",
        ]
    )
    assert run_bench(args) == 0
    summary = json.loads(capsys.readouterr().out)
    assert [level["concurrency"] for level in summary["levels"]] == [1, 2]
    assert all(level["num_output_tokens"] == 8 for level in summary["levels"])
    text_args = parser.parse_args(
        [
            "bench",
            "--url",
            url,
            "--model",
            "mixed",
            "--concurrency",
            "1",
            "--num-requests",
            "2",
            "--max-tokens",
            "4",
            "--num-warmup",
            "0",
        ]
    )
    assert run_bench(text_args) == 0
    out = capsys.readouterr().out
    assert "e2e50" in out and "http_500=1" in out
    with pytest.raises(InvalidRequest, match="loopback"):
        run_bench(parser.parse_args(["bench", "--url", "http://192.0.2.1:8000", "--json"]))
    with pytest.raises(InvalidRequest, match="--concurrency"):
        run_bench(parser.parse_args(["bench", "--url", url, "--concurrency", "0"]))


def test_bench_serving_script_compares_two_urls(
    fake_server: tuple[str, FakeState], capsys: pytest.CaptureFixture[str]
) -> None:
    url, _ = fake_server
    spec = importlib.util.spec_from_file_location(
        "bench_serving", REPO_ROOT / "benchmarks" / "bench_serving.py"
    )
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    code = module.main(
        [
            url,
            url.replace("127.0.0.1", "localhost"),
            "--peer-model",
            "coalesce",
            "--concurrency",
            "1,2",
            "--num-requests",
            "2",
            "--max-tokens",
            "4",
            "--num-warmup",
            "0",
            "--no-usage",
        ]
    )
    assert code == 0
    lines = capsys.readouterr().out.splitlines()
    table = lines[lines.index(next(line for line in lines if line.startswith("bitserve vs peer"))) + 1 :]
    assert table[0].split()[:4] == ["conc", "tok/s", "bitserve", "tok/s"]
    assert [row.split()[0] for row in table[1:]] == ["1", "2"]
    assert all(
        row.split()[-1] == "0/2" for row in table[1:]
    )  # the peer's 2-token chunks look short without usage
