"""Batched prompts on /v1/completions over real sockets (the black-box server, SmolLM2) with the
official `openai` client: lists of strings and of token-id lists, OpenAI's choice numbering
(index = i * n + j), summed usage, interleaved streaming, echo, and the 400s (suffix, echo with
logprobs, batches past the caps)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator

import httpx
import openai
import pytest
from http_testing import ServerProcess

MODEL = "smollm2-135m-instruct"
PROMPTS = ["The capital of France is", "1, 2, 3, 4,", "Once upon a time"]
GREEDY = {"model": MODEL, "max_tokens": 6, "temperature": 0}


@pytest.fixture(scope="module")
def client(blackbox: ServerProcess) -> Iterator[openai.OpenAI]:
    with openai.OpenAI(base_url=f"{blackbox.url}/v1", api_key="unused", max_retries=0, timeout=120.0) as api:
        yield api


@pytest.fixture(scope="module")
def singles(client: openai.OpenAI) -> list[openai.types.Completion]:
    return [client.completions.create(prompt=prompt, **GREEDY) for prompt in PROMPTS]


def test_list_of_strings_with_n(client: openai.OpenAI, singles: list) -> None:
    n = 2
    response = client.completions.create(prompt=PROMPTS, n=n, **GREEDY)
    assert [choice.index for choice in response.choices] == list(range(len(PROMPTS) * n))
    for choice in response.choices:
        single = singles[choice.index // n]
        assert choice.text == single.choices[0].text  # greedy: every choice of prompt i is prompt i's answer
        assert choice.finish_reason == single.choices[0].finish_reason
    assert response.usage.prompt_tokens == sum(single.usage.prompt_tokens for single in singles)
    assert response.usage.completion_tokens == n * sum(single.usage.completion_tokens for single in singles)
    assert response.usage.total_tokens == response.usage.prompt_tokens + response.usage.completion_tokens


def test_token_id_prompts(blackbox: ServerProcess, client: openai.OpenAI, singles: list) -> None:
    ids = [httpx.post(f"{blackbox.url}/tokenize", json={"prompt": p}).json()["tokens"] for p in PROMPTS]
    batched = client.completions.create(prompt=ids, **GREEDY)
    assert [choice.text for choice in batched.choices] == [single.choices[0].text for single in singles]
    one = client.completions.create(prompt=ids[0], **GREEDY)  # a single token-id list is one prompt
    assert len(one.choices) == 1 and one.choices[0].text == singles[0].choices[0].text


def test_streaming_interleaves_indexed_chunks(client: openai.OpenAI) -> None:
    n = 2
    whole = client.completions.create(prompt=PROMPTS, n=n, **GREEDY)
    texts: dict[int, str] = defaultdict(str)
    finishes: dict[int, str] = {}
    usage = None
    stream = client.completions.create(
        prompt=PROMPTS, n=n, stream=True, stream_options={"include_usage": True}, **GREEDY
    )
    for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            texts[choice.index] += choice.text
            if choice.finish_reason:
                finishes[choice.index] = choice.finish_reason
    assert {index: text for index, text in texts.items()} == {c.index: c.text for c in whole.choices}
    assert finishes == {c.index: c.finish_reason for c in whole.choices}
    assert usage is not None and usage.prompt_tokens == whole.usage.prompt_tokens
    assert usage.completion_tokens == whole.usage.completion_tokens


def test_echo_prepends_each_prompt(client: openai.OpenAI, singles: list) -> None:
    response = client.completions.create(prompt=PROMPTS, echo=True, **GREEDY)
    for choice, prompt, single in zip(response.choices, PROMPTS, singles, strict=True):
        assert choice.text == prompt + single.choices[0].text
    chunks = list(client.completions.create(prompt=PROMPTS[:2], echo=True, stream=True, **GREEDY))
    firsts = {}
    for chunk in chunks:
        for choice in chunk.choices:
            firsts.setdefault(choice.index, choice.text)
    assert firsts == {0: PROMPTS[0], 1: PROMPTS[1]}


@pytest.mark.parametrize(
    ("extra", "param", "words"),
    [
        ({"prompt": PROMPTS, "suffix": "end"}, "suffix", "fill-in-the-middle"),
        ({"prompt": PROMPTS, "echo": True, "logprobs": 1}, "echo", "prompt logprobs"),
        ({"prompt": ["x"] * 33}, "prompt", "at most 32"),
        ({"prompt": ["x"] * 8, "n": 9}, "prompt", "72 choices"),
        ({"prompt": [[1, 2], "x"]}, "prompt", "prompt"),
        ({"prompt": [[]]}, "prompt[0]", "no tokens"),
    ],
)
def test_refusals_name_the_problem(blackbox: ServerProcess, extra: dict, param: str, words: str) -> None:
    response = httpx.post(f"{blackbox.url}/v1/completions", json={"max_tokens": 2, **extra}, timeout=60)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and words in error["message"], error


def test_batch_deadline(client: openai.OpenAI) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client.completions.create(
            model=MODEL,
            prompt=PROMPTS,
            max_tokens=2000,
            temperature=0,
            extra_body={"ignore_eos": True, "timeout": 0.5},
        )
    assert caught.value.status_code == 504
