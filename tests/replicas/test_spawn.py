"""Worker processes that do not run the user's script again (replicas/spawn.py): a script without an
``if __name__ == "__main__":`` guard can build a tensor-parallel engine with load processes."""

from __future__ import annotations

import multiprocessing
import multiprocessing.spawn
import os
import subprocess
import sys
import textwrap
import types
from pathlib import Path

from replicas.llm import LLM
from replicas.sampling_params import SamplingParams
from replicas.spawn import WORKER_CONTEXT, WORKER_PREFIX
from tests.timeouts import CHILD_PROCESS_TIMEOUT_S

ROOT = Path(__file__).resolve().parents[2]

_UNGUARDED = textwrap.dedent("""
    import sys

    from lora_core.request import LoRARequest
    from replicas.llm import LLM
    from replicas.sampling_params import SamplingParams

    model, adapter, marker = sys.argv[1:4]
    with open(marker, "a") as f:  # once per run of this file's top level
        f.write("ran\\n")
    llm = LLM(model, enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32", device="cpu",
              tensor_parallel_size=2, lora_load_processes=1)
    out = llm.generate(["SELECT"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                       [LoRARequest("sql", 1, adapter)])
    print("tokens", out[0].outputs[0].token_ids)
    llm.shutdown()
""")


def test_a_script_without_a_main_guard_runs_its_top_level_once(demo, loras, tmp_path):
    """TP worker ranks and their load processes are spawned without importing the script as __mp_main__:
    its top level runs once (a re-run would build another engine in every worker), and it serves."""
    script, marker = tmp_path / "unguarded.py", tmp_path / "marker"
    script.write_text(_UNGUARDED)
    sql = loras["demo-sql"]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    proc = subprocess.run([sys.executable, str(script), str(demo.model_dir), sql.lora_path, str(marker)],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=CHILD_PROCESS_TIMEOUT_S)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    assert marker.read_text() == "ran\n"
    want = LLM(str(demo.model_dir), enable_lora=True, max_loras=2, max_lora_rank=32, dtype="float32",
               device="cpu").generate(["SELECT"], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True),
                                      [sql])[0].outputs[0].token_ids
    assert f"tokens {list(want)}" in proc.stdout


def test_only_worker_processes_skip_the_main_module(monkeypatch, tmp_path):
    """A worker's preparation data names no __main__ to import; any other spawned process's still does."""
    script = tmp_path / "user_script.py"
    script.write_text("")
    fake_main = types.ModuleType("__main__")
    fake_main.__file__, fake_main.__spec__ = str(script), None
    monkeypatch.setitem(sys.modules, "__main__", fake_main)
    theirs = multiprocessing.spawn.get_preparation_data("SpawnProcess-1")
    ours = multiprocessing.spawn.get_preparation_data(f"{WORKER_PREFIX}:SpawnProcess-1")
    assert theirs["init_main_from_path"] == str(script)
    assert "init_main_from_path" not in ours and "init_main_from_name" not in ours
    assert ours["sys_path"] == theirs["sys_path"]  # the rest is spawn's own
    run_as_module = types.ModuleType("__main__")
    run_as_module.__spec__ = types.SimpleNamespace(name="user_package.cli")
    monkeypatch.setitem(sys.modules, "__main__", run_as_module)  # `python -m user_package.cli`
    assert multiprocessing.spawn.get_preparation_data("SpawnProcess-1")["init_main_from_name"] == "user_package.cli"
    assert "init_main_from_name" not in multiprocessing.spawn.get_preparation_data(f"{WORKER_PREFIX}:x")


def test_worker_context_names_its_processes_and_is_spawn_otherwise():
    proc = WORKER_CONTEXT.Process(target=print)
    assert proc.name.startswith(WORKER_PREFIX) and WORKER_CONTEXT.get_start_method() == "spawn"
    assert not multiprocessing.get_context("spawn").Process(target=print).name.startswith(WORKER_PREFIX)
