"""Priority-aware admission under load: with the server saturated, `low` is refused (429) first, then
`normal`, and the last share of the admission limits stays for `high` (issue 14)."""

from __future__ import annotations

import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import pytest
from fastapi.testclient import TestClient

from bitserve.config import ServerConfig
from bitserve.engine.messages import Priority
from bitserve.frontend.admission import AdmissionLimits

LONG = {"prompt": [1, 2, 3], "max_tokens": 40, "ignore_eos": True, "temperature": 0}


def test_caps_shed_low_first_and_keep_a_share_for_high() -> None:
    limits = AdmissionLimits.for_replica(
        ServerConfig(
            max_num_waiting=10, max_num_queued_tokens=1000, high_priority_reserve=0.2, low_priority_share=0.5
        ),
        max_num_seqs=256,
        kv_cache_tokens=10**6,
    )
    assert limits.caps(Priority.HIGH) == (10, 1000)
    assert limits.caps(Priority.NORMAL) == (8, 800)
    assert limits.caps(Priority.LOW) == (5, 500)
    with pytest.raises(ValueError, match="low_priority_share"):
        ServerConfig(high_priority_reserve=0.5, low_priority_share=0.6)


def test_unset_limits_scale_with_the_replica() -> None:
    """A GPU replica (256 sequences, a million KV tokens) queues a 256-request burst at priority normal;
    a small CPU replica keeps the floors."""
    config = ServerConfig()
    gpu = AdmissionLimits.for_replica(config, max_num_seqs=256, kv_cache_tokens=1_000_000)
    assert (gpu.max_num_waiting, gpu.max_num_queued_tokens) == (512, 1_000_000)
    assert gpu.caps(Priority.NORMAL)[0] >= 256
    cpu = AdmissionLimits.for_replica(config, max_num_seqs=32, kv_cache_tokens=8192)
    assert (cpu.max_num_waiting, cpu.max_num_queued_tokens) == (256, 262_144)
    with pytest.raises(ValueError, match="max_num_waiting"):
        ServerConfig(max_num_waiting=0)


@pytest.fixture()
def saturable_client(slowed_client) -> Iterator[TestClient]:  # noqa: ANN001
    # caps: high 5, normal 4, low 2
    config = ServerConfig(warmup=False, max_num_waiting=5, high_priority_reserve=0.2, low_priority_share=0.4)
    with slowed_client(config) as client:
        yield client


def test_under_saturation_low_goes_first_and_high_still_gets_in(saturable_client: TestClient) -> None:
    client = saturable_client
    with ThreadPoolExecutor(5) as pool:
        held = [
            pool.submit(client.post, "/v1/completions", json=LONG | {"priority": "normal"}) for _ in range(2)
        ]
        time.sleep(0.3)  # two admitted: the low share (2) is full
        low = client.post("/v1/completions", json=LONG | {"priority": "low"})
        held += [
            pool.submit(client.post, "/v1/completions", json=LONG | {"priority": "normal"}) for _ in range(2)
        ]
        time.sleep(0.3)  # four admitted: the normal share (4) is full
        normal = client.post("/v1/completions", json=LONG | {"priority": "normal"})
        high = pool.submit(client.post, "/v1/completions", json=LONG | {"priority": "high"})
        results = [future.result(timeout=120) for future in held + [high]]
    assert low.status_code == 429 and low.json()["error"]["code"] == "queue_full"
    assert normal.status_code == 429 and int(normal.headers["retry-after"]) >= 1
    assert [r.status_code for r in results] == [200] * 5  # the four normal and the one high all finished
    assert all(r.json()["usage"]["completion_tokens"] == 40 for r in results)
