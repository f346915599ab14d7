"""The checks an adapter load runs on a PEFT state dict, every problem found at once (typed lora_core errors).

group_by_module pairs a file's keys into modules (lora_A / lora_B / bias, or the embedding's); check_module
checks one module's tensors: pairing, dtype, NaN / Inf, rank against the config and the limit, target, and
fit with the served model's layer (check_fit). All but the NaN / Inf test read only keys, dtypes and shapes:
the file's structure, which lora_core/adapter_structure.py lets a loader check once per structure.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from lora_core.config import LoRAConfig
from lora_core.errors import (
    AdapterShapeError,
    CorruptAdapterError,
    InvalidAdapterError,
    NonFiniteWeightError,
    RankTooLargeError,
    UnknownTargetModuleError,
    UnsupportedAdapterError,
)
from lora_core.load_parts import is_other_part
from lora_core.module_spec import LoRAKind, LoRAModuleSpec
from lora_core.multimodal_names import image_only, text_model_name
from lora_core.peft_helper import PEFTHelper, raise_problems

_PEFT_PREFIX = "base_model.model."
_BASE_COPY = ".base_layer.weight"
_LORA_PARTS = ("lora_A", "lora_B", "lora_embedding_A", "lora_embedding_B")


@dataclass
class ModuleTensors:
    """The raw PEFT tensors of one module, keyed as in the file for error messages."""

    embedding: bool
    a: tuple[str, torch.Tensor] | None = None  # [r, in]  (embedding: [r, vocab])
    b: tuple[str, torch.Tensor] | None = None  # [out, r] (embedding: [dim, r])
    bias: tuple[str, torch.Tensor] | None = None  # [out]
    # A slice of a fused module (split_fused): the adapter's own module name, whose rank_pattern and
    # alpha_pattern entries and scaling it keeps.
    peft_name: str | None = None


def parse_key(key: str) -> tuple[str, str, str, str | None] | None:
    """'base_model.model.X.lora_A[.adapter].weight' -> (X, 'lora_A', 'weight', adapter).

    PEFT drops the adapter name when saving but keeps it in a live state_dict,
    so both spellings are accepted. None means the key is not a LoRA A/B tensor.
    """
    parts = text_model_name(key.removeprefix(_PEFT_PREFIX)).split(".")
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


def group_by_module(tensors: Mapping[str, torch.Tensor], path: str
                    ) -> tuple[dict[str, ModuleTensors], list[InvalidAdapterError]]:
    modules: dict[str, ModuleTensors] = {}
    problems: list[InvalidAdapterError] = []
    adapter_names: set[str | None] = set()
    base_copies: list[str] = []
    for key, t in tensors.items():
        if image_only(key.removeprefix(_PEFT_PREFIX)):
            continue
        parsed = parse_key(key)
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
        mt = modules.setdefault(module, ModuleTensors(embedding))
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
        if text_model_name(key.removeprefix(_PEFT_PREFIX).removesuffix(_BASE_COPY)) not in modules:
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


_FINITE_CHUNK = 1 << 22  # elements per numpy call of data_all_finite: 8 MB of bf16


def data_all_finite(path: Path, data_start: int, dtype: torch.dtype,
                    spans: Iterable[tuple[int, int]] | None = None) -> bool | None:
    """True when no element of the safetensors file's data section (from byte ``data_start``: 8 + the header's
    length), read as ``dtype``, is NaN or Inf (only in ``spans``, byte ranges of the section, where given);
    None where the bit test does not know the dtype or the file no longer holds the ranges. One
    pass in a few numpy calls per span, where all_finite takes several per tensor: each call gives the GIL up
    and takes it back, and a load on a thread beside the engine's steps may wait for the GIL at every one of
    them (replicas/gil.py). For a file whose tensors are all of that dtype (CheckedStructure.dtype)."""
    spec = _EXPONENT_BITS.get(dtype)
    if spec is None:
        return None
    as_int, magnitude, exponent = spec
    np_int = {torch.int16: np.int16, torch.int32: np.int32}[as_int]
    size = np.dtype(np_int).itemsize
    try:
        if path.stat().st_size <= data_start:
            return True
        data = np.memmap(path, dtype=np_int, mode="r", offset=data_start)
    except (OSError, ValueError):  # the file changed since its tensors were read: check those
        return None
    ranges = [(0, data.shape[0])] if spans is None else [(lo // size, hi // size) for lo, hi in _merged(spans)]
    scratch = np.empty(min(max((hi - lo for lo, hi in ranges), default=0), _FINITE_CHUNK), dtype=np_int)
    for first, end in ranges:
        if end > data.shape[0]:
            return None
        for lo in range(first, end, _FINITE_CHUNK):
            out = scratch[:min(_FINITE_CHUNK, end - lo)]
            np.bitwise_and(data[lo:lo + out.shape[0]], magnitude, out=out)
            if int(out.max()) >= exponent:
                return False
    return True


def _merged(spans: Iterable[tuple[int, int]]) -> list[tuple[int, int]]:
    """Byte ranges sorted, those that touch or overlap joined (a layer's tensors lie side by side in the file)."""
    out: list[list[int]] = []
    for lo, hi in sorted(spans):
        if out and lo <= out[-1][1]:
            out[-1][1] = max(out[-1][1], hi)
        else:
            out.append([lo, hi])
    return [(lo, hi) for lo, hi in out]


def _tensors(mt: ModuleTensors) -> list[tuple[str, torch.Tensor]]:
    return [x for x in (mt.a, mt.b, mt.bias) if x is not None]


def value_problems(mt: ModuleTensors, path: str) -> list[InvalidAdapterError]:
    """NaN / Inf in the module's tensors that this load read (not other parts')."""
    problems: list[InvalidAdapterError] = []
    for key, t in _tensors(mt):
        if not is_other_part(t) and not all_finite(t):
            nan, inf = int(torch.isnan(t).sum()), int(torch.isinf(t).sum())
            problems.append(NonFiniteWeightError(path, key, f"holds {nan} NaN and {inf} Inf values"))
    return problems


def check_module(name: str, mt: ModuleTensors, helper: PEFTHelper, path: str,
                 expected: frozenset[str] | None, specs: dict[str, tuple[LoRAModuleSpec, int]] | None,
                 max_rank: int | None) -> list[InvalidAdapterError]:
    """Every problem with one module's tensors: pairing, finiteness, rank, target, fit."""
    if mt.a is None or mt.b is None:
        key = next(x for x in (mt.a, mt.b, mt.bias) if x is not None)[0]
        missing = ("lora_embedding_" if mt.embedding else "lora_") + ("A" if mt.a is None else "B")
        return [CorruptAdapterError(path, key, f"{missing} of module {name} is missing; A and B come in pairs")]
    problems = [CorruptAdapterError(path, key, f"dtype {t.dtype} is not a floating-point type")
                for key, t in _tensors(mt) if not t.is_floating_point()]
    problems += value_problems(mt, path)
    (a_key, a), (b_key, b) = mt.a, mt.b
    suffix = name.rsplit(".", 1)[-1]
    if expected is not None and suffix not in expected:
        problems.append(UnknownTargetModuleError(
            path, a_key, f"module {suffix!r} cannot take a LoRA in this model (supported: {sorted(expected)})"))
    if not helper.in_layers(name):
        problems.append(UnknownTargetModuleError(
            path, a_key, f"module {name} lies outside layers_to_transform {helper.layers_to_transform}"))
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
        problems += check_fit(name, mt, specs, path)
    return problems


def check_fit(name: str, mt: ModuleTensors, specs: dict[str, tuple[LoRAModuleSpec, int]],
              path: str) -> list[InvalidAdapterError]:
    """Does the module exist in the served model, and do A and B fit its dimensions?"""
    (a_key, a), (b_key, b) = mt.a, mt.b
    if name not in specs:
        return [UnknownTargetModuleError(path, a_key, f"the served model has no LoRA-able module {name}")]
    spec, i = specs[name]
    out_features = spec.out_features if i == FUSED else spec.out_slices[i]
    if (spec.kind == LoRAKind.EMBEDDING) != mt.embedding:
        stored = "embedding" if mt.embedding else "linear"
        return [AdapterShapeError(path, a_key, f"{name} is a {spec.kind.value} layer in the served model "
                                               f"but the adapter stores {stored} LoRA tensors for it")]
    problems: list[InvalidAdapterError] = []
    if a.shape[1] != spec.in_features:
        problems.append(AdapterShapeError(
            path, a_key, f"shape {list(a.shape)}: input dim {a.shape[1]} does not fit {name} "
                         f"(in_features={spec.in_features})"))
    if b.shape[0] != out_features:
        problems.append(AdapterShapeError(
            path, b_key, f"shape {list(b.shape)}: output dim {b.shape[0]} does not fit {name} "
                         f"(out_features={out_features})"))
    return problems


def config_problems(helper: PEFTHelper, expected: frozenset[str] | None,
                    lora_config: LoRAConfig | None) -> list[InvalidAdapterError]:
    problems = helper.legal_problems(lora_config)
    if expected is not None and isinstance(helper.target_modules, list):
        unknown = [t for t in helper.target_modules if t.rsplit(".", 1)[-1] not in expected]
        if unknown:
            problems.append(UnknownTargetModuleError(
                helper.config_path, "target_modules",
                f"{unknown} cannot take a LoRA in this model (supported: {sorted(expected)})"))
    return problems


# The slice index of a packed layer's own name in spec_index: the adapter's module covers every slice.
FUSED = -1


def spec_index(module_specs: Iterable[LoRAModuleSpec] | None) -> dict[str, tuple[LoRAModuleSpec, int]] | None:
    """Sub-module name -> (its spec, its slice index), and a packed layer's own name -> (its spec, FUSED); or
    None (no served model to check against)."""
    if module_specs is None:
        return None
    index = {spec.name: (spec, FUSED) for spec in module_specs if spec.packed}
    index.update({sub: (spec, i) for spec in module_specs for i, sub in enumerate(spec.sub_module_names())})
    return index


def split_fused(modules: dict[str, ModuleTensors], specs: dict[str, tuple[LoRAModuleSpec, int]] | None,
                path: str) -> dict[str, ModuleTensors]:
    """An adapter's fused modules (a packed layer's own name, as Phi-3 stores qkv_proj) as the layer's
    sub-modules, which is how the rest of lora_core and the slots take them: each slice keeps the one A
    (x A^T B^T cut by output rows is x A^T (B's rows)^T) and its rows of B and of the bias. Call after
    check_fit: the shapes fit. Meta tensors (another part's) split as well."""
    if specs is None:
        return modules
    out: dict[str, ModuleTensors] = {}
    problems: list[InvalidAdapterError] = []
    for name, mt in modules.items():
        spec, i = specs.get(name, (None, None))
        if i != FUSED:
            out[name] = mt
            continue
        start = 0
        for sub, width in zip(spec.sub_module_names(), spec.out_slices):
            if sub in modules:
                problems.append(CorruptAdapterError(path, mt.a[0], f"module {name} is given both fused and as "
                                                                   f"its part {sub}"))
            rows = slice(start, start + width)
            (b_key, b), bias = mt.b, mt.bias
            out[sub] = ModuleTensors(mt.embedding, mt.a, (f"{b_key}[{start}:{start + width}]", b[rows]),
                                     None if bias is None else (f"{bias[0]}[{start}:{start + width}]", bias[1][rows]),
                                     peft_name=name)
            start += width
    raise_problems(path, problems)
    return out


def checked_modules(tensors: Mapping[str, torch.Tensor], helper: PEFTHelper, path: str,
                     expected: frozenset[str] | None, specs: dict[str, tuple[LoRAModuleSpec, int]] | None,
                     max_rank: int | None) -> dict[str, ModuleTensors]:
    """The tensors grouped by module, after every check; raises every problem found at once."""
    modules, problems = group_by_module(tensors, path)
    for name, mt in modules.items():
        problems += check_module(name, mt, helper, path, expected, specs, max_rank)
    raise_problems(path, problems)
    return modules
