"""Adapters laid out for one rank's GPU slots, in host memory: AdapterPreparer and HostAdapter.

AdapterPreparer turns a LoRAModel into a HostAdapter: every module checked
against the served model's LoRA module specs, sub-modules grouped per packed
layer, cut for (tp_rank, tp_size) by tp.py, oriented as the slots are, cast
to the slot dtype with the LoRA scaling folded into B, all in ONE host
allocation, so activating it is a handful of non-blocking copies. It holds no
GPU state and pickles, so a loader process can run it (replicas/model_runner.py):
the adapter then comes back in shared memory, and HostAdapter.copy() moves it
into pinned memory in one piece.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import (AdapterShapeError, LoRAConfigError, RankTooLargeError, UnknownTargetModuleError,
                              UnsupportedAdapterError)
from lora_core.layer_weights import LoRALayerWeights
from lora_core.lora_model import LoRAModel
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.pinned_pool import PinnedBlock, PinnedSlabPool
from lora_core.tp import local_dims, local_rank, shard_lora_a, shard_lora_b, shard_lora_bias

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
    id: int
    rank: int
    modules: dict[str, tuple[torch.Tensor, list[SliceWrite]]]  # spec name -> (ranks [S] int32, writes)
    # The pool block the tensors view (PinnedSlabPool), released when this adapter is collected.
    block: PinnedBlock | None = dataclasses.field(default=None, repr=False, compare=False)

    def tensors(self) -> list[torch.Tensor]:
        return [t for ranks, writes in self.modules.values()
                for t in [ranks] + [x for w in writes for x in (w.a, w.b, w.bias) if x is not None]]

    def copy(self, pin_memory: bool = True, pool: PinnedSlabPool | None = None) -> "HostAdapter":
        """The same adapter in a new slab: one allocation, one copy (every tensor views one slab).

        The slab is a block of ``pool`` when it has one free, else pinned (by default) on its own.
        """
        tensors = self.tensors()
        storage = tensors[0].untyped_storage()
        if any(t.untyped_storage().data_ptr() != storage.data_ptr() or not t.is_contiguous() for t in tensors):
            raise ValueError("HostAdapter.copy() needs every tensor to be a contiguous view of one slab")
        source = torch.empty(0, dtype=torch.uint8).set_(storage)
        slab, block = _slab(source.numel(), pin_memory, pool)
        slab.copy_(source)

        def moved(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None:
                return None
            start = t.storage_offset() * t.element_size()
            return slab[start:start + t.numel() * t.element_size()].view(t.dtype).view(t.shape)

        return _owning(pool, block, HostAdapter(self.id, self.rank, {
            name: (moved(ranks), [dataclasses.replace(w, a=moved(w.a), b=moved(w.b), bias=moved(w.bias))
                                  for w in writes])
            for name, (ranks, writes) in self.modules.items()}, block))


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

    def prepare(self, lora: LoRAModel, memory: str = "plain", pool: PinnedSlabPool | None = None) -> HostAdapter:
        """Validate lora against the slots and lay it out for them in ONE host allocation.

        memory: "plain", "pinned" (for asynchronous host-to-device copies) or
        "shared" (shared memory, to hand the adapter from a loader process to
        the serving one without a copy; HostAdapter.copy() then pins it).
        pool: plain or pinned slabs come from its blocks while it has free ones.
        Raises the typed errors of a bad adapter and touches nothing else.
        """
        if memory not in _MEMORY:
            raise ValueError(f"memory must be one of {_MEMORY}, got {memory!r}")
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
        pool = pool if memory != "shared" else None
        host, block = self._to_host(modules, memory, pool)
        return _owning(pool, block, HostAdapter(lora.id, lora.rank, host, block))

    def max_slab_bytes(self) -> int:
        """The largest slab prepare() can lay out: every module at max_lora_rank (its slot's size)."""
        esize = torch.empty((), dtype=self.dtype).element_size()
        total = 0
        for name, dims in self.dims.items():
            n_slices = len(dims.out_slices)
            a = math.prod(dims.lora_a_shape(1)) * esize
            b = math.prod(dims.lora_b_shape(1)) * esize
            bias = sum(dims.out_slices) * esize if self.config.bias_enabled else 0
            # Per tensor up to 63 bytes of alignment: ranks, and a, b, bias per slice.
            total += 4 * n_slices + a + b + bias + 64 * (1 + 3 * n_slices)
        return total

    def _to_host(self, modules: dict[str, tuple[torch.Tensor, list[SliceWrite]]], memory: str,
                 pool: PinnedSlabPool | None = None
                 ) -> tuple[dict[str, tuple[torch.Tensor, list[SliceWrite]]], PinnedBlock | None]:
        """Contiguous copies of every tensor, in the slot dtype, carved from ONE host allocation.

        Pinning (and sharing) is a driver or kernel call that costs far more
        than the copy for small tensors: one per adapter, not one per tensor
        (an 8B-shaped adapter has some 450 of them).
        """
        tensors: list[tuple[torch.Tensor, torch.dtype, float]] = []  # (source, slot dtype, scale)
        for ranks, writes in modules.values():
            tensors.append((ranks, torch.int32, 1.0))
            for w in writes:
                tensors += [(w.a, self.dtype, 1.0), (w.b, self.dtype, w.scale)]
                if w.bias is not None:
                    tensors.append((w.bias, self.dtype, w.scale))
        sizes = [t.numel() * torch.empty((), dtype=d).element_size() for t, d, _ in tensors]
        starts = [0]
        for size in sizes:
            starts.append(starts[-1] + -(-size // 64) * 64)  # 64-byte aligned, so every dtype can view its slice
        slab, block = _slab(starts[-1], memory == "pinned", pool)
        if memory == "shared":
            slab.share_memory_()  # empty, so moving it to shared memory copies nothing

        def place(t: torch.Tensor, dtype: torch.dtype, scale: float, start: int, size: int) -> torch.Tensor:
            dst = slab[start:start + size].view(dtype).view(tuple(t.shape))
            # As LoRALayerWeights.optimize: the product in the source dtype, rounded once into the slot's.
            return dst.copy_(t) if scale == 1.0 else torch.mul(t, scale, out=dst)

        copies = iter([place(*t, start, size) for t, start, size in zip(tensors, starts, sizes)])
        out = {}
        for name, (_, writes) in modules.items():
            ranks = next(copies)
            out[name] = (ranks, [dataclasses.replace(w, a=next(copies), b=next(copies), scale=1.0,
                                                     bias=next(copies) if w.bias is not None else None)
                                 for w in writes])
        return out, block

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
                        ) -> tuple[torch.Tensor, list[SliceWrite]]:
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
                # The scaling is folded in by _to_host's copy: one pass over B, not two.
                writes.append(SliceWrite(index, a if dims.is_embedding else a.t(), b.t(), offset, bias,
                                          layer.scaling))
                ranks[index] = local_rank(layer.rank, **cut, max_rank=self.config.max_lora_rank, fully_sharded=fs)
            offset += dims.out_slices[index]
        return torch.tensor(ranks, dtype=torch.int32), writes  # host copies: _to_host
