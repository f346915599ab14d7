"""bench/cluster.py --quick runs end to end on real Ray: one table row per router, finite numbers, a CSV;
and its bursty workload draws bursts of one adapter."""

import csv
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
ROUTERS = ("ours", "default", "random")
NUMERIC = ("requests", "distinct", "slot_hit", "slot_loads", "engine_loads", "origin_fetches",
           "replicas_per_adapter", "max_replica_share", "p50_ms", "p99_ms", "req_per_s")


def test_bench_cluster_quick(tmp_path):
    env = {**os.environ, "OUT": str(tmp_path), "OMP_NUM_THREADS": "1"}
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "cluster.py"), "--quick"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=420)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    lines = proc.stdout.splitlines()
    header = next(i for i, line in enumerate(lines) if line.startswith("router"))
    rows = {line.split()[0]: line.split()[1:] for line in lines[header + 1:header + 1 + len(ROUTERS)]}
    assert set(rows) == set(ROUTERS), proc.stdout
    for router, fields in rows.items():
        assert len(fields) == len(NUMERIC), (router, fields)
        assert all(math.isfinite(float(v)) for v in fields), (router, fields)
    assert any(line.startswith("ours/default:") for line in lines), proc.stdout
    assert any(line.startswith("ours/random:") for line in lines), proc.stdout

    with open(tmp_path / "cluster_quick.csv", newline="") as f:
        table = list(csv.DictReader(f))
    assert [r["router"] for r in table] == list(ROUTERS)
    for r in table:
        for key in NUMERIC:
            assert math.isfinite(float(r[key])), (r["router"], key, r[key])
        assert int(r["requests"]) > 0 and 0.0 <= float(r["slot_hit"]) <= 1.0


def test_bursty_workload_keeps_the_iid_draws_for_burst_one():
    from bench.cluster_workload import zipf_requests

    names = [f"a{i:02d}" for i in range(40)]
    iid = [r.model for r in zipf_requests(names, 50, 1.0, 8, seed=3)]
    assert [r.model for r in zipf_requests(names, 50, 1.0, 8, seed=3, burst=1)] == iid
    bursty = [r.model for r in zipf_requests(names, 50, 1.0, 8, seed=3, burst=4)]
    assert len(bursty) == 50
    runs = [bursty[i:i + 4] for i in range(0, 50, 4)]
    assert all(len(set(run)) == 1 for run in runs)  # every burst names one adapter
    assert len({run[0] for run in runs}) > 1
    with pytest.raises(ValueError):
        zipf_requests(names, 10, 1.0, 8, seed=0, burst=0)
