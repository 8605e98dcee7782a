"""The response cache's parts without a server: what the key covers, the byte budgets (memory LRU and
disk), the TTL, damaged disk entries, and that only complete answers are kept."""

from __future__ import annotations

import asyncio
import dataclasses
import random
from pathlib import Path
from typing import Any

import pytest

from bitserve.config import ServerConfig
from bitserve.lifecycle.slot import SlotInfo
from bitserve.outputs import CompletionOutput, RequestOutput
from bitserve.server.protocol import ChatCompletionRequest, CompletionRequest
from bitserve.server.response_cache.cache import ResponseCache
from bitserve.server.response_cache.entry import CachedCompletion
from bitserve.server.response_cache.key import cache_key, is_deterministic
from bitserve.server.response_cache.streams import RecordingStream
from bitserve.server.response_cache.tiers import ENTRY_OVERHEAD_BYTES, DiskTier, MemoryTier, Stored

INFO = SlotInfo(
    id="m",
    version="aaaaaaaaaaaa",
    file_name="m.gguf",
    architecture="llama",
    backend="cpu",
    devices=("cpu",),
    tensor_types={},
    max_model_len=128,
    vocab_size=100,
    has_chat_template=True,
    memory_bytes=0,
    host_memory_bytes=0,
    created=0,
)


def chat_body(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "hi"}], **fields})


def entry(text: str = "hello", finish_reason: str = "stop") -> CachedCompletion:
    output = CompletionOutput(0, text, [1, 2, 3], finish_reason, None, None)
    result = RequestOutput("r", [5, 6], [output], True)
    cached = CachedCompletion.of([[5, 6]], result)
    assert cached is not None
    return cached


def test_the_key_covers_what_shapes_the_answer_and_nothing_else() -> None:
    base = cache_key("chatcmpl", chat_body(temperature=0), INFO)
    same = (
        chat_body(temperature=0, stream=True, stream_options={"include_usage": True}),
        chat_body(temperature=0, user="u", timeout=5.0, priority="high", unknown_field=1),
        chat_body(temperature=0, model="m", n=1),  # the served alias, and a default written out
    )
    assert all(cache_key("chatcmpl", body, INFO) == base for body in same)
    different = [
        cache_key("chatcmpl", chat_body(temperature=0, max_tokens=3), INFO),
        cache_key("chatcmpl", chat_body(temperature=0, stop=["x"]), INFO),
        cache_key("chatcmpl", chat_body(messages=[{"role": "user", "content": "ho"}], temperature=0), INFO),
        cache_key("cmpl", CompletionRequest.model_validate({"prompt": "hi", "temperature": 0}), INFO),
        cache_key("chatcmpl", chat_body(temperature=0), _replaced(INFO, version="bbbbbbbbbbbb")),
        cache_key("chatcmpl", chat_body(temperature=0), _replaced(INFO, devices=("cuda:0",))),
    ]
    assert base not in different and len(set(different)) == len(different)


def _replaced(info: SlotInfo, **changes: Any) -> SlotInfo:
    return dataclasses.replace(info, **changes)


def test_only_greedy_or_seeded_requests_are_deterministic() -> None:
    assert is_deterministic(chat_body(temperature=0).to_sampling_params())
    assert is_deterministic(chat_body(temperature=0.8, seed=3).to_sampling_params())
    assert is_deterministic(chat_body(temperature=0.8, top_k=1).to_sampling_params())
    assert not is_deterministic(chat_body(temperature=0.8).to_sampling_params())
    assert not is_deterministic(chat_body().to_sampling_params())  # the default temperature samples


def test_memory_tier_evicts_least_recent_over_its_byte_budget() -> None:
    size = 100 + ENTRY_OVERHEAD_BYTES
    tier = MemoryTier(budget_bytes=3 * size)
    for key in "abc":
        tier.put(key, Stored(0.0, b"x" * 100))
    assert tier.get("a") is not None  # a is now the most recent; b the least
    tier.put("d", Stored(0.0, b"x" * 100))
    assert tier.get("b") is None and all(tier.get(key) is not None for key in "acd")
    assert (tier.num_bytes, tier.num_evictions, len(tier)) == (3 * size, 1, 3)
    tier.put("huge", Stored(0.0, b"x" * 4 * size))  # over the whole budget: not kept, nothing evicted
    assert tier.get("huge") is None and len(tier) == 3


def test_disk_tier_budget_atomic_files_and_damaged_entries(tmp_path: Path) -> None:
    tier = DiskTier(tmp_path, budget_bytes=10_000)
    data = random.Random(0).randbytes(2048)  # incompressible: each file is ~2 KiB
    for index in range(12):
        tier.put(f"{index:064x}", Stored(1.0, data + bytes([index])))
    assert tier.num_bytes <= 10_000 and tier.num_evictions > 0
    assert tier.get(f"{0:064x}") is None and tier.get(f"{11:064x}") == Stored(1.0, data + bytes([11]))
    assert not list(tmp_path.rglob("*.tmp"))
    reopened = DiskTier(tmp_path, budget_bytes=10_000)  # a restart indexes what is there
    assert len(reopened) == len(tier) and reopened.get(f"{11:064x}") is not None
    damaged = next(iter(tmp_path.glob("??/*.zlib")))
    damaged.write_bytes(b"BSRC1" + b"\0" * 8 + b"not zlib")
    assert reopened.get(damaged.name.removesuffix(".zlib")) is None
    assert reopened.num_corrupt == 1 and not damaged.exists()


def test_ttl_expires_entries_in_both_tiers(tmp_path: Path) -> None:
    async def scenario() -> None:
        now = [1000.0]
        cache = ResponseCache(
            1 << 20, ttl_s=10.0, directory=str(tmp_path), disk_bytes=1 << 20, clock=lambda: now[0]
        )
        cache.put("k" * 64, entry())
        await cache.flush()
        now[0] += 9.0
        assert (await cache.get("k" * 64)) is not None
        cache.memory.remove("k" * 64)  # the disk copy alone, as after a restart
        now[0] += 1.5
        assert await cache.get("k" * 64) is None
        assert (cache.expired, cache.misses, cache.hits) == (1, 1, {"memory": 1, "disk": 0})
        assert cache.disk is not None and len(cache.disk) == 0

    asyncio.run(scenario())


def test_only_complete_answers_are_kept() -> None:
    aborted = RequestOutput("r", [1], [CompletionOutput(0, "par", [1], "abort")], True)
    unfinished = RequestOutput("r", [1], [CompletionOutput(0, "par", [1], None)], False)
    assert CachedCompletion.of([[1]], aborted) is None and CachedCompletion.of([[1]], unfinished) is None
    stored = entry("a whole answer", "length")
    assert CachedCompletion.from_bytes(stored.to_bytes()) == stored
    with pytest.raises(ValueError):
        CachedCompletion.from_bytes(stored.to_bytes().replace(b'"length"', b'"abort"'))


class FailingStream:
    """Two outputs, then the request's error (a replica death mid-answer)."""

    request_id = "r"
    on_close = None

    def __init__(self) -> None:
        self.outputs = [RequestOutput("r", [1], [CompletionOutput(0, "a", [1])], False)]

    async def next(self, timeout: float | None = None) -> RequestOutput | None:
        if self.outputs:
            return self.outputs.pop()
        raise RuntimeError("engine died")

    def empty_result(self) -> RequestOutput:
        return RequestOutput("r", [1], [CompletionOutput(0)], False)

    def close(self) -> None:
        return None


def test_a_failed_generation_is_not_recorded() -> None:
    recorded: list[RequestOutput] = []
    stream = RecordingStream(FailingStream(), recorded.append)  # type: ignore[arg-type]

    async def read() -> None:
        with pytest.raises(RuntimeError):
            await stream.collect()

    asyncio.run(read())
    assert recorded == []


def test_the_disk_tier_needs_the_cache_on() -> None:
    with pytest.raises(ValueError, match="response_cache_dir needs response_cache"):
        ServerConfig(response_cache_dir="/tmp/x")
    assert ResponseCache.from_config(ServerConfig()) is None
