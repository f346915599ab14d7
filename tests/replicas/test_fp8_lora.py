"""Stacked A rows under FP8 base weights (replicas/fp8_lora.py): when the engine takes the path, that its FP8
copies of the A slots follow every slot the manager writes or moves, and generation against transformers +
PEFT whose base layers and lora_A layers compute the same FP8 products."""

from __future__ import annotations

import pytest
import torch

from lora_core.config import LoRAConfig
from lora_core.errors import LoRAConfigError
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from replicas.fp8_lora import FP8ARows
from replicas.lora_layers import fused_max_adapters, lora_module_specs, stack_lora_weights, stacked_max_tokens
from replicas.quantization import FP8, fp8_linear_reference, quantize_model, quantize_rows
from tests.replicas.conftest import EVERY_PROJECTION, build_model, generate_against_peft, write_peft_adapters
from tests.replicas.fp8_reference import assert_quantized_rows
from tests.replicas.test_fp8 import _fp8_linears, _row_parallel_reference
from tests.replicas.test_stacked_layers import _adapter

CUDA, CPU = torch.device("cuda"), torch.device("cpu")


def test_the_stacked_path_over_fp8_weights_runs_only_when_asked_for():
    rank16, rank8 = LoRAConfig(max_loras=2, max_lora_rank=16), LoRAConfig(max_loras=2, max_lora_rank=8)
    assert stacked_max_tokens(None, rank16, CUDA, 1, torch.bfloat16, quantized=True) == 0
    assert stacked_max_tokens(256, rank16, CUDA, 1, torch.bfloat16, quantized=True) == 256
    assert stacked_max_tokens(64, rank8, CPU, 1, torch.float32, quantized=True) == 64  # the reference GEMM: any rows
    with pytest.raises(LoRAConfigError, match="multiple of 16"):  # cuBLASLt's FP8 GEMM: rows in steps of 16
        stacked_max_tokens(256, rank8, CUDA, 1, torch.bfloat16, quantized=True)
    with pytest.raises(LoRAConfigError, match="fully_sharded_loras"):
        stacked_max_tokens(256, LoRAConfig(max_loras=2, max_lora_rank=16, fully_sharded_loras=True), CUDA, 2,
                           torch.bfloat16, quantized=True)
    # the one-launch sites multiply bfloat16 weights: off over FP8 ones, and refused by name
    assert fused_max_adapters(None, 256, 16, "NVIDIA H100", quantized=True) == 0
    assert fused_max_adapters(None, 256, 16, "NVIDIA H100") == 16
    with pytest.raises(LoRAConfigError, match="quantization"):
        fused_max_adapters(4, 256, 16, quantized=True)


def test_fp8_a_rows_follow_every_slot_written_or_moved(tiny_checkpoint):
    """Three adapters of ranks 4, 8 and 16 in rank-16 slots; then a step of the third alone, which compaction
    moves to slot 0 (the first leaving it): every slot's stacked rows are its A quantized per rank row (zeros
    past the adapter's rank), the base rows and scales untouched, and the layers' weights views of them."""
    model = build_model(tiny_checkpoint("llama3_tied"))
    quantize_model(model, "fp8", torch.float32, CPU)
    specs = lora_module_specs(model)
    cfg = LoRAConfig(max_loras=3, max_lora_rank=16)
    base = {name: (model.get_submodule(name).weight.clone(), model.get_submodule(name).weight_scale.clone())
            for name in ("model.layers.0.self_attn.qkv_proj", "model.layers.1.mlp.down_proj")}
    stacked = stack_lora_weights(model, specs, cfg)
    manager = LoRAModelManager(specs, cfg, "cpu", torch.float32, compact_slots=True)
    manager.on_slot_write = FP8ARows(manager, stacked)
    for lora_id, rank in ((1, 4), (2, 8), (3, 16)):
        manager.add_adapter(_adapter(specs, lora_id, rank))
        manager.activate_adapter(lora_id)
    assert [manager.slot_of(i) for i in (1, 2, 3)] == [0, 1, 2]

    def check(slots: dict[int, int]) -> None:
        for name, st in stacked.items():
            a = manager.buffers(name).lora_a  # [S, L, R, in], the model's dtype
            for lora_id, slot in slots.items():
                want_q, want_s = quantize_rows(a[:, slot].reshape(-1, a.shape[-1]))
                got_q = st.weight[st.out:].view(cfg.max_loras, -1, a.shape[-1])[slot]
                got_s = st.scale[st.out:].view(cfg.max_loras, -1)[slot]
                assert got_q.dtype == FP8 and torch.equal(got_q.float(), want_q.float()), (name, lora_id)
                assert torch.equal(got_s, want_s), (name, lora_id)
                assert_quantized_rows(a[:, slot].reshape(-1, a.shape[-1]), got_q, got_s, interpreted=False)
                rank = (4, 8, 16)[lora_id - 1]
                assert a[:, slot, :rank].abs().sum() > 0 and not a[:, slot, rank:].any()
        for name, (w, s) in base.items():
            layer = model.get_submodule(name)
            assert torch.equal(layer.weight.float(), w.float()) and torch.equal(layer.weight_scale, s)
            assert layer.weight.data_ptr() == stacked[name].weight.data_ptr()
            assert layer.weight_scale.data_ptr() == stacked[name].scale.data_ptr()

    check({1: 0, 2: 1, 3: 2})
    manager.prepare_batch(LoRAMapping([3, 3], [3], is_prefill=False))
    # no free slot above: the least recently used (1, in slot 0) leaves, and 3 moves down into its slot
    assert manager.slot_moves == 1 and manager.slot_of(1) is None and manager.slot_of(3) == 0
    check({3: 0, 2: 1})


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_one_launch_quantizes_a_slot_of_every_part(dtype):
    """kernels.fp8.QuantizeTables (FP8ARows on CUDA): three parts of other row counts and widths (one wider than
    a block), their slots strided as in the manager's arena: slot 2 of each equals quantize_rows' per-row scales
    and values (the Triton quantizer's under the interpreter, whose float8 conversion errs: test_fp8.py) and the
    e4m3 definition's (fp8_reference.py), the other slots untouched."""
    from replicas.kernels.fp8 import TABLE_BLOCK, QuantizeTables, quantize_rows as triton_rows

    device = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(5)
    parts = []
    for rows, width in ((6, 64), (3, TABLE_BLOCK + 904), (12, 32)):
        arena = (torch.randn(4, rows + 1, width, generator=g) * torch.logspace(-2, 1, rows + 1).unsqueeze(1))
        src = arena.to(dtype).to(device)[:, 1:]  # each slot's rows contiguous, the slots apart
        parts.append((src, torch.zeros(4, rows, width, dtype=FP8, device=device),
                      torch.zeros(4, rows, device=device)))
    QuantizeTables(parts)(2)
    for src, dst, scales in parts:
        want_q, want_s = quantize_rows(src[2]) if device == "cuda" else triton_rows(src[2])
        assert torch.equal(scales[2], want_s) and torch.equal(scales[2], quantize_rows(src[2])[1])
        assert torch.equal(dst[2].view(torch.uint8), want_q.view(torch.uint8))
        assert_quantized_rows(src[2], dst[2], scales[2])
        assert not scales[[0, 1, 3]].any() and not dst[[0, 1, 3]].view(torch.uint8).any()
    with pytest.raises(ValueError, match="do not fit"):
        QuantizeTables([(parts[0][0], parts[1][1], parts[0][2])])


def _fp8_lora_a(tp: int):
    """A peft_greedy_reference patch_peft: every lora_A layer runs fp8_linear_reference over its weight
    quantized per rank row, as the stacked GEMM runs the shrink (the input quantized per token); those of
    row-parallel layers (o_proj, down_proj) as tp ranks hold them: each its part of every row, quantized on
    its own, the partial products summed."""
    def patch(model):
        for name, module in model.named_modules():
            if ".lora_A." in name and isinstance(module, torch.nn.Linear):
                parts = [quantize_rows(a.contiguous()) for a in module.weight.data.chunk(
                    tp if any(f"{row}.lora_A" in name for row in ("o_proj", "down_proj")) else 1, dim=1)]
                module.forward = lambda x, parts=parts: sum(
                    fp8_linear_reference(xp, aq, a_scale) for xp, (aq, a_scale) in zip(x.chunk(len(parts), -1), parts))
    return patch


@pytest.mark.parametrize("tp", [1, 2])
def test_generation_with_the_shrink_in_the_fp8_gemm_matches_hf_peft(demo, tmp_path, tp):
    """Every step stacked (lora_stacked_max_tokens above the prompts' rows), adapters on every projection: the
    engine's tokens equal transformers + PEFT's whose base layers and lora_A layers compute the same FP8 products
    (the expand in float32, as PEFT's lora_B; TP 2 over gloo, the row-parallel layers' products as its ranks
    split them). Measured on the CPU at TP 1: three of the four requests' logprobs equal to the bit, the
    fourth's within 0.05 (the engine's GEMMs over the stacked rows and a batch of four sum in another order than
    PEFT's, and an ulp on an FP8 rounding boundary moves this model's logprobs by up to 0.07: test_fp8.py's TP 2
    case), so within 0.1; against PEFT with lora_A unquantized (the unstacked path's shrink) the tokens differ
    and the logprobs by 0.5-1.8."""
    adapters = write_peft_adapters(demo.model_dir, tmp_path, 80,
                                   {"all-r8": dict(r=8, lora_alpha=16, target_modules=EVERY_PROJECTION),
                                    "mlp-r4": dict(r=4, lora_alpha=4, target_modules=["gate_proj", "down_proj"])})

    def forward(name, wq, ws, bias):
        if name.endswith(("o_proj", "down_proj")):
            return lambda x: _row_parallel_reference(x, wq, ws, bias, tp)
        return lambda x: fp8_linear_reference(x, wq, ws, bias)

    prompts = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT", "Hello"]
    generate_against_peft(demo.model_dir, adapters, prompts, [None, "all-r8", "mlp-r4", "all-r8"], 8, tp,
                          patch=_fp8_linears(forward), patch_peft=_fp8_lora_a(tp), tolerance=0.1, quantization="fp8",
                          lora_stacked_max_tokens=512)
