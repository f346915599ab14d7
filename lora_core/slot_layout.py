"""SlotLayout: where every LoRA-able module's A, B and bias sit inside one slot's bytes.

The GPU slots of all modules live in ONE device tensor [max_loras, slot_bytes], and a host-tier
adapter is ONE image of a slot in that same layout (zero past each module's rank), so activating an
adapter is a single host-to-device copy of its image, plus its ranks. Before, it was one copy per
tensor and one zero_ per buffer, about a thousand torch calls: 20-40 ms of the engine thread per
activation for an 8B adapter, measured by bench/adapter_load.py.

The per-module tensors that LoRASlotBuffers and the kernels see are strided views of that tensor,
with the shapes slot_buffers.py documents; only their slot stride is the whole slot (slot_bytes).

A slot image starts with its ranks, int32 [num_modules, max_slices] in layout order, then each
module's regions, every one 64-byte aligned:
    A     [S, R_a, in]   (an embedding: [vocab, R])
    B     [out, R_b]
    bias  [out]          (only with bias_enabled; never for an embedding)
The A regions of the modules named ``a_last`` (the linear layers) come after every other region,
from ``arena_bytes`` on: a manager may keep those A rows outside its arena, under the layer's base
weight, where the base GEMM computes their shrink (lora_core/stacked_a.py); the arena then holds
only the first arena_bytes of each slot. The device keeps the ranks apart, in ``ranks``
[num_modules, max_slices, max_loras], because the kernels read ranks[s, slot] with a slot stride of one.
"""

from __future__ import annotations

import math

import torch

from lora_core.tp import LocalDims

_ALIGN = 64


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


class SlotLayout:
    def __init__(self, dims: dict[str, LocalDims], dtype: torch.dtype, bias_enabled: bool,
                 a_last: frozenset[str] = frozenset()) -> None:
        self.names = list(dims)
        self._index = {name: i for i, name in enumerate(self.names)}
        self.dims = dims
        self.dtype = dtype
        self.esize = torch.empty((), dtype=dtype).element_size()
        self.max_slices = max((len(d.out_slices) for d in dims.values()), default=1)
        self._regions: dict[str, tuple[int, int, int | None]] = {}  # name -> byte offsets of A, B, bias
        self.slot_bytes = 0
        gaps: list[torch.Tensor] = []  # alignment gaps: zeroed in every image (see padding)
        self._place(4 * len(self.names) * self.max_slices, gaps)  # the ranks header
        a_last = frozenset(a_last)
        if a_last - set(dims) or any(dims[name].is_embedding for name in a_last):
            raise ValueError(f"a_last names modules that are not linear ones here: {sorted(a_last)}")
        a_sizes = {name: math.prod(d.lora_a_shape(1)) * self.esize for name, d in dims.items()}
        for name, d in dims.items():
            a = None if name in a_last else self._place(a_sizes[name], gaps)
            b = self._place(math.prod(d.lora_b_shape(1)) * self.esize, gaps)
            bias = self._place(d.out_features * self.esize, gaps) if bias_enabled and not d.is_embedding else None
            self._regions[name] = (a, b, bias)
        self.a_last = a_last
        self.arena_bytes = self.slot_bytes  # every region but the a_last A rows
        # The a_last A rows as one run from arena_bytes on: split sizes (elements) of each and of the
        # alignment gaps between them, and which pieces are A rows (image_a_all).
        self._a_split: list[int] = []
        self._a_pieces: list[int] = []
        done = self.arena_bytes  # where the run's pieces so far end (before the last one's alignment gap)
        for name in self.a_last_names():
            start = self._place(a_sizes[name], gaps)
            self._regions[name] = (start,) + self._regions[name][1:]
            if start > done:
                self._a_split.append((start - done) // self.esize)
            self._a_pieces.append(len(self._a_split))
            self._a_split.append(a_sizes[name] // self.esize)
            done = start + a_sizes[name]
        # int64 byte offsets that no view covers: zeroed in every image, so that two images of one
        # adapter are equal byte for byte whatever their slabs held before
        self.padding = torch.cat(gaps) if gaps else torch.zeros(0, dtype=torch.int64)

    def _place(self, nbytes: int, gaps: list[torch.Tensor]) -> int:
        """Append a region of nbytes; returns its offset. The slot grows to the next aligned offset."""
        start, end = self.slot_bytes, self.slot_bytes + nbytes
        self.slot_bytes = _aligned(end)
        if self.slot_bytes > end:
            gaps.append(torch.arange(end, self.slot_bytes))
        return start

    def a_shape(self, name: str) -> tuple[int, int, int]:
        """[S, R_a, in]: a linear module's A rows in one slot."""
        d = self.dims[name]
        return len(d.out_slices), d.rank_a, d.in_features

    def a_last_names(self) -> list[str]:
        """The a_last modules in image order (image_a_all's order)."""
        return [name for name in self.names if name in self.a_last]

    def image_a_all(self, slab: torch.Tensor) -> list[torch.Tensor]:
        """Every a_last module's A rows in a slot image (uint8 [slot_bytes]), flat views in a_last_names order.
        One split for all of them: an activation copies each, and 128 view constructions (8B) cost the
        engine thread more than the split."""
        typed = slab.view(self.dtype)
        parts = typed.narrow(0, self.arena_bytes // self.esize, sum(self._a_split)).split(self._a_split)
        return [parts[i] for i in self._a_pieces]

    def index(self, name: str) -> int:
        """The module's row in the ranks header and in LoRAModelManager's ranks tensor."""
        return self._index[name]

    def slot_views(self, arena: torch.Tensor
                   ) -> dict[str, tuple[torch.Tensor | None, torch.Tensor, torch.Tensor | None]]:
        """arena: uint8 [num_slots, slot_bytes] -> name -> (lora_a, lora_b, bias) as LoRASlotBuffers holds them.
        An arena of [num_slots, arena_bytes] holds no a_last A rows: their lora_a is None."""
        if arena.dim() != 2 or arena.shape[1] not in (self.slot_bytes, self.arena_bytes) \
                or arena.dtype != torch.uint8:
            raise ValueError(f"expected a uint8 arena [slots, {self.slot_bytes}] (or [slots, {self.arena_bytes}]), "
                             f"got {arena.dtype} {tuple(arena.shape)}")
        short = arena.shape[1] < self.slot_bytes
        typed = arena.view(self.dtype)
        slots, stride = arena.shape[0], arena.shape[1] // self.esize
        out = {}
        for name, (a, b, bias) in self._regions.items():
            d = self.dims[name]
            if d.is_embedding:
                a_size, a_stride = (1, slots, d.in_features, d.rank_a), (d.in_features * d.rank_a, stride, d.rank_a, 1)
            else:
                n = len(d.out_slices)
                a_size = (n, slots, d.rank_a, d.in_features)
                a_stride = (d.rank_a * d.in_features, stride, d.in_features, 1)
            out[name] = (None if short and name in self.a_last else self._view(typed, a_size, a_stride, a),
                         self._view(typed, (slots, d.out_features, d.rank_b), (stride, d.rank_b, 1), b),
                         None if bias is None else self._view(typed, (slots, d.out_features), (stride, 1), bias))
        return out

    def image_views(self, slab: torch.Tensor) -> tuple[torch.Tensor, dict[str, tuple[torch.Tensor, ...]]]:
        """slab: uint8 [slot_bytes], one slot's image -> (ranks [modules, max_slices] int32,
        name -> (A, B, bias) without the slot axis: A [S, R_a, in] or [vocab, R], B [out, R_b], bias [out])."""
        views = self.slot_views(slab.view(1, -1))
        regions = {name: (a[0, 0] if self.dims[name].is_embedding else a[:, 0], b[0], None if bias is None else bias[0])
                   for name, (a, b, bias) in views.items()}
        return self.ranks_view(slab), regions

    def ranks_view(self, slab: torch.Tensor) -> torch.Tensor:
        """slab: uint8 [slot_bytes], one slot's image -> its header, ranks [modules, max_slices] int32."""
        return slab[:4 * len(self.names) * self.max_slices].view(torch.int32).view(len(self.names), self.max_slices)

    def _view(self, typed: torch.Tensor, size: tuple[int, ...], stride: tuple[int, ...], byte_offset: int
              ) -> torch.Tensor:
        return typed.as_strided(size, stride, typed.storage_offset() + byte_offset // self.esize)
