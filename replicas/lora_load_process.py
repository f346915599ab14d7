"""Adapter loads in worker processes (EngineArgs.lora_load_processes > 0; by default on CUDA hosts).

A load on a thread of the engine's process holds the GIL for tens of
milliseconds per adapter (hundreds of small tensors to read, check and lay
out), and the engine's thread waits for it at every torch call. Here a
spawned worker process reads, validates and lays out the adapter
(host_adapter.AdapterPreparer) in shared memory, and the engine's process
only copies that one slab into pinned memory (one copy_, which releases the
GIL, into a block of the manager's PinnedSlabPool, pinned at start-up). On an
H200 host (bench/load_contention.py) loads on a thread slowed a tiny engine's
steps 1.78x at the median, in a process 0.93x (no slowdown), at the same load
rate; with the 8B engine, rows with many loads gained 11-26% tok/s.

With a shared host pool (PinnedSlabPool(shared=True), the manager's when load processes are on) the
serving process hands the worker a free block and the worker writes the adapter straight into it: no slab
per adapter in shared memory (its fresh pages cost 2.5-4x the load itself) and no copy on this side.
Every such load splits by layer over all the workers (lora_core/load_parts.py), each part writing its layers
into the block, and the parts of loads in flight queue in arrival order: a load waits for the loads ahead of
it and then ~1/n of its own time, and no worker idles while a part waits. A part's per-key checks run once
per adapter structure in each worker (lora_core/adapter_structure.py), so the split adds little work: an
8B rank-16 adapter took 33 ms whole and 9 ms a part in 4 (locally; 14 ms before structures were kept).
(Splitting only over idle workers ran a load that arrived under another's parts whole, on one worker, after
them: p50 of the benchmark's adapter wait 63 ms against 33 for a load alone; bench/RESULTS.md.)

Worker processes are spawned without the user's ``__main__`` (replicas/spawn.py), so a script needs no
``if __name__ == "__main__":`` guard for them.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from typing import Callable, TypeVar

import torch
import torch.multiprocessing  # noqa: F401  (tensors cross the process boundary in shared memory)

from lora_core.config import LoRAConfig
from lora_core.host_adapter import AdapterPreparer, HostAdapter
from lora_core.adapter_structure import AdapterStructures
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAModuleSpec
from lora_core.pinned_pool import PinnedSlabPool
from lora_core.shared_region import SharedRegion
from lora_core.request import LoRARequest
from replicas.errors import LoadWorkerLostError
from replicas.spawn import WORKER_CONTEXT

_log = logging.getLogger(__name__)
_T = TypeVar("_T")
_worker: dict = {}  # this worker process's preparer and checks, set once by _init


def _init(preparer: AdapterPreparer, expected: list[str], lora_config: LoRAConfig, specs: list[LoRAModuleSpec],
          region: SharedRegion | None, block_bytes: int) -> None:
    torch.set_num_threads(1)
    _worker.update(preparer=preparer, expected=expected, lora_config=lora_config, specs=specs,
                   region=region.tensor if region is not None else None,
                   block_bytes=block_bytes, structures=AdapterStructures())


def _read(request: LoRARequest, part: tuple[int, int] | None = None) -> LoRAModel:
    # copy=False: the tensors go into the slab at once and the LoRAModel is dropped, so the file's own
    # tensors serve (one copy fewer per load).
    return LoRAModel.from_local_checkpoint(request.lora_path, _worker["expected"], lora_model_id=request.lora_int_id,
                                           lora_config=_worker["lora_config"], module_specs=_worker["specs"],
                                           copy=False, part=part, structures=_worker["structures"])


def _load(request: LoRARequest) -> tuple[int, HostAdapter]:
    lora = _read(request)
    return lora.rank, _worker["preparer"].prepare(lora, "shared")


def _load_into(request: LoRARequest, block_index: int, part: tuple[int, int] | None = None) -> int:
    """Read the adapter (or its part: lora_core/load_parts.py) and write it into block block_index of the
    shared pool; the adapter's rank."""
    lora = _read(request, part)
    start = block_index * _worker["block_bytes"]
    _worker["preparer"].prepare(lora, out=_worker["region"][start:start + _worker["block_bytes"]], part=part)
    return lora.rank


def _ready() -> bool:
    return True


class ProcessAdapterLoader:
    """load(request) -> (rank, HostAdapter) from a pool of worker processes; typed errors cross intact.

    A worker that dies (killed for memory, a crash in a native library) breaks the whole pool: the loads in
    flight then start again once on a fresh pool, and a load whose worker dies twice fails with
    LoadWorkerLostError, for its requests only; later loads get a fresh pool."""

    def __init__(self, workers: int, preparer: AdapterPreparer, expected: list[str], lora_config: LoRAConfig,
                 specs: list[LoRAModuleSpec], adopt: Callable[[HostAdapter], HostAdapter] | None,
                 host_pool: PinnedSlabPool | None = None) -> None:
        """adopt: moves a worker's shared-memory adapter into this process's host memory (on CUDA
        LoRAModelManager.adopt_shared, into pinned memory); None keeps it in shared memory.
        host_pool: the manager's pool; where it is shared, adapters are written into its blocks (adopt is
        then only for loads that find no free block)."""
        self._host_pool = host_pool if host_pool is not None and host_pool.shared else None
        region = self._host_pool.shared_region if self._host_pool is not None else None
        block_bytes = self._host_pool.block_bytes if self._host_pool is not None else 0
        self._initargs = (preparer, expected, lora_config, specs, region, block_bytes)
        self._preparer = preparer
        self._adopt = adopt
        self.workers = workers
        self._lock = threading.Lock()  # loader threads replace a broken pool once between them
        self._pool = self._start_pool()
        self.pools_started = 1

    def _start_pool(self) -> ProcessPoolExecutor:
        pool = ProcessPoolExecutor(self.workers, mp_context=WORKER_CONTEXT, initializer=_init,
                                   initargs=self._initargs)
        for _ in range(self.workers):  # start the workers now: importing torch there takes seconds
            pool.submit(_ready)
        return pool

    @property
    def restarts(self) -> int:
        """Pools replaced after a worker died (routing stats and metrics report it)."""
        return self.pools_started - 1

    def _replace(self, broken: ProcessPoolExecutor, request: LoRARequest) -> None:
        with self._lock:
            if self._pool is broken:  # else another loader thread replaced it already
                _log.warning("an adapter load worker process died (loading %r at the time, or beside it): "
                             "its loads start again in fresh workers", request.lora_name)
                # wait=True: the broken pool fails its futures before it terminates its other workers, and
                # one may still be writing a part into a block that the retry, or another load, gets next.
                broken.shutdown(wait=True, cancel_futures=True)
                self._pool = self._start_pool()
                self.pools_started += 1

    def _twice(self, load: Callable[[ProcessPoolExecutor], _T], request: LoRARequest) -> _T:
        """load(pool), once more on a fresh pool if a worker died under it."""
        for attempt in range(2):
            pool = self._pool
            try:
                return load(pool)
            except BrokenProcessPool as exc:
                self._replace(pool, request)
                if attempt:
                    raise LoadWorkerLostError(f"the worker process loading adapter {request.lora_name!r} "
                                              f"({request.lora_path}) died twice") from exc
        raise AssertionError("unreachable")

    def load(self, request: LoRARequest) -> tuple[int, HostAdapter]:
        """(rank, the adapter in this process's host memory): in a block of the shared pool when one is free,
        else through a shared slab of the worker's (adopted)."""
        block = (self._host_pool.allocate(self._preparer.max_slab_bytes()) if self._host_pool is not None
                 else None)
        if block is None:
            rank, shared = self.load_shared(request)
            return rank, self._adopt(shared) if self._adopt is not None else shared
        try:
            rank = self._twice(lambda pool: self._load_into(pool, request, block.index), request)
        except BaseException:
            self._host_pool.release(block)  # a bad adapter (or a lost worker) leaves the block free
            raise
        return rank, self._preparer.in_block(request.lora_int_id, rank, block, self._host_pool)

    def _load_into(self, pool: ProcessPoolExecutor, request: LoRARequest, block_index: int) -> int:
        parts = self.workers
        futures = []
        try:
            for k in range(parts):
                futures.append(pool.submit(_load_into, request, block_index, (k, parts) if parts > 1 else None))
        finally:
            wait(futures)  # every part has stopped writing the block before it may go back to the pool
        failed = next((f.exception() for f in futures if f.exception() is not None), None)
        if failed is not None:
            raise failed
        return futures[0].result()

    def load_shared(self, request: LoRARequest) -> tuple[int, HostAdapter]:
        """load()'s slab path, without the adoption: the adapter in a shared-memory slab the worker made for it."""
        return self._twice(lambda pool: pool.submit(_load, request).result(), request)

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
