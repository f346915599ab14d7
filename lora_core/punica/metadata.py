"""Per-step kernel metadata: tokens grouped by adapter slot, cut into M-tiles.

Built once per model step (update_metadata) and read by every LoRA layer of
that step. The step's slots are host data (the LoRAMapping), so the tiles are
computed on the host with numpy and reach the device in one non-blocking copy:
building them never waits for the GPU, and a decode step can be captured in a
CUDA graph. (A first version derived them on the device: 42 small kernels per
metadata, ~0.19 ms of every LoRA step's GPU time on an H200 before its graph
could start.)

Layout, for T tokens with slots s[0..T) (-1 = no adapter):
    slots      [T]        the slot of each token
    sorted_idx [T]        token indices ordered by slot (stable); the -1
                          tokens come first and are never referenced
    tile_lora  [max_tiles] slot of each M-tile, -1 past the last real tile
    tile_start [max_tiles] first position in sorted_idx covered by the tile
    tile_end   [max_tiles] end of that slot's run in sorted_idx
    num_tiles  [1]         how many tiles are real (the rest have tile_lora -1)
    row_active [T]        each token's index in `active` (-1 = no adapter)
    active     [L_slots]  the step's distinct slots in slot order (0 past num_active)
    num_active [1]        how many (lora_gemm.py's one-launch sites read these three)
all int32, in that order in one device buffer, each starting 16-byte aligned
(Triton specializes a kernel on its pointers' alignment: unaligned starts that
vary with T compiled new variants while serving). Their offsets follow from
(T, max_tiles), which a CUDA graph's launch key fixes, so every replay of a
graph reads the arrays where its step's copy wrote them.
A tile holds up to block_m tokens of one slot, so the kernels never mix two
adapters in one tl.dot (SGMV). max_tiles bounds sum_l ceil(c_l / block_m) by
ceil(T / block_m) + min(T, L) - 1 whatever the popularity, L being the step's
adapters rounded up (adapter_bound): the kernels' grids are sized by it.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import torch


def choose_block_m(num_tokens: int, num_adapters: int = 1) -> int:
    """Rows per SGMV tile, from the step's tokens per adapter (known on the host, so no sync).

    A tile holds one adapter's tokens, so tiles taller than an adapter's run
    only add masked rows, and shorter ones re-read its weights once per tile.
    bench/punica_kernels.py sweeps these bounds.
    """
    if num_tokens <= 128 or num_tokens <= 16 * max(1, num_adapters):
        return 16
    return 32 if num_tokens <= 1024 else 64


# Steps of up to bgmv_max_rows rows run BGMV (one token per program) while they hold at most this many rows per
# adapter on average, SGMV tiles otherwise (bench/punica_kernels.py --bgmv-rows-per-adapter sweeps it).
BGMV_ROWS_PER_ADAPTER = 2


def adapter_bound(num_adapters: int, num_slots: int) -> int:
    """The adapters a step's grid is sized for: its own count (known on the host) rounded up to a power
    of four, so that three CUDA graphs per row count cover 1-16 adapters. Sizing grids for every slot
    launched up to 16x more programs than a one-adapter step has tiles: programs that only exit, after
    waiting for the kernel before (PDL), but hold their SM's shared memory meanwhile."""
    bound = 1
    while bound < num_adapters:
        bound *= 4
    return min(num_slots, bound)


def max_tiles(num_tokens: int, num_slots: int, block_m: int) -> int:
    return max(1, -(-num_tokens // block_m) + min(num_tokens, num_slots) - 1)


class PunicaMetadata:
    """Slot mapping of one kind of row (all tokens, or the sampled rows) for one step."""

    def __init__(self, max_rows: int, num_slots: int, device: torch.device, bgmv_max_rows: int = 32) -> None:
        self.max_rows = max_rows
        # Up to this many rows the Triton backend runs its BGMV kernels.
        self.bgmv_max_rows = bgmv_max_rows
        self.num_slots = num_slots
        self.device = device
        # every array of the module doc, sized for the largest step
        self._packed = torch.zeros(_offsets(max_rows, max_tiles(max_rows, num_slots, 16), num_slots)[-1] + 1,
                                   dtype=torch.int32, device=device)
        self._views: tuple[torch.Tensor, ...] = self._split(_offsets(0, 1, num_slots), 0, 1)
        self.num_rows = 0
        self.num_adapters = 0  # distinct slots this step; 0 lets layers skip LoRA entirely
        self.slot_bound = num_slots  # the step's highest slot + 1, rounded up as adapter_bound does
        self.block_m = 16
        self.use_bgmv = False
        self.max_tiles = 1

    def update(self, slots: Sequence[int], num_adapters: int, slot_bound: int | None = None) -> None:
        """Take this step's slot per row (host ints, -1 = none), derive the tiles and copy them over.

        num_adapters: distinct slots in use, known on the host. It sets the tile height and bounds the
        tile count (layout), so it must not be lower than the truth: tiles past the bound are dropped.
        slot_bound: no row's slot is at or past it (host-known; default every slot): how many slots'
        A rows a stacked GEMM must cover (lora_core/stacked_a.py).
        """
        n = len(slots)
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed the {self.max_rows} this PunicaWrapper was sized for")
        self.num_rows = n
        self.num_adapters = num_adapters
        self.slot_bound = self.num_slots if slot_bound is None else slot_bound
        self.block_m, self.use_bgmv, self.max_tiles = self.layout(n, num_adapters)
        offsets = _offsets(n, self.max_tiles, self.num_slots)
        self._views = self._split(offsets, n, self.max_tiles)
        if n == 0:
            return
        # Every array is written in full; the alignment gaps between them are read by nothing.
        host = torch.empty(offsets[-1] + 1, dtype=torch.int32, pin_memory=self.device.type == "cuda")
        slots = np.asarray(slots, dtype=np.int32)
        arrays = (*host_tiles(slots, self.num_slots, self.block_m, self.max_tiles), *host_active(slots, self.num_slots))
        out = host.numpy()
        for offset, array in zip(offsets, arrays):
            out[offset:offset + array.shape[0]] = array
        # Non-blocking from pinned memory: the caching host allocator keeps `host` until the copy has run.
        self._packed[:host.shape[0]].copy_(host, non_blocking=True)

    def _split(self, offsets: tuple[int, ...], n: int, tiles: int) -> tuple[torch.Tensor, ...]:
        """Views of the packed buffer at _offsets(n, tiles, slots): a step of n rows and `tiles` tile slots."""
        return tuple(self._packed[o:o + size] for o, size in zip(offsets, _sizes(n, tiles, self.num_slots)))

    def layout(self, num_rows: int, num_adapters: int) -> tuple[int, bool, int]:
        """(block_m, use_bgmv, max_tiles): every host-side launch parameter the kernels take from a step.

        Two steps with equal layouts (and row counts) launch identical grids,
        so one captured CUDA graph serves both.
        """
        block_m = choose_block_m(num_rows, num_adapters)
        # BGMV (one token per program) wins while adapters are barely shared.
        use_bgmv = num_rows <= self.bgmv_max_rows and num_rows <= BGMV_ROWS_PER_ADAPTER * max(1, num_adapters)
        return block_m, use_bgmv, max_tiles(num_rows, adapter_bound(num_adapters, self.num_slots), block_m)

    def launch_key(self, num_rows: int, num_adapters: int) -> tuple:
        """What a CUDA graph of such a step freezes of this metadata (0 adapters: the layers skip LoRA)."""
        if not num_adapters:
            return (num_rows, 0)
        return (num_rows, 1, *self.layout(num_rows, num_adapters))

    @property
    def slots(self) -> torch.Tensor:
        return self._views[0]

    @property
    def sorted_idx(self) -> torch.Tensor:
        return self._views[1]

    @property
    def tile_lora(self) -> torch.Tensor:
        return self._views[2]

    @property
    def tile_start(self) -> torch.Tensor:
        return self._views[3]

    @property
    def tile_end(self) -> torch.Tensor:
        return self._views[4]

    @property
    def num_tiles(self) -> torch.Tensor:
        """[1] int32: tiles holding tokens (the first num_tiles of tile_lora are >= 0)."""
        return self._views[5]

    @property
    def row_active(self) -> torch.Tensor:
        return self._views[6]

    @property
    def active(self) -> torch.Tensor:
        return self._views[7]

    @property
    def num_active(self) -> torch.Tensor:
        return self._views[8]


def _sizes(n: int, tiles: int, slots: int) -> tuple[int, ...]:
    return n, n, tiles, tiles, tiles, 1, n, slots, 1


def _offsets(n: int, tiles: int, slots: int) -> tuple[int, ...]:
    """Where each array of the module doc starts in the packed buffer: consecutive, each at a multiple of
    four int32s (16 bytes)."""
    out, at = [], 0
    for size in _sizes(n, tiles, slots):
        out.append(at)
        at += -(-size // 4) * 4
    return tuple(out)


def host_tiles(slots: np.ndarray, num_slots: int, block_m: int,
               num_tiles: int) -> tuple[np.ndarray, ...]:
    """The module doc's arrays for int32 slots [T] (numpy, on the host): slots, sorted_idx, tile_lora,
    tile_start, tile_end [num_tiles] and num_tiles [1].

    Tiles run slot by slot in slot order, ceil(count / block_m) per slot; tile slots past the real
    tiles get slot -1 (and start / end 0)."""
    counts = np.bincount(np.clip(slots.astype(np.int64) + 1, 0, num_slots), minlength=num_slots + 1)
    ends = np.cumsum(counts)  # bin b (slot b - 1) occupies [ends[b] - counts[b], ends[b]) of sorted_idx
    per_slot = (counts[1:] + block_m - 1) // block_m
    cum = np.cumsum(per_slot)
    ids = np.arange(num_tiles)
    slot = np.searchsorted(cum, ids, side="right")
    real = slot < num_slots
    slot = np.minimum(slot, num_slots - 1)
    first = cum[slot] - per_slot[slot]
    return (slots, np.argsort(slots, kind="stable"), np.where(real, slot, -1),
            np.where(real, ends[slot + 1] - counts[slot + 1] + (ids - first) * block_m, 0),
            np.where(real, ends[slot + 1], 0), np.array([min(int(cum[-1]), num_tiles)]))


def host_active(slots: np.ndarray, num_slots: int) -> tuple[np.ndarray, ...]:
    """row_active [T], active [num_slots] and num_active [1] of the module doc for int32 slots [T]."""
    active = np.unique(slots[slots >= 0])
    row_active = np.where(slots >= 0, np.searchsorted(active, slots), -1).astype(np.int32)
    padded = np.zeros(num_slots, dtype=np.int32)
    padded[:active.shape[0]] = active
    return row_active, padded, np.array([active.shape[0]], dtype=np.int32)
