"""ModelRunner: one rank's model, KV cache and LoRA slots; runs one step from host-side inputs.

The engine turns a SchedulerOutput into a StepInput (plain Python data, so it
can be sent to tensor-parallel worker processes); every rank runs the same
StepInput and returns the logits of the rows to sample (identical on all
ranks after the LM head's all-gather).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lora_core.config import LoRAConfig
from lora_core.errors import UnknownLoRAError
from lora_core.lora_model import LoRAModel
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from lora_core.punica import PunicaWrapper
from lora_core.request import LoRARequest
from replicas.attention import AttentionMetadata, allocate_kv_caches
from replicas.lora_layers import add_lora, lora_module_specs
from replicas.model_config import ModelConfig
from replicas.models import load_model, model_class
from replicas.parallel import ParallelContext


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


@dataclass
class RunnerConfig:
    model: str
    dtype: str = "auto"
    device: str = "cpu"
    block_size: int = 16
    num_blocks: int = 256
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    lora_config: LoRAConfig | None = None
    load_format: str = "auto"  # "dummy": random weights, for benchmarks of model shapes with no checkpoint


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
            self.model = self._dummy_model(backend)
        else:
            self.model = load_model(cfg.model, self.model_config, self.ctx, self.device, attn_backend=backend)
        mc = self.model_config
        self.kv_caches = allocate_kv_caches(mc.num_hidden_layers, cfg.num_blocks, cfg.block_size,
                                            mc.num_local_kv_heads(self.ctx.tp_size), mc.head_dim, mc.dtype,
                                            self.device)
        self.lora_manager: LoRAModelManager | None = None
        self.punica: PunicaWrapper | None = None
        self._lora_requests: dict[int, LoRARequest] = {}
        if cfg.lora_config is not None:
            specs = lora_module_specs(self.model)
            self.lora_manager = LoRAModelManager(specs, cfg.lora_config, self.device, mc.dtype,
                                                 self.ctx.tp_rank, self.ctx.tp_size)
            self.punica = PunicaWrapper(cfg.max_num_batched_tokens, cfg.lora_config.max_loras, self.device,
                                        max_num_prompts=cfg.max_num_seqs)
            add_lora(self.model, self.lora_manager, self.punica, cfg.lora_config)
            self._specs = specs
            self._expected = sorted({s for spec in specs for s in spec.sub_modules})

    def _dummy_model(self, backend):
        """Random weights (std 0.02, norms 1) drawn on the device; same on every run."""
        config = self.model_config
        with torch.device(self.device):
            model = model_class(config)(config, self.ctx, backend)
        gen = torch.Generator(device=self.device).manual_seed(1234 + self.ctx.tp_rank)
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.data.fill_(1.0)
            else:
                param.data.normal_(0.0, 0.02, generator=gen)
        return model.eval()

    # ---- adapters -------------------------------------------------------------------------

    def add_lora(self, request: LoRARequest) -> int:
        """Load, validate and register an adapter in the host LRU; returns its rank."""
        if self.lora_manager is None:
            raise UnknownLoRAError("this engine was started without enable_lora")
        lora = self._load(request)
        self._lora_requests[request.lora_int_id] = request
        self.lora_manager.add_adapter(lora)
        return lora.rank

    def _load(self, request: LoRARequest) -> LoRAModel:
        return LoRAModel.from_local_checkpoint(
            request.lora_path, self._expected, lora_model_id=request.lora_int_id,
            lora_config=self.cfg.lora_config, module_specs=self._specs)

    def remove_lora(self, lora_id: int) -> bool:
        known = self._lora_requests.pop(lora_id, None) is not None
        if self.lora_manager is not None and lora_id in self.lora_manager.list_adapters():
            # The engine removes only adapters no live request uses; the last step is over.
            self.lora_manager.set_running(())
            self.lora_manager.remove_adapter(lora_id)
        return known

    def pin_lora(self, lora_id: int) -> bool:
        self._ensure_registered([lora_id])
        return self.lora_manager.pin_adapter(lora_id)

    def list_loras(self) -> list[int]:
        return sorted(self._lora_requests)

    def _ensure_registered(self, ids) -> None:
        """Adapters the host LRU dropped are reloaded from their (already validated) path."""
        registered = set(self.lora_manager.list_adapters())
        # The previous step is over: only this step's adapters are protected from eviction now.
        self.lora_manager.set_running(i for i in ids if i in registered)
        for lora_id in ids:
            if lora_id and lora_id not in registered:
                if lora_id not in self._lora_requests:
                    raise UnknownLoRAError(f"lora id {lora_id} was never added")
                self.lora_manager.add_adapter(self._load(self._lora_requests[lora_id]))

    # ---- one step ---------------------------------------------------------------------------

    @torch.inference_mode()
    def execute(self, step: StepInput) -> torch.Tensor:
        """Run the step; returns float32 logits [len(sample_rows), vocab]."""
        dev = self.device
        if self.lora_manager is not None:
            mapping = LoRAMapping(step.token_lora_ids or [0] * len(step.input_ids),
                                  step.sample_lora_ids or [0] * len(step.sample_rows), step.is_prefill)
            self._ensure_registered(mapping.active_ids())
            self.punica.update_metadata(mapping, self.lora_manager.prepare_batch(mapping))
        meta = AttentionMetadata.build(step.query_lens, step.seq_lens, step.block_tables, self.cfg.block_size, dev)
        input_ids = torch.tensor(step.input_ids, dtype=torch.long).to(dev, non_blocking=True)
        positions = torch.tensor(step.positions, dtype=torch.long).to(dev, non_blocking=True)
        hidden = self.model(input_ids, positions, self.kv_caches, meta)
        rows = torch.tensor(step.sample_rows, dtype=torch.long).to(dev, non_blocking=True)
        return self.model.compute_logits(hidden.index_select(0, rows)).float()
