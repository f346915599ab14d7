"""Plain-torch punica ops: the reference every Triton kernel is tested against.

Same semantics and arguments as triton_ops. Per token i with slot s_i (-1 = no
adapter) and per output slice k:

    shrink:  buf[k, i, :]             += scale * x[i] @ A[k, s_i, :r, :]^T
    expand:  y[i, off_k : off_k+n_k]  += buf[k, i, :r] @ B[s_i, off_k : off_k+n_k, :r]^T (+ bias)

where r = ranks[k, s_i] (rows past an adapter's rank count as zero). Tokens are
grouped by slot and each group is one matmul; finding the groups reads the
slots back to the host, which is fine for the CPU engine and the test oracle
but is why the GPU uses the Triton kernels.
"""

from __future__ import annotations

import torch


def _groups(slots: torch.Tensor) -> list[tuple[int, torch.Tensor]]:
    result = []
    for slot in torch.unique(slots).tolist():
        if slot >= 0:
            result.append((slot, torch.nonzero(slots == slot).flatten()))
    return result


def _rank_mask(ranks: torch.Tensor | None, k: int, slot: int, width: int, device) -> torch.Tensor | None:
    if ranks is None:
        return None
    r = int(ranks[k, slot])
    return (torch.arange(width, device=device) < r)


def shrink(buf: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, slots: torch.Tensor,
           ranks: torch.Tensor | None, scale: float) -> None:
    """buf [S, T, R] (fp32) += scale * x [T, H] @ lora_a [S, L, R, H]^T per token's slot."""
    num_slices = lora_a.shape[0]
    for slot, rows in _groups(slots):
        xs = x.index_select(0, rows).float()
        for k in range(num_slices):
            out = xs @ lora_a[k, slot].float().t() * scale
            mask = _rank_mask(ranks, k, slot, out.shape[1], out.device)
            if mask is not None:
                out = out * mask
            buf[k, rows] += out.to(buf.dtype)  # rows are unique within a group


def expand(y: torch.Tensor, buf: torch.Tensor, lora_b: torch.Tensor, slots: torch.Tensor,
           ranks: torch.Tensor | None, output_slices: tuple[int, ...], offset_start: int = 0,
           bias: torch.Tensor | None = None, add_inputs: bool = True) -> None:
    """y[:, offset_start + slice k] += buf [S, T, R] @ lora_b [L, N, R]^T, slice by slice.

    With add_inputs=False the rows of y that have an adapter are overwritten
    rather than accumulated into.
    """
    groups = _groups(slots)
    if not add_inputs:
        for _, rows in groups:
            y[rows, offset_start: offset_start + sum(output_slices)] = 0
    offset = 0
    for k, width in enumerate(output_slices):
        for slot, rows in groups:
            xs = buf[k].index_select(0, rows).float()
            mask = _rank_mask(ranks, k, slot, xs.shape[1], xs.device)
            if mask is not None:
                xs = xs * mask
            w = lora_b[slot, offset: offset + width].float()
            out = xs @ w.t()
            if bias is not None:
                out = out + bias[slot, offset: offset + width].float()
            cols = slice(offset_start + offset, offset_start + offset + width)
            y[rows, cols] = (y[rows, cols].float() + out).to(y.dtype)
        offset += width


def embedding_shrink(buf: torch.Tensor, token_ids: torch.Tensor, lora_a: torch.Tensor,
                     slots: torch.Tensor) -> None:
    """buf [1, T, R] = lora_a [1, L, V, R][s_i, token_i] (0 when s_i = -1 or token_i not in [0, V)).

    The gather has no host round-trip, so both backends share it.
    """
    vocab = lora_a.shape[2]
    owned = (slots >= 0) & (token_ids >= 0) & (token_ids < vocab)
    rows = lora_a[0, slots.clamp(min=0).long(), token_ids.clamp(0, vocab - 1).long()]
    buf[0].copy_(rows.float() * owned.unsqueeze(1))


def gather_shrunk(shrunk: torch.Tensor, slots: torch.Tensor, num_slices: int, rank: int) -> torch.Tensor:
    """shrunk [T, >= bound*S*R] (a stacked GEMM's A columns, slot-major: lora_core/stacked_a.py) -> [S, T, R]
    fp32: each row's own slot's shrink, as expand reads it. Rows without an adapter (slot -1) get zeros."""
    rows = shrunk.shape[0]
    per_slot = shrunk[:, : (shrunk.shape[1] // (num_slices * rank)) * num_slices * rank]
    per_slot = per_slot.reshape(rows, -1, num_slices, rank)
    index = slots.long().clamp(min=0).view(rows, 1, 1, 1).expand(rows, 1, num_slices, rank)
    out = per_slot.gather(1, index)[:, 0].float()
    out[slots < 0] = 0
    return out.permute(1, 0, 2)
