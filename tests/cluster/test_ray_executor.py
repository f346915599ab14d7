"""Tensor parallelism with ranks as Ray actors (gloo on CPU) equals TP=1."""

from __future__ import annotations

import pytest
import ray

from lora_core.request import LoRARequest
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams


@pytest.fixture(scope="module")
def demo(demo_checkpoint):
    return demo_checkpoint


@pytest.mark.parametrize("fully_sharded,async_scheduling", [(False, False), (True, True)],
                         ids=["replicated", "fully_sharded-async"])
def test_ray_tp2_equals_tp1(demo, fully_sharded, async_scheduling):
    loras = [None] + [LoRARequest(n, i + 1, str(p)) for i, (n, p) in enumerate(sorted(demo.adapters.items()))]
    prompts = ["The quick brown fox", "Once upon a time", "SELECT", "Hello world", "Tell me"]
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    common = dict(dtype="float32", enable_lora=True, max_loras=4, max_lora_rank=32,
                  fully_sharded_loras=fully_sharded)
    want = LLM(str(demo.model_dir), **common).generate(prompts, params, loras)
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        llm = LLM(str(demo.model_dir), tensor_parallel_size=2, async_scheduling=async_scheduling,
                  distributed_executor_backend="cluster.ray_executor:RayExecutor", **common)
        assert llm.engine.async_scheduling == async_scheduling  # rank 0 sends the pending tokens on
        got = llm.generate(prompts, params, loras)
        llm.shutdown()
    finally:
        ray.shutdown()
    assert [g.outputs[0].token_ids for g in got] == [w.outputs[0].token_ids for w in want]


def test_app_gives_each_rank_a_bundle():
    from cluster.app import tensor_parallel_options

    server = {"model": "/models/x", "engine": {"tensor_parallel_size": 2}}
    options = {"ray_actor_options": {"num_cpus": 2, "num_gpus": 1}}
    tensor_parallel_options(server, options)
    assert options["placement_group_bundles"] == [{"CPU": 2.0, "GPU": 1.0}, {"CPU": 2.0, "GPU": 1.0}]
    assert options["placement_group_strategy"] == "STRICT_PACK"
    assert server["engine"]["distributed_executor_backend"] == "cluster.ray_executor:RayExecutor"
    single = {"model": "demo", "engine": {}}
    untouched: dict = {}
    tensor_parallel_options(single, untouched)
    assert untouched == {} and "distributed_executor_backend" not in single["engine"]


def test_adapter_loads_in_worker_processes_inside_a_ray_actor(demo):
    """deploy/config.gpu.yaml sets lora_load_processes: a replica is a Ray worker, whose entry point is
    guarded, so the loader processes it spawns start, and an adapter loaded there serves."""
    name, path = sorted(demo.adapters.items())[0]

    @ray.remote
    class Replica:
        def generate(self):
            from replicas.llm import LLM

            llm = LLM(str(demo.model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=32,
                      lora_load_processes=1)
            try:
                assert llm.engine.executor.runner.loads.process_loader is not None
                outs = llm.generate(["Hello"], SamplingParams(temperature=0.0, max_tokens=4),
                                    LoRARequest(name, 1, str(path)))
                return outs[0].error, outs[0].outputs[0].token_ids
            finally:
                llm.shutdown()

    want = LLM(str(demo.model_dir), dtype="float32", enable_lora=True, max_loras=2, max_lora_rank=32).generate(
        ["Hello"], SamplingParams(temperature=0.0, max_tokens=4), LoRARequest(name, 1, str(path)))
    ray.init(num_cpus=2, include_dashboard=False, runtime_env={"env_vars": {"OMP_NUM_THREADS": "1"}})
    try:
        error, got = ray.get(Replica.remote().generate.remote(), timeout=240)
    finally:
        ray.shutdown()
    assert error is None and got == want[0].outputs[0].token_ids
