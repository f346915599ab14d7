"""Per-step kernel metadata: tokens grouped by adapter slot, cut into M-tiles.

Built once per model step (update_metadata) and read by every LoRA layer of
that step. Everything is computed on the device into buffers allocated once,
so building it never waits for the GPU and a decode step can be captured in a
CUDA graph.

Layout, for T tokens with slots s[0..T) (-1 = no adapter):
    sorted_idx [T]        token indices ordered by slot (stable); the -1
                          tokens come first and are never referenced
    tile_lora  [max_tiles] slot of each M-tile, -1 past the last real tile
    tile_start [max_tiles] first position in sorted_idx covered by the tile
    tile_end   [max_tiles] end of that slot's run in sorted_idx
    num_tiles  [1]         how many tiles are real (the rest have tile_lora -1)
A tile holds up to block_m tokens of one slot, so the kernels never mix two
adapters in one tl.dot (SGMV). max_tiles bounds sum_l ceil(c_l / block_m) by
ceil(T / block_m) + min(T, L) - 1 whatever the popularity, L being the step's
adapters rounded up (adapter_bound): the kernels' grids are sized by it.
"""

from __future__ import annotations

import torch


def choose_block_m(num_tokens: int, num_adapters: int = 1) -> int:
    """Rows per SGMV tile, from the step's tokens per adapter (known on the host, so no sync).

    A tile holds one adapter's tokens, so tiles taller than an adapter's run
    only add masked rows, and shorter ones re-read its weights once per tile.
    bench/RESULTS.md has the sweeps behind these bounds.
    """
    if num_tokens <= 128 or num_tokens <= 16 * max(1, num_adapters):
        return 16
    return 32 if num_tokens <= 1024 else 64


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
        int32 = dict(dtype=torch.int32, device=device)
        worst_tiles = max_tiles(max_rows, num_slots, 16)
        self._slots = torch.full((max_rows,), -1, **int32)
        self._sorted_idx = torch.zeros(max_rows, dtype=torch.int64, device=device)
        self._tile_lora = torch.full((worst_tiles,), -1, **int32)
        self._tile_start = torch.zeros(worst_tiles, **int32)
        self._tile_end = torch.zeros(worst_tiles, **int32)
        self._counts = torch.zeros(num_slots + 1, dtype=torch.int64, device=device)
        self._tile_ids = torch.arange(worst_tiles, dtype=torch.int64, device=device)
        self._num_tiles = torch.zeros(1, **int32)  # real tiles of the step: the kernels deal work over them
        self.num_rows = 0
        self.num_adapters = 0  # distinct slots this step; 0 lets layers skip LoRA entirely
        self.slot_bound = num_slots  # the step's highest slot + 1, rounded up as adapter_bound does
        self.block_m = 16
        self.use_bgmv = False
        self.max_tiles = 1

    def update(self, slots: torch.Tensor, num_adapters: int, slot_bound: int | None = None) -> None:
        """Take this step's slot per row (int32 on the device, -1 = none) and derive the tiles.

        num_adapters: distinct slots in use, known on the host. It sets the tile height and bounds the
        tile count (layout), so it must not be lower than the truth: tiles past the bound are dropped.
        slot_bound: no row's slot is at or past it (host-known; default every slot): how many slots'
        A rows a stacked GEMM must cover (lora_core/stacked_a.py).
        """
        n = slots.shape[0]
        if n > self.max_rows:
            raise ValueError(f"{n} rows exceed the {self.max_rows} this PunicaWrapper was sized for")
        self.num_rows = n
        self.num_adapters = num_adapters
        self.slot_bound = self.num_slots if slot_bound is None else slot_bound
        self.block_m, self.use_bgmv, self.max_tiles = self.layout(n, num_adapters)
        if n == 0:
            return
        self._slots[:n].copy_(slots, non_blocking=True)
        self.rebuild()

    def layout(self, num_rows: int, num_adapters: int) -> tuple[int, bool, int]:
        """(block_m, use_bgmv, max_tiles): every host-side launch parameter the kernels take from a step.

        Two steps with equal layouts (and row counts) launch identical grids,
        so one captured CUDA graph serves both.
        """
        block_m = choose_block_m(num_rows, num_adapters)
        # BGMV (one token per program) wins while adapters are barely shared.
        use_bgmv = num_rows <= self.bgmv_max_rows and num_rows <= 2 * max(1, num_adapters)
        return block_m, use_bgmv, max_tiles(num_rows, adapter_bound(num_adapters, self.num_slots), block_m)

    def launch_key(self, num_rows: int, num_adapters: int) -> tuple:
        """What a CUDA graph of such a step freezes of this metadata (0 adapters: the layers skip LoRA)."""
        if not num_adapters:
            return (num_rows, 0)
        return (num_rows, 1, *self.layout(num_rows, num_adapters))

    def rebuild(self) -> None:
        """Recompute tiles from the slots already in the buffer (device work only)."""
        n, bm, L = self.num_rows, self.block_m, self.num_slots
        slots = self._slots[:n]
        order = torch.sort(slots, stable=True).indices
        self._sorted_idx[:n].copy_(order)
        bins = (slots.long() + 1).clamp_(0, L)
        counts = self._counts.zero_().scatter_add_(0, bins, torch.ones_like(bins))
        ends = torch.cumsum(counts, 0)  # bin b (slot b-1) occupies [ends[b]-counts[b], ends[b])
        starts = ends - counts
        tiles_per_slot = (counts[1:] + bm - 1) // bm
        tile_cum = torch.cumsum(tiles_per_slot, 0)
        ids = self._tile_ids[: self.max_tiles]
        slot = torch.searchsorted(tile_cum, ids, right=True)
        valid = slot < L
        slot = slot.clamp_(max=L - 1)
        first_tile = tile_cum[slot] - tiles_per_slot[slot]
        start = starts[slot + 1] + (ids - first_tile) * bm
        self._tile_lora[: self.max_tiles].copy_(torch.where(valid, slot, -1))
        self._tile_start[: self.max_tiles].copy_(start)
        self._tile_end[: self.max_tiles].copy_(ends[slot + 1])
        self._num_tiles.copy_(tile_cum[-1:].clamp(max=self.max_tiles))

    @property
    def slots(self) -> torch.Tensor:
        return self._slots[: self.num_rows]

    @property
    def sorted_idx(self) -> torch.Tensor:
        return self._sorted_idx[: self.num_rows]

    @property
    def tile_lora(self) -> torch.Tensor:
        return self._tile_lora[: self.max_tiles]

    @property
    def tile_start(self) -> torch.Tensor:
        return self._tile_start[: self.max_tiles]

    @property
    def tile_end(self) -> torch.Tensor:
        return self._tile_end[: self.max_tiles]

    @property
    def num_tiles(self) -> torch.Tensor:
        """[1] int32: tiles holding tokens (the first num_tiles of tile_lora are >= 0)."""
        return self._num_tiles
