"""Decode steps through DecodeGraphs' static, padded buffers give the eager engine's results.

On CPU nothing is captured (capture=False runs the same padded step eagerly),
which checks the padding and the static buffers; the capture itself is
checked on a GPU (marked gpu) against enforce_eager.
"""

from __future__ import annotations

import pytest
import torch

from replicas.cuda_graphs import capture_sizes
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from replicas.warm_up import synthetic_step

PROMPTS = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT", "Hello world, this is",
           "def add(a, b):", "Summary:", "Translate to French: the cat"]


@pytest.mark.parametrize("enabled_before", [True, False])
def test_captures_hold_the_garbage_collector_off(monkeypatch, enabled_before):
    """capturing(): no collection may run inside a capture (it could free another engine's graphs or pool,
    which invalidates the capture); the collector's state comes back after it, also when the capture fails."""
    import contextlib
    import gc

    from replicas import cuda_graphs

    seen = []

    @contextlib.contextmanager
    def fake_graph(graph, pool=None, capture_error_mode="global"):
        seen.append((gc.isenabled(), pool, capture_error_mode))
        yield

    monkeypatch.setattr(cuda_graphs.torch.cuda, "graph", fake_graph)
    was = gc.isenabled()
    (gc.enable if enabled_before else gc.disable)()
    try:
        with cuda_graphs.capturing(object(), "pool"):
            assert not gc.isenabled()
        assert seen == [(False, "pool", "thread_local")] and gc.isenabled() == enabled_before
        with pytest.raises(RuntimeError, match="capture failed"):
            with cuda_graphs.capturing(object()):
                raise RuntimeError("capture failed")
        assert gc.isenabled() == enabled_before
    finally:
        (gc.enable if was else gc.disable)()


def test_capture_sizes_cover_every_batch_up_to_the_max():
    for max_batch in (1, 3, 8, 33, 64, 100, 256):
        sizes = capture_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[-1] == max_batch and sizes[0] == 1
        # padding never more than doubles a batch, and costs at most 16 rows past 8
        for n in range(1, max_batch + 1):
            padded = next(s for s in sizes if s >= n)
            assert padded < 2 * n or padded - n < 16 or n < 8


def test_eager_passes_run_each_graph_once_under_its_own_layout():
    """run_all_eager (warm-up's compile-ahead pass) runs every (size, launch key) capture_all would capture,
    each right after its layout was set, and none twice; it captures nothing."""
    from replicas.cuda_graphs import DecodeGraphs

    current, ran = [None], []

    def forward(ids, positions, meta):
        ran.append((len(ids), current[0]))
        return torch.zeros(len(ids), 8)

    def set_layout(size, layout):
        current[0] = layout

    graphs = DecodeGraphs(forward, lambda: current[0][0], max_batch=4, max_blocks_per_seq=2, block_size=16,
                          pad_block=0, vocab_size=8, device=torch.device("cpu"), capture=True)
    # two layouts of one launch key ("bgmv") at every size: the second needs no pass of its own
    layouts = {"a": ("bgmv", 1), "b": ("bgmv", 2), "c": ("sgmv", 3)}
    graphs.run_all_eager(set_layout, lambda size: layouts)
    assert ran == [(size, layout) for size in (4, 2, 1) for layout in (("bgmv", 1), ("sgmv", 3))]
    assert graphs.graphs == {}


def _requests(loras):
    """Mixed adapters and lengths, so the decode batch shrinks through several padded sizes."""
    names = [None, *sorted(loras), None, *sorted(loras)[:2]]
    params = [SamplingParams(temperature=0.0, max_tokens=3 + 2 * i, logprobs=2, ignore_eos=True)
              for i in range(len(PROMPTS))]
    return PROMPTS, params, [loras[n] if n else None for n in names[: len(PROMPTS)]]


def _generate(llm, loras):
    prompts, params, lora_reqs = _requests(loras)
    for lora in {l.lora_name: l for l in lora_reqs if l is not None}.values():
        llm.engine.add_lora(lora)  # loaded up front: both engines then schedule (and place KV) alike
    return llm.generate(prompts, params, lora_reqs)  # one call: every request joins the first step


def _kwargs(**extra):
    return {**dict(enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32", max_num_seqs=8,
                   num_kv_blocks=64, enable_prefix_caching=False), **extra}


def test_padded_static_decode_equals_eager(demo, loras):
    eager = LLM(str(demo.model_dir), **_kwargs(enforce_eager=True))
    padded = LLM(str(demo.model_dir), **_kwargs(enforce_eager=True))
    runner = padded.engine.executor.runner
    graphs = runner.build_decode_graphs(capture=False)
    seen = []
    run = graphs.run

    def counting_run(input_ids, positions, block_tables, batch, fill=None):
        seen.append((len(input_ids), batch))
        return run(input_ids, positions, block_tables, batch, fill)

    graphs.run = counting_run
    runner.decode_graphs = graphs
    want, got = _generate(eager, loras), _generate(padded, loras)
    assert any(batch > n for n, batch in seen), seen  # padding rows really ran
    assert len({batch for _, batch in seen}) >= 3, seen
    for w, g in zip(want, got, strict=True):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert lw.keys() == lg.keys()
            assert max(abs(lw[t] - lg[t]) for t in lw) < 1e-4
    # Padding rows wrote only the scratch block, past the block manager's blocks.
    pad = runner.num_blocks
    for (k_e, v_e), (k_p, v_p) in zip(eager.engine.executor.runner.kv_caches, runner.kv_caches, strict=True):
        # (a padded batch may round differently in the last bits of a matmul)
        torch.testing.assert_close(k_p[:pad], k_e[:pad], atol=1e-4, rtol=1e-3)
        torch.testing.assert_close(v_p[:pad], v_e[:pad], atol=1e-4, rtol=1e-3)
        assert not k_e[pad].any() and k_p[pad].any()



def test_decode_graphs_stop_at_the_token_budget(demo):
    """No step has more rows than max_num_batched_tokens: decode graphs past it were captured for nothing and, on a
    GPU, failed the warm-up (LoRA metadata is sized for the budget) when it was below max_num_seqs."""
    llm = LLM(str(demo.model_dir), **_kwargs(max_num_seqs=64, max_num_batched_tokens=16))
    assert llm.engine.executor.runner.build_decode_graphs(capture=False).sizes[-1] == 16
    out = llm.generate(["Hello"] * 20, SamplingParams(temperature=0.0, max_tokens=3))
    assert all(o.error is None and len(o.outputs[0].token_ids) == 3 for o in out)

def test_prefill_and_oversized_steps_stay_eager(demo, loras):
    llm = LLM(str(demo.model_dir), **_kwargs(max_num_seqs=4))
    runner = llm.engine.executor.runner
    runner.decode_graphs = runner.build_decode_graphs(capture=False)
    from replicas.model_runner import StepInput

    prefill = StepInput([1, 2, 3], [0, 1, 2], [3], [3], [[0]], [2], is_prefill=True)
    decode = StepInput([5, 6], [3, 7], [1, 1], [4, 8], [[0], [1, 2]], [0, 1], is_prefill=False)
    too_many = StepInput([5] * 5, [3] * 5, [1] * 5, [4] * 5, [[i] for i in range(5)], list(range(5)),
                         is_prefill=False)
    assert runner._graph_batch(prefill) is None
    assert runner._graph_batch(decode) == 2
    assert runner._graph_batch(too_many) is None


@pytest.mark.gpu
def test_cuda_graphs_equal_eager_on_gpu(demo, loras):
    eager = LLM(str(demo.model_dir), **_kwargs(enforce_eager=True))
    graphed = LLM(str(demo.model_dir), **_kwargs())
    assert eager.engine.num_cuda_graphs == 0 and graphed.engine.num_cuda_graphs > 0
    want, got = _generate(eager, loras), _generate(graphed, loras)
    for w, g in zip(want, got, strict=True):
        assert g.error is None and g.outputs[0].token_ids == w.outputs[0].token_ids
        for lw, lg in zip(w.outputs[0].logprobs, g.outputs[0].logprobs, strict=True):
            assert max(abs(lw[t] - lg.get(t, float("inf"))) for t in lw) < 1e-3


def test_synthetic_warm_up_step_runs_every_layout(demo):
    """The warm-up's synthetic prefill (GPU: compiles kernels before traffic) gives finite logits."""
    llm = LLM(str(demo.model_dir), **_kwargs())
    runner = llm.engine.executor.runner
    for tokens, adapters, seqs in ((16, 0, 1), (48, 1, 1), (40, 4, 1), (40, 4, 3), (48, 1, 8)):
        logits = synthetic_step(runner, tokens, adapters, seqs)
        assert logits.shape == (seqs, runner.model_config.vocab_size) and torch.isfinite(logits).all()
        assert runner.punica.token_meta.num_rows == tokens and runner.punica.sampler_meta.num_rows == seqs



@pytest.mark.gpu
def test_shutdown_frees_the_graphs_before_the_process_group(demo):
    """With TP the graphs hold NCCL collectives: a second TP engine in one process failed ("NCCL
    communicator was aborted") until they were freed before the group (bench/tp_restart.py)."""
    from replicas.llm import LLM

    llm = LLM(str(demo.model_dir), dtype="float32", kv_cache_memory_bytes=1 << 26)
    graphs = llm.engine.executor.runner.decode_graphs
    assert graphs.graphs
    llm.engine.shutdown()
    assert not graphs.graphs and graphs._pool is None
