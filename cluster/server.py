"""LoRAServer: one replica's serving logic, a plain class (the Serve deployment is a thin shell around it).

It owns an AsyncLLMEngine, knows which adapter names it serves and where they
come from, turns OpenAI-style requests into engine requests and reports the
routing stats the adapter-affinity router reads. Adapters named by a request
but not loaded here are pulled from the AdapterCatalog (the cluster's shared
adapter tier, or a local one in tests) and added to the engine on demand.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, AsyncIterator, Protocol

from cluster.adapter_names import DYNAMIC_NAME
from cluster.errors import AdapterNotFoundError
from cluster.replica_metrics import ReplicaMetrics, RequestTiming, Sample
from cluster.reasoning import ReasoningParser
from cluster.server_config import ServerConfig
from cluster.tool_parsers import ToolParser
from lora_core.adapter_fit import AdapterFit
from lora_core.errors import InvalidAdapterError
from lora_core.peft_helper import PEFTHelper
from lora_core.request import LoRARequest
from replicas.async_engine import AsyncLLMEngine
from replicas.chat_template import chat_prompt_ids
from replicas.errors import InvalidRequestError
from replicas.lora_setup import served_adapter_fit
from replicas.outputs import RequestOutput


logger = logging.getLogger(__name__)

ADAPTER_GPU_HIT, ADAPTER_HOST_HIT, ADAPTER_TIER_LOAD = "gpu", "host", "object_store"


class AdapterCatalog(Protocol):
    """Where adapters live cluster-wide: name -> local directory, fetched once per cluster."""

    async def register(self, name: str, uri: str, fit: AdapterFit | None = None) -> None: ...  # all or nothing
    async def unregister(self, name: str) -> None: ...
    async def lookup(self, name: str) -> str | None: ...  # the uri, or None if unknown
    async def local_path(self, name: str) -> Path: ...  # a directory with adapter_config.json + safetensors
    async def release(self, path: str) -> None: ...  # a local_path the engine no longer reads
    async def registered(self) -> dict[str, str]: ...


@dataclass
class GenerateRequest:
    """One request as the ingress hands it to a replica; ``messages`` (chat) replaces ``prompt``."""

    model: str
    sampling: dict[str, Any]
    prompt: str | dict | None = None
    messages: list[dict[str, Any]] | None = None  # as chat templates read them (tool_calls.template_messages)
    add_generation_prompt: bool = True
    request_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    priority: int = 0  # lower first, where the engine's scheduling_policy is "priority"
    tools: list[dict[str, Any]] | None = None  # chat: OpenAI's tools, for the chat template
    continue_final_message: bool = False  # chat: the last message carried on (replicas/chat_template.py)
    chat_template_kwargs: dict[str, Any] | None = None  # chat: more template variables (Qwen3's enable_thinking)
    # Its caller keeps only the last output (no stream): a replica lost midway may be replaced by a fresh run
    restartable: bool = False
    # Its caller sees token ids (Python handle, gRPC), not only text: any token it was sent counts as seen
    shows_token_ids: bool = False


@dataclass
class _NameLock:
    """One adapter name's load lock, and how many requests hold or wait for it."""

    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    users: int = 0


class LoRAServer:
    def __init__(self, config: ServerConfig, catalog: AdapterCatalog) -> None:
        self.config = config
        self.catalog = catalog
        model_dir = config.model
        self._demo_adapters: dict[str, str] = {}
        if config.model == "demo":
            from replicas.demo_checkpoint import ensure_demo_checkpoint

            demo = ensure_demo_checkpoint()
            model_dir = str(demo.model_dir)
            self._demo_adapters = {name: str(path) for name, path in demo.adapters.items()}
        self.model_dir = model_dir
        self.model_name = config.served_model_name or ("lorafleet-demo" if config.model == "demo"
                                                      else os.path.basename(os.path.normpath(model_dir)))
        args = config.engine_args(model_dir)
        self.engine = self._make_engine(args)
        # what the catalog checks an adapter against before registering it
        self.fit = served_adapter_fit(model_dir, args.lora_config())
        self.tokenizer = self.engine.engine.tokenizer
        # name -> the engine's adapter serving it now. Each load is the engine's own adapter (named
        # "<name>#<id>"), so a re-pointed name's new weights load beside the old ones while requests finish on those.
        self._loaded: dict[str, LoRARequest] = {}
        self._loaded_uri: dict[str, str] = {}  # the source each loaded adapter came from
        # Adapters no longer serving their name (unloaded, re-pointed), by id: the engine drops each once no
        # running request uses it.
        self._retiring: dict[int, LoRARequest] = {}
        self._loading: dict[str, _NameLock] = {}  # one load at a time per adapter name
        self._ids = itertools.count(1)
        self._inflight = 0
        # Where each adapter request found its adapter (the tier itself counts origin fetches).
        self.adapter_events: collections.Counter[str] = collections.Counter()
        self.metrics = ReplicaMetrics()  # the operators' (cluster/replica_metrics.py)
        self._ranks: dict[str, int] = {}  # each loaded adapter's rank, the label of its requests' timings

    async def start(self) -> None:
        """Register the demo and configured adapters in the catalog (idempotent across replicas). A configured
        adapter this deployment cannot serve fails the start; a demo adapter is left out, with a warning."""
        preload = self.config.preload_adapters
        for name, uri in {**self._demo_adapters, **preload}.items():
            if await self.catalog.lookup(name) is None:
                try:
                    await self.catalog.register(name, uri, self.fit)
                except InvalidAdapterError as exc:
                    if name in preload:
                        raise
                    logger.warning("demo adapter %s not served by this deployment: %s", name, exc.reason)

    # ---- adapters -------------------------------------------------------------------------

    async def load_adapter(self, name: str, uri: str) -> None:
        """Register cluster-wide (the catalog fetches it once and checks it against this model's layers and
        limits) and load it here; a failure leaves the name as it was (unknown, or serving its old weights)."""
        if name == self.model_name:
            raise InvalidRequestError([("lora_name", f"{name!r} is the base model's name")])
        previous = await self.catalog.lookup(name)
        await self.catalog.register(name, uri, self.fit)
        try:
            await self.sync_registry()  # a re-point: the new weights serve from now on, the old finish what runs
            await self._ensure_loaded(name)
        except Exception:
            await asyncio.shield(self._restore(name, previous))
            raise

    async def _restore(self, name: str, uri: str | None) -> None:
        """Point name back at uri (None: unregister it) after a load that failed past the catalog."""
        if uri is None:
            await self._unregister_quietly(name)
        else:
            await self.catalog.register(name, uri, self.fit)

    async def unload_adapter(self, name: str) -> None:
        """Unregister cluster-wide; from now on no request for name is served here (those running finish)."""
        if await self.catalog.lookup(name) is None and name not in self._loaded:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        await self.catalog.unregister(name)
        await self.sync_registry()

    async def _ensure_loaded(self, name: str) -> LoRARequest:
        if self._retiring:
            await self._drain_retiring()
        request = self._loaded.get(name)
        if request is not None:
            gpu = name in self.routing_stats()["gpu_adapters"]
            self.adapter_events[ADAPTER_GPU_HIT if gpu else ADAPTER_HOST_HIT] += 1
            return request
        # Concurrent first requests for one adapter share one load: a second would read the tier again and put a
        # second copy of the adapter in the engine.
        # The entry lives while requests use it, so the names that never load (any string a client sends)
        # leave nothing behind.
        entry = self._loading.setdefault(name, _NameLock())
        entry.users += 1
        try:
            async with entry.lock:
                if name in self._loaded:
                    return await self._ensure_loaded(name)  # loaded while this request waited: a hit
                return await self._load(name)
        finally:
            entry.users -= 1
            if not entry.users:
                del self._loading[name]

    async def _load(self, name: str) -> LoRARequest:
        """Fetch (through the cluster tier) and add the adapter called name; registers it first where only
        dynamic loading knows it."""
        start = time.monotonic()
        uri = await self.catalog.lookup(name)
        dynamic = uri is None
        if dynamic:
            uri = await self._register_dynamic(name)
        path = None
        try:
            path = await self.catalog.local_path(name)  # the cluster tier: object store, or its origin once
            lora_id = next(self._ids)
            request = LoRARequest(f"{name}#{lora_id}", lora_id, str(path))
            try:
                await self.engine.add_lora(request)
            except InvalidAdapterError as exc:  # the caller knows the adapter by its uri, not by our copy
                raise exc.relocated(str(path), uri) from None
            rank = PEFTHelper.from_local_dir(path).max_rank  # the metrics' label: costs a small JSON read
        except Exception as exc:
            self.metrics.load_failed(exc)
            if path is not None:
                await self.catalog.release(str(path))
            if dynamic:  # a broken adapter does not stay registered
                await asyncio.shield(self._unregister_quietly(name))
            raise
        self._loaded[name] = request
        self._loaded_uri[name] = uri
        self._ranks[name] = rank
        self.adapter_events[ADAPTER_TIER_LOAD] += 1
        self.metrics.load_seconds.observe(time.monotonic() - start)
        return request

    async def _register_dynamic(self, name: str) -> str:
        """Register <dynamic_lora_loading_path>/<name> for an unregistered name (fetched once per cluster);
        AdapterNotFoundError where there is no such path, or the name cannot be one."""
        root = self.config.dynamic_lora_loading_path
        unknown = f"model {name!r} does not exist: not the base model ({self.model_name!r}) nor a registered adapter"
        if root is None:
            raise AdapterNotFoundError(unknown)
        if not DYNAMIC_NAME.fullmatch(name):
            raise AdapterNotFoundError(f"{unknown}, and not a name that dynamic loading takes (letters, digits, "
                                       f"'.', '_' and '-', starting with a letter or digit)")
        uri = f"{root}/{name}"
        try:
            await self.catalog.register(name, uri, self.fit)
        except AdapterNotFoundError:
            raise AdapterNotFoundError(f"{unknown}, and {uri} holds no adapter") from None
        return uri

    async def _unregister_quietly(self, name: str) -> None:
        try:
            await self.catalog.unregister(name)
        except AdapterNotFoundError:
            pass  # another replica's failed load took it back already

    async def sync_registry(self, registered: dict[str, str] | None = None) -> None:
        """Take the cluster's registry (the catalog's now, by default): an adapter loaded here that was
        unregistered or re-pointed serves no later request (a re-pointed name loads its new weights on the next
        one); requests running on it finish, and the engine drops it once none does."""
        registered = await self.catalog.registered() if registered is None else registered
        for name in [n for n, uri in self._loaded_uri.items() if registered.get(n) != uri]:
            request = self._loaded.pop(name)
            del self._loaded_uri[name]
            self._ranks.pop(name, None)
            self._retiring[request.lora_int_id] = request
        await self._drain_retiring()

    async def _drain_retiring(self) -> None:
        """Drop from the engine every retiring adapter no running request uses (the others on a later call);
        safe to run concurrently: each adapter leaves the list once, by its id."""
        for lora_id, request in list(self._retiring.items()):
            start = time.monotonic()
            try:
                await self.engine.remove_lora(request.lora_name)  # False where the engine no longer has it
            except InvalidRequestError:  # still in use: a later call tries again
                continue
            if self._retiring.pop(lora_id, None) is not None:
                self.metrics.unload_seconds.observe(time.monotonic() - start)
                await self.catalog.release(request.lora_path)

    async def models(self) -> list[dict[str, Any]]:
        created = int(time.time())
        common = dict(object="model", created=created, owned_by="lorafleet",
                      max_model_len=self.engine.engine.max_model_len)  # vLLM's: prompt + output tokens at most
        cards = [dict(id=self.model_name, root=self.model_dir, parent=None, **common)]
        for name, uri in sorted((await self.catalog.registered()).items()):
            cards.append(dict(id=name, root=uri, parent=self.model_name, **common))
        return cards

    # ---- generation -----------------------------------------------------------------------

    async def generate(self, request: GenerateRequest) -> AsyncIterator[RequestOutput]:
        """Cumulative outputs of one request; typed errors for a bad model name, prompt or parameter."""
        if "output_kind" in request.sampling:  # the replica coalesces and encodes cumulative outputs
            raise InvalidRequestError([("output_kind", "output_kind is not a request's to set here: streams carry "
                                        "what is new in each chunk already")])
        lora = None if request.model == self.model_name else await self._ensure_loaded(request.model)
        prompt = request.prompt
        if request.messages is not None:
            ids = chat_prompt_ids(self.tokenizer, request.messages, request.add_generation_prompt, request.tools,
                                  request.continue_final_message, request.chat_template_kwargs)
            prompt = {"prompt_token_ids": ids}
        self._inflight += 1
        timing = RequestTiming(self.metrics, self._ranks.get(request.model, 0) if lora is not None else 0)
        try:
            async for output in self.engine.generate(prompt, request.sampling, request.request_id, lora,
                                                     priority=request.priority):
                timing.output(output)
                if lora is not None:
                    output.lora_name = request.model  # the engine's is this load's own ("<name>#<id>")
                yield output
        finally:  # also where the consumer stops at the finished output and closes this generator
            self._inflight -= 1
            timing.done()

    def routing_stats(self) -> dict[str, Any]:
        """What the router reads: adapters resident on GPU / in host memory, free slots, queue depth; and the
        adapter merged into the base weights now (None) with the merges so far (replicas/lora_merge.py); adapter
        load worker processes replaced after one died (replicas/lora_load_process.py)."""
        manager = getattr(self.engine.engine.executor.runner, "lora_manager", None)  # rank 0's, read, not called
        by_id = {r.lora_int_id: name for name, r in self._loaded.items()}
        gpu = [by_id[i] for i in list(manager.lora_index_to_id) if i in by_id] if manager else []
        host = [by_id[i] for i in list(manager.list_adapters()) if i in by_id] if manager else []
        max_loras = len(manager.lora_index_to_id) if manager else 0
        merged, merges = self.merge_state()
        return dict(gpu_adapters=gpu, host_adapters=host, free_slots=max_loras - len(gpu),
                    queue_len=self._inflight, max_loras=max_loras,
                    adapter_events=dict(self.adapter_events),  # where adapter requests found their adapter
                    merged_adapter=merged, lora_merges=merges, load_worker_restarts=self.load_worker_restarts())

    def metrics_samples(self) -> list[Sample]:
        """The operators' metrics of this replica, as Prometheus samples (cluster/replica_metrics.py)."""
        manager = getattr(self.engine.engine.executor.runner, "lora_manager", None)  # rank 0's, read in place
        scheduler = self.engine.engine.scheduler
        engine = {"running": scheduler.num_running, "waiting": scheduler.num_waiting}
        return self.metrics.samples(self.routing_stats(), manager.memory_bytes() if manager else {},
                                    dict(self.adapter_events), engine)

    def load_worker_restarts(self) -> int:
        """Rank 0's adapter load worker pools replaced after a worker died."""
        loads = getattr(self.engine.engine.executor.runner, "loads", None)  # rank 0's, read in place
        return loads.worker_restarts if loads is not None else 0

    def merge_state(self) -> tuple[str | None, int]:
        """The adapter running merged into the base weights now (None) and the merges so far."""
        merged_id, merges = self.engine.engine.executor.runner.lora_merge_state()  # rank 0's, read in place
        merged = next((name for name, r in self._loaded.items() if r.lora_int_id == merged_id), None)
        return merged, merges

    def _make_engine(self, args):
        """The engine this server drives; the emulated replicas of the benchmarks override only this."""
        return AsyncLLMEngine(args)

    @property
    def default_max_tokens(self) -> int:
        return self.config.default_max_tokens

    @property
    def tool_parser(self) -> ToolParser | None:
        return self.config.tool_parser

    @property
    def reasoning_parser(self) -> ReasoningParser | None:
        return self.config.reasoning

    def decode_token(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False)

    @property
    def max_model_len(self) -> int:
        return self.engine.engine.max_model_len

    async def shutdown(self) -> None:
        await self.engine.shutdown()
