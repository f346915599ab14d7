"""EngineArgs: every setting of an LLMEngine, as vLLM's users know them (docs/engine.md lists them)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from lora_core.config import LoRAConfig
from replicas.attention import kv_cache_dtype
from replicas.quantization import check_method
from replicas.scheduler import POLICIES, SchedulerConfig


CUDAGRAPH_MODES = ("full_and_piecewise", "full_decode_only", "none")


@dataclass
class EngineArgs:
    model: str
    tensor_parallel_size: int = 1
    dtype: str = "auto"
    quantization: str | None = None  # "fp8": linear layers' weights in FP8, per-token FP8 inputs (quantization.py)
    kv_cache_dtype: str = "auto"  # "fp8": K and V in float8 e4m3, half the cache's bytes (replicas/attention.py)
    device: str | None = None  # default: cuda when available
    enable_lora: bool = False
    max_loras: int = 4
    max_lora_rank: int = 16
    max_cpu_loras: int | None = None
    fully_sharded_loras: bool = False
    block_size: int = 16
    num_kv_blocks: int | None = None  # fixed block count; else sized from the memory budget below
    kv_cache_memory_bytes: int | None = None  # KV-cache budget per rank (default: 1 GiB on CPU)
    gpu_memory_utilization: float = 0.9  # GPU, no budget given: share of the memory left after weights
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int | None = None
    enable_prefix_caching: bool = True
    # "fcfs": requests in arrival order; "priority": by each request's priority (lower first), then arrival, and
    # preemption takes the least urgent running one (replicas/scheduler.py), as vLLM's scheduling_policy.
    # "fair": tenants (a request's tenant key, else its adapter) take turns by the weighted tokens each was served,
    # the Virtual Token Counter (replicas/fairness.py): one tenant's flood cannot starve the others.
    scheduling_policy: str = "fcfs"
    fair_prompt_weight: float = 1.0  # "fair": what a computed prompt token counts against its tenant's share
    fair_output_weight: float = 2.0  # "fair": what an output token counts (the paper's 2 to 1)
    load_format: str = "auto"  # "dummy": random weights (benchmarks)
    # The noise of requests that give no seed, as vLLM's --seed: set, the same requests met in the same steps
    # draw the same tokens run after run; None: fresh bits from the OS.
    seed: int | None = None
    distributed_executor_backend: str | None = None  # "mp" (default) or "module:Class", e.g. the Ray executor
    enforce_eager: bool = False  # GPU: no CUDA graphs at all (slower; for debugging)
    # As vLLM's compilation_config.cudagraph_mode: "full_and_piecewise" (default) replays decode steps
    # from whole-step graphs and steps with prompt tokens piece by piece between their attentions;
    # "full_decode_only" runs the latter eagerly; "none" is enforce_eager.
    cudagraph_mode: str = "full_and_piecewise"
    # GPU warm-up compiles Triton's kernel variants in this many spawned processes before it launches them
    # (replicas/triton_compile.py): a fresh node's cold start. None: as many as the cores (at most 16, split
    # over TP ranks) when Triton's disk cache is empty, else 0 (each variant compiled, or loaded from the
    # cache, at its first launch).
    compile_workers: int | None = None
    # Adapter loads in this many worker processes instead of two threads, so they share no GIL with the
    # engine (replicas/lora_load_process.py; spawned without re-running your script: replicas/spawn.py).
    # None: 4 on CUDA hosts with 16+ cores (fewer with fewer) where the host pool can be shared (on Linux
    # always: lora_core/shared_region.py), else 0 (threads) (replicas/adapter_loads.load_processes_for).
    lora_load_processes: int | None = None
    # While adapter loads run on loader threads (lora_load_processes 0), the interpreter's GIL switch interval
    # is at most this many seconds (sys.setswitchinterval; Python's own is 5 ms): how long a step's host work
    # may wait for a loader's Python to let go of the GIL (replicas/gil.py). 0: leave it as it is.
    lora_load_switch_interval: float = 2e-4
    # Host memory for max_cpu_loras adapters (plus loads in flight), each sized for max_lora_rank, pinned at
    # start-up (lora_core/pinned_pool.py), so serving never pins memory; False pins per adapter as it arrives.
    lora_host_pool: bool = True
    # Launch each step before the previous one's tokens are read back (replicas/engine.py docstring). None: on for
    # CUDA. Needs an executor that takes tokens on the device (all of ours do; with TP rank 0 sends
    # them to the others). On CPU the model runs synchronously, so it only delays outputs by a step
    # (tests force it on).
    async_scheduling: bool | None = None
    # After this many consecutive steps in which every row uses one adapter (more after merges that did not
    # pay for themselves), that adapter runs merged into the base weights until a step needs another
    # (replicas/lora_merge.py): such steps cost what base steps cost. Keeps the adapter's factors and a few
    # base values (~1.2 GiB for a rank-16 adapter on an 8B model) in the memory the KV cache leaves.
    # None: 8 on CUDA where adapters can merge, else 0 (never merge).
    lora_merge_steps: int | None = None
    # Steps of up to this many token rows compute the LoRA shrink in the base GEMMs, from A rows stacked
    # under the base weights (lora_core/stacked_a.py): one latency-bound kernel less per layer and
    # projection. None: 256 on CUDA, 0 (off) on CPU and with fully_sharded_loras under TP.
    lora_stacked_max_tokens: int | None = None
    # Stacked steps of up to 32 token rows whose adapters round up (to a power of four) to at most this many
    # run each LoRA linear in one launch: base GEMM, shrink and expand (lora_core/punica/lora_gemm.py; rank 16
    # slots). None: the device's measured bound (16 on an H100, 4 elsewhere: lora_layers.FUSED_MAX_ADAPTERS)
    # where the stacked path is on and max_lora_rank is 16, else 0 (off).
    lora_fused_max_adapters: int | None = None
    # Keep each step's adapters in the lowest GPU slots, moving one down (a device-to-device copy) when it sits
    # above what their count needs, so stacked steps read no idle slots' A rows (lora_core/model_manager.py).
    # Only stacked steps gain, so it is on only where the stacked path is.
    lora_compact_slots: bool = True
    # Stacked steps of up to lora_pending_max_tokens token rows over at least lora_pending_min_adapters adapters
    # (rounded up to a power of four, as CUDA graph keys hold them) leave gate_up_proj's LoRA expand to
    # SiluAndMul and qkv_proj's to the rotary kernel, which add it as they read their input: two launches less
    # per layer (lora_core/punica/pending.py).
    # None: 32 where the stacked path is on and max_lora_rank <= 64, else 0 (off) (lora_layers.pending_max_tokens);
    # SiluAndMul fuses slots of rank <= 16 only.
    lora_pending_max_tokens: int | None = None
    lora_pending_min_adapters: int = 5

    def __post_init__(self) -> None:
        if self.scheduling_policy not in POLICIES:
            raise ValueError(f"scheduling_policy must be one of {POLICIES}, got {self.scheduling_policy!r}")
        SchedulerConfig(fair_prompt_weight=self.fair_prompt_weight,  # bad weights raise here, before the model loads
                        fair_output_weight=self.fair_output_weight)
        if self.cudagraph_mode not in CUDAGRAPH_MODES:
            raise ValueError(f"cudagraph_mode must be one of {CUDAGRAPH_MODES}, got {self.cudagraph_mode!r}")
        if self.compile_workers is not None and self.compile_workers < 0:
            raise ValueError(f"compile_workers must be >= 0 (0: compile at first launch), got {self.compile_workers}")
        if self.lora_load_processes is not None and self.lora_load_processes < 0:
            raise ValueError(f"lora_load_processes must be >= 0 (0: loads on threads), got {self.lora_load_processes}")
        if self.lora_load_switch_interval < 0:
            raise ValueError(f"lora_load_switch_interval must be >= 0 seconds (0: leave Python's), "
                             f"got {self.lora_load_switch_interval}")
        if self.lora_merge_steps is not None and self.lora_merge_steps < 0:
            raise ValueError(f"lora_merge_steps must be >= 0 (0: never merge), got {self.lora_merge_steps}")
        if self.lora_stacked_max_tokens is not None and self.lora_stacked_max_tokens < 0:
            raise ValueError(f"lora_stacked_max_tokens must be >= 0 (0: off), got {self.lora_stacked_max_tokens}")
        if self.lora_fused_max_adapters is not None and self.lora_fused_max_adapters < 0:
            raise ValueError(f"lora_fused_max_adapters must be >= 0 (0: off), got {self.lora_fused_max_adapters}")
        if self.lora_pending_max_tokens is not None and self.lora_pending_max_tokens < 0:
            raise ValueError(f"lora_pending_max_tokens must be >= 0 (0: off), got {self.lora_pending_max_tokens}")
        if self.lora_pending_min_adapters < 1:
            raise ValueError(f"lora_pending_min_adapters must be >= 1, got {self.lora_pending_min_adapters}")
        check_method(self.quantization)
        kv_cache_dtype(self.kv_cache_dtype, torch.bfloat16)  # a bad name raises here, before anything starts
        if self.lora_merge_steps and not self.enable_lora:
            raise ValueError("lora_merge_steps merges adapters: it needs enable_lora=True")

    def lora_config(self) -> LoRAConfig | None:
        if not self.enable_lora:
            return None
        return LoRAConfig(max_loras=self.max_loras, max_lora_rank=self.max_lora_rank,
                          max_cpu_loras=self.max_cpu_loras, fully_sharded_loras=self.fully_sharded_loras)
