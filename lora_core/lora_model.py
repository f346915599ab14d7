"""LoRAModel: one adapter, loaded and validated, as per-module LoRALayerWeights.

Loading reads only adapter_config.json and adapter_model.safetensors, checks
every tensor against the config and (when given) the served model, and builds
fresh tensors: nothing global is touched, so a bad adapter fails alone while
every adapter already loaded keeps serving.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import load_file

from lora_core.config import LoRAConfig
from lora_core.errors import (
    AdapterFileMissingError,
    AdapterShapeError,
    CorruptAdapterError,
    InvalidAdapterError,
    NonFiniteWeightError,
    RankTooLargeError,
    UnknownTargetModuleError,
    UnsafeAdapterFormatError,
    UnsupportedAdapterError,
)
from lora_core.layer_weights import LoRALayerWeights
from lora_core.load_parts import is_other_part, read_part
from lora_core.module_spec import LoRAKind, LoRAModuleSpec
from lora_core.peft_helper import PEFTHelper, raise_problems

WEIGHTS_NAME = "adapter_model.safetensors"
_PICKLE_NAMES = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
_PEFT_PREFIX = "base_model.model."
_BASE_COPY = ".base_layer.weight"
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


@dataclass
class _ModuleTensors:
    """The raw PEFT tensors of one module, keyed as in the file for error messages."""

    embedding: bool
    a: tuple[str, torch.Tensor] | None = None  # [r, in]  (embedding: [r, vocab])
    b: tuple[str, torch.Tensor] | None = None  # [out, r] (embedding: [dim, r])
    bias: tuple[str, torch.Tensor] | None = None  # [out]


def _parse_key(key: str) -> tuple[str, str, str, str | None] | None:
    """'base_model.model.X.lora_A[.adapter].weight' -> (X, 'lora_A', 'weight', adapter).

    PEFT drops the adapter name when saving but keeps it in a live state_dict,
    so both spellings are accepted. None means the key is not a LoRA A/B tensor.
    """
    parts = key.removeprefix(_PEFT_PREFIX).split(".")
    i = next((i for i, p in enumerate(parts) if p in _LORA_PARTS), None)
    if not i:  # no LoRA segment, or no module name before it
        return None
    part, rest = parts[i], parts[i + 1:]
    if part.startswith("lora_embedding"):  # a bare nn.Parameter: no .weight suffix
        if len(rest) > 1:
            return None
        return ".".join(parts[:i]), part, "weight", (rest[0] if rest else None)
    if not rest or len(rest) > 2 or rest[-1] not in ("weight", "bias"):
        return None
    if rest[-1] == "bias" and part != "lora_B":
        return None
    return ".".join(parts[:i]), part, rest[-1], (rest[0] if len(rest) == 2 else None)


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
    return None if t is None else t.to(device=device, dtype=dtype or t.dtype)


def _group_by_module(tensors: Mapping[str, torch.Tensor], path: str
                     ) -> tuple[dict[str, _ModuleTensors], list[InvalidAdapterError]]:
    modules: dict[str, _ModuleTensors] = {}
    problems: list[InvalidAdapterError] = []
    adapter_names: set[str | None] = set()
    base_copies: list[str] = []
    for key, t in tensors.items():
        parsed = _parse_key(key)
        if parsed is None and key.endswith(_BASE_COPY):
            base_copies.append(key)
            continue
        if parsed is None:
            reason = ("DoRA magnitude vector: DoRA adapters are not supported" if "lora_magnitude_vector" in key
                      else "not a LoRA A/B tensor; adapters that save whole modules (modules_to_save, "
                           "trainable tokens) are not supported")
            problems.append(UnsupportedAdapterError(path, key, reason))
            continue
        module, part, param, adapter = parsed
        adapter_names.add(adapter)
        embedding = part.startswith("lora_embedding")
        mt = modules.setdefault(module, _ModuleTensors(embedding))
        slot = "bias" if param == "bias" else part[-1].lower()
        if mt.embedding != embedding:
            problems.append(CorruptAdapterError(
                path, key, f"module {module} has both lora_A/lora_B and lora_embedding_A/B tensors"))
        elif getattr(mt, slot) is not None:
            problems.append(CorruptAdapterError(path, key, f"duplicates {getattr(mt, slot)[0]}"))
        else:
            setattr(mt, slot, (key, t))
    for key in base_copies:
        # PEFT saves the base embedding / lm_head next to their LoRA (save_embedding_layers) in case the
        # vocabulary was resized; like vLLM we serve the model's own weights, and a resized vocabulary
        # shows up as a LoRA A/B that does not fit the module.
        if key.removeprefix(_PEFT_PREFIX).removesuffix(_BASE_COPY) not in modules:
            problems.append(UnsupportedAdapterError(
                path, key, "a full base-layer weight without a LoRA on that layer is not supported"))
    if len(adapter_names) > 1:
        names = sorted(a or "<unnamed>" for a in adapter_names)
        problems.append(UnsupportedAdapterError(path, None, f"holds several adapters {names}; save each separately"))
    if not modules and not problems:
        problems.append(CorruptAdapterError(path, None, "holds no LoRA tensors"))
    return modules, problems


# Exponent bits all set = Inf or NaN: with the sign bit cleared, the bits read as an integer of at least
# the exponent mask. Validation reads every weight of every load, and on CPU numpy's integer test runs
# ~100x faster than torch.isfinite on bf16 (an 8B-shaped rank-16 adapter: 6 s -> 0.05 s on the 2-core CI
# machine); one max over the masked bits instead of a compare and an any: 16.7 -> 12.0 ms there.
_EXPONENT_BITS = {torch.bfloat16: (torch.int16, 0x7FFF, 0x7F80), torch.float16: (torch.int16, 0x7FFF, 0x7C00),
                  torch.float32: (torch.int32, 0x7FFFFFFF, 0x7F800000)}


def all_finite(t: torch.Tensor) -> bool:
    """True when t holds no NaN and no Inf."""
    spec = _EXPONENT_BITS.get(t.dtype)
    if spec is None or t.device.type != "cpu":
        return bool(torch.isfinite(t).all())
    if not t.numel():
        return True
    as_int, magnitude, exponent = spec
    bits = t.contiguous().view(as_int).numpy()
    return int((bits & magnitude).max()) < exponent


def _check_module(name: str, mt: _ModuleTensors, helper: PEFTHelper, path: str,
                  expected: frozenset[str] | None, specs: dict[str, tuple[LoRAModuleSpec, int]] | None,
                  max_rank: int | None) -> list[InvalidAdapterError]:
    """Every problem with one module's tensors: pairing, finiteness, rank, target, fit."""
    if mt.a is None or mt.b is None:
        key = next(x for x in (mt.a, mt.b, mt.bias) if x is not None)[0]
        missing = ("lora_embedding_" if mt.embedding else "lora_") + ("A" if mt.a is None else "B")
        return [CorruptAdapterError(path, key, f"{missing} of module {name} is missing; A and B come in pairs")]
    problems: list[InvalidAdapterError] = []
    for key, t in (x for x in (mt.a, mt.b, mt.bias) if x is not None):
        if not t.is_floating_point():
            problems.append(CorruptAdapterError(path, key, f"dtype {t.dtype} is not a floating-point type"))
        elif not is_other_part(t) and not all_finite(t):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            problems.append(NonFiniteWeightError(path, key, f"holds {nan} NaN and {inf} Inf values"))
    (a_key, a), (b_key, b) = mt.a, mt.b
    suffix = name.rsplit(".", 1)[-1]
    if expected is not None and suffix not in expected:
        problems.append(UnknownTargetModuleError(
            path, a_key, f"module {suffix!r} cannot take a LoRA in this model (supported: {sorted(expected)})"))
    if a.ndim != 2 or b.ndim != 2:
        problems.append(AdapterShapeError(
            path, a_key if a.ndim != 2 else b_key,
            f"expected 2-D A [r, in] and B [out, r], got {list(a.shape)} and {list(b.shape)}"))
        return problems
    r, want = a.shape[0], helper.rank_for(name)
    if b.shape[1] != r:
        problems.append(AdapterShapeError(
            path, b_key, f"shape {list(b.shape)} has rank {b.shape[1]} but {a_key} has rank {r}"))
    elif r != want:
        problems.append(AdapterShapeError(
            path, a_key, f"rank {r} does not match r={want} that {helper.config_path} gives {name}"))
    if max_rank is not None and max(r, b.shape[1]) > max_rank:
        problems.append(RankTooLargeError(path, a_key, f"rank {max(r, b.shape[1])} exceeds max_lora_rank={max_rank}"))
    if mt.bias is not None:
        key, bias = mt.bias
        if not helper.lora_bias:
            problems.append(CorruptAdapterError(
                path, key, f"a LoRA bias is present but {helper.config_path} has lora_bias=false"))
        elif tuple(bias.shape) != (b.shape[0],):
            problems.append(AdapterShapeError(path, key, f"shape {list(bias.shape)}, expected [{b.shape[0]}]"))
    if specs is not None:
        problems += _check_fit(name, mt, specs, path)
    return problems


def _check_fit(name: str, mt: _ModuleTensors, specs: dict[str, tuple[LoRAModuleSpec, int]],
               path: str) -> list[InvalidAdapterError]:
    """Does the module exist in the served model, and do A and B fit its dimensions?"""
    (a_key, a), (b_key, b) = mt.a, mt.b
    if name not in specs:
        return [UnknownTargetModuleError(path, a_key, f"the served model has no LoRA-able module {name}")]
    spec, i = specs[name]
    if (spec.kind == LoRAKind.EMBEDDING) != mt.embedding:
        stored = "embedding" if mt.embedding else "linear"
        return [AdapterShapeError(path, a_key, f"{name} is a {spec.kind.value} layer in the served model "
                                               f"but the adapter stores {stored} LoRA tensors for it")]
    problems: list[InvalidAdapterError] = []
    if a.shape[1] != spec.in_features:
        problems.append(AdapterShapeError(
            path, a_key, f"shape {list(a.shape)}: input dim {a.shape[1]} does not fit {name} "
                         f"(in_features={spec.in_features})"))
    if b.shape[0] != spec.out_slices[i]:
        problems.append(AdapterShapeError(
            path, b_key, f"shape {list(b.shape)}: output dim {b.shape[0]} does not fit {name} "
                         f"(out_features={spec.out_slices[i]})"))
    return problems


def _config_problems(helper: PEFTHelper, expected: frozenset[str] | None,
                     lora_config: LoRAConfig | None) -> list[InvalidAdapterError]:
    problems = helper.legal_problems(lora_config)
    if expected is not None and isinstance(helper.target_modules, list):
        unknown = [t for t in helper.target_modules if t.rsplit(".", 1)[-1] not in expected]
        if unknown:
            problems.append(UnknownTargetModuleError(
                helper.config_path, "target_modules",
                f"{unknown} cannot take a LoRA in this model (supported: {sorted(expected)})"))
    return problems


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
        copy: bool = True, part: tuple[int, int] | None = None,
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
        Raises an InvalidAdapterError subclass naming the file and field at fault.
        """
        lora_dir = Path(lora_dir)
        helper = peft_helper if peft_helper is not None else PEFTHelper.from_local_dir(lora_dir)
        expected = frozenset(expected_lora_modules)
        # Config first: it is cheap and rejects most bad adapters before a large file is read.
        raise_problems(helper.config_path, _config_problems(helper, expected, lora_config))
        weights_path = _find_weights(lora_dir)
        tensors = _load_safetensors(weights_path, part)
        return cls.from_lora_tensors(
            tensors, helper, expected_lora_modules=expected, lora_model_id=lora_model_id, device=device,
            dtype=dtype, lora_config=lora_config, module_specs=module_specs,
            weights_path=str(weights_path), lora_dir=str(lora_dir), copy=copy)

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
        raise_problems(peft_helper.config_path, _config_problems(peft_helper, expected, lora_config))

        specs = None
        if module_specs is not None:
            specs = {sub: (spec, i) for spec in module_specs for i, sub in enumerate(spec.sub_module_names())}
        max_rank = lora_config.max_lora_rank if lora_config is not None else None
        modules, problems = _group_by_module(tensors, path)
        for name, mt in modules.items():
            problems += _check_module(name, mt, peft_helper, path, expected, specs, max_rank)
        raise_problems(path, problems)

        own = _own if copy else _as
        loras: dict[str, LoRALayerWeights] = {}
        for name, mt in modules.items():
            (_, a), (_, b) = mt.a, mt.b
            if is_other_part(a):
                continue
            loras[name] = LoRALayerWeights(
                module_name=name,
                rank=a.shape[0],
                lora_alpha=peft_helper.alpha_for(name),
                lora_a=own(a, device, dtype).t(),  # [in, r], a view of PEFT's [r, in]
                lora_b=own(b, device, dtype).t(),
                scaling=peft_helper.scaling_for(name),
                bias=own(mt.bias[1], device, dtype) if mt.bias is not None else None,
                is_embedding=mt.embedding,
            )
        rank = max(mt.a[1].shape[0] for mt in modules.values())
        return cls(lora_model_id, rank, loras, peft_helper=peft_helper, path=lora_dir)

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
