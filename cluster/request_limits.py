"""Bounds on one HTTP request, each checked before the work it bounds: the body's size before the body is read
or parsed, a prompt's characters before it is tokenized.

A body whose Content-Length is over the limit is refused unread; one without (chunked) is counted as it is read
and refused once it passes the limit, so leaving the header out buys nothing. The ingress authenticates first
(cluster/api.py): an unauthenticated caller gets its 401 before a byte of its body is read.
"""

from __future__ import annotations

from typing import Any, Awaitable, Callable

from cluster.errors import RequestTooLargeError
from replicas.errors import InvalidRequestError

# 8 MiB holds a prompt of MAX_PROMPT_CHARS even with every character \u-escaped (6 bytes each, as clients with
# ensure_ascii JSON send non-ASCII text), or a batch of token-id prompts, with room for the rest of a request.
MAX_REQUEST_BODY_BYTES = 8 << 20
# The largest contexts served widely (128k tokens) hold some 0.5M characters of prose at ~4 characters a token:
# twice that still fits any of them, while a tokenizer's pass over it stays near a second of CPU (the demo's:
# ~0.6 s). Deployments of longer contexts raise it.
MAX_PROMPT_CHARS = 1_000_000

ASGIApp = Callable[[dict, Callable, Callable], Awaitable[None]]


def check_prompt_chars(field: str, chars: int, limit: int) -> None:
    """InvalidRequestError naming field where its prompt text holds more than limit characters."""
    # A 400, not a 413: vLLM and OpenAI answer a prompt too long for the context with a 400, so clients that catch
    # BadRequestError to shorten the prompt and retry handle this one too; 413 is for the body's bytes.
    if chars > limit:
        raise InvalidRequestError([(field, f"{field} holds {chars} characters of prompt text, over this server's "
                                           f"limit of {limit} (max_prompt_chars): shorten it")])


def prompt_chars(request: Any) -> int:
    """The prompt text of a GenerateRequest, in characters: its prompt string, or its messages' contents."""
    text = request.prompt if isinstance(request.prompt, str) else ""
    return len(text) + sum(len(str(m.get("content") or "")) for m in request.messages or ())


class BodyLimit:
    """ASGI middleware: a request body over max_bytes is answered by refuse(RequestTooLargeError) (the ingress's
    error_response: 413 in the OpenAI error shape) before the app parses any of it."""

    def __init__(self, app: ASGIApp, max_bytes: int, refuse: Callable[[BaseException], Any]) -> None:
        self.app, self.max_bytes, self.refuse = app, max_bytes, refuse

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        declared = _content_length(scope)
        if declared is not None and declared > self.max_bytes:
            return await self._too_large(scope, receive, send)
        body = _CountedBody(receive, send, self.max_bytes)
        try:
            await self.app(scope, body.receive, body.send)
        except Exception:
            if not body.over:  # past the limit, the app's error is only its failed read: the 413 answers
                raise
        if body.over and not body.started:
            await self._too_large(scope, receive, send)

    async def _too_large(self, scope: dict, receive: Callable, send: Callable) -> None:
        error = RequestTooLargeError(f"the request body is over this server's limit of {self.max_bytes} bytes "
                                     f"(max_request_body_bytes)")
        await self.refuse(error)(scope, receive, send)


class _CountedBody:
    """receive and send for the app: receive fails once the bytes read pass max_bytes, and from then on the
    app's own answer (FastAPI's 400 for a body it could not read) is dropped for the 413."""

    def __init__(self, receive: Callable, send: Callable, max_bytes: int) -> None:
        self._receive, self._send, self.max_bytes = receive, send, max_bytes
        self.read, self.over, self.started = 0, False, False

    async def receive(self) -> dict:
        message = await self._receive()
        if message["type"] == "http.request":
            self.read += len(message.get("body", b""))
            if self.read > self.max_bytes:
                self.over = True
                raise RequestTooLargeError(f"request body over {self.max_bytes} bytes")
        return message

    async def send(self, message: dict) -> None:
        if self.over:
            return
        self.started = self.started or message["type"] == "http.response.start"
        await self._send(message)


def _content_length(scope: dict) -> int | None:
    for name, value in scope.get("headers", []):
        if name.lower() == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None  # malformed: the body is counted as it is read instead
    return None
