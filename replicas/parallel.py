"""Tensor-parallel plumbing: the ParallelContext every parallel layer is given, and process-group setup.

There is no module-global TP state: each layer holds the ParallelContext it
was built with, so two models (or a test's TP=1 oracle and its TP=2 run) can
live in one process. At tp_size 1 every collective is a no-op.
"""

from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class ParallelContext:
    """This process's place in the tensor-parallel group.

    group: the torch.distributed process group of the TP ranks; None means the
    default (world) group, and is the only value at tp_size 1.
    """

    tp_rank: int = 0
    tp_size: int = 1
    group: Any = None

    def __post_init__(self) -> None:
        if self.tp_size < 1 or not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"bad tensor-parallel position: rank {self.tp_rank} of {self.tp_size}")

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """Sum x over the TP ranks, in place; returns x."""
        if self.tp_size > 1:
            dist.all_reduce(x, group=self.group)
        return x

    def all_reduce_max(self, x: torch.Tensor) -> torch.Tensor:
        """The elementwise max of x over the TP ranks, in place; returns x."""
        if self.tp_size > 1:
            dist.all_reduce(x, op=dist.ReduceOp.MAX, group=self.group)
        return x

    def all_true(self, ok: bool, device: torch.device) -> bool:
        """Whether ok holds on every TP rank (each passes its own; a collective, so every rank must call it)."""
        if self.tp_size == 1:
            return ok
        return int(self.all_reduce(torch.tensor([0 if ok else 1], device=device)).item()) == 0

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor:
        """Concatenate every rank's x along ``dim`` in rank order ([..., n] -> [..., n * tp_size])."""
        if self.tp_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.tp_size)]
        dist.all_gather(parts, x, group=self.group)
        return torch.cat(parts, dim=dim)

    def broadcast(self, x: torch.Tensor, src: int = 0) -> torch.Tensor:
        """Rank src's x on every rank, in place; returns x."""
        if self.tp_size > 1:
            dist.broadcast(x, src, group=self.group)
        return x

    def divide(self, size: int, what: str) -> int:
        """size / tp_size, or ValueError naming ``what`` when it does not split evenly."""
        if size % self.tp_size:
            raise ValueError(f"{what} {size} is not divisible by tensor_parallel_size {self.tp_size}")
        return size // self.tp_size


def default_backend() -> str:
    return "nccl" if torch.cuda.is_available() else "gloo"


def backend_for(device: str) -> str:
    """nccl for ranks on GPUs, gloo for ranks on CPU (also on a machine that has a GPU)."""
    return "nccl" if str(device).startswith("cuda") else "gloo"


def init_distributed(rank: int, world_size: int, init_method: str, backend: str | None = None) -> ParallelContext:
    """Join the TP group (one TP group per process group: the world) and return this rank's context.

    backend defaults to nccl when CUDA is available, gloo otherwise. With nccl
    the rank binds to GPU ``rank % device_count`` (so a worker that sees only
    its own GPU through CUDA_VISIBLE_DEVICES takes device 0).
    """
    backend = backend or default_backend()
    if world_size == 1:
        return ParallelContext()
    if backend == "nccl":
        torch.cuda.set_device(rank % torch.cuda.device_count())
    _finish_teardown()
    if not dist.is_initialized():
        dist.init_process_group(backend, init_method=init_method, rank=rank, world_size=world_size)
    return ParallelContext(tp_rank=rank, tp_size=world_size, group=None)


_teardown: threading.Thread | None = None
TEARDOWN_TIMEOUT_S = 30.0


def destroy_distributed(timeout: float | None = None) -> bool:
    """Leave the process group; returns whether that finished.

    NCCL's teardown waits for every rank, so a driver that leaves while a
    worker is dead would hang: with a timeout the teardown runs on a thread
    and the call returns after at most that long. init_distributed waits for
    a teardown still under way, so it never tears down the next group.
    """
    global _teardown
    if not dist.is_initialized():
        return True
    if timeout is None:
        dist.destroy_process_group()
        return True
    _teardown = threading.Thread(target=dist.destroy_process_group, name="lorafleet-tp-teardown", daemon=True)
    _teardown.start()
    _teardown.join(timeout)
    return not _teardown.is_alive()


def _finish_teardown() -> None:
    if _teardown is not None and _teardown.is_alive():
        _teardown.join(TEARDOWN_TIMEOUT_S)
        if _teardown.is_alive():
            raise RuntimeError("the previous tensor-parallel process group is still tearing down (a rank hung "
                               "or died); start the new group in a fresh process")


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port free right now on ``host`` (the OS picks it; the caller binds it soon after)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        return sock.getsockname()[1]
