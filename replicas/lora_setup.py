"""build_lora: one rank's LoRA machinery for a loaded model, from the runner's settings.

The LoRAModelManager (GPU slots, the host LRU on its pinned pool), the PunicaWrapper and its kernel paths
(stacked A rows, one-launch LoRA linears, expands left to the next op), the model's LoRA layers, the merger of
a hot adapter and the background adapter loads, each sized from RunnerConfig's LoRA fields, which EngineArgs
documents. Built before the KV cache, so the memory budget sees the slots as used.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

from lora_core.adapter_fit import AdapterFit
from lora_core.config import LoRAConfig
from lora_core.model_manager import LoRAModelManager
from lora_core.pinned_pool import physical_memory_bytes
from lora_core.punica import PunicaWrapper
from lora_core.stacked_a import max_idle_slots
from replicas.adapter_loads import AdapterLoads, load_processes_for, load_processes_with_pool
from replicas.fp8_lora import FP8ARows
from replicas.lora_layers import (add_lora, fused_max_adapters, lora_module_specs, pending_max_tokens,
                                  stack_lora_weights, stacked_max_tokens)
from replicas.lora_merge import LoRAMerger, merger_for
from replicas.parallel import ParallelContext

if TYPE_CHECKING:
    from replicas.model_runner import RunnerConfig


@dataclass
class LoRAStack:
    manager: LoRAModelManager
    punica: PunicaWrapper
    merger: LoRAMerger | None  # None where merging is off
    loads: AdapterLoads


def build_lora(model: torch.nn.Module, cfg: "RunnerConfig", ctx: ParallelContext, device: torch.device,
               dtype: torch.dtype, quantized: bool = False) -> LoRAStack:
    """Add LoRA to model's linear layers (cfg.lora_config set) and build what serves adapters on this rank.
    quantized: the linear layers' weights are FP8 (no merging; the stacked path only when asked for, with FP8
    copies of the A rows: replicas/fp8_lora.py)."""
    lora_config = cfg.lora_config
    specs = lora_module_specs(model)
    stacked_tokens = stacked_max_tokens(cfg.lora_stacked_max_tokens, lora_config, device, ctx.tp_size, dtype,
                                        quantized)
    stacked = stack_lora_weights(model, specs, lora_config) if stacked_tokens else {}
    # over FP8 weights the stacked rows are FP8 copies of the manager's own A slots (FP8ARows)
    stacked_a = {name: s.a_rows for name, s in stacked.items()} if stacked and not quantized else None
    # Every adapter alive at once: the host LRU's, one per load in flight, one kept for room (AdapterLoads).
    processes = load_processes_for(cfg.lora_load_processes, device)
    blocks = lora_config.max_cpu_loras + AdapterLoads.threads_for(processes) + 1
    # Pinned memory is never paged out: the TP ranks' pools (one host) take at most a quarter of it.
    host = physical_memory_bytes()
    manager = LoRAModelManager(specs, lora_config, device, dtype, ctx.tp_rank, ctx.tp_size,
                               host_pool_blocks=blocks if cfg.lora_host_pool else 0,
                               host_pool_max_bytes=host // 4 // ctx.tp_size if host else None,
                               stacked_a=stacked_a,
                               host_pool_shared=processes > 0,
                               compact_slots=bool(stacked) and cfg.lora_compact_slots)
    if quantized and stacked:
        manager.on_slot_write = FP8ARows(manager, stacked)
    device_name = torch.cuda.get_device_name(device) if device.type == "cuda" else ""
    # LM-head rows: a step's sampled rows, and the rows that give prompt logprobs (up to every token's)
    punica = PunicaWrapper(cfg.max_num_batched_tokens, lora_config.max_loras, device,
                           max_num_prompts=cfg.max_num_seqs + cfg.max_num_batched_tokens,
                           stacked_max_tokens=stacked_tokens,
                           stacked_max_idle_slots=max_idle_slots(lora_config.max_lora_rank),
                           fused_max_adapters=fused_max_adapters(cfg.lora_fused_max_adapters, stacked_tokens,
                                                                 lora_config.max_lora_rank, device_name, quantized),
                           pending_max_tokens=pending_max_tokens(cfg.lora_pending_max_tokens, stacked_tokens,
                                                                 lora_config.max_lora_rank),
                           pending_min_adapters=cfg.lora_pending_min_adapters)
    add_lora(model, manager, punica, lora_config, stacked)
    # A merge's undo lives in the memory the KV budget leaves (lora_merge.py)
    merger = merger_for(model, manager, cfg.lora_merge_steps, ctx, device, quantized)
    processes = load_processes_with_pool(cfg.lora_load_processes, processes, manager.host_pool)
    loads = AdapterLoads(manager, lora_config, specs, processes, pin=device.type == "cuda",
                         switch_interval=cfg.lora_load_switch_interval)
    return LoRAStack(manager, punica, merger, loads)


def served_adapter_fit(model: str, lora_config: LoRAConfig) -> AdapterFit:
    """What an adapter must fit to be served on the model in directory ``model`` under ``lora_config``: the
    layers build_lora wraps, read off the model built on the meta device (no weights read, no memory taken),
    so a server without the model loaded (an ingress) checks adapters as its replicas' engines will."""
    from replicas.model_config import ModelConfig
    from replicas.models import model_class

    config = ModelConfig.from_pretrained(model, device="meta")
    with torch.device("meta"):
        specs = lora_module_specs(model_class(config)(config, None, None))
    return AdapterFit.of(specs, lora_config)
