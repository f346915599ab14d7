"""AdapterStructures: adapter files whose structure passed the checks, remembered by their header.

Before it keeps a weight, a load checks every tensor's key, dtype, shape and rank against the adapter's config
and the served model (adapter_checks.py): ~5 ms of Python for an 8B adapter's ~450 tensors on this 2-core machine,
the same again in every part of a split load (load_parts.py), where it is most of a part's time. Adapters
trained with one recipe share that structure, and a safetensors file states all of it in its header (each
key's dtype, shape and byte range), so the header's bytes and the config settings the checks read name a
structure exactly. A loader keeps the structures that passed; a load of a known one reads its own tensors,
checks their values (NaN / Inf) and lays them out.
"""

from __future__ import annotations

import json
import struct
import threading
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from lora_core.module_spec import LoRAModuleSpec

_MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit


def read_header(path: Path) -> bytes | None:
    """The JSON header of a safetensors file as stored, or None where the file has no plausible one (the full
    read then reports the problem)."""
    try:
        with open(path, "rb") as f:
            prefix = f.read(8)
            if len(prefix) != 8:
                return None
            (size,) = struct.unpack("<Q", prefix)
            if size > _MAX_HEADER_BYTES:
                return None
            header = f.read(size)
    except OSError:
        return None
    return header if len(header) == size else None


_DTYPES = {"BF16": torch.bfloat16, "F16": torch.float16, "F32": torch.float32}


def value_layout(header: bytes, modules: dict[str, ModuleKeys]) -> tuple[torch.dtype | None, dict[str, tuple[int, int]]]:
    """(the one dtype of every tensor the header lists, or None where they differ or it is not a float dtype
    the checks know; each module's byte range in the data section, from its first tensor's start to its last's
    end). With one dtype the section holds only elements of it (safetensors leaves no holes), every tensor
    starting on an element: adapter_checks.data_all_finite reads the section, or a part's ranges, as such."""
    try:
        entries = {k: v for k, v in json.loads(header).items() if k != "__metadata__"}
        names = {entry["dtype"] for entry in entries.values()}
        spans = {}
        for name, keys in modules.items():
            offsets = [entries[k]["data_offsets"] for k in (keys.a, keys.b, keys.bias) if k is not None]
            spans[name] = (min(int(lo) for lo, _ in offsets), max(int(hi) for _, hi in offsets))
    except (ValueError, TypeError, KeyError, AttributeError):
        return None, {}
    return (_DTYPES.get(names.pop()) if len(names) == 1 else None), spans


@dataclass(frozen=True)
class ModuleKeys:
    """Where one module's tensors are in the file."""

    a: str
    b: str
    bias: str | None
    embedding: bool


@dataclass(frozen=True)
class CheckedStructure:
    """An adapter structure with no problem: its modules' keys, its rank (the largest module rank), and the
    one dtype of every tensor in the file with each module's byte range (value_layout; None where dtypes
    differ), which let adapter_checks.data_all_finite check a load's values in one pass over the file's data
    section, or over a part's ranges."""

    modules: dict[str, ModuleKeys]
    rank: int
    dtype: torch.dtype | None = None
    spans: dict[str, tuple[int, int]] = field(default_factory=dict)  # each module's bytes (value_layout)


class AdapterStructures:
    """A bounded, thread-safe map from structure keys to CheckedStructure, least recently used out first."""

    def __init__(self, capacity: int = 32) -> None:
        if capacity < 1:
            raise ValueError(f"capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self._known: OrderedDict[tuple, CheckedStructure] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def key(header: bytes, rank: int, rank_pattern: dict[str, int], lora_bias: bool, expected: frozenset[str],
            specs: Iterable[LoRAModuleSpec] | None, max_rank: int | None) -> tuple:
        """What the structural checks read (adapter_checks.check_module, check_fit, group_by_module): the
        header, the config's ranks and LoRA bias flag, and the served model's modules and rank limit. A check
        that reads anything else must add it here."""
        return (header, rank, tuple(sorted(rank_pattern.items())), lora_bias, expected,
                tuple(specs) if specs is not None else None, max_rank)

    def get(self, key: tuple) -> CheckedStructure | None:
        with self._lock:
            known = self._known.get(key)
            if known is not None:
                self._known.move_to_end(key)
            return known

    def put(self, key: tuple, structure: CheckedStructure) -> None:
        with self._lock:
            self._known[key] = structure
            self._known.move_to_end(key)
            while len(self._known) > self.capacity:
                self._known.popitem(last=False)

    def __len__(self) -> int:
        return len(self._known)
