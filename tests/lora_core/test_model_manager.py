"""LoRAModelManager: slot contents, LRU tiers, pinning, load-before-evict, TP shards."""

from __future__ import annotations

import pytest
import torch

from lora_core.config import LoRAConfig
from lora_core.errors import (AdapterShapeError, LoRACapacityError, RankTooLargeError, UnknownLoRAError,
                              UnknownTargetModuleError, UnsupportedAdapterError)
from lora_core.layer_weights import LoRALayerWeights
from lora_core.lora_model import LoRAModel
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.tp import local_dims, shard_lora_a, shard_lora_b

HIDDEN, KV, INTER, VOCAB, MAX_RANK = 32, 8, 48, 64, 16
L0 = "model.layers.0"
SPECS = [
    LoRAModuleSpec("model.embed_tokens", LoRAKind.EMBEDDING, VOCAB, (HIDDEN,), ("embed_tokens",), ShardKind.VOCAB),
    LoRAModuleSpec(f"{L0}.self_attn.qkv_proj", LoRAKind.LINEAR, HIDDEN, (HIDDEN, KV, KV),
                   ("q_proj", "k_proj", "v_proj"), ShardKind.COLUMN),
    LoRAModuleSpec(f"{L0}.self_attn.o_proj", LoRAKind.LINEAR, HIDDEN, (HIDDEN,), ("o_proj",), ShardKind.ROW),
    LoRAModuleSpec(f"{L0}.mlp.gate_up_proj", LoRAKind.LINEAR, HIDDEN, (INTER, INTER), ("gate_proj", "up_proj"),
                   ShardKind.COLUMN),
    LoRAModuleSpec(f"{L0}.mlp.down_proj", LoRAKind.LINEAR, INTER, (HIDDEN,), ("down_proj",), ShardKind.ROW),
    LoRAModuleSpec("lm_head", LoRAKind.LOGITS, HIDDEN, (VOCAB,), ("lm_head",), ShardKind.COLUMN),
]
ALL_TARGETS = [(spec, i) for spec in SPECS for i in range(len(spec.sub_modules))]


def make_lora(lora_id: int, rank: int, *, skip: tuple[str, ...] = (), rank_pattern: dict[str, int] | None = None,
              bias: bool = False, seed: int | None = None) -> LoRAModel:
    """A random adapter over every sub-module except those whose name ends with one of ``skip``."""
    gen = torch.Generator().manual_seed(lora_id if seed is None else seed)
    loras = {}
    for spec, i in ALL_TARGETS:
        name = spec.sub_module_names()[i]
        if name.endswith(skip):
            continue
        r = (rank_pattern or {}).get(spec.sub_modules[i], rank)
        is_emb = spec.kind is LoRAKind.EMBEDDING
        loras[name] = LoRALayerWeights(
            module_name=name, rank=r, lora_alpha=2.0 * r + 1, scaling=(2.0 * r + 1) / r,
            lora_a=torch.randn(spec.in_features, r, generator=gen),
            lora_b=torch.randn(r, spec.out_slices[i], generator=gen),
            bias=torch.randn(spec.out_slices[i], generator=gen) if bias and not is_emb else None,
            is_embedding=is_emb)
    return LoRAModel(lora_id, rank, loras)


def manager(max_loras=3, max_cpu_loras=None, tp_rank=0, tp_size=1, fs=False, bias=False) -> LoRAModelManager:
    cfg = LoRAConfig(max_loras=max_loras, max_lora_rank=MAX_RANK, max_cpu_loras=max_cpu_loras,
                     fully_sharded_loras=fs, bias_enabled=bias)
    return LoRAModelManager(SPECS, cfg, "cpu", torch.float32, tp_rank=tp_rank, tp_size=tp_size)


def snapshot(m: LoRAModelManager):
    """Everything an operation that fails must leave as it was: slots, both LRU orders, pins, buffers."""
    return (m.lora_index_to_id, m.active_adapters(), m.list_adapters(), [m.is_pinned(i) for i in m.list_adapters()],
            {s.name: (m.buffers(s.name).ranks.tolist(), m.buffers(s.name).lora_a.sum().item(),
                      m.buffers(s.name).lora_b.sum().item()) for s in SPECS})


def assert_slot_holds(m: LoRAModelManager, slot: int, lora: LoRAModel) -> None:
    """TP=1: the slot is the adapter's A^T / (B*scaling)^T padded with zeros, ranks = real ranks."""
    for spec in SPECS:
        buf = m.buffers(spec.name)
        want_a, want_b = torch.zeros_like(buf.lora_a[:, slot]), torch.zeros_like(buf.lora_b[slot])
        want_ranks = [0] * len(spec.sub_modules)
        offset = 0
        for i, name in enumerate(spec.sub_module_names()):
            layer = lora.get_lora(name)
            width = spec.out_slices[i]
            if layer is not None:
                r = layer.rank
                if spec.kind is LoRAKind.EMBEDDING:
                    want_a[0, :, :r] = layer.lora_a
                else:
                    want_a[i, :r] = layer.lora_a.T
                want_b[offset:offset + width, :r] = (layer.lora_b * layer.scaling).T
                want_ranks[i] = r
            offset += width
        torch.testing.assert_close(buf.lora_a[:, slot], want_a)
        torch.testing.assert_close(buf.lora_b[slot], want_b)
        assert buf.ranks[:, slot].tolist() == want_ranks, spec.name


def test_slot_contents_and_ranks_mixed():
    m = manager()
    loras = [make_lora(1, 4, skip=("k_proj",)), make_lora(2, 8, rank_pattern={"v_proj": 2, "up_proj": 16}),
             make_lora(3, 16, skip=("embed_tokens", "down_proj"))]
    for lora in loras:
        assert m.add_adapter(lora) is True
        assert m.activate_adapter(lora.id) == lora.id - 1
    for lora in loras:
        assert_slot_holds(m, m.slot_of(lora.id), lora)
    assert m.buffers(SPECS[1].name).ranks.tolist() == [[4, 8, 16], [0, 8, 16], [4, 2, 16]]
    assert m.lora_index_to_id == [1, 2, 3]
    # the caller's adapter keeps its scaling: folding happened on the manager's copy
    assert loras[0].get_lora("lm_head").scaling != 1.0
    assert m.add_adapter(loras[0]) is False


def test_slot_reuse_leaves_no_stale_data():
    m = manager(max_loras=1)
    big, small = make_lora(1, 16), make_lora(2, 4, skip=("q_proj", "embed_tokens"))
    m.add_adapter(big)
    m.add_adapter(small)
    slot = m.activate_adapter(1)
    assert m.deactivate_adapter(1) is True
    assert m.lora_index_to_id == [None]
    assert all(int(m.buffers(s.name).ranks[:, slot].abs().sum()) == 0 for s in SPECS)
    assert m.deactivate_adapter(1) is False
    assert m.activate_adapter(2) == slot
    assert_slot_holds(m, slot, small)


def test_gpu_lru_eviction_order():
    m = manager(max_loras=2, max_cpu_loras=4)
    for i in (1, 2, 3):
        m.add_adapter(make_lora(i, 4))
    m.activate_adapter(1)
    m.activate_adapter(2)
    m.activate_adapter(1)  # 2 is now least recently used
    assert m.activate_adapter(3) == 1
    assert m.lora_index_to_id == [1, 3] and m.slot_of(2) is None
    assert_slot_holds(m, 1, make_lora(3, 4))


def test_host_lru_eviction_frees_gpu_slot():
    m = manager(max_loras=2, max_cpu_loras=2)
    m.add_adapter(make_lora(1, 4))
    m.add_adapter(make_lora(2, 8))
    m.activate_adapter(2)
    m.activate_adapter(1)  # host order now 2, 1
    assert m.list_adapters() == [2, 1]
    m.add_adapter(make_lora(3, 4))
    assert m.list_adapters() == [1, 3]
    assert m.lora_index_to_id == [None, 1]
    assert int(m.buffers(SPECS[1].name).ranks[:, 0].abs().sum()) == 0
    with pytest.raises(UnknownLoRAError):
        m.activate_adapter(2)


def test_pinned_adapters_are_never_evicted():
    m = manager(max_loras=2, max_cpu_loras=3)
    for i in (1, 2, 3):
        m.add_adapter(make_lora(i, 4))
    m.pin_adapter(1)
    for i in (2, 3, 2, 3):
        m.activate_adapter(i)
    assert m.slot_of(1) is not None
    m.add_adapter(make_lora(4, 4))  # host LRU skips pinned 1
    assert 1 in m.list_adapters() and 2 not in m.list_adapters()
    m.pin_adapter(3)
    before = snapshot(m)
    with pytest.raises(LoRACapacityError):
        m.activate_adapter(4)
    assert snapshot(m) == before
    with pytest.raises(LoRACapacityError):
        m.prepare_batch(LoRAMapping((4,), (4,)))
    assert snapshot(m) == before


def test_host_cache_full_of_protected_adapters_refuses_add():
    m = manager(max_loras=1, max_cpu_loras=1)
    m.add_adapter(make_lora(1, 4))
    m.pin_adapter(1)
    with pytest.raises(LoRACapacityError):
        m.add_adapter(make_lora(2, 4))
    assert m.list_adapters() == [1]


@pytest.mark.parametrize("bad", [
    (make_lora(9, 32), RankTooLargeError),
    (make_lora(9, 4, rank_pattern={"down_proj": 32}), RankTooLargeError),
    (LoRAModel(9, 4, {"model.layers.0.mlp.fc1": make_lora(9, 4).get_lora("lm_head")}), UnknownTargetModuleError),
    (LoRAModel(9, 4, {"lm_head": make_lora(9, 4).get_lora(f"{L0}.self_attn.o_proj")}), AdapterShapeError),
    (make_lora(9, 4, bias=True), UnsupportedAdapterError),
], ids=["rank", "rank_pattern", "unknown_module", "shape", "bias_disabled"])
def test_bad_adapter_is_refused_before_any_eviction(bad):
    lora, error = bad
    m = manager(max_loras=2, max_cpu_loras=2)
    m.add_adapter(make_lora(1, 4))
    m.add_adapter(make_lora(2, 8))
    m.activate_adapter(1)
    m.activate_adapter(2)
    before = snapshot(m)
    with pytest.raises(error):
        m.add_adapter(lora)
    assert snapshot(m) == before


def test_running_batch_is_never_evicted():
    m = manager(max_loras=3, max_cpu_loras=4)
    for i in (1, 2, 3, 4):
        m.add_adapter(make_lora(i, 4))
    for i in (1, 2, 3):
        m.activate_adapter(i)
    m.set_running([1, 2, 0])
    assert m.activate_adapter(4) == 2  # 3 goes although 1 is least recently used
    with pytest.raises(LoRACapacityError):
        m.deactivate_adapter(1)
    m.set_running([1, 2, 4])
    before = snapshot(m)
    with pytest.raises(LoRACapacityError):
        m.activate_adapter(3)
    assert snapshot(m) == before
    m.add_adapter(make_lora(5, 4))  # host evicts 3, the only one not running
    assert sorted(m.list_adapters()) == [1, 2, 4, 5]
    m.set_running([])
    m.activate_adapter(5)
    assert m.slot_of(1) is None


def test_kept_adapters_are_not_evicted():
    """activate_adapter(keep=...): the adapters a caller still needs (a prefetch's: those of running and
    waiting requests) stay, as the running batch's do; with nothing else to evict it raises, changing nothing."""
    m = manager(max_loras=3, max_cpu_loras=5)
    for i in (1, 2, 3, 4, 5):
        m.add_adapter(make_lora(i, 4))
    for i in (1, 2, 3):
        m.activate_adapter(i)
    m.set_running([3])
    assert m.activate_adapter(4, keep=[1]) == 1  # 2 goes although 1 is least recently used
    assert m.lora_index_to_id == [1, 4, 3]
    assert_slot_holds(m, 1, make_lora(4, 4))
    before = snapshot(m)
    with pytest.raises(LoRACapacityError, match="ones to keep"):
        m.activate_adapter(5, keep=[1, 4])
    assert snapshot(m) == before


def test_prepare_batch():
    m = manager(max_loras=2, max_cpu_loras=4)
    for i in (1, 2, 3):
        m.add_adapter(make_lora(i, 4))
    before = snapshot(m)
    with pytest.raises(LoRACapacityError, match="max_loras"):
        m.prepare_batch(LoRAMapping((1, 2, 3, 0), (1, 2, 3)))
    with pytest.raises(UnknownLoRAError):
        m.prepare_batch(LoRAMapping((1, 7), (1, 7)))
    assert snapshot(m) == before
    assert m.prepare_batch(LoRAMapping((1, 1, 0, 2), (1, 2))) == [1, 2]
    assert m.prepare_batch(LoRAMapping((3, 2), (3, 2))) == [3, 2]
    with pytest.raises(LoRACapacityError):
        m.activate_adapter(1)  # both slots are used by the running batch


@pytest.mark.parametrize("fs", [False, True], ids=["replicated", "fully_sharded"])
@pytest.mark.parametrize("tp_rank", [0, 1])
def test_tp_shards_match_tp_slicing(fs, tp_rank):
    m = manager(tp_rank=tp_rank, tp_size=2, fs=fs)
    lora = make_lora(1, 4, rank_pattern={"q_proj": 12, "k_proj": 16})
    m.add_adapter(lora)
    slot = m.activate_adapter(1)
    for spec in SPECS:
        buf, dims = m.buffers(spec.name), local_dims(spec, tp_rank, 2, MAX_RANK, fs)
        assert buf.lora_a.shape == dims.lora_a_shape(3) and buf.lora_b.shape == dims.lora_b_shape(3)
        offset = 0
        for i, name in enumerate(spec.sub_module_names()):
            layer = lora.get_lora(name)
            a = shard_lora_a(layer.lora_a, spec.shard, tp_rank, 2, fully_sharded=fs, max_rank=MAX_RANK)
            b = shard_lora_b(layer.lora_b * layer.scaling, spec.shard, tp_rank, 2, fully_sharded=fs)
            if spec.kind is LoRAKind.EMBEDDING:
                got_a = buf.lora_a[0, slot]
                torch.testing.assert_close(got_a[:, :a.shape[1]], a)
            else:
                got_a = buf.lora_a[i, slot]
                torch.testing.assert_close(got_a[:a.shape[1]], a.T)
            assert torch.count_nonzero(got_a) == torch.count_nonzero(a)  # the rest is zero padding
            got_b = buf.lora_b[slot, offset:offset + b.shape[1]]
            torch.testing.assert_close(got_b[:, :b.shape[0]], b.T)
            assert torch.count_nonzero(got_b[:, b.shape[0]:]) == 0
            assert int(buf.ranks[i, slot]) == layer.rank
            offset += b.shape[1]


def reference_apply(buf, x: torch.Tensor, slots: list[int]) -> torch.Tensor:
    """Plain-torch punica semantics over the stacked slot buffers: y[i] += x[i] @ A[s_i] @ B[s_i]."""
    y = torch.zeros(len(slots), buf.lora_b.shape[1])
    embedding = buf.spec.kind is LoRAKind.EMBEDDING
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        offset = 0
        for s, width in enumerate(buf.output_slices):
            r = int(buf.ranks[s, slot])
            shrink = buf.lora_a[0, slot, x[t], :r] if embedding else buf.lora_a[s, slot, :r] @ x[t]
            y[t, offset:offset + width] += buf.lora_b[slot, offset:offset + width, :r] @ shrink
            offset += width
    return y


def test_mixed_batch_through_slots_matches_each_adapter():
    m = manager(max_loras=3)
    loras = {1: make_lora(1, 4, skip=("v_proj",)), 2: make_lora(2, 16, rank_pattern={"gate_proj": 8}),
             3: make_lora(3, 8)}
    for lora in loras.values():
        m.add_adapter(lora)
    ids = [2, 0, 1, 1, 3, 2, 0, 3]
    index_to_id = m.prepare_batch(LoRAMapping(tuple(ids), tuple(ids)))
    slots = [index_to_id.index(i) if i else -1 for i in ids]
    gen = torch.Generator().manual_seed(0)
    for spec in SPECS:
        emb = spec.kind is LoRAKind.EMBEDDING
        x = torch.randint(0, VOCAB, (len(ids),), generator=gen) if emb else \
            torch.randn(len(ids), spec.in_features, generator=gen)
        got = reference_apply(m.buffers(spec.name), x, slots)
        for t, lora_id in enumerate(ids):
            parts = []
            for i, name in enumerate(spec.sub_module_names()):
                layer = loras[lora_id].get_lora(name) if lora_id else None
                if layer is None:
                    parts.append(torch.zeros(spec.out_slices[i]))
                else:
                    shrink = layer.lora_a[x[t]] if emb else x[t] @ layer.lora_a
                    parts.append(shrink @ layer.lora_b * layer.scaling)
            torch.testing.assert_close(got[t], torch.cat(parts), rtol=1e-4, atol=1e-4)


def test_bias_is_scaled_and_placed_per_slice():
    m = manager(bias=True)
    lora = make_lora(1, 4, bias=True, skip=("k_proj",))
    m.add_adapter(lora)
    slot = m.activate_adapter(1)
    bias = m.buffers(SPECS[1].name).bias[slot]
    q, v = (lora.get_lora(f"{L0}.self_attn.{p}") for p in ("q_proj", "v_proj"))
    torch.testing.assert_close(bias, torch.cat([q.bias * q.scaling, torch.zeros(KV), v.bias * v.scaling]))
    assert m.buffers("model.embed_tokens").bias is None


def test_unknown_ids_raise():
    m = manager()
    for call in (m.activate_adapter, m.deactivate_adapter, m.pin_adapter, m.remove_adapter, m.slot_of):
        with pytest.raises(UnknownLoRAError):
            call(42)
    with pytest.raises(UnknownLoRAError):
        m.set_running([42])


def test_remove_adapter_frees_both_tiers():
    m = manager()
    m.add_adapter(make_lora(1, 4))
    m.pin_adapter(1)
    assert m.remove_adapter(1) is True
    assert m.list_adapters() == [] and m.lora_index_to_id == [None, None, None]


@pytest.mark.gpu
def test_cuda_side_stream_load_matches_cpu():
    cfg = LoRAConfig(max_loras=2, max_lora_rank=MAX_RANK, lora_dtype="float32")
    m = LoRAModelManager(SPECS, cfg, "cuda", torch.bfloat16)
    ref = manager(max_loras=2)
    stream = torch.cuda.Stream()
    for i, rank in ((1, 4), (2, 16), (3, 8)):
        m.add_adapter(make_lora(i, rank))
        ref.add_adapter(make_lora(i, rank))
        m.activate_adapter(i, stream=stream)
        ref.activate_adapter(i)
    torch.cuda.current_stream().wait_stream(stream)
    for spec in SPECS:
        got, want = m.buffers(spec.name), ref.buffers(spec.name)
        assert got.lora_a.is_cuda and got.lora_a.dtype == torch.float32
        torch.testing.assert_close(got.lora_a.cpu(), want.lora_a)
        torch.testing.assert_close(got.lora_b.cpu(), want.lora_b)
        assert got.ranks.cpu().tolist() == want.ranks.tolist()
