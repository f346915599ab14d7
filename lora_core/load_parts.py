"""An adapter load split over several loader processes, each taking the layers of one part.

A loader process spends a rank-16 8B adapter's load (~55 ms on an H200 host) mostly on bytes: reading the
tensors, checking them for NaN / Inf and writing them into a host slab, all per layer. Split by layer
(layer i goes to part i % parts; modules outside the layers to part 0), n processes load one adapter in
about 1/n of that plus the per-key work each repeats: so a request that waits for its adapter waits less
(replicas/lora_load_process.py).

Each part still validates the whole adapter's structure (every key, shape and rank, against the config and
the served model), from the file's header: the other parts' tensors are meta tensors, with their shapes
and dtypes and no data. So every part raises what a whole load would, except a non-finite weight, which
only the part that reads it sees.
"""

from __future__ import annotations

import re
from pathlib import Path

import torch
from safetensors import safe_open

_LAYER = re.compile(r"\.layers\.(\d+)\.")
_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}


def part_of(name: str, parts: int) -> int:
    """The part that loads a module or tensor key: its layer index modulo parts; 0 outside the layers."""
    match = _LAYER.search(name)
    return int(match.group(1)) % parts if match else 0


def read_part(path: Path, part: int, parts: int) -> dict[str, torch.Tensor]:
    """Every tensor of a safetensors file: read where part_of(key) is ``part``, else a meta tensor of its
    shape and dtype (read anyway where the dtype has no torch equivalent here)."""
    if not 0 <= part < parts:
        raise ValueError(f"part must be in [0, {parts}), got {part}")
    out = {}
    with safe_open(str(path), framework="pt") as f:
        for key in f.keys():
            lazy = f.get_slice(key) if part_of(key, parts) != part else None
            dtype = _DTYPES.get(lazy.get_dtype()) if lazy is not None else None
            out[key] = (f.get_tensor(key) if dtype is None
                        else torch.empty(lazy.get_shape(), dtype=dtype, device="meta"))
    return out


def is_other_part(t: torch.Tensor) -> bool:
    """Whether t is a tensor that another part reads (read_part's meta tensors)."""
    return t.device.type == "meta"
