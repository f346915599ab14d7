"""LoRA on the model's tensor-parallel layers, through lora_core's PunicaWrapper.

``add_lora(model, ...)`` replaces every LoRA-able layer (packed qkv_proj and
gate_up_proj, o_proj, down_proj, embed_tokens, lm_head) with a wrapper that
runs the base layer and adds the whole mixed batch's LoRA in a few launches.
The wrappers read the slot buffers of a LoRAModelManager and the per-step
metadata of one PunicaWrapper shared by all layers.

Tensor parallelism (design.md). Without fully_sharded_loras, column layers
replicate A and split B like the base output; row layers split A like the
input and replicate B, each rank adding its partial LoRA before the base
all-reduce: no extra collective. With it, nothing is replicated: column
layers all-gather the [S, T, r/tp] shrink buffer, row layers all-reduce the
[T, r] one and expand into their slice of the output.

Stacked A (lora_core/stacked_a.py; not with fully_sharded_loras under TP; over
FP8 weights as FP8 copies of the manager's A slots, replicas/fp8_lora.py): a
linear layer's A slots sit as extra rows under its base weight, so steps of
up to PunicaWrapper.stacked_max_tokens rows run one GEMM for the base output
and every slot's shrink, then the expand; larger steps run shrink, expand and
base GEMM (PunicaWrapper.lora_linear: the expand writes the delta, the GEMM adds
into it), the shrink reading A from those same rows. Stacked steps of few adapters and rows
(PunicaWrapper's fused_max_adapters) run each layer without biases in one launch instead
(lora_core/punica/lora_gemm.py), reading the same A rows and B slots. In stacked steps the model may ask a
layer for `forward_pending`: (y, the expand still owed to y), which the op after it (SiluAndMul after
gate_up_proj, the rotary embedding after qkv_proj, the add + RMSNorm after o_proj and down_proj) then adds as
it reads y (lora_core/punica/pending.py; PunicaWrapper.pending_expand decides per step).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from lora_core.config import LoRAConfig
from lora_core.errors import LoRAConfigError
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.punica import PunicaWrapper
from lora_core.punica.pending import PendingExpand
from lora_core.stacked_a import a_rows, stack_bias, stack_weight
from replicas.fp8_lora import stack_scales
from replicas.layers.embedding import ParallelLMHead, VocabParallelEmbedding
from replicas.layers.gemm import linear
from replicas.layers.linear import ColumnParallelLinear, RowParallelLinear
from replicas.quantization import fp8_linear


@dataclass
class StackedWeight:
    """A linear layer's base weight with its A slots stacked under it (lora_core/stacked_a.py)."""
    weight: torch.Tensor  # [out + slots * per_slot, in]; the layer's weight is a view of the first out rows
    bias: torch.Tensor | None  # the base bias zero-padded to those rows (column layers), else None
    out: int
    per_slot: int  # A rows of one slot: slices x max_lora_rank
    a_rows: torch.Tensor  # [slots, S, R, in] view of the A rows, as LoRAModelManager takes them
    # FP8 weights (replicas/fp8_lora.py): every row's float32 scale, the layer's weight_scale a view of the first
    # out; the A rows are FP8 copies of the manager's slots, which then keeps its own A
    scale: torch.Tensor | None = None

    def gemm(self, x: torch.Tensor, rows: int, input_scale: torch.Tensor | None) -> torch.Tensor:
        """x @ the first `rows` rows^T (+ their bias): the base output and the shrink of the slots they hold."""
        bias = None if self.bias is None else self.bias[:rows]
        if self.scale is None:
            return linear(x, self.weight[:rows], bias)
        return fp8_linear(x, self.weight[:rows], self.scale[:rows], bias, input_scale)


def stacked_max_tokens(requested: int | None, lora_config: LoRAConfig, device: torch.device, tp_size: int,
                       dtype: torch.dtype | None = None, quantized: bool = False) -> int:
    """EngineArgs.lora_stacked_max_tokens resolved: None is 256 on CUDA and 0 (off) elsewhere. Off with
    fully_sharded_loras under TP, whose ranks hold part of each A row, and with a lora_dtype other than the
    model's dtype (one GEMM reads both); asking for it there raises. Over FP8 base weights None is 0: the
    stacked shrink's products are then FP8's (replicas/fp8_lora.py), so it runs only when asked for, and in
    bfloat16 on CUDA with slots of a rank that is a multiple of 16 (cuBLASLt's FP8 GEMM takes weights in such
    rows; float32 runs the reference GEMM)."""
    sharded = lora_config.fully_sharded_loras and tp_size > 1
    mixed = dtype is not None and lora_config.slot_dtype(dtype) != dtype
    if sharded or mixed:
        if requested:
            raise LoRAConfigError("lora_stacked_max_tokens needs whole A rows on every rank in the model's dtype: "
                                  "not with fully_sharded_loras and tensor_parallel_size > 1, nor another "
                                  "lora_dtype")
        return 0
    if quantized:
        cublas = device.type == "cuda" and dtype in (None, torch.bfloat16)
        if requested and cublas and lora_config.max_lora_rank % 16:
            raise LoRAConfigError(f"lora_stacked_max_tokens over FP8 weights on CUDA needs a max_lora_rank that is "
                                  f"a multiple of 16 (the FP8 GEMM's rows), got {lora_config.max_lora_rank}")
        return requested or 0
    if requested is None:
        return 256 if device.type == "cuda" else 0
    return requested


# The default adapter bound of one-launch sites, by device name. 8B engine, Zipf traffic over 100 adapters
# (~10 per step), decode extra over no LoRA: on an H100 a bound of 16 took it from 1.42 to 0.95 ms per step
# (the base GEMMs there run long enough to hide phase A); on an H200 it ran 0.10 ms slower than the stacked
# path (bench/engine.py). Elsewhere (unmeasured) the H200's setting, 4: one
# adapter's decode extra 0.72 -> 0.44 ms per step there.
FUSED_MAX_ADAPTERS = (("H100", 16),)
FUSED_MAX_ADAPTERS_ELSE = 4


def fused_max_adapters(requested: int | None, stacked_tokens: int, max_lora_rank: int, device_name: str = "",
                       quantized: bool = False) -> int:
    """EngineArgs.lora_fused_max_adapters resolved: None is FUSED_MAX_ADAPTERS' value for the device (by name)
    where stacked steps run with rank-16 slots (the one launch's measured settings, lora_gemm.tiling), else 0;
    asking for it without stacked weights (it reads their A rows), with other slot ranks or over FP8 weights
    (its GEMM is bfloat16's) raises."""
    if not stacked_tokens or max_lora_rank != 16 or quantized:
        if requested:
            raise LoRAConfigError("lora_fused_max_adapters reads the stacked A rows of rank-16 slots in the model's "
                                  f"dtype: it needs lora_stacked_max_tokens, max_lora_rank 16 (got {max_lora_rank}) "
                                  "and no quantization")
        return 0
    if requested is not None:
        return requested
    return next((bound for key, bound in FUSED_MAX_ADAPTERS if key in device_name), FUSED_MAX_ADAPTERS_ELSE)


# gate_up_proj's expand inside SiluAndMul and qkv_proj's inside the rotary kernel (lora_core/punica/pending.py),
# by default for stacked steps of up to 32 rows over 5+ adapters (adapter bound 16+) with slots of rank <= 64
# (SiluAndMul fuses only rank <= 16: fused.LORA_SILU_MAX_RANK). H200, 8B gate_up, expand + silu vs the fused
# silu: 32 rows over 10 / 16 adapters 14.9 / 18.9 -> 10.4 / 10.6 us over the base GEMM and silu, 1-4 adapters
# 2-4 us slower (per-row B reads: no tile shares them), rank 64 slower; engine, Zipf over 100 adapters: decode
# step 7.02 -> 6.92 ms. qkv's rotary saves 2.1-2.6 us per site at 1-32 adapters (H100, 32
# rows), 1.1-2.9 at rank 64 from 10 adapters on (H200); engine with both, Zipf 6.86 -> 6.75 ms, uniform 6.87 ->
# 6.80. o_proj's and down_proj's inside the add + RMSNorm after them (rank <= 16:
# lora_norm.LORA_NORM_MAX_RANK): 0.7-1.1 us per site at 24-32 rows over 10-32 adapters (H200).
# Measured with bench/pending_expand.py and bench/engine.py.
PENDING_MAX_TOKENS = 32
PENDING_MAX_RANK = 64


def pending_max_tokens(requested: int | None, stacked_tokens: int, max_lora_rank: int) -> int:
    """EngineArgs.lora_pending_max_tokens resolved: None is PENDING_MAX_TOKENS where stacked steps run (on CUDA)
    with slots of rank <= PENDING_MAX_RANK, else 0; asked for without stacked steps it raises (only their
    expands can wait: the shrink columns sit beside the base output)."""
    if not stacked_tokens:
        if requested:
            raise LoRAConfigError("lora_pending_max_tokens defers the expands of stacked steps: it needs "
                                  "lora_stacked_max_tokens")
        return 0
    if requested is not None:
        return requested
    return PENDING_MAX_TOKENS if max_lora_rank <= PENDING_MAX_RANK else 0


def stack_lora_weights(model: nn.Module, specs: list[LoRAModuleSpec], lora_config: LoRAConfig
                       ) -> dict[str, StackedWeight]:
    """Move every linear LoRA layer's base weight (and column bias) into a stacked weight with room for
    max_loras A slots; the layer keeps views of its rows, so nothing else changes. One layer at a time,
    so the model's memory grows by the A rows only."""
    out: dict[str, StackedWeight] = {}
    slots, rank = lora_config.max_loras, lora_config.max_lora_rank
    for spec in specs:
        if spec.kind is not LoRAKind.LINEAR:
            continue
        base = model.get_submodule(spec.name)
        slices = len(spec.out_slices)
        stacked = stack_weight(base.weight.data, slots, slices, rank)
        rows = base.weight.shape[0]
        base.weight = nn.Parameter(stacked[:rows], requires_grad=False)
        bias = None
        if isinstance(base, ColumnParallelLinear) and base.bias is not None:
            bias = stack_bias(base.bias.data, stacked)
            base.bias = nn.Parameter(bias[:rows], requires_grad=False)
        scale = stack_scales(base, stacked.shape[0]) if base.quantized else None
        out[spec.name] = StackedWeight(stacked, bias, rows, slices * rank, a_rows(stacked, rows, slots, slices, rank),
                                       scale)
    return out


class _LoRAWrapper(nn.Module):
    """Holds the base layer; attributes it lacks come from the base layer."""

    def __init__(self, base: nn.Module, spec: LoRAModuleSpec, manager: LoRAModelManager,
                 punica: PunicaWrapper, fully_sharded: bool, stacked: StackedWeight | None = None) -> None:
        super().__init__()
        self.base = base
        self.spec = spec
        self.manager = manager
        self.punica = punica
        self.sharded = fully_sharded and base.tp_size > 1
        self.stacked = stacked

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["base"], name)

    @property
    def slots(self):
        return self.manager.buffers(self.spec.name)

    def scales_with_input(self) -> bool:
        """replicas.layers.row_scale.scales_with_input: no base bias and no LoRA bias."""
        return self.base.bias is None and self.slots.bias is None

    def _shrink_gathered(self, x: torch.Tensor, meta) -> torch.Tensor:
        """Fully-sharded column layers: [S, T, r/tp] on each rank -> [S, T, r] everywhere."""
        b = self.slots
        buf = torch.zeros(b.lora_a.shape[0], x.shape[0], b.lora_a.shape[2], dtype=torch.float32, device=x.device)
        self.punica.add_shrink(buf, x, b.lora_a, 1.0, b.ranks, meta=meta)
        return self.base.ctx.all_gather(buf, dim=-1)

    def _linear_with_lora(self, x: torch.Tensor, defer: bool = False
                          ) -> tuple[torch.Tensor, torch.Tensor, PendingExpand | None]:
        """base_forward(x) plus this layer's LoRA, added in place (not fully sharded): (y, the contiguous
        tensor y is the leading columns of: y itself, or a stacked GEMM's whole output, the expand left to
        the op after this layer when `defer` and the step allows it (PunicaWrapper.pending_expand), else None)."""
        b = self.slots
        bound = self.punica.stacked_rows() if self.stacked is not None else None
        if bound is not None:
            st = self.stacked
            if st.bias is None and b.bias is None and st.scale is None:  # few adapters: the site in one launch
                y = self.punica.add_lora_gemm(x, st.weight[:st.out], st.a_rows, b.lora_b, b.output_slices)
                if y is not None:
                    return y, y, None
            # One GEMM for the base output and every slot's shrink below the step's slot bound.
            out = st.gemm(x, st.out + bound * st.per_slot, self.base.input_scale)
            y = out[:, :st.out]
            pending = self.punica.pending_expand(y, out[:, st.out:], b.lora_b, b.output_slices, b.ranks, b.bias) \
                if defer else None
            if pending is None:
                self.punica.add_expand_stacked(y, out[:, st.out:], b.lora_b, b.output_slices, b.ranks, b.bias)
            return y, out, pending
        if self.base.forward_bias is None and not self.base.quantized:
            # the base GEMM adds into the expand's delta (PunicaWrapper.lora_linear); an FP8 GEMM has no C operand
            y = self.punica.lora_linear(x, self.base.weight, b.lora_a, b.lora_b, b.bias, b.output_slices, b.ranks)
            return y, y, None
        y = self.base.base_forward(x)
        self.punica.add_lora_linear(y, x, b.lora_a, b.lora_b, b.bias, 1.0, b.output_slices, b.ranks)
        return y, y, None


class ColumnParallelLinearWithLoRA(_LoRAWrapper):
    def forward_pending(self, x: torch.Tensor) -> tuple[torch.Tensor, PendingExpand | None]:
        """(y, the expand left to the op that reads y next, or None): see replicas.layers.forward_pending."""
        if not self.punica.token_meta.num_adapters or self.sharded:
            return self(x), None
        y, _, pending = self._linear_with_lora(x, defer=True)
        return y, pending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.punica.token_meta.num_adapters:
            return self.base.base_forward(x)
        if not self.sharded:
            return self._linear_with_lora(x)[0]
        y = self.base.base_forward(x)
        b = self.slots
        self.punica.add_expand(y, self._shrink_gathered(x, None), b.lora_b, b.output_slices,
                               ranks=b.ranks, lora_bias_stacked=b.bias)
        return y


class RowParallelLinearWithLoRA(_LoRAWrapper):
    def forward_pending(self, x: torch.Tensor) -> tuple[torch.Tensor, PendingExpand | None]:
        """(y, the expand left to the add + RMSNorm after this layer, or None): see replicas.layers.forward_pending.
        The all-reduce sums the shrink columns with y (they are the whole output's), so the expand left over
        runs once on the full shrink, after it, as the unreduced expands would have summed to. Not with a base
        bias (reduce() would return a new tensor, not the y the expand is owed to)."""
        base = self.base
        if not self.punica.token_meta.num_adapters or self.sharded or base.bias is not None \
                or (base.tp_size > 1 and not base.reduce_results):
            return self(x), None
        y, whole, pending = self._linear_with_lora(x, defer=True)
        return base.reduce(y, whole), pending

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # y is this rank's partial sum, before the all-reduce: its LoRA joins it there.
        if not self.punica.token_meta.num_adapters:
            return self.base.reduce(self.base.base_forward(x))
        if not self.sharded:
            return self.base.reduce(*self._linear_with_lora(x)[:2])
        y = self.base.base_forward(x)
        b = self.slots
        buf = torch.zeros(1, x.shape[0], b.lora_a.shape[2], dtype=torch.float32, device=x.device)
        self.punica.add_shrink(buf, x, b.lora_a, 1.0, b.ranks)
        self.base.ctx.all_reduce(buf)
        width = b.output_slices[0]
        self.punica.add_expand(y, buf, b.lora_b, (width,), offset_start=self.base.tp_rank * width,
                               ranks=b.ranks, lora_bias_stacked=b.bias)
        return self.base.reduce(y)


class VocabParallelEmbeddingWithLoRA(_LoRAWrapper):
    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        y = self.base.base_forward(ids)
        if self.punica.token_meta.num_adapters:
            b = self.slots
            # Ids outside this rank's rows add nothing here; their owner adds them.
            self.punica.add_lora_embedding(y, ids - self.base.vocab_start_index, b.lora_a, b.lora_b, b.ranks)
        return self.base.reduce(y)


class ParallelLMHeadWithLoRA(_LoRAWrapper):
    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        logits = self.base.base_forward(hidden)
        meta = self.punica.sampler_meta
        if meta.num_adapters:
            b = self.slots
            local = logits[:, : b.output_slices[0]]
            if self.sharded:
                self.punica.add_expand(local, self._shrink_gathered(hidden, meta), b.lora_b, b.output_slices,
                                       ranks=b.ranks, meta=meta)
            else:
                self.punica.add_lora_logits(local, hidden, b.lora_a, b.lora_b, 1.0, b.ranks)
        return self.base.gather(logits)


def lora_module_specs(model: nn.Module) -> list[LoRAModuleSpec]:
    """Describe every LoRA-able layer of ``model`` (full, unsharded dims) for LoRAModelManager."""
    packed = getattr(model, "packed_modules_mapping", {})
    specs = []
    for name, module in model.named_modules():
        leaf = name.rsplit(".", 1)[-1]
        if isinstance(module, ColumnParallelLinear):
            subs = tuple(packed.get(leaf, [leaf]))
            specs.append(LoRAModuleSpec(name, LoRAKind.LINEAR, module.input_size, module.output_sizes, subs,
                                        ShardKind.COLUMN))
        elif isinstance(module, RowParallelLinear):
            specs.append(LoRAModuleSpec(name, LoRAKind.LINEAR, module.input_size, module.output_sizes, (leaf,),
                                        ShardKind.ROW))
        elif isinstance(module, VocabParallelEmbedding):
            specs.append(LoRAModuleSpec(name, LoRAKind.EMBEDDING, module.num_embeddings,
                                        (module.embedding_dim,), (leaf,), ShardKind.VOCAB))
        elif isinstance(module, ParallelLMHead):
            specs.append(LoRAModuleSpec(name, LoRAKind.LOGITS, module.embedding_dim, (module.num_embeddings,),
                                        (leaf,), ShardKind.COLUMN))
    return specs


_WRAPPERS = {LoRAKind.EMBEDDING: VocabParallelEmbeddingWithLoRA, LoRAKind.LOGITS: ParallelLMHeadWithLoRA}


def add_lora(model: nn.Module, manager: LoRAModelManager, punica: PunicaWrapper,
             lora_config: LoRAConfig, stacked: dict[str, StackedWeight] | None = None) -> list[LoRAModuleSpec]:
    """Wrap every layer the manager has slots for; call after the base weights are loaded. stacked: the
    stack_lora_weights of this model, whose A rows the manager holds as those layers' slots."""
    config = getattr(model, "config", None)
    tp_size = getattr(getattr(model, "ctx", None), "tp_size", 1)
    if config is not None and tp_size > config.num_key_value_heads:
        raise LoRAConfigError(f"LoRA with tensor_parallel_size {tp_size} > {config.num_key_value_heads} kv heads "
                              "(replicated k/v projections) is not supported yet")
    for spec in manager.specs.values():
        parent_name, _, leaf = spec.name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        base = getattr(parent, leaf)
        cls = _WRAPPERS.get(spec.kind) or (RowParallelLinearWithLoRA if spec.shard is ShardKind.ROW
                                           else ColumnParallelLinearWithLoRA)
        setattr(parent, leaf, cls(base, spec, manager, punica, lora_config.fully_sharded_loras,
                                  (stacked or {}).get(spec.name)))
    return list(manager.specs.values())
