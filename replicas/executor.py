"""Executors: where the model runner(s) of one replica live.

UniProcExecutor runs the single rank in this process. MultiprocExecutor runs
rank 0 here and ranks 1..tp-1 in spawned worker processes (which do not run
the user's script again: replicas/spawn.py) joined by
torch.distributed (gloo on CPU, NCCL on GPU) on a free loopback port; every
call is sent to all ranks and run by all, so their collectives pair up. The
cluster package adds a Ray executor with the same interface.
"""

from __future__ import annotations

import importlib
import multiprocessing as mp
import time
import traceback
from typing import Any

import torch

from replicas.model_runner import ModelRunner, RunnerConfig, StepInput
from replicas.parallel import TEARDOWN_TIMEOUT_S, backend_for, destroy_distributed, free_port, init_distributed
from replicas.spawn import WORKER_CONTEXT


class UniProcExecutor:
    takes_device_tokens = True  # execute() accepts the previous step's tokens as a device tensor

    def __init__(self, cfg: RunnerConfig) -> None:
        self.runner = ModelRunner(cfg)

    @property
    def model_config(self):
        return self.runner.model_config

    def call(self, method: str, *args: Any) -> Any:
        return getattr(self.runner, method)(*args)

    def call_all(self, method: str, *args: Any) -> list:
        """call(), every rank's result (here the one rank's)."""
        return [self.call(method, *args)]

    def execute(self, step: StepInput, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self.runner.execute(step, previous_tokens)

    def shutdown(self) -> None:
        self.runner.close()


def _worker_main(rank: int, world: int, init_method: str, cfg: RunnerConfig, conn) -> None:
    # Daemonic, so that the parent's exit ends it; a daemonic process may not start children, but this rank
    # starts its own adapter-load workers (lora_load_processes), which end with it (their queues close).
    mp.current_process().daemon = False
    try:
        if cfg.device.startswith("cuda"):
            cfg.device = f"cuda:{rank % torch.cuda.device_count()}"
        ctx = init_distributed(rank, world, init_method, backend_for(cfg.device))
        runner = ModelRunner(cfg, ctx)
        conn.send(("ok", None))
    except BaseException as exc:  # the parent re-raises it with the worker's traceback
        conn.send(("error", f"{exc!r}\n{traceback.format_exc()}"))
        return
    while True:
        method, args = conn.recv()
        if method == "shutdown":
            break
        try:
            result = getattr(runner, method)(*args)
            conn.send(("ok", None if method == "execute" else result))
        except BaseException as exc:
            conn.send(("error", exc))
    runner.close()
    destroy_distributed()


def _peer_lost(exc: BaseException) -> bool:
    return type(exc) is RuntimeError or isinstance(exc, getattr(torch.distributed, "DistError", ()))


class WorkerError(RuntimeError):
    """A tensor-parallel worker failed to start."""


class Rank0Executor:
    """Rank 0's runner in this process, ranks 1..tp-1 elsewhere: subclasses say where (_send, _gather). Every call
    runs on all ranks, so their collectives pair up; an error (rank 0's first) is raised once every rank has
    answered, so the ranks stay in step for the next call."""

    takes_device_tokens = True  # rank 0's execute() takes them; runners send them on to the others
    runner: ModelRunner | None = None

    @property
    def model_config(self):
        return self.runner.model_config

    def call(self, method: str, *args: Any) -> Any:
        return self._call(method, args, args)[0]

    def call_all(self, method: str, *args: Any) -> list:
        """call(), every rank's result: rank 0's first."""
        return self._call(method, args, args)

    def execute(self, step: StepInput, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        return self._call("execute", (step,), (step, previous_tokens))[0]

    def _call(self, method: str, worker_args: tuple, rank0_args: tuple) -> list:
        pending = self._send(method, worker_args)
        error, result = None, None
        try:
            result = getattr(self.runner, method)(*rank0_args)
        except BaseException as exc:
            error = exc
        worker_error, worker_results = self._gather(pending)
        if error is not None or worker_error is not None:
            raise error if error is not None else worker_error
        return [result, *worker_results]

    def _send(self, method: str, args: tuple) -> Any:
        """Start the call on ranks 1..tp-1; returns what _gather waits on."""
        raise NotImplementedError

    def _gather(self, pending: Any) -> tuple[BaseException | None, list]:
        """Wait for every other rank's answer to the call: the first error among them (if any) and their
        results in rank order (None for execute)."""
        raise NotImplementedError


class MultiprocExecutor(Rank0Executor):
    def __init__(self, cfg: RunnerConfig, tp_size: int) -> None:
        ctx_mp = WORKER_CONTEXT  # spawned, without the user's __main__ (replicas/spawn.py)
        init_method = f"tcp://127.0.0.1:{free_port()}"
        self._conns, self._procs = [], []
        for rank in range(1, tp_size):
            parent, child = ctx_mp.Pipe()
            proc = ctx_mp.Process(target=_worker_main, args=(rank, tp_size, init_method, cfg, child), daemon=True)
            proc.start()
            self._conns.append(parent)
            self._procs.append(proc)
        if cfg.device.startswith("cuda"):
            cfg.device = "cuda:0"
        self.runner = None
        try:
            self.runner = ModelRunner(cfg, init_distributed(0, tp_size, init_method, backend_for(cfg.device)))
        except BaseException as exc:
            # e.g. a setting the runner refuses: the workers (failed or waiting) and this process's
            # process group must go, or the next engine in this process finds a stale group. Where a worker
            # failed first, rank 0 only saw its peer vanish from a collective (a bare RuntimeError from gloo, a
            # DistError from NCCL): say why it went. Rank 0's own errors (a refused setting) stand as they are.
            reason = self._worker_failure() if _peer_lost(exc) else None
            self.shutdown()
            if reason is not None:
                raise WorkerError(f"tensor-parallel worker failed to start: {reason}") from exc
            raise
        for conn in self._conns:
            status, detail = conn.recv()
            if status != "ok":
                self.shutdown()
                raise WorkerError(f"tensor-parallel worker failed to start: {detail}")

    def _worker_failure(self, wait_s: float = 1.0) -> str | None:
        """A worker's start-up error, if one sent it. A failed worker sends its error before it exits, so before
        rank 0 can see it gone: wait_s (in all) is only slack for the pipe."""
        deadline = time.monotonic() + wait_s
        for conn in self._conns:
            try:
                if conn.poll(max(0.0, deadline - time.monotonic())):
                    status, detail = conn.recv()
                    if status == "error":
                        return detail
            except (EOFError, OSError):
                continue
        return None

    def _send(self, method: str, args: tuple) -> None:
        for conn in self._conns:
            conn.send((method, args))

    def _gather(self, pending: None) -> tuple[BaseException | None, list]:
        error, results = None, []
        for conn in self._conns:  # always drain, so the pipes stay in step
            status, detail = conn.recv()
            if status == "error" and error is None:
                error = detail
            results.append(detail if status == "ok" else None)
        return error, results

    def shutdown(self) -> None:
        if self.runner is not None:
            self.runner.close()
        for conn in self._conns:
            try:
                conn.send(("shutdown", ()))
            except (BrokenPipeError, OSError):
                pass
        # Every rank leaves the process group together: NCCL's teardown waits for the peers, so joining
        # (or killing) the workers first hung this rank on a GPU (TP=2 on 2 x H200). A dead worker can still
        # hang it, hence the bound.
        destroy_distributed(timeout=TEARDOWN_TIMEOUT_S)
        for proc in self._procs:
            proc.join(timeout=10)
            if proc.is_alive():
                proc.kill()
        self._conns, self._procs = [], []


def make_executor(cfg: RunnerConfig, tp_size: int, backend: str | None = None):
    """backend: None/"mp" (worker processes), or "module:Class" of another executor with the same
    interface, constructed as Class(cfg, tp_size) — e.g. the Ray executor in cluster/."""
    if backend not in (None, "mp"):
        module, _, name = backend.partition(":")
        return getattr(importlib.import_module(module), name)(cfg, tp_size)
    return UniProcExecutor(cfg) if tp_size == 1 else MultiprocExecutor(cfg, tp_size)
