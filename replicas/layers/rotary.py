"""Rotary position embedding, neox style (rotate halves, as HF Llama), with linear, llama3, longrope and yarn
scaling.

cos/sin are computed from the positions on each call (positions * inv_freq in
float32, exactly as HF does), so no [max_position, head_dim] table is held.

longrope has two sets of frequencies: short_factor's within the original
context, long_factor's past it. transformers picks one for a whole forward
pass by the sequence's length, so a sequence whose prompt fits the original
context turns its prompt with the short set and its tokens past it with the
long one, and a longer prompt turns every position with the long set. Here
the set is chosen per token: inv_freq holds both rows, a position at or past
long_from takes the second, and so does a position encoded as p + LONG_ROPE
(a token of a sequence whose prompt is longer than the original context:
replicas/sampled_step.py encodes them, only ever in steps with prompt tokens).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from lora_core.punica.pending import PendingExpand
from replicas.layers.norm import fused_ops
from replicas.layers.row_scale import RowScale
from replicas.model_config import ModelConfigError
from replicas.rope_config import LONG_ROPE, NEVER_LONG, RopeScaling


def rope_inv_freq(head_dim: int, base: float, scaling: RopeScaling | None = None) -> torch.Tensor:
    """[head_dim/2] float32 inverse frequencies, scaled per ``scaling``; longrope: [2, head_dim/2], the short
    factors' row, then the long factors'."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    inv_freq = 1.0 / (base ** exponents)
    scaling = scaling or RopeScaling()
    if scaling.rope_type == "longrope":
        factors = torch.tensor([scaling.short_factor, scaling.long_factor or scaling.short_factor],
                               dtype=torch.float32)
        return 1.0 / (factors * base ** exponents)
    if scaling.rope_type == "default":
        return inv_freq
    if scaling.rope_type == "linear":
        return inv_freq / scaling.factor
    if scaling.rope_type == "llama3":
        return _llama3(inv_freq, scaling)
    if scaling.rope_type == "yarn":
        return _yarn(inv_freq, head_dim, base, scaling)
    raise ModelConfigError(f"rope type {scaling.rope_type!r} is not supported")


def _llama3(inv_freq: torch.Tensor, s: RopeScaling) -> torch.Tensor:
    """Llama 3.1: long wavelengths divided by factor, short ones kept, a smooth blend between."""
    old_len = s.original_max_position_embeddings
    low_freq_wavelen, high_freq_wavelen = old_len / s.low_freq_factor, old_len / s.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / s.factor, inv_freq)
    smooth = (old_len / wavelen - s.low_freq_factor) / (s.high_freq_factor - s.low_freq_factor)
    smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
    medium = (wavelen >= high_freq_wavelen) & (wavelen <= low_freq_wavelen)
    return torch.where(medium, smoothed, scaled)


def _yarn(inv_freq: torch.Tensor, dim: int, base: float, s: RopeScaling) -> torch.Tensor:
    """YaRN: a frequency that turns more than beta_fast times over the original context keeps its value
    (extrapolated), one that turns less than beta_slow times is divided by factor (interpolated), and those
    between blend linearly by their index; as transformers computes it (truncate: the range's ends rounded out)."""
    def index(turns: float) -> float:  # the frequency index that makes `turns` turns over the original context
        return dim * math.log(s.original_max_position_embeddings / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = index(s.beta_fast), index(s.beta_slow)
    if s.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # transformers' guard against a zero-width ramp
    interpolated = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    return inv_freq / s.factor * interpolated + inv_freq * (1 - interpolated)


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


class RotaryEmbedding(nn.Module):
    """forward(positions [T], q [T, n_q*d], k [T, n_k*d]) -> rotated (q, k), same shapes and dtype.

    rotary_dim: the leading dimensions of each head that turn (Phi-4-mini: 96 of 128), the rest passing through;
    None: all of them."""

    def __init__(self, head_dim: int, base: float, scaling: RopeScaling | None = None,
                 rotary_dim: int | None = None) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rotary_dim = rotary_dim or head_dim
        self.register_buffer("inv_freq", rope_inv_freq(self.rotary_dim, base, scaling), persistent=False)
        # positions from here on (and encoded ones, LONG_ROPE) take inv_freq's second row
        self.long_from = NEVER_LONG if self.inv_freq.dim() == 1 else scaling.original_max_position_embeddings
        # longrope and yarn scale cos and sin. Over whole heads the attention's scale takes it (LlamaAttention:
        # q.k times its square), which costs nothing; the dimensions a partly turned head passes are not scaled,
        # so there cos and sin carry it.
        self.cos_sin_factor = scaling.attention_factor if scaling is not None and self.partial else 1.0
        # the kernels' shape arguments, built once: forward runs per layer per step
        self._shape = dict(long_from=self.long_from, rotary_dim=self.rotary_dim, cos_sin_factor=self.cos_sin_factor)

    @property
    def partial(self) -> bool:
        return self.rotary_dim < self.head_dim

    def cos_sin(self, positions: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin [T, 1, rotary_dim] in ``dtype``."""
        if self.inv_freq.dim() == 1:
            freqs = positions.float().unsqueeze(-1) * self.inv_freq.float()
        else:
            rows = self.inv_freq.float()[(positions >= self.long_from).long()]
            freqs = torch.where(positions >= LONG_ROPE, positions - LONG_ROPE, positions).float().unsqueeze(-1) * rows
        emb = torch.cat((freqs, freqs), dim=-1).unsqueeze(1)
        return (emb.cos() * self.cos_sin_factor).to(dtype), (emb.sin() * self.cos_sin_factor).to(dtype)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, lora: PendingExpand | None = None,
                v: torch.Tensor | None = None, row_scale: RowScale | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """lora: qkv_proj's expand, left to this op (lora_core/punica/pending.py), with q, k, v views of the output
        it is owed to: on CUDA one kernel adds it as it rotates (v in place); elsewhere it runs first.
        row_scale: the RowScale the norm before qkv_proj left (with v): applied after the expand, v's part in
        place, by the same kernel or first."""
        fused = fused_ops(q)
        if row_scale is not None and v is None:
            raise ValueError("RotaryEmbedding takes a row_scale with q, k and v: v needs it too")
        if lora is not None:
            if v is None or not lora.splits_y((q, k, v)):
                raise ValueError("RotaryEmbedding takes a pending expand with q, k, v: the views of its output")
            if fused is not None:
                from replicas.kernels import lora_rotary  # triton: CUDA only here

                if lora_rotary.fusable(lora, q, k, v):
                    return lora_rotary.rotary_lora(positions, q, k, v, self.inv_freq, self.head_dim, lora, row_scale,
                                                   **self._shape)
            lora.apply()
        if row_scale is not None:
            row_scale.apply_(q, k, v)
        if fused is None:
            return self.forward_native(positions, q, k)
        from replicas.kernels import rotary  # triton: CUDA only here

        return rotary.rotary(positions, q, k, self.inv_freq, self.head_dim, **self._shape)

    def forward_native(self, positions: torch.Tensor, q: torch.Tensor,
                       k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        cos, sin = self.cos_sin(positions, q.dtype)
        d = self.rotary_dim

        def turn(x: torch.Tensor) -> torch.Tensor:
            heads = x.unflatten(-1, (-1, self.head_dim))
            turned, passed = heads[..., :d], heads[..., d:]
            out = turned * cos + _rotate_half(turned) * sin
            return (out if passed.shape[-1] == 0 else torch.cat((out, passed), dim=-1)).reshape(x.shape)

        return turn(q), turn(k)
