"""Adapters laid out for one rank's GPU slots, in host memory: AdapterPreparer and HostAdapter.

AdapterPreparer turns a LoRAModel into a HostAdapter: every module checked
against the served model's LoRA module specs, sub-modules grouped per packed
layer, cut for (tp_rank, tp_size) by tp.py, oriented as the slots are, cast
to the slot dtype with the LoRA scaling folded into B, all in ONE host
allocation laid out as one GPU slot (slot_layout.SlotLayout), so activating it
is one non-blocking copy. It holds no
GPU state and pickles, so a loader process can run it (replicas/model_runner.py):
the adapter then comes back in shared memory, and HostAdapter.copy() moves it
into pinned memory in one piece.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import (AdapterShapeError, LoRAConfigError, RankTooLargeError, UnknownTargetModuleError,
                              UnsupportedAdapterError)
from lora_core.layer_weights import LoRALayerWeights
from lora_core.load_parts import part_of
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.pinned_pool import PinnedBlock, PinnedSlabPool
from lora_core.slot_copies import SlotCopies
from lora_core.slot_layout import SlotLayout
from lora_core.tp import LocalDims, local_dims, local_rank, shard_lora_a, shard_lora_b, shard_lora_bias

_MEMORY = ("plain", "pinned", "shared")


@dataclass
class SliceWrite:
    """One sub-module's local tensors, already in slot orientation."""

    index: int                  # output slice
    a: torch.Tensor             # [r_a, in] (embedding: [vocab, r])
    b: torch.Tensor             # [out_slice, r]
    b_offset: int               # where the slice starts in lora_b's out dim
    bias: torch.Tensor | None   # [out_slice]
    scale: float = 1.0          # multiplies b and bias on their way into host memory (the LoRA scaling)


@dataclass
class HostAdapter:
    """One adapter as one image of a GPU slot (slot_layout.SlotLayout): ``slab`` holds every module's
    A, B and bias at the slot's offsets, zero past the adapter's ranks; ``ranks`` [modules, max_slices]
    int32 views the slab's header."""

    id: int
    rank: int
    slab: torch.Tensor  # uint8 [slot_bytes]
    ranks: torch.Tensor  # int32 [modules, max_slices], a view of slab
    # The pool block the slab views (PinnedSlabPool), released when this adapter is collected.
    block: PinnedBlock | None = dataclasses.field(default=None, repr=False, compare=False)

    def copy(self, pin_memory: bool = True, pool: PinnedSlabPool | None = None) -> "HostAdapter":
        """The same adapter in a new slab, by one copy: a block of ``pool`` when it has one free, else
        its own allocation (pinned by default)."""
        slab, block = _slab(self.slab.numel(), pin_memory, pool)
        slab.copy_(self.slab)
        start = (self.ranks.data_ptr() - self.slab.data_ptr()) // 4
        ranks = slab.view(torch.int32)[start:start + self.ranks.numel()].view(self.ranks.shape)
        return _owning(pool, block, HostAdapter(self.id, self.rank, slab, ranks, block))


def _slab(nbytes: int, pin_memory: bool, pool: PinnedSlabPool | None) -> tuple[torch.Tensor, PinnedBlock | None]:
    block = pool.allocate(nbytes) if pool is not None else None
    if block is not None:
        return block.tensor, block
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=pin_memory), None


def _owning(pool: PinnedSlabPool | None, block: PinnedBlock | None, adapter: HostAdapter) -> HostAdapter:
    if block is not None:
        pool.adopt(adapter, block)
    return adapter


class AdapterPreparer:
    """Lays adapters out for the slots of one rank: the host-side half of LoRAModelManager."""

    def __init__(self, specs: dict[str, LoRAModuleSpec], lora_config: LoRAConfig, slot_dtype: torch.dtype,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.specs = specs
        self.config = lora_config
        self.dtype = slot_dtype
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self._targets: dict[str, tuple[str, int]] = {}  # PEFT module name -> (spec name, slice)
        for spec in specs.values():
            for index, sub in enumerate(spec.sub_module_names()):
                if sub in self._targets:
                    raise LoRAConfigError(f"module {sub!r} is packed into two LoRA module specs")
                self._targets[sub] = (spec.name, index)
        self.dims = {name: local_dims(spec, tp_rank, tp_size, lora_config.max_lora_rank,
                                      lora_config.fully_sharded_loras) for name, spec in specs.items()}
        # Linear layers' A rows last: a manager may hold them under the base weights (stacked_a.py).
        linear = frozenset(name for name, spec in specs.items() if spec.kind is LoRAKind.LINEAR)
        self.layout = SlotLayout(self.dims, slot_dtype, lora_config.bias_enabled, a_last=linear)

    def prepare(self, lora: LoRAModel, memory: str = "plain", pool: PinnedSlabPool | None = None,
                out: torch.Tensor | None = None, part: tuple[int, int] | None = None) -> HostAdapter:
        """Validate lora against the slots and lay it out for them in ONE host allocation.

        memory: "plain", "pinned" (for asynchronous host-to-device copies) or
        "shared" (shared memory, to hand the adapter from a loader process to
        the serving one without a copy; HostAdapter.copy() then pins it).
        pool: plain or pinned slabs come from its blocks while it has free ones.
        out: write into this slab (uint8, at least slot_bytes) instead: a block of a pool that a loader
        process shares with the serving one (in_block() there). Raises the typed errors of a bad
        adapter and touches nothing else (out excepted).
        part=(k, n), with out: write only the modules of part k (load_parts.part_of), from a LoRAModel loaded
        with the same part; the n parts together write what one whole prepare does.
        """
        if memory not in _MEMORY:
            raise ValueError(f"memory must be one of {_MEMORY}, got {memory!r}")
        if out is not None and (out.dtype != torch.uint8 or out.numel() < self.layout.slot_bytes):
            raise ValueError(f"out must be a uint8 slab of >= {self.layout.slot_bytes} bytes, got {out.dtype} "
                             f"[{out.numel()}]")
        where = lora.path or f"LoRA adapter {lora.id}"
        max_rank = self.config.max_lora_rank
        if lora.rank > max_rank:
            raise RankTooLargeError(where, "r", f"rank {lora.rank} exceeds max_lora_rank {max_rank}")
        grouped: dict[str, list[LoRALayerWeights | None]] = {}
        for name, layer in lora.loras.items():
            if name not in self._targets:
                raise UnknownTargetModuleError(where, name, "the served model has no LoRA-able module of that name")
            spec_name, index = self._targets[name]
            self._check_layer(where, name, layer, self.specs[spec_name], index)
            grouped.setdefault(spec_name, [None] * len(self.specs[spec_name].out_slices))[index] = layer
        modules = {name: self._prepare_module(self.specs[name], layers) for name, layers in grouped.items()}
        if out is not None:
            slab = out[:self.layout.slot_bytes]
            return HostAdapter(lora.id, lora.rank, slab, self._write_image(slab, modules, part))
        if part is not None:
            raise ValueError("a part of an adapter is written into a given slab (out=) only")
        pool = pool if memory != "shared" else None
        slab, block = _slab(self.layout.slot_bytes, memory == "pinned", pool)
        if memory == "shared":
            slab.share_memory_()  # empty, so moving it to shared memory copies nothing
        ranks = self._write_image(slab, modules)
        return _owning(pool, block, HostAdapter(lora.id, lora.rank, slab, ranks, block))

    def in_block(self, lora_id: int, rank: int, block: PinnedBlock, pool: PinnedSlabPool) -> HostAdapter:
        """The adapter that prepare(out=block.tensor) wrote (in a loader process sharing the pool's region),
        owning the block: it goes back to the pool when the adapter is collected."""
        slab = block.tensor[:self.layout.slot_bytes]
        return _owning(pool, block, HostAdapter(lora_id, rank, slab, self.layout.ranks_view(slab), block))

    def max_slab_bytes(self) -> int:
        """The bytes of every adapter's slab: one slot's image (SlotLayout.slot_bytes)."""
        return self.layout.slot_bytes

    def _write_image(self, slab: torch.Tensor, modules: dict[str, tuple[torch.Tensor, list[SliceWrite]]],
                     part: tuple[int, int] | None = None) -> torch.Tensor:
        """Lay the adapter out in slab as one slot image (zeros past its ranks); returns the ranks view.

        One allocation per adapter, not one per tensor: pinning or sharing is a driver or kernel call
        that costs far more than the copy for small tensors (an 8B adapter has some 450 of them). The
        slab may hold another adapter's image (a reused pool block): what the writes leave is zeroed,
        and only that (zeroing all 84 MB of an 8B rank-16 image first took a fifth of its preparation).
        """
        ranks, regions = self.layout.image_views(slab)
        if part is not None:  # this part's modules only, each part's ranks rows its own
            regions = {name: views for name, views in regions.items() if part_of(name, part[1]) == part[0]}
        self._write_ranks(ranks, modules, [self.layout.index(name) for name in regions] if part else None)
        if part is None or part[0] == 0:
            slab.index_fill_(0, self.layout.padding, 0)
        for name, (a_all, b_all, bias_all) in regions.items():
            _zero_unwritten(a_all, b_all, bias_all, modules[name][1] if name in modules else [], self.dims[name])
        copies = SlotCopies()
        for name, (_, writes) in modules.items():
            a_all, b_all, bias_all = regions[name]
            for w in writes:
                if w.a.numel():
                    dst = a_all[:, :w.a.shape[1]] if self.dims[name].is_embedding else a_all[w.index, :w.a.shape[0]]
                    copies.add(dst, w.a, 1.0)
                rows = slice(w.b_offset, w.b_offset + w.b.shape[0])
                copies.add(b_all[rows, :w.b.shape[1]], w.b, w.scale)
                if w.bias is not None and bias_all is not None:
                    copies.add(bias_all[rows], w.bias, w.scale)
        copies.run()
        return ranks

    def _write_ranks(self, ranks: torch.Tensor, modules: dict[str, tuple[list[int], list[SliceWrite]]],
                     rows: list[int] | None) -> None:
        """The ranks table's rows (every row, or a part's ``rows``): each module's slice ranks, zeros elsewhere,
        in two torch calls (not two per module: replicas/gil.py says why that counts)."""
        rows = list(range(ranks.shape[0])) if rows is None else rows
        table = {row: [0] * ranks.shape[1] for row in rows}
        for name, (module_ranks, _) in modules.items():
            table[self.layout.index(name)][:len(module_ranks)] = module_ranks
        values = torch.tensor([table[row] for row in rows], dtype=ranks.dtype)
        if len(rows) == ranks.shape[0]:
            ranks.copy_(values)
        elif rows:
            ranks[rows] = values

    def _check_layer(self, where: str, name: str, layer: LoRALayerWeights, spec: LoRAModuleSpec,
                     index: int) -> None:
        if layer.rank > self.config.max_lora_rank:
            raise RankTooLargeError(where, name, f"rank {layer.rank} exceeds max_lora_rank {self.config.max_lora_rank}")
        want_a = (spec.in_features, layer.rank)
        want_b = (layer.rank, spec.out_slices[index])
        if tuple(layer.lora_a.shape) != want_a or tuple(layer.lora_b.shape) != want_b:
            raise AdapterShapeError(where, name, f"A {tuple(layer.lora_a.shape)} / B {tuple(layer.lora_b.shape)}, "
                                                 f"expected A {want_a} / B {want_b}")
        if layer.bias is not None:
            if spec.kind is LoRAKind.EMBEDDING:
                raise UnsupportedAdapterError(where, name, "an embedding LoRA cannot carry a bias")
            if not self.config.bias_enabled:
                raise UnsupportedAdapterError(where, name, "LoRA bias is off (LoRAConfig.bias_enabled)")
            if tuple(layer.bias.shape) != (spec.out_slices[index],):
                raise AdapterShapeError(where, name, f"bias {tuple(layer.bias.shape)}, expected "
                                                     f"({spec.out_slices[index]},)")

    def _prepare_module(self, spec: LoRAModuleSpec, layers: list[LoRALayerWeights | None]
                        ) -> tuple[list[int], list[SliceWrite]]:
        dims, fs = self.dims[spec.name], self.config.fully_sharded_loras
        cut = dict(shard=spec.shard, tp_rank=self.tp_rank, tp_size=self.tp_size)
        ranks, writes, offset = [0] * len(layers), [], 0
        for index, layer in enumerate(layers):
            if layer is not None:
                a = shard_lora_a(layer.lora_a, **cut, fully_sharded=fs, max_rank=self.config.max_lora_rank)
                if spec.shard is ShardKind.COLUMN and fs:  # keep only this rank's real (non-padding) columns
                    a = a[:, :max(0, min(dims.rank_a, layer.rank - self.tp_rank * dims.rank_a))]
                b = shard_lora_b(layer.lora_b, **cut, fully_sharded=fs)
                bias = shard_lora_bias(layer.bias, **cut, fully_sharded=fs)
                # The scaling is folded in by _write_image's copy: one pass over B, not two.
                writes.append(SliceWrite(index, a if dims.is_embedding else a.t(), b.t(), offset, bias,
                                          layer.scaling))
                ranks[index] = local_rank(layer.rank, **cut, max_rank=self.config.max_lora_rank, fully_sharded=fs)
            offset += dims.out_slices[index]
        return ranks, writes  # laid out in the slab by _write_image


def _zero_unwritten(a_all: torch.Tensor, b_all: torch.Tensor, bias_all: torch.Tensor | None,
                    writes: list[SliceWrite], dims: LocalDims) -> None:
    """Zero one module's regions of an image where ``writes`` put nothing: the A rows and B columns past
    each slice's rank, untargeted slices, biases not given (the kernels mask by rank, but a merge reads
    every row: lora_core/merge.py)."""
    by_index = {w.index: w for w in writes}
    offset = 0
    for index, width in enumerate(dims.out_slices):
        w = by_index.get(index)
        rank_b = 0 if w is None else w.b.shape[1]
        if rank_b < b_all.shape[1]:
            b_all[offset:offset + width, rank_b:].zero_()
        if bias_all is not None and (w is None or w.bias is None):
            bias_all[offset:offset + width].zero_()
        if dims.is_embedding:  # one slice; A is [vocab, R]
            rank_a = 0 if w is None else w.a.shape[1]
            if rank_a < a_all.shape[1]:
                a_all[:, rank_a:].zero_()
        else:
            rank_a = 0 if w is None else w.a.shape[0]
            if rank_a < a_all.shape[1]:
                a_all[index, rank_a:].zero_()
        offset += width
