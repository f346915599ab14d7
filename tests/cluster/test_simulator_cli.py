"""lorafleet-sim (cluster/simulator/cli.py): sizing from a trace, the load sweep and its plot, and the capacity
estimate the load axis uses."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest

from cluster.simulator import ClusterConfig, ReplicaConfig, WorkloadConfig, generate, simulate, write_trace
from cluster.simulator.capacity import capacity_rps, request_cost_s, workload_capacity_rps
from cluster.simulator.cli import SimUsageError, at_rate, calibration_name, main, size_cluster
from cluster.simulator.sim import step_model

ROOT = Path(__file__).resolve().parents[2]
SMALL = ReplicaConfig(max_loras=4, max_cpu_loras=8, max_num_seqs=8, max_ongoing=16)


def trace(seed=0, **kw):
    cfg = dict(duration_s=30.0, rate=20.0, num_adapters=80, seed=seed, output_median=32, prompt_median=96,
               max_output=128)
    cfg.update(kw)
    return generate(WorkloadConfig(**cfg))


def test_calibration_name_names_the_measured_tables():
    assert calibration_name("H100", "8B") == "h100-llama3-8b"
    with pytest.raises(SimUsageError, match="h200-llama3-8b"):
        calibration_name("a100", "8b")
    with pytest.raises(SimUsageError):
        calibration_name("h100", "70b")


def test_at_rate_keeps_the_requests_and_sets_the_rate():
    tr = trace()
    scaled = at_rate(tr, 55.0)
    assert [(r.adapter, r.prompt_tokens, r.output_tokens) for r in scaled] == \
        [(r.adapter, r.prompt_tokens, r.output_tokens) for r in tr]
    span = scaled[-1].arrival_s - scaled[0].arrival_s
    assert len(scaled) / span == pytest.approx(55.0)
    assert all(b.arrival_s >= a.arrival_s for a, b in zip(scaled, scaled[1:]))
    with pytest.raises(SimUsageError):
        at_rate(tr[:1], 10.0)
    with pytest.raises(SimUsageError):
        at_rate([replace(r, arrival_s=1.0) for r in tr[:3]], 10.0)


def test_capacity_scales_with_replicas_and_request_size():
    model = step_model("h200-llama3-8b")
    tr = trace()
    one = capacity_rps(1, model, SMALL, tr)
    assert capacity_rps(4, model, SMALL, tr) == pytest.approx(4 * one)
    longer = [replace(r, output_tokens=r.output_tokens * 4) for r in tr]
    assert capacity_rps(1, model, SMALL, longer) < one
    # A request's cost at full batch is below its cost alone: batching is what capacity counts on.
    r = tr[0]
    alone = model.step_s(0, r.prompt_tokens, 1, r.rank) + model.step_s(1, 0, 1, r.rank) * (r.output_tokens - 1)
    assert request_cost_s(r, model, SMALL) < alone
    wl = WorkloadConfig(num_adapters=80, output_median=32, prompt_median=96, max_output=128)
    assert workload_capacity_rps(2, model, SMALL, wl) == pytest.approx(2 * workload_capacity_rps(1, model, SMALL, wl))


def test_overload_past_capacity_loses_attainment_that_half_load_keeps():
    cfg = ClusterConfig(replicas=2, replica=SMALL)
    tr = trace(duration_s=60.0)
    cap = capacity_rps(2, step_model(cfg.gpu), SMALL, tr)
    half = simulate(at_rate(tr, 0.5 * cap), cfg, "ours").summary()
    over = simulate(at_rate(tr, 1.5 * cap), cfg, "ours").summary()
    assert half["slo"] > 0.95
    assert over["slo"] < half["slo"] - 0.2


def test_size_cluster_finds_the_fewest_replicas():
    tr = trace(rate=30.0)
    cfg = ClusterConfig(replicas=1, replica=SMALL)
    n, summary = size_cluster(tr, cfg, 0.95)
    assert summary["slo"] >= 0.95
    assert n >= 2
    fewer = simulate(tr, replace(cfg, replicas=n - 1), "ours").summary()
    assert fewer["slo"] < 0.95


def test_the_cli_prints_the_table_sweeps_and_plots(tmp_path, capsys):
    path = tmp_path / "t.csv"
    write_trace(trace(), path)
    out = tmp_path / "plots"
    code = main(["--trace", str(path), "--replicas", "2", "--gpu", "h100", "--max-loras", "4", "--max-cpu-loras", "8",
                 "--max-num-seqs", "8", "--max-ongoing", "16", "--loads", "0.5", "1.2", "--out", str(out),
                 "--policies", "ours,ray-multiplex"])
    text = capsys.readouterr().out
    assert code == 0
    assert "h100-llama3-8b" in text and "ray-multiplex" in text and "bound" in text
    assert "load sweep" in text
    png = out / "load_sweep.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000


def test_the_cli_rejects_bad_choices_with_a_message(tmp_path, capsys):
    assert main(["--gpu", "tpu", "--no-plots"]) == 2
    assert "no calibration" in capsys.readouterr().err
    assert main(["--policies", "ours,magic", "--no-plots"]) == 2
    assert "magic" in capsys.readouterr().err
    assert main(["--trace", str(tmp_path / "missing.csv"), "--no-plots"]) == 2


def test_the_console_script_is_declared():
    text = (ROOT / "pyproject.toml").read_text()
    assert 'lorafleet-sim = "cluster.simulator.cli:main"' in text
    done = subprocess.run([sys.executable, "-m", "cluster.simulator.cli", "--help"], cwd=ROOT, capture_output=True,
                          text=True, check=True)
    assert "--trace" in done.stdout and "--model-shape" in done.stdout
