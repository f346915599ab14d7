"""Can one process run a tensor-parallel engine, shut it down, and start another? (issue 3, TP on GPUs)

Each case runs in a fresh subprocess: build a TP engine on the tiny dummy
model, generate, shut it down, build a second one, generate again. Cases vary
what the first engine leaves behind (CUDA graphs or not, the engine object
alive or collected) and NCCL's settings. Prints one line per case, and the end
of the output of a case that did not pass. On 2 x H200 every case with CUDA
graphs failed ("NCCL communicator was aborted") until the runner freed its
graphs, which hold NCCL collectives, before leaving the group; eager passed.

    python bench/tp_restart.py [--tp 2] [--cases all]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
from pathlib import Path

CASES = {  # name -> (env, enforce_eager, collect the first engine before the second)
    "graphs": ({}, False, False),
    "eager": ({}, True, False),
    "graphs-collected": ({}, False, True),
    "no-graph-register": ({"NCCL_GRAPH_REGISTER": "0"}, False, True),
}

CHILD = r"""
import gc, sys, time, traceback
sys.path.insert(0, {root!r})
from bench.engine_workload import TINY, write_model_dir
from pathlib import Path
from replicas.llm import LLM
from replicas.sampling_params import SamplingParams

def main():
    model = write_model_dir(Path({work!r}) / "model", TINY)
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    outs = []
    for i in range(2):
        t = time.perf_counter()
        llm = LLM(str(model), tensor_parallel_size={tp}, load_format="dummy", dtype="bfloat16",
                  enforce_eager={eager}, kv_cache_memory_bytes=1 << 26)
        outs.append(llm.generate([{{"prompt_token_ids": [5, 6, 7, 8]}}], params)[0].outputs[0].token_ids)
        llm.engine.shutdown()
        print(f"engine {{i}} ok in {{time.perf_counter() - t:.1f}} s", flush=True)
        if {collect}:
            del llm
            gc.collect()
    print("RESULT ok" if outs[0] == outs[1] else f"RESULT different tokens {{outs}}", flush=True)

if __name__ == "__main__":
    try:
        main()
    except BaseException:
        traceback.print_exc()
        print("RESULT failed", flush=True)
"""


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--tp", type=int, default=2)
    p.add_argument("--cases", default="all")
    p.add_argument("--timeout", type=float, default=150)
    p.add_argument("--tail", type=int, default=12, help="output lines shown for a case that did not pass")
    a = p.parse_args(argv)
    root = str(Path(__file__).resolve().parent.parent)
    names = list(CASES) if a.cases == "all" else a.cases.split(",")
    for name in names:
        env, eager, collect = CASES[name]
        with tempfile.TemporaryDirectory() as work:
            code = CHILD.format(root=root, work=work, tp=a.tp, eager=eager, collect=collect)
            script = Path(work) / "child.py"
            script.write_text(code)
            try:
                proc = subprocess.run([sys.executable, str(script)], env=os.environ | env, capture_output=True,
                                      text=True, timeout=a.timeout)
                text = proc.stdout + proc.stderr
            except subprocess.TimeoutExpired as exc:
                text = "".join(b.decode() if isinstance(b, bytes) else b or "" for b in (exc.stdout, exc.stderr))
                text += f"\nRESULT hung (> {a.timeout:.0f} s)"
        result = next((l for l in reversed(text.splitlines()) if l.startswith("RESULT")), "RESULT none")
        print(f"{name:18} {result[7:]}", flush=True)
        if not result.endswith(" ok"):
            print("\n".join("   " + line[:300] for line in text.splitlines()[-a.tail:]), flush=True)


if __name__ == "__main__":
    main()
