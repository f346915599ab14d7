"""Engine benchmark (issue 3): throughput and latency of LLMEngine with and without LoRA, and against HF + PEFT.

A Llama-3-8B-shaped model with random weights (load_format="dummy", bf16 on
GPU) serves an S-LoRA-style workload: input and output lengths uniform in
[8, 512], random prompt ids, greedy, ignore_eos, a closed loop of C concurrent
requests (or Poisson arrivals with --rate), driven through
LLMEngine.add_request / step. The same requests run in every scenario:
  base               no LoRA (enable_lora off);
  none-r{R}          base's requests on the engine with LoRA on (what enable_lora costs them);
  one-r{R}           one adapter for every request (runs merged: replicas/lora_merge.py);
  one97-r{R}         the same adapter for 97% (90%) of requests, the base model for the rest;
  one90-r{R}
  distinct-r{R}      every request its own adapter;
  uniform{N}-r{R}    uniform / Zipf(1.5) popularity over N = 100, 1,000 adapter
  zipf{N}-r{R}       directories (> max_loras GPU slots and > max_cpu_loras host entries);
  <row>+NAME         with --variant NAME:FIELD=VALUE[,...]: the same row on an engine built with
                     those EngineArgs fields changed (e.g. sync:async_scheduling=0); a LoRA
                     twin's x base is against base+NAME, base+NAME's against base;
  hf                 Llama-3.2-1B shape, 32 distinct rank-16 adapters in one batch of 32
                     (128-token prompts, 64 new tokens): HF transformers + PEFT generate
                     with adapter_names=, against ours on the same adapter files.
Adapters (ranks 16 and 64, all seven projections) are registered lazily, by the
first request that names them, so their disk loads are part of the measurement.
Columns: tok/s = generated tokens / wall; TTFT = add (or Poisson arrival) to
the first token; TPOT = (finish - first token) / (tokens - 1); x base = tok/s
over base's; dec ms = median pure-decode step at batch C; x dec = base's dec ms
over this row's (the same ratio without prompt steps, whose time varies more
between engines of one call: bench/RESULTS.md, tenth session); #ad = distinct
adapters in those steps; loads = adapter loads from disk. Physics: base's
bound = weights + KV read per decode step, extra = its decode step; LoRA rows'
bound = #ad x bytes per adapter, extra = decode step minus base's; both over
the device-to-device copy bandwidth measured in this run (read + write
bytes). x bnd = extra / bound; ceil = base's dec ms / (that + bound), the
highest x dec that the adapter bytes alone allow (a LoRA row's target above
it is out of reach at that batch size). Prints rows as they finish, a table last, then
where each row's wall time went (lines starting "time", ending with the adapter
copies from host memory into GPU slots that steps waited for / that prefetches
made ahead, under a running step) and which Triton kernel
variants compiled while a row ran (bench/triton_compiles.py; those that the
engine's warm-up leaves to serving mostly compile in the bench's warm requests
before the rows, which span the rows' prompt lengths, and are named there);
CSV to $OUT (or bench/out), rewritten after every row.

    python bench/engine.py                                     # everything (> 10 min on one GPU)
    python bench/engine.py --scenarios 'base,*-r16'            # base is run whenever a LoRA row is
    python bench/engine.py --tiny                              # tiny model on CPU, < 1 min
    python bench/engine.py --scenarios 'base,distinct-r16*' --variant th:lora_load_processes=0   # loads on threads
"""

from __future__ import annotations

import argparse
import csv
import dataclasses
import fnmatch
import gc
import os
import random
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from bench.engine_workload import (GEMMA3_1B, GRANITE_8B, LLAMA3_8B, LLAMA32_1B,  # noqa: E402
                                   PHI3_MINI, PHI4_MINI, QWEN3_8B, TINY, AdapterPools, Recorder, Request,
                                   add_physics, assign_adapters, copy_bandwidth, drive,
                                   make_requests, summarize, write_model_dir)
from bench.triton_compiles import CompileLog  # noqa: E402
from replicas.engine import EngineArgs, LLMEngine  # noqa: E402

POPULARITIES = (("none", "none", 1), ("one", "one", 1), ("one97", "one97", 1), ("one90", "one90", 1),
                ("distinct", "distinct", 0), ("uniform100", "uniform", 100), ("zipf100", "zipf", 100),
                ("uniform1000", "uniform", 1000), ("zipf1000", "zipf", 1000))
GPU = dict(num_requests=128, concurrency=32, input_len=(8, 512), output_len=(8, 512), hf_batch=32, hf_prompt=128,
           hf_new=64)
CPU_TINY = dict(num_requests=12, concurrency=4, input_len=(4, 24), output_len=(2, 12), hf_batch=4, hf_prompt=16,
                hf_new=8)
COLUMNS = [("scenario", "{:16}", "s"), ("rank", "{:>3}", "d"), ("registered", "{:>5}", "d"),
           ("tok_s", "{:>8}", ".1f"), ("ttft_p50_ms", "{:>7}", ".1f"), ("ttft_p99_ms", "{:>7}", ".1f"),
           ("tpot_p50_ms", "{:>7}", ".2f"), ("tpot_p99_ms", "{:>7}", ".2f"), ("x_base", "{:>6}", ".3f"),
           ("decode_ms", "{:>7}", ".2f"), ("x_decode", "{:>6}", ".3f"), ("adapters", "{:>5}", ".1f"),
           ("loads", "{:>5}", "d"),
           ("extra_ms", "{:>7}", ".2f"), ("bound_ms", "{:>7}", ".2f"), ("x_bound", "{:>6}", ".2f"),
           ("x_decode_ceiling", "{:>6}", ".3f")]
HEADS = ["scenario", "r", "#reg", "tok/s", "ttft50", "ttft99", "tpot50", "tpot99", "x base", "dec ms", "x dec", "#ad",
         "loads", "extra", "bound", "x bnd", "ceil"]


# Every request's sampling: greedy, as the recorded rows ran, or random as most traffic samples
# (bench/sampling_settings.py measures what each setting costs).
SAMPLING = {"greedy": {"temperature": 0.0}, "random": {"temperature": 0.8, "top_p": 0.95, "top_k": 50},
            "nucleus": {"temperature": 0.8, "top_p": 0.95}}  # nucleus: the OpenAI clients' form, no top_k


def scenarios(ranks: list[int], variants: tuple[str, ...] = ()) -> dict[str, tuple[str, int, int, str]]:
    """name -> (popularity, pool size (0: one per request), rank, variant ("" = the default engine)).

    Every row gets a twin "<name>+<variant>" per variant, run in the same call.
    """
    table = {"base": ("none", 0, 0, "")}
    table.update({f"base+{v}": ("none", 0, 0, v) for v in variants})
    for r in ranks:
        for variant in ("",) + tuple(variants):
            suffix = f"+{variant}" if variant else ""
            table.update({f"{name}-r{r}{suffix}": (pop, size, r, variant) for name, pop, size in POPULARITIES})
    return table


def parse_variant(text: str) -> tuple[str, dict]:
    """"lp:lora_load_processes=2,lora_compact_slots=False" -> ("lp", {field: int, bool or str value, ...})."""
    name, _, fields = text.partition(":")
    known = {f.name for f in dataclasses.fields(EngineArgs)}
    overrides = {}
    for item in filter(None, fields.split(",")):
        key, _, value = item.partition("=")
        if key not in known or not value:
            raise SystemExit(f"--variant {text!r}: {key!r} is not an EngineArgs field=value")
        overrides[key] = _value(value)
    if not name or not overrides:
        raise SystemExit(f"--variant {text!r}: expected NAME:FIELD=VALUE[,FIELD=VALUE]")
    return name, overrides


def _value(text: str):
    """A --variant value as the field wants it: int, float (0.0005, 1e-3), True / False, None, or the text."""
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return {"True": True, "False": False, "None": None}.get(text, text)


def fmt(row: dict) -> str:
    return " ".join(spec.format(format(row[key], f) if key in row else "-") for key, spec, f in COLUMNS)


def header() -> str:
    return " ".join(spec.format(h) for (_, spec, _), h in zip(COLUMNS, HEADS))


def write_csv(path: Path, rows: list[dict]) -> None:
    fields = list(dict.fromkeys(k for r in rows for k in r))
    with open(path, "w", newline="") as f:
        writer = csv.DictWriter(f, fieldnames=fields, restval="")
        writer.writeheader()
        writer.writerows(rows)


def make_engine(model_dir: Path, a, rank: int, max_loras: int, max_seqs: int, max_len: int,
                batched_tokens: int = 2048, max_cpu_loras: int | None = None,
                overrides: dict | None = None) -> LLMEngine:
    args = dict(model=str(model_dir), tensor_parallel_size=a.tp, dtype=a.dtype, enable_lora=rank > 0,
                max_loras=max_loras, max_lora_rank=max(rank, 1), max_cpu_loras=max_cpu_loras,
                num_kv_blocks=max_seqs * -(-max_len // 16) + 8, max_num_seqs=max_seqs,
                max_num_batched_tokens=max(batched_tokens, max_len), enable_prefix_caching=False,
                load_format="dummy")
    return LLMEngine(EngineArgs(**args | (overrides or {})))  # a --variant may change any of them


def engine_rows(a, names: list[str], table: dict, model_dir: Path, pools: AdapterPools, reqs: list[Request],
                emit) -> None:
    """One engine per (rank, variant) (rank 0 = base): warm it up, then run each of its scenarios."""
    for rank, variant in dict.fromkeys(table[n][2:] for n in names):
        t_build = time.perf_counter()
        engine = make_engine(model_dir, a, rank, a.max_loras, a.max_num_seqs, a.input_len[1] + a.output_len[1],
                             max_cpu_loras=a.max_cpu_loras, overrides=a.variants.get(variant))
        rec = Recorder(engine)
        # Warm requests over the rows' whole prompt-length range, so that kernel variants the engine's own
        # warm-up leaves to serving compile here rather than in the first measured row (the log names them).
        warm = make_requests(a.concurrency, tuple(a.input_len), (a.output_len[0], min(16, a.output_len[1])),
                             pools.shape["vocab_size"], None, seed=9)
        warm_pool = pools.pool("warm", rank, a.concurrency) if rank else []
        with CompileLog() as compiled:
            for pop in (("distinct", "one") if rank else ("none",)):
                drive(engine, rec, assign_adapters(warm, pop, 1), warm_pool, a.concurrency, None, f"warm-{pop}")
        print(f"# engine rank {rank}{f' {variant} {a.variants[variant]}' if variant else ''}: built and warmed up in "
              f"{time.perf_counter() - t_build:.1f} s; Triton variants its warm-up left to the warm requests: "
              f"{len(compiled.variants)}" + "".join(f"\n#   {v}" for v in compiled.variants), flush=True)
        for name in (n for n in names if table[n][2:] == (rank, variant)):
            pop, size, _, _ = table[name]
            size = size or len(reqs)
            loras = pools.pool(name.rsplit("-", 1)[0], rank, size) if rank else []
            merges = engine.executor.call("lora_merge_state")[1]
            with CompileLog() as compiled:  # kernel variants the engine's warm-up left to serving
                run = drive(engine, rec, assign_adapters(reqs, pop, size), loras, a.concurrency, a.rate, name,
                            SAMPLING[a.sampling])
            emit(dict(summarize(name, rank, size if rank and pop != "none" else 0, run, a.concurrency),
                      compiles=len(compiled.variants), compiled="; ".join(compiled.variants),
                      merges=engine.executor.call("lora_merge_state")[1] - merges))
        engine.shutdown()
        del engine, rec
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def hf_rows(a, work: Path, dtype: torch.dtype, emit) -> None:
    """HF transformers + PEFT generate with adapter_names (one mixed batch) vs ours, same shape and adapters."""
    import peft
    import transformers

    shape = TINY if a.tiny else LLAMA32_1B
    model_dir = write_model_dir(work / "model-1b", shape)
    loras = AdapterPools(work / "lora-1b", shape, dtype, a.weight_files).pool("hf", 16, a.hf_batch)
    rng = random.Random(2)
    prompts = [[rng.randrange(4, shape["vocab_size"]) for _ in range(a.hf_prompt)] for _ in range(a.hf_batch)]
    reqs = [Request(p, a.hf_new, 0.0, i) for i, p in enumerate(prompts)]
    n = a.hf_batch
    engine = make_engine(model_dir, a, 16, n, n, a.hf_prompt + a.hf_new, n * a.hf_prompt)
    rec = Recorder(engine)
    drive(engine, rec, [Request(r.prompt_ids, 4, 0.0, r.adapter) for r in reqs], loras, n, None, "warm")
    ours = drive(engine, rec, reqs, loras, n, None, "ours")
    engine.shutdown()
    del engine, rec
    gc.collect()
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    with torch.device(device):
        base = transformers.AutoModelForCausalLM.from_config(transformers.AutoConfig.from_pretrained(model_dir),
                                                             dtype=dtype)
    model = peft.PeftModel.from_pretrained(base, loras[0].lora_path, adapter_name=loras[0].lora_name)
    for lora in loras[1:]:
        model.load_adapter(lora.lora_path, adapter_name=lora.lora_name)
    model.eval()
    ids = torch.tensor(prompts, device=device)

    def generate(new: int, names: list[str]) -> float:
        start = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), adapter_names=names,
                                 max_new_tokens=new, min_new_tokens=new, do_sample=False, pad_token_id=3)
        if device.type == "cuda":
            torch.cuda.synchronize()
        return (out.shape[1] - ids.shape[1]) * n / (time.perf_counter() - start)

    names = [lora.lora_name for lora in loras]
    generate(2, names)
    hf_base = generate(a.hf_new, ["__base__"] * n)
    hf = generate(a.hf_new, names)
    model = base = None  # free HF's model before our rows' numbers are emitted
    gc.collect()
    tok_s = sum(ours["ntok"].values()) / ours["wall"]
    emit(dict(scenario="hf-peft-base", rank=0, registered=0, tok_s=hf_base))
    emit(dict(scenario="hf-peft-distinct", rank=16, registered=n, tok_s=hf))
    emit(dict(scenario="ours-distinct", rank=16, registered=n, tok_s=tok_s, x_hf=tok_s / hf))


MODELS = {"llama3-8b": LLAMA3_8B, "qwen3-8b": QWEN3_8B, "phi3-mini": PHI3_MINI, "phi4-mini": PHI4_MINI,
          "gemma3-1b": GEMMA3_1B, "granite-8b": GRANITE_8B}


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tiny", action="store_true", help="tiny model and lengths: the whole run on CPU in < 1 min")
    p.add_argument("--model", choices=sorted(MODELS), default="llama3-8b", help="the model's shape (without --tiny)")
    p.add_argument("--scenarios", default="all", help="comma-separated names or globs (e.g. 'base,*-r16,hf')")
    p.add_argument("--out", default=None, help="CSV directory (default $OUT, else bench/out)")
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 64])
    p.add_argument("--num-requests", type=int)
    p.add_argument("--concurrency", type=int, help="closed loop: requests in flight")
    p.add_argument("--rate", type=float, default=None, help="Poisson arrivals per second instead of a closed loop")
    p.add_argument("--input-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, metavar=("MIN", "MAX"))
    p.add_argument("--max-loras", type=int, help="GPU slots (default: concurrency)")
    p.add_argument("--max-cpu-loras", type=int, default=None, help="host LRU entries (default 2 x max-loras)")
    p.add_argument("--max-num-seqs", type=int, default=None, help="default: max(64, concurrency)")
    p.add_argument("--weight-files", type=int, default=4, help="distinct adapter weight files per rank")
    p.add_argument("--hf-batch", type=int)
    p.add_argument("--hf-prompt", type=int)
    p.add_argument("--hf-new", type=int)
    p.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    p.add_argument("--variant", action="append", default=[], metavar="NAME:FIELD=VALUE[,...]",
                   help="also run every row as '<row>+NAME' on an engine with these EngineArgs changed")
    p.add_argument("--dtype", default="auto", help="auto: bfloat16 on GPU, float32 on CPU")
    p.add_argument("--sampling", choices=sorted(SAMPLING), default="greedy",
                   help="every request's sampling (random: temperature 0.8, top_p 0.95, top_k 50; nucleus: "
                        "the same without top_k)")
    p.add_argument("--workdir", default=None, help="where model dirs and adapters go (default: a temp dir)")
    a = p.parse_args(argv)
    for key, value in (CPU_TINY if a.tiny else GPU).items():
        if getattr(a, key) is None:
            setattr(a, key, value)
    a.max_loras = a.max_loras or a.concurrency
    a.max_num_seqs = a.max_num_seqs or max(64, a.concurrency)
    return a


def main(argv: list[str] | None = None) -> list[dict]:
    a = parse_args(argv)
    torch.manual_seed(0)
    if a.tiny and not torch.cuda.is_available():
        torch.set_num_threads(1)  # tiny ops: on a 2-core CI box, 2 threads made a softmax 100x slower (2.5 ms)
    a.variants = dict(parse_variant(v) for v in a.variant)
    table = scenarios(a.ranks, tuple(a.variants))
    known = list(table) + ["hf"]
    picked = [n for n in known if any(fnmatch.fnmatch(n, pat) for pat in a.scenarios.split(","))] \
        if a.scenarios != "all" else known
    if not picked:
        sys.exit(f"--scenarios {a.scenarios!r} matches none of {known}")
    engine_names = [n for n in picked if n != "hf"]
    if engine_names and "base" not in engine_names:
        engine_names.insert(0, "base")  # every LoRA row is compared with it
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = {"auto": torch.bfloat16 if device.type == "cuda" else torch.float32}.get(a.dtype) \
        or getattr(torch, a.dtype)
    a.dtype = str(dtype).removeprefix("torch.")
    esize = torch.empty((), dtype=dtype).element_size()
    shape = TINY if a.tiny else MODELS[a.model]
    out_dir = Path(a.out or os.environ.get("OUT") or Path(__file__).parent / "out")
    out_dir.mkdir(parents=True, exist_ok=True)
    csv_path = out_dir / ("engine_tiny.csv" if a.tiny else "engine.csv")
    bw = copy_bandwidth(device)
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()
    name = torch.cuda.get_device_name() if device.type == "cuda" else "cpu"
    print(f"device {name}  copy bandwidth {bw / 1e12:.3f} TB/s (read+write)  {a.dtype}  tp {a.tp}\n"
          f"model {'tiny' if a.tiny else a.model + ' shape'}  requests {a.num_requests}  "
          + (f"Poisson {a.rate}/s" if a.rate else f"closed loop {a.concurrency}")
          + f"  in {a.input_len}  out {a.output_len}  max_loras {a.max_loras}  "
          f"max_cpu_loras {a.max_cpu_loras or 2 * a.max_loras}  ranks {a.ranks}", flush=True)
    rows: list[dict] = []
    bases: dict[str, dict] = {}  # variant ("" = default) -> its base row

    def base_of(variant: str) -> dict:
        def settings(v: str) -> dict:
            return {k: x for k, x in (a.variants.get(v) or {}).items() if not k.startswith("lora_")}
        if variant in bases:
            return bases[variant]
        return next((row for v, row in bases.items() if settings(v) == settings(variant)), bases[""])

    def emit(row: dict) -> None:
        variant = row["scenario"].partition("+")[2]
        if row.get("rank") == 0:
            bases[variant] = row
        if "decode_ms" in row:
            # LoRA rows against the base row of their own engine settings (or of a variant that differs in LoRA
            # fields only: f8s's rows against base+f8); base twins against the default
            base = bases[""] if row["rank"] == 0 else base_of(variant)
            row = add_physics(row, base, shape, esize, bw, a.tp, a.variants.get(variant))
        row = dict(row, device=name, copy_tb_s=bw / 1e12)
        rows.append(row)
        print(("\n" + header() + "\n" if len(rows) == 1 else "") + fmt(row)
              + (f"   x hf {row['x_hf']:.1f}" if "x_hf" in row else ""), flush=True)
        write_csv(csv_path, rows)

    with tempfile.TemporaryDirectory(prefix="bench-engine-", dir=a.workdir) as tmp:
        work = Path(tmp)
        if engine_names:
            pools = AdapterPools(work / "lora", shape, dtype, a.weight_files)
            for name_ in engine_names:  # directories first: the 1,000-adapter pools take seconds, not run time
                pop, size, rank, _ = table[name_]
                if rank:
                    pools.pool(name_.rsplit("-", 1)[0], rank, size or a.num_requests)
            reqs = make_requests(a.num_requests, tuple(a.input_len), tuple(a.output_len), shape["vocab_size"],
                                 a.rate)
            engine_rows(a, engine_names, table, write_model_dir(work / "model", shape), pools, reqs, emit)
        if "hf" in picked:
            hf_rows(a, work, dtype, emit)
    print("\n" + header())
    for row in rows:
        print(fmt(row) + (f"   x hf {row['x_hf']:.1f}" if "x_hf" in row else ""))
    print("\nwhere the wall time went (s): decode-only steps (count, mean rows), steps with prompt tokens, outside;"
          " adapter copies host -> GPU slot that a step waited for / made ahead under a running step")
    for row in rows:
        if "decode_s" in row:
            print(f"time {row['scenario']:18} wall {row['wall_s']:6.2f}  decode {row['decode_s']:6.2f} "
                  f"({row['decode_steps_all']:5d}, {row['decode_rows']:5.1f} rows)  prompt {row['prompt_s']:6.2f} "
                  f"({row['prompt_steps']:4d})  outside {row['outside_s']:6.2f}  Triton compiles {row['compiles']}"
                  f"  slot copies {row['slot_copies_in_step']} / {row['slot_copies_ahead']}  merges {row['merges']}"
                  "  TTFT p50 parts (ms): "
                  f"load {row['ttft_load_p50_ms']:.1f} queued {row['ttft_queue_p50_ms']:.1f} "
                  f"to first token {row['ttft_first_p50_ms']:.1f}")
    for row in rows:
        if row.get("compiled"):
            print(f"compiled while {row['scenario']} ran: {row['compiled']}")
    print(f"CSV: {csv_path}")
    return rows


if __name__ == "__main__":
    main()
