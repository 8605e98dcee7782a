"""Batch API cost to interactive traffic, against a running `bitserve serve`: the latency of sequential
interactive chat requests alone, then while a batch runs (the batch's throughput too). Batch requests
are admitted at low priority but share the engine's steps with interactive ones once running; this
measures what that costs at the server's --batch-concurrency.

    bitserve serve --batch-db /tmp/b.sqlite3 &
    python benchmarks/bench_batch.py --url http://127.0.0.1:8000 --num-requests 48 --max-tokens 32
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

import openai

PROMPT = "Name three rivers."


def interactive_latency_s(client: openai.OpenAI, model: str, max_tokens: int) -> float:
    started = time.perf_counter()
    client.chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": PROMPT}],
        max_tokens=max_tokens,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    return time.perf_counter() - started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--num-requests", type=int, default=48, help="requests in the batch")
    parser.add_argument("--max-tokens", type=int, default=32, help="tokens per batch request")
    parser.add_argument("--interactive-tokens", type=int, default=16)
    parser.add_argument("--samples", type=int, default=10, help="interactive requests per phase")
    args = parser.parse_args()
    client = openai.OpenAI(base_url=f"{args.url}/v1", api_key=os.environ.get("BITSERVE_API_KEY", "unused"))
    for _ in range(3):  # warm
        interactive_latency_s(client, args.model, args.interactive_tokens)
    alone = [interactive_latency_s(client, args.model, args.interactive_tokens) for _ in range(args.samples)]
    lines = [
        {
            "custom_id": f"r{index}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {
                "model": args.model,
                "messages": [{"role": "user", "content": f"Write a line about river {index}."}],
                "max_tokens": args.max_tokens,
                "ignore_eos": True,
                "temperature": 0,
            },
        }
        for index in range(args.num_requests)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    file_id = client.files.create(file=("bench.jsonl", content), purpose="batch").id
    started = time.perf_counter()
    batch = client.batches.create(
        input_file_id=file_id, endpoint="/v1/chat/completions", completion_window="24h"
    )
    while client.batches.retrieve(batch.id).status == "validating":
        time.sleep(0.05)
    during: list[float] = []
    while len(during) < args.samples and client.batches.retrieve(batch.id).status == "in_progress":
        during.append(interactive_latency_s(client, args.model, args.interactive_tokens))
    while (batch := client.batches.retrieve(batch.id)).status not in (
        "completed",
        "failed",
        "expired",
        "cancelled",
    ):
        time.sleep(0.1)
    elapsed = time.perf_counter() - started
    print(f"load average {os.getloadavg()[0]:.1f}")
    print(f"interactive alone: median {statistics.median(alone):.3f} s, max {max(alone):.3f} s")
    if during:
        print(
            f"interactive during the batch ({len(during)} samples): "
            f"median {statistics.median(during):.3f} s, max {max(during):.3f} s"
        )
    print(
        f"batch {batch.status}: {batch.request_counts.completed}/{args.num_requests} requests x "
        f"{args.max_tokens} tokens in {elapsed:.1f} s = {args.num_requests / elapsed:.2f} req/s, "
        f"{args.num_requests * args.max_tokens / elapsed:.0f} tok/s (the interactive ones ran meanwhile)"
    )


if __name__ == "__main__":
    main()
