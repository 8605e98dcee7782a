"""Start-up of the built CPU image, as a pod starts it (read-only root, a tmpfs at /tmp, host network, an
API key): seconds from `docker run` to /health/ready 200, the longest silence in its start-up log, the
container's RSS once it answered, the image's size, and its answer to the first question users ask.

    bash scripts/build_image.sh          # prints the tag
    python benchmarks/bench_image_start.py --image bitserve:0.1.0 --runs 3

Each run is a fresh container (an empty tmpfs: nothing survives from the run before), so every run is a
first start. .ci/run prints this table after it builds the image.
"""

from __future__ import annotations

import argparse
import secrets
import shutil
import subprocess
import sys
import time

import httpx
from bench_serve_rss import free_port

from bitserve.loader.catalog import DEFAULT_MODEL
from bitserve.testing.container import running_image

QUESTION = "What is the capital of France?"


def first_answer(base_url: str, api_key: str | None = None) -> str:
    """The server's greedy answer to QUESTION (24 tokens at most)."""
    body = {
        "model": DEFAULT_MODEL,
        "messages": [{"role": "user", "content": QUESTION}],
        "temperature": 0,
        "max_tokens": 24,
    }
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    response = httpx.post(f"{base_url}/v1/chat/completions", json=body, headers=headers, timeout=120)
    response.raise_for_status()
    return response.json()["choices"][0]["message"]["content"]


def one_run(docker: str, image: str) -> dict[str, object]:
    with running_image(docker, image, free_port(), secrets.token_urlsafe(24)) as container:
        ready_s = container.wait_ready()
        started = time.monotonic()
        answer = first_answer(container.base_url, container.api_key)
        return {
            "ready_s": ready_s,
            "first_answer_s": time.monotonic() - started,
            "silence_s": container.longest_log_silence_s(),
            "rss_mb": container.rss_bytes() / 1e6,
            "answer": answer,
        }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--image", required=True, help="the tag scripts/build_image.sh printed")
    parser.add_argument("--runs", type=int, default=3, help="fresh containers started one after another")
    args = parser.parse_args()
    docker = shutil.which("docker")
    if docker is None:
        sys.exit("docker is not on PATH")
    size = subprocess.run(
        [docker, "image", "inspect", "-f", "{{.Size}}", args.image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    out = sys.stdout
    out.write(f"image {args.image}: {int(size) / 1e9:.2f} GB\n\n")
    out.write("| run | docker run to ready | longest log silence | first answer | RSS after it | answer |\n")
    out.write("| ---: | ---: | ---: | ---: | ---: | --- |\n")
    for index in range(args.runs):
        row = one_run(docker, args.image)
        out.write(
            f"| {index + 1} | {row['ready_s']:.1f} s | {row['silence_s']:.1f} s"
            f" | {row['first_answer_s']:.2f} s | {row['rss_mb']:.0f} MB | {str(row['answer'])!r} |\n"
        )
        out.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
