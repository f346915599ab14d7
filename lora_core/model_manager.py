"""LoRAModelManager: adapters in the host LRU and in the GPU slots of one replica rank.

Two tiers. The host tier (HostLRUCache, ``max_cpu_loras`` entries) holds each
registered adapter already prepared for this rank's slots by
host_adapter.AdapterPreparer (scaling folded into B, grouped per packed
layer, cut for this TP rank, slot layout and dtype; on CUDA in pinned
memory, from a PinnedSlabPool when one is configured). The GPU tier is one
device tensor of ``max_loras`` slots laid out as those host images
(slot_layout.SlotLayout), seen by each LoRA-able layer as a LoRASlotBuffers
of strided views, allocated once here so serving never allocates; activating
an adapter is one non-blocking copy of its image plus one of its ranks. With
``stacked_a`` the linear layers' A slots live under their base weights
instead (stacked_a.py): one more copy per linear module.

Mixed ranks: every slot is sized for max_lora_rank and a smaller adapter is
zero-padded. Memory: each slot, and each host image, takes max_lora_rank rows
whatever the adapter's rank, and an activation copies them all (a rank-16
adapter in rank-64 slots moves 4x its bytes to the GPU). Kernel bandwidth:
none past the real rank, because ``ranks[s, slot]`` holds it and the kernels
mask their loads by it. Time is another matter: the
kernels' rank tile is sized for max_lora_rank, so small decode batches of
low-rank adapters in wide slots still run slower (bench/RESULTS.md measures it).

Slot compaction (``compact_slots``): a stacked step reads every slot below its
highest one in use, and runs the shrink kernel instead when too many of them
are idle (stacked_a.py). So prepare_batch keeps a batch's n adapters in the
slots below adapter_bound(n) (n rounded up to a power of four): one that sits
higher moves down, by a device-to-device copy of its slot, into a free slot
there or one made free by moving the least recently used evictable adapter
there up (evicting, if no slot above is free, the one that LRU eviction would
take). Without it, LRU eviction scatters a Zipf workload's ~12 adapters per
step over all 32 slots in 95-99% of steps (bench/slot_bounds.py): rank-64 Zipf
steps then ran the shrink kernel, 0.58 ms slower on an H200 (bench/RESULTS.md).

Eviction never takes a pinned adapter nor one the running batch uses; every
operation checks that it can succeed (adapter valid, enough slots freeable)
before it changes anything, so a failure leaves slots and LRU order intact.
"""

from __future__ import annotations

import contextlib
import logging
from collections import OrderedDict
from typing import Callable, Iterable

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import LoRACapacityError, LoRAConfigError, UnknownLoRAError
from lora_core.host_adapter import AdapterPreparer, HostAdapter
from lora_core.host_cache import HostLRUCache
from lora_core.lora_model import LoRAModel
from lora_core.mapping import LoRAMapping
from lora_core.module_spec import LoRAModuleSpec
from lora_core.pinned_pool import PinnedSlabPool
from lora_core.punica.metadata import adapter_bound
from lora_core.slot_buffers import LoRASlotBuffers
from lora_core.stacked_a import check_stacked_a

_log = logging.getLogger(__name__)


class LoRAModelManager:
    def __init__(self, specs: list[LoRAModuleSpec], lora_config: LoRAConfig, device: torch.device | str,
                 dtype: torch.dtype, tp_rank: int = 0, tp_size: int = 1, host_pool_blocks: int = 0,
                 host_pool_max_bytes: int | None = None, stacked_a: dict[str, torch.Tensor] | None = None,
                 host_pool_shared: bool = False, compact_slots: bool = False) -> None:
        """host_pool_blocks > 0: host-tier slabs come from a PinnedSlabPool of that many blocks, pinned
        here (on CUDA) so that serving never pins memory: max_cpu_loras plus the loads that can be in
        flight at once. 0: each adapter pins its own slab as it arrives. host_pool_max_bytes caps the
        pool (fewer blocks; adapters past them pin their own slabs). host_pool_shared: the pool in shared
        memory, for loader processes to write adapters into (pinned_pool.py).
        stacked_a: for every linear module, the device rows [max_loras, S, R_a, in] under its base weight
        that hold its A slots (lora_core/stacked_a.py); the arena then holds everything else.
        compact_slots: prepare_batch keeps each batch's adapters in the lowest slots (module docstring)."""
        self.config = lora_config
        self.device = torch.device(device)
        self.dtype = lora_config.slot_dtype(dtype)
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.specs: dict[str, LoRAModuleSpec] = {}
        for spec in specs:
            if spec.name in self.specs:
                raise LoRAConfigError(f"two LoRA module specs are named {spec.name!r}")
            self.specs[spec.name] = spec
        self.preparer = AdapterPreparer(self.specs, lora_config, self.dtype, tp_rank, tp_size)
        self._dims = self.preparer.dims
        self.layout = self.preparer.layout
        self._stacked_a = check_stacked_a(stacked_a, self.layout, lora_config.max_loras, self.device) \
            if stacked_a is not None else {}
        # Every module's slots in one tensor, laid out as the host images (slot_layout.py); ranks apart.
        arena_bytes = self.layout.arena_bytes if self._stacked_a else self.layout.slot_bytes
        self._arena = torch.zeros(lora_config.max_loras, arena_bytes, dtype=torch.uint8, device=self.device)
        self._ranks = torch.zeros(len(self.layout.names), self.layout.max_slices, lora_config.max_loras,
                                  dtype=torch.int32, device=self.device)
        views = self.layout.slot_views(self._arena)
        for name, rows in self._stacked_a.items():
            views[name] = (rows.transpose(0, 1),) + views[name][1:]  # [S, L, R_a, in], as the kernels read A
        # per slot, where each linear module's A rows go, in the image's order (layout.image_a_all)
        self._stacked_dst = [[self._stacked_a[name][slot].view(-1) for name in self.layout.a_last_names()]
                             for slot in range(lora_config.max_loras)] if self._stacked_a else []
        self._buffers = {name: LoRASlotBuffers(spec=spec, lora_a=views[name][0], lora_b=views[name][1],
                                               ranks=self._ranks[self.layout.index(name),
                                                                 :len(self._dims[name].out_slices)],
                                               output_slices=self._dims[name].out_slices, bias=views[name][2])
                         for name, spec in self.specs.items()}
        self._pin_host = self.device.type == "cuda" and torch.cuda.is_available()
        self.host_pool: PinnedSlabPool | None = None
        blocks = host_pool_blocks
        if host_pool_max_bytes is not None:
            blocks = min(blocks, host_pool_max_bytes // self.layout.slot_bytes)
            if blocks < host_pool_blocks:
                _log.warning("adapter host pool capped at %d of %d blocks (%.1f GiB of %.1f MiB each); adapters "
                             "past them pin their own memory", blocks, host_pool_blocks,
                             blocks * self.layout.slot_bytes / 2**30, self.layout.slot_bytes / 2**20)
        if blocks > 0:
            self.host_pool = PinnedSlabPool(self.layout.slot_bytes, blocks, self._pin_host, shared=host_pool_shared)
        self._slots: list[int | None] = [None] * lora_config.max_loras
        self._active: OrderedDict[int, int] = OrderedDict()  # id -> slot, least recently used first
        self._running: frozenset[int] = frozenset()
        self.compact_slots = compact_slots
        self.slot_moves = 0  # slot-to-slot copies made by compaction, for tests and benchmarks
        # Adapter images copied from host memory into slots: on the calling (step's) stream, which the step waits
        # for, and on a side stream (prefetches under a running step). For benchmarks.
        self.host_copies = {"in_step": 0, "ahead": 0}
        # Called with a slot's index once its image is written (an install or a compaction move), on the stream
        # that wrote it and before its ranks: for copies of the slot kept elsewhere in another form (FP8 A rows
        # under FP8 base weights: replicas/fp8_lora.py).
        self.on_slot_write: Callable[[int], None] | None = None
        self._host: HostLRUCache[int, HostAdapter] = HostLRUCache(
            lora_config.max_cpu_loras, can_evict=lambda i: i not in self._running, on_evict=self._on_host_evict)

    # ---- queries -----------------------------------------------------------------

    @property
    def lora_index_to_id(self) -> list[int | None]:
        return list(self._slots)

    def list_adapters(self) -> list[int]:
        """Registered (host-cached) adapter ids, least recently used first."""
        return list(self._host)

    def active_adapters(self) -> list[int]:
        """Adapter ids holding a GPU slot, least recently used first."""
        return list(self._active)

    def memory_bytes(self) -> dict[str, int]:
        """Adapter memory on this rank: the GPU slots reserved, the part of them holding an adapter, and the
        host images held (pinned where on CUDA)."""
        per_slot = self._arena.shape[1]
        return {"gpu_reserved": self._arena.numel(), "gpu_used": len(self._active) * per_slot,
                "host": len(self._host) * self.layout.slot_bytes}

    def slot_of(self, lora_id: int) -> int | None:
        self._require(lora_id)
        return self._active.get(lora_id)

    def is_pinned(self, lora_id: int) -> bool:
        return self._host.is_pinned(lora_id)

    def host_ranks(self, lora_id: int) -> torch.Tensor:
        """A registered adapter's ranks, read on the host: int32 [modules (layout.index order), max_slices]."""
        self._require(lora_id)
        return self._host.peek(lora_id).ranks

    def buffers(self, module_name: str) -> LoRASlotBuffers:
        if module_name not in self._buffers:
            raise KeyError(f"no LoRA-able module named {module_name!r}")
        return self._buffers[module_name]

    def _require(self, lora_id: int) -> None:
        if lora_id not in self._host:
            raise UnknownLoRAError(f"LoRA adapter {lora_id} is not registered")

    # ---- host tier -----------------------------------------------------------------

    def add_adapter(self, lora: LoRAModel) -> bool:
        """Register ``lora`` in the host LRU; False if it was already there.

        The adapter is validated and prepared before anything is evicted, so a
        bad adapter leaves the caches as they were.
        """
        if lora.id in self._host:
            self._host.touch(lora.id)
            return False
        return self.add_prepared(self.prepare_adapter(lora))

    def prepare_adapter(self, lora: LoRAModel) -> HostAdapter:
        """Validate ``lora`` against the slots and copy it into (pinned) host memory, in slot layout.

        Touches no cache state, so it may run on a loader thread while steps
        run; add_prepared then registers the result.
        """
        if isinstance(lora.id, bool) or not isinstance(lora.id, int) or lora.id < 1:
            raise LoRAConfigError(f"a LoRA adapter id must be an integer > 0, got {lora.id!r}")
        return self.preparer.prepare(lora, "pinned" if self._pin_host else "plain", self.host_pool)

    def adopt_shared(self, shared: HostAdapter) -> HostAdapter:
        """A prepared adapter from a loader process (shared memory) copied into this rank's host memory:
        a pool block, or a slab of its own when none is free (pinned on CUDA)."""
        return shared.copy(pin_memory=self._pin_host, pool=self.host_pool)

    def add_prepared(self, prepared: HostAdapter) -> bool:
        """Register a prepare_adapter result in the host LRU; False if that id was already there."""
        if prepared.id in self._host:
            self._host.touch(prepared.id)
            return False
        self._host.put(prepared.id, prepared)
        return True

    def remove_adapter(self, lora_id: int) -> bool:
        """Forget the adapter on both tiers (even if pinned, not if the running batch uses it)."""
        self._require(lora_id)
        self._check_not_running(lora_id)
        if lora_id in self._active:
            self._release(lora_id)
        self._host.remove(lora_id)
        return True

    def _on_host_evict(self, lora_id: int, _adapter: HostAdapter) -> None:
        if lora_id in self._active:
            self._release(lora_id)

    # ---- GPU tier -------------------------------------------------------------------

    def activate_adapter(self, lora_id: int, stream: "torch.cuda.Stream | None" = None,
                         keep: Iterable[int] = ()) -> int:
        """Give ``lora_id`` a GPU slot (evicting the least recently used evictable one) and return it.

        stream: write the slot there (a side stream; the caller orders it after every step that may read
        an evicted slot). keep: adapters not to evict besides the running batch's."""
        self._require(lora_id)
        if lora_id in self._active:
            self._active.move_to_end(lora_id)
            self._host.touch(lora_id)
            return self._active[lora_id]
        slot = self._free_slot()
        if slot is None:
            victims = self._gpu_evictable(exclude=set(keep))
            if not victims:
                raise LoRACapacityError(f"no GPU slot for LoRA adapter {lora_id}: all {len(self._slots)} slots "
                                        "hold pinned adapters, adapters of the running batch or ones to keep")
            slot = self._release(victims[0], stream)
        self._install(lora_id, slot, stream)
        self._host.touch(lora_id)
        return slot

    def deactivate_adapter(self, lora_id: int) -> bool:
        """Free the adapter's slot (unpinning it); False if it held none."""
        self._require(lora_id)
        if lora_id not in self._active:
            return False
        self._check_not_running(lora_id)
        self._host.unpin(lora_id)
        self._release(lora_id)
        return True

    def pin_adapter(self, lora_id: int, stream: "torch.cuda.Stream | None" = None) -> bool:
        """Keep the adapter on the GPU and in the host cache until removed or deactivated."""
        self._require(lora_id)
        self.activate_adapter(lora_id, stream)
        self._host.pin(lora_id)
        return True

    def set_running(self, ids: Iterable[int]) -> None:
        """Mark the adapters the current step reads: no eviction may take them (0 = base model)."""
        running = frozenset(i for i in ids if i)
        for lora_id in sorted(running):
            self._require(lora_id)
        self._running = running

    def prepare_batch(self, mapping: LoRAMapping, stream: "torch.cuda.Stream | None" = None) -> list[int | None]:
        """Activate every adapter of the step, mark them running, return lora_index_to_id."""
        ids = sorted(mapping.active_ids())
        for lora_id in ids:
            self._require(lora_id)
        if len(ids) > len(self._slots):
            raise LoRACapacityError(f"the batch mixes {len(ids)} adapters but max_loras is {len(self._slots)}")
        missing = [i for i in ids if i not in self._active]
        freeable = self._slots.count(None) + len(self._gpu_evictable(exclude=set(ids), running=frozenset()))
        if len(missing) > freeable:
            raise LoRACapacityError(f"the batch needs {len(missing)} more GPU slots but only {freeable} can be "
                                    "freed; the others hold pinned adapters")
        self._running = frozenset(ids)
        if self.compact_slots:
            self._place_low(ids, stream)
        for lora_id in ids:
            self.activate_adapter(lora_id, stream)
        return self.lora_index_to_id

    def _place_low(self, ids: list[int], stream: "torch.cuda.Stream | None") -> None:
        """Give each of the batch's adapters that is missing or sits at or above adapter_bound(len(ids)) a
        slot below it (_low_slot). Those left over (pinned or running adapters hold every low slot) go
        where activate_adapter puts them."""
        bound = adapter_bound(len(ids), len(self._slots))
        for lora_id in [i for i in ids if self._active.get(i, bound) >= bound]:
            slot = self._low_slot(bound, stream)
            if slot is None:
                return
            if lora_id in self._active:
                self._move(lora_id, slot, stream)
            else:
                self._install(lora_id, slot, stream)

    def _low_slot(self, bound: int, stream: "torch.cuda.Stream | None") -> int | None:
        """A free slot below ``bound``, or None. Made free if need be: the least recently used evictable
        adapter there moves up, into a free slot above the bound, else into the slot of the least recently
        used evictable adapter of all, which leaves the GPU as it would without compaction (if that is the
        one below the bound, it leaves and nothing moves)."""
        free = next((slot for slot in range(bound) if self._slots[slot] is None), None)
        if free is not None:
            return free
        evictable = self._gpu_evictable()
        low = next((i for i in evictable if self._active[i] < bound), None)
        if low is None:
            return None
        above = next((slot for slot in range(bound, len(self._slots)) if self._slots[slot] is None), None)
        if above is None:
            if evictable[0] == low:
                return self._release(low)
            above = self._release(evictable[0])
        slot = self._active[low]
        self._move(low, above, stream)
        return slot

    def _move(self, lora_id: int, slot: int, stream: "torch.cuda.Stream | None") -> None:
        """Copy a GPU adapter's slot (image, stacked A rows, ranks) into the free ``slot`` and free its old one,
        in stream order: steps already queued read the old slot, later ones the new."""
        old = self._active[lora_id]
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._arena[slot].copy_(self._arena[old], non_blocking=True)
            for dst, src in (zip(self._stacked_dst[slot], self._stacked_dst[old]) if self._stacked_a else ()):
                dst.copy_(src, non_blocking=True)
            if self.on_slot_write is not None:
                self.on_slot_write(slot)
            self._ranks[:, :, slot].copy_(self._ranks[:, :, old], non_blocking=True)
            self._ranks[:, :, old] = 0
        self._slots[old], self._slots[slot] = None, lora_id
        self._active[lora_id] = slot
        self.slot_moves += 1

    def _check_not_running(self, lora_id: int) -> None:
        if lora_id in self._running:
            raise LoRACapacityError(f"LoRA adapter {lora_id} is in use by the running batch")

    def _free_slot(self) -> int | None:
        return next((slot for slot, owner in enumerate(self._slots) if owner is None), None)

    def _gpu_evictable(self, exclude: set[int] | None = None, running: frozenset[int] | None = None) -> list[int]:
        running = self._running if running is None else running
        exclude = exclude or set()
        return [i for i in self._active if not self._host.is_pinned(i) and i not in running and i not in exclude]

    def _release(self, lora_id: int, stream: "torch.cuda.Stream | None" = None) -> int:
        """Free the slot; zero ranks make kernels skip it until the next write (on ``stream``, as this one)
        overwrites its image."""
        slot = self._active.pop(lora_id)
        self._slots[slot] = None
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._ranks[:, :, slot] = 0
        return slot

    def _install(self, lora_id: int, slot: int, stream: "torch.cuda.Stream | None") -> None:
        """Copy a registered adapter's host image into the free ``slot`` and record it there."""
        self._write(slot, self._host.peek(lora_id), stream)
        self._slots[slot], self._active[lora_id] = lora_id, slot

    def _write(self, slot: int, adapter: HostAdapter, stream: "torch.cuda.Stream | None") -> None:
        """Two copies: the adapter's slot image (zeros past its ranks included), then its ranks, which
        make the kernels read the slot; with stacked A rows, one more per linear module between them."""
        self.host_copies["ahead" if stream is not None else "in_step"] += 1
        with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
            self._arena[slot].copy_(adapter.slab[:self._arena.shape[1]], non_blocking=True)
            if self._stacked_a:
                for dst, src in zip(self._stacked_dst[slot], self.layout.image_a_all(adapter.slab)):
                    dst.copy_(src, non_blocking=True)
            if self.on_slot_write is not None:
                self.on_slot_write(slot)
            self._ranks[:, :, slot].copy_(adapter.ranks, non_blocking=True)
            if adapter.block is not None and self._pin_host:
                adapter.block.record()  # the pool hands the block out again only after these copies
