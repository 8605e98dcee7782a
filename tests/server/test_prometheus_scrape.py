"""A real Prometheus (Debian's `prometheus` package; .ci/run installs it) scrapes the black-box
`bitserve serve`, with deploy/prometheus/alerts.yaml loaded: the metric names arrive, a latency
quantile can be computed from the histogram, the queue-depth query the Prometheus adapter runs for the
HPA answers, and every alert rule loads and evaluates without error."""

from __future__ import annotations

import os
import shutil
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from http_testing import REPO_ROOT, ServerProcess, free_port

ALERTS = REPO_ROOT / "deploy" / "prometheus" / "alerts.yaml"
SCRAPE_TIMEOUT_S = 60.0


@pytest.fixture(scope="module")
def prometheus(tmp_path_factory: pytest.TempPathFactory, blackbox: ServerProcess) -> Iterator[str]:
    binary = shutil.which("prometheus")
    if binary is None:
        if os.environ.get("CI"):
            pytest.fail("prometheus is missing under CI: .ci/run should have installed it")
        pytest.skip("prometheus is not installed (Debian's prometheus package)")
    folder = tmp_path_factory.mktemp("prometheus")
    config = {
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "rule_files": [str(ALERTS)],
        "scrape_configs": [
            {
                "job_name": "bitserve",
                "static_configs": [
                    {
                        "targets": [blackbox.url.removeprefix("http://")],
                        # what the Kubernetes service discovery would attach
                        "labels": {"namespace": "ci", "pod": "bitserve-0"},
                    }
                ],
            }
        ],
    }
    (folder / "prometheus.yml").write_text(yaml.safe_dump(config))
    port = free_port()
    with open(folder / "prometheus.log", "wb") as log:
        process = subprocess.Popen(
            [
                binary,
                f"--config.file={folder / 'prometheus.yml'}",
                f"--storage.tsdb.path={folder / 'data'}",
                f"--web.listen-address=127.0.0.1:{port}",
            ],
            stdout=log,
            stderr=subprocess.STDOUT,
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait(lambda: httpx.get(f"{url}/-/ready", timeout=2).status_code == 200, process, folder)
        yield url
    finally:
        process.terminate()
        process.wait(timeout=30)


def _wait(condition, process: subprocess.Popen, folder: Path) -> None:  # noqa: ANN001
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while time.monotonic() < deadline:
        assert process.poll() is None, (folder / "prometheus.log").read_text()[-3000:]
        try:
            if condition():
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise AssertionError(f"timed out:\n{(folder / 'prometheus.log').read_text()[-3000:]}")


def _query(url: str, expression: str) -> list[dict]:
    answer = httpx.get(f"{url}/api/v1/query", params={"query": expression}, timeout=10).json()
    assert answer["status"] == "success", answer
    return answer["data"]["result"]


def _eventually(url: str, expression: str) -> list[dict]:
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while time.monotonic() < deadline:
        result = _query(url, expression)
        if result:
            return result
        time.sleep(0.5)
    raise AssertionError(f"no result for {expression} after {SCRAPE_TIMEOUT_S} s")


def test_real_prometheus_scrape(prometheus: str, blackbox: ServerProcess) -> None:
    body = {"prompt": "The capital of France is", "max_tokens": 4, "temperature": 0}
    for _ in range(3):
        assert httpx.post(f"{blackbox.url}/v1/completions", json=body, timeout=60).status_code == 200
    (up,) = _eventually(prometheus, 'up{job="bitserve"}')
    assert up["value"][1] == "1"
    requests = _eventually(prometheus, "sum(bitserve_requests_total)")
    assert float(requests[0]["value"][1]) >= 3
    names = httpx.get(f"{prometheus}/api/v1/label/__name__/values", timeout=10).json()["data"]
    assert {"bitserve_time_to_first_token_seconds_bucket", "vllm:num_requests_waiting"} <= set(names)
    assert "process_resident_memory_bytes" in names
    quantile = _eventually(
        prometheus,
        "histogram_quantile(0.5, sum by (le) (bitserve_request_duration_seconds_bucket))",
    )
    assert 0 < float(quantile[0]["value"][1]) < 600
    # the Prometheus adapter's metricsQuery for bitserve_queue_depth, as it expands it for one pod
    depth = _eventually(
        prometheus, 'sum(bitserve_num_requests_waiting{namespace="ci",pod="bitserve-0"}) by (pod)'
    )
    assert float(depth[0]["value"][1]) >= 0
    rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
    loaded = [rule for group in rules for rule in group["rules"]]
    assert len(loaded) == sum(len(g["rules"]) for g in yaml.safe_load(ALERTS.read_text())["groups"])
    deadline = time.monotonic() + SCRAPE_TIMEOUT_S
    while any(rule.get("health") != "ok" for rule in loaded) and time.monotonic() < deadline:
        time.sleep(0.5)
        rules = httpx.get(f"{prometheus}/api/v1/rules", timeout=10).json()["data"]["groups"]
        loaded = [rule for group in rules for rule in group["rules"]]
    assert all(rule["health"] == "ok" for rule in loaded), [(r["name"], r.get("lastError")) for r in loaded]
