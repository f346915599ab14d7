"""The logprobs a request asks for (SamplingParams.logprobs), for every row of a step in one tensor.

Per row, from the model's raw logits x and the drawn token t: log p(t) = x_t - logsumexp(x), t's rank (1 + the
number of tokens with a larger logit), and the k most likely tokens with their logprobs. All of it goes into
one float32 tensor [rows, 3 + 2k] (token id, its logprob, its rank, k logprobs, k ids: ids and ranks are
exact in float32 below 2^24), so the host takes one copy back instead of five. The top k are ordered by logit,
equal logits (frequent in bfloat16) by id, on every device.

Why not log_softmax: it writes the whole [rows, vocab] and the rank and the gather read it again; on CUDA
the logsumexp, the drawn token's logit and its rank come out of one read of the logits, split over a few
programs a row, and the top k out of k more passes over them (replicas/kernels/token_logprobs.py; the raw
logits keep log_softmax's order). The logprobs equal log_softmax's to float32 rounding.
"""

from __future__ import annotations

import torch

MAX_ID = 1 << 24  # float32 holds every integer below this exactly


def token_logprobs_reference(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """logits [N, V] float32, token_ids [N] -> [N, 3 + 2k] (see the module docstring)."""
    lse = logits.logsumexp(dim=-1, keepdim=True)
    chosen = logits.gather(1, token_ids.unsqueeze(1))
    rank = (logits > chosen).sum(dim=-1, keepdim=True) + 1
    # a stable sort: equal logits in id order (torch.topk leaves their order open)
    top, ids = (t[:, :k] for t in logits.sort(dim=-1, descending=True, stable=True))
    return torch.cat([token_ids.unsqueeze(1).float(), chosen - lse, rank.float(), top - lse, ids.float()], dim=1)


def token_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, k: int) -> torch.Tensor:
    """token_logprobs_reference's tensor, by two Triton launches on CUDA. logits of any float dtype, computed
    in float32 (on CUDA without a float32 copy of them)."""
    if logits.shape[1] >= MAX_ID:
        raise ValueError(f"a vocabulary of {logits.shape[1]} ids does not fit float32's exact integers")
    if logits.is_cuda:
        from replicas.kernels.token_logprobs import token_logprobs as kernel  # triton: CUDA only here

        return kernel(logits, token_ids, k)
    return token_logprobs_reference(logits.float(), token_ids, k)
