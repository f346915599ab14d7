"""bench/engine.py --tiny runs end to end on CPU: every scenario row printed with finite numbers, CSV written.

It runs as a subprocess (the real command line, its own process) on the tiny
model; the GPU run with the Llama-3-8B shape is recorded in bench/RESULTS.md.
Times are not checked, only that they were measured.
"""

from __future__ import annotations

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.timeouts import BENCH_RUN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]
ENGINE_ROWS = ["base"] + [f"{p}-r{r}" for r in (16, 64)
                          for p in ("none", "one", "one97", "one90", "distinct", "uniform100", "zipf100", "uniform1000",
                                    "zipf1000")]
HF_ROWS = ["hf-peft-base", "hf-peft-distinct", "ours-distinct"]
NUMERIC = 16  # columns after the scenario name in an engine row
X_BOUND = 14  # of those, x bnd


@pytest.fixture(scope="module")
def tiny_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("bench_engine")
    env = dict(os.environ, OUT=str(out))
    if not torch.cuda.is_available():  # the Triton kernels run in the interpreter on CPU
        env.setdefault("TRITON_INTERPRET", "1")
    env.setdefault("LORAFLEET_CACHE", str(tmp_path_factory.mktemp("cache")))
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), "--tiny"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=BENCH_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    return proc.stdout, out


def _rows(stdout: str) -> dict[str, list[str]]:
    """The final table: the last line printed for each scenario name."""
    rows = {}
    for line in stdout.splitlines():
        fields = line.split()
        if fields and fields[0] in ENGINE_ROWS + HF_ROWS:
            rows[fields[0]] = fields[1:]
    return rows


def test_every_scenario_row_has_finite_numbers(tiny_run):
    rows = _rows(tiny_run[0])
    assert set(rows) == set(ENGINE_ROWS + HF_ROWS), sorted(set(ENGINE_ROWS + HF_ROWS) - set(rows))
    assert rows["base"][-1] == "-"  # ceil: LoRA rows only
    for name in ENGINE_ROWS:
        values = [float(v) for v in (rows[name][:-1] if name == "base" else rows[name])]
        if name.startswith("none-"):  # base's requests on the LoRA engine: no adapter bytes, no x bound
            assert math.isnan(values[X_BOUND]) and float(rows[name][1]) == 0, rows[name]  # and none registered
            values[X_BOUND] = 0.0
        assert len(values) == NUMERIC - (name == "base") and all(math.isfinite(v) for v in values), (name, rows[name])
        assert values[2] > 0, name  # tok/s
    assert float(rows["base"][7]) == 1.0 and float(rows["base"][9]) == 1.0  # x base, x dec
    for name in HF_ROWS:
        assert math.isfinite(float(rows[name][2])) and float(rows[name][2]) > 0, (name, rows[name])
    assert "x hf" in tiny_run[0]


def test_wall_time_is_split_into_steps_and_the_rest(tiny_run):
    path = tiny_run[1] / "engine_tiny.csv"
    with open(path, newline="") as f:
        rows = {r["scenario"]: r for r in csv.DictReader(f)}
    for name in ENGINE_ROWS:
        r = {k: float(rows[name][k]) for k in ("wall_s", "decode_s", "prompt_s", "outside_s", "decode_rows")}
        assert r["decode_s"] > 0 and r["prompt_s"] > 0 and r["outside_s"] >= 0, (name, r)
        assert math.isclose(r["decode_s"] + r["prompt_s"] + r["outside_s"], r["wall_s"], rel_tol=1e-6), (name, r)
        assert 1 <= r["decode_rows"] <= 4, (name, r)  # the tiny run's closed loop of 4
    assert tiny_run[0].count("\ntime ") == len(ENGINE_ROWS)
    copies = {name: int(rows[name]["slot_copies_in_step"]) + int(rows[name]["slot_copies_ahead"]) for name in rows
              if name in ENGINE_ROWS}
    assert copies["base"] == 0 and copies["distinct-r16"] >= 1  # every distinct adapter reaches a slot once at least


def test_csv_holds_every_row(tiny_run):
    path = tiny_run[1] / "engine_tiny.csv"
    with open(path, newline="") as f:
        rows = {r["scenario"]: r for r in csv.DictReader(f)}
    assert set(rows) == set(ENGINE_ROWS + HF_ROWS)
    for name in ENGINE_ROWS:
        for key in ("tok_s", "ttft_p50_ms", "ttft_p99_ms", "tpot_p50_ms", "tpot_p99_ms", "x_base", "decode_ms",
                    "x_decode", "extra_ms", "bound_ms") + (() if name.startswith("none-") else ("x_bound",)):
            assert math.isfinite(float(rows[name][key])), (name, key, rows[name][key])
        # x dec: base's decode step over the row's (every row here runs on its rank's default engine)
        assert math.isclose(float(rows[name]["x_decode"]),
                            float(rows["base"]["decode_ms"]) / float(rows[name]["decode_ms"])), name
        if name != "base":  # the best x dec the adapter bytes allow: base's step plus their read time
            base_ms, bound = float(rows["base"]["decode_ms"]), float(rows[name]["bound_ms"])
            assert math.isclose(float(rows[name]["x_decode_ceiling"]), base_ms / (base_ms + bound)), name
        assert int(rows[name]["tokens"]) > 0
    assert int(rows["one-r16"]["loads"]) == 1  # registered once, reused by every request
    merges = {name: int(rows[name]["merges"]) for name in ENGINE_ROWS}  # merging is on by default on CUDA only
    assert all(n == 0 for n in merges.values()) if not torch.cuda.is_available() else merges["one-r16"] >= 1
    # TTFT's parts: a base request joins the queue as it is added; a distinct one after its adapter's load
    parts = {name: [float(rows[name][f"ttft_{p}_p50_ms"]) for p in ("load", "queue", "first")] for name in rows
             if name in ENGINE_ROWS}
    assert all(v >= 0 for name in parts for v in parts[name]), parts
    assert parts["base"][2] > 0 and parts["distinct-r16"][0] > 0, parts
    assert int(rows["base"]["loads"]) == 0
    assert int(rows["distinct-r16"]["loads"]) == int(rows["distinct-r16"]["requests"])
    assert math.isfinite(float(rows["ours-distinct"]["x_hf"]))


def test_compile_log_names_variants_and_keeps_the_previous_hook(monkeypatch):
    """bench/triton_compiles.CompileLog against a stand-in for triton.knobs.runtime (under the CPU
    interpreter nothing compiles, so the hook is driven directly): a variant is its kernel name plus its
    scalar constexprs by argument name; the hook that was installed before keeps being called and is back
    after the block."""
    from types import SimpleNamespace

    from bench import triton_compiles

    calls = []

    def previous(**kwargs):
        calls.append(kwargs["fn"].name)

    runtime = SimpleNamespace(jit_post_compile_hook=previous)
    monkeypatch.setattr(triton_compiles, "_knobs", lambda: runtime)
    fn = SimpleNamespace(name="_paged_attention_kernel", jit_function=SimpleNamespace(arg_names=["q_ptr", "BLOCK_Q"]))
    with triton_compiles.CompileLog() as log:
        assert runtime.jit_post_compile_hook == log.hook
        runtime.jit_post_compile_hook(key="k", repr="r", fn=fn, compile={"constants": {(1,): 64, (0,): None}},
                                      is_manual_warmup=False, already_compiled=False)
    assert log.variants == ["_paged_attention_kernel BLOCK_Q=64"] and calls == ["_paged_attention_kernel"]
    assert runtime.jit_post_compile_hook is previous


def test_rows_count_the_kernels_compiled_while_serving(tiny_run):
    with open(tiny_run[1] / "engine_tiny.csv", newline="") as f:
        rows = {r["scenario"]: r for r in csv.DictReader(f)}
    for name in ENGINE_ROWS:  # no compiler under the interpreter: nothing compiles, and the column says so
        assert rows[name]["compiles"] == "0" and rows[name]["compiled"] == "", (name, rows[name])


def test_variants_take_every_kind_of_engine_setting():
    """--variant NAME:FIELD=VALUE,...: ints, floats (a switch interval, a memory share), booleans and None reach
    EngineArgs as such; anything not a field is refused."""
    sys.path.insert(0, str(ROOT))
    from bench.engine import parse_variant

    name, fields = parse_variant("si:lora_load_switch_interval=5e-4,gpu_memory_utilization=0.8,lora_load_processes=4,"
                                 "lora_compact_slots=False,lora_merge_steps=None,dtype=float16")
    assert name == "si"
    assert fields == dict(lora_load_switch_interval=5e-4, gpu_memory_utilization=0.8, lora_load_processes=4,
                          lora_compact_slots=False, lora_merge_steps=None, dtype="float16")
    assert type(fields["lora_load_processes"]) is int and type(fields["gpu_memory_utilization"]) is float
    with pytest.raises(SystemExit, match="not an EngineArgs field"):
        parse_variant("x:no_such_field=1")


def test_random_sampling_rows_generate_every_requested_token(tmp_path):
    """--sampling random (temperature, top_p, top_k for every request) runs the same workload: each request still
    generates its output length (ignore_eos), so the tokens column equals greedy's."""
    def tokens(sampling: str) -> dict[str, int]:
        out = tmp_path / sampling
        env = dict(os.environ, OUT=str(out), LORAFLEET_CACHE=str(tmp_path / "cache"))
        if not torch.cuda.is_available():
            env.setdefault("TRITON_INTERPRET", "1")
        proc = subprocess.run([sys.executable, str(ROOT / "bench" / "engine.py"), "--tiny", "--scenarios",
                               "base,one-r16", "--ranks", "16", "--sampling", sampling], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=BENCH_RUN_TIMEOUT_S)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
        with open(next(out.glob("*.csv"))) as f:
            return {row["scenario"]: int(row["tokens"]) for row in csv.DictReader(f)}

    sampled, greedy = tokens("random"), tokens("greedy")
    assert sampled == greedy and set(sampled) == {"base", "one-r16"} and all(sampled.values())


@pytest.mark.parametrize("model,want", [("qwen3-8b", ("qwen3", True, 36, 128, 12288, None)),
                                        ("phi3-mini", ("phi3", False, 32, 96, 8192, 2047)),
                                        ("phi4-mini", ("phi3", False, 32, 128, 8192, None)),
                                        ("gemma3-1b", ("gemma3", True, 26, 256, 6912, None)),
                                        ("granite-8b", ("granite", False, 40, 128, 12800, None))])
def test_a_model_shape_writes_a_model_dir_of_its_architecture(tmp_path, model, want):
    """bench/engine.py --model ...: the model directory parses as that architecture (Qwen3's and Gemma 3's head
    norms on, Phi-3's window) at that shape; the benchmark's byte counts read the same head_dim."""
    from bench.engine import MODELS
    from bench.engine_workload import head_dim, write_model_dir
    from replicas.model_config import ModelConfig

    cfg = ModelConfig.from_pretrained(write_model_dir(tmp_path / model, dict(MODELS[model], vocab_size=64)),
                                      device="cpu")
    assert (cfg.model_type, cfg.qk_norm, cfg.num_hidden_layers, cfg.head_dim, cfg.intermediate_size,
            cfg.sliding_window) == want
    assert head_dim(MODELS[model]) == cfg.head_dim
