"""tp.py: sharded LoRA plus simulated collectives equals the unsharded x @ A @ B."""

from __future__ import annotations

import zlib

import pytest
import torch

from lora_core.errors import LoRAConfigError
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.tp import local_dims, shard_lora_a, shard_lora_b, shard_lora_bias

HIDDEN, VOCAB, T, MAX_RANK = 32, 64, 5, 16

SPECS = {
    # GQA: q 32 wide, k/v 8 wide, so the slices split unequally
    "qkv": LoRAModuleSpec("l.qkv_proj", LoRAKind.LINEAR, HIDDEN, (32, 8, 8), ("q_proj", "k_proj", "v_proj"),
                          ShardKind.COLUMN),
    "gate_up": LoRAModuleSpec("l.gate_up_proj", LoRAKind.LINEAR, HIDDEN, (48, 48), ("gate_proj", "up_proj"),
                              ShardKind.COLUMN),
    "o": LoRAModuleSpec("l.o_proj", LoRAKind.LINEAR, 32, (HIDDEN,), ("o_proj",), ShardKind.ROW),
    "down": LoRAModuleSpec("l.down_proj", LoRAKind.LINEAR, 48, (HIDDEN,), ("down_proj",), ShardKind.ROW),
    "lm_head": LoRAModuleSpec("lm_head", LoRAKind.LOGITS, HIDDEN, (VOCAB,), ("lm_head",), ShardKind.COLUMN),
    "embed": LoRAModuleSpec("embed_tokens", LoRAKind.EMBEDDING, VOCAB, (HIDDEN,), ("embed_tokens",),
                            ShardKind.VOCAB),
    "replicated": LoRAModuleSpec("r", LoRAKind.LINEAR, HIDDEN, (16,), ("r",), ShardKind.REPLICATED),
}


def _weights(spec: LoRAModuleSpec, ranks: list[int], gen: torch.Generator):
    """One (A [in, r], B [r, out], bias [out]) per slice, float64 for exact-ish sums."""
    out = []
    for width, rank in zip(spec.out_slices, ranks):
        a = torch.randn(spec.in_features, rank, generator=gen, dtype=torch.float64)
        b = torch.randn(rank, width, generator=gen, dtype=torch.float64)
        bias = None if spec.kind is LoRAKind.EMBEDDING else torch.randn(width, generator=gen, dtype=torch.float64)
        out.append((a, b, bias))
    return out


def _reference(spec, weights, x):
    parts = []
    for a, b, bias in weights:
        shrink = a[x] if spec.kind is LoRAKind.EMBEDDING else x @ a
        parts.append(shrink @ b + (bias if bias is not None else 0))
    return torch.cat(parts, dim=1)


def _sharded(spec, weights, x, tp_size, fs):
    """Run every TP rank on its shard and combine them the way the layer's collectives do."""
    shard = spec.shard
    per_rank = []  # each rank's list of per-slice outputs
    for k in range(tp_size):
        dims = local_dims(spec, k, tp_size, MAX_RANK, fs)
        slices = []
        for (a, b, bias), w_local in zip(weights, dims.out_slices):
            a_k = shard_lora_a(a, shard, k, tp_size, fully_sharded=fs, max_rank=MAX_RANK)
            b_k = shard_lora_b(b, shard, k, tp_size, fully_sharded=fs)
            bias_k = shard_lora_bias(bias, shard, k, tp_size, fully_sharded=fs)
            assert b_k.shape[1] == w_local
            slices.append((a_k, b_k, bias_k))
        per_rank.append(slices)

    n_slices = len(weights)
    if shard is ShardKind.COLUMN:
        outs = []
        for s in range(n_slices):
            if fs:
                gathered = torch.cat([x @ per_rank[k][s][0] for k in range(tp_size)], dim=1)  # all-gather
                assert gathered.shape[1] == MAX_RANK
                rank = per_rank[0][s][1].shape[0]
                local = [gathered[:, :rank] @ per_rank[k][s][1] + per_rank[k][s][2] for k in range(tp_size)]
                assert torch.count_nonzero(gathered[:, rank:]) == 0  # rank padding stays zero
            else:
                local = [x @ per_rank[k][s][0] @ per_rank[k][s][1] + per_rank[k][s][2] for k in range(tp_size)]
            outs.append(torch.cat(local, dim=1))  # column outputs concatenated per slice
        return torch.cat(outs, dim=1)
    if shard is ShardKind.ROW:
        (a, b, bias), = weights
        x_k = list(x.chunk(tp_size, dim=1))  # row-parallel input is already split
        if fs:
            shrink = sum(x_k[k] @ per_rank[k][0][0] for k in range(tp_size))  # all-reduce of [T, r]
            partials = []
            for k in range(tp_size):
                y = torch.zeros(x.shape[0], b.shape[1], dtype=x.dtype)
                w = per_rank[k][0][1].shape[1]
                y[:, k * w:(k + 1) * w] = shrink @ per_rank[k][0][1] + per_rank[k][0][2]
                partials.append(y)
        else:
            partials = [x_k[k] @ per_rank[k][0][0] @ per_rank[k][0][1] + per_rank[k][0][2] for k in range(tp_size)]
        return sum(partials)  # the base layer's all-reduce
    if shard is ShardKind.VOCAB:
        partials = []
        for k in range(tp_size):
            a_k, b_k, _ = per_rank[k][0]
            start = k * a_k.shape[0]
            owned = (x >= start) & (x < start + a_k.shape[0])
            rows = torch.where(owned[:, None], a_k[(x - start).clamp(0, a_k.shape[0] - 1)], 0.0)
            partials.append(rows @ b_k)
        return sum(partials)  # the embedding's all-reduce
    outs = [_reference(spec, [(a, b, bias) for a, b, bias in per_rank[k]], x) for k in range(tp_size)]
    for y in outs[1:]:
        torch.testing.assert_close(y, outs[0])
    return outs[0]


@pytest.mark.parametrize("tp_size", [1, 2, 4])
@pytest.mark.parametrize("fs", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("name", list(SPECS))
@pytest.mark.parametrize("ranks", ["max", "mixed"])
def test_sharded_equals_unsharded(name, fs, tp_size, ranks):
    spec = SPECS[name]
    gen = torch.Generator().manual_seed(zlib.crc32(f"{name}{fs}{tp_size}{ranks}".encode()))
    slice_ranks = [MAX_RANK if ranks == "max" else r for r, _ in zip([4, 8, 16], spec.out_slices)]
    weights = _weights(spec, slice_ranks, gen)
    if spec.kind is LoRAKind.EMBEDDING:
        x = torch.randint(0, VOCAB, (T,), generator=gen)
    else:
        x = torch.randn(T, spec.in_features, generator=gen, dtype=torch.float64)
    torch.testing.assert_close(_sharded(spec, weights, x, tp_size, fs), _reference(spec, weights, x))


def test_local_dims_shapes():
    qkv = SPECS["qkv"]
    d = local_dims(qkv, 1, 4, 16, fully_sharded=True)
    assert (d.in_features, d.out_slices, d.rank_a, d.rank_b) == (32, (8, 2, 2), 4, 16)
    assert d.lora_a_shape(3) == (3, 3, 4, 32) and d.lora_b_shape(3) == (3, 12, 16)
    d = local_dims(qkv, 1, 4, 16, fully_sharded=False)
    assert d.rank_a == 16
    o = local_dims(SPECS["o"], 0, 2, 16, fully_sharded=False)
    assert (o.in_features, o.out_slices) == (16, (HIDDEN,))
    o = local_dims(SPECS["o"], 0, 2, 16, fully_sharded=True)
    assert (o.in_features, o.out_slices, o.rank_a) == (16, (HIDDEN // 2,), 16)
    e = local_dims(SPECS["embed"], 0, 4, 16, fully_sharded=True)
    assert e.lora_a_shape(2) == (1, 2, VOCAB // 4, 16) and e.lora_b_shape(2) == (2, HIDDEN, 16)


def test_indivisible_dims_raise():
    with pytest.raises(LoRAConfigError, match="not divisible"):
        local_dims(SPECS["qkv"], 0, 16, 16, fully_sharded=False)  # k slice 8 over 16 ranks
    with pytest.raises(LoRAConfigError, match="max_lora_rank"):
        local_dims(SPECS["gate_up"], 0, 4, 6, fully_sharded=True)
    with pytest.raises(LoRAConfigError, match="not divisible"):
        shard_lora_a(torch.zeros(30, 4), ShardKind.ROW, 0, 4)
    with pytest.raises(LoRAConfigError, match="max_lora_rank"):
        shard_lora_a(torch.zeros(32, 4), ShardKind.COLUMN, 0, 4, fully_sharded=True, max_rank=6)
    with pytest.raises(LoRAConfigError, match="tp_rank"):
        local_dims(SPECS["o"], 2, 2, 16, fully_sharded=False)
    with pytest.raises(LoRAConfigError, match="vocab-parallel"):
        local_dims(LoRAModuleSpec("x", LoRAKind.LINEAR, 8, (8,), ("x",), ShardKind.VOCAB), 0, 1, 4, False)


def test_fully_sharded_pads_small_rank_before_split():
    a = torch.randn(8, 4)
    parts = [shard_lora_a(a, ShardKind.COLUMN, k, 4, fully_sharded=True, max_rank=16) for k in range(4)]
    assert all(p.shape == (8, 4) for p in parts)
    torch.testing.assert_close(parts[0], a)
    assert all(torch.count_nonzero(p) == 0 for p in parts[1:])
