"""The engine end to end on the demo checkpoint against Hugging Face transformers + PEFT."""

from __future__ import annotations

import pytest
import torch

from lora_core.request import LoRARequest
from replicas.errors import InvalidRequestError
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from tests.replicas.conftest import peft_greedy_reference

STEPS = 12
PROMPTS = ["The quick brown fox", "Once upon a time in a city far away,", "SELECT", "Hello world, this is"]


@pytest.fixture(scope="module")
def lora_requests(loras):
    return list(loras.values())


@pytest.fixture(scope="module")
def batch(lora_requests):
    """A mixed batch: every adapter plus base-model requests, prompts of different lengths."""
    prompts, loras = [], []
    for i, lora in enumerate([None] + lora_requests + [None]):
        prompts.append(PROMPTS[i % len(PROMPTS)])
        loras.append(lora)
    return prompts, loras


@pytest.fixture(scope="module")
def hf_reference(demo, batch):
    """Greedy tokens and their logprobs from transformers + PEFT, one request at a time."""
    prompts, loras = batch
    return peft_greedy_reference(demo.model_dir, demo.adapters, prompts,
                                 [lora and lora.lora_name for lora in loras], STEPS)


def _check_against_hf(outputs, hf_reference):
    for out, (tokens, logprobs) in zip(outputs, hf_reference, strict=True):
        assert out.error is None
        completion = out.outputs[0]
        assert completion.token_ids == tokens, f"{out.lora_name}: {completion.token_ids} != {tokens}"
        got = [step[t] for step, t in zip(completion.logprobs, tokens, strict=True)]
        # float32 on CPU; on a GPU the Triton kernels' float32 dots run in TF32
        tolerance = 2e-2 if torch.cuda.is_available() else 2e-3
        assert max(abs(a - b) for a, b in zip(got, logprobs, strict=True)) < tolerance
        assert completion.finish_reason == "length"


def _greedy(n=STEPS):
    return SamplingParams(temperature=0.0, max_tokens=n, logprobs=1, ignore_eos=True)


def test_mixed_batch_matches_hf_peft(demo, batch, hf_reference):
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32")
    outputs = llm.generate(batch[0], _greedy(), batch[1])
    _check_against_hf(outputs, hf_reference)
    # adapters really change the output, and equal prompts under the base model agree
    assert len({tuple(o.outputs[0].token_ids) for o in outputs[:5]}) == 5
    assert outputs[0].outputs[0].text == llm.engine.tokenizer.decode(outputs[0].outputs[0].token_ids)


@pytest.mark.gpu  # one launch per LoRA site: Triton on tp GPUs
@pytest.mark.parametrize("tp", [1, pytest.param(2, marks=pytest.mark.skipif(torch.cuda.device_count() < 2,
                                                                            reason="needs 2 GPUs"))])
def test_one_launch_sites_match_hf_peft(demo, batch, hf_reference, tp):
    """Rank-16 slots on GPUs: steps of <= 4 adapters run each LoRA linear in one launch (lora_gemm.py; with
    TP=2 the row layers' partial shrinks meet B in the all-reduce); the requests whose adapters fit (rank <=
    16) and the base ones still match transformers + PEFT."""
    import json
    from pathlib import Path

    def fits(lora):
        return lora is None or json.loads((Path(lora.lora_path) / "adapter_config.json").read_text())["r"] <= 16
    keep = [i for i, lora in enumerate(batch[1]) if fits(lora)]
    assert len({batch[1][i].lora_name for i in keep if batch[1][i]}) >= 3
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=16, dtype="float32",
              tensor_parallel_size=tp)
    outputs = llm.generate([batch[0][i] for i in keep], _greedy(), [batch[1][i] for i in keep])
    _check_against_hf(outputs, [hf_reference[i] for i in keep])
    punica = llm.engine.executor.runner.punica  # rank 0's, in this process
    from replicas.lora_layers import fused_max_adapters  # the device's default bound (4 or 16), >= these 4 slots

    assert punica.fused_max_adapters == fused_max_adapters(None, 256, 16, torch.cuda.get_device_name()) >= 4
    assert any(g is not None for g in punica._lora_gemms.values())


def test_fewer_slots_than_adapters_still_exact(demo, batch, hf_reference):
    """max_loras=2 < 4 adapters: requests wait for a slot; results do not change."""
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, max_cpu_loras=2,
              dtype="float32")
    _check_against_hf(llm.generate(batch[0], _greedy(), batch[1]), hf_reference)


@pytest.mark.parametrize("max_loras,stacked_max_tokens", [(4, 256), (2, 8)])
def test_shrink_in_the_base_gemm_matches_hf_peft(demo, batch, hf_reference, max_loras, stacked_max_tokens):
    """A rows stacked under the base weights (lora_core/stacked_a.py): steps of up to stacked_max_tokens rows
    shrink in the base GEMM, larger ones (the prompts, at 8) run the shrink kernel on those rows; with two
    slots for four adapters every slot's rows are rewritten as adapters come and go."""
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=max_loras, max_lora_rank=32, max_cpu_loras=4,
              dtype="float32", lora_stacked_max_tokens=stacked_max_tokens)
    runner = llm.engine.executor.runner
    assert runner.punica.stacked_max_tokens == stacked_max_tokens
    qkv = runner.model.model.layers[0].self_attn.qkv_proj
    assert qkv.stacked is not None and qkv.base.weight.data_ptr() == qkv.stacked.weight.data_ptr()
    _check_against_hf(llm.generate(batch[0], _greedy(), batch[1]), hf_reference)


# the Triton backend serves on CUDA only (tests/lora_core/test_column_expand.py runs the kernel under the interpreter)
@pytest.mark.gpu
def test_column_expand_in_the_engine_matches_hf_peft(demo, batch, hf_reference, monkeypatch):
    """Stacked decode steps whose expand runs as column tiles (lora_core/punica/column_expand.py): forced for
    every step here (the demo's sites are small enough for the one-row-per-program expand otherwise)."""
    from lora_core.punica import column_expand, triton_ops

    monkeypatch.setattr(triton_ops, "BGMV_EXPAND_WORK", 0)
    calls = []
    real = column_expand.column_expand
    monkeypatch.setattr(column_expand, "column_expand", lambda *a, **k: calls.append(1) or real(*a, **k))
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=4, max_lora_rank=32, dtype="float32",
              lora_stacked_max_tokens=256, lora_pending_max_tokens=0, lora_fused_max_adapters=0, lora_merge_steps=0)
    _check_against_hf(llm.generate(batch[0], _greedy(), batch[1]), hf_reference)
    assert calls


@pytest.mark.parametrize("tp", [1, 2])
def test_adapters_moved_between_slots_match_hf_peft(demo, batch, hf_reference, tp):
    """Slot compaction (lora_core/model_manager.py): one request at a time, each adapter is moved into slot 0
    for its steps (the one before moves up to make room), twice round: a moved slot serves the same tokens.
    With TP=2 every rank moves its own shards alike (NCCL on two GPUs where there are two, else gloo)."""
    device = None if tp == 1 else "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    llm = LLM(str(demo.model_dir), tensor_parallel_size=tp, enable_lora=True, max_loras=4, max_lora_rank=32,
              max_cpu_loras=4, dtype="float32", lora_stacked_max_tokens=256, device=device)
    try:
        manager = llm.engine.executor.runner.lora_manager  # rank 0's
        for _ in range(2):
            for prompt, lora, reference in zip(*batch, hf_reference, strict=True):
                _check_against_hf(llm.generate([prompt], _greedy(), [lora]), [reference])
                if lora is not None:
                    assert manager.slot_of(lora.lora_int_id) == 0
        assert manager.slot_moves >= 2 * (len(batch[1]) - 2) - 1
    finally:
        llm.shutdown()


def test_stacked_rows_default_to_cuda_steps_of_up_to_256_rows():
    from lora_core.config import LoRAConfig
    from lora_core.errors import LoRAConfigError
    from replicas.lora_layers import stacked_max_tokens

    cfg, sharded = LoRAConfig(max_loras=2, max_lora_rank=8), LoRAConfig(max_loras=2, max_lora_rank=8,
                                                                        fully_sharded_loras=True)
    assert stacked_max_tokens(None, cfg, torch.device("cuda"), 1) == 256
    assert stacked_max_tokens(None, cfg, torch.device("cpu"), 1) == 0
    assert stacked_max_tokens(64, cfg, torch.device("cpu"), 2) == 64
    assert stacked_max_tokens(None, sharded, torch.device("cuda"), 2) == 0  # ranks hold part of each A row
    assert stacked_max_tokens(None, sharded, torch.device("cuda"), 1) == 256
    with pytest.raises(LoRAConfigError, match="whole A rows"):
        stacked_max_tokens(64, sharded, torch.device("cuda"), 2)
    fp16 = LoRAConfig(max_loras=2, max_lora_rank=8, lora_dtype="float16")  # slots in another dtype than the model
    assert stacked_max_tokens(None, fp16, torch.device("cuda"), 1, torch.bfloat16) == 0
    assert stacked_max_tokens(None, fp16, torch.device("cuda"), 1, torch.float16) == 256
    with pytest.raises(LoRAConfigError, match="lora_dtype"):
        stacked_max_tokens(8, fp16, torch.device("cuda"), 1, torch.bfloat16)


def test_pending_expands_default_to_steps_of_32_rows_where_rank_16_or_lower_steps_stack():
    from lora_core.errors import LoRAConfigError
    from replicas.engine import EngineArgs
    from replicas.lora_layers import pending_max_tokens

    assert pending_max_tokens(None, 256, 16) == 32 and pending_max_tokens(None, 256, 8) == 32
    assert pending_max_tokens(None, 256, 64) == 32  # the rotary fuses rank 64 (SiluAndMul refuses past 16)
    assert pending_max_tokens(None, 256, 128) == 0
    assert pending_max_tokens(None, 0, 16) == 0 and pending_max_tokens(0, 256, 16) == 0
    assert pending_max_tokens(8, 256, 64) == 8  # asked for: as asked
    with pytest.raises(LoRAConfigError, match="lora_stacked_max_tokens"):
        pending_max_tokens(8, 0, 16)
    with pytest.raises(ValueError, match="lora_pending_max_tokens"):
        EngineArgs(model="m", lora_pending_max_tokens=-1)
    with pytest.raises(ValueError, match="lora_pending_min_adapters"):
        EngineArgs(model="m", lora_pending_min_adapters=0)


def test_one_launch_sites_default_to_the_devices_measured_bound_where_rank_16_steps_stack():
    from lora_core.errors import LoRAConfigError
    from replicas.engine_args import EngineArgs
    from replicas.lora_layers import fused_max_adapters

    assert fused_max_adapters(None, 256, 16) == 4 and fused_max_adapters(16, 256, 16) == 16
    assert fused_max_adapters(None, 256, 16, "NVIDIA H100 80GB HBM3") == 16
    assert fused_max_adapters(None, 256, 16, "NVIDIA H200") == 4
    assert fused_max_adapters(2, 256, 16, "NVIDIA H100 80GB HBM3") == 2  # asked for: as asked
    assert fused_max_adapters(0, 256, 16) == 0 and fused_max_adapters(None, 0, 16) == 0
    assert fused_max_adapters(None, 256, 32) == 0  # measured settings for rank-16 slots only
    for args in ((4, 0, 16), (4, 256, 64)):
        with pytest.raises(LoRAConfigError, match="rank-16 slots"):
            fused_max_adapters(*args)
    with pytest.raises(ValueError, match="lora_fused_max_adapters"):
        EngineArgs(model="m", lora_fused_max_adapters=-1)


@pytest.mark.parametrize("tp", [1, 2])
def test_expands_left_to_the_next_op_match_hf_peft(demo, batch, hf_reference, tp, monkeypatch):
    """lora_pending_max_tokens (lora_core/punica/pending.py): gate_up_proj's expand runs in SiluAndMul,
    qkv_proj's in the rotary embedding, o_proj's and down_proj's in the add + RMSNorm after them (the fused
    kernels on CUDA, SiluAndMul's and the norm's allowed these rank-32 slots), with one adapter per step too
    (lora_pending_min_adapters=1). TP=1 and 2 (column shards of B; o_proj and down_proj expand after their
    all-reduce), and on CUDA those norms leave each row's 1 / rms to the rotary and SiluAndMul kernels
    (replicas/layers/row_scale.py). Same tokens as HF + PEFT, and the steps did leave their expands."""
    from lora_core.punica import PunicaWrapper
    from lora_core.punica.pending import PendingExpand

    if torch.cuda.is_available():
        from replicas.kernels import fused, lora_norm

        monkeypatch.setattr(fused, "LORA_SILU_MAX_RANK", 32)
        monkeypatch.setattr(lora_norm, "LORA_NORM_MAX_RANK", 32)
        deferred, real_deferred = [], lora_norm.add_rms_norm_lora_deferred  # the norms left their 1 / rms
        monkeypatch.setattr(lora_norm, "add_rms_norm_lora_deferred", lambda *a: deferred.append(1) or real_deferred(*a))

    left = []
    real = PunicaWrapper.pending_expand

    def counted(self, *args):
        pending = real(self, *args)
        left.append(pending is not None)
        return pending

    monkeypatch.setattr(PunicaWrapper, "pending_expand", counted)
    applied = []
    real_apply = PendingExpand.apply
    monkeypatch.setattr(PendingExpand, "apply", lambda self: applied.append(1) or real_apply(self))
    device = None if tp == 1 else "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    llm = LLM(str(demo.model_dir), tensor_parallel_size=tp, enable_lora=True, max_loras=4, max_lora_rank=32,
              dtype="float32", lora_stacked_max_tokens=256, lora_pending_max_tokens=16, lora_pending_min_adapters=1,
              device=device)
    try:
        _check_against_hf(llm.generate(batch[0], _greedy(), batch[1]), hf_reference)
    finally:
        llm.shutdown()
    if tp == 1:  # the counters live in this process: rank 0 of TP=2 runs in a worker
        # qkv, o, gate_up and down of each layer in each step of <= 16 rows; the prompt step (> 16 rows) expands
        # itself
        assert sum(left) >= 4 * 2 * (STEPS - 1) and not all(left)
        if not torch.cuda.is_available():  # on CPU SiluAndMul and the rotary run each left expand themselves
            assert len(applied) == sum(left)
        else:  # on CUDA their kernels take every one
            assert not applied and deferred


@pytest.mark.parametrize("fully_sharded,stacked", [(False, 0), (True, 0), (False, 256)],
                         ids=["replicated", "fully_sharded", "replicated-stacked"])
def test_tensor_parallel_matches_hf_peft(demo, batch, hf_reference, fully_sharded, stacked):
    # NCCL over two GPUs where there are two (the 2 x H200 device), else gloo over CPU processes
    device = "cuda" if torch.cuda.device_count() >= 2 else "cpu"
    llm = LLM(str(demo.model_dir), tensor_parallel_size=2, enable_lora=True, max_loras=4, max_lora_rank=32,
              fully_sharded_loras=fully_sharded, dtype="float32", device=device,
              lora_stacked_max_tokens=stacked)
    try:
        _check_against_hf(llm.generate(batch[0], _greedy(), batch[1]), hf_reference)
    finally:
        llm.shutdown()


def test_bad_requests_fail_alone(demo, lora_requests, tmp_path):
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32",
              max_model_len=64)
    sql = next(r for r in lora_requests if r.lora_name == "demo-sql")  # rank 8
    big = next(r for r in lora_requests if r.lora_name == "demo-translate")  # rank 32 > 8
    missing = LoRARequest("missing", 99, str(tmp_path / "nope"))
    cases = [
        ("a " * 100, None, SamplingParams(max_tokens=4), "prompt"),  # longer than max_model_len
        ("", None, SamplingParams(max_tokens=4), "prompt"),
        ("hi", missing, SamplingParams(max_tokens=4), "lora_request"),
        ("hi", big, SamplingParams(max_tokens=4), "lora_request"),
    ]
    good = ("The quick brown fox", sql, _greedy(6))
    prompts = [c[0] for c in cases] + [good[0]]
    outs = llm.generate(prompts, [c[2] for c in cases] + [good[2]], [c[1] for c in cases] + [good[1]])
    for out, case in zip(outs, cases):
        assert isinstance(out.error, InvalidRequestError), case
        assert case[3] in out.error.fields, out.error
    assert outs[-1].error is None and len(outs[-1].outputs[0].token_ids) == 6
    for bad in (dict(max_tokens=0), dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5)):
        with pytest.raises(InvalidRequestError, match=next(iter(bad))):
            SamplingParams(**bad)
    # the engine still serves after all of that
    again = llm.generate([good[0]], good[2], [good[1]])
    assert again[0].outputs[0].token_ids == outs[-1].outputs[0].token_ids


def test_kv_cache_sized_from_memory_budget(demo):
    from replicas.attention import kv_cache_block_bytes

    budget = 3 << 20
    llm = LLM(str(demo.model_dir), dtype="float32", kv_cache_memory_bytes=budget, block_size=16)
    mc = llm.engine.model_config
    per_block = kv_cache_block_bytes(mc.num_hidden_layers, 16, mc.num_key_value_heads, mc.head_dim, torch.float32)
    # the budget holds every block the scheduler hands out plus the padding block of graph steps
    assert llm.engine.scheduler.block_manager.num_blocks == budget // per_block - 1
    assert llm.engine.executor.runner.kv_caches[0][0].shape[0] == budget // per_block
    with pytest.raises(ValueError, match="holds no block"):
        LLM(str(demo.model_dir), dtype="float32", kv_cache_memory_bytes=2 * per_block - 1)


def test_adapter_on_embeddings_and_lm_head_matches_peft(demo, tmp_path):
    """An adapter written by peft on embed_tokens + lm_head (+ q_proj): greedy tokens and logprobs equal PEFT's."""
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM, AutoTokenizer

    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_pretrained(demo.model_dir, dtype=torch.float32).eval()
    model = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, target_modules=["embed_tokens", "lm_head", "q_proj"]))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "lora_" in name:
                param.normal_(0.0, 0.2)
    model.save_pretrained(tmp_path / "emb")
    tok = AutoTokenizer.from_pretrained(demo.model_dir)
    ids = tok(PROMPTS[1], return_tensors="pt").input_ids
    want_tokens, want_lps = [], []
    for _ in range(8):
        with torch.no_grad():
            lp = torch.log_softmax(model(ids).logits[0, -1].float(), -1)
        want_tokens.append(int(lp.argmax()))
        want_lps.append(float(lp.max()))
        ids = torch.cat([ids, torch.tensor([[want_tokens[-1]]])], dim=1)
    llm = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=8, dtype="float32")
    lora = LoRARequest("emb", 7, str(tmp_path / "emb"))
    out = llm.generate([PROMPTS[1], PROMPTS[1]], _greedy(8), [lora, None])
    got = out[0].outputs[0]
    assert got.token_ids == want_tokens
    assert max(abs(step[t] - w) for step, t, w in zip(got.logprobs, got.token_ids, want_lps)) < 2e-3
    assert out[1].outputs[0].token_ids != want_tokens  # the adapter changed the output


def test_engine_seed_makes_unseeded_sampling_repeat(demo):
    """EngineArgs.seed (vLLM's --seed): requests without a seed draw the same tokens in a second engine with the
    same seed, and other tokens with another seed; a request's own seed is its own either way."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, top_p=0.9), SamplingParams(max_tokens=12, top_k=20),
              SamplingParams(max_tokens=12, temperature=1.0, seed=5)]

    def tokens(seed):
        llm = LLM(str(demo.model_dir), dtype="float32", seed=seed)
        try:
            return [out.outputs[0].token_ids for out in llm.generate(PROMPTS[:3], params)]
        finally:
            llm.shutdown()

    first, again, other = tokens(7), tokens(7), tokens(8)
    assert first == again
    assert first[:2] != other[:2] and first[2] == other[2]
