"""The model's fused pointwise path, end to end, in CI: greedy tokens and logprobs equal HF + PEFT's.

On CPU the layers use their plain-torch forms (fused_ops(x) is None there), so without this test CI would
never run, inside the model, the kernels a GPU decode step runs: the LoRA expands left to SiluAndMul, the
rotary embedding and the add + RMSNorm (lora_core/punica/pending.py), and those norms' RowScale, the 1 / rms
left to the rotary and SiluAndMul kernels after the next layer (replicas/layers/row_scale.py). Here fused_ops
answers with replicas.kernels.fused on CPU too, so the kernels run under Triton's interpreter (on a GPU they
run as they always do).
"""

from __future__ import annotations

import torch

from replicas.kernels import fused, lora_norm
from replicas.layers import norm, rotary
from replicas.llm import LLM
from tests.replicas.test_engine import _check_against_hf, _greedy, batch, hf_reference, lora_requests  # noqa: F401


def test_fused_kernels_in_the_model_match_hf_peft(demo, batch, hf_reference, monkeypatch):  # noqa: F811
    if not torch.cuda.is_available():
        monkeypatch.setattr(norm, "fused_ops", lambda x: fused)
        monkeypatch.setattr(rotary, "fused_ops", lambda x: fused)
    monkeypatch.setattr(fused, "LORA_SILU_MAX_RANK", 32)  # the demo's adapters reach rank 32
    monkeypatch.setattr(lora_norm, "LORA_NORM_MAX_RANK", 32)
    calls = {"deferred": 0, "norm": 0, "silu": 0, "rotary": 0}

    def counting(name, fn):
        def run(*args, **kwargs):
            calls[name] += 1
            return fn(*args, **kwargs)
        return run

    from replicas.kernels import lora_rotary

    monkeypatch.setattr(lora_norm, "add_rms_norm_lora_deferred",
                        counting("deferred", lora_norm.add_rms_norm_lora_deferred))
    monkeypatch.setattr(lora_norm, "add_rms_norm_lora", counting("norm", lora_norm.add_rms_norm_lora))
    monkeypatch.setattr(fused, "silu_and_mul", counting("silu", fused.silu_and_mul))
    monkeypatch.setattr(lora_rotary, "rotary_lora", counting("rotary", lora_rotary.rotary_lora))
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32",
              lora_stacked_max_tokens=256, lora_pending_max_tokens=16, lora_pending_min_adapters=1)
    try:
        _check_against_hf(llm.generate(batch[0], _greedy(), batch[1]), hf_reference)
    finally:
        llm.shutdown()
    # every decode step (<= 16 rows) of the 4 layers: 2 deferred norms but for layer 0's input norm (no
    # residual yet); the final norm takes the last down_proj's expand without deferring (the LM head reads it)
    assert calls["deferred"] > 0 and calls["norm"] > 0 and calls["rotary"] > 0 and calls["silu"] > 0
    assert calls["deferred"] > calls["norm"]
