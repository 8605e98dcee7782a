"""Rows of the batch database as plain records, and their OpenAI wire objects (`file`, `batch`)."""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

# A batch's statuses (OpenAI's): open ones are the worker's to move on; completed, failed, expired
# and cancelled are final.
OPEN_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")
CANCELLABLE_STATUSES = ("validating", "in_progress")
# When a batch entered each status (a column per status that has one).
STATUS_TIMES = {
    "in_progress": "in_progress_at",
    "finalizing": "finalizing_at",
    "completed": "completed_at",
    "failed": "failed_at",
    "expired": "expired_at",
    "cancelling": "cancelling_at",
    "cancelled": "cancelled_at",
}


@dataclass(frozen=True, slots=True)
class FileRecord:
    id: str
    owner: str
    purpose: str
    filename: str
    num_bytes: int
    created_at: int

    def to_object(self) -> dict[str, Any]:
        return {
            "id": self.id,
            "object": "file",
            "bytes": self.num_bytes,
            "created_at": self.created_at,
            "filename": self.filename,
            "purpose": self.purpose,
            "status": "processed",  # validated at upload: a file exists only once it is usable
            "status_details": None,
            "expires_at": None,
        }


@dataclass(frozen=True, slots=True)
class BatchRecord:
    seq: int
    id: str
    owner: str
    endpoint: str
    input_file_id: str
    completion_window: str
    status: str
    errors: str | None
    metadata: str | None
    output_file_id: str | None
    error_file_id: str | None
    num_total: int
    num_completed: int
    num_failed: int
    created_at: int
    expires_at: float
    in_progress_at: int | None
    finalizing_at: int | None
    completed_at: int | None
    failed_at: int | None
    expired_at: int | None
    cancelling_at: int | None
    cancelled_at: int | None
    model: str | None  # the model that answered its first finished request
    input_tokens: int  # token counts of its finished requests, added up as they finish
    cached_tokens: int
    output_tokens: int
    reasoning_tokens: int

    def usage(self) -> dict[str, Any]:
        """OpenAI's BatchUsage (the openai SDK's `Batch.usage`)."""
        return {
            "input_tokens": self.input_tokens,
            "input_tokens_details": {"cached_tokens": self.cached_tokens},
            "output_tokens": self.output_tokens,
            "output_tokens_details": {"reasoning_tokens": self.reasoning_tokens},
            "total_tokens": self.input_tokens + self.output_tokens,
        }

    def to_object(self) -> dict[str, Any]:
        errors = json.loads(self.errors) if self.errors else None
        return {
            "id": self.id,
            "object": "batch",
            "endpoint": self.endpoint,
            "errors": {"object": "list", "data": errors} if errors else None,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window,
            "status": self.status,
            "output_file_id": self.output_file_id,
            "error_file_id": self.error_file_id,
            "created_at": self.created_at,
            "in_progress_at": self.in_progress_at,
            "expires_at": int(self.expires_at),
            "finalizing_at": self.finalizing_at,
            "completed_at": self.completed_at,
            "failed_at": self.failed_at,
            "expired_at": self.expired_at,
            "cancelling_at": self.cancelling_at,
            "cancelled_at": self.cancelled_at,
            "request_counts": {
                "total": self.num_total,
                "completed": self.num_completed,
                "failed": self.num_failed,
            },
            "metadata": json.loads(self.metadata) if self.metadata else None,
            "model": self.model,
            "usage": self.usage(),
        }


@dataclass(frozen=True, slots=True)
class RequestRecord:
    """One request of a batch, as the worker runs it."""

    batch_id: str
    line: int
    id: str
    custom_id: str
    url: str
    body: str
    status: str
    attempts: int
    result: str | None
    claimed_by: int | None  # the claim key of the worker running it


@dataclass(frozen=True, slots=True)
class BatchProgress:
    """The requests of the open batches, all owners together (/v1/stats)."""

    num_open: int  # open batches
    num_total: int
    num_completed: int
    num_failed: int
    num_pending: int  # waiting for a worker (new, or a retry's backoff)
    num_running: int  # claimed by a worker, this one or another sharing the database

    def to_dict(self) -> dict[str, int]:
        return {
            "open_batches": self.num_open,
            "total": self.num_total,
            "completed": self.num_completed,
            "failed": self.num_failed,
            "pending": self.num_pending,
            "running": self.num_running,
        }


def from_row(record_type: type[Any], row: Mapping[str, Any]) -> Any:
    """A record from a database row (sqlite3.Row or psycopg's dict row: read by column name)."""
    return record_type(**{field.name: row[field.name] for field in fields(record_type)})
