"""Black box: `bitserve serve` (embedded SmolLM2) in a subprocess, driven by the official `openai`
client and raw httpx: chat, completions, streaming, usage, n, stop, seeds, logprobs, errors,
models, tokenize, 100 concurrent streams, and disconnects that free their KV blocks."""

from __future__ import annotations

import asyncio
import threading
import time
from collections.abc import Iterator
from typing import Any

import httpx
import openai
import pytest
from http_testing import ServerProcess, parse_stream

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]
ERROR_KEYS = {"message", "type", "param", "code", "hint"}
NUM_CONCURRENT_STREAMS = 100


@pytest.fixture(scope="module")
def client(blackbox: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{blackbox.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as api:
        yield api


def stream_lines(server: ServerProcess, path: str, body: dict[str, Any]) -> list[str]:
    with httpx.stream("POST", f"{server.url}{path}", json=body, timeout=120.0) as response:
        assert response.status_code == 200, response.read()
        assert response.headers["content-type"].startswith("text/event-stream")
        assert "content-length" not in response.headers
        return list(response.iter_lines())


def test_chat_completion(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, temperature=0)
    choice = response.choices[0]
    assert response.object == "chat.completion" and response.model == MODEL
    assert choice.message.role == "assistant" and choice.message.content
    assert choice.finish_reason in ("stop", "length")
    assert 1 <= response.usage.completion_tokens <= 8
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_chat_stream_matches_the_whole_answer(client: openai.OpenAI) -> None:
    whole = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=10, temperature=0)
    chunks = list(
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=10,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    assert all(chunk.object == "chat.completion.chunk" and chunk.id == chunks[0].id for chunk in chunks)
    text = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert text == whole.choices[0].message.content
    finishes = [
        chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason
    ]
    assert finishes == [whole.choices[0].finish_reason]
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage is not None
    assert usage_chunk.usage.completion_tokens == whole.usage.completion_tokens
    assert usage_chunk.usage.prompt_tokens == whole.usage.prompt_tokens


def test_raw_sse_frames(blackbox: ServerProcess) -> None:
    for path, body in (
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/completions", {"prompt": "Once upon a time"}),
    ):
        lines = stream_lines(blackbox, path, {**body, "max_tokens": 6, "stream": True})
        chunks, is_done = parse_stream(lines)  # every data frame is JSON, the last is [DONE]
        assert is_done and chunks
        assert "usage" not in chunks[-1]  # not asked for
        assert chunks[-1]["choices"][0]["finish_reason"] in ("stop", "length")
        kind = "chat.completion.chunk" if "chat" in path else "text_completion"
        assert all(chunk["object"] == kind for chunk in chunks)


def test_completion_with_n_and_echo(client: openai.OpenAI) -> None:
    response = client.completions.create(
        model=MODEL, prompt="The sea is", max_tokens=6, n=2, temperature=0.8, seed=7, echo=True
    )
    assert sorted(choice.index for choice in response.choices) == [0, 1]
    assert all(choice.text.startswith("The sea is") for choice in response.choices)
    assert response.usage.completion_tokens <= 12


def test_stop_strings_never_appear(client: openai.OpenAI) -> None:
    free = (
        client.completions.create(model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0)
        .choices[0]
        .text
    )
    assert " 7" in free, free  # the model counts on; stop at " 7"
    stopped = client.completions.create(
        model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"]
    )
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert " 7" not in choice.text and free.startswith(choice.text)
    chunks = list(
        client.completions.create(
            model=MODEL, prompt="1, 2, 3, 4,", max_tokens=16, temperature=0, stop=[" 7"], stream=True
        )
    )
    assert "".join(chunk.choices[0].text for chunk in chunks) == choice.text


def test_seed_reproducibility(client: openai.OpenAI) -> None:
    def sample() -> str:
        response = client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0.8, seed=1234
        )
        return response.choices[0].message.content or ""

    assert sample() == sample()


def test_logprobs_with_top_logprobs(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True, top_logprobs=3
    )
    content = response.choices[0].logprobs.content
    assert len(content) == response.usage.completion_tokens
    assert "".join(entry.token for entry in content) == response.choices[0].message.content
    for entry in content:
        assert entry.logprob <= 0 and len(entry.top_logprobs) == 3
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        assert entry.top_logprobs[0].token == entry.token  # greedy picks the most likely token
    legacy = (
        client.completions.create(model=MODEL, prompt="Hello", max_tokens=3, temperature=0, logprobs=2)
        .choices[0]
        .logprobs
    )
    assert len(legacy.tokens) == len(legacy.token_logprobs) == len(legacy.top_logprobs) == 3
    assert legacy.text_offset == [0, len(legacy.tokens[0]), len(legacy.tokens[0]) + len(legacy.tokens[1])]


@pytest.mark.parametrize(
    ("call", "error_type", "status", "code"),
    [
        (
            lambda api: api.chat.completions.create(model=MODEL, messages=MESSAGES, temperature=5),
            openai.BadRequestError,
            400,
            "invalid_value",
        ),
        (
            lambda api: api.chat.completions.create(model="no-such-model", messages=MESSAGES),
            openai.NotFoundError,
            404,
            "model_not_found",
        ),
        (
            lambda api: api.chat.completions.create(model=MODEL, messages=MESSAGES, store=True),
            openai.BadRequestError,
            400,
            "unsupported_parameter",
        ),
        (
            lambda api: api.completions.create(model=MODEL, prompt="hi " * 5000),
            openai.BadRequestError,
            400,
            "context_length_exceeded",
        ),
        (
            lambda api: api.completions.create(model=MODEL, prompt="hi", max_tokens=5000),
            openai.BadRequestError,
            400,
            "context_length_exceeded",
        ),
    ],
)
def test_error_classes(
    client: openai.OpenAI, call: Any, error_type: type[openai.APIStatusError], status: int, code: str
) -> None:
    with pytest.raises(error_type) as caught:
        call(client)
    assert caught.value.status_code == status
    error = caught.value.response.json()["error"]
    assert set(error) == ERROR_KEYS and error["code"] == code and error["message"]
    assert caught.value.response.headers["x-request-id"]


def test_models(client: openai.OpenAI) -> None:
    assert [model.id for model in client.models.list()] == [MODEL]
    assert client.models.retrieve(MODEL).id == MODEL
    with pytest.raises(openai.NotFoundError):
        client.models.retrieve("gpt-4")


def test_tokenize_round_trip(blackbox: ServerProcess) -> None:
    text = "Ternary weights: -1, 0 and +1 — café ☕"
    tokens = httpx.post(f"{blackbox.url}/tokenize", json={"prompt": text}).json()
    assert tokens["count"] == len(tokens["tokens"]) > 0 and tokens["max_model_len"] > 0
    assert (
        httpx.post(f"{blackbox.url}/detokenize", json={"tokens": tokens["tokens"]}).json()["prompt"] == text
    )


def test_health_and_metrics(blackbox: ServerProcess) -> None:
    health = httpx.get(f"{blackbox.url}/health").json()
    assert health["status"] == "ready"
    build = health["build"]
    assert build["version"] and build["git_sha"] and build["torch_version"]
    assert build["kernel_backend"] in ("cpu", "reference") and "Q4_1" in build["tensor_types"]
    (replica,) = health["components"]["replicas"]  # the KV pool sized at load (issue 10)
    kv = replica["kv_cache"]
    assert kv["num_tokens"] >= 4096 and kv["bytes_per_token"] == 30 * 2 * 3 * 64 * 4
    assert kv["memory_bytes"] == kv["num_blocks"] * kv["block_size"] * kv["bytes_per_token"]
    assert httpx.get(f"{blackbox.url}/health/live").status_code == 200
    httpx.post(f"{blackbox.url}/v1/completions", json={"prompt": "x", "n": 99})  # one counted 400
    metrics = httpx.get(f"{blackbox.url}/metrics")
    assert metrics.status_code == 200 and metrics.headers["content-type"].startswith("text/plain")
    assert 'bitserve_http_errors_total{reason="invalid_value",status="400"}' in metrics.text
    assert "bitserve_requests_total" in metrics.text


async def _one_stream(http: httpx.AsyncClient, index: int) -> tuple[int, bool, str | None]:
    body = {
        "model": MODEL,
        "messages": [{"role": "user", "content": f"Say a number: {index % 7}"}],
        "max_tokens": 8,
        "stream": True,
    }
    async with http.stream("POST", "/v1/chat/completions", json=body) as response:
        lines = [line async for line in response.aiter_lines()]
    chunks, is_done = parse_stream(lines) if response.status_code == 200 else ([], False)
    finishes = [
        c["choices"][0]["finish_reason"]
        for c in chunks
        if c.get("choices") and c["choices"][0]["finish_reason"]
    ]
    return response.status_code, is_done, finishes[-1] if finishes else None


def test_100_concurrent_streams(blackbox: ServerProcess) -> None:
    async def run() -> list[tuple[int, bool, str | None]]:
        limits = httpx.Limits(max_connections=NUM_CONCURRENT_STREAMS + 10)
        async with httpx.AsyncClient(base_url=blackbox.url, timeout=300.0, limits=limits) as http:
            return await asyncio.gather(*(_one_stream(http, i) for i in range(NUM_CONCURRENT_STREAMS)))

    results = asyncio.run(run())
    assert [status for status, _, _ in results] == [200] * NUM_CONCURRENT_STREAMS
    assert all(is_done for _, is_done, _ in results)
    assert all(finish in ("stop", "length") for _, _, finish in results)


def wait_until_idle(server: ServerProcess, timeout_s: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout_s
    while True:
        stats = httpx.get(f"{server.url}/v1/stats").json()
        if stats["requests"]["num_active"] == 0 and stats["kv_cache"]["usage"] == 0.0:
            return stats
        assert time.monotonic() < deadline, f"not idle after {timeout_s} s: {stats}"
        time.sleep(0.1)


def test_killed_stream_frees_its_blocks(blackbox: ServerProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 2000, "ignore_eos": True, "stream": True}
    with httpx.stream("POST", f"{blackbox.url}/v1/chat/completions", json=body, timeout=60.0) as response:
        lines = response.iter_lines()  # NOTE: keep the iterator alive; dropping it closes the response
        num_chunks = sum(1 for _ in range(8) if next(lines).startswith("data: "))
        assert num_chunks >= 3
        stats = httpx.get(f"{blackbox.url}/v1/stats").json()
        assert stats["requests"]["num_active"] == 1 and stats["kv_cache"]["usage"] > 0
    # leaving the block closed the connection mid-stream
    wait_until_idle(blackbox)


def test_sequential_requests_reuse_the_resident_kv_blocks(
    client: openai.OpenAI, blackbox: ServerProcess
) -> None:
    """One request at a time takes back blocks it already wrote, never fresh pages: the server's RSS
    stays flat under light load however many requests it serves (issue 10)."""
    wait_until_idle(blackbox)

    def ask(index: int) -> int:
        # prompts that share no first block: no prefix hits, every request allocates
        prompt = f"{index} " + "lorem ipsum dolor " * 12
        client.completions.create(model=MODEL, prompt=prompt, max_tokens=4, temperature=0)
        return int(wait_until_idle(blackbox)["kv_cache"]["num_resident_blocks"])

    resident = [ask(index) for index in range(4)]
    kv = httpx.get(f"{blackbox.url}/v1/stats").json()["kv_cache"]
    assert resident[-1] == resident[0] < kv["num_usable_blocks"], (resident, kv)


def test_disconnected_non_streaming_request_is_aborted(blackbox: ServerProcess) -> None:
    body = {"model": MODEL, "prompt": "Once upon a time", "max_tokens": 2000, "ignore_eos": True}
    outcome: list[BaseException] = []

    def post() -> None:
        try:
            httpx.post(f"{blackbox.url}/v1/completions", json=body, timeout=4.0)
        except httpx.ReadTimeout as exc:  # the client gives up and closes the connection
            outcome.append(exc)

    thread = threading.Thread(target=post)
    thread.start()
    deadline = time.monotonic() + 4.0
    seen_active = False
    while not seen_active and time.monotonic() < deadline:
        seen_active = httpx.get(f"{blackbox.url}/v1/stats").json()["requests"]["num_active"] == 1
        time.sleep(0.05)
    thread.join(timeout=30)
    assert seen_active and len(outcome) == 1
    wait_until_idle(blackbox)
