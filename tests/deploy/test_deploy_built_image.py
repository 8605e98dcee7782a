"""The CPU image itself, built by scripts/build_image.sh (.ci/run builds it and names it in $BITSERVE_IMAGE):
run as a pod runs it (read-only root, a tmpfs at /tmp, host network, an API key) and driven with the
official openai client: ready from its baked kernel cache, answers the first question sensibly, streams,
and refuses a request without the key."""

from __future__ import annotations

import os
import secrets
import shutil

import httpx
import pytest
from deploy_testing import free_port

from bitserve.loader.catalog import DEFAULT_MODEL
from bitserve.testing.container import Container, running_image

IMAGE_ENV = "BITSERVE_IMAGE"


@pytest.fixture(scope="module")
def container() -> Container:
    image = os.environ.get(IMAGE_ENV, "")
    docker = shutil.which("docker")
    if not image or docker is None:
        if os.environ.get("CI"):
            pytest.fail(f"CI builds the image (.ci/run): ${IMAGE_ENV} is not set or docker is missing")
        pytest.skip(f"no built image: run `bash scripts/build_image.sh` and set ${IMAGE_ENV} to its tag")
    with running_image(docker, image, free_port(), secrets.token_urlsafe(24)) as started:
        started.wait_ready()
        yield started


def test_the_image_answers_the_openai_client(container: Container) -> None:
    from openai import OpenAI

    client = OpenAI(base_url=f"{container.base_url}/v1", api_key=container.api_key, max_retries=0)
    assert [model.id for model in client.models.list().data] == [DEFAULT_MODEL]
    question = [{"role": "user", "content": "What is the capital of France?"}]
    answer = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=question, temperature=0, max_tokens=16
    )
    assert "Paris" in answer.choices[0].message.content, answer
    stream = client.chat.completions.create(
        model=DEFAULT_MODEL, messages=question, temperature=0, max_tokens=16, stream=True
    )
    chunks = list(stream)
    streamed = "".join(chunk.choices[0].delta.content or "" for chunk in chunks if chunk.choices)
    assert streamed == answer.choices[0].message.content
    assert chunks[-1].choices[0].finish_reason in ("stop", "length")


def test_the_image_refuses_a_request_without_its_key(container: Container) -> None:
    response = httpx.post(f"{container.base_url}/v1/completions", json={"prompt": "hi"}, timeout=30)
    assert response.status_code == 401, response.text


def test_the_image_starts_from_its_baked_kernel_cache(container: Container) -> None:
    logs = container.logs()
    assert "kernel cache: copied" in logs, logs[-4000:]
    # the first generation found its kernels compiled: a compile would keep it running for ~40 s
    validating = [line for line in logs.splitlines() if "validating" in line]
    assert validating and not any("still running" in line for line in validating), logs[-4000:]
