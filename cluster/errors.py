"""Typed errors of the cluster layer. Only the ingress maps them (and lower layers' errors) to HTTP codes."""

from __future__ import annotations


class ClusterError(Exception):
    """Base of the errors cluster/ raises on purpose."""


class BadAdapterSourceError(ClusterError, ValueError):
    """A lora_path that is malformed, outside the allowed roots, or contains '..' (HTTP 400); nothing was read."""


class AdapterNotFoundError(ClusterError, KeyError):
    """An adapter name that is not registered, or a source that has no adapter at that address (HTTP 404)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else "adapter not found"


class ResponseNotFoundError(ClusterError, KeyError):
    """A response id this ingress does not hold (HTTP 404): never stored, evicted, or kept by another replica."""

    def __init__(self, message: str, field: str | None = None) -> None:
        super().__init__(message)
        self.fields = [field] if field else []  # the request field that named it (error_response's param)

    def __str__(self) -> str:
        return str(self.args[0])


class SourceUnavailableError(ClusterError, RuntimeError):
    """The origin (S3, the Hub) could not be reached or failed (HTTP 502/503); other adapters are unaffected."""


class OverloadedError(ClusterError, RuntimeError):
    """Too many requests queued on every replica (HTTP 429/503)."""


class ReplicaUnavailableError(ClusterError, RuntimeError):
    """The replica serving a request died or could not be reached, after the request had produced output, or
    again on its one retry elsewhere (HTTP 503); the message names no Ray internals."""


class AuthenticationError(ClusterError, PermissionError):
    """Missing or wrong API key (HTTP 401)."""


class RequestTooLargeError(ClusterError):
    """A request body over the ingress's max_request_body_bytes (HTTP 413), refused before it was parsed."""


def is_replica_loss(exc: BaseException) -> bool:
    """Did the call fail because its replica died or could not be reached (not because of the request)?"""
    from ray.exceptions import RayActorError, RayTaskError  # RayActorError: died, or unavailable for now

    if isinstance(exc, RayTaskError):
        exc = getattr(exc, "cause", None)
    return isinstance(exc, RayActorError)


def remote_cause(exc: BaseException) -> BaseException:
    """The exception a replica raised, out of the RayTaskError that carried it to the caller (that wrapper is an
    instance of the cause's type too, but its str() is the whole remote traceback); others as they are."""
    from ray.exceptions import RayTaskError

    if isinstance(exc, RayTaskError) and isinstance(getattr(exc, "cause", None), BaseException):
        return exc.cause
    return exc


class QuotaExceededError(ClusterError):
    """A tenant (API key or adapter) over its token-rate quota (cluster/quotas.py): HTTP 429 with a Retry-After
    of retry_after_s seconds (rounded up): by then the tenant's bucket holds what the request needs, unless its
    other requests take it first."""

    def __init__(self, message: str, retry_after_s: float) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s

    def __reduce__(self):  # pickled (across Ray) with its retry_after_s, which args alone would lose
        return type(self), (str(self), self.retry_after_s)
