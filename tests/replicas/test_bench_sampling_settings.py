"""bench/sampling_settings.py --shape tiny and bench/sampler_host.py run end to end on CPU (each in its own
process, the real command line): every setting prints a row, and every request runs to max_tokens (the stop
strings and ids never match, the penalties and logprobs change no length). Times are not compared; the GPU
runs are in bench/RESULTS.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.timeouts import BENCH_RUN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def test_every_setting_runs_every_request_to_max_tokens(tmp_path):
    env = dict(os.environ, LORAFLEET_CACHE=str(tmp_path))
    requests, output = 4, 6
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sampling_settings.py"), "--shape", "tiny",
                           "--requests", str(requests), "--concurrency", "2", "--prompt", "8", "--output", str(output),
                           "--repeats", "1"], cwd=ROOT, env=env, capture_output=True, text=True,
                          timeout=BENCH_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    names = ("greedy", "random", "nucleus", "penalties", "logprobs", "stops", "all")
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines() if line.split()[:1] in
            [[n] for n in names]}
    assert set(rows) == set(names)
    assert {name: int(row[0]) for name, row in rows.items()} == dict.fromkeys(names, requests * output)


def test_sampler_host_times_every_setting():
    """bench/sampler_host.py on CPU: a row per setting, greedy's ratio 1, every host time measured."""
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "sampler_host.py"), "--device", "cpu", "--rows", "3",
                           "--vocab", "300", "--prompt", "8", "--outputs", "4", "--iters", "5"],
                          cwd=ROOT, capture_output=True, text=True, timeout=BENCH_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()[2:]}
    assert set(rows) == {"greedy", "random", "nucleus", "penalties", "logprobs", "stops", "all"}
    assert all(float(row[0]) > 0 for row in rows.values()) and float(rows["greedy"][2]) == 1.0
