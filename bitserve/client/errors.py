"""What the client raises: an HTTP error answer becomes the APIStatusError subclass of its status,
carrying the server's error JSON (`{"error": {message, type, param, code, hint}}`); a failed admin
operation is OperationFailed; the network failing is APIConnectionError. All are BitserveErrors, so
the CLI reports them like its own."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import httpx

from bitserve.errors import BitserveError

if TYPE_CHECKING:
    from bitserve.client.schema import Operation

MAX_TEXT_CHARS = 200  # of a body that is not bitserve's error JSON, in the message


class ClientError(BitserveError):
    """Base of every error bitserve.Client raises."""


class APIConnectionError(ClientError):
    """The server could not be reached, or did not answer in time."""


class APIStatusError(ClientError):
    """The server answered with an error status. `body` is its whole JSON body ({} if not JSON);
    `error` its `error` object; `code`, `type`, `param`, `hint` come from there."""

    def __init__(self, response: httpx.Response, body: dict[str, Any]) -> None:
        error = body.get("error") if isinstance(body.get("error"), dict) else {}
        self.status_code = response.status_code
        self.body = body
        self.error: dict[str, Any] = error or {}
        self.code: str | None = self.error.get("code")
        self.type: str | None = self.error.get("type")
        self.request_id = response.headers.get("x-request-id")
        self.retry_after_s = _seconds(response.headers.get("retry-after"))  # 429 and 503 send it
        text = self.error.get("message") or response.text[:MAX_TEXT_CHARS] or response.reason_phrase
        super().__init__(
            f"{response.status_code} {self.code or ''}: {text}",
            param=self.error.get("param"),
            hint=self.error.get("hint"),
        )


class BadRequestError(APIStatusError):
    """400: a malformed request or a value out of range."""


class AuthenticationError(APIStatusError):
    """401: no API key, or one the server does not know."""


class PermissionDeniedError(APIStatusError):
    """403: the key lacks the scope or the model this call needs."""


class NotFoundError(APIStatusError):
    """404: no such model, operation, batch or file (or no such route)."""


class ConflictError(APIStatusError):
    """409: another admin action on this alias is running."""


class RateLimitError(APIStatusError):
    """429: over a limit or the queue is full; `retry_after_s` says when to try again."""


class InternalServerError(APIStatusError):
    """5xx other than 503."""


class ServiceUnavailableError(APIStatusError):
    """503: the model is loading, the server is draining, or no memory is left for a load."""


class BatchAPIUnavailable(NotFoundError):
    """The server has no Batch API (`/v1/files`, `/v1/batches`): a bitserve without it."""


class OperationFailed(ClientError):
    """An admin operation (load, swap, rollback, unload) ended in `failed`; `operation` is its last
    state, with the server's error."""

    def __init__(self, operation: Operation) -> None:
        error = operation.error
        message = error.message if error is not None else "no error given"
        super().__init__(
            f"{operation.action} failed: {message}", hint=error.hint if error is not None else None
        )
        self.operation = operation


class WaitTimeout(ClientError):
    """A wait (an operation, a batch) did not end within its timeout; the work goes on on the server."""


STATUS_ERRORS: dict[int, type[APIStatusError]] = {
    400: BadRequestError,
    401: AuthenticationError,
    403: PermissionDeniedError,
    404: NotFoundError,
    409: ConflictError,
    429: RateLimitError,
    503: ServiceUnavailableError,
}


def _seconds(value: str | None) -> float | None:
    try:
        return float(value) if value is not None else None
    except ValueError:
        return None  # an HTTP date: bitserve sends seconds


def error_from_response(response: httpx.Response) -> APIStatusError:
    """The typed error of an error answer, holding its JSON body."""
    try:
        body = response.json()
    except ValueError:
        body = {}
    if not isinstance(body, dict):
        body = {}
    status = response.status_code
    cls = STATUS_ERRORS.get(status) or (InternalServerError if status >= 500 else APIStatusError)
    return cls(response, body)


def is_missing_route(error: APIStatusError) -> bool:
    """A 404 for the path itself (the server has no such route), not for a missing object."""
    return error.status_code == 404 and str(error.error.get("message", "")).startswith("no route for")
