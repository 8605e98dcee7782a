"""The OpenAI API over a SmolLM2 replica with `speculative="ngram"`: chat completions, plain and
streamed, give plain decoding's text and token counts (stop strings included), and /metrics counts the
drafts."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import IN_PROCESS_SERVER
from fastapi.testclient import TestClient
from http_testing import parse_stream

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams

MESSAGES = [
    {
        "role": "user",
        "content": "Repeat the following text exactly: The museum opens at ten and closes at five. "
        "Children under twelve enter for free on Sundays.",
    }
]


@pytest.fixture(scope="module")
def spec_client(smollm2_path: Path) -> Iterator[TestClient]:
    from bitserve.engine.instance import ModelInstance
    from bitserve.server.app import build_app

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(smollm2_path)), scheduler=SchedulerConfig(speculative="ngram")
        )
    )
    app = build_app(IN_PROCESS_SERVER, instance=instance)
    with TestClient(app) as client:
        yield client
    instance.close()


@pytest.fixture(scope="module")
def plain(smollm2_path: Path) -> Iterator[LLM]:
    llm = LLM(str(smollm2_path))
    yield llm
    llm.close()


def model_id(client: TestClient) -> str:
    return client.get("/v1/models").json()["data"][0]["id"]


@pytest.mark.parametrize("stop", [None, ["under twelve"]])
def test_chat_completions_equal_plain_decoding(
    spec_client: TestClient, plain: LLM, stop: list[str] | None
) -> None:
    params = SamplingParams(max_tokens=40, temperature=0, stop=stop or ())
    expected = plain.chat(MESSAGES, params)[0].outputs[0]
    assert expected.finish_reason == "stop"  # EOS, or the stop string inside the copied text
    assert not stop or "under twelve" not in expected.text and expected.stop_reason == "under twelve"
    body = {"model": model_id(spec_client), "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    if stop:
        body["stop"] = stop
    response = spec_client.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    reply = response.json()
    assert reply["choices"][0]["message"]["content"] == expected.text
    assert reply["usage"]["completion_tokens"] == len(expected.token_ids)
    assert reply["choices"][0]["finish_reason"] == expected.finish_reason
    with spec_client.stream("POST", "/v1/chat/completions", json={**body, "stream": True}) as streamed:
        chunks, is_done = parse_stream(list(streamed.iter_lines()))
    assert is_done
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c.get("choices"))
    assert text == expected.text


def test_metrics_count_the_drafts(spec_client: TestClient) -> None:
    body = {"model": model_id(spec_client), "messages": MESSAGES, "max_tokens": 24, "temperature": 0}
    assert spec_client.post("/v1/chat/completions", json=body).status_code == 200
    metrics = spec_client.get("/metrics").text
    values = {}
    for name in ("draft", "accepted"):
        match = re.search(
            rf"^bitserve_spec_decode_{name}_tokens_total\{{[^}}]*\}} ([0-9.e+]+)$", metrics, re.M
        )
        assert match, name
        values[name] = float(match.group(1))
    assert 0 < values["accepted"] <= values["draft"]
