"""Steps with prompt tokens through PiecewiseGraphs' static, padded pieces give the eager engine's results.

On CPU nothing is captured (capture=False runs the same pieces over the same
padded buffers eagerly), which checks the cut at the attentions, the padding
and the buffers; the capture itself is checked on a GPU (marked gpu).
"""

from __future__ import annotations

import pytest
import torch

from replicas.engine import EngineArgs
from replicas.llm import LLM
from replicas.piecewise_graphs import piecewise_sizes
from replicas.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox jumps over the lazy dog and", "Once upon a time in a city far away,", "SELECT",
           "Hello world, this is", "def add(a, b):", "Summary: the meeting was", "Translate to French: the cat"]


def test_piecewise_sizes_bound_the_padding():
    for max_tokens in (16, 100, 512, 2048, 3000):
        sizes = piecewise_sizes(max_tokens)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_tokens and sizes[0] == min(16, max_tokens)
        for n in range(1, max_tokens + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded - n <= max(31, n // 4), (n, padded)
    assert len(piecewise_sizes(2048)) <= 24  # each size is captured once per layout: keep them few


def _kwargs(**extra):
    # max_num_seqs 3 of 7 prompts: later prompts join while others decode, so steps mix both.
    return {**dict(enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32", max_num_seqs=3,
                   num_kv_blocks=64, enable_prefix_caching=False, max_num_batched_tokens=40), **extra}


def _generate(llm, loras):
    names = [None, *sorted(loras), None, *sorted(loras)[:2]]
    lora_reqs = [loras[n] if n else None for n in names[: len(PROMPTS)]]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, logprobs=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    for lora in {l.lora_name: l for l in lora_reqs if l is not None}.values():
        llm.engine.add_lora(lora)  # loaded up front: both engines then schedule (and place KV) alike
    return llm.generate(PROMPTS, params, lora_reqs)


def test_padded_pieces_equal_eager(demo, loras):
    eager = LLM(str(demo.model_dir), **_kwargs(enforce_eager=True))
    padded = LLM(str(demo.model_dir), **_kwargs(enforce_eager=True))
    runner = padded.engine.executor.runner
    assert runner.piecewise is None  # CPU: nothing built unless asked
    graphs = runner.piecewise = runner.build_piecewise_graphs(capture=False)
    seen = []
    run = graphs.run

    def counting_run(input_ids, positions, meta, size, fill=None):
        seen.append((len(input_ids), size, max(meta.query_lens_host), len(meta.query_lens_host)))
        return run(input_ids, positions, meta, size, fill)

    graphs.run = counting_run
    want, got = _generate(eager, loras), _generate(padded, loras)
    assert any(size > n for n, size, _, _ in seen), seen  # padding rows really ran
    assert len({size for _, size, _, _ in seen}) >= 2, seen
    assert any(q_max > 1 and seqs > 1 for _, _, q_max, seqs in seen), seen  # a step mixed prompt and decode
    for w, g in zip(want, got, strict=True):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lw.keys() == lg.keys()
            assert max(abs(lw[t] - lg[t]) for t in lw) < 1e-4
    # Padding rows never reach the attention, so they write no KV at all (no scratch block either).
    for (k_e, v_e), (k_p, v_p) in zip(eager.engine.executor.runner.kv_caches, runner.kv_caches, strict=True):
        torch.testing.assert_close(k_p, k_e, atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(v_p, v_e, atol=1e-4, rtol=1e-3)


def test_pieces_compose_to_the_model_forward(demo):
    """forward_piece 0..L with the attention between them is the model's forward, row for row."""
    llm = LLM(str(demo.model_dir), dtype="float32", num_kv_blocks=16, enable_prefix_caching=False)
    runner = llm.engine.executor.runner
    graphs = runner.build_piecewise_graphs(capture=False)
    from replicas.attention import AttentionMetadata

    lens, tables = [5, 9], [[0], [1]]
    meta = AttentionMetadata.build(lens, lens, tables, runner.cfg.block_size, runner.device)
    ids = [7, 8, 9, 10, 11, 3, 4, 5, 6, 7, 8, 9, 10, 11]
    positions = list(range(5)) + list(range(9))
    with torch.inference_mode():
        want = runner.model(torch.tensor(ids, device=runner.device), torch.tensor(positions, device=runner.device),
                            runner.kv_caches, meta).clone()
        got = graphs.run(ids, positions, meta, graphs.padded_size(len(ids)))
    assert got.shape == want.shape and graphs.padded_size(len(ids)) == 16
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_cudagraph_mode_is_checked_and_turns_pieces_off():
    with pytest.raises(ValueError, match="cudagraph_mode"):
        EngineArgs(model="x", cudagraph_mode="piecewise_please")
    assert EngineArgs(model="x").cudagraph_mode == "full_and_piecewise"


@pytest.mark.gpu
def test_piecewise_graphs_equal_eager_on_gpu(demo, loras):
    eager = LLM(str(demo.model_dir), **_kwargs(enforce_eager=True))
    decode_only = LLM(str(demo.model_dir), **_kwargs(cudagraph_mode="full_decode_only"))
    graphed = LLM(str(demo.model_dir), **_kwargs())
    assert decode_only.engine.executor.runner.piecewise is None
    pieces = graphed.engine.executor.runner.piecewise
    assert pieces is not None and pieces.graphs  # captured at warm-up
    assert graphed.engine.num_cuda_graphs > decode_only.engine.num_cuda_graphs
    want = _generate(eager, loras)
    for llm in (decode_only, graphed):
        got = _generate(llm, loras)
        for w, g in zip(want, got, strict=True):
            assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
            for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
                assert max(abs(lw[t] - lg.get(t, float("inf"))) for t in lw) < 1e-3
