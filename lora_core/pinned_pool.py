"""PinnedSlabPool: host memory for the host tier's adapters, pinned once, up front.

Pinning memory for an adapter as it arrives (cudaHostAlloc of an 84 MB slab, an 8B rank-16 adapter)
took 60-95 ms on an H200 host, and the CUDA driver serializes its API meanwhile: the engine thread's
kernel launches and copies waited, and steps that took 12 ms took 140-190 ms (bench/engine.py on an
H200). So the slabs come from one region pinned at start-up, cut into equal blocks, each large
enough for the largest adapter one rank can hold (every slot at max_lora_rank, as the GPU slots are
sized). A block goes back to the pool when the HostAdapter holding it is collected, and is handed out
again only once the host-to-device copies that read it have finished (an event the manager records
after them), so an evicted adapter's in-flight copy never reads a new one's bytes.

When every block is taken (more adapters alive than the pool was sized for), allocate() returns None
and the caller pins a slab of its own, as before the pool: slower, never wrong.

A shared pool (shared=True) lays its region in shared memory, so that a loader process
(replicas/lora_load_process.py) can write an adapter straight into a block the serving process handed
it. Otherwise each load went through a slab the worker put in shared memory for that adapter, whose
fresh pages cost more than the load itself: on an H200 host a rank-16 load (84 MB) took 132 ms in a
worker against 54 ms on a thread, rank 64 (336 MB) 504 against 122 (bench/adapter_load.py). The region is a
SharedRegion (lora_core/shared_region.py): on Linux an anonymous memory
file, whatever the size of /dev/shm; elsewhere, where /dev/shm has no room for it, the pool stays private
(``shared`` False) and the loader falls back to that path.
"""

from __future__ import annotations

import logging
import os
import threading
import weakref

import torch

from lora_core.shared_region import SHM_DIR, SharedRegion, room_for

_log = logging.getLogger(__name__)


class PinnedBlock:
    """One block of the pool: ``tensor`` is its bytes (uint8); ``event`` the last copy that read it."""

    __slots__ = ("index", "tensor", "event", "__weakref__")

    def __init__(self, index: int, tensor: torch.Tensor) -> None:
        self.index = index
        self.tensor = tensor
        self.event: torch.cuda.Event | None = None

    def record(self) -> None:
        """Mark the copies enqueued so far on the current stream as reading this block."""
        self.event = torch.cuda.Event()
        self.event.record()


class PinnedSlabPool:
    def __init__(self, block_bytes: int, num_blocks: int, pin: bool, shared: bool = False) -> None:
        if block_bytes <= 0 or num_blocks <= 0:
            raise ValueError(f"a pool needs blocks of > 0 bytes and > 0 blocks, got {block_bytes} x {num_blocks}")
        self.block_bytes = -(-block_bytes // 64) * 64  # every block starts 64-byte aligned, as a slab does
        self.num_blocks = num_blocks
        nbytes = self.block_bytes * num_blocks
        self.shared = shared and room_for(nbytes)
        if shared and not self.shared:
            _log.warning("no room in %s for the %.1f GiB adapter host pool: it stays private, so load processes "
                         "(lora_load_processes > 0) hand each adapter over through a slab of its own (slower loads); "
                         "by default loads then run on threads", SHM_DIR, nbytes / 2**30)
        # Pageable memory registered with the driver, not torch's pinned allocator: that one rounds
        # every allocation up to a power of two (up to 2x the memory for one large region).
        self.shared_region = SharedRegion(nbytes) if self.shared else None  # what a loader process maps
        self._region = self.shared_region.tensor if self.shared else torch.empty(nbytes, dtype=torch.uint8)
        if pin:
            _register(self._region)
            weakref.finalize(self, _unregister, self._region)
        elif self.shared:
            self._region.zero_()  # take the shared pages now, while there is room (pinning does it too)
        self._blocks = [PinnedBlock(i, self._region[i * self.block_bytes:(i + 1) * self.block_bytes])
                        for i in range(num_blocks)]
        self._free = list(range(num_blocks - 1, -1, -1))  # pop() hands out block 0 first
        self._lock = threading.Lock()
        self.fallbacks = 0  # allocations that found no free block (the caller pinned its own slab)

    @property
    def free_blocks(self) -> int:
        return len(self._free)

    @property
    def region(self) -> torch.Tensor:
        """Every block's bytes, block i at [i * block_bytes, (i + 1) * block_bytes) (shared_region's tensor
        where the pool is shared)."""
        return self._region

    def allocate(self, nbytes: int) -> PinnedBlock | None:
        """A free block for nbytes (its tensor trimmed to them), or None when none is free or nbytes is
        larger than a block. Waits for the last copy that read the block, if it is still running."""
        if nbytes > self.block_bytes:
            return None
        with self._lock:
            if not self._free:
                self.fallbacks += 1
                return None
            block = self._blocks[self._free.pop()]
        if block.event is not None:
            block.event.synchronize()
            block.event = None
        return PinnedBlock(block.index, block.tensor[:nbytes])

    def release(self, block: PinnedBlock) -> None:
        """Return a block from allocate(); its event (if recorded) guards the next allocation."""
        with self._lock:
            owner = self._blocks[block.index]
            if block.index in self._free:
                raise ValueError(f"block {block.index} was released twice")
            owner.event = block.event
            self._free.append(block.index)

    def adopt(self, owner: object, block: PinnedBlock) -> None:
        """Release ``block`` when ``owner`` (the HostAdapter whose tensors view it) is collected."""
        weakref.finalize(owner, self.release, block)


def physical_memory_bytes() -> int | None:
    """The host's physical memory, or None where the OS does not say (to size a pool against it)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return None


def _register(region: torch.Tensor) -> None:
    err = torch.cuda.cudart().cudaHostRegister(region.data_ptr(), region.numel(), 0)
    if int(err) != 0:
        raise RuntimeError(f"cudaHostRegister of {region.numel()} bytes for the adapter host pool failed "
                           f"(error {int(err)}); set lora_host_pool off or lower max_cpu_loras")


def _unregister(region: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(region.data_ptr())
