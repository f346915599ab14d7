"""Pointwise ops adding a layer's pending LoRA expand (lora_core/punica/pending.py) as they read its output:
SiluAndMul (gate_up_proj), the rotary embedding (qkv_proj), the add + RMSNorm (o_proj, down_proj).

Reference: the same step's PendingExpand.apply (the expand as a kernel of its
own; plain torch on CPU) into a copy of x, then the layer's forward_native. The
fused kernels run under Triton's interpreter on CPU and for real on a GPU.
Shrink columns and B entries past each slot's rank hold zeros up to the rank rounded up to
triton_kernels.RANK_MASK_GROUP (the kernels read that far, so that their loads vectorize, as the slot
images' zeros allow) and garbage (NaN) past it for the kernels, zeros for the reference: a kernel must never
read further.
"""

from __future__ import annotations

import types

import pytest
import torch

from lora_core.mapping import LoRAMapping
from lora_core.punica import PunicaWrapper
from lora_core.punica.pending import PendingExpand
from lora_core.punica.triton_kernels import RANK_MASK_GROUP
from replicas.kernels import fused
from replicas.kernels import lora_norm
from replicas.layers import GeluTanhAndMul, RMSNorm, RotaryEmbedding, SiluAndMul, norm
from replicas.rope_config import LONG_ROPE, RopeScaling
from tests.lora_core.punica_cases import stacked_weights

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"
DTYPES = [torch.float32, torch.float16] + ([torch.bfloat16] if ON_GPU else [])
SLOTS, RANK = 6, 16
# slot per row, -1 = no adapter: shared and distinct adapters, rows without one, mixed ranks (RANKS by slot)
ROW_SLOTS = {1: [3], 5: [2, -1, 5, 2, 0], 9: [4, 4, -1, 1, 3, 0, 5, 2, -1]}
RANKS = [16, 4, 8, 16, 1, 12]


def _randn(*shape, dtype, seed, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g) * scale).to(DEVICE, dtype)


def _pending(row_slots: list[int], slices: tuple[int, ...], dtype, seed: int, garbage: bool, y: torch.Tensor):
    """A step's PendingExpand owed to y, over SLOTS slots of RANKS, with shrink columns for every slot."""
    g = torch.Generator().manual_seed(seed)
    _, b, ranks = stacked_weights(SLOTS, RANK, 8, slices, RANKS, dtype, DEVICE, g)
    ids = list(range(1, SLOTS + 1))
    punica = PunicaWrapper(16, SLOTS, DEVICE, stacked_max_tokens=16)
    punica.update_metadata(LoRAMapping([ids[s] if s >= 0 else 0 for s in row_slots], [1], False), ids)
    shrunk = (torch.randn(len(row_slots), SLOTS, len(slices), RANK, generator=g) * 2).to(DEVICE, dtype)
    group = RANK_MASK_GROUP.value
    for slot, r in enumerate(RANKS):
        shrunk[:, slot, :, r:] = 0.0
        if garbage:
            shrunk[:, slot, :, -(-r // group) * group:] = float("nan")
            b[slot, :, -(-r // group) * group:] = float("nan")
    return PendingExpand(punica, y, shrunk.view(len(row_slots), -1), b, slices, ranks)


def _reference_input(x: torch.Tensor, pending_args) -> torch.Tensor:
    want = x.clone()
    _pending(*pending_args, garbage=False, y=want).apply()
    return want


def _close(out: torch.Tensor, ref: torch.Tensor) -> None:
    # The expand's float32 sum over the rank may add in another order than the reference: an ulp of the
    # rounded sum, carried through the op.
    assert not out.isnan().any()
    tol = 1e-5 if out.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", sorted(ROW_SLOTS))
@pytest.mark.parametrize("inter, block", [(96, 256), (200, 32)])  # one program per row; several, the last partial
@pytest.mark.parametrize("layer", [SiluAndMul, GeluTanhAndMul])
def test_silu_and_mul_adds_the_pending_expand_to_gate_and_up(rows, inter, block, dtype, layer, monkeypatch):
    monkeypatch.setattr(fused, "LORA_SILU_BLOCK", block)
    x = _randn(rows, 2 * inter, dtype=dtype, seed=4, scale=2.0)
    args = (ROW_SLOTS[rows], (inter, inter), dtype, rows + 100)
    x_before = x.clone()

    out = fused.silu_and_mul(x, lora=_pending(*args, True, x), gelu_tanh=layer.gelu_tanh)
    _close(out, layer().forward_native(_reference_input(x, args)))
    assert torch.equal(x, x_before)


def test_rows_without_adapters_are_the_plain_op():
    """A step whose rows have no adapter: the pending expand adds nothing, bit for bit."""
    dtype, inter = torch.float16, 64
    gate_up = _randn(3, 2 * inter, dtype=dtype, seed=9)
    assert torch.equal(fused.silu_and_mul(gate_up, lora=_pending([-1, -1, -1], (inter, inter), dtype, 8, True,
                                                                 gate_up)),
                       fused.silu_and_mul(gate_up))


def test_a_pending_expand_of_another_shape_is_refused():
    x = _randn(5, 128, dtype=torch.float32, seed=1)
    with pytest.raises(ValueError, match="two-slice"):
        fused.silu_and_mul(x, lora=_pending(ROW_SLOTS[5], (64, 32, 32), torch.float32, 1, False, x))
    with pytest.raises(ValueError, match="two-slice"):
        fused.silu_and_mul(x, lora=_pending(ROW_SLOTS[5], (128,), torch.float32, 1, False, x))


def test_silu_and_mul_layer_takes_a_pending_expand_on_any_device():
    """SiluAndMul(lora=...): the fused kernel on CUDA, the expand then forward_native elsewhere; an expand it
    cannot fuse (other slices) runs first on any device."""
    inter, dtype = 64, torch.float32
    for slices in ((inter, inter), (32, 96)):
        gate_up = _randn(5, 2 * inter, dtype=dtype, seed=4)
        args = (ROW_SLOTS[5], slices, dtype, 12)
        y = gate_up.clone()
        _close(SiluAndMul()(y, lora=_pending(*args, False, y)),
               SiluAndMul().forward_native(_reference_input(gate_up, args)))


def test_silu_and_mul_layer_fuses_slots_up_to_its_rank_limit(monkeypatch):
    """SiluAndMul hands the fused kernel only expands of slots up to fused.LORA_SILU_MAX_RANK (past it the fused
    op is slower); a larger one runs first as its own expand. The kernels module is stood in for, so the choice
    is checked on any device (the kernel itself is tested above)."""
    inter, dtype = 64, torch.float32
    handed = []

    def silu_and_mul(x, lora=None, row_scale=None, gelu_tanh=False):
        assert row_scale is None and not gelu_tanh
        handed.append(lora)
        if lora is not None:
            lora.apply()  # into x, as the kernel adds it
        return SiluAndMul().forward_native(x)

    for max_rank, fuses in ((RANK, True), (RANK - 1, False)):
        kernels = types.SimpleNamespace(LORA_SILU_MAX_RANK=max_rank, silu_fusable=fused.silu_fusable,
                                        silu_and_mul=silu_and_mul)
        monkeypatch.setattr(norm, "fused_ops", lambda x: kernels)
        gate_up = _randn(5, 2 * inter, dtype=dtype, seed=4)
        args = (ROW_SLOTS[5], (inter, inter), dtype, 12)
        y = gate_up.clone()
        handed.clear()
        _close(SiluAndMul()(y, lora=_pending(*args, False, y)),
               SiluAndMul().forward_native(_reference_input(gate_up, args)))
        assert (handed[0] is not None) == fuses


def test_steps_leave_expands_by_rows_adapter_bound_and_bias():
    """PunicaWrapper.pending_expand: only steps of up to pending_max_tokens rows whose adapter bound (1, 4, 16,
    ...) reaches pending_min_adapters, and never with a LoRA bias."""
    ids = list(range(1, SLOTS + 1))
    _, b, ranks = stacked_weights(SLOTS, RANK, 8, (8, 8), RANKS, torch.float32, DEVICE, torch.Generator())
    shrunk = torch.zeros(9, SLOTS * 2 * RANK, device=DEVICE)
    punica = PunicaWrapper(16, SLOTS, DEVICE, stacked_max_tokens=16, pending_max_tokens=8, pending_min_adapters=4)

    def left(row_ids, bias=None):
        punica.update_metadata(LoRAMapping(row_ids, [1], False), ids)
        y = torch.zeros(len(row_ids), 16, device=DEVICE)
        return punica.pending_expand(y, shrunk[:len(row_ids)], b, (8, 8), ranks, bias) is not None

    assert not left([1, 1, 1])  # one adapter: bound 1
    assert left([1, 2, 1]) and left([1, 2, 3, 4, 0])  # two to four adapters: bound 4
    assert not left([1, 2] * 5)  # 10 rows > 8
    assert not left([1, 2, 3], bias=torch.zeros(SLOTS, 16, device=DEVICE))
    assert not PunicaWrapper(16, SLOTS, DEVICE).pending_expand(shrunk[:, :16], shrunk, b, (8, 8), ranks)  # off


HEAD_DIM, Q_HEADS, KV_HEADS = 16, 4, 2
QKV = (Q_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM, KV_HEADS * HEAD_DIM)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", sorted(ROW_SLOTS))
@pytest.mark.parametrize("heads_per_program,rope_kind", [(1, None), (2, None), (4, None), (2, "longrope"),
                                                       (1, "partial"), (2, "partial")])
def test_rotary_adds_the_pending_qkv_expand(rows, heads_per_program, rope_kind, dtype, monkeypatch):
    """lora_rotary.rotary_lora: q and k rotated after their expand, v's expand added in place, q and k's
    columns of the qkv output left alone. longrope: short and long frequencies, and encoded positions;
    partial: half of each head turned, cos and sin scaled (Phi-4-mini's longrope), the rest expanded only."""
    from replicas.kernels import lora_rotary

    monkeypatch.setattr(lora_rotary, "LORA_ROTARY_HEADS", heads_per_program)
    turned = HEAD_DIM // 2 if rope_kind == "partial" else HEAD_DIM
    scaling = RopeScaling("longrope", original_max_position_embeddings=50, attention_factor=1.19,
                          short_factor=(1.0, 1.5, 2.0, 1.2, 1.1, 3.0, 1.0, 2.5)[:turned // 2],
                          long_factor=(9.0, 7.0, 5.0, 4.0, 3.0, 2.0, 1.5, 1.0)[:turned // 2]) if rope_kind else None
    rope = RotaryEmbedding(HEAD_DIM, 10000.0, scaling, turned).to(DEVICE)
    qkv = _randn(rows, sum(QKV), dtype=dtype, seed=5, scale=2.0)
    positions = (torch.arange(rows) * 37).to(DEVICE)
    if rope_kind:
        positions[::3] += LONG_ROPE
    args = (ROW_SLOTS[rows], QKV, dtype, rows + 200)
    want = _reference_input(qkv, args)
    want_q, want_k, want_v = want.split(QKV, -1)
    ref_q, ref_k = rope.forward_native(positions, want_q, want_k)

    got = qkv.clone()
    q, k, v = got.split(QKV, -1)
    out_q, out_k = lora_rotary.rotary_lora(positions, q, k, v, rope.inv_freq, HEAD_DIM, _pending(*args, True, got),
                                           long_from=rope.long_from, rotary_dim=rope.rotary_dim,
                                           cos_sin_factor=rope.cos_sin_factor)
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    _close(v, want_v)
    assert torch.equal(got[:, :QKV[0] + QKV[1]], qkv[:, :QKV[0] + QKV[1]])


def test_rotary_layer_takes_a_pending_expand_with_views_of_its_output():
    """RotaryEmbedding(q, k, lora=..., v=...): the fused kernel on CUDA, the expand then forward_native elsewhere;
    q, k, v that are not the views of the expand's output are refused (the expand would miss them)."""
    dtype, rows = torch.float32, 5
    rope = RotaryEmbedding(HEAD_DIM, 10000.0).to(DEVICE)
    qkv = _randn(rows, sum(QKV), dtype=dtype, seed=6)
    positions = torch.arange(rows).to(DEVICE)
    args = (ROW_SLOTS[rows], QKV, dtype, 13)
    want = _reference_input(qkv, args)
    ref_q, ref_k = rope.forward_native(positions, *want.split(QKV, -1)[:2])
    got = qkv.clone()
    q, k, v = got.split(QKV, -1)
    out_q, out_k = rope(positions, q, k, lora=_pending(*args, False, got), v=v)
    _close(out_q, ref_q)
    _close(out_k, ref_k)
    _close(v, want.split(QKV, -1)[2])
    with pytest.raises(ValueError, match="views of its output"):
        rope(positions, q.clone(), k, lora=_pending(*args, False, got), v=v)
    with pytest.raises(ValueError, match="views of its output"):
        rope(positions, q, k, lora=_pending(*args, False, got))


HIDDEN_BLOCKS = [(96, 256), (200, 32)]  # (hidden, columns per program): one program per row; several, the last partial


def _norm_case(rows: int, hidden: int, dtype, seed: int):
    x = _randn(rows, hidden, dtype=dtype, seed=seed, scale=2.0)
    residual = _randn(rows, hidden, dtype=dtype, seed=seed + 1)
    layer = RMSNorm(hidden, 1e-5, dtype).to(DEVICE)
    layer.weight.data = _randn(hidden, dtype=dtype, seed=seed + 2) + 1.0
    return x, residual, layer, (ROW_SLOTS[rows], (hidden,), dtype, rows + 300)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows", sorted(ROW_SLOTS))
@pytest.mark.parametrize("hidden, block", HIDDEN_BLOCKS)
def test_add_rms_norm_adds_the_pending_expand_first(rows, hidden, block, dtype, monkeypatch):
    """lora_norm.add_rms_norm_lora = the expand into x, then fused_add_rms_norm: normed output and new residual;
    x and residual left alone. Launched twice on one workspace: the row counters are back at zero after each
    launch and the partials are summed in chunk order, so the second gives the same bits."""
    monkeypatch.setattr(lora_norm, "LORA_NORM_BLOCK", block)
    x, residual, layer, args = _norm_case(rows, hidden, dtype, rows)
    x_before, r_before = x.clone(), residual.clone()
    want_out, want_h = layer.forward_native(_reference_input(x, args), residual)

    pending = _pending(*args, True, x)
    out, h = lora_norm.add_rms_norm_lora(x, residual, layer.weight, layer.eps, pending)
    _close(h, want_h)
    _close(out, want_out)
    assert torch.equal(x, x_before) and torch.equal(residual, r_before)
    counters, _ = pending.punica.arrival_workspace(rows, -(-hidden // block))
    assert not counters.any()
    again = lora_norm.add_rms_norm_lora(x, residual, layer.weight, layer.eps, pending)
    assert torch.equal(again[0], out) and torch.equal(again[1], h)


def test_add_rms_norm_without_adapters_is_the_plain_op():
    """Rows without an adapter: the residual sum bit for bit, the norm up to its float32 sum's order."""
    x, residual, layer, _ = _norm_case(5, 200, torch.float16, 7)
    pending = _pending([-1] * 5, (200,), torch.float16, 8, True, x)
    out, h = lora_norm.add_rms_norm_lora(x, residual, layer.weight, layer.eps, pending)
    want_out, want_h = fused.fused_add_rms_norm(x, residual, layer.weight, layer.eps)
    assert torch.equal(h, want_h)
    _close(out, want_out)


def test_add_rms_norm_refuses_what_it_cannot_fuse():
    x, residual, layer, args = _norm_case(5, 96, torch.float32, 3)
    with pytest.raises(ValueError, match="one-slice"):  # two slices
        lora_norm.add_rms_norm_lora(x, residual, layer.weight, layer.eps, _pending(ROW_SLOTS[5], (48, 48),
                                                                                     torch.float32, 1, False, x))
    with pytest.raises(ValueError, match="one-slice"):  # owed to another tensor than x
        lora_norm.add_rms_norm_lora(x, residual, layer.weight, layer.eps, _pending(*args, False, x.clone()))
    with pytest.raises(ValueError, match="one-slice"):  # a residual of another shape
        lora_norm.add_rms_norm_lora(x, residual[:4], layer.weight, layer.eps, _pending(*args, False, x))


@pytest.mark.parametrize("max_rank, fuses", [(RANK, True), (RANK - 1, False)])
def test_rms_norm_layer_takes_a_pending_expand(max_rank, fuses, monkeypatch):
    """RMSNorm(x, residual, lora=...): the fused kernel where fused ops run (a stand-in here, so the choice is
    checked on any device) for slots up to lora_norm.LORA_NORM_MAX_RANK; past it, and with no fused ops or no
    residual, the expand runs into x first."""
    handed, kernel = [], lora_norm.add_rms_norm_lora

    def fused_kernel(*args):
        handed.append(args)
        return kernel(*args)

    stand_in = types.SimpleNamespace(fused_add_rms_norm=fused.fused_add_rms_norm, rms_norm=fused.rms_norm)
    monkeypatch.setattr(norm, "fused_ops", lambda x: stand_in)
    monkeypatch.setattr(lora_norm, "add_rms_norm_lora", fused_kernel)
    monkeypatch.setattr(lora_norm, "LORA_NORM_MAX_RANK", max_rank)
    x, residual, layer, args = _norm_case(5, 96, torch.float32, 11)
    want_out, want_h = layer.forward_native(_reference_input(x, args), residual)
    y = x.clone()
    out, h = layer(y, residual, lora=_pending(*args, False, y))
    _close(out, want_out)
    _close(h, want_h)
    assert bool(handed) == fuses
    monkeypatch.setattr(norm, "fused_ops", lambda x: None)  # the CPU path
    y = x.clone()
    out, h = layer(y, residual, lora=_pending(*args, False, y))
    _close(out, want_out)
    _close(h, want_h)
    y = x.clone()  # no residual: the expand, then the plain norm
    _close(layer(y, lora=_pending(*args, False, y)), layer.forward_native(_reference_input(x, args)))
