"""LoRAModel: one adapter, loaded and validated, as per-module LoRALayerWeights.

Loading reads only adapter_config.json and adapter_model.safetensors, checks
every tensor against the config and (when given) the served model, and builds
fresh tensors: nothing global is touched, so a bad adapter fails alone while
every adapter already loaded keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from pathlib import Path

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from lora_core.adapter_checks import (ModuleTensors, checked_modules, config_problems, data_all_finite, spec_index,
                                      split_fused, value_problems)
from lora_core.adapter_structure import AdapterStructures, CheckedStructure, ModuleKeys, read_header, value_layout
from lora_core.config import LoRAConfig
from lora_core.errors import AdapterFileMissingError, CorruptAdapterError, UnsafeAdapterFormatError
from lora_core.layer_weights import LoRALayerWeights
from lora_core.load_parts import is_other_part, part_of, read_part
from lora_core.module_spec import LoRAModuleSpec
from lora_core.peft_helper import PEFTHelper, raise_problems

WEIGHTS_NAME = "adapter_model.safetensors"
_PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")


def _own(t: torch.Tensor | None, device: torch.device | str, dtype: torch.dtype | None) -> torch.Tensor | None:
    """A copy in t's own layout that shares no memory with the file's (possibly mmap'd) tensor.

    Copy first, transpose after (a view): a transposing copy of a bf16 tensor
    on CPU runs several times slower than a straight one, and the slots want
    PEFT's layout back anyway.
    """
    if t is None:
        return None
    out = torch.empty(tuple(t.shape), dtype=dtype or t.dtype, device=device)
    out.copy_(t)
    return out


def _as(t: torch.Tensor | None, device: torch.device | str, dtype: torch.dtype | None) -> torch.Tensor | None:
    """t itself where device and dtype match (copy=False), else a converted copy."""
    if t is None or (t.device == torch.device(device) and dtype in (None, t.dtype)):
        return t  # no .to(): each torch call gives the GIL up and takes it back (replicas/gil.py)
    return t.to(device=device, dtype=dtype or t.dtype)


def _find_weights(lora_dir: Path) -> Path:
    path = lora_dir / WEIGHTS_NAME
    if path.is_file():
        return path
    pickled = [n for n in _PICKLE_NAMES if (lora_dir / n).is_file()]
    if pickled:
        raise UnsafeAdapterFormatError(
            lora_dir / pickled[0], None,
            f"weights are only in pickle format; we refuse to load it because unpickling an untrusted "
            f"file runs arbitrary code. Convert it to {WEIGHTS_NAME} (e.g. load it where you trust it and "
            f"call peft_model.save_pretrained(dir, safe_serialization=True)).")
    raise AdapterFileMissingError(path, None, f"no {WEIGHTS_NAME} in adapter directory {lora_dir}")


def _load_safetensors(path: Path, part: tuple[int, int] | None = None) -> dict[str, torch.Tensor]:
    try:
        return load_file(str(path), device="cpu") if part is None else read_part(path, *part)
    except Exception as exc:  # any failure to parse an untrusted file means the file is bad
        raise CorruptAdapterError(path, None, f"not a readable safetensors file ({exc})") from exc


def _read_known(path: Path, known: CheckedStructure, part: tuple[int, int] | None) -> dict[str, ModuleTensors]:
    """The tensors of a structure that passed the checks before (adapter_structure.py): only this part's."""
    try:
        with safe_open(str(path), framework="pt") as f:
            return {name: ModuleTensors(keys.embedding, (keys.a, f.get_tensor(keys.a)), (keys.b, f.get_tensor(keys.b)),
                                        (keys.bias, f.get_tensor(keys.bias)) if keys.bias else None)
                    for name, keys in known.modules.items() if part is None or part_of(name, part[1]) == part[0]}
    except Exception as exc:  # as _load_safetensors: a file that no longer reads is a bad file
        raise CorruptAdapterError(path, None, f"not a readable safetensors file ({exc})") from exc


def _build(modules: dict[str, ModuleTensors], helper: PEFTHelper, device: torch.device | str,
           dtype: torch.dtype | None, copy: bool) -> dict[str, LoRALayerWeights]:
    """LoRALayerWeights of the modules this load read (other parts' are left out)."""
    own = _own if copy else _as
    loras: dict[str, LoRALayerWeights] = {}
    for name, mt in modules.items():
        (_, a), (_, b) = mt.a, mt.b
        if is_other_part(a):
            continue
        peft_name = mt.peft_name or name  # a fused module's slices keep its patterns (split_fused)
        loras[name] = LoRALayerWeights(
            module_name=name,
            rank=a.shape[0],
            lora_alpha=helper.alpha_for(peft_name),
            lora_a=own(a, device, dtype).t(),  # [in, r], a view of PEFT's [r, in]
            lora_b=own(b, device, dtype).t(),
            scaling=helper.scaling_for(peft_name),
            bias=own(mt.bias[1], device, dtype) if mt.bias is not None else None,
            is_embedding=mt.embedding,
        )
    return loras


class LoRAModel:
    """A loaded adapter.

    loras maps full module names ("model.layers.0.self_attn.q_proj") to their
    LoRALayerWeights. The model is unpacked: merging q/k/v into qkv_proj is
    done by LoRAModelManager when it writes a slot.
    """

    def __init__(self, lora_model_id: int, rank: int, loras: dict[str, LoRALayerWeights],
                 peft_helper: "PEFTHelper | None" = None, path: str | None = None) -> None:
        self.id = lora_model_id
        self.rank = rank
        self.loras = loras
        self.peft_helper = peft_helper
        self.path = path

    @classmethod
    def from_local_checkpoint(
        cls, lora_dir: str | Path, expected_lora_modules: Iterable[str], peft_helper: PEFTHelper | None = None,
        *, lora_model_id: int = 0, device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
        lora_config: LoRAConfig | None = None, module_specs: Iterable[LoRAModuleSpec] | None = None,
        copy: bool = True, part: tuple[int, int] | None = None, structures: AdapterStructures | None = None,
    ) -> "LoRAModel":
        """Load a PEFT adapter directory (adapter_config.json + adapter_model.safetensors).

        expected_lora_modules are the module suffixes the served model can take a
        LoRA on ("q_proj", "embed_tokens", ...); module_specs, when given, also
        check each tensor against the real layer dimensions. lora_model_id 0
        means "not assigned yet": ids are the caller's (LoRARequest) to give.
        copy=False keeps the file's tensors (no copy where device and dtype already
        match): for a caller that lays the adapter out at once and drops it, as a
        loader process does (on a 2-core machine the copy took ~8 of 48 ms of a
        rank-16 8B load).
        part=(k, n): only the modules of layers i with i % n == k (load_parts.py): one of n loader processes'
        share, its rank the whole adapter's; the whole adapter is validated but for other parts' finiteness.
        structures: a loader's AdapterStructures (adapter_structure.py): a file whose structure passed the
        checks before is only read and checked for NaN / Inf; one that passes now is added.
        Raises an InvalidAdapterError subclass naming the file and field at fault.
        """
        lora_dir = Path(lora_dir)
        helper = peft_helper if peft_helper is not None else PEFTHelper.from_local_dir(lora_dir)
        expected = frozenset(expected_lora_modules)
        module_specs = list(module_specs) if module_specs is not None else None  # read twice below
        specs = spec_index(module_specs)
        # Config first: it is cheap and rejects most bad adapters before a large file is read.
        raise_problems(helper.config_path, config_problems(helper, expected, lora_config))
        weights_path = _find_weights(lora_dir)
        path, max_rank = str(weights_path), lora_config.max_lora_rank if lora_config is not None else None
        header = read_header(weights_path) if structures is not None else None
        key = (AdapterStructures.key(header, helper.r, helper.rank_pattern, helper.lora_bias, expected,
                                     module_specs, max_rank) if header is not None else None)
        known = structures.get(key) if key is not None else None
        if known is not None:
            modules = _read_known(weights_path, known, part)
            # The values in one pass over the file (or this part's layers); a finding goes tensor by tensor
            spans = None if part is None else [known.spans.get(name) for name in modules]
            if (known.dtype is None or None in (spans or ())
                    or data_all_finite(weights_path, 8 + len(header), known.dtype, spans) is not True):
                raise_problems(path, [p for mt in modules.values() for p in value_problems(mt, path)])
            rank = known.rank
        else:
            modules = checked_modules(_load_safetensors(weights_path, part), helper, path, expected, specs,
                                       max_rank)
            rank = max(mt.a[1].shape[0] for mt in modules.values())
            if key is not None:
                keys = {name: ModuleKeys(mt.a[0], mt.b[0], mt.bias and mt.bias[0], mt.embedding)
                        for name, mt in modules.items()}
                structures.put(key, CheckedStructure(keys, rank, *value_layout(header, keys)))
        modules = split_fused(modules, specs, path)
        return cls(lora_model_id, rank, _build(modules, helper, device, dtype, copy), peft_helper=helper,
                   path=str(lora_dir))

    @classmethod
    def from_lora_tensors(
        cls, tensors: Mapping[str, torch.Tensor], peft_helper: PEFTHelper,
        *, expected_lora_modules: Iterable[str] | None = None, lora_model_id: int = 0,
        device: torch.device | str = "cpu", dtype: torch.dtype | None = None,
        lora_config: LoRAConfig | None = None, module_specs: Iterable[LoRAModuleSpec] | None = None,
        weights_path: str | None = None, lora_dir: str | None = None, copy: bool = True,
    ) -> "LoRAModel":
        """Build from a PEFT state dict (saved keys or a live model's, with adapter name).

        PEFT stores A as [r, in] and B as [out, r] (embedding A [r, vocab], B
        [dim, r]); we keep A^T [in, r] and B^T [r, out] so that
        x @ lora_a @ lora_b is the LoRA output. The input tensors are copied,
        never aliased (copy=False: aliased where device and dtype match);
        lora_a / lora_b are transposed views of what is kept (PEFT's layout,
        which the slots use too). Every problem found is raised at once.
        """
        path = weights_path or (str(Path(lora_dir) / WEIGHTS_NAME) if lora_dir else "<tensors>")
        expected = frozenset(expected_lora_modules) if expected_lora_modules is not None else None
        raise_problems(peft_helper.config_path, config_problems(peft_helper, expected, lora_config))
        max_rank = lora_config.max_lora_rank if lora_config is not None else None
        specs = spec_index(module_specs)
        modules = split_fused(checked_modules(tensors, peft_helper, path, expected, specs, max_rank), specs, path)
        rank = max(mt.a[1].shape[0] for mt in modules.values())
        return cls(lora_model_id, rank, _build(modules, peft_helper, device, dtype, copy), peft_helper=peft_helper,
                   path=lora_dir)

    def get_lora(self, module_name: str) -> LoRALayerWeights | None:
        return self.loras.get(module_name)

    def num_bytes(self) -> int:
        return sum(l.num_bytes() for l in self.loras.values())

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None,
           pin_memory: bool = False) -> "LoRAModel":
        for lora in self.loras.values():
            lora.to(device=device, dtype=dtype, pin_memory=pin_memory)
        return self

    def optimize(self) -> "LoRAModel":
        for lora in self.loras.values():
            lora.optimize()
        return self

    def __repr__(self) -> str:
        return f"LoRAModel(id={self.id}, rank={self.rank}, modules={len(self.loras)}, path={self.path!r})"
