"""Tensor-parallel slicing of LoRA weights (seed layout: A [in, r], B [r, out]).

The base layers are Megatron-sharded; each function here cuts one adapter's
A, B or bias for one (tp_rank, tp_size) so that the sharded LoRA plus the
collectives the layer already runs (or, with ``fully_sharded``, one small
extra collective on the [T, r] shrink buffer) equals the unsharded
``x @ A @ B``:

    COLUMN (qkv, gate_up, lm_head; output split per slice)
        A replicated                  | fully sharded: A split on the rank dim
        B split on out                |   (shrink is all-gathered), B split on out
    ROW (o_proj, down_proj; input split, partial outputs all-reduced)
        A split on in                 | fully sharded: A split on in, partial
        B replicated                  |   shrink all-reduced, B split on out
    VOCAB (embed_tokens; vocab rows split)
        A rows split, B replicated in both modes
    REPLICATED: nothing is cut.

Functions take one sub-module's tensors: a packed layer (qkv_proj) calls them
once per slice, so "split on out" is always per slice, never across the
concatenation. For the fully-sharded rank split, A is first zero-padded to
max_lora_rank so every rank holds the same R/tp columns and the gathered
buffer lines up with B's rows. A consequence: a small-rank adapter's real
columns all sit on the first TP ranks (the others shrink zeros).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.errors import LoRAConfigError
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind


def _check_tp(tp_rank: int, tp_size: int) -> None:
    if isinstance(tp_size, bool) or not isinstance(tp_size, int) or tp_size < 1:
        raise LoRAConfigError(f"tp_size must be a positive integer, got {tp_size!r}")
    if isinstance(tp_rank, bool) or not isinstance(tp_rank, int) or not 0 <= tp_rank < tp_size:
        raise LoRAConfigError(f"tp_rank must be in [0, {tp_size}), got {tp_rank!r}")


def _chunk(t: torch.Tensor, dim: int, tp_rank: int, tp_size: int, what: str) -> torch.Tensor:
    size = t.shape[dim]
    if size % tp_size:
        raise LoRAConfigError(f"{what}: dim {size} is not divisible by tp_size {tp_size}")
    if tp_size == 1:
        return t  # the whole tensor, without a torch call (a load makes hundreds: replicas/gil.py)
    step = size // tp_size
    return t.narrow(dim, tp_rank * step, step)


def _pad_rank(lora_a: torch.Tensor, max_rank: int | None) -> torch.Tensor:
    rank = lora_a.shape[1]
    if max_rank is None:
        raise ValueError("fully-sharded column LoRA A needs max_rank to pad the rank dim before splitting it")
    if rank > max_rank:
        raise ValueError(f"LoRA A has rank {rank} > max_rank {max_rank}")
    if rank == max_rank:
        return lora_a
    return torch.nn.functional.pad(lora_a, (0, max_rank - rank))


def shard_lora_a(lora_a: torch.Tensor, shard: ShardKind, tp_rank: int, tp_size: int, *,
                 fully_sharded: bool = False, max_rank: int | None = None) -> torch.Tensor:
    """This rank's part of A [in, r]: [in, r], [in/tp, r], [vocab/tp, r] or [in, max_rank/tp]."""
    _check_tp(tp_rank, tp_size)
    shard = ShardKind(shard)
    if shard is ShardKind.COLUMN and fully_sharded:
        if max_rank is not None and max_rank % tp_size:
            raise LoRAConfigError(f"fully-sharded LoRA: max_lora_rank {max_rank} is not divisible by tp_size {tp_size}")
        return _chunk(_pad_rank(lora_a, max_rank), 1, tp_rank, tp_size, "column LoRA A rank")
    if shard is ShardKind.ROW:
        return _chunk(lora_a, 0, tp_rank, tp_size, "row-parallel LoRA A input")
    if shard is ShardKind.VOCAB:
        return _chunk(lora_a, 0, tp_rank, tp_size, "vocab-parallel LoRA A vocab")
    return lora_a


def shard_lora_b(lora_b: torch.Tensor, shard: ShardKind, tp_rank: int, tp_size: int, *,
                 fully_sharded: bool = False) -> torch.Tensor:
    """This rank's part of one slice's B [r, out]: [r, out/tp] or the whole B."""
    _check_tp(tp_rank, tp_size)
    shard = ShardKind(shard)
    if shard is ShardKind.COLUMN or (shard is ShardKind.ROW and fully_sharded):
        return _chunk(lora_b, 1, tp_rank, tp_size, f"{shard.value}-parallel LoRA B output")
    # VOCAB keeps B whole even when fully sharded: a token's shrink row is
    # non-zero only on the rank owning that token, so the owner must add the
    # whole hidden vector; a hidden-split B would need another collective.
    return lora_b


def shard_lora_bias(bias: torch.Tensor | None, shard: ShardKind, tp_rank: int, tp_size: int, *,
                    fully_sharded: bool = False) -> torch.Tensor | None:
    """This rank's part of one slice's bias [out]; it follows B's output split."""
    _check_tp(tp_rank, tp_size)
    if bias is None:
        return None
    shard = ShardKind(shard)
    if shard is ShardKind.VOCAB:
        raise ValueError("an embedding LoRA carries no bias")
    if shard is ShardKind.COLUMN or (shard is ShardKind.ROW and fully_sharded):
        return _chunk(bias, 0, tp_rank, tp_size, f"{shard.value}-parallel LoRA bias")
    if shard is ShardKind.ROW and tp_rank != 0:
        # Row outputs are partial sums all-reduced across ranks: add the bias once.
        return torch.zeros_like(bias)
    return bias


def local_rank(rank: int, shard: ShardKind, tp_rank: int, tp_size: int, max_rank: int,
               fully_sharded: bool) -> int:
    """The value for LoRASlotBuffers.ranks: the real rank of the slice's B rows.

    Every mode keeps B's rank dim whole, so this is the adapter's rank. In a
    fully-sharded column layer A holds only max_rank/tp rows per TP rank; the
    shrink must read min(rank, R_a) of them (rows past the real rank are zero)
    while the expand over the gathered [T, max_rank] buffer reads ``rank``.
    """
    _check_tp(tp_rank, tp_size)
    if rank > max_rank:
        raise ValueError(f"rank {rank} > max_rank {max_rank}")
    return rank


@dataclass(frozen=True)
class LocalDims:
    """Local (this TP rank) sizes of one spec's slot buffers."""

    in_features: int              # [vocab/tp] for an embedding
    out_slices: tuple[int, ...]   # per-slice local output widths
    rank_a: int                   # R_a: rows of A per slot
    rank_b: int                   # R_b: rank columns of B per slot
    is_embedding: bool = False

    @property
    def out_features(self) -> int:
        return sum(self.out_slices)

    def lora_a_shape(self, num_slots: int) -> tuple[int, ...]:
        if self.is_embedding:
            return (1, num_slots, self.in_features, self.rank_a)
        return (len(self.out_slices), num_slots, self.rank_a, self.in_features)

    def lora_b_shape(self, num_slots: int) -> tuple[int, ...]:
        return (num_slots, self.out_features, self.rank_b)


def _divide(value: int, tp_size: int, what: str) -> int:
    if value % tp_size:
        raise LoRAConfigError(f"{what} {value} is not divisible by tp_size {tp_size}")
    return value // tp_size


def local_dims(spec: LoRAModuleSpec, tp_rank: int, tp_size: int, max_rank: int,
               fully_sharded: bool) -> LocalDims:
    """Local buffer sizes of ``spec`` on tp_rank; LoRAConfigError if a dim does not split."""
    _check_tp(tp_rank, tp_size)
    shard = ShardKind(spec.shard)
    is_embedding = spec.kind is LoRAKind.EMBEDDING
    if is_embedding and shard not in (ShardKind.VOCAB, ShardKind.REPLICATED):
        raise LoRAConfigError(f"{spec.name}: an embedding is vocab-parallel or replicated, not {shard.value}")
    if shard is ShardKind.VOCAB and not is_embedding:
        raise LoRAConfigError(f"{spec.name}: only an embedding can be vocab-parallel")
    if is_embedding and len(spec.out_slices) != 1:
        raise LoRAConfigError(f"{spec.name}: an embedding has one output slice")
    in_features, out_slices, rank_a = spec.in_features, tuple(spec.out_slices), max_rank
    if shard in (ShardKind.ROW, ShardKind.VOCAB):
        in_features = _divide(in_features, tp_size, f"{spec.name}: {shard.value}-parallel input dim")
    if shard is ShardKind.COLUMN or (shard is ShardKind.ROW and fully_sharded):
        out_slices = tuple(_divide(w, tp_size, f"{spec.name}: {shard.value}-parallel output slice")
                           for w in out_slices)
    if shard is ShardKind.COLUMN and fully_sharded:
        rank_a = _divide(max_rank, tp_size, f"{spec.name}: fully-sharded LoRA needs max_lora_rank that splits;"
                                            " max_lora_rank")
    return LocalDims(in_features, out_slices, rank_a, max_rank, is_embedding)
