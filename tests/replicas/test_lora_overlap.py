"""LoRAOverlap (LoRA beside the base GEMM, experimental): the same result as the in-place LoRA.

On CPU the side stream is absent and the same sequence runs in order; the
GPU test runs the real fork/join, eagerly and captured in CUDA graphs.
"""

from __future__ import annotations

import pytest
import torch

from replicas.lora_overlap import LoRAOverlap
from tests.replicas.engine_cases import PROMPTS, greedy, make_llm  # noqa: F401  (fixture)

ON_GPU = torch.cuda.is_available()


def _mixed(loras):
    names = sorted(loras)
    lora_list = [loras[names[0]], None, loras[names[1]], loras[names[2]], None, loras[names[3]]]
    params = [greedy(12, logprobs=3) for _ in PROMPTS]
    return lora_list, params


def _run(llm, lora_list, params):
    outs = llm.generate(PROMPTS, params, lora_list)
    for out in outs:
        assert out.error is None, out.error
    return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs]


@pytest.mark.parametrize("max_tokens", [4, 64])  # 4: prefill steps take the in-place path, decode overlaps
def test_overlapped_lora_equals_in_place(make_llm, loras, max_tokens):  # noqa: F811
    lora_list, params = _mixed(loras)
    want = _run(make_llm(), lora_list, params)
    llm = make_llm(lora_overlap_max_tokens=max_tokens)
    wrappers = [m for m in llm.engine.executor.runner.model.modules() if getattr(m, "overlap", None)]
    assert wrappers and all(m.overlap is wrappers[0].overlap for m in wrappers)  # one shared workspace
    calls = []
    run = LoRAOverlap.run

    def counted(self, *args, **kwargs):
        calls.append(args[0].shape[0])
        return run(self, *args, **kwargs)

    LoRAOverlap.run = counted
    try:
        got = _run(llm, lora_list, params)
    finally:
        LoRAOverlap.run = run
    # Same tokens; logprobs to float32 noise: two identical engines differ by up to ~1e-5 on CPU.
    assert [t for t, _ in got] == [t for t, _ in want]
    for (_, got_lp), (_, want_lp) in zip(got, want):
        for g, w in zip(got_lp, want_lp):
            assert g.keys() == w.keys() and all(abs(g[k] - w[k]) < 1e-4 for k in g)
    assert calls and max(calls) <= max_tokens


def test_overlap_adds_the_lora_once_and_leaves_no_adapter_rows_alone():
    overlap = LoRAOverlap("cpu", max_tokens=8, max_width=6)
    x = torch.randn(3, 4)
    w = torch.randn(6, 4)
    lora = torch.zeros(3, 6)
    lora[0] = 1.0  # rows 1 and 2 have no adapter: their delta must be zero, even after a previous call

    def lora_into(delta):
        delta += lora

    overlap._delta.fill_(7.0)  # stale contents of the shared workspace
    y = overlap.run(x, 6, lambda t: t @ w.t(), lora_into)
    torch.testing.assert_close(y, x @ w.t() + lora, rtol=0, atol=0)
    assert not overlap.applies(9, 6) and not overlap.applies(3, 7) and overlap.applies(8, 6)


@pytest.mark.gpu
def test_overlap_on_gpu_with_graphs_equals_eager_in_place(demo, loras):
    from replicas.llm import LLM

    lora_list, params = _mixed(loras)

    def make(**kwargs):
        return LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32",
                   kv_cache_memory_bytes=1 << 28, **kwargs)

    want = _run(make(enforce_eager=True), lora_list, params)
    assert _run(make(lora_overlap_max_tokens=64, enforce_eager=True), lora_list, params) == want
    graphed = make(lora_overlap_max_tokens=64)
    assert graphed.engine.num_decode_graphs > 0
    got = _run(graphed, lora_list, params)
    assert [t for t, _ in got] == [t for t, _ in want]
