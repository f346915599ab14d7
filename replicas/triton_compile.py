"""Triton variants compiled in worker processes ahead of their first launch (a cold start's warm-up).

Why: a replica on a fresh node (an autoscaled one, say) finds Triton's disk cache empty, and its warm-up
compiled every kernel variant (92 for an 8B engine with rank-16 LoRA) one after another: 48 of its 87 s
start-up went to Triton's compiler on one H100 host, 73 of 132 s on another (bench/warm_up.py,
bench/RESULTS.md). Threads did not help: much of a compile is Python (the frontend), and with Triton's
AsyncCompileMode on 16 threads beside warm-up's own Python the engine took 113 s against 87. Processes
share no GIL: 110 s against 132 in one run.

So warm-up first runs its steps once with every launch of a variant not yet built turned into a compile
request that launches nothing (Triton's jit_cache_hook: a True answer skips the compile and the launch);
each request goes at once to a pool of spawned processes, which compile it into Triton's disk cache
(JITFunction.preload of the variant's specialization data). Warm-up then runs for real, and each first
launch loads its variant from the disk instead of compiling it. The compile-only pass computes nothing:
kernels' outputs hold whatever their buffers held, which only warm-up's synthetic steps may read.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
import time
from concurrent.futures import Future, ProcessPoolExecutor, wait
from pathlib import Path
from typing import Iterator

from replicas.spawn import WORKER_CONTEXT, usable_cores

log = logging.getLogger(__name__)


def compile_workers() -> int:
    """Processes for compiles: the usable cores, at most 16."""
    return max(1, min(16, usable_cores()))


def disk_cache_dir() -> Path:
    """Triton's disk cache: TRITON_CACHE_DIR, else .triton/cache under TRITON_HOME or the home directory
    (asked only where _runtime_knobs() found Triton >= 3.4, which has knobs)."""
    from triton import knobs

    return Path(knobs.cache.dir)


def compile_workers_for(requested: int | None, device: str, tensor_parallel_size: int = 1) -> int:
    """EngineArgs.compile_workers resolved once for every TP rank (their compile-only passes run the same
    collectives, so all or none take one). None: on CUDA, the cores split over the ranks when Triton's disk
    cache holds nothing yet (a fresh node, where every variant would compile one after another), else 0: a
    warm cache loads each variant in milliseconds, and the compile-only pass would only add its own time."""
    if requested is not None:
        return requested
    if not str(device).startswith("cuda") or _runtime_knobs() is None:
        return 0
    cache = disk_cache_dir()
    if cache.is_dir() and any(cache.iterdir()):
        return 0
    return max(1, compile_workers() // max(1, tensor_parallel_size))


def _runtime_knobs():
    """triton.knobs.runtime where it has jit_cache_hook (Triton >= 3.4), else None (no compile ahead)."""
    try:
        from triton import knobs
        from triton.runtime.jit import JITFunction
    except ImportError:
        return None
    runtime = getattr(knobs, "runtime", None)
    if not hasattr(runtime, "jit_cache_hook") or not hasattr(JITFunction, "preload"):
        return None
    return runtime


def compile_variant(module: str, qualname: str, specialization: str) -> float:
    """In a worker: compile one variant of the kernel module.qualname into Triton's disk cache; seconds."""
    start = time.perf_counter()
    kernel = importlib.import_module(module)
    for part in qualname.split("."):
        kernel = getattr(kernel, part)
    kernel.preload(specialization)
    return time.perf_counter() - start


class CompileAhead:
    """The requests of one compile_ahead() scope: variants seen (each once) and their compiles' futures."""

    def __init__(self, pool: ProcessPoolExecutor, thread: int) -> None:
        self.pool, self.thread = pool, thread
        self.futures: dict[tuple, Future] = {}
        self.skipped = 0  # variants that cannot be imported by name (a kernel defined inside a function)

    def hook(self, *, key, fn, compile, **kwargs) -> bool | None:
        """Triton's jit_cache_hook: True skips this compile and launch (only on the thread inside)."""
        if threading.get_ident() != self.thread:
            return None
        module, qualname = str(fn.module), fn.name  # JitFunctionInfo: the kernel's module and __qualname__
        if "<locals>" in qualname:
            self.skipped += 1
            return None  # compiled here, as without compile_ahead
        ident = (module, qualname, str(key))
        if ident not in self.futures:
            self.futures[ident] = self.pool.submit(compile_variant, module, qualname, compile["specialization_data"])
        return True

    def wait(self) -> None:
        """Every compile done; a failed one is logged (its first launch compiles it, as without this)."""
        wait(self.futures.values())
        for (module, qualname, _), future in self.futures.items():
            if future.exception() is not None:
                log.warning("compiling %s.%s ahead failed (compiled at its first launch): %s", module, qualname,
                            future.exception())


@contextlib.contextmanager
def compile_ahead(workers: int | None = None) -> Iterator[CompileAhead | None]:
    """Inside, a launch on this thread of a Triton variant not yet built launches nothing and sends the
    variant to a pool of `workers` spawned processes; on leaving, every one has compiled into Triton's disk
    cache, so the same launches then load it instead of compiling.

    Yields the scope's CompileAhead, or None (and nothing changes: launches run as usual) with workers=0 or
    where Triton has no jit_cache_hook. workers=None: compile_workers().
    """
    runtime = _runtime_knobs() if workers != 0 else None
    if runtime is None:
        yield None
        return
    with ProcessPoolExecutor(workers or compile_workers(), mp_context=WORKER_CONTEXT) as pool:
        ahead = CompileAhead(pool, threading.get_ident())
        previous = runtime.jit_cache_hook
        runtime.jit_cache_hook = ahead.hook
        try:
            yield ahead
        finally:
            runtime.jit_cache_hook = previous
            ahead.wait()
