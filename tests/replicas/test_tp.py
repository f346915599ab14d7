"""TP=2 (two gloo processes) gives the logits of TP=1, through the same mixed prefill/decode steps.

llama3_tied: GQA with 2 kv heads split one per rank, tied vocab-parallel head.
llama_mqa_bias: 1 kv head replicated on both ranks, o_proj/MLP biases (the
row-parallel bias must be added once), and a vocab of 121 padded to 122.
qwen3: 2 q heads (one per rank) over 1 replicated kv head, the per-head q/k norms
(one weight, whole on both ranks), head_dim apart from hidden / heads.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from replicas.parallel import destroy_distributed, free_port, init_distributed
from tests.replicas.conftest import MIXED_STEPS, build_model, run_steps, sequence_tokens

TP = 2


# checkpoint -> (q heads per rank, ranks holding each kv head)
CASES = {"llama3_tied": (2, 1), "llama_mqa_bias": (2, 2), "qwen3": (1, 2)}


def _worker(rank: int, port: int, paths: dict[str, str], out_dir: str) -> None:
    torch.set_num_threads(1)
    ctx = init_distributed(rank, TP, f"tcp://127.0.0.1:{port}", "gloo")
    try:
        for name, path in paths.items():
            model = build_model(Path(path), ctx)
            tokens = sequence_tokens(MIXED_STEPS, model.config.vocab_size)
            local = model.model.layers[0].self_attn.qkv_proj
            torch.save({"logits": run_steps(model, MIXED_STEPS, tokens),
                        "heads": (local.num_heads, local.num_kv_heads, local.num_kv_head_replicas)},
                       Path(out_dir) / f"{name}-rank{rank}.pt")
    finally:
        destroy_distributed()


@pytest.fixture(scope="module")
def tp2_results(tiny_checkpoint, tmp_path_factory) -> Path:
    """One pair of worker processes runs every case (process start-up dominates the cost)."""
    out = tmp_path_factory.mktemp("tp2")
    paths = {name: str(tiny_checkpoint(name)) for name in CASES}
    mp.spawn(_worker, args=(free_port(), paths, str(out)), nprocs=TP, join=True)
    return out


@pytest.mark.parametrize("name", sorted(CASES))
def test_tp2_matches_tp1(tiny_checkpoint, tp2_results, name):
    model = build_model(tiny_checkpoint(name))
    expected = run_steps(model, MIXED_STEPS, sequence_tokens(MIXED_STEPS, model.config.vocab_size))
    for rank in range(TP):
        result = torch.load(tp2_results / f"{name}-rank{rank}.pt")
        q_heads, replicas = CASES[name]
        assert result["heads"] == (q_heads, 1, replicas)  # q heads, kv heads, kv replicas per rank
        for seq, want in expected.items():
            torch.testing.assert_close(result["logits"][seq], want, atol=1e-4, rtol=0,
                                       msg=lambda m: f"rank {rank}, sequence {seq}: {m}")


def test_kv_heads_replicated_across_ranks(tiny_checkpoint):
    """With 1 kv head and 2 ranks both ranks load the same (whole) k and v rows."""
    from replicas.layers import QKVParallelLinear
    from replicas.parallel import ParallelContext

    full = torch.randn(4 * 16 + 2 * 16, 64)
    q, k, v = full.split([64, 16, 16])
    for rank in range(TP):
        layer = QKVParallelLinear(64, 16, 4, 1, ctx=ParallelContext(rank, TP))
        for sid, part in zip("qkv", (q, k, v)):
            layer.weight_loader(layer.weight, part, sid)
        assert layer.shard_of(1) == (0, 1) and layer.num_kv_head_replicas == 2
        torch.testing.assert_close(layer.weight[:32], q[rank * 32 : (rank + 1) * 32])
        torch.testing.assert_close(layer.weight[32:], torch.cat([k, v]))


def test_a_hung_teardown_is_bounded_and_blocks_the_next_group(monkeypatch):
    """destroy_distributed(timeout) returns when a rank hangs; a new group waits for (or refuses) the old teardown."""
    import threading

    import torch.distributed as dist

    from replicas import parallel

    release, joined = threading.Event(), []
    monkeypatch.setattr(dist, "is_initialized", lambda: not joined)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: release.wait(5))
    monkeypatch.setattr(dist, "init_process_group", lambda *a, **k: joined.append(k["rank"]))
    monkeypatch.setattr(parallel, "TEARDOWN_TIMEOUT_S", 0.05)
    assert parallel.destroy_distributed(timeout=0.05) is False  # the peer never came: we returned anyway
    with pytest.raises(RuntimeError, match="still tearing down"):
        parallel.init_distributed(0, 2, "tcp://127.0.0.1:1", "gloo")
    assert joined == []
    release.set()
    monkeypatch.setattr(dist, "is_initialized", lambda: bool(joined))
    ctx = parallel.init_distributed(1, 2, "tcp://127.0.0.1:1", "gloo")
    assert joined == [1] and ctx.tp_rank == 1 and ctx.tp_size == 2
