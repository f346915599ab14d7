"""The Serve deployments: thin shells around LoRAServer (replicas) and the HTTP API (ingress).

    Ingress (FastAPI, CPU) --handle--> LoRAReplica x N (GPU, AdapterAffinityRouter)
                  \\___________ shared adapter-tier actor ___________/

Python callers use the ingress handle:

    handle = serve.get_app_handle("lorafleet")
    out = await handle.generate.remote(prompt="Hi", adapter="demo-sql", max_tokens=16)
    async for chunk in handle.options(stream=True).generate.remote(prompt="Hi", stream=True):
        ...
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import os
import uuid
from pathlib import Path
from typing import Any, AsyncIterator

from ray import serve
from ray.serve.exceptions import BackPressureError

from cluster.adapter_tier_actor import get_or_create_adapter_tier
from cluster.api import build_api, is_domain_error
from cluster.autoscaling import RecentAdapters, replica_autoscaling_stats
from cluster.errors import OverloadedError, ReplicaUnavailableError, is_replica_loss
from cluster.output_stream import DeltaDecoder, DeltaEncoder, coalesced, output_dict
from cluster.prometheus import text
from cluster.replica_metrics import get_or_create_metrics_board, render
from cluster.router import decisions_text
from cluster.request_limits import MAX_PROMPT_CHARS, check_prompt_chars, prompt_chars
from cluster.response_store_actor import SharedResponses, get_or_create_response_store
from cluster.server import GenerateRequest, LoRAServer
from cluster.server_config import ServerConfig
from cluster.sources import SourceSettings
from cluster.tier_catalog import TierCatalog
from lora_core.adapter_fit import AdapterFit
from replicas.lora_setup import served_adapter_fit


logger = logging.getLogger(__name__)

# A lost replica's request runs once more elsewhere (GenerateRequest.restartable: also after it had output).
REPLICA_LOSS_RETRIES = 1
# The key of the stream item that carries a request's own error from the replica to the ingress.
ERROR_ITEM = "raise"


def _tier(tier_config: dict[str, Any], server: dict[str, Any]):
    """The shared adapter-tier actor (created by whichever deployment asks first)."""
    config = dict(tier_config)
    sources = dict(config.pop("sources", {}))
    roots = [os.path.abspath(os.path.expanduser(p)) for p in sources.get("allowed_local_roots", [])]
    if server.get("model", "demo") == "demo":  # the demo adapters are local directories in the cache
        from replicas.demo_checkpoint import ensure_demo_checkpoint

        roots.append(str(Path(next(iter(ensure_demo_checkpoint().adapters.values()))).parent))
    sources["allowed_local_roots"] = roots
    if config.get("registry_dir"):
        config["registry_dir"] = os.path.expanduser(config["registry_dir"])
    # Detached: an actor's non-detached child dies with it, so the tier would die for good with the
    # replica that happened to create it (killed, or scaled down), taking every replica's handle along.
    config.setdefault("detached", True)
    return get_or_create_adapter_tier(source_settings=SourceSettings(**sources), **config)


def _replica_id() -> str:
    """This Serve replica's id, the `replica` label of its metrics."""
    try:
        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - outside a Serve replica (a test building the class): any unique name
        return uuid.uuid4().hex[:8]


class LoRAReplica:
    """One engine replica; `record_routing_stats` feeds the adapter-affinity router."""

    def __init__(self, server: dict[str, Any], tier: dict[str, Any]) -> None:
        self.server = LoRAServer(ServerConfig(**server), TierCatalog(_tier(tier, server)))
        self._started = asyncio.Lock()
        self._ready = False
        self._following: asyncio.Task | None = None
        self._board = get_or_create_metrics_board()  # where the app's /metrics finds this replica's
        self._replica_id = _replica_id()
        self._recent_adapters = RecentAdapters()  # the autoscaler's working set (record_autoscaling_stats)

    async def _start(self) -> None:
        self._follow_registry()
        async with self._started:
            if not self._ready:
                await self.server.start()
                self._ready = True

    def _follow_registry(self) -> None:
        """Apply the cluster registry's changes as they happen, so that an unload that returned has reached
        this replica (TierCatalog.follow); started with the replica's first call, its routing stats."""
        if self._following is None:
            self._following = asyncio.get_running_loop().create_task(
                self.server.catalog.follow(self.server.sync_registry))

    async def generate(self, request: GenerateRequest) -> AsyncIterator[dict]:
        """The request's outputs as cluster/output_stream.py's deltas (the ingress rebuilds them), at most one
        per ServerConfig.stream_interval_ms. The request's own error (a bad parameter, an unknown adapter) ends
        the stream as an item the ingress raises: a failed call would log Ray's traceback for a client error."""
        await self._start()
        if request.model != self.server.model_name:
            self._recent_adapters.add(request.model)
        encoder = DeltaEncoder()
        try:
            async for out in coalesced(self.server.generate(request), self.server.config.stream_interval_ms / 1e3):
                yield encoder.encode(out)
        except Exception as exc:  # noqa: BLE001 - the domain errors travel; a fault raises as it is
            if not is_domain_error(exc):
                raise
            yield {ERROR_ITEM: exc}

    async def models(self) -> list[dict]:
        await self._start()
        return await self.server.models()

    async def record_routing_stats(self) -> dict[str, Any]:
        """What the router reads (LoRAServer.routing_stats), polled by Serve every routing-stats period; the
        replica's metrics go to the board at the same pace (not awaited: a slow board holds up no routing)."""
        self._follow_registry()
        try:
            self._board.report.remote(self._replica_id, self.server.metrics_samples())
        except Exception:  # noqa: BLE001 - metrics never cost the router its stats
            logger.warning("replica metrics snapshot failed", exc_info=True)
        stats = self.server.routing_stats()
        stats["base_model"] = self.server.model_name
        return stats

    async def record_autoscaling_stats(self) -> dict[str, float]:
        """What the adapter-aware autoscaling policy reads (cluster/autoscaling.py), collected by Serve when the
        deployment autoscales: requests here and running, adapter loads in flight, distinct adapters asked for
        lately, and what the engine holds at once."""
        stats = self.server.routing_stats()
        return replica_autoscaling_stats(
            ongoing=stats["queue_len"], running=self.server.engine.engine.scheduler.num_running,
            pending_loads=len(self.server._loading),  # adapter names loading now (one load per name)
            recent_adapters=len(self._recent_adapters), max_num_seqs=self.server.engine.args.max_num_seqs,
            max_loras=stats["max_loras"])

    async def check_health(self) -> None:
        if not self.server.engine.is_running:
            raise RuntimeError("the engine stopped")

    async def __del__(self) -> None:  # Serve calls this when the replica shuts down
        if self._following is not None:
            self._following.cancel()
        await self.server.shutdown()


class _ReplicaBackend:
    """What cluster.api needs, over a handle to the replica deployment."""

    def __init__(self, replicas, catalog: TierCatalog, model_name: str, default_max_tokens: int) -> None:
        self.replicas, self.catalog = replicas, catalog
        self.model_name, self.default_max_tokens = model_name, default_max_tokens
        self.tool_parser = None  # the Ingress sets the server's (ServerConfig.tool_call_parser)
        self.reasoning_parser = None  # ... and ServerConfig.reasoning_parser's
        self._decode = None
        self.fit: AdapterFit | None = None  # what an adapter must fit to register (the Ingress sets its model's)
        self.replica_loss_retries = 0  # requests run again elsewhere after their replica was lost
        self.max_prompt_chars = MAX_PROMPT_CHARS  # the Ingress sets its ServerConfig's

    def metrics_text(self) -> str:
        """This ingress's own counters, in Prometheus text format."""
        name = "lorafleet_requests_retried_after_replica_loss_total"
        return text([(name, {}, self.replica_loss_retries)],
                    {name: ("counter", "Requests run again on another replica after theirs was lost")})

    async def generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        """The request's outputs from a replica. A replica lost before the request produced output (or at any
        point, for a restartable request, whose caller keeps only the last) is replaced: the request runs
        once more on another (the router has dropped the dead one); lost again, or after output has gone
        out, it is a ReplicaUnavailableError (HTTP 503). Prompt text over max_prompt_chars is refused before
        anything runs, whichever API sent it (HTTP checks it per field first; gRPC and the Python handle here)."""
        check_prompt_chars("prompt", prompt_chars(request), self.max_prompt_chars)
        for attempt in range(REPLICA_LOSS_RETRIES + 1):
            produced = False
            held = None  # an output the caller would show nothing of yet: kept back, a later one holds it too
            try:
                async for out in self.call_generate(request):
                    if produced or _shows_something(out, request):
                        produced, held = True, None
                        yield out
                    else:
                        held = out
                if held is not None:
                    yield held
                return
            except BackPressureError as exc:  # every replica's queue is full (max_queued_requests): HTTP 429
                raise OverloadedError(f"all replicas are at capacity, retry later ({exc})") from exc
            except Exception as exc:  # noqa: BLE001 - only a lost replica is handled here
                if not is_replica_loss(exc):
                    raise
                if (produced and not request.restartable) or attempt == REPLICA_LOSS_RETRIES:
                    raise ReplicaUnavailableError(
                        "the replica serving this request stopped" + (" after it had started answering"
                                                                       if produced else "; retry later")) from None
                logger.warning("request %s: its replica was lost (%s); running it on another",
                               request.request_id, type(exc).__name__)
                self.replica_loss_retries += 1

    def call_generate(self, request: GenerateRequest) -> AsyncIterator[Any]:
        """The replicas' generate stream as cumulative RequestOutputs, called under an internal request id of its
        own: a handle call takes the HTTP request's, and the prompts of one completions request
        (cluster/prompt_batch.py), sharing it, collided in Serve's and the router's bookkeeping: all but one
        never ran. remote() reads the context when called, so it is called here, not when iterated."""
        from ray.serve import context  # Serve's request context: private, read and set as Serve itself does

        current = context._get_serve_request_context()
        token = context._serve_request_context.set(
            dataclasses.replace(current, _internal_request_id=uuid.uuid4().hex))
        try:
            items = self.replicas.options(stream=True).generate.remote(request)
        finally:
            context._serve_request_context.reset(token)
        return _decoded(items)

    async def models(self) -> list[dict]:
        return await self.replicas.models.remote()

    async def load_adapter(self, name: str, uri: str) -> None:
        if name == self.model_name:
            from replicas.errors import InvalidRequestError

            raise InvalidRequestError([("lora_name", f"{name!r} is the base model's name")])
        # fetched once for every replica, and checked against this deployment's model and limits before it
        # counts as registered, or its first request would fail instead; a failure changes nothing
        await self.catalog.register(name, uri, self.fit)

    async def unload_adapter(self, name: str) -> None:
        from cluster.errors import AdapterNotFoundError

        if await self.catalog.lookup(name) is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        await self.catalog.unregister(name)

    @property
    def tokenizer(self):
        """The base model's tokenizer, loaded here on first use (decoding logprobs' tokens, /tokenize)."""
        if self._decode is None:
            from replicas.tokenizer import Tokenizer

            self._decode = Tokenizer.from_pretrained(self.model_dir)
        return self._decode

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)


@serve.ingress()
class Ingress:
    """HTTP + Python-handle + gRPC entry point."""

    def __init__(self, replicas, server: dict[str, Any], tier: dict[str, Any],
                 api_keys: list[str] | None = None) -> None:
        config = ServerConfig(**server)
        self.catalog = TierCatalog(_tier(tier, server))
        model_name = config.served_model_name or ("lorafleet-demo" if config.model == "demo" else
                                                  config.model.rstrip("/").rsplit("/", 1)[-1])
        self.backend = _ReplicaBackend(replicas, self.catalog, model_name, config.default_max_tokens)
        self.backend.tool_parser, self.backend.reasoning_parser = config.tool_parser, config.reasoning
        if config.model == "demo":
            from replicas.demo_checkpoint import ensure_demo_checkpoint

            self.backend.model_dir = str(ensure_demo_checkpoint().model_dir)
        else:
            self.backend.model_dir = config.model
        self.backend.fit = served_adapter_fit(self.backend.model_dir,
                                              config.engine_args(self.backend.model_dir).lora_config())
        self.api_keys = api_keys
        self.api_limits = config.api_limits()  # build_api's request bounds
        self.backend.max_prompt_chars = config.max_prompt_chars

    def __serve_build_asgi_app__(self):
        # /v1/responses' store: one actor for every ingress replica, so a follow-up may land on any of them
        responses = SharedResponses(get_or_create_response_store())
        board = get_or_create_metrics_board()

        async def extra_metrics() -> str:  # this ingress's, the tier's, and every live replica's latest
            return (self.backend.metrics_text() + decisions_text() + await self.catalog.metrics_text()
                    + render(await board.live.remote()))

        return build_api(self.backend, self.api_keys, extra_metrics=extra_metrics, responses=responses,
                         **self.api_limits)

    async def generate(self, prompt: str | list[int] | None = None, adapter: str | None = None,
                       messages: list[dict] | None = None, stream: bool = False, priority: int = 0,
                       chat_template_kwargs: dict | None = None, **sampling: Any):
        """Python handle API: the final output as a dict, or (stream=True) an async iterator of them.
        chat_template_kwargs: more variables for the chat template that renders messages."""
        model = adapter or self.backend.model_name
        sampling.setdefault("max_tokens", self.backend.default_max_tokens)
        if isinstance(prompt, list):
            prompt = {"prompt_token_ids": prompt}
        request = GenerateRequest(model, sampling, prompt=prompt, messages=messages, priority=priority,
                                  chat_template_kwargs=chat_template_kwargs, restartable=not stream,
                                  shows_token_ids=True)
        outputs = self.backend.generate(request)
        if stream:
            return _relay(outputs)
        last = None
        async for out in outputs:
            last = out
        return None if last is None else output_dict(last)

    # gRPC (cluster/proto/lorafleet.proto): Serve's gRPC proxy calls the methods named after the RPCs.
    async def Generate(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        """LoRAFleet.Generate (server streaming): GenerateResponse chunks; errors become gRPC status codes."""
        from cluster.grpc_ingress import generate_stream

        async for chunk in generate_stream(self.backend, request, grpc_context, self.api_keys):
            yield chunk

    async def ListAdapters(self, request, grpc_context=None):  # noqa: N802 - the RPC's name
        """LoRAFleet.ListAdapters (unary): the base model and every registered adapter."""
        from cluster.grpc_ingress import list_adapters

        return await list_adapters(self.backend, grpc_context, self.api_keys)


async def _relay(outputs) -> AsyncIterator[dict]:
    async for out in outputs:
        yield output_dict(out)


def _shows_something(out: Any, request: GenerateRequest) -> bool:
    """Whether a caller of the API shows anything of this cumulative output: text, an end, or token ids where it
    sees them (Python handle, gRPC, or asked-for logprobs). A first token whose text the detokenizer still holds
    back shows an HTTP caller nothing, so a replica lost then leaves a request the caller saw no output of,
    which must run again elsewhere (the outputs are cumulative: holding one back loses nothing)."""
    if out.finished:
        return True
    wants_tokens = (request.shows_token_ids or request.sampling.get("logprobs") is not None
                    or request.sampling.get("prompt_logprobs") is not None)
    return any(c.text or (wants_tokens and c.token_ids) for c in out.outputs)


async def _decoded(items) -> AsyncIterator[Any]:
    """A replica's delta stream (cluster/output_stream.py) as the cumulative RequestOutputs it encodes; the
    request's own error, sent as an item, raised here."""
    decoder = DeltaDecoder()
    async for item in items:
        if ERROR_ITEM in item:
            raise item[ERROR_ITEM]
        yield decoder.decode(item)
