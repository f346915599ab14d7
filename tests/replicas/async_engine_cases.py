"""What the AsyncLLMEngine tests share (tests/replicas/test_async_engine*.py): prompts over the base model and
every demo adapter, their greedy reference through LLM, and a fresh engine per test body."""

from __future__ import annotations

import asyncio

import pytest

from replicas.async_engine import AsyncLLMEngine
from replicas.engine import EngineArgs
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams

PROMPTS = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT", "Hello world, this is",
           "The baker opened his shop"]
ENGINE = dict(enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32", device="cpu")


def greedy(n=12, **kwargs):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True, logprobs=1, **kwargs)


@pytest.fixture(scope="module")
def cases(loras):
    """(prompt, adapter or None) pairs: the base model and every adapter."""
    return list(zip(PROMPTS, [None, *loras.values()]))


@pytest.fixture(scope="module")
def reference(demo, cases):
    llm = LLM(str(demo.model_dir), **ENGINE)
    outs = llm.generate([p for p, _ in cases], greedy(), [lora for _, lora in cases])
    llm.shutdown()
    return [(o.outputs[0].text, o.outputs[0].token_ids) for o in outs]


def run(demo, body, **overrides):
    """asyncio.run(body(engine)) on a fresh engine, shut down afterwards."""

    async def main():
        engine = AsyncLLMEngine.from_engine_args(EngineArgs(model=str(demo.model_dir), **{**ENGINE, **overrides}))
        try:
            return await body(engine)
        finally:
            await engine.shutdown()

    return asyncio.run(main())


async def collect(engine, prompt, params, request_id, lora=None, events=None):
    outs = []
    async for out in engine.generate(prompt, params, request_id, lora):
        outs.append(out)
        if events is not None:
            events.append((request_id, out.finished))
    return outs


def final(outs):
    return outs[-1].outputs[0].text, outs[-1].outputs[0].token_ids
