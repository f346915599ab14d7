"""One line per failed request: what an operator reads instead of a traceback for a client's mistake.

The HTTP middleware opens a record for each request (its id: the caller's X-Request-Id or a new one, its route
template, never the raw path, so no caller can mint new label values); the handlers note what they learn on
the way (the adapter named, the error's message), and the middleware writes the record once the status is
known: a 4xx at INFO, a 5xx at WARNING, as `key=value` pairs. Server faults also log their traceback at ERROR
where they are caught (cluster/api.py error_response); client errors never do.
"""

from __future__ import annotations

import json
import logging
import uuid
from contextvars import ContextVar
from typing import Any

from starlette.routing import Match

logger = logging.getLogger("lorafleet.access")

# The record of the request being handled. A mutable dict set by the middleware: the handler runs in a task
# of its own (a copy of the context), and what it notes must reach the middleware's copy.
_RECORD: ContextVar[dict[str, Any] | None] = ContextVar("lorafleet_request_record", default=None)
REQUEST_ID_HEADER = "x-request-id"


def open_record(headers: Any) -> tuple[dict[str, Any], Any]:
    """A new record for the request with these headers, made current; (record, token to close it with)."""
    record = {"request_id": headers.get(REQUEST_ID_HEADER) or uuid.uuid4().hex, "adapter": None, "error": None}
    return record, _RECORD.set(record)


def close_record(token: Any) -> None:
    _RECORD.reset(token)


def note(**fields: Any) -> None:
    """Add to the current request's record (nothing outside a request)."""
    record = _RECORD.get()
    if record is not None:
        record.update(fields)


def route_label(app: Any, scope: dict) -> str:
    """The route template the request matched ("/v1/responses/{response_id}"), or "unmatched"."""
    route = scope.get("route")
    if route is None:
        route = next((r for r in app.routes if r.matches(scope)[0] == Match.FULL), None)
    return getattr(route, "path", None) or "unmatched"


def write(record: dict[str, Any], route: str, status: int) -> None:
    """The request's one line, where it failed."""
    if status < 400:
        return
    fields = {"request_id": record["request_id"], "route": route, "status": status, "adapter": record["adapter"],
              "error": record["error"]}
    line = " ".join(f"{k}={json.dumps(v)}" for k, v in fields.items() if v is not None)
    logger.log(logging.INFO if status < 500 else logging.WARNING, "request failed %s", line)
