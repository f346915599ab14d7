"""The OpenAI-compatible HTTP API (FastAPI), over any backend with LoRAServer's methods.

Routes: /v1/completions, /v1/chat/completions (SSE streaming with `stream`),
/v1/responses, /v1/responses/{id} (GET, DELETE) and /v1/responses/{id}/input_items (OpenAI's Responses API
over the chat path: cluster/responses.py),
/v1/models, vLLM's /v1/load_lora_adapter and /v1/unload_lora_adapter,
/health and /metrics, vLLM's /tokenize and /detokenize (cluster/token_routes.py).
This is the one place where domain errors become HTTP status codes.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import secrets
import time
from contextvars import ContextVar
from dataclasses import replace
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest

from cluster import access_log, prompt_batch
from cluster.errors import (AdapterNotFoundError, AuthenticationError, BadAdapterSourceError, OverloadedError,
                            QuotaExceededError, ReplicaUnavailableError, RequestTooLargeError, ResponseNotFoundError,
                            SourceUnavailableError, is_replica_loss, remote_cause)
from cluster.protocol import (ChatCompletionRequest, CompletionRequest, LoadLoRAAdapterRequest,
                              UnloadLoRAAdapterRequest)
from cluster.chat_request import chat_generation
from cluster.quotas import QuotaConfig, TokenQuotas, request_cost
from cluster.request_limits import (MAX_PROMPT_CHARS, MAX_REQUEST_BODY_BYTES, BodyLimit, check_prompt_chars,
                                    prompt_chars)
from cluster.response_formats import CompletionFormat, Format
from cluster.responses import add_response_routes
from cluster.server import GenerateRequest
from cluster.token_routes import add_token_routes
from lora_core.errors import InvalidAdapterError, LoRAConfigError, UnknownLoRAError
from replicas.errors import EngineDeadError, InvalidRequestError
from replicas.outputs import CompletionDeltas, RequestOutput

logger = logging.getLogger(__name__)
# The API key of the request being handled (None without keys): the tenant its quota charges, where quotas are
# by key. Set by the authenticating middleware, read by the handler's task (a copy of the context).
_API_KEY: ContextVar[str | None] = ContextVar("lorafleet_api_key", default=None)

# (exception types, HTTP status, OpenAI error type); first match wins.
ERROR_STATUS: list[tuple[tuple[type, ...], int, str]] = [
    ((AuthenticationError,), 401, "authentication_error"),
    ((RequestTooLargeError,), 413, "invalid_request_error"),
    ((AdapterNotFoundError, UnknownLoRAError, ResponseNotFoundError), 404, "not_found_error"),
    ((InvalidRequestError, BadAdapterSourceError, InvalidAdapterError, LoRAConfigError, ValueError), 400,
     "invalid_request_error"),
    ((OverloadedError, QuotaExceededError), 429, "rate_limit_error"),
    ((SourceUnavailableError, EngineDeadError, ReplicaUnavailableError), 503, "service_unavailable"),
]


def _status(exc: BaseException) -> tuple[int, str] | None:
    """(HTTP status, OpenAI error type) of a domain error; None for anything else (a fault: 500)."""
    for types, status, kind in ERROR_STATUS:
        if isinstance(exc, types):
            return status, kind
    return None


def is_domain_error(exc: BaseException) -> bool:
    """An error the API answers with its own status and message, not a server fault."""
    return _status(remote_cause(exc)) is not None


def error_response(exc: BaseException) -> JSONResponse:
    """The OpenAI error body for exc. A domain error's message is its own; a fault's names only its kind
    (the traceback, with whatever Ray put in it, is for the server's log)."""
    exc = remote_cause(exc)  # the message is the replica's error, not the Ray traceback around it
    known = _status(exc)
    if known is None:
        if is_replica_loss(exc):
            known, exc = (503, "service_unavailable"), ReplicaUnavailableError("the replica serving this request "
                                                                              "stopped; retry later")
        else:
            logger.error("internal error", exc_info=exc)
            known, exc = (500, "internal_error"), RuntimeError(f"internal error ({type(exc).__name__})")
    status, kind = known
    access_log.note(error=str(exc))
    param = ",".join(getattr(exc, "fields", []) or []) or None
    body = {"object": "error", "error": {"message": str(exc), "type": kind, "param": param, "code": status}}
    headers = {"Retry-After": str(max(1, math.ceil(exc.retry_after_s)))} if isinstance(exc, QuotaExceededError) \
        else None
    return JSONResponse(body, status_code=status, headers=headers)


def _cost(req: GenerateRequest) -> int:
    """What a request may spend of its quota: its prompt and every token it may generate (quotas.request_cost)."""
    tokens = len(req.prompt.get("prompt_token_ids") or ()) if isinstance(req.prompt, dict) else 0
    return request_cost(prompt_chars(req), req.sampling["max_tokens"], req.sampling.get("n") or 1, prompt_tokens=tokens)


class _Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter("lorafleet_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.prompt_tokens = Counter("lorafleet_prompt_tokens", "Prompt tokens", ["model"], registry=self.registry)
        self.generated_tokens = Counter("lorafleet_generated_tokens", "Generated tokens", ["model"],
                                        registry=self.registry)
        self.ttft = Histogram("lorafleet_time_to_first_token_seconds", "Time to first token", ["model"],
                              registry=self.registry)
        self.tpot = Histogram("lorafleet_time_per_output_token_seconds", "Time per output token after the first",
                              ["model"], registry=self.registry,
                              buckets=(.001, .0025, .005, .01, .02, .04, .08, .16, .32, .64, 1.28))


def build_api(backend: Any, api_keys: list[str] | None = None,
              extra_metrics: Callable[[], str] | None = None, responses: Any = None, *,
              max_request_body_bytes: int = MAX_REQUEST_BODY_BYTES, max_prompt_chars: int = MAX_PROMPT_CHARS,
              metrics_public: bool = True, quotas: QuotaConfig | None = None) -> FastAPI:
    """The HTTP app. backend: model_name, generate(GenerateRequest), models(), load/unload_adapter.
    responses: where /v1/responses keeps finished responses (cluster/responses.py's store; default: here).
    The request bounds, metrics_public and quotas: ServerConfig's fields of those names (cluster/request_limits.py,
    cluster/quotas.py)."""
    app = FastAPI(title="lorafleet", version="0.1.0")
    metrics = _Metrics()
    keys = [k.encode() for k in api_keys or []]
    buckets = TokenQuotas(quotas) if quotas is not None and quotas.enabled else None
    open_paths = {"/health", "/metrics"} if metrics_public else {"/health"}
    # Added before authenticate, so inside it (Starlette runs the last added outermost): a caller without a key
    # gets its 401 before any of its body is read or counted.
    app.add_middleware(BodyLimit, max_bytes=max_request_body_bytes, refuse=error_response)

    @app.middleware("http")
    async def authenticate(request: Request, call_next):
        record, token = access_log.open_record(request.headers)
        try:
            response = await _authenticated(request, call_next)
        finally:
            access_log.close_record(token)
        route = access_log.route_label(app, request.scope)  # a template, never the raw path: bounded labels
        metrics.requests.labels(route, str(response.status_code)).inc()
        access_log.write(record, route, response.status_code)
        response.headers[access_log.REQUEST_ID_HEADER] = record["request_id"]
        return response

    async def _authenticated(request: Request, call_next):
        path = request.url.path.removeprefix(request.scope.get("root_path", "").rstrip("/"))  # under a route_prefix
        if keys and path not in open_paths:
            header = request.headers.get("authorization", "")
            token = header[7:].encode() if header.lower().startswith("bearer ") else b""
            if not any(secrets.compare_digest(token, k) for k in keys):
                return error_response(AuthenticationError("missing or invalid API key (Authorization: Bearer ...)"))
            _API_KEY.set(token.decode())  # the handler's task copies this context: its quota's tenant
        return await call_next(request)

    async def _generate(req: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """backend.generate(req), charged to its tenant's token quota (QuotaExceededError, HTTP 429, before it
        runs); the reservation is settled with what the request used when it ends, however it ends."""
        if buckets is None:
            async for out in backend.generate(req):
                yield out
            return
        reservation = buckets.reserve(buckets.tenant(_API_KEY.get(), req.model), _cost(req))
        last = None
        try:
            async for last in backend.generate(req):
                yield last
        finally:
            reservation.settle(0 if last is None else len(last.prompt_token_ids)
                               + sum(len(c.token_ids) for c in last.outputs))

    @app.exception_handler(Exception)
    async def fault(_request: Request, exc: Exception):  # whatever no route caught: still the OpenAI shape
        return error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def bad_body(_request: Request, exc: RequestValidationError):
        fields = [(".".join(str(p) for p in e["loc"] if p != "body"), e["msg"]) for e in exc.errors()]
        problems = [(field, f"{field}: {msg}" if field else msg) for field, msg in fields]  # the message names it too
        return error_response(InvalidRequestError(problems or [("body", "malformed request body")]))

    add_token_routes(app, backend, error_response, max_prompt_chars=max_prompt_chars)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/metrics")
    async def prometheus():
        text = generate_latest(metrics.registry).decode()
        if extra_metrics is not None:
            text += await extra_metrics()
        return PlainTextResponse(text, media_type="text/plain; version=0.0.4")

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": await backend.models()}

    @app.post("/v1/load_lora_adapter")
    async def load_lora_adapter(body: LoadLoRAAdapterRequest):
        access_log.note(adapter=body.lora_name)
        try:
            await backend.load_adapter(body.lora_name, body.lora_path)
        except Exception as exc:  # noqa: BLE001 - mapped to its status code
            return error_response(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' added successfully.")

    @app.post("/v1/unload_lora_adapter")
    async def unload_lora_adapter(body: UnloadLoRAAdapterRequest):
        access_log.note(adapter=body.lora_name)
        try:
            await backend.unload_adapter(body.lora_name)
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return PlainTextResponse(f"Success: LoRA adapter '{body.lora_name}' removed successfully.")

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest):
        access_log.note(adapter=body.model)
        try:
            check_prompt_chars("prompt", body.prompt_chars(), max_prompt_chars)
            prompts = prompt_batch.engine_prompts(body.prompt)
        except InvalidRequestError as exc:
            return error_response(exc)
        sampling = body.sampling(backend.default_max_tokens, body.logprobs)
        if body.echo and body.logprobs is not None:  # the prompt's tokens come back with their logprobs too
            sampling["prompt_logprobs"] = body.logprobs
        reqs = [GenerateRequest(body.model, sampling, prompt=prompt, priority=body.priority) for prompt in prompts]
        if len(reqs) > 1:
            return await _respond_many(reqs, body, CompletionFormat(body, backend))
        return await _respond(reqs[0], body, CompletionFormat(body, backend))

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest):
        access_log.note(adapter=body.model)
        try:
            check_prompt_chars("messages", body.prompt_chars(), max_prompt_chars)
            req, fmt = chat_generation(body, backend)
        except InvalidRequestError as exc:
            return error_response(exc)
        return await _respond(req, body, fmt)

    async def _start(req: GenerateRequest, model: str
                     ) -> tuple[RequestOutput, AsyncIterator[RequestOutput]] | JSONResponse:
        """The request's first output, and all its outputs from that one on, timed for the metrics. An error
        before the first output is a plain HTTP error: nothing has been sent yet."""
        access_log.note(adapter=model)
        start = time.monotonic()
        stream = _generate(req)
        try:
            first = await stream.__anext__()
        except StopAsyncIteration:
            return error_response(EngineDeadError("the request ended without output"))
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        return first, _timed(first, stream, _Timing(metrics, model, start))

    async def _respond(req: GenerateRequest, body: Any, fmt: Format):
        req.restartable = not body.stream  # only the last output is kept: a lost replica's run may start over
        started = await _start(req, body.model)
        if isinstance(started, JSONResponse):
            return started
        first, outputs = started
        if not body.stream:
            try:
                async for last in outputs:
                    pass
            except Exception as exc:  # noqa: BLE001 - nothing has been sent: a plain HTTP error
                return error_response(exc)
            return JSONResponse(fmt.full(last))

        async def events() -> AsyncIterator[str]:
            deltas, last = CompletionDeltas(), first
            fmt.begin(first)
            try:
                async for last in outputs:
                    for c, delta, ids, finished in deltas(last):  # a chunk per choice with news (n > 1: several)
                        chunk = fmt.chunk(delta, c, finished, ids)
                        if chunk is not None:
                            yield _event(chunk, body, fmt, last)
            except Exception as exc:  # noqa: BLE001 - the stream is open: report in-band, then close
                yield f"data: {error_response(exc).body.decode()}\n\n"
            else:
                if (body.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps(fmt.usage_chunk(last))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    async def _respond_many(reqs: list[GenerateRequest], body: Any, fmt: Format):
        """Several prompts side by side (cluster/prompt_batch.py); choice i * n + j: prompt i's completion j."""
        for req in reqs:
            req.restartable = not body.stream
        start, n = time.monotonic(), body.n
        try:
            batch, firsts = await prompt_batch.start([_generate(r) for r in reqs])
        except Exception as exc:  # noqa: BLE001
            return error_response(exc)
        timings = [_Timing(metrics, body.model, start) for _ in reqs]
        if not body.stream:
            try:
                lasts = await prompt_batch.last_outputs(batch, firsts)
            except Exception as exc:  # noqa: BLE001
                return error_response(exc)
            for timing, out in zip(timings, lasts):
                timing.done(out)
            return JSONResponse(fmt.full(*lasts))

        async def events() -> AsyncIterator[str]:
            deltas, lasts = [CompletionDeltas() for _ in reqs], list(firsts)
            for i, first in enumerate(firsts):
                fmt.begin(first, base=i * n)
            try:
                # aclosing: a client that goes away stops every prompt's request, not only this generator
                async with contextlib.aclosing(prompt_batch.merged(batch, firsts)) as outputs:
                    async for i, out in outputs:
                        timings[i].token(out)
                        lasts[i] = out
                        for c, delta, ids, finished in deltas[i](out):
                            chunk = fmt.chunk(delta, replace(c, index=i * n + c.index), finished, ids)
                            if chunk is not None:
                                yield _event(chunk, body, fmt, *lasts)
            except Exception as exc:  # noqa: BLE001 - the stream is open: report in-band, then close
                yield f"data: {error_response(exc).body.decode()}\n\n"
            else:
                for timing, out in zip(timings, lasts):
                    timing.done(out)
                if (body.stream_options or {}).get("include_usage"):
                    yield f"data: {json.dumps(fmt.usage_chunk(*lasts))}\n\n"
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    add_response_routes(app, backend, error_response, _start, responses, max_prompt_chars=max_prompt_chars)
    app.state.metrics = metrics
    return app


def _event(chunk: dict, body: Any, fmt: Format, *outs: RequestOutput) -> str:
    """One SSE event; with vLLM's stream_options.continuous_usage_stats, the usage so far rides on every chunk."""
    if (body.stream_options or {}).get("continuous_usage_stats"):
        chunk["usage"] = fmt.usage(*outs)
    return f"data: {json.dumps(chunk)}\n\n"


async def _timed(first: RequestOutput, rest: AsyncIterator[RequestOutput], timing: "_Timing"
                 ) -> AsyncIterator[RequestOutput]:
    """first, then rest, each counted as it comes; the request's totals once the last is through."""
    last = first
    timing.token(first)
    yield first
    async for last in rest:
        timing.token(last)
        yield last
    timing.done(last)


class _Timing:
    def __init__(self, metrics: _Metrics, model: str, start: float) -> None:
        self.metrics, self.model, self.start = metrics, model, start
        self.first: float | None = None

    def token(self, out: RequestOutput) -> None:
        if self.first is None and any(c.token_ids for c in out.outputs):
            self.first = time.monotonic()
            self.metrics.ttft.labels(self.model).observe(self.first - self.start)

    def done(self, out: RequestOutput) -> None:
        self.token(out)
        lengths = [len(c.token_ids) for c in out.outputs]
        self.metrics.prompt_tokens.labels(self.model).inc(len(out.prompt_token_ids))
        self.metrics.generated_tokens.labels(self.model).inc(sum(lengths))
        n = max(lengths, default=0)  # n > 1: the choices decode side by side, one token a step each
        if self.first is not None and n > 1:
            self.metrics.tpot.labels(self.model).observe((time.monotonic() - self.first) / (n - 1))
