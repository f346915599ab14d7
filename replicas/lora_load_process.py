"""Adapter loads in worker processes (opt-in: EngineArgs.lora_load_processes > 0).

A load on a thread of the engine's process holds the GIL for tens of
milliseconds per adapter (hundreds of small tensors to read, check and lay
out), and the engine's thread waits for it at every torch call. Here a
spawned worker process reads, validates and lays out the adapter
(host_adapter.AdapterPreparer) in shared memory, and the engine's process
only copies that one slab into pinned memory (one copy_, which releases the
GIL, into a block of the manager's PinnedSlabPool, pinned at start-up). On an
H200 host (bench/load_contention.py) loads on a thread slowed a tiny engine's
steps 1.78x at the median, in a process 0.93x (no slowdown), at the same load
rate; with the 8B engine, rows with many loads gained 11-26% tok/s
(bench/RESULTS.md, fourth session).

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

Worker processes are spawned, so a script that builds an engine with this on
must guard its entry point with ``if __name__ == "__main__":`` (as for tensor
parallelism); hence opt-in for LLM() users, and on in deploy/config.gpu.yaml
(a Serve replica is a Ray worker, whose entry point is guarded).
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor, wait
from typing import Callable

import torch
import torch.multiprocessing  # noqa: F401  (tensors cross the process boundary in shared memory)

from lora_core.config import LoRAConfig
from lora_core.host_adapter import AdapterPreparer, HostAdapter
from lora_core.adapter_structure import AdapterStructures
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAModuleSpec
from lora_core.pinned_pool import PinnedSlabPool
from lora_core.request import LoRARequest

_worker: dict = {}  # this worker process's preparer and checks, set once by _init


def _init(preparer: AdapterPreparer, expected: list[str], lora_config: LoRAConfig, specs: list[LoRAModuleSpec],
          region: torch.Tensor | None, block_bytes: int) -> None:
    torch.set_num_threads(1)
    _worker.update(preparer=preparer, expected=expected, lora_config=lora_config, specs=specs, region=region,
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
    """load(request) -> (rank, HostAdapter) from a pool of worker processes; typed errors cross intact."""

    def __init__(self, workers: int, preparer: AdapterPreparer, expected: list[str], lora_config: LoRAConfig,
                 specs: list[LoRAModuleSpec], adopt: Callable[[HostAdapter], HostAdapter] | None,
                 host_pool: PinnedSlabPool | None = None) -> None:
        """adopt: moves a worker's shared-memory adapter into this process's host memory (on CUDA
        LoRAModelManager.adopt_shared, into pinned memory); None keeps it in shared memory.
        host_pool: the manager's pool; where it is shared, adapters are written into its blocks (adopt is
        then only for loads that find no free block)."""
        self._host_pool = host_pool if host_pool is not None and host_pool.shared else None
        region = self._host_pool.region if self._host_pool is not None else None
        block_bytes = self._host_pool.block_bytes if self._host_pool is not None else 0
        self._pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init,
                                         initargs=(preparer, expected, lora_config, specs, region, block_bytes))
        self._preparer = preparer
        self._adopt = adopt
        self._workers = workers
        for _ in range(workers):  # start the workers now: importing torch there takes seconds
            self._pool.submit(_ready)

    def load(self, request: LoRARequest) -> tuple[int, HostAdapter]:
        """(rank, the adapter in this process's host memory): in a block of the shared pool when one is free,
        else through a shared slab of the worker's (adopted)."""
        block = (self._host_pool.allocate(self._preparer.max_slab_bytes()) if self._host_pool is not None
                 else None)
        if block is None:
            rank, shared = self.load_shared(request)
            return rank, self._adopt(shared) if self._adopt is not None else shared
        parts = self._workers
        futures = []
        try:
            for k in range(parts):
                futures.append(self._pool.submit(_load_into, request, block.index, (k, parts) if parts > 1 else None))
            wait(futures)  # every part has stopped writing the block before it may go back to the pool
            failed = next((f.exception() for f in futures if f.exception() is not None), None)
            if failed is not None:
                raise failed
        except BaseException:
            wait(futures)
            self._host_pool.release(block)  # a bad adapter (or a lost worker) leaves the block free
            raise
        rank = futures[0].result()
        return rank, self._preparer.in_block(request.lora_int_id, rank, block, self._host_pool)

    def load_shared(self, request: LoRARequest) -> tuple[int, HostAdapter]:
        """load()'s slab path, without the adoption: the adapter in a shared-memory slab the worker made for it."""
        return self._pool.submit(_load, request).result()

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
