"""Read a .safetensors file into one buffer we own: one sequential read, no mmap, no second copy.

An adapter load used to go through safetensors' load_file (an mmap of the
file, faulted in page by page) and then a copy into owned memory. With
several loads in flight those page faults contend on the process's memory
map; a plain read() into a fresh buffer does the same work in one pass. The
tensors returned are views of that buffer, so nothing aliases the file.

Format (https://huggingface.co/docs/safetensors): 8 bytes little-endian
header length N, N bytes of JSON {name: {"dtype", "shape", "data_offsets":
[begin, end]}, "__metadata__": {...}}, then the data, offsets relative to its
start. Every field of an untrusted file is checked before it is used.
"""

from __future__ import annotations

import json
import math
import os
from pathlib import Path

import torch

_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
           "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8, "U8": torch.uint8,
           "BOOL": torch.bool}
_MAX_HEADER = 100 << 20  # safetensors' own limit


class SafetensorsFormatError(ValueError):
    """The file is not a well-formed safetensors file; the message says what is wrong."""


def read_safetensors(path: str | Path) -> dict[str, torch.Tensor]:
    """name -> CPU tensor for every tensor of the file, all views of one buffer read from it."""
    with open(path, "rb", buffering=0) as f:
        size = os.fstat(f.fileno()).st_size
        head = f.read(8)
        if len(head) < 8:
            raise SafetensorsFormatError(f"{size} bytes: too short for the 8-byte header length")
        header_len = int.from_bytes(head, "little")
        if header_len > min(size - 8, _MAX_HEADER):
            raise SafetensorsFormatError(f"header length {header_len} exceeds the file's {size} bytes")
        try:
            header = json.loads(f.read(header_len))
        except (UnicodeDecodeError, json.JSONDecodeError) as exc:
            raise SafetensorsFormatError(f"header is not JSON ({exc})") from None
        if not isinstance(header, dict):
            raise SafetensorsFormatError("header is not a JSON object")
        data = torch.empty(size - 8 - header_len, dtype=torch.uint8)
        _read_exactly(f, memoryview(data.numpy()))
    return {name: _view(data, name, info) for name, info in header.items() if name != "__metadata__"}


def _read_exactly(f, into: memoryview) -> None:
    done = 0
    while done < len(into):
        got = f.readinto(into[done:])
        if not got:
            raise SafetensorsFormatError(f"file ended {len(into) - done} bytes early")
        done += got


def _view(data: torch.Tensor, name: str, info: object) -> torch.Tensor:
    if not isinstance(info, dict):
        raise SafetensorsFormatError(f"tensor {name!r}: entry is not an object")
    dtype, shape, offsets = _DTYPES.get(info.get("dtype")), info.get("shape"), info.get("data_offsets")
    if dtype is None:
        raise SafetensorsFormatError(f"tensor {name!r}: dtype {info.get('dtype')!r} is not supported")
    if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
        raise SafetensorsFormatError(f"tensor {name!r}: shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(type(o) is int for o in offsets)):
        raise SafetensorsFormatError(f"tensor {name!r}: data_offsets {offsets!r} is not [begin, end]")
    begin, end = offsets
    itemsize = torch.empty((), dtype=dtype).element_size()
    if not 0 <= begin <= end <= data.numel():
        raise SafetensorsFormatError(f"tensor {name!r}: bytes [{begin}, {end}) lie outside the "
                                     f"{data.numel()} data bytes (truncated file?)")
    if end - begin != math.prod(shape) * itemsize:
        raise SafetensorsFormatError(f"tensor {name!r}: {end - begin} bytes do not hold shape {shape} "
                                     f"of {info['dtype']}")
    raw = data[begin:end]
    if begin % itemsize:  # a view needs aligned elements; writers align, but the file is untrusted
        raw = raw.clone()
    return raw.view(dtype).view(shape)
