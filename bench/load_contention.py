"""How much adapter loads slow the engine's own steps: loads on a thread vs in a worker process (issue 3).

The engine thread and a thread that loads adapters share the GIL: every torch
call of a step releases it, and taking it back waits for the loader's Python.
This runs a small engine's decode steps (the tiny model, one torch thread, so
the measurement is the GIL and not core oversubscription) three ways, side
by side:
  idle      no loads
  thread    a thread loads and lays out Llama-3-8B-shaped adapters back to back,
            as ModelRunner's loader threads do
  process   the same loads in a worker process (replicas.lora_load_process),
            the engine's process only copying each finished slab once
and prints the step time p50 / p90, its ratio to idle, and the loads per second.

    python bench/load_contention.py [--rank 16] [--steps 150]
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
from lora_core.lora_model import LoRAModel  # noqa: E402
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind  # noqa: E402
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


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--steps", type=int, default=150)
    a = p.parse_args(argv)
    work = Path(tempfile.mkdtemp(prefix="lorafleet-contention-"))
    dtype = torch.bfloat16
    requests = AdapterPools(work / "lora", LLAMA3_8B, dtype, num_files=1).pool("c", a.rank, 64)
    specs = llama_specs(LLAMA3_8B)
    cfg = LoRAConfig(max_loras=1, max_lora_rank=a.rank)
    preparer = AdapterPreparer({s.name: s for s in specs}, cfg, dtype)
    expected = list(PROJECTIONS)

    torch.set_num_threads(1)
    engine = LLMEngine(EngineArgs(model=str(write_model_dir(work / "model", TINY)), dtype="float32", device="cpu",
                                  max_num_seqs=16, num_kv_blocks=4000, load_format="dummy",
                                  enable_prefix_caching=False))
    params = SamplingParams(max_tokens=100_000, ignore_eos=True, temperature=0.0)
    for k in range(8):
        engine.add_request(f"r-{k}", {"prompt_token_ids": list(range(5, 25))}, params)
    for _ in range(5):
        engine.step()

    def on_thread(request):
        return preparer.prepare(LoRAModel.from_local_checkpoint(
            request.lora_path, expected, lora_model_id=request.lora_int_id, lora_config=cfg, module_specs=specs))

    procs = ProcessAdapterLoader(1, preparer, expected, cfg, specs, adopt=None)

    def in_process(request):
        return procs.load(request)[1].copy(pin_memory=False)  # the serving process's one copy (pinned on GPU)

    procs.load(requests[0])  # the worker has imported torch and is warm
    rows = []
    for mode, load in (("idle", None), ("thread", on_thread), ("process", in_process)):
        stop, loads = threading.Event(), [0]

        def loop(load=load, stop=stop, loads=loads):
            torch.set_num_threads(1)
            while not stop.is_set():
                load(requests[loads[0] % len(requests)])
                loads[0] += 1

        worker = threading.Thread(target=loop, daemon=True) if load else None
        if worker:
            worker.start()
            time.sleep(0.5)
        times, t0 = [], time.perf_counter()
        for _ in range(a.steps):
            start = time.perf_counter()
            engine.step()
            times.append(time.perf_counter() - start)
        wall = time.perf_counter() - t0
        stop.set()
        if worker:
            worker.join()
        times.sort()
        rows.append((mode, 1e3 * times[len(times) // 2], 1e3 * times[int(0.9 * len(times))], loads[0] / wall))
        print(f"# {mode} done", flush=True)
    procs.shutdown()
    idle = rows[0][1]
    print(f"\ntiny engine, 8 sequences, 1 torch thread; loads: Llama-3-8B shape, rank {a.rank}, bf16")
    print("mode       step p50 ms  step p90 ms  x idle  loads/s")
    for mode, p50, p90, rate in rows:
        print(f"{mode:8} {p50:12.2f} {p90:12.2f} {p50 / idle:7.2f} {rate:8.1f}")


if __name__ == "__main__":
    main()
