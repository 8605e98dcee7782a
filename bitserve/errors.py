"""bitserve's exception hierarchy. Knows nothing about HTTP: `server/errors.py` maps these to statuses.

Every error carries a message, the `param` at fault (if any) and a `hint` telling the caller what to do.
"""

from __future__ import annotations


class BitserveError(Exception):
    """Base of every error bitserve raises on purpose."""

    def __init__(self, message: str, *, param: str | None = None, hint: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.hint = hint

    def __str__(self) -> str:
        text = self.message
        if self.hint:
            text += f" (hint: {self.hint})"
        return text

    def __reduce__(self) -> tuple[object, ...]:
        # Errors cross the engine process's pipe (engine/process.py). Exception's own reduce calls
        # cls(*args), which a subclass with required keywords (QueueFull's retry_after_s) refuses.
        return (_restore_error, (type(self), self.args, self.__dict__))


def _restore_error(
    cls: type[BitserveError], args: tuple[object, ...], state: dict[str, object]
) -> BitserveError:
    error = cls.__new__(cls)
    error.args = args
    error.__dict__.update(state)
    return error


class InvalidRequest(BitserveError, ValueError):
    """A request or parameter is malformed or out of range."""


class ContextLengthExceeded(InvalidRequest):
    """The prompt (plus max_tokens) does not fit the model's context."""


class PayloadTooLarge(BitserveError):
    """A request body exceeds the configured limit."""


class QueueFull(BitserveError):
    """Admission refused: the waiting queue is full. `retry_after_s` says when to try again."""

    def __init__(self, message: str, *, retry_after_s: float, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or "retry after the number of seconds in Retry-After")
        self.retry_after_s = retry_after_s


class Unauthenticated(BitserveError):
    """No credentials, or credentials that do not verify (unknown key, bad or expired token)."""


class Forbidden(BitserveError):
    """The caller may not do this (e.g. load a file outside the configured model roots, a route outside
    the principal's scopes, a model its key does not list)."""


class RateLimited(BitserveError):
    """A principal is over its request or token limit. `retry_after_s` says when to try again."""

    def __init__(self, message: str, *, retry_after_s: float, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or "retry after the number of seconds in Retry-After")
        self.retry_after_s = retry_after_s


class LimiterUnavailable(BitserveError):
    """The shared rate limiter (Redis) cannot be reached and the server fails closed."""


class Conflict(BitserveError):
    """Another operation holds the resource (e.g. an admin action already running on this alias)."""


class ModelNotFound(BitserveError):
    """The named model is not known to the catalog or the model roots."""


class NotFound(BitserveError):
    """The caller has no resource of that id (a batch, a file): missing, or another caller's."""


class ServiceUnavailable(BitserveError):
    """A part of the server is off or could not start (e.g. the Batch API without its database)."""


class CircuitOpen(ServiceUnavailable):
    """A dependency's circuit breaker is open (server/breakers.py): the call was not made.
    `retry_after_s` says when the breaker lets a probe through."""

    def __init__(self, message: str, *, retry_after_s: float, hint: str | None = None) -> None:
        super().__init__(message, hint=hint or "retry after the number of seconds in Retry-After")
        self.retry_after_s = retry_after_s


class ModelUnavailable(BitserveError):
    """The model exists but cannot serve now (loading, draining, missing weights file)."""


class ServerShuttingDown(ModelUnavailable):
    """The server is draining (SIGTERM): no new requests, and the drain deadline ends the rest."""


class InvalidModelFile(BitserveError):
    """A GGUF file is malformed, hostile or unsupported.

    `offset` is the file offset where the problem was found (None when it is not about one place).
    """

    def __init__(
        self,
        message: str,
        *,
        path: str | None = None,
        offset: int | None = None,
        expected: str | None = None,
        hint: str | None = None,
    ) -> None:
        where = []
        if path is not None:
            where.append(str(path))
        if offset is not None:
            where.append(f"offset {offset}")
        prefix = f"{': '.join(where)}: " if where else ""
        text = prefix + message
        if expected is not None:
            text += f"; expected {expected}"
        super().__init__(text, hint=hint)
        self.path = path
        self.offset = offset
        self.expected = expected


class DigestMismatch(InvalidModelFile):
    """A downloaded, cached or installed file's sha256 differs from the digest it is pinned to."""


class UnsupportedModel(InvalidModelFile):
    """The file is well formed but uses an architecture or format bitserve does not support."""


class ModelLoadError(BitserveError):
    """Loading a model failed for a reason other than the file itself (memory, smoke test)."""


class RequestFailed(BitserveError):
    """One request failed inside the engine; other requests are unaffected."""


class RequestRefused(InvalidRequest):
    """A server plugin refused the request (server/plugins: a content filter's rule matched its prompt)."""


class PluginFailed(BitserveError):
    """A server plugin's hook raised or ran past its time budget: that request fails, no other does.
    `plugin` names it (the error body says which; the log has the traceback)."""

    def __init__(self, message: str, *, plugin: str, hint: str | None = None) -> None:
        super().__init__(message, hint=hint)
        self.plugin = plugin


class DeadlineExceeded(BitserveError):
    """A request's deadline (its `timeout` or `X-Request-Timeout`) passed before it finished; it was
    aborted wherever it was (queue or decode)."""


class EngineDead(BitserveError):
    """An exception escaped the engine step; the replica is no longer trustworthy."""
