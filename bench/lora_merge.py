"""What running an adapter merged costs (replicas/lora_merge.py): one merge, one unmerge, the memory its undo holds.

Builds the engine benchmark's Llama-3-8B-shaped model (dummy bf16 weights) with
lora_merge_steps on, registers one adapter of --rank, and times merging it into
every linear weight and restoring them (CUDA events around each, median of
--repeat). A switch pays off after about (merge + unmerge) / (LoRA decode extra
per step) steps: bench/engine.py's one-r16 rows give the latter.

    python bench/lora_merge.py [--rank 16] [--repeat 5] [--tiny]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine_workload import LLAMA3_8B, TINY, AdapterPools, write_model_dir  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402


def _ms(fn) -> float:
    if not torch.cuda.is_available():
        t = time.perf_counter()
        fn()
        return 1e3 * (time.perf_counter() - t)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end)


def _sync() -> None:
    if torch.cuda.is_available():
        torch.cuda.synchronize()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--tiny", action="store_true", help="tiny model: runs on CPU in seconds")
    p.add_argument("--profile", action="store_true", help="then the top device ops of one merge and unmerge")
    a = p.parse_args()
    shape = TINY if a.tiny else LLAMA3_8B
    dtype = torch.bfloat16 if torch.cuda.is_available() else torch.float32
    work = Path(tempfile.mkdtemp())
    model_dir = write_model_dir(work / "model", shape)
    lora = AdapterPools(work / "lora", shape, dtype, 1).pool("p", a.rank, 1)[0]
    engine = LLMEngine(EngineArgs(model=str(model_dir), enable_lora=True, max_loras=4, max_lora_rank=a.rank,
                                  num_kv_blocks=256, load_format="dummy", lora_merge_steps=1))
    runner = engine.executor.runner
    runner.add_lora(lora)
    slot = runner.lora_manager.activate_adapter(lora.lora_int_id)
    merger = runner.merger
    weights = [w for w, _ in merger._layers]
    elements = sum(w.numel() for w in weights)
    copy_gib = sum(w.numel() * w.element_size() for w in weights) / 2**30
    before = [w.clone() for w in weights[::16]]  # a sample of the layers, to check the unmerges against
    merges, unmerges = [], []
    for _ in range(a.repeat):
        merges.append(_ms(lambda: merger.merge(lora.lora_int_id, slot)))
        undo_gib, kept = merger.backup_bytes() / 2**30, merger.fixups()
        unmerges.append(_ms(merger.unmerge))
    print(f"rank {a.rank}: merge {sorted(merges)[len(merges) // 2]:.2f} ms, unmerge "
          f"{sorted(unmerges)[len(unmerges) // 2]:.2f} ms (median of {a.repeat}); the undo {undo_gib:.3f} GiB "
          f"({kept / elements:.2%} of the elements' base values kept) against {copy_gib:.2f} GiB for a copy "
          f"of the linear weights; the sampled layers restored bit for bit after {a.repeat} switches: "
          f"{all(torch.equal(w.view(torch.uint8), b.view(torch.uint8)) for w, b in zip(weights[::16], before))}",
          flush=True)
    if a.profile:
        with torch.profiler.profile() as prof:
            merger.merge(lora.lora_int_id, slot)
            merger.unmerge()
            _sync()
        print(prof.key_averages().table(sort_by="self_device_time_total", row_limit=12))
    engine.shutdown()


if __name__ == "__main__":
    main()
