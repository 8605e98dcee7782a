"""Server test fixtures: an in-process app over the synthetic TQ2_0 BitNet (fast, no chat template),
and one black-box `bitserve serve` subprocess with the embedded SmolLM2, shared by the package."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient
from http_testing import ServerProcess
from lifecycle_testing import ModelRoot, build_model_root
from postgres_testing import fresh_database

from bitserve.config import EngineConfig, ModelConfig, SchedulerConfig, ServerConfig

SYNTHETIC_MAX_MODEL_LEN = 128
IN_PROCESS_SERVER = ServerConfig(max_body_bytes=64 * 1024, body_read_timeout_s=1.0, sse_keepalive_s=1.0)
# The black-box server: short read timeouts so the hostile tests finish quickly.
BLACKBOX_ARGS = (
    "--header-read-timeout-s",
    "2",
    "--body-read-timeout-s",
    "2",
    "--max-body-bytes",
    "262144",
    "--sse-keepalive-s",
    "1",
    "--drain-timeout-s",
    "5",
)


@pytest.fixture(scope="session")
def tq2_model_path(tmp_path_factory: pytest.TempPathFactory, synthetic_config, synthetic_weights) -> Path:  # noqa: ANN001
    from bitserve.testing.synthetic import write_synthetic_model

    tokenizer, weights = synthetic_weights
    path = tmp_path_factory.mktemp("server-model") / "bitnet-TQ2_0.gguf"
    return write_synthetic_model(path, "TQ2_0", config=synthetic_config, weights=weights, tokenizer=tokenizer)


@pytest.fixture(scope="package")
def synthetic_instance(tq2_model_path: Path) -> Iterator[object]:
    from bitserve.engine.instance import ModelInstance

    instance = ModelInstance.load(
        EngineConfig(
            model=ModelConfig(model=str(tq2_model_path)),
            scheduler=SchedulerConfig(max_model_len=SYNTHETIC_MAX_MODEL_LEN),
        )
    )
    yield instance
    instance.close()


@pytest.fixture(scope="package")
def client(synthetic_instance: object) -> Iterator[TestClient]:
    """TestClient over build_app with the synthetic model already loaded (lifespan runs once)."""
    from bitserve.server.app import build_app

    app = build_app(IN_PROCESS_SERVER, instance=synthetic_instance)  # type: ignore[arg-type]
    with TestClient(app) as test_client:
        yield test_client


@pytest.fixture(scope="package")
def blackbox(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> Iterator[ServerProcess]:
    server = ServerProcess(tmp_path_factory.mktemp("blackbox") / "server.log", *BLACKBOX_ARGS)
    try:
        server.wait_ready()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="package")
def model_root(tmp_path_factory: pytest.TempPathFactory, smollm2_path: Path) -> ModelRoot:
    """The lifecycle tests' model root (tiny v1 and v2, broken and escaping files), built once for the
    package: tests read it, none writes it."""
    return build_model_root(tmp_path_factory.mktemp("lifecycle"), smollm2_path)


@pytest.fixture(params=["sqlite", "postgresql"])
def batch_db(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[str]:
    """A --batch-db value of each backend: a SQLite file, or a fresh PostgreSQL database (skipped
    without POSTGRES_TEST_URL)."""
    if request.param == "sqlite":
        yield str(tmp_path / "batches.sqlite3")
        return
    with fresh_database() as url:
        yield url
