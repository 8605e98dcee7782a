"""Per-request deadlines over real sockets (the black-box `bitserve serve` with SmolLM2): the body's
`timeout` and the `X-Request-Timeout` header on chat, completions and the native API; 504 with an
OpenAI error body, or an error event then [DONE] when streaming; the aborted-requests metric; bad
values refused at the edge; the official `openai` client's extra_body / extra_headers."""

from __future__ import annotations

import time
from collections.abc import Iterator

import httpx
import openai
import pytest
from http_testing import ServerProcess, parse_stream

MODEL = "smollm2-135m-instruct"
MESSAGES = [{"role": "user", "content": "Tell me a very long story about the sea."}]
LONG = {"max_tokens": 2000, "ignore_eos": True, "temperature": 0}  # never done within the deadlines below
ERROR_KEYS = {"message", "type", "param", "code", "hint"}


@pytest.fixture(scope="module")
def client(blackbox: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{blackbox.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as api:
        yield api


def assert_deadline_error(error: dict) -> None:
    assert set(error) == ERROR_KEYS
    assert error["code"] == "deadline_exceeded" and error["type"] == "timeout_error"
    assert error["param"] == "timeout"


def test_chat_timeout_in_body_is_a_504(client: openai.OpenAI) -> None:
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=2000,
            temperature=0,
            extra_body={"timeout": 0.5, "ignore_eos": True},
        )
    assert caught.value.status_code == 504
    assert_deadline_error(caught.value.body)  # type: ignore[arg-type]
    assert time.monotonic() - started < 10  # aborted at its deadline, not after 2000 tokens


def test_completion_header_timeout_is_a_504(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(
            model=MODEL,
            prompt="Once upon a time",
            max_tokens=2000,
            temperature=0,
            extra_body={"ignore_eos": True},
            extra_headers={"X-Request-Timeout": "0.3"},
        )
    assert caught.value.status_code == 504
    assert_deadline_error(caught.value.body)  # type: ignore[arg-type]


def test_stricter_of_header_and_body_wins(blackbox: ServerProcess) -> None:
    response = httpx.post(
        f"{blackbox.url}/v1/completions",
        json={"prompt": "Once upon a time", "timeout": 3600, **LONG},
        headers={"X-Request-Timeout": "0.3"},
        timeout=60,
    )
    assert response.status_code == 504, response.text
    assert_deadline_error(response.json()["error"])


def test_a_generous_deadline_changes_nothing(client: openai.OpenAI) -> None:
    plain = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=6, temperature=0)
    timed = client.completions.create(
        model=MODEL, prompt="The sea is", max_tokens=6, temperature=0, extra_body={"timeout": 600}
    )
    assert timed.choices[0].text == plain.choices[0].text
    assert timed.choices[0].finish_reason == "length"


def test_streaming_deadline_ends_with_an_error_event(blackbox: ServerProcess, client: openai.OpenAI) -> None:
    with httpx.stream(
        "POST",
        f"{blackbox.url}/v1/chat/completions",
        json={"messages": MESSAGES, "stream": True, "timeout": 1.5, **LONG},
        timeout=60,
    ) as response:
        assert response.status_code == 200
        chunks, is_done = parse_stream(list(response.iter_lines()))
    assert is_done
    assert "error" in chunks[-1]
    assert_deadline_error(chunks[-1]["error"])
    assert any(chunk.get("choices") and chunk["choices"][0]["delta"].get("content") for chunk in chunks[:-1])
    # the openai client raises the error event as an APIError
    with pytest.raises(openai.APIError, match="deadline"):
        for _ in client.completions.create(
            model=MODEL, prompt="Once upon a time", stream=True, extra_body={"timeout": 0.5, **LONG}
        ):
            pass


def test_native_api_deadline(blackbox: ServerProcess) -> None:
    response = httpx.post(
        f"{blackbox.url}/v1/inference",
        json={"prompt": "Once upon a time", "timeout": 0.3, **LONG},
        timeout=60,
    )
    assert response.status_code == 504
    assert_deadline_error(response.json()["error"])
    with httpx.stream(
        "POST",
        f"{blackbox.url}/v1/inference/stream",
        json={"prompt": "Once upon a time", **LONG},
        headers={"X-Request-Timeout": "0.5"},
        timeout=60,
    ) as streamed:
        chunks, is_done = parse_stream(list(streamed.iter_lines()))
    assert is_done and "error" in chunks[-1]
    assert_deadline_error(chunks[-1]["error"])


def test_deadlines_are_counted(blackbox: ServerProcess) -> None:
    httpx.post(f"{blackbox.url}/v1/completions", json={"prompt": "Hi", "timeout": 0.2, **LONG}, timeout=60)
    metrics = httpx.get(f"{blackbox.url}/metrics").text
    lines = [line for line in metrics.splitlines() if line.startswith("bitserve_requests_aborted_total{")]
    counts = [float(line.rsplit(" ", 1)[1]) for line in lines if 'reason="deadline"' in line]
    assert counts and counts[0] >= 1, lines


@pytest.mark.parametrize(
    ("body", "headers", "param"),
    [
        ({"timeout": 0}, {}, "timeout"),
        ({"timeout": -1}, {}, "timeout"),
        ({"timeout": 1e9}, {}, "timeout"),
        ({"timeout": "5"}, {}, "timeout"),
        ({}, {"X-Request-Timeout": "soon"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "0"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "inf"}, "X-Request-Timeout"),
        ({}, {"X-Request-Timeout": "1" * 40}, "X-Request-Timeout"),
    ],
)
def test_bad_timeouts_are_400(blackbox: ServerProcess, body: dict, headers: dict, param: str) -> None:
    for path, prompt in (
        ("/v1/completions", {"prompt": "Hi"}),
        ("/v1/chat/completions", {"messages": MESSAGES}),
        ("/v1/inference", {"prompt": "Hi"}),
    ):
        response = httpx.post(
            f"{blackbox.url}{path}", json={**prompt, "max_tokens": 2, **body}, headers=headers, timeout=60
        )
        assert response.status_code == 400, (path, response.text)
        assert response.json()["error"]["param"] == param


def aborted_count(server: ServerProcess, reason: str) -> float:
    metrics = httpx.get(f"{server.url}/metrics").text
    return sum(
        float(line.rsplit(" ", 1)[1])
        for line in metrics.splitlines()
        if line.startswith("bitserve_requests_aborted_total{") and f'reason="{reason}"' in line
    )


def test_the_clients_own_timeout_aborts_as_a_disconnect(
    blackbox: ServerProcess, client: openai.OpenAI
) -> None:
    """openai's `timeout=` is the client's HTTP timeout (no header goes out): when it fires the client
    hangs up, and the server aborts the request as a disconnect, not as a deadline."""
    before = aborted_count(blackbox, "client_disconnect")
    with pytest.raises(openai.APITimeoutError):
        client.with_options(timeout=0.5).completions.create(
            model=MODEL, prompt="Once upon a time", extra_body=LONG
        )
    for _ in range(50):  # the server notices the disconnect within a step or two
        if aborted_count(blackbox, "client_disconnect") > before:
            break
        time.sleep(0.1)
    assert aborted_count(blackbox, "client_disconnect") > before
