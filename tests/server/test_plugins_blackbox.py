"""Black box: `bitserve serve` (embedded SmolLM2) with the content filter and a test plugin found through
a dist-info entry point on a temporary sys.path, over real sockets: a banned phrase SmolLM2 produces at
temperature 0 never appears in the streamed deltas and the stream ends with [DONE]; a banned prompt gets
400; a plugin that raises (or runs past its budget) fails that request with 500 naming it, before or
during a stream, and the next request is served."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import httpx
import openai
import pytest
from http_testing import ServerProcess, parse_stream

MODEL = "smollm2-135m-instruct"
# SmolLM2's greedy answer (measured): "The sea is a vast, unforgiving, and unforgiving, a place where the
# boundaries of humanity are constantly shifting, and the very fabric of reality is woven with ..."
MESSAGES = [{"role": "user", "content": "Write one short sentence about the sea."}]
PHRASE = "vast, unforgiving"  # several tokens: " vast", ",", " un", "for", "giving" arrive as deltas
RULES = f"{PHRASE}\nre:fabric of \\w+\nforbidden topic\n"
REDACTION = "[redacted]"
PLUGIN_MODULE = '''
import asyncio
from bitserve.server.plugins.base import Plugin


class Raising:
    def feed(self, text):
        raise RuntimeError("the stream hook broke")

    def flush(self):
        return ""


class Exploding(Plugin):
    """Fails as the request's `user` field asks: in pre_inference, mid-stream, or by being slow."""

    def pre_inference(self, context):
        if context.body.user == "explode":
            raise ZeroDivisionError("the pre-inference hook broke")
        if context.body.user == "slow":
            return asyncio.sleep(30)
        return None

    def stream_filter(self, context):
        return Raising() if context.request.body.user == "explode-stream" else None
'''


def install_test_plugin(root: Path) -> None:
    """A distribution with one `bitserve.plugins` entry point, as pip would leave it."""
    (root / "exploding_plugin.py").write_text(PLUGIN_MODULE, encoding="utf-8")
    dist_info = root / "bitserve_test_plugins-0.1.dist-info"
    dist_info.mkdir()
    (dist_info / "METADATA").write_text(
        "Metadata-Version: 2.1\nName: bitserve-test-plugins\nVersion: 0.1\n", encoding="utf-8"
    )
    (dist_info / "entry_points.txt").write_text(
        "[bitserve.plugins]\nexploding = exploding_plugin:Exploding\n", encoding="utf-8"
    )


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[ServerProcess]:
    root = tmp_path_factory.mktemp("plugins")
    install_test_plugin(root)
    rules = root / "rules.txt"
    rules.write_text(RULES, encoding="utf-8")
    path = os.pathsep.join(part for part in (str(root), os.environ.get("PYTHONPATH", "")) if part)
    process = ServerProcess(
        root / "server.log",
        *("--plugin", "exploding", "--plugin", "content_filter", "--content-filter-rules", str(rules)),
        *("--content-filter-max-match-chars", "32", "--plugin-timeout-s", "0.5", "--no-warmup"),
        env={"PYTHONPATH": path},
    )
    try:
        process.wait_ready()
        yield process
    finally:
        process.stop()


@pytest.fixture(scope="module")
def client(server: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as api:
        yield api


def chat(client: openai.OpenAI, max_tokens: int = 40, **extra: object) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=max_tokens, temperature=0, **extra
    )


def test_a_banned_phrase_never_appears_in_the_streamed_deltas(
    client: openai.OpenAI, server: ServerProcess
) -> None:
    deltas = [
        chunk.choices[0].delta.content or ""
        for chunk in client.chat.completions.create(
            model=MODEL, messages=MESSAGES, max_tokens=40, temperature=0, stream=True
        )
        if chunk.choices
    ]
    text = "".join(deltas)
    # the model did produce the phrase (its place is marked), and the regex rule's match too
    assert text.startswith(f"The sea is a {REDACTION}, and unforgiving"), text
    assert PHRASE not in text.lower() and "fabric of reality" not in text
    assert text.count(REDACTION) == 2 and len([d for d in deltas if d]) > 5  # streamed, not in one piece
    assert chat(client).choices[0].message.content == text  # the whole answer gets the same redaction
    message = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0}
    anthropic = httpx.post(f"{server.url}/v1/messages", json=message, timeout=120.0)
    assert (
        anthropic.status_code == 200 and anthropic.json()["content"][0]["text"] == text
    )  # the same pipeline
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 40, "temperature": 0, "stream": True}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120.0) as response:
        chunks, is_done = parse_stream(list(response.iter_lines()))
    assert is_done and not any("error" in chunk for chunk in chunks)


def test_a_banned_prompt_gets_400(client: openai.OpenAI) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        client.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "Tell me about the Forbidden Topic"}],
            max_tokens=4,
        )
    error = refused.value.body
    assert refused.value.status_code == 400 and error["code"] == "request_refused"
    assert "blocked phrase" in error["message"] and "forbidden" not in error["message"].lower()


def test_a_plugin_that_raises_fails_only_its_request(client: openai.OpenAI, server: ServerProcess) -> None:
    for user, what in (("explode", "ZeroDivisionError"), ("slow", "budget")):
        with pytest.raises(openai.InternalServerError) as failed:
            chat(client, max_tokens=4, user=user)
        assert failed.value.status_code == 500 and failed.value.body["code"] == "plugin_error"
        assert "'exploding'" in failed.value.body["message"] and what in failed.value.body["message"]
        assert chat(client, max_tokens=4).choices[0].message.content  # the next request is served
    assert "plugin exploding failed in pre_inference" in server.log_tail(20000)
    metrics = httpx.get(f"{server.url}/metrics", timeout=30.0).text
    for outcome in ("error", "timeout"):
        assert f'bitserve_plugin_events_total{{outcome="{outcome}",plugin="exploding"}}' in metrics


def test_a_stream_hook_that_raises_ends_that_stream_with_an_error_event(server: ServerProcess) -> None:
    body = {"model": MODEL, "messages": MESSAGES, "max_tokens": 8, "stream": True, "user": "explode-stream"}
    with httpx.stream("POST", f"{server.url}/v1/chat/completions", json=body, timeout=120.0) as response:
        assert response.status_code == 200  # the hook ran after the headers went out
        chunks, is_done = parse_stream(list(response.iter_lines()))
    assert is_done and chunks[-1]["error"]["code"] == "plugin_error"
    assert "'exploding'" in chunks[-1]["error"]["message"]
    native = httpx.post(
        f"{server.url}/v1/inference", json={"prompt": "Hello", "max_tokens": 4}, timeout=120.0
    )
    assert native.status_code == 200 and native.json()["choices"][0]["text"]
