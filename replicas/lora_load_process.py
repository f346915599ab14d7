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

Worker processes are spawned, so a script that builds an engine with this on
must guard its entry point with ``if __name__ == "__main__":`` (as for tensor
parallelism); hence opt-in for LLM() users, and on in deploy/config.gpu.yaml
(a Serve replica is a Ray worker, whose entry point is guarded).
"""

from __future__ import annotations

import multiprocessing as mp
from concurrent.futures import ProcessPoolExecutor
from typing import Callable

import torch
import torch.multiprocessing  # noqa: F401  (tensors cross the process boundary in shared memory)

from lora_core.config import LoRAConfig
from lora_core.host_adapter import AdapterPreparer, HostAdapter
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAModuleSpec
from lora_core.request import LoRARequest

_worker: dict = {}  # this worker process's preparer and checks, set once by _init


def _init(preparer: AdapterPreparer, expected: list[str], lora_config: LoRAConfig,
          specs: list[LoRAModuleSpec]) -> None:
    torch.set_num_threads(1)
    _worker.update(preparer=preparer, expected=expected, lora_config=lora_config, specs=specs)


def _load(request: LoRARequest) -> tuple[int, HostAdapter]:
    lora = LoRAModel.from_local_checkpoint(request.lora_path, _worker["expected"], lora_model_id=request.lora_int_id,
                                           lora_config=_worker["lora_config"], module_specs=_worker["specs"])
    return lora.rank, _worker["preparer"].prepare(lora, "shared")


def _ready() -> bool:
    return True


class ProcessAdapterLoader:
    """load(request) -> (rank, HostAdapter) from a pool of worker processes; typed errors cross intact."""

    def __init__(self, workers: int, preparer: AdapterPreparer, expected: list[str], lora_config: LoRAConfig,
                 specs: list[LoRAModuleSpec], adopt: Callable[[HostAdapter], HostAdapter] | None) -> None:
        """adopt: moves a worker's shared-memory adapter into this process's host memory (on CUDA
        LoRAModelManager.adopt_shared, into pinned memory); None keeps it in shared memory."""
        self._pool = ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn"), initializer=_init,
                                         initargs=(preparer, expected, lora_config, specs))
        self._adopt = adopt
        for _ in range(workers):  # start the workers now: importing torch there takes seconds
            self._pool.submit(_ready)

    def load(self, request: LoRARequest) -> tuple[int, HostAdapter]:
        rank, shared = self._pool.submit(_load, request).result()
        return rank, self._adopt(shared) if self._adopt is not None else shared

    def shutdown(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)
