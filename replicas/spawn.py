"""Worker processes that do not run the user's script again.

multiprocessing's "spawn" start method (the only safe one once CUDA or other
threads are running) re-imports the parent's ``__main__`` module in every
child so that functions defined there can be unpickled. For a script without
an ``if __name__ == "__main__":`` guard that means running the script again in
each worker: building another engine there, loading the model onto the GPU
again, and failing with multiprocessing's "bootstrapping phase" error when
that engine spawns its own workers. Our workers' code and arguments all live
in importable modules (replicas, lora_core), so they never need the user's
``__main__``: processes of WORKER_CONTEXT skip it, and an engine with
tensor parallelism or load processes needs no guard (vLLM's spawned workers
do; joblib's loky skips ``__main__`` the same way).

How: the parent describes what a spawned child must set up before it
unpickles its process object in ``multiprocessing.spawn.get_preparation_data``;
for processes named with WORKER_PREFIX the wrapper below drops the two keys
that make the child import ``__main__`` (by path or by module name). Other
processes, ours or not, are prepared as before.
"""

from __future__ import annotations

import multiprocessing.context
import multiprocessing.spawn
import os

WORKER_PREFIX = "lorafleet-worker"
_MAIN_KEYS = ("init_main_from_path", "init_main_from_name")


class WorkerProcess(multiprocessing.context.SpawnProcess):
    """A spawned process that does not import the parent's ``__main__``."""

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        self.name = f"{WORKER_PREFIX}:{self.name}"


class WorkerContext(multiprocessing.context.SpawnContext):
    """The "spawn" context whose Process is WorkerProcess: pass it where a context is taken
    (ProcessPoolExecutor(mp_context=...)); its Pipe, Queue and the rest are spawn's."""

    Process = WorkerProcess


def _preparation_data(name: str, _prepare=multiprocessing.spawn.get_preparation_data) -> dict:
    data = _prepare(name)
    if name.startswith(WORKER_PREFIX):
        for key in _MAIN_KEYS:
            data.pop(key, None)
    return data


if not getattr(multiprocessing.spawn.get_preparation_data, "_lorafleet", False):  # once, even if reloaded
    _preparation_data._lorafleet = True
    multiprocessing.spawn.get_preparation_data = _preparation_data

WORKER_CONTEXT = WorkerContext()


def usable_cores() -> int:
    """The cores this process may run on (its affinity where the OS tells it), what sizes a worker pool."""
    return len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
