"""Embeddings throughput of a running `bitserve serve` (POST /v1/embeddings, the openai wire shape).

    bitserve serve --port 8011 &
    python benchmarks/bench_embeddings.py --url http://127.0.0.1:8011 --batch 1,8,32 --words 16,120

For each (batch size, input length) it sends `--requests` requests one after another (the engine
embeds one request's inputs in one pass between steps, so concurrency adds queueing, not speed) and
prints inputs/s, tokens/s and the median request latency. Inputs are distinct sentences of about
`words` words. Timings are whatever the machine gives; nothing is asserted.
"""

from __future__ import annotations

import argparse
import statistics
import time

import httpx

WORDS = "the sea is deep and the ships sail over it while the gulls call above the grey waves".split()


def sentence(index: int, num_words: int) -> str:
    return f"{index}: " + " ".join(WORDS[(index + k) % len(WORDS)] for k in range(num_words))


def run(url: str, batch: int, num_words: int, num_requests: int) -> dict[str, float]:
    latencies, num_tokens = [], 0
    with httpx.Client(base_url=url, timeout=600) as client:
        client.post("/v1/embeddings", json={"input": sentence(0, num_words)}).raise_for_status()  # warm-up
        started = time.perf_counter()
        for request in range(num_requests):
            inputs = [sentence(request * batch + i, num_words) for i in range(batch)]
            t0 = time.perf_counter()
            response = client.post("/v1/embeddings", json={"input": inputs, "encoding_format": "base64"})
            response.raise_for_status()
            latencies.append(time.perf_counter() - t0)
            num_tokens += response.json()["usage"]["prompt_tokens"]
        elapsed = time.perf_counter() - started
    return {
        "inputs_per_s": batch * num_requests / elapsed,
        "tokens_per_s": num_tokens / elapsed,
        "tokens_per_input": num_tokens / (batch * num_requests),
        "p50_s": statistics.median(latencies),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--url", default="http://127.0.0.1:8000")
    parser.add_argument("--batch", default="1,8,32", help="inputs per request, comma-separated")
    parser.add_argument("--words", default="16,120", help="words per input, comma-separated")
    parser.add_argument("--requests", type=int, default=8, help="requests per measurement")
    args = parser.parse_args()
    print("| batch | words | tokens/input | inputs/s | tokens/s | p50 request s |")
    print("| --- | --- | --- | --- | --- | --- |")
    for num_words in (int(w) for w in args.words.split(",")):
        for batch in (int(b) for b in args.batch.split(",")):
            r = run(args.url, batch, num_words, args.requests)
            print(
                f"| {batch} | {num_words} | {r['tokens_per_input']:.0f} | {r['inputs_per_s']:.1f} "
                f"| {r['tokens_per_s']:.0f} | {r['p50_s']:.3f} |"
            )


if __name__ == "__main__":
    main()
