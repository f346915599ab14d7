"""Load processes (EngineArgs.lora_load_processes): the default per device, and an engine that keeps loading
adapters when a load's worker process dies."""

from __future__ import annotations

import multiprocessing
import os
import signal
import types

import pytest
import torch

from lora_core.request import LoRARequest
from replicas.adapter_loads import DEFAULT_LOAD_PROCESSES, load_processes_for, load_processes_with_pool
from replicas.engine_args import EngineArgs
from replicas.errors import InvalidRequestError, LoadWorkerLostError
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from replicas.spawn import WORKER_PREFIX
from tests.timeouts import HANG_TIMEOUT_S

_KW = dict(enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu")


def _greedy():
    return SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)


class _ExitsWhereUnpickled(str):
    """An adapter path that ends the worker process which receives it (as a crash in a load would)."""

    def __reduce__(self):
        return os._exit, (3,)


def _workers() -> list[multiprocessing.Process]:
    return [p for p in multiprocessing.active_children() if p.name.startswith(WORKER_PREFIX)]


def test_default_is_processes_on_cuda_hosts_with_the_cores_and_threads_elsewhere(monkeypatch):
    cuda, cpu = torch.device("cuda"), torch.device("cpu")
    assert load_processes_for(None, cpu) == 0 and load_processes_for(3, cpu) == 3 and load_processes_for(0, cuda) == 0
    for cores, want in [(64, DEFAULT_LOAD_PROCESSES), (16, 4), (8, 2), (4, 1), (3, 0)]:
        monkeypatch.setattr(os, "sched_getaffinity", lambda pid, n=cores: set(range(n)), raising=False)
        assert load_processes_for(None, cuda) == want, cores
    shared, private = types.SimpleNamespace(shared=True), types.SimpleNamespace(shared=False)
    assert load_processes_with_pool(None, 4, shared) == 4
    assert load_processes_with_pool(None, 4, private) == 0 and load_processes_with_pool(None, 4, None) == 0
    assert load_processes_with_pool(2, 2, private) == 2 and load_processes_with_pool(2, 2, None) == 2  # as asked
    with pytest.raises(ValueError, match="lora_load_processes must be >= 0"):
        EngineArgs(model="m", lora_load_processes=-1)


def test_the_default_engine_on_cpu_loads_on_threads(demo):
    llm = LLM(str(demo.model_dir), **_KW)
    assert llm.engine.executor.runner.loads.process_loader is None


def test_a_dead_worker_is_replaced_and_the_load_still_serves(demo, loras):
    sql = loras["demo-sql"]
    want = LLM(str(demo.model_dir), **_KW).generate(["SELECT"], _greedy(), [sql])[0].outputs[0].token_ids
    before = _workers()  # any left by earlier tests' engines
    llm = LLM(str(demo.model_dir), lora_load_processes=1, **_KW)
    try:
        loader = llm.engine.executor.runner.loads.process_loader
        (worker,) = [p for p in _workers() if p.pid not in {q.pid for q in before}]
        os.kill(worker.pid, signal.SIGKILL)
        worker.join(HANG_TIMEOUT_S)
        out = llm.generate(["SELECT"], _greedy(), [sql])[0]
        assert out.error is None and out.outputs[0].token_ids == want
        assert loader.pools_started == 2
    finally:
        llm.shutdown()


def test_a_load_whose_worker_dies_twice_fails_its_requests_only(demo, loras, tmp_path):
    names = sorted(loras)
    good = [loras[names[0]], loras[names[1]]]
    crash = LoRARequest("crash", 9, _ExitsWhereUnpickled(str(tmp_path)))
    prompts = ["SELECT", "Hello", "Once upon a time"]
    want = [o.outputs[0].token_ids for o in LLM(str(demo.model_dir), **_KW).generate(prompts, _greedy(), good + [None])]
    llm = LLM(str(demo.model_dir), lora_load_processes=1, **_KW)
    try:
        loader = llm.engine.executor.runner.loads.process_loader
        failed = llm.generate(["SELECT"], _greedy(), [crash])[0]
        # the server's failure, not the client's (HTTP 500, not 400: cluster.api.ERROR_STATUS)
        assert isinstance(failed.error, LoadWorkerLostError) and not isinstance(failed.error, InvalidRequestError)
        assert "died twice" in str(failed.error) and failed.outputs[0].finish_reason == "error"
        assert loader.pools_started == 3  # one per death: the next load finds a fresh pool
        got = llm.generate(prompts, _greedy(), good + [None])
        assert [o.error for o in got] == [None] * 3 and [o.outputs[0].token_ids for o in got] == want
        assert loader.pools_started == 3
    finally:
        llm.shutdown()


@pytest.mark.gpu  # the CUDA default (bench/RESULTS.md)
def test_the_default_engine_on_a_cuda_host_loads_in_processes(demo, loras):
    """On CUDA, with the cores and /dev/shm room, adapters load in worker processes writing into the shared
    pinned pool; the tokens equal those of loads on threads."""
    kwargs = dict(_KW, device="cuda")
    sql = loras["demo-sql"]
    want = LLM(str(demo.model_dir), lora_load_processes=0, **kwargs).generate(["SELECT"], _greedy(), [sql])
    llm = LLM(str(demo.model_dir), **kwargs)
    try:
        runner = llm.engine.executor.runner
        assert runner.loads.process_loader is not None and runner.lora_manager.host_pool.shared
        assert runner.loads.process_loader.workers == load_processes_for(None, torch.device("cuda")) > 0
        got = llm.generate(["SELECT"], _greedy(), [sql])
        assert got[0].outputs[0].token_ids == want[0].outputs[0].token_ids
    finally:
        llm.shutdown()
