"""Black-box: `bitserve serve --device cuda` answers the official `openai` client (issue 11).

A real server process on the small bitnet-b1.58 I2_S file (CUDA decoder, decode CUDA graphs): plain and
streamed completions, concurrent streams, and the greedy tokens equal an in-process CPU reference run.
"""

from __future__ import annotations

import concurrent.futures
import sys
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "server"))

from http_testing import ServerProcess  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, b158_file: Path) -> Iterator[ServerProcess]:
    log = tmp_path_factory.mktemp("gpu-server-log") / "server.log"
    process = ServerProcess(log, "--model", str(b158_file), "--device", "cuda", "--kv-cache-dtype", "float32")
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


def client_for(server: ServerProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_completion_tokens_equal_cpu_reference(server: ServerProcess, b158_file: Path) -> None:
    from bitserve.llm import LLM
    from bitserve.sampling_params import SamplingParams

    client = client_for(server)
    model = client.models.list().data[0].id
    answer = client.completions.create(
        model=model,
        prompt="The weather today is",
        max_tokens=12,
        temperature=0,
        extra_body={"ignore_eos": True},
    )
    assert answer.usage.completion_tokens == 12
    reference = LLM(str(b158_file), backend="reference", kv_cache_dtype="float32")
    try:
        expected = (
            reference.generate(
                ["The weather today is"], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
            )[0]
            .outputs[0]
            .text
        )
    finally:
        reference.close()
    assert answer.choices[0].text == expected


def test_concurrent_streams_all_finish(server: ServerProcess) -> None:
    client = client_for(server)
    model = client.models.list().data[0].id

    def stream(index: int) -> tuple[int, str | None]:
        chunks = client.completions.create(
            model=model,
            prompt=f"Request number {index} says",
            max_tokens=20,
            temperature=0.8,
            seed=index,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
        tokens, finish = 0, None
        for chunk in chunks:
            if chunk.usage is not None:
                tokens = chunk.usage.completion_tokens
            for choice in chunk.choices:
                finish = choice.finish_reason or finish
        return tokens, finish

    with concurrent.futures.ThreadPoolExecutor(max_workers=24) as pool:
        results = list(pool.map(stream, range(24)))
    assert results == [(20, "length")] * 24
