"""The web playground at `/`, in a real browser: Debian's chromium driven by Playwright against a
`bitserve serve` subprocess (SmolLM2, plus a tiny synthetic model loaded through the admin API) that
requires an API key. The page must work offline from its own files under a strict CSP: type a prompt and
watch the answer stream in, stop a stream (the server's running count drops), switch models (the request
names the other one), see /v1/stats live, and render a screenshot that is not blank.

Skips without /usr/bin/chromium locally; under CI (`.ci/run` installs it) it fails instead.
`PLAYGROUND_SCREENSHOT=docs/playground.png` also writes the screenshot there (the README's picture)."""

from __future__ import annotations

import base64
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from http_testing import ServerProcess
from lifecycle_testing import write_version

from bitserve.loader.gguf_reader import read_gguf
from bitserve.loader.gguf_types import GGUFValueType
from bitserve.server.playground import CONTENT_SECURITY_POLICY
from bitserve.testing.synthetic import tokenizer_metadata

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--headless",
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
]
API_KEY = "playground-test-key-0123456789"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAIN_MODEL = "smollm2-135m-instruct"
SECOND_MODEL = "tiny"
VIEWPORT = {"width": 1400, "height": 860}
TIMEOUT_MS = 30_000
MIN_DISTINCT_COLORS = 64  # text, antialiasing, the chart: a blank or one-colour page has a handful
CHAT_TEMPLATE_KEY = "tokenizer.chat_template"


def write_second_model(path: Path, smollm2_path: Path) -> Path:
    """A tiny synthetic BitNet with SmolLM2's tokenizer and chat template (it speaks gibberish, fast)."""
    tokenizer = tokenizer_metadata(smollm2_path)
    with read_gguf(smollm2_path) as gguf:
        tokenizer[CHAT_TEMPLATE_KEY] = (GGUFValueType.STRING, gguf.metadata[CHAT_TEMPLATE_KEY], None)
    return write_version(path, tokenizer, seed=1)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[ServerProcess]:
    """SmolLM2 as the default model, behind an API key, and a tiny synthetic model (the same tokenizer)
    loaded beside it through the admin API."""
    root = tmp_path_factory.mktemp("playground-models")
    write_second_model(root / f"{SECOND_MODEL}.gguf", smollm2_path)
    log = tmp_path_factory.mktemp("playground") / "server.log"
    server = ServerProcess(
        log, "--model-root", str(root), "--sse-keepalive-s", "1", env={"BITSERVE_API_KEY": API_KEY}
    )
    try:
        server.wait_ready()
        body = {"model": SECOND_MODEL, "alias": SECOND_MODEL, "validate": False, "wait": True}
        response = httpx.post(f"{server.url}/v1/models/load", json=body, headers=AUTH, timeout=120.0)
        assert response.status_code == 200, response.text
        yield server
    finally:
        server.stop()


def require(is_present: bool, what: str, how: str) -> None:
    """Skip locally without `what`; under CI, where .ci/run provides it, fail."""
    if not is_present:
        if os.environ.get("CI"):
            pytest.fail(f"{what} is missing under CI: .ci/run should have installed it")
        pytest.skip(f"{what} is not installed ({how}; .ci/run does)")


@pytest.fixture(scope="module")
def browser() -> Iterator[Any]:
    require(CHROMIUM.exists(), str(CHROMIUM), "apt-get install chromium")
    require(importlib.util.find_spec("playwright") is not None, "playwright", "pip install -e '.[test]'")
    from playwright.sync_api import sync_playwright

    with sync_playwright() as playwright:
        launched = playwright.chromium.launch(executable_path=str(CHROMIUM), args=CHROMIUM_ARGS)
        yield launched
        launched.close()


def test_the_page_and_its_files_need_no_key_and_carry_a_strict_csp(server: ServerProcess) -> None:
    page = httpx.get(f"{server.url}/")
    assert page.status_code == 200 and page.headers["content-type"] == "text/html; charset=utf-8"
    assert page.headers["content-security-policy"] == CONTENT_SECURITY_POLICY
    assert "script-src 'self'" in CONTENT_SECURITY_POLICY and "unsafe" not in CONTENT_SECURITY_POLICY
    assert '<script type="module" src="/playground/app.js">' in page.text
    for name, content_type in (
        ("app.js", "text/javascript; charset=utf-8"),
        ("style.css", "text/css; charset=utf-8"),
        ("favicon.svg", "image/svg+xml"),
    ):
        asset = httpx.get(f"{server.url}/playground/{name}")
        assert asset.status_code == 200 and asset.headers["content-type"] == content_type, name
        assert asset.headers["x-content-type-options"] == "nosniff"
        etag = {"If-None-Match": asset.headers["etag"]}
        revalidated = httpx.get(f"{server.url}/playground/{name}", headers=etag)
        assert revalidated.status_code == 304 and not revalidated.content
    for missing in ("/playground/nope.js", "/playground/..%2Fplayground.py", "/playground/%2E%2E/app.py"):
        assert httpx.get(f"{server.url}{missing}").status_code in (401, 404), missing
    assert httpx.get(f"{server.url}/v1/models").status_code == 401  # the API still needs the key
    assert "/" not in httpx.get(f"{server.url}/openapi.json").json()["paths"]


def wait_until(condition: Callable[[], bool], timeout_s: float = 20.0, what: str = "condition") -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def num_running(server: ServerProcess, model: str) -> int:
    stats = httpx.get(f"{server.url}/v1/stats", headers=AUTH, timeout=10.0).json()
    return int(stats["models"][model]["requests"]["num_active"])


def last_answer(page: Any) -> Any:
    return page.locator(".message.assistant").last


def send(page: Any, prompt: str, max_tokens: int) -> None:
    page.fill("#max-tokens", str(max_tokens))
    page.fill("#prompt", prompt)
    page.click("#send")


def watch_stream(page: Any) -> list[int]:
    """The last answer's text length, sampled until it stops streaming."""
    answer = last_answer(page)
    lengths = []
    deadline = time.monotonic() + TIMEOUT_MS / 1000
    while answer.get_attribute("data-state") in (None, "streaming") and time.monotonic() < deadline:
        lengths.append(len(answer.locator(".content").inner_text()))
        time.sleep(0.03)
    return lengths


def distinct_colors(browser: Any, png: bytes) -> int:
    """Distinct pixel colours of a PNG, decoded by the browser itself on a blank page."""
    page = browser.new_page()
    try:
        return int(
            page.evaluate(
                """async (data) => {
                    const image = new Image();
                    image.src = "data:image/png;base64," + data;
                    await image.decode();
                    const canvas = new OffscreenCanvas(image.width, image.height);
                    const context = canvas.getContext("2d");
                    context.drawImage(image, 0, 0);
                    const rgba = context.getImageData(0, 0, image.width, image.height).data;
                    return new Set(new Uint32Array(rgba.buffer)).size;
                }""",
                base64.b64encode(png).decode(),
            )
        )
    finally:
        page.close()


def assert_snippets_run(curl: str, python: str) -> None:
    """The request as shown, copied into a shell and into Python (the key from $BITSERVE_API_KEY), streams."""
    env = {**os.environ, "BITSERVE_API_KEY": API_KEY}

    def run(*command: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(command, env=env, capture_output=True, text=True, timeout=60)

    if shutil.which("curl") is not None:
        shell = run("bash", "-c", curl)
        assert shell.returncode == 0 and shell.stdout.rstrip().endswith("data: [DONE]"), shell
    script = run(sys.executable, "-c", python)
    assert script.returncode == 0 and script.stdout, script


def open_with_key(browser: Any, server: ServerProcess) -> tuple[Any, list[str], list[dict[str, Any]]]:
    """The page, with the key typed into its field; (page, console errors, chat request bodies)."""
    page = browser.new_page(viewport=VIEWPORT)
    page.set_default_timeout(TIMEOUT_MS)
    errors: list[str] = []
    bodies: list[dict[str, Any]] = []
    page.on("pageerror", lambda error: errors.append(str(error)))
    page.on("console", lambda message: errors.append(message.text) if message.type == "error" else None)
    page.on(
        "request",
        lambda request: (
            bodies.append(json.loads(request.post_data))
            if request.url.endswith("/v1/chat/completions")
            else None
        ),
    )
    page.goto(f"{server.url}/")
    page.wait_for_selector("#status:has-text('API key')")  # /v1/models answered 401 without one
    page.fill("#api-key", API_KEY)
    page.click("#save-key")
    page.wait_for_selector("#model option:nth-child(2)", state="attached")  # both models listed
    return page, errors, bodies


def test_playground_streams_stops_and_switches_models(
    server: ServerProcess, browser: Any, tmp_path: Path
) -> None:
    page, errors, bodies = open_with_key(browser, server)
    assert page.input_value("#model") == MAIN_MODEL  # the default alias is picked first
    assert page.locator("#model-details").inner_text().count("version") == 1
    page.fill("#temperature", "0")

    send(page, "Write a haiku about the sea.", max_tokens=48)
    lengths = watch_stream(page)
    assert last_answer(page).get_attribute("data-state") == "done"
    growth = sorted(set(lengths))
    assert len(growth) >= 3 and lengths == sorted(lengths), lengths  # streamed: the text grew in steps
    assert MAIN_MODEL in last_answer(page).locator(".meta").inner_text()
    assert "finish: " in last_answer(page).locator(".meta").inner_text()

    send(page, "Tell me a long story about a lighthouse keeper.", max_tokens=1000)
    wait_until(lambda: len(last_answer(page).locator(".content").inner_text()) > 20, what="tokens")
    page.wait_for_selector("#stat-active:text-is('1')")  # the live stats see the request running
    assert num_running(server, MAIN_MODEL) == 1
    page.click("#stop")
    wait_until(lambda: num_running(server, MAIN_MODEL) == 0, timeout_s=10.0, what="the server to abort")
    page.wait_for_selector(".message.assistant:last-child[data-state='stopped']")
    stopped_at = last_answer(page).locator(".content").inner_text()
    page.wait_for_selector("#stat-active:text-is('0')")
    assert last_answer(page).locator(".content").inner_text() == stopped_at  # nothing came after stop
    assert page.is_enabled("#send") and not page.is_enabled("#stop")
    assert page.locator("#stats-chart polyline").count() == 3

    png = page.screenshot()
    (tmp_path / "playground.png").write_bytes(png)
    if os.environ.get("PLAYGROUND_SCREENSHOT"):
        shutil.copyfile(tmp_path / "playground.png", os.environ["PLAYGROUND_SCREENSHOT"])
    assert distinct_colors(browser, png) >= MIN_DISTINCT_COLORS

    page.select_option("#model", SECOND_MODEL)
    page.fill("#prompt", "Hello")
    assert f'"model": "{SECOND_MODEL}"' in page.inner_text("#snippet-curl")
    send(page, "Hello", max_tokens=8)
    page.wait_for_selector(".message.assistant:last-child[data-state='done']")
    assert [body["model"] for body in bodies] == [MAIN_MODEL, MAIN_MODEL, SECOND_MODEL]
    assert SECOND_MODEL in last_answer(page).locator(".meta").inner_text()
    assert len(bodies[-1]["messages"]) == 5  # the conversation so far, then the new turn
    page.click("[data-snippet='python']")
    python = page.inner_text("#snippet-python")
    assert f'model="{SECOND_MODEL}"' in python
    assert_snippets_run(page.inner_text("#snippet-curl"), python)

    page.reload()  # the key stays in this browser (localStorage): the models load without typing it
    page.wait_for_selector("#model option:nth-child(2)", state="attached")
    assert page.input_value("#api-key") == API_KEY
    assert not [error for error in errors if "401" not in error], errors
    page.close()
