"""AdapterTier: the cluster's shared adapter cache, between the replicas' host caches and the origins.

It keeps the registry of adapters (adapter_registry.py: name -> source uri,
persisted so a restart forgets none, followed by the replicas), fetches an adapter from its origin once however many callers
miss on it at the same time, validates it with lora_core before anyone sees
it, and caches it LRU by bytes. Plain asyncio and no Ray: the actor in
adapter_tier_actor.py wraps it and stores each blob in the object store
through ``pack``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import tempfile
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import safetensors.numpy
import safetensors.torch
import torch

from cluster.adapter_registry import AdapterRegistry
from cluster.errors import AdapterNotFoundError, SourceUnavailableError
from cluster.prometheus import Histogram
from lora_core.adapter_fit import AdapterFit
from lora_core.errors import InvalidAdapterError
from lora_core.lora_model import WEIGHTS_NAME, LoRAModel
from lora_core.peft_helper import CONFIG_NAME

logger = logging.getLogger(__name__)

# The module suffixes a Llama-architecture model can take a LoRA on; qkv_proj and gate_up_proj are the fused
# modules of models that store them so (Phi-3), which the replicas split into q/k/v and gate/up.
LLAMA_LORA_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                      "qkv_proj", "gate_up_proj", "embed_tokens", "lm_head")
# Origin fetches at once. They wait on the network, not the CPU: the event loop's default executor
# (min(32, cpus + 4) threads) capped a cluster's cold starts at 32 fetches in flight, which flat popularity over
# thousands of adapters exceeds (the simulator's Zipf 0.8 cells: ~100 new adapters/s x 0.37 s a fetch).
DEFAULT_FETCH_CONCURRENCY = 128


@dataclass
class AdapterBlob:
    """One validated adapter as plain data: its adapter_config.json and its PEFT tensors.

    tensors maps the safetensors keys to numpy arrays, so that the object
    store hands same-node readers zero-copy (read-only) views. numpy has no
    bfloat16 or float8: such a tensor is kept as its raw bits (uint16 / uint8)
    and torch_dtypes names its real dtype ("bfloat16").
    """

    name: str
    uri: str
    config: dict[str, Any]
    tensors: dict[str, np.ndarray]
    torch_dtypes: dict[str, str] = field(default_factory=dict)
    nbytes: int = 0

    def __post_init__(self) -> None:
        if not self.nbytes:
            self.nbytes = sum(t.nbytes for t in self.tensors.values()) + len(json.dumps(self.config))


def materialize(blob: AdapterBlob, dest_dir: str | Path) -> Path:
    """Write blob as a PEFT directory (adapter_config.json + adapter_model.safetensors); return dest_dir."""
    dest = Path(dest_dir)
    dest.mkdir(parents=True, exist_ok=True)
    if blob.torch_dtypes:
        tensors = {k: _from_numpy(a, blob.torch_dtypes.get(k)) for k, a in blob.tensors.items()}
        safetensors.torch.save_file(tensors, str(dest / WEIGHTS_NAME), metadata={"format": "pt"})
    else:
        safetensors.numpy.save_file(blob.tensors, str(dest / WEIGHTS_NAME), metadata={"format": "pt"})
    (dest / CONFIG_NAME).write_text(json.dumps(blob.config, indent=2) + "\n", encoding="utf-8")
    return dest


def load_blob(name: str, uri: str, adapter_dir: str | Path,
              expected_lora_modules: Iterable[str] = LLAMA_LORA_MODULES, fit: AdapterFit | None = None) -> AdapterBlob:
    """Validate a fetched adapter directory with lora_core and read it into an AdapterBlob.

    fit, when given, also checks it against the served model's layers and the engine's limits. Raises
    lora_core's InvalidAdapterError subclass naming the file (under uri, not adapter_dir) and field at fault.
    """
    adapter_dir = Path(adapter_dir)
    try:
        if fit is not None:
            fit.check(adapter_dir)
        else:
            LoRAModel.from_local_checkpoint(adapter_dir, expected_lora_modules)
    except InvalidAdapterError as exc:
        raise exc.relocated(str(adapter_dir), uri) from None
    config = json.loads((adapter_dir / CONFIG_NAME).read_text(encoding="utf-8"))
    tensors: dict[str, np.ndarray] = {}
    torch_dtypes: dict[str, str] = {}
    for key, t in safetensors.torch.load_file(str(adapter_dir / WEIGHTS_NAME)).items():
        if t.dtype in _RAW_BITS:
            torch_dtypes[key] = str(t.dtype).removeprefix("torch.")
            t = t.view(_RAW_BITS[t.dtype])
        tensors[key] = t.numpy()
    return AdapterBlob(name, uri, config, tensors, torch_dtypes)


_RAW_BITS = {torch.bfloat16: torch.uint16, torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def _from_numpy(a: np.ndarray, torch_dtype: str | None) -> torch.Tensor:
    t = torch.from_numpy(np.array(a))  # a copy: object-store views are read-only
    return t.view(getattr(torch, torch_dtype)) if torch_dtype else t


@dataclass
class TierMetrics:
    """Plain counters; the Serve metrics exporter reads them."""

    origin_fetches: int = 0
    fetch_errors: int = 0
    hits: int = 0
    misses: int = 0
    evictions: int = 0
    bytes_cached: int = 0
    adapters_cached: int = 0
    # The latest fetch durations (origin download + validation), and all of them as a histogram.
    fetch_latencies_s: deque = field(default_factory=lambda: deque(maxlen=4096))
    fetch_seconds: Histogram = field(default_factory=Histogram)

    def as_dict(self) -> dict[str, Any]:
        return {**self.__dict__, "fetch_latencies_s": list(self.fetch_latencies_s),
                "fetch_seconds": dataclasses.asdict(self.fetch_seconds)}


@dataclass
class _Entry:
    value: Any  # what pack() made of the blob
    nbytes: int
    fit: AdapterFit | None = None  # what it was checked against beyond its format (load's fit)


class AdapterTier:
    """Registry + LRU-by-bytes cache of validated adapters, fetched once from their origins.

    parse_uri(uri) -> source (with source.fetch(dest_dir) -> Path) is
    cluster.sources.parse_adapter_uri bound to the deployment's settings.
    pack turns a fetched AdapterBlob into what get() returns and the cache
    holds (the actor passes ray.put); identity by default. registry_dir None
    keeps the registry in memory only.
    """

    def __init__(self, parse_uri: Callable[[str], Any], *, capacity_bytes: int,
                 registry_dir: str | Path | None = None, work_dir: str | Path | None = None,
                 expected_lora_modules: Iterable[str] = LLAMA_LORA_MODULES,
                 pack: Callable[[AdapterBlob], Any] = lambda blob: blob,
                 fetch_concurrency: int = DEFAULT_FETCH_CONCURRENCY) -> None:
        if isinstance(fetch_concurrency, bool) or not isinstance(fetch_concurrency, int) or fetch_concurrency < 1:
            raise ValueError(f"fetch_concurrency must be a positive integer, got {fetch_concurrency!r}")
        self._parse_uri = parse_uri
        self.fetch_concurrency = fetch_concurrency
        self._fetch_pool: ThreadPoolExecutor | None = None  # made on the first fetch (threads start lazily too)
        self.capacity_bytes = capacity_bytes
        self._work_dir = Path(work_dir) if work_dir is not None else None
        self._expected = tuple(expected_lora_modules)
        self._pack = pack
        self._registry = AdapterRegistry(registry_dir)
        self._cache: OrderedDict[str, _Entry] = OrderedDict()  # LRU first
        # (name, uri, fit, registers) -> the fetch that callers asking the same share
        self._inflight: dict[tuple[str, str, AdapterFit | None, bool], asyncio.Future] = {}
        self.metrics = TierMetrics()

    # ------------------------------------------------------------- registry

    def register(self, name: str, uri: str) -> None:
        """Register (or re-point) an adapter without fetching it; raises BadAdapterSourceError for a bad uri,
        nothing read. load() is the checked way."""
        self._parse_uri(uri)
        if self._registry.get(name) != uri:
            self._set(name, uri)

    def unregister(self, name: str) -> None:
        if self._registry.get(name) is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        self._set(name, None)

    def _set(self, name: str, uri: str | None) -> None:
        self._registry.set(name, uri)  # persisted first: raises with nothing changed
        self._drop(name)  # a cached copy came from the old uri

    def registered(self) -> dict[str, str]:
        return self._registry.names()

    @property
    def registry(self) -> AdapterRegistry:
        """The names, and their watchers (the replicas follow it: AdapterRegistry.watch)."""
        return self._registry

    async def load(self, name: str, uri: str, fit: AdapterFit | None = None) -> Any:
        """Fetch and check the adapter at uri, then register it as name (vLLM's load_lora_adapter): all or
        nothing. fit: the served model's layers and limits, checked too. A broken or unreachable adapter
        changes nothing: a new name stays unknown, and a name it would re-point keeps its old weights, served
        throughout. Concurrent loads of one name: the last to finish wins."""
        self._parse_uri(uri)  # a bad uri fails here, before any I/O
        entry = self._cache.get(name)
        if self._registry.get(name) == uri and entry is not None and fit in (None, entry.fit):
            self._cache.move_to_end(name)
            self.metrics.hits += 1
            return entry.value
        self.metrics.misses += 1
        return await self._shared_fetch(name, uri, fit, registers=True)

    # ---------------------------------------------------------------- cache

    async def get(self, name: str) -> Any:
        """The adapter (as packed), from the cache or fetched from its origin once.

        Raises AdapterNotFoundError for an unregistered name, the source's typed
        error when the origin fails, and lora_core's InvalidAdapterError when
        the adapter is broken; a failure is not cached, so a later call retries.
        """
        uri = self._registry.get(name)
        if uri is None:
            raise AdapterNotFoundError(f"adapter {name!r} is not registered")
        if self.cache_hit(name):  # register() drops the copy of a re-pointed name, so it is this uri's
            return self._cache[name].value
        self.metrics.misses += 1
        return await self._shared_fetch(name, uri, None, registers=False)

    async def _shared_fetch(self, name: str, uri: str, fit: AdapterFit | None, registers: bool) -> Any:
        key = (name, uri, fit, registers)
        future = self._inflight.get(key)
        if future is None:
            future = self._inflight[key] = asyncio.ensure_future(self._fetch(*key))
        # shield: one caller giving up must not cancel the fetch the others wait on, nor half-do a load.
        return await asyncio.shield(future)

    async def _fetch(self, name: str, uri: str, fit: AdapterFit | None, registers: bool) -> Any:
        start = time.perf_counter()
        try:
            self.metrics.origin_fetches += 1
            if self._fetch_pool is None:
                self._fetch_pool = ThreadPoolExecutor(self.fetch_concurrency, thread_name_prefix="tier-fetch")
            blob, value = await asyncio.get_running_loop().run_in_executor(
                self._fetch_pool, self._fetch_blocking, name, uri, fit)
        except Exception:
            self.metrics.fetch_errors += 1
            raise
        finally:
            del self._inflight[(name, uri, fit, registers)]
        seconds = time.perf_counter() - start
        self.metrics.fetch_latencies_s.append(seconds)
        self.metrics.fetch_seconds.observe(seconds)
        logger.info("adapter %s fetched from %s: %d bytes in %.2fs", name, uri, blob.nbytes, seconds)
        if registers and self._registry.get(name) != uri:
            self._set(name, uri)  # checked: the name serves these weights from now on
        if self._registry.get(name) == uri:  # not unregistered or re-pointed meanwhile
            self._insert(name, _Entry(value, blob.nbytes, fit))
        return value

    def _fetch_blocking(self, name: str, uri: str, fit: AdapterFit | None) -> tuple[AdapterBlob, Any]:
        source = self._parse_uri(uri)
        with tempfile.TemporaryDirectory(prefix="lorafleet-adapter-", dir=self._work_dir) as tmp:
            try:
                adapter_dir = source.fetch(Path(tmp) / "adapter")
            except OSError as exc:  # local disk or network trouble the source did not type itself
                reason = str(exc).replace(tmp, "<fetch directory>")  # callers see no server-side path
                raise SourceUnavailableError(f"fetching adapter {name!r} from {uri} failed: {reason}") from exc
            blob = load_blob(name, uri, adapter_dir, self._expected, fit)
        return blob, self._pack(blob)

    def _insert(self, name: str, entry: _Entry) -> None:
        self._drop(name)
        if entry.nbytes > self.capacity_bytes:
            logger.warning("adapter %s (%d bytes) exceeds the tier's capacity of %d bytes: served, not cached",
                           name, entry.nbytes, self.capacity_bytes)
            return
        while self._cache and self.metrics.bytes_cached + entry.nbytes > self.capacity_bytes:
            self._drop(next(iter(self._cache)))
            self.metrics.evictions += 1
        self._cache[name] = entry
        self.metrics.bytes_cached += entry.nbytes
        self.metrics.adapters_cached = len(self._cache)

    def _drop(self, name: str) -> None:
        entry = self._cache.pop(name, None)
        if entry is not None:
            self.metrics.bytes_cached -= entry.nbytes
            self.metrics.adapters_cached = len(self._cache)

    def cache_hit(self, name: str) -> bool:
        """The LRU's rule on a read: name's copy, where the tier holds one, becomes the most recently used (a
        hit counted). The cluster simulator (cluster/simulator/tiers.py) drives it, and admit(), as they are."""
        if name not in self._cache:
            return False
        self._cache.move_to_end(name)
        self.metrics.hits += 1
        return True

    def admit(self, name: str, value: Any, nbytes: int) -> None:
        """Cache value (nbytes) as name's copy, evicting least recently used copies to fit the capacity."""
        self._insert(name, _Entry(value, nbytes))

    def cached(self) -> list[str]:
        """Names in the cache, least recently used first."""
        return list(self._cache)
