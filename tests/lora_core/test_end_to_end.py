"""The whole lora_core path against PEFT itself.

Real PEFT adapters of different ranks (saved by peft from the tiny Llama) go
through LoRAModel.from_local_checkpoint -> LoRAModelManager (host LRU, GPU
slots, packing, scaling folded into B) -> LoRAMapping -> prepare_batch ->
PunicaWrapper, and every token's LoRA output must equal what PEFT's own layer
adds: x @ delta_W^T for linear layers, the embedding / lm_head layer's output
minus its base layer's for the others. Tokens of the base model get nothing.
The TP test shards the same adapters over two ranks and simulates the
collectives in plain torch: the result must equal TP=1.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from lora_core.config import LoRAConfig
from lora_core.lora_model import LoRAModel
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind
from lora_core.punica import PunicaWrapper
from lora_core.slot_buffers import LoRASlotBuffers
from tests.lora_core.conftest import EXPECTED_LORA_MODULES, LAYERS, peft_delta_in_out, peft_lora_layers

MAX_RANK = 16
# Different ranks, scalings and module sets; 3 uses rank_pattern / alpha_pattern, 4 the embedding and lm_head.
ADAPTERS = {
    1: dict(r=4, lora_alpha=8, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    2: dict(r=8, lora_alpha=16, use_rslora=True, target_modules=["gate_proj", "up_proj", "down_proj"]),
    3: dict(r=16, lora_alpha=32, target_modules="all-linear",
            rank_pattern={"k_proj": 4, "model.layers.1.mlp.down_proj": 12}, alpha_pattern={"v_proj": 7}),
    4: dict(r=8, lora_alpha=12, target_modules=["embed_tokens", "lm_head", "q_proj"]),
}
SHARDS = {"embed_tokens": ShardKind.VOCAB, "lm_head": ShardKind.COLUMN, "qkv_proj": ShardKind.COLUMN,
          "gate_up_proj": ShardKind.COLUMN, "o_proj": ShardKind.ROW, "down_proj": ShardKind.ROW}

# These cases hold CPU tensors, so the Triton backend runs them through the
# interpreter, which is only on where there is no GPU (tests/conftest.py). On
# the GPU machine the kernels are covered by test_punica.py on CUDA tensors.
BACKENDS = ["torch", pytest.param("triton", marks=pytest.mark.skipif(
    torch.cuda.is_available(), reason="CPU-tensor interpreter case; GPU kernels: test_punica.py"))]


@pytest.fixture(scope="module")
def adapters(make_peft_adapter):
    """lora id -> (adapter dir, peft model)."""
    return {i: make_peft_adapter(seed=100 + i, **kwargs) for i, kwargs in ADAPTERS.items()}


def _load(adapters, specs, cfg) -> dict[int, LoRAModel]:
    return {i: LoRAModel.from_local_checkpoint(path, EXPECTED_LORA_MODULES, lora_model_id=i, lora_config=cfg,
                                               module_specs=specs)
            for i, (path, _) in adapters.items()}


def _sharded(specs: list[LoRAModuleSpec]) -> list[LoRAModuleSpec]:
    return [dataclasses.replace(s, shard=SHARDS[s.name.rsplit(".", 1)[-1]]) for s in specs]


# ---- inputs and the PEFT oracle -------------------------------------------------------------


def _mapping(ids: list[int], num_tokens: int, num_prompts: int, seed: int) -> LoRAMapping:
    """Tokens of every adapter in ``ids`` and of the base model (0), interleaved, not grouped."""
    g = torch.Generator().manual_seed(seed)
    pool = [0, *ids]

    def draw(n: int) -> list[int]:
        return pool + [pool[j] for j in torch.randint(len(pool), (n - len(pool),), generator=g).tolist()]

    tokens = draw(num_tokens)
    tokens = [tokens[j] for j in torch.randperm(num_tokens, generator=g).tolist()]
    return LoRAMapping(tokens, draw(num_prompts), is_prefill=num_tokens > 32)


def _inputs(specs: list[LoRAModuleSpec], mapping: LoRAMapping, seed: int) -> dict[str, torch.Tensor]:
    """Per module: token ids (embedding), sampled rows [P, H] (lm_head) or activations [T, in]."""
    g = torch.Generator().manual_seed(seed)
    out = {}
    for spec in specs:
        if spec.kind is LoRAKind.EMBEDDING:
            out[spec.name] = torch.randint(spec.in_features, (mapping.num_tokens,), generator=g)
        else:
            rows = len(mapping.prompt_mapping) if spec.kind is LoRAKind.LOGITS else mapping.num_tokens
            out[spec.name] = torch.randn(rows, spec.in_features, generator=g)
    return out


@torch.no_grad()
def _peft_output(spec: LoRAModuleSpec, peft_model, x: torch.Tensor) -> torch.Tensor:
    """What PEFT's adapter adds to ``spec``'s output for inputs x (zero for untargeted sub-modules)."""
    layers = peft_lora_layers(peft_model)
    if spec.kind is not LoRAKind.LINEAR:  # embedding / lm_head: run PEFT's layer itself
        name, = spec.sub_module_names()
        if name not in layers:
            return torch.zeros(x.shape[0], spec.out_features)
        layer = layers[name]
        return (layer(x) - layer.base_layer(x)).float()
    parts = [x @ peft_delta_in_out(layers[name]) if name in layers else torch.zeros(x.shape[0], width)
             for name, width in zip(spec.sub_module_names(), spec.out_slices)]
    return torch.cat(parts, dim=1)


def _expected(spec, adapters, rows: tuple[int, ...], x: torch.Tensor) -> torch.Tensor:
    want = torch.zeros(len(rows), spec.out_features)
    for lora_id in set(rows) - {0}:
        sel = torch.tensor([i for i, r in enumerate(rows) if r == lora_id])
        want[sel] = _peft_output(spec, adapters[lora_id][1], x[sel])
    return want


def _rows_of(spec: LoRAModuleSpec, mapping: LoRAMapping) -> tuple[int, ...]:
    return mapping.prompt_mapping if spec.kind is LoRAKind.LOGITS else mapping.index_mapping


def _apply(w: PunicaWrapper, buf: LoRASlotBuffers, x: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The LoRA output alone: run the op on a random base output and subtract it."""
    y0 = torch.randn(num_rows, buf.lora_b.shape[1])
    y = y0.clone()
    kind = buf.spec.kind
    if kind is LoRAKind.EMBEDDING:
        w.add_lora_embedding(y, x, buf.lora_a, buf.lora_b, buf.ranks)
    elif kind is LoRAKind.LOGITS:
        w.add_lora_logits(y, x, buf.lora_a, buf.lora_b, 1.0, buf.ranks)
    else:
        w.add_lora_linear(y, x, buf.lora_a, buf.lora_b, buf.bias, 1.0, buf.output_slices, buf.ranks)
    return y - y0


def _check(name: str, got: torch.Tensor, want: torch.Tensor, rows: tuple[int, ...]) -> None:
    base = torch.tensor([r == 0 for r in rows])
    assert torch.count_nonzero(got[base]) == 0, f"{name}: base-model rows got a LoRA update"
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5, msg=lambda m: f"{name}: {m}")


# ---- TP=1 against PEFT --------------------------------------------------------------------


# (ids in the batch, tokens, sampled rows). max_loras=3 < 4 adapters: step 2 evicts adapter 3 (rank 16,
# all-linear) and reuses its slot for adapter 4 (rank 8, q_proj only), so stale rows and slices must not
# leak; step 3 brings 3 back into another adapter's slot. 40 tokens run the SGMV kernels, 12 the BGMV ones.
STEPS = [([1, 2, 3], 40, 6), ([4, 1, 2], 12, 5), ([3, 4, 1], 20, 4)]


@pytest.mark.parametrize("backend", BACKENDS)
def test_mixed_batch_matches_peft(backend, adapters, llama_module_specs):
    assert LAYERS >= 2
    cfg = LoRAConfig(max_loras=3, max_lora_rank=MAX_RANK)
    loras = _load(adapters, llama_module_specs, cfg)
    assert sorted({l.rank for l in loras.values()}) == [4, 8, 16]
    manager = LoRAModelManager(llama_module_specs, cfg, "cpu", torch.float32)
    for lora in loras.values():
        assert manager.add_adapter(lora)
    assert len(manager.list_adapters()) == len(ADAPTERS) > cfg.max_loras
    w = PunicaWrapper(64, cfg.max_loras, "cpu", backend=backend)

    slots: list[dict[int, int]] = []
    nonzero: set[str] = set()  # modules some adapter changed, so the comparisons are not all 0 == 0
    for step, (ids, num_tokens, num_prompts) in enumerate(STEPS):
        mapping = _mapping(ids, num_tokens, num_prompts, seed=step)
        w.update_metadata(mapping, manager.prepare_batch(mapping), cfg.max_loras)
        assert sorted(manager.active_adapters()) == sorted(ids)
        slots.append({i: manager.slot_of(i) for i in ids})
        inputs = _inputs(llama_module_specs, mapping, seed=10 + step)
        for spec in llama_module_specs:  # embedding, lm_head and every module of layers 0 and 1
            rows = _rows_of(spec, mapping)
            got = _apply(w, manager.buffers(spec.name), inputs[spec.name], len(rows))
            want = _expected(spec, adapters, rows, inputs[spec.name])
            _check(f"step {step} {spec.name}", got, want, rows)
            if want.abs().max() > 0:
                nonzero.add(spec.name)
    assert nonzero == {s.name for s in llama_module_specs}
    assert slots[1][4] == slots[0][3], "adapter 4 should reuse the slot of the least recently used adapter 3"
    assert slots[2][3] == slots[0][2], "adapter 3 should come back into the slot of adapter 2"


# ---- TP=2 against TP=1 --------------------------------------------------------------------


def _tp_column(spec, bufs, wrappers, x, fs, sampled):
    """Column-parallel: each rank computes its output shard; the shards are concatenated per slice."""
    meta = [w.sampler_meta if sampled else w.token_meta for w in wrappers]
    shrunk = []
    for buf, w, m in zip(bufs, wrappers, meta):
        s = torch.zeros(buf.lora_a.shape[0], x.shape[0], buf.lora_a.shape[2])
        w.add_shrink(s, x, buf.lora_a, 1.0, buf.ranks, meta=m)
        shrunk.append(s)
    if fs:  # A split on the rank dim: all-gather the [S, T, R/tp] buffers into [S, T, R]
        gathered = torch.cat(shrunk, dim=2)
        assert gathered.shape[2] == MAX_RANK
        shrunk = [gathered] * len(bufs)
    outs = []
    for buf, w, m, s in zip(bufs, wrappers, meta, shrunk):
        y = torch.zeros(x.shape[0], buf.lora_b.shape[1])
        w.add_expand(y, s, buf.lora_b, buf.output_slices, 0, True, buf.ranks, meta=m)
        outs.append(y.split(list(buf.output_slices), dim=1))
    return torch.cat([torch.cat([o[k] for o in outs], dim=1) for k in range(len(spec.out_slices))], dim=1)


def _tp_row(spec, bufs, wrappers, x, fs):
    """Row-parallel: each rank sees its input shard; partial outputs are summed (the base all-reduce)."""
    width = spec.in_features // len(bufs)
    partial = []
    for k, (buf, w) in enumerate(zip(bufs, wrappers)):
        s = torch.zeros(1, x.shape[0], buf.lora_a.shape[2])
        w.add_shrink(s, x[:, k * width:(k + 1) * width].contiguous(), buf.lora_a, 1.0, buf.ranks)
        partial.append(s)
    if fs:  # B split on out: all-reduce the partial shrink, each rank expands into its output slice
        reduced = torch.stack(partial).sum(0)
        partial = [reduced] * len(bufs)
    total = torch.zeros(x.shape[0], spec.out_features)
    for k, (buf, w, s) in enumerate(zip(bufs, wrappers, partial)):
        y = torch.zeros(x.shape[0], spec.out_features)
        local = buf.output_slices[0]
        w.add_expand(y, s, buf.lora_b, buf.output_slices, k * local if fs else 0, True, buf.ranks)
        total += y
    return total


def _tp_embedding(spec, bufs, wrappers, token_ids):
    """Vocab-parallel: a rank adds only for the tokens it owns; outputs are summed."""
    vocab = spec.in_features // len(bufs)
    total = torch.zeros(token_ids.shape[0], spec.out_features)
    for k, (buf, w) in enumerate(zip(bufs, wrappers)):
        y = torch.zeros_like(total)
        w.add_lora_embedding(y, token_ids - k * vocab, buf.lora_a, buf.lora_b, buf.ranks)
        total += y
    return total


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("fully_sharded", [False, True], ids=["replicated", "fully_sharded"])
def test_tp2_matches_tp1(fully_sharded, backend, adapters, llama_module_specs):
    tp_size = 2
    specs = _sharded(llama_module_specs)
    cfg = LoRAConfig(max_loras=4, max_lora_rank=MAX_RANK, fully_sharded_loras=fully_sharded)
    loras = _load(adapters, specs, cfg)
    mapping = _mapping(sorted(ADAPTERS), 20, 6, seed=7)
    checked = specs
    if backend == "triton":  # the interpreter is slow: layer 0 (every TP kind) is enough
        checked = [s for s in specs if not s.name.startswith("model.layers.1.")]
    inputs = _inputs(checked, mapping, seed=8)

    def build(tp_rank: int, size: int):
        m = LoRAModelManager(specs, cfg, "cpu", torch.float32, tp_rank=tp_rank, tp_size=size)
        for lora in loras.values():
            m.add_adapter(lora)
        w = PunicaWrapper(64, cfg.max_loras, "cpu", backend=backend)
        w.update_metadata(mapping, m.prepare_batch(mapping))
        return m, w

    ref_manager, ref_w = build(0, 1)
    ranks = [build(k, tp_size) for k in range(tp_size)]
    for spec in checked:  # column qkv / gate_up / lm_head, row o / down, vocab embedding
        rows = _rows_of(spec, mapping)
        x = inputs[spec.name]
        want = _apply(ref_w, ref_manager.buffers(spec.name), x, len(rows))
        bufs = [m.buffers(spec.name) for m, _ in ranks]
        wrappers = [w for _, w in ranks]
        if spec.shard is ShardKind.VOCAB:
            got = _tp_embedding(spec, bufs, wrappers, x)
        elif spec.shard is ShardKind.COLUMN:
            got = _tp_column(spec, bufs, wrappers, x, fully_sharded, sampled=spec.kind is LoRAKind.LOGITS)
        else:
            got = _tp_row(spec, bufs, wrappers, x, fully_sharded)
        assert want.abs().max() > 0
        _check(f"tp{tp_size} {spec.name}", got, want, rows)
        # and TP=1 itself is PEFT's answer
        torch.testing.assert_close(want, _expected(spec, adapters, rows, x), rtol=1e-4, atol=1e-5)
