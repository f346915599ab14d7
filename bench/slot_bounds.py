"""How high a step's slots reach under Zipf traffic: the slot bound that stacked steps read A rows up to.

Stacked steps (lora_core/stacked_a.py) read the A rows of every slot below the step's highest one (rounded up
to a power of four), so a step's idle slots below it cost bytes, and past a limit the step runs the shrink
kernel instead. This replays a closed loop of requests with
Zipf(1.5)-popular adapters through LoRAModelManager.prepare_batch (CPU, tiny slots: the placement is all
that matters) and prints how often a step's bound is every slot, the activations, and the share of steps
whose idle slots below the bound stay within stacked_a.max_idle_slots at rank 64 ("r64 stacks"), for eviction
rules:
  lru              the manager's (least recently used evictable adapter)
  low-older-half   the lowest slot among the older half of the evictable adapters
  lowest           the lowest evictable slot
  compact          LRU, and the manager's compact_slots: a batch's adapters moved below its adapter bound

    python bench/slot_bounds.py [--adapters 100] [--slots 32] [--concurrency 32] [--steps 4000]
"""

from __future__ import annotations

import argparse
import os
import random
import sys
from typing import NamedTuple

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from lora_core.config import LoRAConfig  # noqa: E402
from lora_core.layer_weights import LoRALayerWeights  # noqa: E402
from lora_core.lora_model import LoRAModel  # noqa: E402
from lora_core.mapping import LoRAMapping  # noqa: E402
from lora_core.model_manager import LoRAModelManager  # noqa: E402
from lora_core.module_spec import LoRAKind, LoRAModuleSpec, ShardKind  # noqa: E402
from lora_core.punica.metadata import adapter_bound  # noqa: E402
from lora_core.stacked_a import max_idle_slots  # noqa: E402

MODULE = "model.layers.0.self_attn.o_proj"
RULES = ("lru", "low-older-half", "lowest", "compact")


class _Manager(LoRAModelManager):
    """The manager evicts the first adapter _gpu_evictable lists: reorder that list by the rule."""

    rule = "lru"

    def _gpu_evictable(self, exclude=None, running=None) -> list[int]:
        ids = super()._gpu_evictable(exclude, running)
        if self.rule in ("lru", "compact") or not ids:
            return ids
        pool = ids[:max(1, len(ids) // 2)] if self.rule == "low-older-half" else ids
        first = min(pool, key=lambda i: self._active[i])
        return [first] + [i for i in ids if i != first]


class Replay(NamedTuple):
    per_step: float  # adapters per step
    bound: float  # mean slot bound
    full: float  # share of steps bounded by every slot
    loads: int  # activations (adapters brought to the GPU)
    moves: int  # slot moves (compaction)
    stacks64: float  # share of steps within the rank-64 idle-slot limit


def run(rule: str, a: argparse.Namespace, seed: int) -> Replay:
    spec = LoRAModuleSpec(MODULE, LoRAKind.LINEAR, 8, (8,), ("o_proj",), ShardKind.ROW)
    cfg = LoRAConfig(max_loras=a.slots, max_lora_rank=4, max_cpu_loras=a.adapters)
    m = _Manager([spec], cfg, "cpu", torch.float32, compact_slots=rule == "compact")
    m.rule = rule
    for i in range(1, a.adapters + 1):
        m.add_adapter(LoRAModel(i, 4, {MODULE: LoRALayerWeights(module_name=MODULE, rank=4, lora_alpha=4.0,
                                                                   scaling=1.0, lora_a=torch.zeros(8, 4),
                                                                   lora_b=torch.zeros(4, 8))}))
    rng = random.Random(seed)
    weights = [1 / (k + 1) ** 1.5 for k in range(a.adapters)]

    def new_request() -> tuple[int, int]:  # (adapter, decode steps left), outputs uniform in [8, 80]
        return rng.choices(range(1, a.adapters + 1), weights=weights)[0], rng.randint(8, 80)

    reqs = [new_request() for _ in range(a.concurrency)]
    bounds, counts, loads = [], [], 0
    for _ in range(a.steps):
        ids = [lora for lora, _ in reqs]
        before = set(m.active_adapters())
        m.prepare_batch(LoRAMapping(ids, ids, False))
        loads += len(set(ids) - before)
        bounds.append(adapter_bound(max(m.slot_of(i) for i in ids) + 1, a.slots))
        counts.append(len(set(ids)))
        reqs = [(lora, n - 1) if n > 1 else new_request() for lora, n in reqs]
    n, idle = len(bounds), max_idle_slots(64)
    return Replay(sum(counts) / n, sum(bounds) / n, sum(b == a.slots for b in bounds) / n, loads, m.slot_moves,
                  sum(b - c <= idle for b, c in zip(bounds, counts)) / n)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--adapters", type=int, default=100)
    p.add_argument("--slots", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=32)
    p.add_argument("--steps", type=int, default=4000)
    p.add_argument("--seeds", type=int, default=2)
    a = p.parse_args()
    print(f"{'rule':16}{'seed':>5}{'adapters/step':>15}{'mean bound':>12}{'all slots':>11}{'activations':>13}"
          f"{'moves':>7}{'r64 stacks':>12}")
    for rule in RULES:
        for seed in range(a.seeds):
            r = run(rule, a, seed)
            print(f"{rule:16}{seed:>5}{r.per_step:>15.1f}{r.bound:>12.1f}{r.full:>11.0%}{r.loads:>13}{r.moves:>7}"
                  f"{r.stacks64:>12.0%}")


if __name__ == "__main__":
    main()
