"""Megatron tensor-parallel linear layers; each parameter loads its own shard.

    ColumnParallelLinear   W [sum(out_k), in] split per output slice k on the out dim
      MergedColumnParallelLinear  gate_up: slices (gate, up), each split
      QKVParallelLinear           slices (q, k, v); q heads split, kv heads split,
                                  or replicated when num_kv_heads < tp_size
    RowParallelLinear      W [out, in] split on the in dim; partial sums all-reduced

Every layer exposes what a LoRA wrapper needs: ``input_size`` and
``output_sizes`` (full, per slice), ``output_partition_sizes`` (this rank's
widths per slice), ``shard_of(k)``, ``tp_rank`` / ``tp_size`` and
``base_forward(x)`` (the local GEMM). RowParallelLinear runs
``forward(x) = reduce(base_forward(x))`` so a wrapper can add its partial
LoRA output before the all-reduce.

``weight_loader(param, loaded_weight, shard_id=None)`` takes a FULL checkpoint
tensor (one slice's, or the whole packed weight when shard_id is None).
``quantize_fp8()`` turns a loaded layer's weight into FP8 with per-row scales
(``weight_scale``; replicas/quantization.py), after which base_forward runs the
FP8 GEMM.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import nn

from lora_core.punica.pending import PendingExpand
from replicas.layers.gemm import linear
from replicas.loader import CheckpointError, copy_checked
from replicas.parallel import ParallelContext
from replicas.quantization import FP8, fp8_linear, quantize_rows, row_scales


class LinearBase(nn.Module):
    splits_rows = False  # whether the ranks hold parts of each weight row (RowParallelLinear)

    def __init__(self, input_size: int, output_sizes: Sequence[int], ctx: ParallelContext | None,
                 params_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.ctx = ctx or ParallelContext()
        self.tp_rank, self.tp_size = self.ctx.tp_rank, self.ctx.tp_size
        self.input_size = input_size
        self.output_sizes = tuple(output_sizes)
        self.params_dtype = params_dtype or torch.get_default_dtype()
        self.register_buffer("weight_scale", None)  # float32 per output row: FP8 weights (replicas/quantization.py)
        self.register_buffer("input_scale", None)  # float32 [1]: inputs quantized with it (static), not per token

    def _param(self, *shape: int) -> nn.Parameter:
        # no device argument: building under `with torch.device(...)` allocates in place
        param = nn.Parameter(torch.empty(*shape, dtype=self.params_dtype), requires_grad=False)
        param.weight_loader = self.weight_loader
        return param

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, self.bias)

    def _gemm(self, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_scale is not None:
            return fp8_linear(x, self.weight, self.weight_scale, bias, self.input_scale)
        return linear(x, self.weight, bias)

    @property
    def quantized(self) -> bool:
        return self.weight_scale is not None

    def quantize_fp8(self) -> None:
        """The loaded weight in float8 e4m3, each row scaled by its max |w| / 448 over the whole row (the ranks
        of a row-parallel layer agree on it); the model's-dtype weight is dropped."""
        scales = row_scales(self.weight.data)
        if self.splits_rows:
            self.ctx.all_reduce_max(scales)
        quantized, _ = quantize_rows(self.weight.data, scales)
        self.weight = nn.Parameter(quantized, requires_grad=False)
        self.weight_scale = scales

    def expect_fp8(self, static_input: bool) -> None:
        """Before loading an FP8 checkpoint (replicas/fp8_checkpoint.py): the weight as FP8, a weight_scale per
        row, and with static_input an input_scale, each loading its shard from the checkpoint's tensors."""
        self.weight = nn.Parameter(torch.empty(self.weight.shape, dtype=FP8, device=self.weight.device),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        self.weight_scale = nn.Parameter(torch.empty(self.weight.shape[0], device=self.weight.device),
                                         requires_grad=False)
        self.weight_scale.weight_loader = self.scale_loader
        if static_input:
            self.input_scale = nn.Parameter(torch.zeros(1, device=self.weight.device), requires_grad=False)
            self.input_scale.weight_loader = _largest_loader

    def scale_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """weight_scale's rows from a checkpoint's scale: per channel ([out, 1] or [out]) or per tensor (one
        value, repeated over the tensor's rows); this rank's rows, as weight_loader cuts the weight's."""
        scale = loaded.float().reshape(-1)
        if scale.numel() == 1:  # per tensor: the one value for each of the tensor's rows
            scale = scale.expand(sum(self.output_sizes) if shard_id is None else
                                 self.output_sizes[self._slice_id(shard_id)])
        if self.splits_rows:  # every rank holds every row
            copy_checked(param.data, scale, "RowParallelLinear weight_scale")
        else:  # one value per row: cut as the weight's rows are, packed or not ([rows, 1] views)
            self.weight_loader(param.data.unsqueeze(1), scale.unsqueeze(1), shard_id)

    @property
    def forward_bias(self) -> torch.Tensor | None:
        """The bias base_forward adds (x @ weight^T + forward_bias), if any."""
        return self.bias

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        raise NotImplementedError

    def extra_repr(self) -> str:
        return f"in={self.input_size}, out={self.output_sizes}, tp={self.tp_rank}/{self.tp_size}"


class ColumnParallelLinear(LinearBase):
    """y = x @ W^T + b with W's output rows split over ranks, slice by slice.

    forward: [T, in] -> [T, sum(output_partition_sizes)] (this rank's columns),
    or [T, sum(output_sizes)] with gather_output.
    """

    def __init__(self, input_size: int, output_sizes: int | Sequence[int], bias: bool = False,
                 ctx: ParallelContext | None = None, params_dtype: torch.dtype | None = None,
                 gather_output: bool = False) -> None:
        sizes = (output_sizes,) if isinstance(output_sizes, int) else tuple(output_sizes)
        super().__init__(input_size, sizes, ctx, params_dtype)
        self.output_partition_sizes = self._partition_sizes()
        self.gather_output = gather_output
        self.weight = self._param(sum(self.output_partition_sizes), input_size)
        self.bias = self._param(sum(self.output_partition_sizes)) if bias else None

    def _partition_sizes(self) -> tuple[int, ...]:
        return tuple(self.ctx.divide(size, f"output slice {k}") for k, size in enumerate(self.output_sizes))

    def shard_of(self, slice_id: int) -> tuple[int, int]:
        """(index, count): this rank holds part ``index`` of ``count`` equal parts of slice ``slice_id``."""
        return self.tp_rank, self.tp_size

    def _slice_id(self, shard_id: object) -> int:
        if isinstance(shard_id, int) and 0 <= shard_id < len(self.output_sizes):
            return shard_id
        raise CheckpointError(f"{type(self).__name__}: unknown shard id {shard_id!r}")

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is None:
            if len(self.output_sizes) == 1:
                shard_id = 0
            else:  # an already-packed checkpoint tensor: load it slice by slice
                if loaded_weight.shape[0] != sum(self.output_sizes):
                    raise CheckpointError(f"packed weight has {loaded_weight.shape[0]} rows, "
                                          f"expected {sum(self.output_sizes)}")
                for k, part in enumerate(loaded_weight.split(self.output_sizes, dim=0)):
                    self.weight_loader(param, part, k)
                return
        k = self._slice_id(shard_id)
        if loaded_weight.shape[0] != self.output_sizes[k]:
            raise CheckpointError(f"{type(self).__name__} slice {shard_id!r}: checkpoint has "
                                  f"{loaded_weight.shape[0]} rows, expected {self.output_sizes[k]}")
        width = self.output_partition_sizes[k]
        index, _ = self.shard_of(k)
        offset = sum(self.output_partition_sizes[:k])
        copy_checked(param.data.narrow(0, offset, width), loaded_weight.narrow(0, index * width, width),
                     f"{type(self).__name__} slice {shard_id!r}")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.base_forward(x)
        return self.ctx.all_gather(y) if self.gather_output else y


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several same-input projections packed on the output dim (gate_up_proj); shard_id = slice index."""


class QKVParallelLinear(ColumnParallelLinear):
    """Packed q, k, v projections (GQA-aware); shard_id is "q", "k" or "v".

    Each rank holds num_heads/tp query heads. Key/value heads are split when
    num_kv_heads >= tp_size; otherwise each is replicated on tp/num_kv_heads
    consecutive ranks, which then hold one kv head each.
    """

    SLICES = {"q": 0, "k": 1, "v": 2}

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 ctx: ParallelContext | None = None, params_dtype: torch.dtype | None = None) -> None:
        ctx = ctx or ParallelContext()
        self.head_dim, self.total_num_heads, self.total_num_kv_heads = head_dim, num_heads, num_kv_heads
        self.num_heads = ctx.divide(num_heads, "num_attention_heads")
        if num_kv_heads >= ctx.tp_size:
            self.num_kv_heads, self.num_kv_head_replicas = ctx.divide(num_kv_heads, "num_key_value_heads"), 1
        else:
            if ctx.tp_size % num_kv_heads:
                raise ValueError(f"tensor_parallel_size {ctx.tp_size} is not a multiple of "
                                 f"num_key_value_heads {num_kv_heads}")
            self.num_kv_heads, self.num_kv_head_replicas = 1, ctx.tp_size // num_kv_heads
        kv = num_kv_heads * head_dim
        super().__init__(hidden_size, (num_heads * head_dim, kv, kv), bias, ctx, params_dtype)

    def _partition_sizes(self) -> tuple[int, ...]:
        kv = self.num_kv_heads * self.head_dim
        return self.num_heads * self.head_dim, kv, kv

    def shard_of(self, slice_id: int) -> tuple[int, int]:
        if slice_id == 0:
            return self.tp_rank, self.tp_size
        return self.tp_rank // self.num_kv_head_replicas, self.tp_size // self.num_kv_head_replicas

    def _slice_id(self, shard_id: object) -> int:
        if shard_id in self.SLICES:
            return self.SLICES[shard_id]
        return super()._slice_id(shard_id)


class RowParallelLinear(LinearBase):
    """y = x @ W^T + b with W's input columns split: x arrives split on its last dim.

    base_forward: [T, in/tp] -> partial [T, out] (no bias); reduce: all-reduce,
    then add the bias once; forward = reduce(base_forward(x)).
    """

    splits_rows = True

    def __init__(self, input_size: int, output_size: int, bias: bool = False, ctx: ParallelContext | None = None,
                 params_dtype: torch.dtype | None = None, reduce_results: bool = True) -> None:
        super().__init__(input_size, (output_size,), ctx, params_dtype)
        self.input_size_per_partition = self.ctx.divide(input_size, "row-parallel input dim")
        self.output_partition_sizes = (output_size,)
        self.reduce_results = reduce_results
        self.weight = self._param(output_size, self.input_size_per_partition)
        self.bias = self._param(output_size) if bias else None

    def base_forward(self, x: torch.Tensor) -> torch.Tensor:
        return self._gemm(x, None)

    @property
    def forward_bias(self) -> None:
        return None  # reduce() adds it, once

    def reduce(self, y: torch.Tensor, whole: torch.Tensor | None = None) -> torch.Tensor:
        """All-reduce the partial sums y (then add the bias once). whole: a contiguous tensor whose leading
        columns y is (a stacked GEMM's output, lora_core/stacked_a.py), reduced in its place: collectives
        need contiguous tensors, and the columns beside y cost a few bytes, not a copy kernel."""
        if self.reduce_results:
            self.ctx.all_reduce(y if whole is None else whole)
        if self.bias is None or (not self.reduce_results and self.tp_rank != 0):
            return y  # unreduced partials: only rank 0's carries the bias
        return y + self.bias

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.base_forward(x))

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        if shard_id is not None:
            raise CheckpointError(f"RowParallelLinear takes no shard id (got {shard_id!r})")
        if param.dim() == 2:  # the bias stays whole on every rank; reduce() adds it once
            width = self.input_size_per_partition
            if loaded_weight.dim() != 2 or loaded_weight.shape[1] != self.input_size:
                raise CheckpointError(f"RowParallelLinear: checkpoint shape {tuple(loaded_weight.shape)} does not "
                                      f"fit [{self.output_sizes[0]}, {self.input_size}]")
            loaded_weight = loaded_weight.narrow(1, self.tp_rank * width, width)
        copy_checked(param.data, loaded_weight, "RowParallelLinear")


def _largest_loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
    # a static input scale: one for the layer, the largest of the tensors packed into it (q, k and v read the
    # same input, so one scale must cover all three)
    if loaded.numel() != 1:
        raise CheckpointError(f"input_scale must be one value per tensor, got shape {tuple(loaded.shape)}")
    param.data.copy_(torch.maximum(param.data, loaded.float().reshape(1).to(param.device)))


def forward_pending(layer: nn.Module, x: torch.Tensor) -> tuple[torch.Tensor, PendingExpand | None]:
    """(layer(x), None), or for a LoRA layer in a step that allows it (y, the expand it left for the op that
    reads y next to add: SiluAndMul and RotaryEmbedding take it as `lora=`; lora_core/punica/pending.py)."""
    pending = getattr(layer, "forward_pending", None)
    return pending(x) if pending is not None else (layer(x), None)
