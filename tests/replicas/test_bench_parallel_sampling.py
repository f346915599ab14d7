"""bench/parallel_sampling.py --tiny runs end to end on CPU (its own process, the real command line): both
modes print a row, and the hold computes each request's prompt once where "all" computes it n times.
Times are not checked; the GPU run (Llama-3-8B shape) is recorded in bench/RESULTS.md."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from tests.timeouts import BENCH_RUN_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]


def test_hold_computes_each_prompt_once(tmp_path):
    env = dict(os.environ, LORAFLEET_CACHE=str(tmp_path))
    requests, n, prompt, block = 3, 3, 40, 16
    proc = subprocess.run([sys.executable, str(ROOT / "bench" / "parallel_sampling.py"), "--tiny", "--requests",
                           str(requests), "--n", str(n), "--prompt", str(prompt), "--output", "4", "--repeats", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=BENCH_RUN_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rows = {line.split()[0]: line.split()[1:] for line in proc.stdout.splitlines()
            if line.split()[:1] in (["hold"], ["all"]) and "/" not in line}
    computed = {mode: int(row[2]) for mode, row in rows.items()}
    shared = (prompt - 1) // block * block  # the full blocks a later completion takes from the cache
    assert computed["hold"] == requests * (prompt + (n - 1) * (prompt - shared))
    assert computed["all"] == requests * n * prompt
    assert "hold / all: tok/s" in proc.stdout
