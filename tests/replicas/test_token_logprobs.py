"""token_logprobs: the reference against log_softmax's definition, the kernels against the reference (under the
interpreter here, on CUDA on a GPU), and the sampler's logprobs for part of a batch."""

from __future__ import annotations

import pytest
import torch

from replicas.token_logprobs import token_logprobs_reference

ON_GPU = torch.cuda.is_available()
DEVICE = "cuda" if ON_GPU else "cpu"


def _logits(rows: int, vocab: int, seed: int) -> torch.Tensor:
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(seed)) * 4
    logits[0, 7:10] = logits[0, 3]  # ties with a drawn token: not counted above it
    logits[1, : vocab // 2] = float("-inf")  # banned tokens (their logprob is -inf, their share 0)
    return logits


def test_the_reference_is_log_softmax():
    logits = _logits(3, 50, 0)
    tokens = torch.tensor([3, 40, 11])
    got = token_logprobs_reference(logits, tokens, 4)
    lp = logits.log_softmax(-1)
    assert got[:, 0].tolist() == tokens.tolist()
    torch.testing.assert_close(got[:, 1], lp.gather(1, tokens[:, None])[:, 0])
    assert got[:, 2].tolist() == [1 + sum(v > logits[r, t].item() for v in logits[r].tolist())
                                  for r, t in enumerate(tokens.tolist())]
    top, ids = lp.topk(4)
    torch.testing.assert_close(got[:, 3:7], top)
    assert torch.equal(got[:, 7:].long(), ids)


# (rows, vocab, k): one split and several (the kernel splits 128 K into 16), a vocabulary off the block size,
# k = 0 (the drawn token only)
# bfloat16: a prefill's prompt rows, read as the model wrote them (in float32 inside the kernel)
@pytest.mark.parametrize("rows,vocab,k,dtype", [(3, 50, 4, torch.float32), (2, 40_000, 5, torch.float32),
                                                (4, 128_256, 0, torch.float32), (2, 9_000, 20, torch.bfloat16)])
def test_the_kernels_equal_the_reference(rows, vocab, k, dtype):
    from replicas.kernels.token_logprobs import token_logprobs

    wide = _logits(rows, vocab, rows + vocab).repeat(1, 2).to(DEVICE, dtype)  # rows strided by 2 V
    logits = wide[:, :vocab]
    tokens = torch.tensor([3, vocab - 1, vocab // 2, 0][:rows], device=DEVICE)
    got = token_logprobs(logits, tokens, k).cpu()
    want = token_logprobs_reference(logits.float(), tokens, k).cpu()
    assert got.shape == want.shape == (rows, 3 + 2 * k)
    assert torch.equal(got[:, [0, 2]], want[:, [0, 2]]) and torch.equal(got[:, 3 + k:], want[:, 3 + k:])
    # the logsumexp sums in another order: float32 rounding of values up to ~40
    torch.testing.assert_close(got[:, 1: 3 + k], want[:, 1: 3 + k], rtol=0, atol=2e-5)


def test_the_top_k_orders_equal_logits_by_id_across_splits():
    """Logits on a coarse grid (many equal), the largest planted in several splits and in a last split of 5
    columns (fewer than k), a row of only two finite logits: the kernels' top k equal the reference's, equal
    logits in id order, -inf ones last (still in id order)."""
    from replicas.kernels.token_logprobs import BLOCK, SPLITS, token_logprobs

    vocab = BLOCK * SPLITS + 5  # splits of 2 * BLOCK columns: the last one holds 5
    logits = (torch.randn(3, vocab, generator=torch.Generator().manual_seed(9)) * 2).round()
    logits[0, [1, 5000, 9000, vocab - 1, vocab - 3]] = 9.0
    logits[1, [vocab - 2, 2, 4097]] = 7.0
    logits[2] = float("-inf")
    logits[2, [11, 8000]] = 1.0
    tokens = torch.tensor([1, 2, 11])
    got = token_logprobs(logits.to(DEVICE), tokens.to(DEVICE), 20).cpu()
    want = token_logprobs_reference(logits, tokens, 20)
    assert want[0, 23:28].long().tolist() == [1, 5000, 9000, vocab - 3, vocab - 1]  # ties by id
    assert want[2, 23:27].long().tolist() == [11, 8000, 0, 1]  # then -inf, by id
    assert torch.equal(got[:, 23:], want[:, 23:]) and torch.equal(got[:, [0, 2]], want[:, [0, 2]])
    torch.testing.assert_close(got[:, 1:23], want[:, 1:23], rtol=0, atol=2e-5)


def test_the_sampler_returns_logprobs_for_the_rows_that_ask():
    from replicas.sampler import Sampler
    from replicas.sampling_params import SamplingParams
    from replicas.sequence import Sequence

    logits = _logits(4, 60, 1)
    params = [SamplingParams(temperature=0, logprobs=k) for k in (2, None, 0, 5)]
    seqs = [Sequence(f"r{i}", [1], p) for i, p in enumerate(params)]
    tokens, logprobs = Sampler().sample(logits, seqs)
    assert logprobs[1] is None
    lp = logits.log_softmax(-1)
    for row, k in ((0, 2), (2, 0), (3, 5)):
        got, token = logprobs[row], int(tokens[row])
        assert got.token_id == token and got.rank == 1  # greedy: the most likely token
        assert got.logprob == pytest.approx(lp[row, token].item(), abs=1e-5)
        top, ids = lp[row].topk(k)
        assert got.top_token_ids == ids.tolist() and all(isinstance(t, int) for t in got.top_token_ids)
        assert got.top_logprobs == pytest.approx(top.tolist(), abs=1e-5)
