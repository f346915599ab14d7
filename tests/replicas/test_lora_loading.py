"""Adapters named by requests load on a background thread while the engine keeps stepping."""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from lora_core.request import LoRARequest
from replicas.errors import InvalidRequestError
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from tests.timeouts import HANG_TIMEOUT_S


def _greedy(n=6):
    return SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)


@pytest.fixture
def gated(demo):
    """An engine whose adapter loads wait for gate.set(); counts loads per id."""
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu")
    runner = llm.engine.executor.runner
    gate, started, counts = threading.Event(), threading.Event(), {}
    load = runner.loads.load

    def slow(request):
        counts[request.lora_int_id] = counts.get(request.lora_int_id, 0) + 1
        started.set()
        assert gate.wait(HANG_TIMEOUT_S)
        return load(request)

    runner.loads.load = slow
    yield llm, gate, started, counts
    gate.set()


def test_a_load_does_not_stall_running_requests(gated, loras, demo):
    llm, gate, started, counts = gated
    engine = llm.engine
    engine.add_request("base", "The quick brown fox", _greedy(8))
    engine.step()
    sql = loras["demo-sql"]
    engine.add_request("a", "SELECT", _greedy(), sql)
    engine.add_request("b", "SELECT name", _greedy(), sql)  # same adapter: one load
    assert started.wait(HANG_TIMEOUT_S)
    steps = 0
    done = {}
    while "base" not in done:  # the base request finishes while the adapter is still loading
        done |= {o.request_id: o for o in engine.step() if o.finished}
        steps += 1
    assert steps >= 7 and "a" not in done and "b" not in done
    assert engine.has_unfinished_requests()
    gate.set()
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert counts == {sql.lora_int_id: 1}
    want = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32",
               device="cpu").generate(["SELECT", "SELECT name"], _greedy(), [sql, sql])
    assert [done[r].outputs[0].token_ids for r in ("a", "b")] == [w.outputs[0].token_ids for w in want]


def test_a_broken_adapter_fails_only_its_requests(demo, tmp_path):
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu")
    engine = llm.engine
    broken = LoRARequest("broken", 7, str(tmp_path))  # no adapter_config.json
    engine.add_request("ok", "Hello world", _greedy(4))
    engine.add_request("bad", "Hello", _greedy(4), broken)  # accepted: the load runs in the background
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["ok"].error is None and len(done["ok"].outputs[0].token_ids) == 4
    error = done["bad"].error
    assert isinstance(error, InvalidRequestError) and "adapter_config.json" in str(error)
    assert done["bad"].outputs[0].finish_reason == "error"
    assert [r.lora_name for r in engine.list_loras()] == []
    # the id is free again, and a good adapter under it works
    good = LoRARequest("good", 7, str(demo.adapters["demo-sql"]))
    assert llm.generate(["SELECT"], _greedy(3), [good])[0].error is None


def test_abort_while_the_adapter_loads(gated, loras):
    llm, gate, started, _ = gated
    engine = llm.engine
    engine.add_request("a", "SELECT", _greedy(), loras["demo-chat"])
    assert started.wait(HANG_TIMEOUT_S)
    assert engine.abort("a")
    outputs = engine.step()
    assert [(o.request_id, o.outputs[0].finish_reason) for o in outputs] == [("a", "abort")]
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert not engine.abort("a")


def test_a_request_id_in_use_is_refused_before_any_load(gated, loras):
    llm, gate, started, counts = gated
    engine = llm.engine
    engine.add_request("a", "SELECT", _greedy(), loras["demo-chat"])
    with pytest.raises(InvalidRequestError, match="already in use"):
        engine.add_request("a", "SELECT", _greedy(), loras["demo-sql"])
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert set(counts) == {loras["demo-chat"].lora_int_id}


def test_begin_add_lora_resolves_in_a_step(gated, loras, tmp_path):
    llm, gate, started, _ = gated
    engine = llm.engine
    engine.add_request("base", "Hello world", _greedy(3))
    loaded = engine.begin_add_lora(loras["demo-sql"])
    broken = engine.begin_add_lora(LoRARequest("broken", 9, str(tmp_path)))
    assert started.wait(HANG_TIMEOUT_S) and not loaded.done()
    engine.step()  # serving goes on while the adapter loads
    assert not loaded.done()
    gate.set()
    while engine.has_unfinished_requests():
        engine.step()
    assert loaded.result(timeout=0) is None
    assert "demo-sql" in [r.lora_name for r in engine.list_loras()]
    with pytest.raises(Exception, match="adapter_config.json"):
        broken.result(timeout=0)
    assert engine.begin_add_lora(loras["demo-sql"]).result(timeout=0) is None  # already registered


def test_a_load_that_ends_while_the_host_cache_is_busy_waits_for_room(demo, loras):
    """Host cache of 2, both entries used by running requests when a third adapter's load ends:
    the loaded adapter waits for room (no failure, no eviction of a running adapter)."""
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_cpu_loras=2, max_lora_rank=32,
              dtype="float32", device="cpu")
    engine = llm.engine
    engine.add_lora(loras["demo-sql"])
    engine.add_lora(loras["demo-chat"])
    engine.add_request("a", "SELECT", _greedy(6), loras["demo-sql"])
    engine.add_request("b", "Hello", _greedy(6), loras["demo-chat"])
    engine.step()
    engine.add_request("c", "Summary:", _greedy(3), loras["demo-summarize"])
    runner = engine.executor.runner
    runner.loads.future(loras["demo-summarize"].lora_int_id).result(timeout=HANG_TIMEOUT_S)  # loaded while a, b run
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert {r: (o.error, len(o.outputs[0].token_ids)) for r, o in done.items()} == \
        {"a": (None, 6), "b": (None, 6), "c": (None, 3)}


def test_an_adapter_the_host_cache_dropped_reloads_in_the_background(demo, loras):
    """With one host entry, using B evicts A; a later request for A is parked while A reloads, others run."""
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=1, max_cpu_loras=1, max_lora_rank=32,
              dtype="float32", device="cpu")
    engine, runner = llm.engine, llm.engine.executor.runner
    names = sorted(loras)
    a, b = loras[names[0]], loras[names[1]]
    want = llm.generate(["Hello there"], _greedy(), [a])[0].outputs[0].token_ids
    llm.generate(["Hello"], _greedy(2), [b])
    assert not runner.lora_in_host_cache(a.lora_int_id) and runner.lora_in_host_cache(b.lora_int_id)

    gate, load = threading.Event(), runner.loads.load
    runner.loads.load = lambda request: (gate.wait(HANG_TIMEOUT_S), load(request))[1]
    engine.add_request("base", "The quick brown fox", _greedy(8))
    engine.add_request("a", "Hello there", _greedy(), a)  # accepted at once: the reload is in the background
    assert a.lora_int_id in engine.adapters.loading and [r.lora_name for r in engine.list_loras()] == [a.lora_name,
                                                                                                 b.lora_name]
    done = {}
    while "base" not in done:  # the base request runs to the end while A reloads
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert "a" not in done
    gate.set()
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    assert done["a"].error is None and done["a"].outputs[0].token_ids == want
    assert runner.lora_in_host_cache(a.lora_int_id)


def test_loads_in_worker_processes_serve_the_same_and_fail_alike(demo, loras, tmp_path):
    """EngineArgs.lora_load_processes: adapters prepared in a spawned process, written into the shared host
    pool. On a GPU the pool is also pinned (registered with CUDA) and its blocks feed the slots' copies."""
    names = sorted(loras)
    lora_list = [loras[names[0]], None, loras[names[1]], loras[names[2]]]
    prompts = ["SELECT", "Hello", "Once upon a time", "The router"]
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32",
                  device="cuda" if torch.cuda.is_available() else "cpu")
    want = [o.outputs[0].token_ids for o in LLM(str(demo.model_dir), **kwargs).generate(prompts, _greedy(), lora_list)]
    llm = LLM(str(demo.model_dir), lora_load_processes=1, **kwargs)
    try:
        runner = llm.engine.executor.runner
        assert runner.lora_manager.host_pool.shared
        thread_loads = []
        runner.loads.load = lambda request: thread_loads.append(request) or pytest.fail("loaded on a thread")
        got = llm.generate(prompts, _greedy(), lora_list)
        assert [o.outputs[0].token_ids for o in got] == want and thread_loads == []
        out = llm.generate(["Hello"], _greedy(2), [LoRARequest("broken", 9, str(tmp_path))])[0]
        assert isinstance(out.error, InvalidRequestError) and "adapter_config.json" in str(out.error)
        assert out.outputs[0].finish_reason == "error"
    finally:
        llm.shutdown()


def test_an_adapter_from_a_process_is_adopted_whole(demo, loras):
    """On a GPU the engine copies a worker's shared-memory adapter into its pinned pool (adopt_shared):
    the copy must carry the slab and its ranks header intact, as if prepared in this process."""
    from replicas.lora_load_process import ProcessAdapterLoader

    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu")
    manager = llm.engine.executor.runner.lora_manager
    loads = llm.engine.executor.runner.loads
    request = loras[sorted(loras)[1]]
    procs = ProcessAdapterLoader(1, manager.preparer, loads.expected, loads.lora_config, loads.specs,
                                 adopt=manager.adopt_shared)
    try:
        rank, adopted = procs.load(request)
    finally:
        procs.shutdown()
    want = manager.prepare_adapter(loads.load(request))
    assert adopted.block is not None and not adopted.slab.is_shared()
    assert rank == want.rank and torch.equal(adopted.slab, want.slab) and torch.equal(adopted.ranks, want.ranks)
    assert adopted.ranks.untyped_storage().data_ptr() == adopted.slab.untyped_storage().data_ptr()
    assert int(adopted.ranks.max()) > 0  # a real header, not zeros


@pytest.mark.parametrize("processes", [1, 3])
def test_a_worker_writes_the_adapter_into_a_block_of_the_shared_pool(demo, loras, tmp_path, monkeypatch, processes):
    """With load processes the host pool is shared: a worker writes the adapter into a block the engine
    handed it (no slab of its own, no copy here), byte for byte what this process would prepare; the
    workers split every load by layer, each writing its layers, loads at once too. A bad adapter gives its
    typed error and its block back; with no free block the load takes the slab path."""
    import gc
    import json
    import shutil

    from lora_core.errors import InvalidAdapterError, NonFiniteWeightError
    from safetensors.torch import load_file, save_file

    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu",
              lora_load_processes=processes)
    try:
        runner = llm.engine.executor.runner
        loads, manager = runner.loads, runner.lora_manager
        pool = manager.host_pool
        assert pool.shared
        free = pool.free_blocks
        request = loras[sorted(loras)[1]]
        procs = loads.process_loader
        submitted, submit = [], procs._pool.submit
        procs._pool.submit = lambda fn, *args: submitted.append(args[2:]) or submit(fn, *args)
        rank, adapter = procs.load(request)
        assert submitted == ([(None,)] if processes == 1 else [((k, 3),) for k in range(3)])
        want = manager.prepare_adapter(loads.load(request))
        start = adapter.slab.data_ptr() - pool.region.data_ptr()
        assert adapter.block is not None and start == adapter.block.index * pool.block_bytes
        assert rank == want.rank and torch.equal(adapter.slab, want.slab) and torch.equal(adapter.ranks, want.ranks)
        assert pool.free_blocks == free - 2  # this one and the one prepared here
        bad = tmp_path / "bad"
        shutil.copytree(request.lora_path, bad)
        config = json.loads((bad / "adapter_config.json").read_text())
        (bad / "adapter_config.json").write_text(json.dumps(config | {"r": config["r"] + 1}))  # not its tensors'
        with pytest.raises(InvalidAdapterError, match="does not match r="):  # every tensor named at once
            loads.process_loader.load(LoRARequest("bad", 77, str(bad)))
        assert pool.free_blocks == free - 2
        nan = tmp_path / "nan"  # a NaN in the last layer: with parts, a part other than the first finds it
        shutil.copytree(request.lora_path, nan)
        tensors = load_file(str(nan / "adapter_model.safetensors"))
        key = max((k for k in tensors if "lora_B" in k), key=lambda k: int(k.split(".layers.")[1].split(".")[0]))
        tensors[key][0, 0] = float("nan")
        save_file(tensors, str(nan / "adapter_model.safetensors"))
        with pytest.raises(NonFiniteWeightError, match=key.replace(".", "[.]")):
            loads.process_loader.load(LoRARequest("nan", 78, str(nan)))
        assert pool.free_blocks == free - 2
        submitted.clear()
        with ThreadPoolExecutor(2) as threads:  # a load that arrives under another's parts splits all the same
            both = list(threads.map(procs.load, [request, request]))
        assert sorted(submitted) == sorted(([(None,)] if processes == 1 else [((k, 3),) for k in range(3)]) * 2)
        assert all(torch.equal(a.slab, want.slab) for _, a in both)
        del both
        gc.collect()
        monkeypatch.setattr(pool, "allocate", lambda nbytes: None)  # every block taken
        rank2, fallback = loads.process_loader.load(request)
        assert fallback.block is None and torch.equal(fallback.slab, want.slab)
        del adapter, want, fallback
        gc.collect()
        assert pool.free_blocks == free
    finally:
        llm.shutdown()


def test_every_load_process_gets_a_load_in_flight(monkeypatch):
    """With N worker processes, N loads run at once: each holds a loader thread while it waits."""
    from types import SimpleNamespace

    from lora_core.config import LoRAConfig
    from replicas import adapter_loads

    processes = 4
    together = threading.Barrier(processes, timeout=HANG_TIMEOUT_S)

    class FakeProcessLoader:  # what a pool of worker processes looks like from the loader threads
        def __init__(self, *args, **kwargs):
            pass

        def load(self, request):
            together.wait()  # breaks (BrokenBarrierError) unless all loads are in flight at once
            return request.lora_int_id, None

        def shutdown(self):
            pass

    monkeypatch.setattr(adapter_loads, "ProcessAdapterLoader", FakeProcessLoader)
    loads = adapter_loads.AdapterLoads(SimpleNamespace(preparer=None, host_pool=None), LoRAConfig(max_loras=2), [],
                                       processes)
    try:
        for i in range(1, processes + 1):
            loads.start(LoRARequest(f"a{i}", i, f"/adapters/a{i}"))
        got = sorted(loads.future(i).result(timeout=HANG_TIMEOUT_S)[0] for i in range(1, processes + 1))
        assert got == [1, 2, 3, 4]
    finally:
        loads.close()


def test_a_load_that_ends_under_a_step_joins_after_the_next_launch(demo, loras):
    """Asynchronous scheduling: a load that finished while a step was in flight is taken in after the next step
    is launched; its adapter is copied into a slot under that step (on a GPU, on the side stream) and its request
    runs in the step after, with the tokens a plain engine gives."""
    kwargs = dict(enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu")
    llm = LLM(str(demo.model_dir), async_scheduling=True, **kwargs)
    engine, runner = llm.engine, llm.engine.executor.runner
    sql = loras["demo-sql"]
    engine.add_request("base", "The quick brown fox", _greedy(12))
    engine.step()
    assert engine._in_flight is not None
    engine.add_request("a", "SELECT", _greedy(), sql)
    runner.loads.future(sql.lora_int_id).result(timeout=HANG_TIMEOUT_S)  # the load is over, a step is in flight
    engine.step()
    assert engine.scheduler.requests["a"].status.name == "WAITING"  # not in the step launched just now
    assert runner.lora_manager.slot_of(sql.lora_int_id) is not None  # but in a slot already
    engine.step()
    assert engine.scheduler.requests["a"].status.name == "RUNNING"
    done = {}
    while engine.has_unfinished_requests():
        done |= {o.request_id: o for o in engine.step() if o.finished}
    want = LLM(str(demo.model_dir), **kwargs).generate(["SELECT"], _greedy(), [sql])[0]
    assert done["a"].outputs[0].token_ids == want.outputs[0].token_ids
