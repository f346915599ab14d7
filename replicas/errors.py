"""Typed errors raised by the engine.

Like lora_core's, these are domain errors: the engine raises them for one
request (the others keep running); only the ingress (cluster/) maps them to
HTTP status codes.
"""

from __future__ import annotations

from lora_core.errors import UnknownLoRAError


class EngineError(Exception):
    """Base class of every error the engine raises on purpose."""


class ModelConfigError(EngineError, ValueError):
    """A model directory's config cannot be served (unsupported, malformed, or bad engine settings)."""


class InvalidRequestError(EngineError, ValueError):
    """A request cannot be served as asked: a bad sampling parameter, an empty
    prompt, a prompt longer than the model's context.

    ``problems`` lists each fault as ``(field, message)``; the message names
    every field and its value.
    """

    def __init__(self, problems: list[tuple[str, str]] | str, field: str | None = None) -> None:
        if isinstance(problems, str):
            problems = [(field or "request", problems)]
        self.problems = list(problems)
        self.fields = [f for f, _ in self.problems]
        super().__init__("; ".join(msg for _, msg in self.problems))


class UnknownAdapterError(EngineError, UnknownLoRAError):
    """A request names an adapter the engine does not know and cannot load."""


class RequestAbortedError(EngineError):
    """The request was aborted (by the client or the engine) before it finished."""


class LoadWorkerLostError(EngineError, RuntimeError):
    """The worker process loading an adapter died, and died again on a fresh pool (lora_load_processes)."""


class EngineDeadError(EngineError, RuntimeError):
    """The engine loop or a TP worker died; no request can be served any more."""
