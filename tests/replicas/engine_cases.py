"""Requests, engine settings and helpers shared by test_engine_features.py and test_engine_scheduling.py.

make_llm and llm are module-scoped fixtures: a test module imports them by name.
"""

from __future__ import annotations

import pytest

from replicas.llm import LLM
from replicas.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT", "Hello world, this is",
           "When a request arrives, the router", "Every morning the baker"]
LONG_TEXT = ("The quick brown fox jumps over the lazy dog. A serving system answers many requests at once, and "
             "each request may ask for a different adapter. The base model stays in memory while small low-rank "
             "adapters come and go. When a request arrives, the router looks for a replica that already holds its "
             "adapter; if none does, it picks the least busy one, which then loads the adapter from its host cache.")


@pytest.fixture(scope="module")
def make_llm(demo):
    def make(model_dir=None, **kwargs) -> LLM:
        kwargs = dict(enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32", device="cpu") | kwargs
        return LLM(str(model_dir or demo.model_dir), **kwargs)

    return make


def register(engine, lora_list) -> None:
    """Load the adapters up front: a request naming an unregistered adapter waits for its background
    load outside the scheduler, and these tests check the scheduler's order from the first step."""
    for lora in {l.lora_name: l for l in lora_list if l is not None}.values():
        engine.add_lora(lora)


def submit(engine, prompts, params, lora_list) -> dict:
    """Register the adapters, add one request per prompt (ids "0", "1", ...); request id -> its Sequence."""
    register(engine, lora_list)
    for i, (prompt, p, lora) in enumerate(zip(prompts, params, lora_list)):
        engine.add_request(str(i), prompt, p, lora)
    return dict(engine.scheduler.requests)


@pytest.fixture(scope="module")
def llm(make_llm):
    return make_llm()


def greedy(max_tokens: int = 16, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.0, max_tokens=max_tokens, **kwargs)


def seeded(seed: int, max_tokens: int = 24, **kwargs) -> SamplingParams:
    return SamplingParams(temperature=0.8, top_p=0.9, top_k=50, seed=seed, max_tokens=max_tokens, **kwargs)


def tokens(outputs) -> list[list[int]]:
    for out in outputs:
        assert out.error is None, out.error
    return [out.outputs[0].token_ids for out in outputs]


def run_steps(engine, on_step=None) -> dict[str, object]:
    """Step the engine until it is idle; request id -> its final RequestOutput (each reported once)."""
    final = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                assert out.request_id not in final, f"{out.request_id} finished twice"
                final[out.request_id] = out
        if on_step is not None:
            on_step()
    return final


def assert_no_leaked_blocks(llm: LLM) -> None:
    bm = llm.engine.scheduler.block_manager
    assert bm.num_free_blocks == bm.num_blocks
