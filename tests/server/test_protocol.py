"""Request models -> SamplingParams, and the HTTP contract of validation errors, against build_app
with the synthetic TQ2_0 BitNet (in process)."""

from __future__ import annotations

import json
import logging

import pytest
from fastapi.testclient import TestClient
from http_testing import parse_stream

from bitserve.core.request import Priority
from bitserve.errors import InvalidRequest
from bitserve.sampling_params import SamplingParams
from bitserve.server.body import parse_request
from bitserve.server.protocol import ChatCompletionRequest, CompletionRequest, InferenceRequest

MODEL = "bitnet-TQ2_0"
ERROR_KEYS = {"message", "type", "param", "code", "hint"}


def chat(**fields: object) -> ChatCompletionRequest:
    body = {"messages": [{"role": "user", "content": "hi"}], **fields}
    return parse_request(json.dumps(body).encode(), ChatCompletionRequest)


def test_chat_fields_map_onto_sampling_params() -> None:
    request = chat(
        temperature=0.7,
        top_p=0.9,
        top_k=-1,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=42,
        stop="END",
        logit_bias={"17": -100, "5": 2.5},
        n=3,
        logprobs=True,
        top_logprobs=4,
        priority="high",
        max_tokens=9,
        max_completion_tokens=7,
    )
    assert request.requested_max_tokens == 7  # max_completion_tokens wins over the deprecated max_tokens
    params = request.to_sampling_params()
    assert params == SamplingParams(
        n=3,
        max_tokens=7,
        temperature=0.7,
        top_p=0.9,
        top_k=0,
        min_p=0.05,
        presence_penalty=0.5,
        frequency_penalty=-0.5,
        repetition_penalty=1.1,
        seed=42,
        stop=("END",),
        logit_bias={5: 2.5, 17: -100.0},
        logprobs=4,
    )
    assert request.priority_class is Priority.HIGH


def test_unset_fields_keep_sampling_params_defaults() -> None:
    request = chat()
    assert request.num_logprobs is None
    assert request.to_sampling_params() == SamplingParams()
    assert chat(logprobs=True).num_logprobs == 0  # the chosen token's logprob, no alternatives


def test_completion_fields_map_onto_sampling_params() -> None:
    request = parse_request(
        json.dumps(
            {
                "prompt": [[1, 2, 3]],
                "logprobs": 2,
                "stop": ["a", "b"],
                "n": 2,
                "best_of": 2,
                "ignore_eos": True,
                "stop_token_ids": [7],
            }
        ).encode(),
        CompletionRequest,
    )
    assert request.prompt_input().token_ids == [1, 2, 3]
    params = request.to_sampling_params()
    assert (params.n, params.logprobs, params.stop, params.ignore_eos, params.stop_token_ids) == (
        2,
        2,
        ("a", "b"),
        True,
        (7,),
    )


def test_unknown_fields_are_tolerated_and_logged(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.WARNING, logger="bitserve.server.body"):
        request = parse_request(b'{"prompt": "x", "frobnicate": 1, "best_effort": true}', InferenceRequest)
    assert request.prompt == "x"
    assert "best_effort, frobnicate" in caplog.text


def error_of(response: object, status: int) -> dict[str, object]:
    assert response.status_code == status, response.text  # type: ignore[attr-defined]
    error = response.json()["error"]  # type: ignore[attr-defined]
    assert set(error) == ERROR_KEYS
    return error


@pytest.mark.parametrize(
    ("fields", "param"),
    [
        ({"temperature": 2.5}, "temperature"),
        ({"temperature": "hot"}, "temperature"),
        ({"top_p": 0}, "top_p"),
        ({"top_k": -2}, "top_k"),
        ({"n": 17}, "n"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -5}, "max_tokens"),
        ({"max_tokens": 10**30}, "max_tokens"),
        ({"max_tokens": 1.5}, "max_tokens"),
        ({"seed": -1}, "seed"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"repetition_penalty": 0}, "repetition_penalty"),
        ({"logprobs": 21}, "logprobs"),
        ({"stop": ["x"] * 17}, "stop"),
        ({"stop": ["y" * 257]}, "stop"),
        ({"stop": [""]}, "stop"),
        ({"logit_bias": {"5": 101}}, "logit_bias"),
        ({"logit_bias": {"tok": 1}}, "logit_bias"),
        ({"logit_bias": {str(i): 1 for i in range(301)}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),  # beyond the vocabulary
        ({"priority": "urgent"}, "priority"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"prompt": [0, 10**6]}, "prompt"),  # token id outside the vocabulary
        ({"prompt": [True, False]}, "prompt"),
        ({"stream": "yes"}, "stream"),
        ({"model": "other-model"}, "model"),
    ],
)
def test_bad_values_get_400_naming_the_field(
    client: TestClient, fields: dict[str, object], param: str
) -> None:
    body = {"prompt": "hello", "max_tokens": 2, **fields}
    status = 404 if param == "model" else 400
    error = error_of(client.post("/v1/completions", json=body), status)
    assert error["param"] == param
    assert error["type"] == "invalid_request_error"


@pytest.mark.parametrize(
    ("path", "fields", "param"),
    [
        ("/v1/chat/completions", {"functions": [{"name": "f"}]}, "functions"),
        ("/v1/chat/completions", {"store": True}, "store"),
        (
            "/v1/chat/completions",
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0].type",
        ),
        ("/v1/completions", {"suffix": "tail"}, "suffix"),
        ("/v1/completions", {"best_of": 3}, "best_of"),
        ("/v1/completions", {"echo": True, "logprobs": 1}, "echo"),
    ],
)
def test_unimplemented_fields_get_400_saying_so(
    client: TestClient, path: str, fields: dict[str, object], param: str
) -> None:
    base = {"messages": [{"role": "user", "content": "hi"}]} if "chat" in path else {"prompt": "hi"}
    error = error_of(client.post(path, json={**base, "max_tokens": 2, **fields}), 400)
    assert error["code"] == "unsupported_parameter"
    assert error["param"] == param
    assert "not supported" in str(error["message"])


def test_chat_without_a_chat_template_is_a_clear_400(client: TestClient) -> None:
    error = error_of(
        client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}]}), 400
    )
    assert "no chat template" in str(error["message"])
    assert "/v1/completions" in str(error["hint"])


def test_prompt_too_long_and_max_tokens_past_the_context(client: TestClient) -> None:
    error = error_of(client.post("/v1/completions", json={"prompt": list(range(1, 200))}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "prompt")
    error = error_of(client.post("/v1/completions", json={"prompt": "hello", "max_tokens": 128}), 400)
    assert (error["code"], error["param"]) == ("context_length_exceeded", "max_tokens")


def test_completion_round_trip_on_the_synthetic_model(client: TestClient) -> None:
    response = client.post(
        "/v1/completions",
        json={
            "model": MODEL,
            "prompt": [1, 2, 3],
            "max_tokens": 4,
            "n": 2,
            "temperature": 0,
            "ignore_eos": True,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion" and body["model"] == MODEL
    assert [choice["index"] for choice in body["choices"]] == [0, 1]
    assert all(choice["finish_reason"] == "length" for choice in body["choices"])
    assert body["choices"][0]["text"] == body["choices"][1]["text"]  # greedy choices agree
    usage = body["usage"]
    assert (usage["prompt_tokens"], usage["completion_tokens"], usage["total_tokens"]) == (3, 8, 11)


def test_native_inference_and_stream_agree(client: TestClient) -> None:
    request = {"prompt": [5, 6, 7, 8], "max_tokens": 5, "temperature": 0, "ignore_eos": True, "logprobs": 2}
    whole = client.post("/v1/inference", json=request).json()
    with client.stream("POST", "/v1/inference/stream", json=request) as response:
        chunks, is_done = parse_stream(list(response.iter_lines()))
    assert is_done
    streamed = [choice for chunk in chunks for choice in chunk["choices"]]
    assert [t for choice in streamed for t in choice["token_ids"]] == whole["choices"][0]["token_ids"]
    assert "".join(choice["text"] for choice in streamed) == whole["choices"][0]["text"]
    assert chunks[-1]["usage"]["completion_tokens"] == 5
    logprobs = whole["choices"][0]["logprobs"]
    assert len(logprobs) == 5 and all(len(entry["top_logprobs"]) == 2 for entry in logprobs)
    # greedy: the chosen token is the most likely one
    assert all(
        entry["rank"] == 1 and entry["token_id"] == entry["top_logprobs"][0]["token_id"] for entry in logprobs
    )


def test_request_ids(client: TestClient) -> None:
    assert (
        client.get("/health/live", headers={"X-Request-Id": "trace-123"}).headers["x-request-id"]
        == "trace-123"
    )
    for bad in ("has space", "x" * 129, "\u00e9t\u00e9"):
        returned = client.get("/health/live", headers={"X-Request-Id": bad.encode("utf-8")}).headers[
            "x-request-id"
        ]
        assert returned != bad and 1 <= len(returned) <= 128
    error = client.post("/v1/completions", content=b"{", headers={"X-Request-Id": "abc"})
    assert error.status_code == 400 and error.headers["x-request-id"] == "abc"


def test_sampling_params_errors_keep_their_param() -> None:
    # a bound only SamplingParams knows: min_tokens above max_tokens
    with pytest.raises(InvalidRequest) as caught:
        chat(min_tokens=10, max_tokens=5).to_sampling_params()
    assert caught.value.param == "min_tokens"


def test_openapi_describes_the_request_bodies(client: TestClient) -> None:
    document = client.get("/openapi.json").json()
    request_body = document["paths"]["/v1/chat/completions"]["post"]["requestBody"]
    body = request_body["content"]["application/json"]["schema"]
    assert body["properties"]["n"]["maximum"] == 16
    assert body["properties"]["messages"]["items"]["$ref"] == "#/components/schemas/ChatMessage"
    assert "ChatMessage" in document["components"]["schemas"]
