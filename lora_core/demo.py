"""A tour of lora_core: PEFT adapters on disk -> host cache -> slots -> one mixed batch (`make demo`).

Writes three small adapters in PEFT's on-disk format for a 2-layer Llama-shaped
model into $LORAFLEET_CACHE/demo-adapters (default ~/.cache/lorafleet), loads
them through the real loader, runs one batch mixing all three with base-model
tokens through PunicaWrapper.add_lora_linear on every LoRA layer, and checks
each token against x @ compute_delta_weight(). A fourth adapter, of too large
a rank, is refused with its typed error while the others keep serving.
Exits 1 on any mismatch.
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path

import torch
from safetensors.torch import save_file

from lora_core.config import LoRAConfig
from lora_core.errors import InvalidAdapterError
from lora_core.layer_weights import PackedLoRALayerWeights
from lora_core.lora_model import LoRAModel
from lora_core.mapping import LoRAMapping
from lora_core.model_manager import LoRAModelManager
from lora_core.module_spec import LoRAKind, LoRAModuleSpec
from lora_core.punica import PunicaWrapper

HIDDEN, KV, INTER, LAYERS = 64, 32, 96, 2
SUB_DIMS = {"q_proj": (HIDDEN, HIDDEN), "k_proj": (HIDDEN, KV), "v_proj": (HIDDEN, KV), "o_proj": (HIDDEN, HIDDEN),
            "gate_proj": (HIDDEN, INTER), "up_proj": (HIDDEN, INTER), "down_proj": (INTER, HIDDEN)}  # (in, out)
PACKED = {"self_attn.qkv_proj": ("q_proj", "k_proj", "v_proj"), "self_attn.o_proj": ("o_proj",),
          "mlp.gate_up_proj": ("gate_proj", "up_proj"), "mlp.down_proj": ("down_proj",)}
PARENT = {sub: name.split(".")[0] for name, subs in PACKED.items() for sub in subs}  # q_proj -> self_attn
PEFT_DEFAULTS = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path="lorafleet/demo-llama",
                     bias="none", lora_dropout=0.0, use_rslora=False, use_dora=False, rank_pattern={},
                     alpha_pattern={}, modules_to_save=None, fan_in_fan_out=False, init_lora_weights=True,
                     layers_to_transform=None, lora_bias=False)
ADAPTERS = {  # name -> adapter_config.json fields on top of PEFT_DEFAULTS
    "sql-r8": dict(r=8, lora_alpha=16, target_modules=["q_proj", "k_proj", "v_proj", "o_proj"]),
    "chat-r16-rslora": dict(r=16, lora_alpha=32, use_rslora=True, target_modules=list(SUB_DIMS)),
    "summarize-r4": dict(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "gate_proj", "up_proj", "down_proj"],
                         rank_pattern={"down_proj": 2}, alpha_pattern={"down_proj": 4}),
}
BAD = ("too-big-r64", dict(r=64, lora_alpha=64, target_modules=["q_proj", "v_proj"]))
BATCH = [1, 1, 1, 2, 0, 3, 3, 2, 2, 0, 1, 3, 0, 2]  # lora_int_id per token, 0 = base model


def llama_specs() -> list[LoRAModuleSpec]:
    """What an engine reports for its LoRA-able layers (q/k/v and gate/up packed, as in vLLM)."""
    return [LoRAModuleSpec(f"model.layers.{i}.{name}", LoRAKind.LINEAR, SUB_DIMS[subs[0]][0],
                           tuple(SUB_DIMS[s][1] for s in subs), subs)
            for i in range(LAYERS) for name, subs in PACKED.items()]


def write_adapter(path: Path, fields: dict, seed: int) -> Path:
    """Write one adapter as PEFT's save_pretrained does; skipped if already complete."""
    if (path / "adapter_config.json").is_file():
        return path
    path.mkdir(parents=True, exist_ok=True)
    gen = torch.Generator().manual_seed(seed)
    tensors = {}
    for i in range(LAYERS):
        for sub, (d_in, d_out) in SUB_DIMS.items():
            if sub in fields["target_modules"]:
                r = fields.get("rank_pattern", {}).get(sub, fields["r"])
                key = f"base_model.model.model.layers.{i}.{PARENT[sub]}.{sub}"
                # PEFT starts B at zero; a trained B is not, and a zero B would make the check vacuous.
                tensors[f"{key}.lora_A.weight"] = torch.randn(r, d_in, generator=gen) * 0.1
                tensors[f"{key}.lora_B.weight"] = torch.randn(d_out, r, generator=gen) * 0.1
    save_file(tensors, str(path / "adapter_model.safetensors"), metadata={"format": "pt"})
    # The config goes last: its presence marks the adapter complete.
    (path / "adapter_config.json").write_text(json.dumps({**PEFT_DEFAULTS, **fields}, indent=2))
    return path


def expected_delta(lora: LoRAModel | None, spec: LoRAModuleSpec) -> torch.Tensor:
    """The [in, out] update of a packed layer from the adapter's unpacked modules; zero if untargeted."""
    layers = [lora.get_lora(n) for n in spec.sub_module_names()] if lora is not None else []
    if not any(layers):
        return torch.zeros(spec.in_features, spec.out_features)
    return PackedLoRALayerWeights.pack(spec.name, spec.sub_modules, spec.out_slices, layers).compute_delta_weight()


def main(cache_dir: str | Path | None = None) -> int:
    root = Path(cache_dir or os.environ.get("LORAFLEET_CACHE") or Path.home() / ".cache/lorafleet")
    root = root / "demo-adapters"
    device = "cuda" if torch.cuda.is_available() else "cpu"
    config = LoRAConfig(max_loras=4, max_lora_rank=16, lora_dtype="float32")
    specs, suffixes = llama_specs(), list(SUB_DIMS)
    manager = LoRAModelManager(specs, config, device, torch.float32)
    wrapper = PunicaWrapper(max_num_tokens=len(BATCH), max_loras=config.max_loras, device=device)
    print(f"lorafleet demo: lora_core on {device} ({wrapper.backend} backend), {LAYERS}-layer Llama-shaped "
          f"model, hidden {HIDDEN}\nadapters (PEFT format) in {root}")

    models: dict[int, LoRAModel] = {}
    for lora_id, (name, fields) in enumerate(ADAPTERS.items(), start=1):
        path = write_adapter(root / name, fields, seed=lora_id)
        models[lora_id] = LoRAModel.from_local_checkpoint(path, suffixes, lora_model_id=lora_id,
                                                          lora_config=config, module_specs=specs)
        manager.add_adapter(models[lora_id])

    bad_name, bad_fields = BAD
    try:
        LoRAModel.from_local_checkpoint(write_adapter(root / bad_name, bad_fields, seed=99), suffixes,
                                        lora_model_id=99, lora_config=config, module_specs=specs)
        print(f"FAILED: {bad_name} (rank {bad_fields['r']} > max_lora_rank) was accepted")
        return 1
    except InvalidAdapterError as exc:
        refused = f"{type(exc).__name__}: {str(exc).replace(str(root) + os.sep, '')}"

    mapping = LoRAMapping(index_mapping=BATCH, prompt_mapping=BATCH, is_prefill=True)
    wrapper.update_metadata(mapping, manager.prepare_batch(mapping), config.max_loras)  # once per step
    slot_bytes = sum(manager.buffers(s.name).num_bytes() for s in specs) // config.max_loras
    print(f"slots: {config.max_loras}, each sized for max_lora_rank={config.max_lora_rank} "
          f"({slot_bytes / 1024:.0f} KiB)\n  id  name              rank  scaling        modules  KiB  slot")
    for lora_id, lora in models.items():
        h = lora.peft_helper
        rank = f"{h.r}" + (f"/{min(h.rank_pattern.values())}" if h.rank_pattern else "")
        scaling = f"{h.lora_alpha}/{'sqrt(r)' if h.use_rslora else 'r'}={h.scaling_for('q_proj'):.3g}"
        print(f"  {lora_id:2}  {list(ADAPTERS)[lora_id - 1]:17} {rank:5} {scaling:15}{len(lora.loras):6}"
              f"{lora.num_bytes() / 1024:6.0f}{manager.slot_of(lora_id):6}")
    print(f"refused {bad_name}, the others keep serving:\n  {refused}")

    gen = torch.Generator().manual_seed(0)
    worst = scale = 0.0
    for spec in specs:
        buf = manager.buffers(spec.name)
        x = torch.randn(len(BATCH), spec.in_features, generator=gen)
        y = torch.zeros(len(BATCH), spec.out_features, device=device)
        wrapper.add_lora_linear(y, x.to(device), buf.lora_a, buf.lora_b, buf.bias, 1.0, buf.output_slices, buf.ranks)
        for t, lora_id in enumerate(BATCH):
            want = x[t] @ expected_delta(models.get(lora_id), spec)
            worst = max(worst, (y[t].cpu() - want).abs().max().item())
            scale = max(scale, want.abs().max().item())
    tolerance = 1e-5 if wrapper.backend == "torch" else 1e-2  # the GPU kernels may use TF32 for fp32 inputs
    print(f"batch of {len(BATCH)} tokens, ids {BATCH} (0 = base model), through {len(specs)} LoRA layers")
    print(f"max abs error vs x @ delta_W: {worst:.2e} (outputs up to {scale:.2f}, tolerance {tolerance:g} relative)")
    ok = worst <= tolerance * scale
    print("OK" if ok else "MISMATCH")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
