r"""Latency of a rate-limited key's requests while the shared limiter's Redis hangs (a listener that accepts
connections and never answers: a network partition), with the circuit breaker and without it.

    python benchmarks/bench_breaker.py --num-requests 12

Starts `bitserve serve` (the embedded SmolLM2) with `--rate-limit-url` pointing at the hanging listener and
`--rate-limit-on-error open`, once with the breaker effectively off (`--breaker-failure-threshold` huge,
what every request paid before the breaker) and once with the defaults, and sends --num-requests
sequential 1-token completions with a key limited in requests and tokens a minute (so a request asks Redis
three times: admit its request, read its tokens, charge them). Prints each request's seconds
and the median of requests 7-12 (after the default breaker of 5 failures has opened). Nothing is asserted.
"""

from __future__ import annotations

import argparse
import logging
import statistics
import sys
import tempfile
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1] / "tests" / "server"
sys.path.insert(0, str(TESTS))  # the tests' server process and hanging listener
sys.path.insert(0, str(TESTS.parents[1]))  # run from a checkout without installing

import httpx  # noqa: E402
from http_testing import ServerProcess  # noqa: E402
from redis_testing import HangingServer  # noqa: E402

from bitserve.server.security.keys import hash_key  # noqa: E402

logger = logging.getLogger("bench_breaker")

MODES = {"no breaker (before)": ["--breaker-failure-threshold", "1000000"], "breaker (defaults)": []}
BODY = {"model": "smollm2-135m-instruct", "prompt": "Hello", "max_tokens": 1, "temperature": 0}
KEY = "bsk_bench_breaker_key_000000000000000"
AUTH_FILE = f"""[[keys]]
name = "bench"
hash = "{hash_key(KEY)}"
scopes = ["inference"]
requests_per_minute = 100000
tokens_per_minute = 10000000
"""


def run_mode(folder: Path, extra: list[str], num_requests: int) -> list[float]:
    hanging = HangingServer()
    auth = folder / "auth.toml"
    auth.write_text(AUTH_FILE, encoding="utf-8")
    server = ServerProcess(
        folder / "server.log",
        *("--auth-file", str(auth), "--rate-limit-url", hanging.url, "--rate-limit-on-error", "open"),
        *extra,
    )
    try:
        server.wait_ready()
        seconds = []
        with httpx.Client(base_url=server.url, timeout=60.0) as client:
            for _ in range(num_requests):
                started = time.perf_counter()
                response = client.post(
                    "/v1/completions", json=BODY, headers={"Authorization": f"Bearer {KEY}"}
                )
                seconds.append(time.perf_counter() - started)
                response.raise_for_status()
        return seconds
    finally:
        server.stop()
        hanging.stop()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--num-requests", type=int, default=12)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)
    for mode, extra in MODES.items():
        with tempfile.TemporaryDirectory() as folder:
            seconds = run_mode(Path(folder), extra, args.num_requests)
        tail = seconds[6:12]
        logger.info(
            "%s: %s; median of requests 7-12: %.3f s",
            mode,
            " ".join(f"{s:.3f}" for s in seconds),
            statistics.median(tail) if tail else float("nan"),
        )


if __name__ == "__main__":
    main()
