"""Response-cache latency of a running `bitserve serve --response-cache`: one greedy chat request
generated (a miss), then the same request answered from the cache, whole and streamed.

    bitserve serve --port 8012 --response-cache &
    python benchmarks/bench_response_cache.py --url http://127.0.0.1:8012 --max-tokens 64

Uses the official `openai` client (its own overhead is in every number). The first request must be a
miss: restart the server, or change --prompt, between runs. Timings are whatever the machine gives.
"""

from __future__ import annotations

import argparse
import statistics
import time
from typing import Any

import httpx
import openai


def timed_chat(api: openai.OpenAI, request: dict[str, Any]) -> tuple[float, str | None, Any]:
    started = time.perf_counter()
    raw = api.chat.completions.with_raw_response.create(**request)
    completion = raw.parse()
    return time.perf_counter() - started, raw.headers.get("x-cache"), completion


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--prompt", default="Write a short paragraph about the sea.")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--hits", type=int, default=20, help="cached requests to time")
    args = parser.parse_args()
    request = {
        "model": args.model,
        "messages": [{"role": "user", "content": args.prompt}],
        "max_tokens": args.max_tokens,
        "temperature": 0,
    }
    with openai.OpenAI(base_url=f"{args.url}/v1", api_key="unused", max_retries=0, timeout=600) as api:
        miss_s, miss_status, generated = timed_chat(api, request)
        hits = [timed_chat(api, request) for _ in range(args.hits)]
        started = time.perf_counter()
        chunks = list(api.chat.completions.create(**request, stream=True))
        stream_s = time.perf_counter() - started
    text = generated.choices[0].message.content
    assert miss_status == "miss", "the first request was already cached: restart the server"
    assert all(status == "hit" and hit.choices[0].message.content == text for _, status, hit in hits)
    hit_s = [seconds for seconds, _, _ in hits]
    print("| request | latency |")
    print("| --- | ---: |")
    print(f"| miss: generated, {generated.usage.completion_tokens} tokens | {miss_s * 1000:,.0f} ms |")
    print(
        f"| hit, whole body (median of {len(hit_s)}; max) | {statistics.median(hit_s) * 1000:.1f} ms "
        f"({max(hit_s) * 1000:.1f} ms) |"
    )
    print(f"| hit, streamed ({len(chunks)} chunks, to [DONE]) | {stream_s * 1000:.1f} ms |")
    print(httpx.get(f"{args.url}/v1/stats", timeout=10).json()["response_cache"])


if __name__ == "__main__":
    main()
