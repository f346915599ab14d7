"""Checkpoint loading: walk a model directory's safetensors, one tensor at a time.

The loader yields FULL checkpoint tensors by their HF names; each parameter's
``weight_loader`` (see replicas.layers) cuts its own tensor-parallel shard, so
every rank reads the same files and no rank ever holds the whole model:
safe_open maps the file and get_tensor materialises one tensor per step.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

import torch
from safetensors import SafetensorError, safe_open

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


class CheckpointError(ValueError):
    """A checkpoint's weight files are missing, unreadable, or do not fit the model."""


def checkpoint_files(path: str | Path) -> list[Path]:
    """The safetensors files of a checkpoint dir, in load order.

    With model.safetensors.index.json, the files its weight_map names (all
    must exist); else model.safetensors; else every *.safetensors in the dir.
    """
    path = Path(path)
    if not path.is_dir():
        raise CheckpointError(f"{path}: checkpoint directory not found")
    index = path / INDEX_FILE
    if index.is_file():
        try:
            weight_map = json.loads(index.read_text(encoding="utf-8"))["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as exc:
            raise CheckpointError(f"{index}: malformed index ({exc!r})") from None
        files = [path / name for name in names]
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise CheckpointError(f"{index}: names weight files that are missing: {missing}")
        return files
    if (path / SINGLE_FILE).is_file():
        return [path / SINGLE_FILE]
    files = sorted(path.glob("*.safetensors"))
    if not files:
        pickled = sorted(p.name for p in path.glob("*.bin")) + sorted(p.name for p in path.glob("*.pt"))
        hint = f" (found {pickled}: pickle-based weights are not loaded; convert to safetensors)" if pickled else ""
        raise CheckpointError(f"{path}: no *.safetensors weight files{hint}")
    return files


def iterate_weights(path: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """Yield (HF name, full CPU tensor) for every tensor of the checkpoint, lazily."""
    for file in checkpoint_files(path):
        try:
            with safe_open(str(file), framework="pt", device="cpu") as f:
                for name in f.keys():
                    yield name, f.get_tensor(name)
        except (SafetensorError, OSError) as exc:
            raise CheckpointError(f"{file}: unreadable safetensors file ({exc})") from None


def default_weight_loader(param: torch.nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
    """Copy a whole (unsharded) tensor into ``param``; shapes must match exactly."""
    if shard_id is not None:
        raise CheckpointError(f"a replicated parameter takes no shard id (got {shard_id!r})")
    copy_checked(param.data, loaded_weight, "weight")


def copy_checked(dst: torch.Tensor, src: torch.Tensor, what: str) -> None:
    """dst.copy_(src) (casting dtype) after checking shapes, raising CheckpointError on a mismatch."""
    if tuple(dst.shape) != tuple(src.shape):
        raise CheckpointError(f"{what}: checkpoint shape {tuple(src.shape)} does not fit {tuple(dst.shape)}")
    dst.copy_(src)
