"""The typed answers of bitserve.Client: pydantic models of the server's JSON. Every model keeps the
fields it does not declare (`extra="allow"`: `model.model_extra`), so a newer server's additions
reach the caller instead of failing validation."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict

TERMINAL_BATCH_STATES = frozenset({"completed", "failed", "expired", "cancelled"})


class ApiModel(BaseModel):
    model_config = ConfigDict(extra="allow", protected_namespaces=())


class Replica(ApiModel):
    device: str
    backend: str | None = None
    is_alive: bool | None = None
    is_draining: bool | None = None
    num_active_requests: int = 0


class ModelVersion(ApiModel):
    """One loaded (or loading) version of an alias."""

    slot_id: int | str | None = None
    state: str  # loading | ready | draining | failed | ...
    phase: str | None = None
    progress: float = 0.0
    version: str | None = None  # short sha256 of the file
    file: str | None = None
    architecture: str | None = None
    quant_formats: list[str] = []
    devices: list[str] = []
    backend: str | None = None
    memory_bytes: int | None = None
    num_active_requests: int = 0
    replicas: list[Replica] = []
    error: Any = None


class Model(ModelVersion):
    """An alias as GET /v1/models lists it: what serves now, the version it replaced, a pending one."""

    id: str
    object: str = "model"
    created: int = 0
    owned_by: str = "bitserve"
    max_model_len: int | None = None
    is_default: bool = False
    previous: ModelVersion | None = None
    pending: ModelVersion | None = None


class OperationError(ApiModel):
    message: str | None = None
    hint: str | None = None
    type: str | None = None


class Operation(ApiModel):
    """An admin action (load, swap, rollback, unload) and where it stands."""

    id: str
    action: str
    alias: str
    model: str | None = None
    state: str  # running | succeeded | failed
    phase: str | None = None
    progress: float = 0.0
    error: OperationError | None = None
    result: dict[str, Any] = {}
    started_at: float | None = None
    finished_at: float | None = None
    status_url: str | None = None

    @property
    def is_done(self) -> bool:
        return self.state != "running"


class ModelList(ApiModel):
    data: list[Model]
    operations: list[Operation] = []


class Health(ApiModel):
    """GET /health: the phase (loading, ready, draining, failed, dead), components, build (metrics scope)."""

    status: str
    components: dict[str, Any] = {}
    build: dict[str, Any] | None = None


class Probe(ApiModel):
    """GET /health/live or /health/ready: ok or fail, and each check."""

    status: str
    checks: dict[str, bool] = {}

    @property
    def is_ok(self) -> bool:
        return self.status == "ok"


class Stats(ApiModel):
    """GET /v1/stats: the default model's batching, throughput, queue and KV use (more in extras),
    every model's under `models`, the response cache's counters, and the Batch API's batches by status
    and progress."""

    phase: str
    uptime_s: float
    memory: dict[str, Any] = {}
    admission: dict[str, Any] = {}
    response_cache: dict[str, Any] = {}
    batches: dict[str, Any] = {}
    models: dict[str, Any] = {}


class Tokenized(ApiModel):
    tokens: list[int]
    count: int
    max_model_len: int | None = None


class Detokenized(ApiModel):
    prompt: str


class FileObject(ApiModel):
    id: str
    object: str = "file"
    bytes: int | None = None
    created_at: int | None = None
    filename: str | None = None
    purpose: str | None = None


class BatchRequestCounts(ApiModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchUsage(ApiModel):
    """Tokens of a batch's finished requests (OpenAI's BatchUsage)."""

    input_tokens: int = 0
    input_tokens_details: dict[str, int] = {}  # cached_tokens
    output_tokens: int = 0
    output_tokens_details: dict[str, int] = {}  # reasoning_tokens
    total_tokens: int = 0


class Batch(ApiModel):
    """An OpenAI batch object."""

    id: str
    object: str = "batch"
    endpoint: str | None = None
    status: str
    input_file_id: str | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    completion_window: str | None = None
    created_at: int | None = None
    request_counts: BatchRequestCounts | None = None
    errors: Any = None
    metadata: dict[str, Any] | None = None
    model: str | None = None
    usage: BatchUsage | None = None

    @property
    def is_done(self) -> bool:
        return self.status in TERMINAL_BATCH_STATES


class BatchResult(ApiModel):
    """One line of a batch's output or error file: the answer to request `custom_id`."""

    id: str | None = None
    custom_id: str
    response: dict[str, Any] | None = None  # {status_code, request_id, body}
    error: dict[str, Any] | None = None

    @property
    def body(self) -> dict[str, Any] | None:
        """The endpoint's JSON answer (a chat.completion, say), when the request succeeded."""
        return self.response.get("body") if self.response is not None else None
