"""ModelRunner: one rank's model, KV cache and LoRA slots; runs one step from host-side inputs.

The engine turns a SchedulerOutput into a StepInput (plain Python data, so it
can be sent to tensor-parallel worker processes); every rank runs the same
StepInput and returns the logits of the rows to sample (identical on all
ranks after the LM head's all-gather).
"""

from __future__ import annotations

import gc
from dataclasses import dataclass, field
from typing import Iterable

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import LoRACapacityError, UnknownLoRAError
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from lora_core.punica import PunicaWrapper
from lora_core.request import LoRARequest
import torch.distributed as dist

from replicas.adapter_loads import AdapterLoads
from replicas.attention import AttentionMetadata, allocate_kv_caches, kv_cache_block_bytes, kv_cache_dtype
from replicas.cuda_graphs import DecodeGraphs
from replicas.lora_merge import LoRAMerger
from replicas.lora_setup import build_lora
from replicas.model_config import ModelConfig
from replicas.models import dummy_model, load_model
from replicas.parallel import ParallelContext
from replicas.piecewise_graphs import PiecewiseGraphs
from replicas.quantization import link_fp8_norms, quantize_model
from replicas.warm_up import warm_up

# Evicting prefetch copies per step: an 8B rank-16 adapter's copy takes 2.2 ms of an H200's ~6.5 ms decode step,
# so two hide under it; more would make the next step wait.
PREFETCH_EVICTIONS = 2


@dataclass
class StepInput:
    """One step, as host data: sequences' new tokens laid end to end."""

    input_ids: list[int]
    positions: list[int]
    query_lens: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]
    sample_rows: list[int]  # row of the last new token of each sequence that samples
    token_lora_ids: list[int] = field(default_factory=list)  # one per token, 0 = base
    sample_lora_ids: list[int] = field(default_factory=list)  # one per sampled row
    is_prefill: bool = True
    # Async scheduling: input rows whose token the previous step sampled and the host has not read
    # back yet; execute() copies them on the device from that step's tokens (row fill_from[i]).
    fill_rows: list[int] = field(default_factory=list)
    fill_from: list[int] = field(default_factory=list)
    # Rows whose logits give prompt logprobs (replicas/prompt_logprobs.py), returned after the sampled rows'.
    prompt_logprob_rows: list[int] = field(default_factory=list)


@dataclass
class RunnerConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int | None = None  # fixed count; else sized from the budget below
    kv_cache_memory_bytes: int | None = None  # KV budget per rank; default: 1 GiB on CPU
    gpu_memory_utilization: float = 0.9  # on GPU with no budget: this share of the memory left after weights
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    lora_config: LoRAConfig | None = None
    load_format: str = "auto"  # "dummy": random weights, for benchmarks of model shapes with no checkpoint
    max_model_len: int | None = None  # default: the model's max_position_embeddings (sizes graph block tables)
    enforce_eager: bool = False  # on GPU, steps replay CUDA graphs unless this is set
    # Steps with prompt tokens: replayed from CUDA graphs piece by piece (replicas/piecewise_graphs.py)
    # on GPU; False runs them eagerly (decode steps keep their graphs).
    piecewise_graphs: bool = True
    compile_workers: int = 0  # GPU warm-up's Triton compiles in this many processes (triton_compile.py); 0: off
    lora_load_processes: int | None = None  # > 0: loads in worker processes (lora_load_process.py); None: 4 on CUDA
    lora_load_switch_interval: float = 2e-4  # GIL switch interval while loads run on threads (replicas/gil.py)
    lora_host_pool: bool = True  # host-tier adapters in blocks pinned at start-up (lora_core/pinned_pool.py)
    lora_merge_steps: int | None = None  # one adapter alone this long runs merged (lora_merge.py); None: 8 on CUDA
    # steps of up to this many token rows shrink in the base GEMMs (lora_core/stacked_a.py); None: 256 on CUDA
    lora_stacked_max_tokens: int | None = None
    lora_fused_max_adapters: int | None = None  # one launch per LoRA site for small steps; None: by device
    lora_compact_slots: bool = True  # each step's adapters in the lowest slots, with the stacked path
    lora_pending_max_tokens: int | None = None  # stacked steps up to this many rows fuse gate_up's expand into silu
    lora_pending_min_adapters: int = 5  # ... when their adapter bound is at least this
    quantization: str | None = None  # "fp8": the linear layers' weights in FP8 (replicas/quantization.py)
    kv_cache_dtype: str = "auto"  # "fp8": K and V stored in float8 e4m3 (replicas/attention.py)


class ModelRunner:
    def __init__(self, cfg: RunnerConfig, ctx: ParallelContext | None = None) -> None:
        self.cfg = cfg
        self.ctx = ctx or ParallelContext()
        self.device = torch.device(cfg.device)
        self.model_config = ModelConfig.from_pretrained(cfg.model, dtype=cfg.dtype, device=self.device)
        backend = None
        if self.device.type == "cuda":
            from replicas.kernels.paged_attention import triton_attention

            backend = triton_attention
        if cfg.load_format == "dummy":
            self.model = dummy_model(self.model_config, self.ctx, self.device, backend)
        else:
            self.model = load_model(cfg.model, self.model_config, self.ctx, self.device, attn_backend=backend)
        # FP8 weights: a checkpoint's as loaded, or quantized here (before LoRA wraps the layers, and before the
        # KV budget is measured)
        self.quantized = cfg.quantization is not None or self.model_config.fp8_checkpoint is not None
        self.kv_dtype = kv_cache_dtype(cfg.kv_cache_dtype, self.model_config.dtype)
        if cfg.quantization is not None and self.model_config.fp8_checkpoint is None:
            quantize_model(self.model, cfg.quantization, self.model_config.dtype, self.device)
        if self.quantized:  # the norms before FP8 layers quantize those layers' inputs as they write them
            link_fp8_norms(self.model)
        mc = self.model_config
        self.lora_manager: LoRAModelManager | None = None
        self.punica: PunicaWrapper | None = None
        self._lora_requests: dict[int, LoRARequest] = {}
        self.loads: AdapterLoads | None = None  # background adapter loads (start_lora_load)
        self.merger: LoRAMerger | None = None
        if cfg.lora_config is not None:  # slots first, so the KV budget sees their memory as used
            lora = build_lora(self.model, cfg, self.ctx, self.device, mc.dtype, self.quantized)
            self.lora_manager, self.punica, self.merger, self.loads = lora.manager, lora.punica, lora.merger, lora.loads
        self.num_blocks = self._num_kv_blocks()
        # One block more than the block manager hands out: padding rows of graph steps write there.
        self.kv_caches = allocate_kv_caches(mc.num_hidden_layers, self.num_blocks + 1, cfg.block_size,
                                            mc.num_local_kv_heads(self.ctx.tp_size), mc.head_dim, self.kv_dtype,
                                            self.device)
        graphs = self.device.type == "cuda" and not cfg.enforce_eager
        self.decode_graphs = self.build_decode_graphs(capture=True) if graphs else None
        self.piecewise = self.build_piecewise_graphs(capture=True) if graphs and cfg.piecewise_graphs else None
        # Prefetches copy adapters into slots on this stream, after _slots_settled: recorded once a step's own
        # slot writes are queued, it is passed when no earlier step can read a slot a prefetch evicts.
        self._side_stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._slots_settled = torch.cuda.Event() if self._side_stream is not None else None

    def _num_kv_blocks(self) -> int:
        """Blocks per rank: the fixed count, or the memory budget over one block's bytes (same on all ranks)."""
        cfg, mc = self.cfg, self.model_config
        if cfg.num_blocks is not None:
            return cfg.num_blocks
        per_block = kv_cache_block_bytes(mc.num_hidden_layers, cfg.block_size,
                                         mc.num_local_kv_heads(self.ctx.tp_size), mc.head_dim, self.kv_dtype)
        budget = cfg.kv_cache_memory_bytes
        if budget is None and self.device.type == "cuda":
            gc.collect()  # engines dropped earlier in this process give their memory back first
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info(self.device)
            budget = int(free - total * (1 - cfg.gpu_memory_utilization))
        elif budget is None:
            budget = 1 << 30
        blocks = torch.tensor([budget // per_block], dtype=torch.long, device=self.device)
        if self.ctx.tp_size > 1:  # ranks may see slightly different free memory
            dist.all_reduce(blocks, op=dist.ReduceOp.MIN, group=self.ctx.group)
        if int(blocks) < 2:
            raise ValueError(f"the KV-cache budget ({budget} bytes) holds no block of {per_block} bytes "
                             "(plus one for padding)")
        return int(blocks) - 1  # the padding block

    # ---- adapters -------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> int:
        """Load, validate and register an adapter in the host LRU; returns its rank."""
        self.start_lora_load(request)
        return self.finish_lora_load(request.lora_int_id)

    def start_lora_load(self, request: LoRARequest) -> None:
        """Read, validate and prepare an adapter (disk to pinned host memory) on a loader thread. Steps keep
        running meanwhile; finish_lora_load registers it. A second start for an id already loading is a no-op."""
        if self.lora_manager is None:
            raise UnknownLoRAError("this engine was started without enable_lora")
        self.loads.start(request)

    def close(self) -> None:
        """Stop the adapter loaders (threads and worker processes; loads in flight are dropped) and free the
        decode graphs: with tensor parallelism they hold NCCL collectives, so they go before the process group."""
        for graphs in (self.decode_graphs, self.piecewise):
            if graphs is not None:
                graphs.release()
        if self.loads is not None:
            self.loads.close()

    def lora_in_host_cache(self, lora_id: int) -> bool:
        """Whether the adapter is registered in host memory now (a step could use it without a load)."""
        return self.lora_manager is not None and lora_id in self.lora_manager.list_adapters()

    def lora_loads_done(self) -> list[int]:
        """Ids whose background load has finished (successfully or not), oldest first."""
        return self.loads.done() if self.loads is not None else []

    def finish_lora_load(self, lora_id: int, wait_for_room: bool = False) -> int | None:
        """Wait for the load of lora_id, register it and return its rank; raises the load's typed error.
        None: no room yet (AdapterLoads.finish explains wait_for_room)."""
        loaded = self.loads.finish(lora_id, wait_for_room)
        if loaded is None:
            return None
        request, rank = loaded
        self._lora_requests[lora_id] = request
        return rank

    def remove_lora(self, lora_id: int) -> bool:
        known = self._lora_requests.pop(lora_id, None) is not None
        if self.merger is not None:  # the id may come back with other weights
            self.merger.forget(lora_id)
        if self.lora_manager is not None and lora_id in self.lora_manager.list_adapters():
            # The engine removes only adapters no live request uses; the last step is over.
            self.lora_manager.set_running(())
            self.lora_manager.remove_adapter(lora_id)
        return known

    def pin_lora(self, lora_id: int) -> bool:
        self._ensure_registered([lora_id])
        return self.lora_manager.pin_adapter(lora_id)

    def lora_merge_state(self) -> tuple[int | None, int]:
        """(the adapter merged into the weights now or None, merges so far); (None, 0) with merging off."""
        return (self.merger.merged, self.merger.merges) if self.merger is not None else (None, 0)

    def list_loras(self) -> list[int]:
        return sorted(self._lora_requests)

    def _ensure_registered(self, ids) -> None:
        """Adapters the host LRU dropped are reloaded from their (already validated) path."""
        registered = set(self.lora_manager.list_adapters())
        # The previous step is over: only this step's adapters are protected from eviction now.
        self.lora_manager.set_running(i for i in ids if i in registered)
        for lora_id in ids:
            if lora_id and lora_id not in registered:
                self._register(lora_id)

    def _register(self, lora_id: int) -> None:
        if lora_id not in self._lora_requests:
            raise UnknownLoRAError(f"lora id {lora_id} was never added")
        self.lora_manager.add_adapter(self.loads.load(self._lora_requests[lora_id]))

    def prefetch_loras(self, ids: list[int], keep: Iterable[int] = ()) -> list[int]:
        """Copy adapters of waiting requests into slots, on the side stream on GPU, right after a step's launch
        so that the copies overlap it (the next step waits for them): a free slot, else the least recently used
        adapter's that neither the running step nor ``keep`` (running requests) nor ``ids`` uses, at most
        PREFETCH_EVICTIONS such per call. The copies first wait for _slots_settled. The ids now in a slot."""
        if self.lora_manager is None:
            return []
        manager, loaded, evictions = self.lora_manager, [], 0
        keep = frozenset(keep) | frozenset(ids)
        if self._side_stream is not None:
            self._side_stream.wait_event(self._slots_settled)
        for lora_id in ids:
            registered = lora_id in manager.list_adapters()
            if not registered or manager.slot_of(lora_id) is None:
                evicts = None not in manager.lora_index_to_id
                if evicts and evictions >= PREFETCH_EVICTIONS:
                    break
                if not registered:
                    if len(manager.list_adapters()) >= self.cfg.lora_config.max_cpu_loras:
                        break  # making room would evict from the host cache: leave that to the step
                    self._register(lora_id)
                try:
                    manager.activate_adapter(lora_id, stream=self._side_stream, keep=keep)
                except LoRACapacityError:  # every slot is in use or kept: the step will make room
                    break
                evictions += evicts
            loaded.append(lora_id)
        return loaded

    # ---- one step ---------------------------------------------------------------------------

    def build_decode_graphs(self, capture: bool) -> DecodeGraphs:
        """Static decode buffers over this runner's model; capture=False runs them eagerly (CPU tests)."""
        cfg, mc = self.cfg, self.model_config
        max_len = cfg.max_model_len or mc.max_position_embeddings
        # A decode step has a row per sequence, and no step more rows than the token budget
        max_batch = min(cfg.max_num_seqs, cfg.max_num_batched_tokens)
        return DecodeGraphs(self._forward, self.punica.launch_key if self.punica else lambda: None,
                            max_batch, -(-max_len // cfg.block_size), cfg.block_size, self.num_blocks,
                            mc.vocab_size, self.device, capture)

    def build_piecewise_graphs(self, capture: bool) -> PiecewiseGraphs:
        """Static buffers for steps with prompt tokens; capture=False runs the pieces eagerly (CPU tests)."""
        launch_key = self.punica.token_launch_key if self.punica else lambda: None
        return PiecewiseGraphs(self.model, self.kv_caches, launch_key, self.cfg.max_num_batched_tokens, self.device,
                               capture)

    def warm_up(self) -> int:
        """Compile the kernels and capture the graphs before traffic (replicas/warm_up.py); the graph count."""
        return warm_up(self)

    def _forward(self, input_ids: torch.Tensor, positions: torch.Tensor, meta: AttentionMetadata) -> torch.Tensor:
        """A decode step's model pass: every row is sampled. Logits in the model's dtype: DecodeGraphs copies
        them into its float32 buffer, converting as it copies (no float32 intermediate)."""
        return self.model.compute_logits(self.model(input_ids, positions, self.kv_caches, meta))

    def _graph_batch(self, step: StepInput) -> int | None:
        """The padded batch a pure decode step replays at; None: not a decode-graph step (piecewise or eager)."""
        n = len(step.input_ids)
        if self.decode_graphs is None or step.is_prefill or not n or len(step.query_lens) != n:
            return None
        if step.sample_rows != list(range(n)):
            return None
        return self.decode_graphs.padded_size(n)

    def _lora_rows(self, step: StepInput) -> tuple[list[int], list[int]]:
        """Adapter ids of the step's token rows and sampled rows: all 0 while the one adapter they use runs
        merged into the base weights (the merger decides, and merges or unmerges here)."""
        tokens = step.token_lora_ids or [0] * len(step.input_ids)
        # the rows that give prompt logprobs go through the LM head after the sampled ones, with their adapters
        sampled = step.sample_lora_ids or [0] * len(step.sample_rows)
        sampled = sampled + [tokens[r] for r in step.prompt_logprob_rows]
        merger = self.merger
        if merger is None:
            return tokens, sampled
        target = merger.plan(tokens, sampled)
        if target != merger.merged:
            if merger.merged is not None:
                merger.unmerge()
            if target is not None:
                self._merge(target)
        if merger.merged is None:
            return tokens, sampled
        return [0] * len(tokens), [0] * len(sampled)

    def _merge(self, lora_id: int) -> None:
        """Merge the adapter from its GPU slot (activating it there first, in stream order)."""
        stream = torch.cuda.current_stream(self.device) if self._side_stream is not None else None
        if stream is not None:  # a prefetch may be writing its slot
            stream.wait_stream(self._side_stream)
        self._ensure_registered([lora_id])
        self.merger.merge(lora_id, self.lora_manager.activate_adapter(lora_id))
        if stream is not None:  # and no later prefetch may overwrite that slot before the merge has read it
            self._side_stream.wait_stream(stream)

    def _set_lora_mapping(self, step: StepInput, pad: int, pad_sampled: int) -> None:
        """Slots of the step's token rows and sampled rows, each padded (no adapter) to a graph's size."""
        tokens, sampled = self._lora_rows(step)
        mapping = LoRAMapping(tokens + [0] * pad, sampled + [0] * pad_sampled, step.is_prefill)
        if self._side_stream is not None:  # prefetched slots must be written before this step reads them
            torch.cuda.current_stream(self.device).wait_stream(self._side_stream)
        self._ensure_registered(mapping.active_ids())
        self.punica.update_metadata(mapping, self.lora_manager.prepare_batch(mapping))
        if self._side_stream is not None:  # the steps before this one and its slot moves (prefetch_loras)
            self._slots_settled.record(torch.cuda.current_stream(self.device))

    @torch.inference_mode()
    def execute(self, step: StepInput, previous_tokens: torch.Tensor | None = None) -> torch.Tensor:
        """Run the step; returns float32 logits [len(sample_rows) + len(prompt_logprob_rows), vocab].
        previous_tokens: the previous step's sampled token ids, on this device, when step.fill_rows names input
        rows that take one of them. Rank 0 has them (it samples) and sends them to the other tensor-parallel
        ranks, which pass None."""
        dev = self.device
        n = len(step.input_ids)
        batch = self._graph_batch(step)
        size = self.piecewise.padded_size(n) if batch is None and self.piecewise is not None else None
        if self.lora_manager is not None:
            if batch is not None:
                self._set_lora_mapping(step, batch - n, batch - n)
            else:
                self._set_lora_mapping(step, (size or n) - n, 0)

        def fill(input_ids: torch.Tensor) -> None:
            if not step.fill_rows:
                return
            rows = torch.tensor(step.fill_rows + step.fill_from, dtype=torch.long).to(dev, non_blocking=True)
            n = len(step.fill_rows)
            if self.ctx.tp_rank == 0:
                if previous_tokens is None:
                    raise ValueError("the step reads tokens of the previous step, and none were given")
                tokens = previous_tokens.index_select(0, rows[n:])
            else:
                tokens = torch.empty(n, dtype=torch.long, device=dev)
            input_ids.index_copy_(0, rows[:n], self.ctx.broadcast(tokens))

        if batch is not None:
            return self.decode_graphs.run(step.input_ids, step.positions, step.block_tables, batch, fill)
        meta = AttentionMetadata.build(step.query_lens, step.seq_lens, step.block_tables, self.cfg.block_size, dev)
        if size is not None:
            hidden = self.piecewise.run(step.input_ids, step.positions, meta, size, fill)
        else:
            input_ids = torch.tensor(step.input_ids, dtype=torch.long).to(dev, non_blocking=True)
            fill(input_ids)
            positions = torch.tensor(step.positions, dtype=torch.long).to(dev, non_blocking=True)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = torch.tensor(step.sample_rows + step.prompt_logprob_rows, dtype=torch.long).to(dev, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()
