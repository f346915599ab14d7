"""The engine's warm-up compiles the sampler's Triton kernels (replicas/warm_up.draw_kernels): requests with any
top_k, with top_p alone, with a top_k past the candidates' limit, with logprobs or penalties compile nothing while
serving."""

from __future__ import annotations

import pytest

from replicas.sampling_params import SamplingParams

pytestmark = pytest.mark.gpu


def test_no_draw_compiles_after_warm_up(demo):
    from bench.triton_compiles import CompileLog
    from replicas.llm import LLM

    llm = LLM(str(demo.model_dir), dtype="float32", kv_cache_memory_bytes=1 << 28)
    vocab = llm.engine.model_config.vocab_size
    params = [SamplingParams(temperature=0.8, top_k=k, max_tokens=4, seed=k) for k in (1, 7, 40, 100, 300, 1000)]
    params += [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=4),
               SamplingParams(temperature=1.0, top_p=0.5, min_p=0.05, max_tokens=4),
               SamplingParams(temperature=0.7, top_k=vocab - 1, top_p=0.95, max_tokens=4)]
    params += [SamplingParams(temperature=0, logprobs=k, max_tokens=4) for k in (0, 1, 5, 16, 20)]
    params += [SamplingParams(temperature=0, repetition_penalty=1.2, frequency_penalty=0.5, max_tokens=4)]
    with CompileLog() as log:
        for p in params:  # one kind of draw per batch, then all mixed in one
            llm.generate(["the warm-up"], p)
        outs = llm.generate(["the warm-up"] * len(params), params)
    assert all(len(o.outputs[0].token_ids) == 4 for o in outs)
    draws = ("_draw_kernel", "_nucleus_kernel", "_exponentials_kernel", "_partials_kernel", "_combine_kernel",
             "_penalize_kernel", "_record_kernel")
    assert [v for v in log.variants if v.split()[0] in draws] == []
