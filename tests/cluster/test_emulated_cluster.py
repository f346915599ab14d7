"""Emulated GPU replicas (cluster/simulator/emulated*.py, bench/emulated_cluster.py): the engine stand-in batches and
loads as SimReplica does and reports what the router reads; a small emulated cluster on real Ray Serve, with the
real router, tier and an S3 origin (SeaweedFS), answers every request, and its load counters agree with its
routing stats and the tier's fetches."""

from __future__ import annotations

import ast
import asyncio
import inspect
import sys
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def _init_fields(cls) -> set[str]:
    """The attributes `self.X = ...` (or `self.X: T = ...`) that cls.__init__ sets."""
    tree = ast.parse(inspect.getsource(cls.__init__).strip().replace("\n    ", "\n"))
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Assign):
            targets = node.targets
        else:
            targets = [node.target] if isinstance(node, ast.AnnAssign) else []
        out |= {t.attr for t in targets if isinstance(t, ast.Attribute) and isinstance(t.value, ast.Name)
                and t.value.id == "self"}
    return out


def test_the_emulated_server_and_replica_set_every_field_of_the_real_ones():
    """EmulatedReplica repeats LoRAReplica's __init__ with the emulated server: a field added to the real one must
    be added there too. EmulatedServer is LoRAServer with another engine and nothing else."""
    from cluster.deployments import LoRAReplica
    from cluster.server import LoRAServer
    from cluster.simulator.emulated_replica import EmulatedReplica, EmulatedServer

    have = _init_fields(EmulatedReplica) | {n for n, v in vars(EmulatedReplica).items() if isinstance(v, property)}
    assert _init_fields(LoRAReplica) - have == set(), _init_fields(LoRAReplica) - have
    # The server runs LoRAServer's own __init__: it overrides only the engine it builds.
    assert {n for n in vars(EmulatedServer) if not n.startswith("__")} == {"_make_engine"}
    assert "_make_engine" in vars(LoRAServer) and "self._make_engine(args)" in inspect.getsource(LoRAServer.__init__)


def test_the_emulated_engine_batches_loads_and_reports_as_the_replica_model():
    """Ten requests over five adapters on 2 slots and 3 host entries: every request gets its first token, then
    all its tokens; the host tier and the slots never exceed their capacity; what LoRAServer reads (slot ids,
    host ids, scheduler counts) matches the SimReplica underneath; a consumer that stops early aborts its request."""
    from cluster.simulator.emulated import EmulatedEngine, Emulation
    from lora_core.request import LoRARequest
    from replicas.demo_checkpoint import ensure_demo_checkpoint
    from replicas.engine_args import EngineArgs

    args = EngineArgs(model=str(ensure_demo_checkpoint().model_dir), enable_lora=True, max_loras=2, max_cpu_loras=3,
                      max_num_seqs=4, max_lora_rank=64)

    async def go():
        engine = EmulatedEngine(args, Emulation(time_factor=0.5))
        loras = [LoRARequest(f"a{i}#{i + 1}", i + 1, "/unused") for i in range(5)]
        for lora in loras:
            await engine.add_lora(lora)
        seen: list[tuple[int, int, bool]] = []
        peaks = Counter()

        async def one(i: int) -> None:
            async for out in engine.generate({"prompt_token_ids": [7] * 50}, {"max_tokens": 12}, f"r{i}",
                                             loras[i % 5]):
                seen.append((i, len(out.outputs[0].token_ids), out.finished))
                m = engine.engine.executor.runner.lora_manager
                peaks["slots"] = max(peaks["slots"], sum(x is not None for x in m.lora_index_to_id))
                peaks["host"] = max(peaks["host"], len(m.list_adapters()))
                peaks["running"] = max(peaks["running"], engine.engine.scheduler.num_running)

        async def abandoned() -> bool:
            stream = engine.generate({"prompt_token_ids": [7] * 50}, {"max_tokens": 500}, "gone", loras[0])
            await stream.__anext__()  # the first token, then the consumer leaves
            await stream.aclose()
            replica = engine.replica
            return all(r.req.output_tokens != 500 for r in (*replica.waiting, *replica.running))

        results = await asyncio.gather(*(one(i) for i in range(10)), abandoned())
        m = engine.engine.executor.runner.lora_manager
        ids = {lora.lora_int_id: lora.lora_name for lora in loras}
        state = dict(slots=[ids[i] for i in m.lora_index_to_id if i is not None],
                     host=[ids[i] for i in m.list_adapters()],
                     replica_slots=list(engine.replica.slots), replica_host=list(engine.replica.host),
                     counters=engine.counters(), aborted=results[-1])
        await engine.shutdown()
        return seen, peaks, state

    seen, peaks, state = asyncio.run(go())
    for i in range(10):
        assert [(n, done) for j, n, done in seen if j == i] == [(1, False), (12, True)], i
    assert peaks["slots"] <= 2 and peaks["host"] <= 3 and 1 <= peaks["running"] <= 4
    assert state["aborted"]
    assert state["slots"] == state["replica_slots"] and state["host"] == state["replica_host"]
    assert set(state["slots"]) <= set(state["host"])  # a host eviction frees the slot too
    counters = state["counters"]
    assert counters["host_loads"] >= 5 and counters["slot_loads"] >= 5  # five adapters, fewer places than that
    assert counters["steps"] > 0 and counters["events"] > 0


def test_a_small_emulated_cluster_answers_every_request_and_its_counters_agree(s3_server):
    """3 emulated replicas (2 slots, 3 host entries each) on real Ray Serve behind the real ingress and router, the
    shared tier over SeaweedFS: every request of a 30-request trace over 8 adapters is answered with all its tokens;
    the tier fetched each adapter from the origin once; per replica, the routing stats' slots and host adapters fit
    the engine's limits and its loads, and the adapter requests it counted add up to the trace's."""
    sys.path.insert(0, str(ROOT))
    from bench.emulated_cluster import EmulatedCluster, emulated_summary, run_emulated
    from cluster.simulator import WorkloadConfig, generate

    trace = generate(WorkloadConfig(duration_s=1.5, rate=20, num_adapters=8, prompt_median=64, output_median=24,
                                    seed=3))[:30]
    cluster = EmulatedCluster(replicas=3, engine=dict(max_loras=2, max_cpu_loras=3, max_num_seqs=8,
                                                      max_num_batched_tokens=4096),
                              emulation=dict(time_factor=2.0, max_ongoing=16), stats_period_s=0.5)
    run = run_emulated(trace, cluster, s3_server.endpoint_url, s3_server.env, log=lambda *_: None,
                       bucket="emulated-cluster-test")
    assert [r for r in run["results"] if r.get("error")] == []
    assert [r["tokens"] for r in run["results"]] == [r.output_tokens for r in trace]
    summary = emulated_summary(run, trace)
    assert summary["completed"] == len(trace) and summary["ttft_p50"] > 0 and summary["throughput"] > 0
    assert len(run["tier_actors"]) == 1  # the replicas used the tier made with the modeled origin

    distinct = {r.adapter for r in trace if r.adapter}
    assert run["origin_fetches"] == len(distinct)  # once per cluster, whatever the replicas did
    stats = run["stats"]
    assert len(stats) == 3
    events = Counter()
    for s in stats:
        gpu, host, em = s["gpu_adapters"], s["host_adapters"], s["emulated"]
        assert s["max_loras"] == 2 and len(gpu) + s["free_slots"] == 2
        assert set(gpu) <= set(host) and len(host) <= 3 and s["queue_len"] == 0
        assert em["host_loads"] >= s["adapter_events"].get("object_store", 0)  # a first load is a host load
        assert em["host_loads"] >= len(host) and em["slot_loads"] >= len(gpu)
        events.update(s["adapter_events"])
    assert sum(events.values()) == sum(1 for r in trace if r.adapter)  # one per adapter request: gpu, host or load
    assert events["object_store"] >= len(distinct)
    assert run["host_loads"] >= events["object_store"] and run["slot_loads"] >= len(distinct)


def test_ray_loader_emulation_downloads_once_per_replica_and_reads_its_disk_after():
    """Emulation.per_replica_origin (the simulator's PerReplicaDownload): three adapters through a host tier of two,
    in turn and then the first again: four host loads, three origin downloads (the fourth reads the disk)."""
    from cluster.simulator.emulated import EmulatedEngine, Emulation
    from lora_core.request import LoRARequest
    from replicas.demo_checkpoint import ensure_demo_checkpoint
    from replicas.engine_args import EngineArgs

    args = EngineArgs(model=str(ensure_demo_checkpoint().model_dir), enable_lora=True, max_loras=1, max_cpu_loras=2,
                      max_num_seqs=4, max_lora_rank=64)

    async def go(per_replica_origin: bool) -> dict:
        engine = EmulatedEngine(args, Emulation(time_factor=0.01, per_replica_origin=per_replica_origin))
        loras = [LoRARequest(f"a{i}#{i + 1}", i + 1, "/unused") for i in range(3)]
        for lora in loras:
            await engine.add_lora(lora)
        for k, i in enumerate((0, 1, 2, 0)):
            async for _ in engine.generate({"prompt_token_ids": [7] * 8}, {"max_tokens": 2}, f"r{k}", loras[i]):
                pass
        counters = engine.counters()
        await engine.shutdown()
        return counters

    ray_like, ours = asyncio.run(go(True)), asyncio.run(go(False))
    assert ray_like["host_loads"] == ours["host_loads"] == 4
    assert ray_like["origin_downloads"] == 3 and ours["origin_downloads"] == 0


def test_the_multiplexed_ingress_names_each_calls_adapter_as_its_model_id():
    """The Ray-routing ingress's handle wrapper (bench/emulated_cluster.py): an adapter request carries multiplexed_model_id = the adapter, a base
    model request an empty one; the caller's own options (stream) are kept, and other methods pass through."""
    sys.path.insert(0, str(ROOT))
    from bench.emulated_cluster import _MultiplexedCalls
    from cluster.server import GenerateRequest

    calls = []

    class Handle:
        def __init__(self, options=None):
            self.opts = options or {}

        def options(self, **kw):
            return Handle({**self.opts, **kw})

        @property
        def generate(self):
            handle = self

            class Method:
                @staticmethod
                def remote(request):
                    calls.append((handle.opts, request.model))
                    return "stream"

            return Method()

        models = "models-method"

    wrapped = _MultiplexedCalls(Handle(), "base")
    assert wrapped.options(stream=True).generate.remote(GenerateRequest("ad-1", {})) == "stream"
    wrapped.options(stream=True).generate.remote(GenerateRequest("base", {}))
    assert calls == [({"stream": True, "multiplexed_model_id": "ad-1"}, "ad-1"),
                     ({"stream": True, "multiplexed_model_id": ""}, "base")]
    assert wrapped.models == "models-method"
