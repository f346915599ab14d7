"""How much adapter loads slow the engine's own steps: loads on threads vs in a worker process (issue 3).

The engine thread and the threads that load adapters share the GIL: every torch
call of a step releases it, and taking it back waits for the loaders' Python,
up to the interpreter's switch interval (replicas/gil.py). This runs a small
engine's decode steps (the tiny model, one torch thread, so the measurement is
the GIL and not core oversubscription) under back-to-back loads of
Llama-3-8B-shaped adapters, several ways side by side:
  idle        no loads
  thread      the engine's loader threads (replicas/adapter_loads.py: two of
              them, read + check + lay out) with Python's switch interval
  thread-<us> the same with the interval lowered to <us> microseconds while a
              load runs (EngineArgs.lora_load_switch_interval)
  process     the same loads in a worker process (replicas.lora_load_process),
              the engine's process only copying each finished slab once
Modes alternate over --rounds rounds (machine noise spreads over all of them);
it prints the step time p50 / p90 over all rounds, its ratio to idle, and the
loads per second; and, for the thread modes, what one load takes on a thread
while another thread runs Python non-stop (load_beside_python: the GIL's other
direction, the engine's host loop holding off a load, which a request for a new
adapter waits for).

    python bench/load_contention.py [--rank 16] [--steps 100] [--rounds 3] [--intervals-us 1000 200 50]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine_workload import LLAMA3_8B, PROJECTIONS, TINY, AdapterPools, write_model_dir  # noqa: E402
from lora_core.config import LoRAConfig  # noqa: E402
from lora_core.host_adapter import AdapterPreparer  # noqa: E402
from lora_core.model_manager import LoRAModelManager  # noqa: E402
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind  # noqa: E402
from replicas.adapter_loads import AdapterLoads  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402
from replicas.lora_load_process import ProcessAdapterLoader  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402


def llama_specs(shape: dict) -> list[LoRAModuleSpec]:
    """The LoRA module specs of a Llama of this shape (what lora_module_specs reads off a built model)."""
    h, i, layers = shape["hidden_size"], shape["intermediate_size"], shape["num_hidden_layers"]
    kv = h // shape["num_attention_heads"] * shape["num_key_value_heads"]
    specs = []
    for n in range(layers):
        p = f"model.layers.{n}"
        specs += [LoRAModuleSpec(f"{p}.self_attn.qkv_proj", LoRAKind.LINEAR, h, (h, kv, kv),
                                 ("q_proj", "k_proj", "v_proj"), ShardKind.COLUMN),
                  LoRAModuleSpec(f"{p}.self_attn.o_proj", LoRAKind.LINEAR, h, (h,), ("o_proj",), ShardKind.ROW),
                  LoRAModuleSpec(f"{p}.mlp.gate_up_proj", LoRAKind.LINEAR, h, (i, i), ("gate_proj", "up_proj"),
                                 ShardKind.COLUMN),
                  LoRAModuleSpec(f"{p}.mlp.down_proj", LoRAKind.LINEAR, i, (h,), ("down_proj",), ShardKind.ROW)]
    return specs


def load_beside_python(load, requests, seconds: float) -> float:
    """ms per load, loads back to back on this thread, while another thread runs Python without a pause (as an
    engine's host loop between its torch calls): each time a load takes the GIL back it may wait a switch
    interval for that thread to let go."""
    stop = threading.Event()

    def spin() -> None:
        n = 0
        while not stop.is_set():
            n += 1

    spinner = threading.Thread(target=spin, daemon=True)
    spinner.start()
    done, t0 = 0, time.perf_counter()
    try:
        while time.perf_counter() - t0 < seconds or done == 0:
            load(requests[done % len(requests)])
            done += 1
    finally:
        stop.set()
        spinner.join()
    return 1e3 * (time.perf_counter() - t0) / done


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=100, help="engine steps per mode and round")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--intervals-us", type=float, nargs="*", default=[1000, 200, 50],
                   help="lowered switch intervals to run beside Python's own")
    p.add_argument("--beside-python-s", type=float, default=3.0,
                   help="per thread mode: seconds of loads beside a thread running Python (0: skip)")
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lorafleet-contention-"))
    dtype = torch.bfloat16
    requests = AdapterPools(work / "lora", LLAMA3_8B, dtype, num_files=1).pool("c", a.rank, 64)
    specs = llama_specs(LLAMA3_8B)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=a.rank, max_cpu_loras=8)
    manager = LoRAModelManager(specs, cfg, device="cpu", dtype=dtype)
    preparer = AdapterPreparer({s.name: s for s in specs}, cfg, dtype)
    expected = list(PROJECTIONS)

    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(model=str(write_model_dir(work / "model", TINY)), dtype="float32", device="cpu",
                                  max_num_seqs=16, num_kv_blocks=4000, load_format="dummy",
                                  enable_prefix_caching=False))
    params = SamplingParams(max_tokens=a.steps + 10, ignore_eos=True, temperature=0.0)
    batches = iter(range(1_000_000))

    def fresh_batch() -> None:
        # Every (mode, round) decodes a new batch from the same lengths: a batch that ran on would reach the
        # model's context limit and finish, leaving later modes empty steps.
        for request_id in list(engine.scheduler.requests):
            engine.abort(request_id)
        batch = next(batches)
        for k in range(8):
            engine.add_request(f"b{batch}-{k}", {"prompt_token_ids": list(range(5, 25))}, params)
        for _ in range(5):
            engine.step()

    def on_threads(interval_s: float):
        # the engine's own path: AdapterLoads.load_prepared (structures kept, the interval lowered per load)
        # (no switch_interval argument for Python's own, so that this script also runs on trees before it)
        loads = AdapterLoads(manager, cfg, specs, **({"switch_interval": interval_s} if interval_s else {}))
        return AdapterLoads.threads_for(0), loads.load_prepared

    procs = ProcessAdapterLoader(1, preparer, expected, cfg, specs, adopt=None)

    def in_process(request):
        return procs.load(request)[1].copy(pin_memory=False)  # the serving process's one copy (pinned on GPU)

    procs.load(requests[0])  # the worker has imported torch and is warm
    modes = {"idle": (0, None), "thread": on_threads(0.0)}
    modes.update({f"thread-{us:g}": on_threads(us * 1e-6) for us in a.intervals_us})
    modes["process"] = (1, in_process)
    beside = {mode: load_beside_python(load, requests, a.beside_python_s)
              for mode, (threads, load) in modes.items() if mode.startswith("thread") and a.beside_python_s > 0}
    times: dict[str, list[float]] = {mode: [] for mode in modes}
    rates: dict[str, list[float]] = {mode: [] for mode in modes}
    for round_ in range(a.rounds):
        for mode, (threads, load) in modes.items():
            fresh_batch()
            stop, loads_done = threading.Event(), [0]

            def loop(load=load, stop=stop, loads_done=loads_done):
                torch.set_num_threads(1)  # as the engine's loader threads
                while not stop.is_set():
                    load(requests[loads_done[0] % len(requests)])
                    loads_done[0] += 1

            workers = [threading.Thread(target=loop, daemon=True) for _ in range(threads)]
            for worker in workers:
                worker.start()
            if workers:
                time.sleep(0.5)
            t0, done = time.perf_counter(), loads_done[0]
            for _ in range(a.steps):
                start = time.perf_counter()
                engine.step()
                times[mode].append(time.perf_counter() - start)
            rates[mode].append((loads_done[0] - done) / (time.perf_counter() - t0))
            if len(engine.scheduler.requests) != 8:
                raise SystemExit(f"{mode}: the batch finished before its steps were timed")
            stop.set()
            for worker in workers:
                worker.join()
        print(f"# round {round_ + 1} of {a.rounds} done", flush=True)
    procs.shutdown()

    def pct(values: list[float], q: float) -> float:
        values = sorted(values)
        return 1e3 * values[min(len(values) - 1, int(q * len(values)))]

    idle = pct(times["idle"], 0.5)
    print(f"\ntiny engine, 8 sequences, 1 torch thread; loads: Llama-3-8B shape, rank {a.rank}, bf16; "
          f"Python's switch interval {sys.getswitchinterval() * 1e3:g} ms; {a.rounds} rounds of {a.steps} steps")
    print("mode          step p50 ms  step p90 ms  x idle  loads/s  ms a load beside Python")
    for mode in modes:
        p50 = pct(times[mode], 0.5)
        line = (f"{mode:13} {p50:12.2f} {pct(times[mode], 0.9):12.2f} {p50 / idle:7.2f} "
                f"{sum(rates[mode]) / len(rates[mode]):8.1f}")
        print(line + (f"  {beside[mode]:10.0f}" if mode in beside else ""))


if __name__ == "__main__":
    main()
