"""AdapterLoads: one rank's background adapter loads (disk -> validated -> laid out in host memory).

A load reads, validates and prepares an adapter on a loader thread, or in a
worker process with EngineArgs.lora_load_processes (replicas.lora_load_process),
while the rank keeps running steps; finish() hands the prepared adapter to
the LoRAModelManager. Every disk load of an adapter goes through load_prepared
(background) or load (a synchronous reload of a registered adapter). A load on a
loader thread shares the GIL with the engine's steps, so it runs with the
interpreter's switch interval lowered (replicas/gil.py).
"""

from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import LoRACapacityError
from lora_core.adapter_structure import AdapterStructures
from lora_core.lora_model import LoRAModel
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAModuleSpec
from lora_core.pinned_pool import PinnedSlabPool
from lora_core.request import LoRARequest
from replicas.gil import LOADER_SWITCH_INTERVAL
from replicas.lora_load_process import ProcessAdapterLoader
from replicas.spawn import usable_cores

# Adapter loads run on two threads, each with torch's intra-op parallelism off: an adapter is hundreds of
# ~100 KB tensors, and intra-op thread pools in several loaders oversubscribe the cores. On a 16-core H200
# host (bench/adapter_load.py, 8B shape, rank 16) read + prepare ran 6.2 adapters/s on one thread with the
# default pool, 13.2 with one intra-op thread, 14.4 on two such threads, and slower on 4 or 8.
_LOADER_THREADS = 2

# Load processes where EngineArgs.lora_load_processes is None: on CUDA hosts, 4 while the cores allow it (one per
# four usable cores). Loads on threads share the GIL with the engine's host loop: on an H200 host the 8B engine
# ran distinct rank-16 traffic at 0.64 x base on threads and 0.80 with 4 processes, TTFT p50 211 against 77 ms
# (bench/engine.py). On CPU the engine's own steps want the cores, hence threads there.
DEFAULT_LOAD_PROCESSES = 4


def load_processes_for(requested: int | None, device: torch.device) -> int:
    """EngineArgs.lora_load_processes resolved: None is DEFAULT_LOAD_PROCESSES on CUDA (fewer on hosts with under
    16 usable cores, none under 4) and 0 (threads) elsewhere. Without a shared host pool (lora_host_pool off, or
    no memfd and no room in /dev/shm: lora_core/shared_region.py) the engine falls back to threads
    (load_processes_with_pool): a load process would then hand each adapter over through a slab of its own."""
    if requested is not None:
        return requested
    if device.type != "cuda":
        return 0
    return min(DEFAULT_LOAD_PROCESSES, usable_cores() // 4)


def load_processes_with_pool(requested: int | None, processes: int, pool: PinnedSlabPool | None) -> int:
    """The processes a rank runs once its host pool exists: by default (requested None) only where they write
    into a shared pool, else threads; a requested count as asked."""
    if requested is None and (pool is None or not pool.shared):
        return 0
    return processes


def _init_loader_thread() -> None:
    torch.set_num_threads(1)  # per thread: the engine's own thread keeps its setting


class AdapterLoads:
    def __init__(self, manager: LoRAModelManager, lora_config: LoRAConfig, specs: list[LoRAModuleSpec],
                 processes: int = 0, pin: bool = False, switch_interval: float = 0.0) -> None:
        self.manager, self.lora_config, self.specs = manager, lora_config, specs
        self.switch_interval = switch_interval  # the GIL's, while a load runs on a loader thread (gil.py)
        self.expected = sorted({s for spec in specs for s in spec.peft_suffixes()})
        self.structures = AdapterStructures()  # structures checked once (lora_core/adapter_structure.py)
        self._loads: dict[int, tuple[LoRARequest, Future]] = {}
        self._threads: ThreadPoolExecutor | None = None
        # With worker processes each load in flight holds a thread only to wait for its parts (which queue in
        # the pool in arrival order): one thread per process keeps the next loads' parts queued behind them.
        self._num_threads = self.threads_for(processes)
        self.process_loader = (ProcessAdapterLoader(processes, manager.preparer, self.expected, lora_config,
                                                    specs, adopt=manager.adopt_shared if pin else None,
                                                    host_pool=manager.host_pool)
                               if processes > 0 else None)

    @property
    def worker_restarts(self) -> int:
        """Times a load worker process died and its pool was replaced (0 with loads on threads)."""
        return self.process_loader.restarts if self.process_loader is not None else 0

    @staticmethod
    def threads_for(processes: int) -> int:
        """Loader threads, so loads in flight at once, with that many worker processes."""
        return max(_LOADER_THREADS, processes)

    def start(self, request: LoRARequest) -> None:
        """Start loading on a loader thread (in a worker process through it, if any); a second start
        for an id already loading is a no-op."""
        if request.lora_int_id not in self._loads:
            if self._threads is None:
                self._threads = ThreadPoolExecutor(max_workers=self._num_threads,
                                                   thread_name_prefix="lorafleet-lora-load",
                                                   initializer=_init_loader_thread)
            self._loads[request.lora_int_id] = (request, self._threads.submit(self.load_prepared, request))

    def load_prepared(self, request: LoRARequest):
        if self.process_loader is not None:
            return self.process_loader.load(request)
        with LOADER_SWITCH_INTERVAL.lowered(self.switch_interval):
            lora = self.load(request)
            return lora.rank, self.manager.prepare_adapter(lora)

    def load(self, request: LoRARequest) -> LoRAModel:
        """Read and validate an adapter on the calling thread. Its tensors are the file's own (copy=False):
        every caller lays it out into a host slab at once and drops it (load_prepared, ModelRunner._register),
        so a copy of each tensor first would cost ~8 of a rank-16 8B load's ~50 ms for nothing."""
        return LoRAModel.from_local_checkpoint(request.lora_path, self.expected, lora_model_id=request.lora_int_id,
                                               lora_config=self.lora_config, module_specs=self.specs, copy=False,
                                               structures=self.structures)

    def done(self) -> list[int]:
        """Ids whose background load has finished (successfully or not), oldest first."""
        return [lora_id for lora_id, (_, future) in self._loads.items() if future.done()]

    def future(self, lora_id: int) -> Future:
        return self._loads[lora_id][1]

    def finish(self, lora_id: int, wait_for_room: bool) -> tuple[LoRARequest, int] | None:
        """Wait for the load of lora_id and add it to the host cache: (request, rank); raises the load's error.

        wait_for_room: when the host cache is full of adapters the running batch
        uses, keep the loaded adapter and return None (call again after a step).
        Without it the caller says no step is running: the last step's adapters
        lose their protection and the least recently used one makes room.
        """
        request, future = self._loads[lora_id]
        try:
            rank, prepared = future.result()
            if not wait_for_room:
                self.manager.set_running(())
            self.manager.add_prepared(prepared)
        except LoRACapacityError:
            if wait_for_room:
                return None
            del self._loads[lora_id]
            raise
        except BaseException:
            del self._loads[lora_id]
            raise
        del self._loads[lora_id]
        return request, rank

    def close(self) -> None:
        """Stop the loader threads and worker processes; loads in flight are dropped."""
        if self._threads is not None:
            self._threads.shutdown(wait=False, cancel_futures=True)
            self._threads = None
        if self.process_loader is not None:
            self.process_loader.shutdown()
