"""The gRPC API (cluster/proto/lorafleet.proto) over the ingress backend: proto <-> GenerateRequest, and the
one table that turns domain errors into gRPC status codes (the HTTP API's codes, spoken in gRPC).

Ray Serve's gRPC proxy calls the Ingress methods named after the RPCs (`Generate`, `ListAdapters`) with the
request proto and a `grpc_context`; they delegate here. Start Serve with

    serve.start(grpc_options={"port": 9000, "grpc_servicer_functions": GRPC_SERVICER_FUNCTIONS})

(cluster.app.GRPC_SERVICER_FUNCTIONS) and call it with the `application` metadata naming the Serve app:

    stub = lorafleet_pb2_grpc.LoRAFleetStub(grpc.insecure_channel("127.0.0.1:9000"))
    for chunk in stub.Generate(lorafleet_pb2.GenerateRequest(prompt="Hi", adapter="demo-sql", max_tokens=16),
                               metadata=(("application", "lorafleet"),)):
        print(chunk.text, end="")
"""

from __future__ import annotations

import json
import secrets
from typing import Any, AsyncIterator

import grpc

from cluster.errors import remote_cause
from cluster.proto import lorafleet_pb2 as pb
from cluster.server import GenerateRequest
from replicas.errors import InvalidRequestError
from replicas.outputs import CompletionDeltas

GRPC_SERVICER_FUNCTIONS = ["cluster.proto.lorafleet_pb2_grpc.add_LoRAFleetServicer_to_server"]

# HTTP status (cluster.api.ERROR_STATUS) -> gRPC status code
_HTTP_TO_GRPC = {
    400: grpc.StatusCode.INVALID_ARGUMENT,
    401: grpc.StatusCode.UNAUTHENTICATED,
    404: grpc.StatusCode.NOT_FOUND,
    429: grpc.StatusCode.RESOURCE_EXHAUSTED,
    503: grpc.StatusCode.UNAVAILABLE,
}
_CHAT_ROLES = ("system", "user", "assistant", "tool")
_OPTIONAL_SAMPLING = ("temperature", "top_p", "top_k", "min_p", "seed", "presence_penalty", "frequency_penalty",
                      "repetition_penalty", "n", "min_tokens", "logprobs", "prompt_logprobs", "truncate_prompt_tokens",
                      "skip_special_tokens")
# Repeated, map and plain bool fields: proto3 cannot tell unset from empty or false, and either means the default,
# so only those given travel.
_GIVEN_SAMPLING = ("stop", "stop_token_ids", "ignore_eos", "logit_bias", "allowed_token_ids", "bad_words",
                   "include_stop_str_in_output")
_STRUCTURED = ("json", "json_object", "regex", "choice", "grammar", "disable_any_whitespace")


def _plain(value: Any) -> Any:
    """A proto field's value as Python's own: a map's as a dict, a repeated field's as a list."""
    if isinstance(value, (bool, int, float, str)):
        return value
    return dict(value) if hasattr(value, "items") else list(value)


def grpc_status(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The gRPC status code and details for an error, following the HTTP API's mapping."""
    from ray.exceptions import RayActorError
    from ray.serve.exceptions import DeploymentUnavailableError

    from cluster.api import ERROR_STATUS

    exc = remote_cause(exc)
    if isinstance(exc, (RayActorError, DeploymentUnavailableError)):  # a replica died or is not up yet
        return grpc.StatusCode.UNAVAILABLE, f"the engine is unavailable: {exc}"
    for types, status, _kind in ERROR_STATUS:
        if isinstance(exc, types):
            return _HTTP_TO_GRPC.get(status, grpc.StatusCode.INTERNAL), str(exc)
    return grpc.StatusCode.INTERNAL, f"{type(exc).__name__}: {exc}"


def _metadata(grpc_context: Any) -> dict[str, str]:
    if grpc_context is None:
        return {}
    return {k.lower(): v for k, v in grpc_context.invocation_metadata()}


def check_api_key(grpc_context: Any, api_keys: list[str] | None) -> None:
    """With API keys configured, require `authorization: Bearer <key>` metadata (as the HTTP API does)."""
    if not api_keys or grpc_context is None:  # no keys, or an in-cluster Python handle call
        return
    from cluster.errors import AuthenticationError

    header = _metadata(grpc_context).get("authorization", "")
    token = header[len("bearer "):] if header.lower().startswith("bearer ") else ""
    if not any(secrets.compare_digest(token.encode(), k.encode()) for k in api_keys):
        raise AuthenticationError("missing or invalid API key (metadata authorization: Bearer ...)")


def request_from_proto(msg: pb.GenerateRequest, model_name: str, default_max_tokens: int) -> GenerateRequest:
    """The engine request for a GenerateRequest proto; InvalidRequestError names each bad field."""
    problems: list[tuple[str, str]] = []
    given = [name for name, present in (("prompt", bool(msg.prompt)), ("prompt_token_ids", bool(msg.prompt_token_ids)),
                                        ("messages", bool(msg.messages))) if present]
    if len(given) != 1:
        problems.append(("prompt", "set exactly one of prompt, prompt_token_ids or messages"
                                   + (f" (got {', '.join(given)})" if given else "")))
    for i, m in enumerate(msg.messages):
        if m.role not in _CHAT_ROLES:
            problems.append((f"messages[{i}].role", f"messages[{i}].role must be one of {_CHAT_ROLES}, got {m.role!r}"))
    if msg.HasField("max_tokens") and msg.max_tokens < 1:
        problems.append(("max_tokens", f"max_tokens must be >= 1, got {msg.max_tokens}"))
    template_kwargs = None
    if msg.chat_template_kwargs:
        try:
            template_kwargs = json.loads(msg.chat_template_kwargs)
        except ValueError as exc:
            problems.append(("chat_template_kwargs", f"chat_template_kwargs is not JSON: {exc}"))
        if not msg.messages:
            problems.append(("chat_template_kwargs", "chat_template_kwargs needs messages"))
    if problems:
        raise InvalidRequestError(problems)

    sampling: dict[str, Any] = {"max_tokens": msg.max_tokens if msg.HasField("max_tokens") else default_max_tokens}
    for name in _OPTIONAL_SAMPLING:
        if msg.HasField(name):
            sampling[name] = getattr(msg, name)
    for name in _GIVEN_SAMPLING:
        if value := getattr(msg, name):
            sampling[name] = _plain(value)
    if msg.HasField("structured_outputs"):
        so = msg.structured_outputs
        sampling["structured_outputs"] = {name: _plain(v) for name in _STRUCTURED if (v := getattr(so, name))}

    model = msg.adapter or model_name
    extra: dict = {"shows_token_ids": True}  # each GenerateResponse carries its token ids
    if msg.request_id:
        extra["request_id"] = msg.request_id
    if msg.HasField("priority"):
        extra["priority"] = msg.priority
    if msg.messages:
        messages = [{"role": m.role, "content": m.content} for m in msg.messages]
        return GenerateRequest(model, sampling, messages=messages, chat_template_kwargs=template_kwargs, **extra)
    prompt: str | dict = {"prompt_token_ids": list(msg.prompt_token_ids)} if msg.prompt_token_ids else msg.prompt
    return GenerateRequest(model, sampling, prompt=prompt, **extra)


def _with_status(grpc_context: Any, exc: BaseException) -> None:
    """Put exc's status on the Serve gRPC context; the caller re-raises so Serve's proxy sends that code."""
    code, details = grpc_status(exc)
    if grpc_context is not None:
        grpc_context.set_code(code)
        grpc_context.set_details(details)


async def generate_stream(backend: Any, msg: pb.GenerateRequest, grpc_context: Any = None,
                          api_keys: list[str] | None = None) -> AsyncIterator[pb.GenerateResponse]:
    """LoRAFleet.Generate: one GenerateResponse per engine step with the new text and token ids (per completion,
    with its index, when the request asks for n > 1)."""
    try:
        check_api_key(grpc_context, api_keys)
        request = request_from_proto(msg, backend.model_name, backend.default_max_tokens)
        deltas, started = CompletionDeltas(), set()
        async for out in backend.generate(request):
            for c, delta_text, delta_ids, last in deltas(out):  # n > 1: a response per completion, by index
                response = pb.GenerateResponse(
                    text=delta_text, token_ids=delta_ids, request_id=out.request_id, index=c.index,
                    finish_reason=(c.finish_reason or "") if last else "",
                    stop_reason="" if c.stop_reason is None or not last else str(c.stop_reason),
                    prompt_tokens=len(out.prompt_token_ids or []), completion_tokens=len(c.token_ids))
                if c.logprobs is not None and delta_ids:  # the entries of the tokens new in this response
                    response.logprobs.extend(map(_token_logprob, delta_ids, c.logprobs[-len(delta_ids):]))
                if out.prompt_logprobs is not None and c.index not in started:
                    response.prompt_logprobs.extend(map(_token_logprob, out.prompt_token_ids, out.prompt_logprobs))
                started.add(c.index)
                yield response
    except Exception as exc:  # noqa: BLE001 - becomes the RPC's status code
        _with_status(grpc_context, exc)
        raise


def _token_logprob(token: int, entry: dict[int, float] | None) -> pb.TokenLogprob:
    """A token's {token: logprob} entry (its own and its step's top k) as a message; None: no logprob."""
    if entry is None:
        return pb.TokenLogprob(token_id=token)
    top = sorted(entry.items(), key=lambda kv: -kv[1])
    return pb.TokenLogprob(token_id=token, logprob=entry[token],
                           top=[pb.TopLogprob(token_id=t, logprob=v) for t, v in top])


async def list_adapters(backend: Any, grpc_context: Any = None,
                        api_keys: list[str] | None = None) -> pb.ListAdaptersResponse:
    """LoRAFleet.ListAdapters: the base model first, then every registered adapter by name."""
    try:
        check_api_key(grpc_context, api_keys)
        cards = await backend.models()
    except Exception as exc:  # noqa: BLE001
        _with_status(grpc_context, exc)
        raise
    adapters = [pb.Adapter(name=c["id"], source=str(c.get("root") or ""), parent=c.get("parent") or "")
                for c in cards]
    return pb.ListAdaptersResponse(base_model=backend.model_name, adapters=adapters)
