"""lora_core.safetensors_io against the safetensors library: same tensors, clear errors on broken files."""

from __future__ import annotations

import json
import struct

import pytest
import torch
from safetensors.torch import load_file, save_file

from lora_core.safetensors_io import SafetensorsFormatError, read_safetensors


def _write_raw(path, header: dict, data: bytes) -> None:
    blob = json.dumps(header).encode()
    path.write_bytes(struct.pack("<Q", len(blob)) + blob + data)


def test_reads_what_safetensors_writes(tmp_path):
    g = torch.Generator().manual_seed(0)
    tensors = {"a.bf16": torch.randn(3, 5, generator=g).bfloat16(), "b.f32": torch.randn(7, generator=g),
               "c.f16": torch.randn(2, 2, 2, generator=g).half(), "d.i64": torch.arange(5),
               "e.empty": torch.zeros(0, 4), "f.scalar": torch.tensor(2.5)}
    path = tmp_path / "w.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    got, want = read_safetensors(path), load_file(str(path))
    assert got.keys() == want.keys() == tensors.keys()
    for name, t in want.items():
        assert got[name].dtype == t.dtype and torch.equal(got[name], t), name
    # one buffer, owned: writing a tensor changes neither the file nor the other tensors
    got["b.f32"].fill_(0)
    assert torch.equal(load_file(str(path))["b.f32"], tensors["b.f32"])
    assert torch.equal(got["a.bf16"], tensors["a.bf16"])


def test_unaligned_offsets_are_copied_not_refused(tmp_path):
    values = torch.tensor([1.5, -2.0, 3.25], dtype=torch.float32)
    data = b"\x00" + values.numpy().tobytes()  # float32 starting at byte 1
    path = tmp_path / "odd.safetensors"
    _write_raw(path, {"pad": {"dtype": "U8", "shape": [1], "data_offsets": [0, 1]},
                      "x": {"dtype": "F32", "shape": [3], "data_offsets": [1, 13]}}, data)
    assert torch.equal(read_safetensors(path)["x"], values)


@pytest.mark.parametrize("case,message", [
    ("short", "too short"),
    ("huge_header", "exceeds the file"),
    ("not_json", "not JSON"),
    ("not_object", "not a JSON object"),
    ("dtype", "is not supported"),
    ("shape", "not a list of sizes"),
    ("offsets", r"not \[begin, end\]"),
    ("outside", "outside"),
    ("size", "do not hold shape"),
    ("truncated", "outside"),
])
def test_broken_files_raise_a_format_error(tmp_path, case, message):
    path = tmp_path / f"{case}.safetensors"
    good = {"x": {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}
    if case == "short":
        path.write_bytes(b"\x01\x02")
    elif case == "huge_header":
        path.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
    elif case == "not_json":
        path.write_bytes(struct.pack("<Q", 4) + b"{{{{" + bytes(8))
    elif case == "not_object":
        _write_raw(path, [1, 2], bytes(8))
    elif case == "truncated":
        save_file({"x": torch.randn(64)}, str(tmp_path / "full.safetensors"))
        path.write_bytes((tmp_path / "full.safetensors").read_bytes()[:-100])
    else:
        entry = dict(good["x"])
        entry.update({"dtype": {"dtype": "F4"}, "shape": {"shape": [2, -1]}, "offsets": {"data_offsets": [0]},
                      "outside": {"data_offsets": [0, 16]}, "size": {"shape": [3]}}[case])
        _write_raw(path, {"x": entry}, bytes(8))
    with pytest.raises(SafetensorsFormatError, match=message):
        read_safetensors(path)
