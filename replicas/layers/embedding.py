"""Vocab-parallel embedding and LM head: vocab rows split over TP ranks.

The vocab is padded up to a multiple of tp_size; rank r holds rows
[r * V_p/tp, (r + 1) * V_p/tp) of the padded table (padding rows are zero).

    VocabParallelEmbedding  ids [T] -> [T, H]: each rank looks up the ids it
        owns (others give 0), then the partial outputs are all-reduced.
    ParallelLMHead          hidden [N, H] -> logits [N, V]: local logits
        [N, V_p/tp] all-gathered on the vocab dim, padding cut off.

Both follow the ``forward = finish(base_forward(x))`` shape of the linear
layers so a LoRA wrapper can add to the local output before the collective.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from replicas.loader import CheckpointError, copy_checked
from replicas.parallel import ParallelContext


class _VocabParallel(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, ctx: ParallelContext | None,
                 params_dtype: torch.dtype | None) -> None:
        super().__init__()
        self.ctx = ctx or ParallelContext()
        self.tp_rank, self.tp_size = self.ctx.tp_rank, self.ctx.tp_size
        self.num_embeddings = num_embeddings
        self.embedding_dim = embedding_dim
        self.num_embeddings_padded = -(-num_embeddings // self.tp_size) * self.tp_size
        self.num_embeddings_per_partition = self.num_embeddings_padded // self.tp_size
        self.vocab_start_index = self.tp_rank * self.num_embeddings_per_partition
        self.vocab_end_index = self.vocab_start_index + self.num_embeddings_per_partition
        dtype = params_dtype or torch.get_default_dtype()
        self.weight = nn.Parameter(torch.empty(self.num_embeddings_per_partition, embedding_dim, dtype=dtype),
                                   requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    @property
    def input_size(self) -> int:
        return self.num_embeddings

    def weight_loader(self, param: nn.Parameter, loaded_weight: torch.Tensor, shard_id: object = None) -> None:
        """Copy this rank's rows of the full [V, H] table; rows past V (padding) become zero."""
        if shard_id is not None:
            raise CheckpointError(f"{type(self).__name__} takes no shard id (got {shard_id!r})")
        if tuple(loaded_weight.shape) != (self.num_embeddings, self.embedding_dim):
            raise CheckpointError(f"{type(self).__name__}: checkpoint shape {tuple(loaded_weight.shape)} "
                                  f"does not fit [{self.num_embeddings}, {self.embedding_dim}]")
        start = min(self.vocab_start_index, self.num_embeddings)
        rows = min(self.vocab_end_index, self.num_embeddings) - start
        param.data.zero_()
        copy_checked(param.data[:rows], loaded_weight.narrow(0, start, rows), type(self).__name__)

    def extra_repr(self) -> str:
        return (f"vocab={self.num_embeddings} (rows {self.vocab_start_index}:{self.vocab_end_index}), "
                f"dim={self.embedding_dim}, tp={self.tp_rank}/{self.tp_size}")


class VocabParallelEmbedding(_VocabParallel):
    """ids [T] (int) -> embeddings [T, H]."""

    @property
    def output_sizes(self) -> tuple[int, ...]:
        return (self.embedding_dim,)

    def base_forward(self, ids: torch.Tensor) -> torch.Tensor:
        """This rank's partial lookup: rows it owns, zeros for the rest."""
        if self.tp_size == 1:
            return F.embedding(ids, self.weight)
        owned = (ids >= self.vocab_start_index) & (ids < self.vocab_end_index)
        local = torch.where(owned, ids - self.vocab_start_index, torch.zeros_like(ids))
        return F.embedding(local, self.weight).masked_fill_(~owned.unsqueeze(-1), 0)

    def reduce(self, y: torch.Tensor) -> torch.Tensor:
        return self.ctx.all_reduce(y)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        return self.reduce(self.base_forward(ids))


class ParallelLMHead(_VocabParallel):
    """hidden [N, H] -> logits [N, V]. ``tie_to(embedding)`` shares the embedding's table."""

    @property
    def input_size(self) -> int:
        return self.embedding_dim

    @property
    def output_sizes(self) -> tuple[int, ...]:
        return (self.num_embeddings,)

    def tie_to(self, embedding: VocabParallelEmbedding) -> None:
        if embedding.weight.shape != self.weight.shape:
            raise ValueError(f"cannot tie lm_head {tuple(self.weight.shape)} to embedding "
                             f"{tuple(embedding.weight.shape)}")
        self.weight = embedding.weight

    def base_forward(self, hidden: torch.Tensor) -> torch.Tensor:
        """Local logits [N, V_p/tp] for this rank's vocab rows."""
        return F.linear(hidden, self.weight)

    def gather(self, logits: torch.Tensor) -> torch.Tensor:
        """[N, V_p/tp] on every rank -> [N, V] on every rank."""
        return self.ctx.all_gather(logits, dim=-1)[..., : self.num_embeddings]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.gather(self.base_forward(hidden))
