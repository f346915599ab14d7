"""bench/engine.py's inputs and driver: model dirs, PEFT adapter pools, requests, the step loop, bytes, bandwidth.

Model directories hold config.json and tokenizer files only (the engine draws
random weights with load_format="dummy"). The tokenizer is a word-level one
over the model's whole vocabulary (the demo checkpoint's tokenizer_config.json
beside it), so that every generated id decodes to text and the streaming
detokenizer's window stays short, as with Llama 3's real tokenizer; a
1,536-token tokenizer would leave most of a 128,256-id vocabulary
undecodable and make detokenizing cost grow with every generated token.

Adapters: a few distinct random weight files per (shape, rank), written once;
every registered adapter is a directory with its own adapter_config.json and
an adapter_model.safetensors symlinked to one of them, so 1,000 registered
8B-shaped rank-16 adapters take 4 files of 84 MB, not 84 GB.
"""

from __future__ import annotations

import json
import math
import random
import shutil
import statistics
import time
from collections import deque
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer, models

from lora_core.request import LoRARequest
from replicas.demo_checkpoint import ensure_demo_checkpoint
from replicas.engine import LLMEngine
from replicas.sampling_params import SamplingParams

LLAMA3_8B = dict(hidden_size=4096, num_hidden_layers=32, num_attention_heads=32, num_key_value_heads=8,
                 intermediate_size=14336, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0)
LLAMA32_1B = dict(hidden_size=2048, num_hidden_layers=16, num_attention_heads=32, num_key_value_heads=8,
                  intermediate_size=8192, vocab_size=128256, max_position_embeddings=8192, rope_theta=500000.0,
                  tie_word_embeddings=True)
# Qwen3-8B: its per-head q/k norms (replicas/models/llama.py), head_dim given (here equal to hidden / heads)
QWEN3_8B = dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096, num_hidden_layers=36,
                num_attention_heads=32, num_key_value_heads=8, head_dim=128, intermediate_size=12288,
                vocab_size=151936, max_position_embeddings=40960, rope_theta=1000000.0)
# Phi-3-mini-4k: MHA (32 kv heads: 3x Llama-3-8B's KV bytes per token) and a window of 2047 keys, longer than the
# default sequences (it masks nothing there). Its fused checkpoint tensors play no part with dummy weights, and its
# adapters here name q/k/v and gate/up apart, as for the Llama shapes
PHI3_MINI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, num_hidden_layers=32,
                 num_attention_heads=32, num_key_value_heads=32, intermediate_size=8192, vocab_size=32064,
                 max_position_embeddings=4096, sliding_window=2047, rope_theta=10000.0)
# Phi-4-mini: 96 of each head's 128 dimensions turn, longrope (48 factors a set; the benchmark's sequences stay
# within the original 4 K context, but both sets and the attention factor on cos and sin are in the kernels), tied
# embeddings over a 200 K vocabulary
PHI4_MINI = dict(architectures=["Phi3ForCausalLM"], model_type="phi3", hidden_size=3072, num_hidden_layers=32,
                 num_attention_heads=24, num_key_value_heads=8, intermediate_size=8192, vocab_size=200064,
                 max_position_embeddings=131072, original_max_position_embeddings=4096, partial_rotary_factor=0.75,
                 tie_word_embeddings=True, rope_theta=10000.0,
                 rope_scaling=dict(type="longrope", short_factor=[1.0 + i / 48 for i in range(48)],
                                   long_factor=[1.0 + i for i in range(48)]))
# Gemma 3 1B: head_dim 256, one kv head, five sliding layers (window 512) to every full one, 262 K vocabulary
GEMMA3_1B = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text", hidden_size=1152, num_hidden_layers=26,
                 num_attention_heads=4, num_key_value_heads=1, head_dim=256, intermediate_size=6912,
                 vocab_size=262144, max_position_embeddings=32768, hidden_activation="gelu_pytorch_tanh",
                 query_pre_attn_scalar=256, sliding_window=512, sliding_window_pattern=6, rope_theta=1000000.0,
                 rope_local_base_freq=10000.0, tie_word_embeddings=True)
# Granite 3.1 8B: Llama-3-8B-like with its four multipliers and a 49 K vocabulary
GRANITE_8B = dict(architectures=["GraniteForCausalLM"], model_type="granite", hidden_size=4096, num_hidden_layers=40,
                  num_attention_heads=32, num_key_value_heads=8, intermediate_size=12800, vocab_size=49155,
                  max_position_embeddings=131072, rope_theta=10000000.0, tie_word_embeddings=True,
                  embedding_multiplier=12.0, attention_multiplier=0.0078125, residual_multiplier=0.22,
                  logits_scaling=16.0)
TINY = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            intermediate_size=128, vocab_size=512, max_position_embeddings=1024, rope_theta=10000.0)
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPECIALS = ("<unk>", "<s>", "</s>", "<pad>")  # ids 0..3, as in the demo tokenizer
_PEFT = dict(peft_type="LORA", task_type="CAUSAL_LM", base_model_name_or_path="random", revision=None,
             inference_mode=True, bias="none", lora_dropout=0.0, use_rslora=False, use_dora=False,
             fan_in_fan_out=False, init_lora_weights=True, layers_to_transform=None, layers_pattern=None,
             rank_pattern={}, alpha_pattern={}, modules_to_save=None, lora_bias=False)


def head_dim(shape: dict) -> int:
    """A shape's head_dim, where it gives one apart from hidden_size / num_attention_heads (Gemma 3)."""
    return shape.get("head_dim") or shape["hidden_size"] // shape["num_attention_heads"]


def proj_dims(shape: dict) -> dict[str, tuple[int, int]]:
    """(in, out) features of each LoRA target projection."""
    h, inter = shape["hidden_size"], shape["intermediate_size"]
    q, kv = shape["num_attention_heads"] * head_dim(shape), shape["num_key_value_heads"] * head_dim(shape)
    return {"q_proj": (h, q), "k_proj": (h, kv), "v_proj": (h, kv), "o_proj": (q, h),
            "gate_proj": (h, inter), "up_proj": (h, inter), "down_proj": (inter, h)}


def adapter_bytes(shape: dict, rank: int, esize: int) -> int:
    """Bytes of one adapter on all seven projections (what a decode step reads per active adapter)."""
    return esize * rank * shape["num_hidden_layers"] * sum(i + o for i, o in proj_dims(shape).values())


def weight_bytes(shape: dict, esize: int, head_esize: int | None = None) -> int:
    """Weights a decode step reads: every layer's projections (esize bytes an element) and the LM head
    (head_esize, default esize: FP8 projections keep a bfloat16 head); embedding rows are negligible."""
    layers = shape["num_hidden_layers"] * sum(i * o for i, o in proj_dims(shape).values())
    return esize * layers + (head_esize or esize) * shape["vocab_size"] * shape["hidden_size"]


def kv_bytes_per_token(shape: dict, esize: int) -> int:
    return esize * 2 * shape["num_hidden_layers"] * shape["num_key_value_heads"] * head_dim(shape)


def add_physics(row: dict, base: dict, shape: dict, esize: int, bw: float, tp: int,
                overrides: dict | None = None) -> dict:
    """The row's ratios to its base and its bytes' bound. overrides: its engine's --variant fields (FP8 weights
    or an FP8 KV cache read one byte an element, LoRA weights stay in esize)."""
    overrides = overrides or {}
    weights = 1 if overrides.get("quantization") == "fp8" else esize
    kv = 1 if str(overrides.get("kv_cache_dtype", "")).startswith("fp8") else esize
    if row["rank"] == 0:
        read = weight_bytes(shape, weights, esize) + row["kv_tokens"] * kv_bytes_per_token(shape, kv)
        extra = row["decode_ms"]
    else:
        read = row["adapters"] * adapter_bytes(shape, row["rank"], esize)
        extra = row["decode_ms"] - base["decode_ms"]
    bound = 1e3 * read / tp / bw  # each of tp ranks reads about 1/tp of the bytes at its own bandwidth
    physics = dict(x_base=row["tok_s"] / base["tok_s"], x_decode=base["decode_ms"] / row["decode_ms"], extra_ms=extra,
                   bound_ms=bound, x_bound=extra / bound if bound else float("nan"))  # none-r{R}: no adapter bytes
    if row["rank"]:
        physics["x_decode_ceiling"] = base["decode_ms"] / (base["decode_ms"] + bound)
    return dict(row, **physics)


def write_model_dir(path: Path, shape: dict) -> Path:
    """config.json for the shape, the demo's tokenizer_config.json and a word-level tokenizer over the vocab."""
    path.mkdir(parents=True, exist_ok=True)
    config = dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_act="silu", rms_norm_eps=1e-5,
                  head_dim=head_dim(shape), attention_bias=False, mlp_bias=False, tie_word_embeddings=False,
                  bos_token_id=1, eos_token_id=2, pad_token_id=3, torch_dtype="bfloat16")
    config.update(shape)
    (path / "config.json").write_text(json.dumps(config, indent=2))
    shutil.copy(ensure_demo_checkpoint().model_dir / "tokenizer_config.json", path / "tokenizer_config.json")
    vocab = {tok: i for i, tok in enumerate(SPECIALS)}
    vocab.update({f"t{i}": i for i in range(len(SPECIALS), shape["vocab_size"])})
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    tok.add_special_tokens(list(SPECIALS))
    tok.save(str(path / "tokenizer.json"))
    return path


class AdapterPools:
    """Registered adapter directories by (pool, rank), sharing a few weight files per rank."""

    def __init__(self, root: Path, shape: dict, dtype: torch.dtype, num_files: int = 4) -> None:
        self.root, self.shape, self.dtype, self.num_files = root, shape, dtype, num_files
        self._files: dict[int, list[Path]] = {}
        self._pools: dict[tuple[str, int], list[LoRARequest]] = {}
        self._next_id = 1

    def weight_files(self, rank: int) -> list[Path]:
        if rank not in self._files:
            files = []
            for k in range(self.num_files):
                gen = torch.Generator().manual_seed(1000 * rank + k)
                tensors = {}
                for layer in range(self.shape["num_hidden_layers"]):
                    for proj, (d_in, d_out) in proj_dims(self.shape).items():
                        block = "self_attn" if proj in PROJECTIONS[:4] else "mlp"
                        key = f"base_model.model.model.layers.{layer}.{block}.{proj}"
                        tensors[key + ".lora_A.weight"] = (torch.randn(rank, d_in, generator=gen)
                                                           / math.sqrt(d_in)).to(self.dtype)
                        tensors[key + ".lora_B.weight"] = (0.01 * torch.randn(d_out, rank, generator=gen)
                                                           ).to(self.dtype)
                path = self.root / "weights" / f"r{rank}-{k}.safetensors"
                path.parent.mkdir(parents=True, exist_ok=True)
                save_file(tensors, str(path), metadata={"format": "pt"})
                files.append(path)
            self._files[rank] = files
        return self._files[rank]

    def pool(self, name: str, rank: int, size: int) -> list[LoRARequest]:
        """`size` adapters named <name>-r<rank>-<i>, each with its own directory and lora_int_id."""
        key = (name, rank)
        if key not in self._pools or len(self._pools[key]) < size:
            files = self.weight_files(rank)
            have = self._pools.setdefault(key, [])
            config = json.dumps(dict(_PEFT, r=rank, lora_alpha=rank, target_modules=list(PROJECTIONS)))
            for i in range(len(have), size):
                d = self.root / "adapters" / f"{name}-r{rank}-{i}"
                d.mkdir(parents=True, exist_ok=True)
                (d / "adapter_config.json").write_text(config)
                (d / "adapter_model.safetensors").symlink_to(files[i % len(files)])
                have.append(LoRARequest(d.name, self._next_id, str(d)))
                self._next_id += 1
        return self._pools[key][:size]


@dataclass
class Request:
    prompt_ids: list[int]
    max_tokens: int
    arrival: float  # seconds after the start (Poisson); 0 in a closed loop
    adapter: int | None  # index into the scenario's adapter pool


def make_requests(n: int, in_range: tuple[int, int], out_range: tuple[int, int], vocab: int,
                  rate: float | None, seed: int = 0) -> list[Request]:
    """Lengths uniform in the ranges, random prompt ids; the same for every scenario of a run."""
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        t += rng.expovariate(rate) if rate else 0.0
        prompt = [rng.randrange(len(SPECIALS), vocab) for _ in range(rng.randint(*in_range))]
        reqs.append(Request(prompt, rng.randint(*out_range), t, None))
    return reqs


def assign_adapters(reqs: list[Request], popularity: str, pool_size: int, seed: int = 1) -> list[Request]:
    """none | one | one<P> (one adapter for P% of requests, the base model for the rest) | distinct (request i ->
    adapter i) | uniform | zipf (P(k) ~ (k+1)^-1.5) over pool_size."""
    rng = random.Random(seed)
    weights = [(k + 1) ** -1.5 for k in range(pool_size)] if popularity == "zipf" else None
    out = []
    kind, share = ("one", int(popularity[3:] or 100) / 100) if popularity.startswith("one") else (popularity, 1.0)
    for i, r in enumerate(reqs):
        adapter = {"none": None, "one": 0 if share == 1.0 or rng.random() < share else None, "distinct": i,
                   "uniform": rng.randrange(pool_size) if popularity == "uniform" else None,
                   "zipf": rng.choices(range(pool_size), weights)[0] if weights else None}[kind]
        out.append(Request(r.prompt_ids, r.max_tokens, r.arrival, adapter))
    return out


def copy_bandwidth(device: torch.device) -> float:
    """Bytes read + written per second by a large tensor copy (1 GiB on GPU, 64 MiB on CPU), median."""
    if device.type == "cuda":
        src = torch.empty(1 << 29, dtype=torch.float16, device=device).normal_()
        dst = torch.empty_like(src)
        times = []
        for i in range(25):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src)
            end.record()
            end.synchronize()
            if i >= 5:
                times.append(start.elapsed_time(end) * 1e-3)
    else:
        src = torch.randn(1 << 24)
        dst = torch.empty_like(src)
        times = []
        for i in range(12):
            t0 = time.perf_counter()
            dst.copy_(src)
            if i >= 2:
                times.append(time.perf_counter() - t0)
    return 2 * src.numel() * src.element_size() / statistics.median(times)


def percentile(values: list[float], q: float) -> float:
    if not values:
        return float("nan")
    s = sorted(values)
    pos = (len(s) - 1) * q / 100
    lo = int(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


class Recorder:
    """Per-step wall time and shape (wrapping engine._step_input), adapter loads from disk (rank 0's
    background loads and synchronous reloads, on threads or in loader processes), and when each request
    joined the scheduler (after its adapter's load) and first ran (TTFT's parts)."""

    def __init__(self, engine: LLMEngine) -> None:
        self.steps: list[tuple[float, bool, int, int, int]] = []  # seconds, prefill, batch, adapters, kv tokens
        self.loads, self._last = 0, None
        self.admitted: dict[str, float] = {}  # request id -> when it joined the scheduler's queue
        self.started: dict[str, float] = {}  # request id -> when a step first scheduled it
        make_input, add = engine._step_input, engine.scheduler.add

        def recording(out, previous):
            now = time.perf_counter()
            for s in out.scheduled:
                self.started.setdefault(s.seq.request_id, now)
            inputs = make_input(out, previous)
            self._last = inputs[0]
            return inputs

        def admitting(seq):
            self.admitted.setdefault(seq.request_id, time.perf_counter())
            return add(seq)

        engine._step_input, engine.scheduler.add = recording, admitting
        runner = getattr(engine.executor, "runner", None)
        self.manager = getattr(runner, "lora_manager", None)  # rank 0's: its host-to-slot copies
        if runner is not None and runner.loads is not None:
            # Every disk load goes through exactly one of them: a background load, or a synchronous reload.
            for owner, name in ((runner.loads, "load_prepared"), (runner, "_register")):
                setattr(owner, name, self._counted(getattr(owner, name)))

    def _counted(self, load):
        def counting(*args):
            self.loads += 1
            return load(*args)
        return counting

    def record(self, seconds: float) -> None:
        s, self._last = self._last, None
        if s is not None:
            self.steps.append((seconds, s.is_prefill, len(s.sample_rows), len({i for i in s.sample_lora_ids if i}),
                               sum(s.seq_lens)))


def drive(engine: LLMEngine, rec: Recorder, reqs: list[Request], loras: list, concurrency: int,
          rate: float | None, tag: str, sampling: dict | None = None) -> dict:
    """Run reqs to completion (closed loop of `concurrency`, or Poisson arrivals); per-request times.
    sampling: SamplingParams fields for every request (default greedy)."""
    pending, active = deque(range(len(reqs))), 0
    added, first, done, ntok = {}, {}, {}, {}
    rec.steps.clear()
    loads0 = rec.loads
    copies0 = dict(rec.manager.host_copies) if rec.manager is not None else {}
    t0 = time.perf_counter()
    while True:
        now = time.perf_counter()
        while pending and (t0 + reqs[pending[0]].arrival <= now if rate else active < concurrency):
            i = pending.popleft()
            r = reqs[i]
            added[i] = t0 + r.arrival if rate else time.perf_counter()  # a load in add_request counts
            engine.add_request(f"{tag}-{i}", {"prompt_token_ids": r.prompt_ids},
                               SamplingParams(max_tokens=r.max_tokens, ignore_eos=True,
                                              **(sampling or {"temperature": 0.0})),
                               None if r.adapter is None else loras[r.adapter])
            active += 1
        if not engine.has_unfinished_requests():
            if not pending:
                break
            time.sleep(max(0.0, t0 + reqs[pending[0]].arrival - time.perf_counter()))
            continue
        start = time.perf_counter()
        outputs = engine.step()
        end = time.perf_counter()
        rec.record(end - start)
        for out in outputs:
            if out.error is not None:
                raise RuntimeError(f"request {out.request_id} failed: {out.error!r}")
            i = int(out.request_id.rsplit("-", 1)[1])
            if out.outputs[0].token_ids and i not in first:
                first[i] = end
            if out.finished:
                done[i], ntok[i] = end, len(out.outputs[0].token_ids)
                active -= 1
    copies = {k: v - copies0[k] for k, v in rec.manager.host_copies.items()} if rec.manager is not None else {}
    ids = {i: f"{tag}-{i}" for i in done}
    return dict(added=added, first=first, done=done, ntok=ntok, wall=max(done.values()) - t0,
                steps=list(rec.steps), loads=rec.loads - loads0, copies=copies,
                admitted={i: rec.admitted[r] for i, r in ids.items() if r in rec.admitted},
                started={i: rec.started[r] for i, r in ids.items() if r in rec.started})


def summarize(name: str, rank: int, registered: int, run: dict, concurrency: int) -> dict:
    ntok = run["ntok"]
    ttft = [run["first"][i] - run["added"][i] for i in ntok]
    # TTFT's parts: until the request joined the queue (its adapter's load), queued, first step to first token
    split = [(run["admitted"][i] - run["added"][i], run["started"][i] - run["admitted"][i],
              run["first"][i] - run["started"][i]) for i in ntok if i in run["admitted"] and i in run["started"]]
    tpot = [(run["done"][i] - run["first"][i]) / (n - 1) for i, n in ntok.items() if n > 1]
    decode = [s for s in run["steps"] if not s[1]]
    full = [s for s in decode if s[2] == concurrency]
    use = full if len(full) >= 5 else decode
    mean = (lambda xs: statistics.fmean(xs) if xs else float("nan"))
    return dict(scenario=name, rank=rank, registered=registered, requests=len(ntok), tokens=sum(ntok.values()),
                wall_s=run["wall"], tok_s=sum(ntok.values()) / run["wall"],
                ttft_p50_ms=1e3 * percentile(ttft, 50), ttft_p99_ms=1e3 * percentile(ttft, 99),
                tpot_p50_ms=1e3 * percentile(tpot, 50), tpot_p99_ms=1e3 * percentile(tpot, 99),
                **{f"ttft_{part}_p50_ms": 1e3 * percentile([s[k] for s in split], 50)
                   for k, part in enumerate(("load", "queue", "first"))},
                decode_ms=1e3 * percentile([s[0] for s in use], 50), decode_batch=mean([s[2] for s in use]),
                decode_steps=len(use), adapters=mean([s[3] for s in use]), kv_tokens=mean([s[4] for s in use]),
                loads=run["loads"], slot_copies_in_step=run["copies"].get("in_step", 0),
                slot_copies_ahead=run["copies"].get("ahead", 0), **time_breakdown(run))


def time_breakdown(run: dict) -> dict:
    """Where the wall time went: decode-only steps (with their mean batch), steps with prompt tokens,
    and time outside engine.step (add_request, the driver)."""
    decode = [s for s in run["steps"] if not s[1]]
    prompt = [s for s in run["steps"] if s[1]]
    decode_s, prompt_s = sum(s[0] for s in decode), sum(s[0] for s in prompt)
    return dict(decode_s=decode_s, decode_steps_all=len(decode), prompt_s=prompt_s, prompt_steps=len(prompt),
                outside_s=run["wall"] - decode_s - prompt_s,
                decode_rows=statistics.fmean([s[2] for s in decode]) if decode else float("nan"))
