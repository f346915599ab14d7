"""lorafleet-sim (cluster/simulator/cli.py): sizing from a trace, the load sweep and its plot, the capacity
estimate the load axis uses, and the autoscaling mode (--autoscale) with its replicas-over-time plot."""

import subprocess
import sys
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from cluster.simulator import (ClusterConfig, ReplicaConfig, WorkloadConfig, generate, read_trace, simulate,
                               write_trace)
from cluster.autoscaling import AutoscalerConfig, AutoscalerConfigError
from cluster.simulator.autoscale import AutoscaleConfig, adapter_aware_config, fleet_summary, parse_scaler
from cluster.simulator.capacity import capacity_rps, request_cost_s, workload_capacity_rps
from cluster.simulator.cli import SimUsageError, at_rate, calibration_name, main, parse_bounds, size_cluster
from cluster.simulator.sim import run, step_model

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
    few = trace(num_adapters=1)  # one adapter, on every replica: full batches of it, so capacity is linear
    assert capacity_rps(4, model, SMALL, few) == pytest.approx(4 * capacity_rps(1, model, SMALL, few))
    tr = trace()
    one = capacity_rps(1, model, SMALL, tr)
    # Spread over 80 adapters the slots bind; with more replicas each holds a smaller share of them (adapter
    # affinity), so its batches grow: at least linear.
    assert capacity_rps(4, model, SMALL, tr) >= 4 * one
    longer = [replace(r, output_tokens=r.output_tokens * 4) for r in tr]
    assert capacity_rps(1, model, SMALL, longer) < one
    # A request's cost at full batch is below its cost alone: batching is what capacity counts on.
    r = tr[0]
    alone = model.step_s(0, r.prompt_tokens, 1, r.rank) + model.step_s(1, 0, 1, r.rank) * (r.output_tokens - 1)
    assert request_cost_s(r, model, SMALL) < alone
    wl = WorkloadConfig(num_adapters=1, output_median=32, prompt_median=96, max_output=128)
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


# A small cluster's worth of diurnal load: the peak wants more than AUTO_MAX replicas, the trough one.
AUTO_MIN, AUTO_MAX = 1, 3
AUTO_ARGS = ["--replicas", "2", "--gpu", "h100", "--max-loras", "4", "--max-cpu-loras", "8", "--max-num-seqs", "8",
             "--max-ongoing", "16", "--policies", "ours", "--loads", "--autoscale", f"{AUTO_MIN}:{AUTO_MAX}",
             "--startup-s", "10", "--serve-delays", "5", "30", "--scaler", "downscale_delay_s=20,up_slot_fill=1.0"]


def diurnal_trace():
    return trace(duration_s=300.0, rate=12.0, diurnal_amplitude=0.9, diurnal_period_s=300.0)


def autoscale_rows(text: str) -> dict[str, dict]:
    """The --autoscale table's rows, by policy name (the name column is 20 wide and may hold a space)."""
    lines = text[text.index("\nautoscaling "):].splitlines()
    head = next(i for i, line in enumerate(lines) if line.startswith("policy "))
    rows = {}
    for line in lines[head + 1:]:
        if not line.strip() or line.startswith("("):
            break
        slo, goodput, ttft_p99, replica_h, peak, changes, lost = line[20:].split()
        rows[line[:20].strip()] = dict(slo=float(slo), goodput=float(goodput), ttft_p99=float(ttft_p99),
                                       replica_h=float(replica_h), peak=int(peak), changes=int(changes),
                                       lost=int(lost))
    return rows


def integral_h(changes: list[tuple[float, int]], end_s: float) -> float:
    """Replica-hours of a step function of (time, live replicas) up to end_s."""
    points = [*changes, (end_s, changes[-1][1])]
    return sum(n * (min(t1, end_s) - min(t0, end_s)) for (t0, n), (t1, _) in zip(points, points[1:])) / 3600


def test_the_cli_autoscale_mode_prints_both_policies_and_plots(tmp_path, capsys):
    path = tmp_path / "t.csv"
    tr = diurnal_trace()
    write_trace(tr, path)
    out = tmp_path / "plots"
    assert main(["--trace", str(path), "--out", str(out), *AUTO_ARGS]) == 0
    text = capsys.readouterr().out
    rows = autoscale_rows(text)
    assert list(rows) == ["adapter-aware", "serve target=8", "fixed 2"]  # Serve's target: half of --max-ongoing
    png = out / "replicas_over_time.png"
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000
    assert not (out / "load_sweep.png").exists()  # --loads with no shares: no sweep

    # Each row is what run() gives on the same trace with the settings the flags name, to the printed digits.
    cfg = ClusterConfig(replicas=2, gpu="h100-llama3-8b",
                        replica=ReplicaConfig(max_loras=4, max_cpu_loras=8, max_num_seqs=8, max_ongoing=16))
    same = dict(min_replicas=AUTO_MIN, max_replicas=AUTO_MAX, startup_s=10.0)
    as_read = write_and_read(tr, tmp_path)
    runs = {"adapter-aware": run(as_read, replace(cfg, autoscaling=AutoscaleConfig(
                policy="adapter-aware", upscale_delay_s=0.0, downscale_delay_s=0.0,
                scaler={"downscale_delay_s": 20.0, "up_slot_fill": 1.0}, **same))),
            "serve target=8": run(as_read, replace(cfg, autoscaling=AutoscaleConfig(
                policy="serve", target_ongoing_requests=8, upscale_delay_s=5.0, downscale_delay_s=30.0, **same)))}
    for name, (report, log) in runs.items():
        direct, got = fleet_summary(report, log), rows[name]
        assert got["slo"] == round(direct["slo"], 4) and got["ttft_p99"] == round(direct["ttft_p99"], 3)
        assert got["goodput"] == round(direct["goodput"], 2)
        assert (got["peak"], got["changes"], got["lost"]) == (direct["peak"], direct["changes"], direct["lost"])
        # Replica-hours are the fleet's logged live count integrated to the last finish.
        assert got["replica_h"] == pytest.approx(integral_h(log.changes, report.end_s), abs=0.006)
        assert direct["replica_h"] == pytest.approx(integral_h(log.changes, report.end_s))
        # Within the bounds, and the bounds bind: the peak wants more than AUTO_MAX (a drained replica would
        # count above it only while a new one starts inside its drain, which these delays leave no room for).
        counts = [n for _, n in log.changes]
        assert min(counts) >= AUTO_MIN and max(counts) <= AUTO_MAX, (name, log.changes)
        assert log.peak == AUTO_MAX and got["changes"] >= 2
    assert rows["adapter-aware"] != rows["serve target=8"]
    # The fixed row is the policy table's ours row at --replicas.
    fixed = simulate(as_read, cfg, "ours").summary()
    assert rows["fixed 2"]["replica_h"] == round(fixed["replica_h"], 2) and rows["fixed 2"]["peak"] == 2


def write_and_read(tr, tmp_path):
    """The trace as the CLI sees it: through the CSV (arrival times rounded to microseconds)."""
    path = tmp_path / "again.csv"
    write_trace(tr, path)
    return read_trace(path)


def test_the_autoscale_settings_printed_are_a_valid_autoscaling_config(tmp_path, capsys):
    path = tmp_path / "t.csv"
    write_trace(trace(duration_s=20.0, rate=10.0), path)
    assert main(["--trace", str(path), "--no-plots", *AUTO_ARGS, "--initial-replicas", "2"]) == 0
    text = capsys.readouterr().out
    snippet = text[text.index("autoscaling_config:"):].split("\n\n")[0]
    auto = yaml.safe_load(snippet)["autoscaling_config"]
    assert (auto["min_replicas"], auto["initial_replicas"], auto["max_replicas"]) == (AUTO_MIN, 2, AUTO_MAX)
    assert auto["upscale_delay_s"] == auto["downscale_delay_s"] == 0
    assert auto["policy"]["policy_function"] == "cluster.autoscaling:AdapterAwarePolicy"
    kwargs = auto["policy"]["policy_kwargs"]
    assert kwargs == {"max_num_seqs": 8, "downscale_delay_s": 20, "up_slot_fill": 1.0}
    assert AutoscalerConfig.from_kwargs(kwargs).downscale_delay_s == 20


def test_autoscale_choices_are_checked_before_a_run(tmp_path, capsys):
    assert parse_bounds("2:6") == (2, 6)
    for bad in ("6:2", "3", "a:b", "0:0", "-1:2"):
        with pytest.raises(SimUsageError):
            parse_bounds(bad)
    assert parse_scaler("up_slot_fill=1.0, max_step_up=2") == {"up_slot_fill": 1.0, "max_step_up": 2}
    assert parse_scaler("") == {}
    for bad in ("up_slot_fil=1", "up_slot_fill", "max_step_up=1.5", "down_slot_fill=0.95"):
        with pytest.raises(AutoscalerConfigError):
            parse_scaler(bad)
    assert main(["--no-plots", "--loads", "--autoscale", "4:2"]) == 2
    assert "MIN:MAX" in capsys.readouterr().err
    assert main(["--no-plots", "--loads", "--autoscale", "1:2", "--scaler", "magic=1"]) == 2
    assert "magic" in capsys.readouterr().err
    assert main(["--no-plots", "--loads", "--autoscale", "1:2", "--initial-replicas", "3"]) == 2
    assert "--initial-replicas" in capsys.readouterr().err
    # the adapter-aware policy runs with Serve's delays at 0, as deploy/config.gpu.yaml sets them
    auto = adapter_aware_config(min_replicas=1, max_replicas=4)
    assert (auto.policy, auto.upscale_delay_s, auto.downscale_delay_s) == ("adapter-aware", 0.0, 0.0)
