"""A 10x flood from one adapter beside a light one: the light adapter's p99 TTFT beside the flood over its p99 TTFT
alone, under scheduling_policy "fcfs" and "fair" (replicas/fairness.py), side by side in one run.

Prints the ratio in engine steps (the policy's own effect: how many steps the light request waits) and in
seconds, and beside the seconds the bound no admission order can beat while the flood's admitted work shares
the light request's first step: alone-TTFT x (the mean step time beside the flood / the mean step time alone).
On a CPU a step's time grows with its tokens, so the seconds ratio sits near that bound; on a GPU, where a
small step costs about what a full one does, seconds follow steps.

    python3 bench/fairness.py                 # CUDA if there is one, else the CPU
    python3 bench/fairness.py --device cpu --flood 40 --budget 128
"""

from __future__ import annotations

import argparse
import gc
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from lora_core.request import LoRARequest  # noqa: E402
from replicas.demo_checkpoint import ensure_demo_checkpoint  # noqa: E402
from replicas.llm import LLM  # noqa: E402
from replicas.sampling_params import SamplingParams  # noqa: E402

LIGHT_AT = (2, 6, 10, 14)  # the steps the four light requests arrive at


def run(engine, flood_lora, light_lora, flood: int, prompt_ids: list[int]) -> tuple[list, list, float]:
    """(light TTFTs in steps, in seconds, mean step seconds) with `flood` flood requests at step 0."""
    for i in range(flood):
        engine.add_request(f"flood{i}", {"prompt_token_ids": prompt_ids},
                           SamplingParams(max_tokens=16, temperature=0, ignore_eos=True), flood_lora)
    sent, first, n, step_s = {}, {}, 0, []
    while engine.has_unfinished_requests() or len(sent) < len(LIGHT_AT):
        if n in LIGHT_AT:
            rid = f"light{len(sent)}"
            engine.add_request(rid, {"prompt_token_ids": prompt_ids[:12]},
                               SamplingParams(max_tokens=4, temperature=0, ignore_eos=True), light_lora)
            sent[rid] = (n, time.perf_counter())
        start = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - start)
        for out in outs:
            if out.request_id in sent and out.request_id not in first and out.outputs[0].token_ids:
                first[out.request_id] = (n, time.perf_counter())
        n += 1
    steps = [first[r][0] - sent[r][0] + 1 for r in sent]
    seconds = [first[r][1] - sent[r][1] for r in sent]
    return steps, seconds, float(np.mean(step_s))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default=None)
    p.add_argument("--flood", type=int, default=40)
    p.add_argument("--budget", type=int, default=128, help="max_num_batched_tokens")
    p.add_argument("--repeats", type=int, default=3, help="runs of each case; the median ratio is printed")
    args = p.parse_args()
    import torch

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    demo = ensure_demo_checkpoint()
    flood_lora = LoRARequest("demo-sql", 1, str(demo.adapters["demo-sql"]))
    light_lora = LoRARequest("demo-chat", 2, str(demo.adapters["demo-chat"]))
    print(f"device {device}{' ' + torch.cuda.get_device_name() if device == 'cuda' else ''}, flood {args.flood} "
          f"x 96-token prompts, token budget {args.budget}")
    print(f"{'policy':7} {'p99 steps alone':>16} {'flood':>6} {'ratio':>6} | {'p99 s alone':>11} {'flood':>7} "
          f"{'ratio':>6} {'bound':>6}")
    for policy in ("fcfs", "fair"):
        llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32",
                  device=device, scheduling_policy=policy, max_num_batched_tokens=args.budget,
                  enable_prefix_caching=False, kv_cache_memory_bytes=1 << 30)  # the demo needs little; a
        # fixed budget also keeps the second engine's from depending on what the first one left allocated
        for lora in (flood_lora, light_lora):
            llm.engine.add_lora(lora)
        prompt_ids = llm.engine.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 30)[:96]
        run(llm.engine, flood_lora, light_lora, 0, prompt_ids)  # warm-up: kernels, graphs
        rows = []
        for _ in range(args.repeats):
            a_steps, a_s, a_step = run(llm.engine, flood_lora, light_lora, 0, prompt_ids)
            f_steps, f_s, f_step = run(llm.engine, flood_lora, light_lora, args.flood, prompt_ids)
            a99, f99 = np.percentile(a_s, 99), np.percentile(f_s, 99)
            rows.append((np.percentile(a_steps, 99), np.percentile(f_steps, 99), a99, f99, f_step / a_step))
        a_st, f_st, a99, f99, step_ratio = np.median(np.array(rows), axis=0)
        print(f"{policy:7} {a_st:16.1f} {f_st:6.1f} {f_st / a_st:6.2f} | {a99:11.4f} {f99:7.4f} {f99 / a99:6.2f} "
              f"{step_ratio:6.2f}")
        llm.shutdown()
        del llm
        gc.collect()
        if device == "cuda":
            torch.cuda.empty_cache()
    print("ratio: beside the flood over alone (target <= 2 under fair); bound: the flood's mean step time over the "
          "light run's alone, what the seconds ratio cannot go below once the light request shares steps")


if __name__ == "__main__":
    main()
