"""POST /v1/embeddings with the official `openai` client: over real sockets (the black-box server,
SmolLM2) for shapes, usage, base64 = float, token-id inputs, dimensions and the 400s; and in process
(the synthetic BitNet) against a direct computation from the model's forward."""

from __future__ import annotations

import base64
import math
import struct
from collections.abc import Iterator

import httpx
import openai
import pytest
import torch
from fastapi.testclient import TestClient
from http_testing import ServerProcess

from bitserve.runner.embeddings import CLS, LAST, MEAN, embed, module_forward, pooling_from_metadata

MODEL = "smollm2-135m-instruct"
SMOLLM2_HIDDEN = 576
TEXTS = ["The sea is deep.", "Paris is the capital of France.", "1, 2, 3, 4"]


@pytest.fixture(scope="module")
def api(blackbox: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(
        base_url=f"{blackbox.url}/v1", api_key="unused", max_retries=0, timeout=120.0
    ) as client:
        yield client


def norm(vector: list[float]) -> float:
    return math.sqrt(sum(x * x for x in vector))


def close(a: list[float], b: list[float], tol: float = 1e-5) -> bool:
    return len(a) == len(b) and max(abs(x - y) for x, y in zip(a, b, strict=True)) <= tol


def test_strings_floats_and_usage(api: openai.OpenAI, blackbox: ServerProcess) -> None:
    response = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    assert response.object == "list" and response.model == MODEL
    assert [item.index for item in response.data] == [0, 1, 2]
    for item in response.data:
        assert len(item.embedding) == SMOLLM2_HIDDEN and abs(norm(item.embedding) - 1) < 1e-4
    counts = [len(httpx.post(f"{blackbox.url}/tokenize", json={"prompt": t}).json()["tokens"]) for t in TEXTS]
    assert response.usage.prompt_tokens == response.usage.total_tokens == sum(counts)
    single = api.embeddings.create(model=MODEL, input=TEXTS[1], encoding_format="float")
    assert close(single.data[0].embedding, response.data[1].embedding)  # batched = alone
    assert not close(response.data[0].embedding, response.data[1].embedding, 1e-2)


def test_base64_decodes_to_the_floats(api: openai.OpenAI) -> None:
    floats = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    raw = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="base64")
    for as_float, as_b64 in zip(floats.data, raw.data, strict=True):
        blob = base64.b64decode(as_b64.embedding)  # type: ignore[arg-type]
        decoded = list(struct.unpack(f"<{len(blob) // 4}f", blob))
        assert close(decoded, as_float.embedding, 1e-7)  # float32 both ways
    default = api.embeddings.create(model=MODEL, input=TEXTS)  # the client asks for base64 and decodes it
    assert all(close(d.embedding, f.embedding, 1e-7) for d, f in zip(default.data, floats.data, strict=True))


def test_token_id_inputs(api: openai.OpenAI, blackbox: ServerProcess) -> None:
    ids = [httpx.post(f"{blackbox.url}/tokenize", json={"prompt": t}).json()["tokens"] for t in TEXTS]
    texts = api.embeddings.create(model=MODEL, input=TEXTS, encoding_format="float")
    batched = api.embeddings.create(model=MODEL, input=ids, encoding_format="float")
    one = api.embeddings.create(model=MODEL, input=ids[0], encoding_format="float")
    assert all(close(a.embedding, b.embedding) for a, b in zip(texts.data, batched.data, strict=True))
    assert close(one.data[0].embedding, texts.data[0].embedding)


def test_dimensions_truncate_and_renormalize(api: openai.OpenAI) -> None:
    full = api.embeddings.create(model=MODEL, input=TEXTS[0], encoding_format="float").data[0].embedding
    short = api.embeddings.create(model=MODEL, input=TEXTS[0], dimensions=64, encoding_format="float")
    vector = short.data[0].embedding
    head = full[:64]
    assert len(vector) == 64 and abs(norm(vector) - 1) < 1e-4
    assert close(vector, [x / norm(head) for x in head], 1e-5)


@pytest.mark.parametrize(
    ("body", "param", "words"),
    [
        ({"input": "x", "dimensions": SMOLLM2_HIDDEN + 1}, "dimensions", "hidden size"),
        ({"input": ["x"] * 257}, "input", "at most 256"),
        ({"input": []}, "input", "empty"),
        ({"input": [[]]}, "input[0]", "no tokens"),
        ({"input": [10**7]}, "input", "vocabulary"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format", ""),
        ({"input": [1] * 9000}, "input", "context"),
    ],
)
def test_bad_requests(blackbox: ServerProcess, body: dict, param: str, words: str) -> None:
    response = httpx.post(f"{blackbox.url}/v1/embeddings", json=body, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


# ----------------------------------------------------------------- in process: against the model itself


def test_equal_to_a_direct_forward(client: TestClient, synthetic_instance: object) -> None:
    api = openai.OpenAI(base_url="http://testserver/v1", api_key="unused", http_client=client, max_retries=0)
    token_ids = [[1, 5, 9, 12, 40], [7, 3]]
    response = api.embeddings.create(model=None, input=token_ids, encoding_format="float")  # type: ignore[arg-type]
    model = synthetic_instance.engine.runner.model  # type: ignore[attr-defined]
    with torch.inference_mode():
        for ids, item in zip(token_ids, response.data, strict=True):
            hidden = model(torch.tensor(ids), torch.arange(len(ids)))  # [tokens, hidden], final norm applied
            pooled = hidden.float().mean(dim=0)
            expected = (pooled / pooled.norm()).tolist()
            assert close(item.embedding, expected, 1e-5)
    assert response.usage.prompt_tokens == 7


def test_pooling_types(synthetic_instance: object) -> None:
    assert pooling_from_metadata({"llama.pooling_type": 2}, "llama") == CLS
    assert pooling_from_metadata({"llama.pooling_type": 3}, "llama") == LAST
    assert pooling_from_metadata({"llama.pooling_type": 0}, "llama") == MEAN  # none: a vector is still needed
    assert pooling_from_metadata({}, "llama") == MEAN
    model = synthetic_instance.engine.runner.model  # type: ignore[attr-defined]
    ids = [4, 8, 15, 16]
    with torch.inference_mode():
        hidden = model(torch.tensor(ids), torch.arange(len(ids))).float()
    forward = module_forward(model)
    first, last = embed(forward, [ids], CLS, None)[0], embed(forward, [ids], LAST, None)[0]
    assert close(first, (hidden[0] / hidden[0].norm()).tolist())
    assert close(last, (hidden[-1] / hidden[-1].norm()).tolist())


def test_a_gguf_pooling_type_is_used(
    tmp_path,
    synthetic_config,
    synthetic_weights,  # noqa: ANN001
) -> None:
    """A GGUF whose metadata says CLS pooling embeds with its first token's hidden state, end to end."""
    from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig
    from bitserve.engine.instance import ModelInstance
    from bitserve.loader.gguf_types import GGUFValueType
    from bitserve.server.app import build_app
    from bitserve.testing.synthetic import write_synthetic_model

    tokenizer, weights = synthetic_weights
    arch = synthetic_config.architecture
    extra = {f"{arch}.pooling_type": (GGUFValueType.UINT32, 2, None)}  # llama.cpp's CLS
    path = write_synthetic_model(
        tmp_path / "cls.gguf",
        "TQ2_0",
        config=synthetic_config,
        weights=weights,
        tokenizer={**tokenizer, **extra},
    )
    instance = ModelInstance.load(
        EngineConfig(model=ModelConfig(model=str(path)), scheduler=SchedulerConfig(max_model_len=64))
    )
    try:
        assert instance.pooling == CLS
        ids = [4, 8, 15, 16]
        with TestClient(build_app(ServerConfig(warmup=False), instance=instance)) as http:
            vector = http.post("/v1/embeddings", json={"input": ids}).json()["data"][0]["embedding"]
        with torch.inference_mode():
            first = instance.engine.runner.model(torch.tensor(ids), torch.arange(len(ids)))[0].float()
        assert close(vector, (first / first.norm()).tolist())
    finally:
        instance.close()
