"""The response cache over real sockets with the official `openai` client: a repeated greedy or seeded
request is a hit (`X-Cache: hit`, the same answer), a sampled one is never cached, a stream replays
a stored answer and ends with [DONE], a swap never serves the old version's answers, expiry, and the
disk tier survives a restart. The models are tiny synthetic BitNet versions with a chat template."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from http_testing import parse_stream
from lifecycle_testing import (
    ModelRoot,
    ThreadServer,
    admin,
    lifecycle_server,
    metric_value,
    version_of,
    write_version,
)

from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.gguf_types import GGUFValueType
from bitserve.testing.synthetic import tokenizer_metadata

ALIAS = "v1"  # the startup model's alias: its file stem
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]


@pytest.fixture(scope="module")
def chat_root(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> ModelRoot:
    """v1 and v2 (different weights) with SmolLM2's tokenizer and chat template."""
    tokenizer: dict[str, Any] = tokenizer_metadata(smollm2_path)
    with read_gguf(smollm2_path) as gguf:
        template = str(gguf.metadata["tokenizer.chat_template"])
    tokenizer["tokenizer.chat_template"] = (GGUFValueType.STRING, template, None)
    base = tmp_path_factory.mktemp("response-cache")
    root = base / "models"
    root.mkdir()
    files = {
        name: write_version(root / f"{name}.gguf", tokenizer, seed) for name, seed in (("v1", 1), ("v2", 2))
    }
    return ModelRoot(root, base, files)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("cache-dir")


@pytest.fixture(scope="module")
def server(chat_root: ModelRoot, cache_dir: Path) -> Iterator[ThreadServer]:
    with lifecycle_server(chat_root, response_cache=True, response_cache_dir=str(cache_dir)) as running:
        yield running


@pytest.fixture(scope="module")
def api(server: ThreadServer) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=60.0) as client:
        yield client


def chat(api: openai.OpenAI, **options: Any) -> tuple[str | None, str, Any]:
    """(X-Cache, X-Model-Version, the parsed completion) of one chat request."""
    raw = api.chat.completions.with_raw_response.create(
        model=ALIAS,
        messages=options.pop("messages", MESSAGES),
        max_tokens=options.pop("max_tokens", 8),
        **options,
    )
    return raw.headers.get("x-cache"), raw.headers["x-model-version"], raw.parse()


def cache_stats(server: ThreadServer) -> dict[str, Any]:
    stats: dict[str, Any] = httpx.get(f"{server.url}/v1/stats", timeout=10.0).json()["response_cache"]
    return stats


def sse_chat(server: ThreadServer, body: dict[str, Any]) -> tuple[str | None, list[dict[str, Any]], bool]:
    """(X-Cache, JSON chunks, ended with [DONE]) of one streamed chat request, read as raw SSE."""
    payload = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 8, "stream": True, **body}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=payload, timeout=60.0) as response:
        assert response.status_code == 200
        chunks, is_done = parse_stream(list(response.iter_lines()))
        return response.headers.get("x-cache"), chunks, is_done


def streamed_text(chunks: list[dict[str, Any]]) -> str:
    return "".join(choice["delta"].get("content") or "" for chunk in chunks for choice in chunk["choices"])


def test_a_repeated_greedy_request_is_a_hit(server: ThreadServer, api: openai.OpenAI) -> None:
    first_cache, _, first = chat(api, temperature=0)
    # `user`, `stream: false` and a deadline do not change the answer: the same entry
    second_cache, _, second = chat(
        api, temperature=0, user="someone else", stream=False, extra_body={"timeout": 30}
    )
    assert (first_cache, second_cache) == ("miss", "hit")
    assert second.choices[0].message.content == first.choices[0].message.content
    assert second.choices[0].finish_reason == first.choices[0].finish_reason
    assert second.usage.completion_tokens == first.usage.completion_tokens
    assert second.id != first.id  # a new response, the same answer
    different_cache, _, _ = chat(api, temperature=0, max_tokens=7)
    assert different_cache == "miss"
    stats = cache_stats(server)
    assert stats["enabled"] and stats["memory"]["hits"] >= 1 and stats["stores"] >= 2
    assert metric_value(server.url, "bitserve_response_cache_hits_total", tier="memory") >= 1


def test_sampled_requests_are_never_cached_but_seeded_ones_are(
    server: ThreadServer, api: openai.OpenAI
) -> None:
    before = cache_stats(server)
    for _ in range(2):
        status, _, _ = chat(api, temperature=1.0)
        assert status is None  # not looked up: a sampled answer is not a function of the request
    after = cache_stats(server)
    assert (after["misses"], after["hits"], after["stores"]) == (
        before["misses"],
        before["hits"],
        before["stores"],
    )
    seeded = [chat(api, temperature=1.0, seed=1234) for _ in range(2)]
    assert [status for status, _, _ in seeded] == ["miss", "hit"]
    assert seeded[0][2].choices[0].message.content == seeded[1][2].choices[0].message.content
    assert chat(api, temperature=1.0, seed=1235)[0] == "miss"


def test_a_stream_replays_a_stored_answer_and_the_reverse(server: ThreadServer, api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Name a colour."}]
    status, _, whole = chat(api, temperature=0, messages=messages)
    assert status == "miss"
    replay_status, chunks, is_done = sse_chat(
        server, {"messages": messages, "temperature": 0, "stream_options": {"include_usage": True}}
    )
    assert replay_status == "hit" and is_done
    assert chunks[0]["choices"][0]["delta"] == {"role": "assistant", "content": ""}
    assert all(chunk["object"] == "chat.completion.chunk" for chunk in chunks)
    assert streamed_text(chunks) == whole.choices[0].message.content
    assert (
        chunks[-1]["choices"] == []
        and chunks[-1]["usage"]["completion_tokens"] == whole.usage.completion_tokens
    )
    # the official client reads the replayed stream like a generated one
    raw = api.chat.completions.with_raw_response.create(
        model=ALIAS, messages=messages, max_tokens=8, temperature=0, stream=True
    )
    assert raw.headers["x-cache"] == "hit"
    text = "".join(chunk.choices[0].delta.content or "" for chunk in raw.parse() if chunk.choices)
    assert text == whole.choices[0].message.content
    # a streamed answer serves a later whole-body request
    other = [{"role": "user", "content": "Name a fruit."}]
    streamed_status, streamed, _ = sse_chat(server, {"messages": other, "temperature": 0})
    status, _, replayed = chat(api, temperature=0, messages=other)
    assert (streamed_status, status) == ("miss", "hit")
    assert replayed.choices[0].message.content == streamed_text(streamed)


WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "properties": {"city": {"enum": ["Rome", "Paris"]}},  # short: the call always closes
            "required": ["city"],
        },
    },
}


def test_a_cached_tool_call_replays_as_tool_calls(server: ThreadServer, api: openai.OpenAI) -> None:
    """A stored tool-call answer goes back through the tool-call formatter: a plain hit carries the same
    tool_calls, and a streamed hit sends them as tool-call deltas, not as text."""
    request = {
        "messages": [{"role": "user", "content": "Weather in Rome?"}],
        "tools": [WEATHER_TOOL],
        "tool_choice": "required",
        "parallel_tool_calls": False,
        "temperature": 0,
        "max_tokens": 60,
    }
    first_cache, _, first = chat(api, **dict(request))
    second_cache, _, second = chat(api, **dict(request))
    assert (first_cache, second_cache) == ("miss", "hit")
    assert first.choices[0].message.tool_calls, first.choices[0].message.content
    calls = [(c.function.name, json.loads(c.function.arguments)) for c in first.choices[0].message.tool_calls]
    assert calls and calls == [
        (c.function.name, json.loads(c.function.arguments)) for c in second.choices[0].message.tool_calls
    ]
    assert second.choices[0].finish_reason == "tool_calls" and second.choices[0].message.content is None
    body = {key: value for key, value in request.items() if key != "messages"}
    stream_cache, chunks, is_done = sse_chat(server, {**body, "messages": request["messages"]})
    assert stream_cache == "hit" and is_done and streamed_text(chunks) == ""
    arguments = "".join(
        call["function"].get("arguments") or ""
        for chunk in chunks
        for choice in chunk["choices"]
        for call in choice["delta"].get("tool_calls") or []
    )
    assert json.loads(arguments) == calls[0][1]
    assert chunks[-1]["choices"][0]["finish_reason"] == "tool_calls" or any(
        choice.get("finish_reason") == "tool_calls" for chunk in chunks for choice in chunk["choices"]
    )


def test_completions_and_the_native_api_are_cached(server: ThreadServer, api: openai.OpenAI) -> None:
    raws = [
        api.completions.with_raw_response.create(model=ALIAS, prompt="Once upon", max_tokens=6, temperature=0)
        for _ in range(2)
    ]
    assert [raw.headers["x-cache"] for raw in raws] == ["miss", "hit"]
    assert raws[0].parse().choices[0].text == raws[1].parse().choices[0].text
    body = {"model": ALIAS, "prompt": "Once upon", "max_tokens": 6, "temperature": 0}
    native = [httpx.post(f"{server.url}/v1/inference", json=body, timeout=60.0) for _ in range(2)]
    assert [response.headers["x-cache"] for response in native] == ["miss", "hit"]
    assert native[0].json()["choices"][0]["token_ids"] == native[1].json()["choices"][0]["token_ids"]


def test_an_expired_answer_is_generated_again(server: ThreadServer, api: openai.OpenAI) -> None:
    messages = [{"role": "user", "content": "Count to three."}]
    assert chat(api, temperature=0, messages=messages)[0] == "miss"
    assert chat(api, temperature=0, messages=messages)[0] == "hit"
    cache = server.state.response_cache
    expired_before, real_clock = cache.expired, cache.clock
    cache.clock = lambda: real_clock() + cache.ttl_s + 1.0
    try:
        assert chat(api, temperature=0, messages=messages)[0] == "miss"
    finally:
        cache.clock = real_clock
    assert cache.expired == expired_before + 1
    assert chat(api, temperature=0, messages=messages)[0] == "hit"  # stored again


def test_an_answer_cut_short_is_not_stored(server: ThreadServer, api: openai.OpenAI) -> None:
    """A deadline that passes mid-generation (504, or an error event when streaming) stores nothing:
    the same request without a deadline (not part of the key) is generated, then cached."""
    messages = [{"role": "user", "content": "Tell me a long story."}]
    options: dict[str, Any] = {"temperature": 0, "messages": messages, "max_tokens": 200}
    body = {"model": ALIAS, **options, "ignore_eos": True}
    with pytest.raises(openai.APIStatusError) as expired:
        chat(api, **options, extra_body={"ignore_eos": True, "timeout": 0.001})
    assert expired.value.status_code == 504
    status, chunks, is_done = sse_chat(server, {**body, "timeout": 0.001})
    assert status == "miss" and is_done and "error" in chunks[-1]
    assert chat(api, **options, extra_body={"ignore_eos": True})[0] == "miss"
    assert chat(api, **options, extra_body={"ignore_eos": True})[0] == "hit"


def test_a_swap_never_serves_the_old_versions_answers(
    server: ThreadServer, api: openai.OpenAI, chat_root: ModelRoot
) -> None:
    v1, v2 = version_of(chat_root.files["v1"]), version_of(chat_root.files["v2"])
    status, version, _ = chat(api, temperature=0)  # stored by the first test
    assert (status, version) == ("hit", v1)
    assert admin(server.url, f"/v1/models/{ALIAS}/swap", {"model": "v2", "wait": True}).status_code == 200
    status, version, _ = chat(api, temperature=0)
    assert (status, version) == ("miss", v2)
    assert admin(server.url, f"/v1/models/{ALIAS}/rollback", {"wait": True}).status_code == 200
    status, version, _ = chat(api, temperature=0)
    assert (status, version) == ("hit", v1)  # v1's own answer again


def test_the_disk_tier_survives_a_restart(
    server: ThreadServer, chat_root: ModelRoot, cache_dir: Path
) -> None:
    """Runs last in the module: the answers the tests above stored are on disk; a new server over the
    same folder answers from it."""
    request = {"model": ALIAS, "messages": MESSAGES, "max_tokens": 8, "temperature": 0}
    before = httpx.post(f"{server.url}/v1/chat/completions", json=request, timeout=60.0)
    assert before.headers["x-cache"] == "hit"
    server.stop()  # the lifespan flushes the background disk writes
    assert list(cache_dir.glob("??/*.zlib"))
    with lifecycle_server(chat_root, response_cache=True, response_cache_dir=str(cache_dir)) as restarted:
        after = httpx.post(f"{restarted.url}/v1/chat/completions", json=request, timeout=60.0)
        assert after.headers["x-cache"] == "hit"
        assert after.json()["choices"][0]["message"] == before.json()["choices"][0]["message"]
        stats = cache_stats(restarted)
        assert stats["disk"]["hits"] == 1 and stats["memory"]["hits"] == 0 and stats["disk"]["entries"] >= 1
        assert metric_value(restarted.url, "bitserve_response_cache_hits_total", tier="disk") == 1


def test_the_cache_is_off_by_default(chat_root: ModelRoot) -> None:
    with lifecycle_server(chat_root) as plain:
        request = {"model": ALIAS, "prompt": "Hi", "max_tokens": 2, "temperature": 0}
        response = httpx.post(f"{plain.url}/v1/completions", json=request, timeout=60.0)
        assert response.status_code == 200 and "x-cache" not in response.headers
        assert cache_stats(plain) == {"enabled": False}
        assert "bitserve_response_cache" not in httpx.get(f"{plain.url}/metrics", timeout=10.0).text


def test_json_of_a_stored_entry_is_compressed_on_disk(cache_dir: Path) -> None:
    """Read after the restart test: every file is the header then zlib data, not plain JSON."""
    import zlib

    files = list(cache_dir.glob("??/*.zlib"))
    assert files
    for path in files:
        raw = path.read_bytes()
        assert raw.startswith(b"BSRC1")
        assert json.loads(zlib.decompress(raw[13:]))["format"] == 1
