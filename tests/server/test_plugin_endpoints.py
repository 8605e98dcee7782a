"""The plugin hooks run for every endpoint because they live in the shared pipeline: the Marker plugin
(plugin_testing.py) rewrites each request to 3 tokens and replaces each choice's output with a marker,
and completions (one prompt or a batch), the native API and the WebSocket show both, streamed or whole.
(Chat and Anthropic messages need a chat template: test_plugins_blackbox.py covers them on SmolLM2.)"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import pytest
from conftest import IN_PROCESS_SERVER
from fastapi.testclient import TestClient
from http_testing import parse_stream
from plugin_testing import MAX_TOKENS

from bitserve.server.plugins.config import PluginConfig

PROMPT = "The quick brown fox"


@pytest.fixture(scope="module")
def marked(synthetic_instance: object) -> Iterator[TestClient]:
    from bitserve.server.app import build_app

    plugins = PluginConfig(plugins="plugin_testing:Marker")
    with TestClient(build_app(IN_PROCESS_SERVER, instance=synthetic_instance, plugins=plugins)) as client:  # type: ignore[arg-type]
        yield client


def streamed(client: TestClient, path: str, body: dict[str, Any]) -> list[dict[str, Any]]:
    with client.stream("POST", path, json={**body, "stream": True}) as response:
        assert response.status_code == 200, response.read()
        chunks, is_done = parse_stream(list(response.iter_lines()))
    assert is_done
    return chunks


def test_whole_answers_are_rewritten_per_choice(marked: TestClient) -> None:
    for path, body, marker, num_choices in (
        ("/v1/completions", {"prompt": PROMPT}, "<cmpl:", 1),
        ("/v1/completions", {"prompt": [PROMPT, "Once upon a time"], "n": 2}, "<cmpl:", 4),
        ("/v1/inference", {"prompt": PROMPT}, "<inf:", 1),
    ):
        response = marked.post(path, json={**body, "max_tokens": 20})
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert len(choices) == num_choices
        assert all(choice["text"].startswith(marker) for choice in choices), choices
        # the rewrite took effect: 3 tokens a choice
        assert response.json()["usage"]["completion_tokens"] == MAX_TOKENS * len(choices)


def test_streams_are_rewritten_per_choice(marked: TestClient) -> None:
    chunks = streamed(marked, "/v1/completions", {"prompt": [PROMPT, "Once upon a time"]})
    texts: dict[int, str] = {}
    for chunk in chunks:
        for choice in chunk["choices"]:
            texts[choice["index"]] = texts.get(choice["index"], "") + choice["text"]
    assert sorted(texts) == [0, 1] and all(text.startswith("<cmpl:") for text in texts.values())
    chunks = streamed(marked, "/v1/inference/stream", {"prompt": PROMPT})
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]).startswith("<inf:")


def test_the_websocket_is_rewritten(marked: TestClient) -> None:
    with marked.websocket_connect("/v1/ws") as socket:
        socket.send_text(json.dumps({"type": "completions", "id": "r1", "body": {"prompt": PROMPT}}))
        messages = [json.loads(socket.receive_text())]
        while messages[-1]["type"] != "done":
            messages.append(json.loads(socket.receive_text()))
    chunks = [m["data"] for m in messages if m["type"] == "chunk"]
    assert "".join(ch["text"] for c in chunks for ch in c["choices"]).startswith("<cmpl:"), messages
