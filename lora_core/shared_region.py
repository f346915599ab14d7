"""SharedRegion: host memory that this process and the processes it spawns map alike.

The adapter host pool lives in one (lora_core/pinned_pool.py) when adapter loads run in worker processes:
a worker writes an adapter straight into a block of it. Where the OS has memfd_create (Linux), the region
is an anonymous memory file: it is not a file under /dev/shm, so the size of that mount (64 MB in a
default Docker container, often small in Kubernetes pods) does not bound it, only memory does. Pickled into
a process being spawned, it crosses as its file descriptor, which multiprocessing hands the child at spawn,
and the child maps the same pages. Elsewhere it is torch's shared memory (files under /dev/shm).
"""

from __future__ import annotations

import mmap
import os
import weakref
from multiprocessing.reduction import DupFd

import torch


def _memfd_works() -> bool:
    # Python has os.memfd_create on Linux, but a kernel before 3.17 or a sandbox's seccomp filter may refuse it.
    if not hasattr(os, "memfd_create"):
        return False
    try:
        os.close(os.memfd_create("lorafleet-probe", os.MFD_CLOEXEC))
    except OSError:
        return False
    return True


MEMFD = _memfd_works()

# Where torch's shared memory (file-descriptor strategy) lives on Linux. A region larger than its free space is
# still created, but touching its pages past that space kills the process (SIGBUS): so the room is checked first.
SHM_DIR = "/dev/shm"


class SharedRegion:
    """``tensor``: the region's bytes (uint8). Pickle it only into a process being spawned (e.g. a
    ProcessPoolExecutor's initargs) or through a multiprocessing connection; the other side gets a
    SharedRegion over the same memory."""

    def __init__(self, nbytes: int, memfd: bool | None = None) -> None:
        """memfd: an anonymous memory file (True), torch's shared memory under /dev/shm (False), or the
        first where the OS has it (None)."""
        self.nbytes = nbytes
        memfd = MEMFD if memfd is None else memfd
        self.fd: int | None = None
        if memfd:
            self.fd = os.memfd_create("lorafleet-adapter-pool", os.MFD_CLOEXEC)
            weakref.finalize(self, os.close, self.fd)
            os.ftruncate(self.fd, nbytes)
            self.tensor = _mapped(self.fd, nbytes)
        else:
            # A new shared storage, not torch.empty(...).share_memory_(): that one copies the region into shared
            # memory (a second pass over every page).
            self.tensor = torch.empty(0, dtype=torch.uint8).set_(torch.UntypedStorage._new_shared(nbytes))

    def __reduce__(self):
        if self.fd is None:
            return _from_tensor, (self.tensor,)  # torch's own reduction of shared storage
        return _attached, (DupFd(self.fd), self.nbytes)


def room_for(nbytes: int) -> bool:
    """Whether a SharedRegion of nbytes can be made here: always with memfd (memory bounds it, as any
    allocation), else where /dev/shm has that much free."""
    if MEMFD:
        return True
    try:
        stats = os.statvfs(SHM_DIR)
    except OSError:
        return False
    return stats.f_bavail * stats.f_frsize >= nbytes


def _mapped(fd: int, nbytes: int) -> torch.Tensor:
    # The tensor keeps the mmap object (and so the mapping) alive; the mapping keeps the file alive.
    return torch.frombuffer(mmap.mmap(fd, nbytes), dtype=torch.uint8)


def _attached(dup, nbytes: int) -> SharedRegion:
    # The child's side: it maps the region and keeps no descriptor, so it does not pickle the region on.
    fd = dup.detach()
    try:
        return _from_tensor(_mapped(fd, nbytes))
    finally:
        os.close(fd)  # the mapping holds its own reference to the file


def _from_tensor(tensor: torch.Tensor) -> SharedRegion:
    """A SharedRegion over memory already shared (no descriptor of its own)."""
    region = SharedRegion.__new__(SharedRegion)
    region.nbytes, region.fd, region.tensor = tensor.numel(), None, tensor
    return region
