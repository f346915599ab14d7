"""compile_ahead: this thread's launches of unbuilt Triton variants become compiles in worker processes.

On CPU nothing compiles (no GPU target): these tests drive the scope's jit_cache_hook as Triton calls it,
and a spawned worker's compile_variant on a stand-in with preload(); the compile itself, into Triton's
disk cache, runs on the GPU (marked gpu; the engine's warm-up in bench/warm_up.py).
"""

from __future__ import annotations

import threading
from concurrent.futures import Executor, Future, ProcessPoolExecutor
from types import SimpleNamespace

import pytest
import triton
import triton.language as tl

from replicas import triton_compile
from replicas.spawn import WORKER_CONTEXT
from replicas.triton_compile import CompileAhead, compile_ahead, compile_variant, compile_workers
from tests.timeouts import CHILD_PROCESS_TIMEOUT_S


@triton.jit
def add_one(x_ptr, n, BLOCK: tl.constexpr):  # module level: a worker imports it by name
    offs = tl.arange(0, BLOCK)
    tl.store(x_ptr + offs, tl.load(x_ptr + offs, mask=offs < n) + 1, mask=offs < n)


class Probe:
    """Stands in for a JITFunction in a worker: preload(data) writes the file that data names."""

    def preload(self, specialization: str) -> None:
        with open(specialization, "w") as f:
            f.write("compiled")


probe = SimpleNamespace(kernel=Probe())


class Recorder(Executor):
    def __init__(self) -> None:
        self.submitted = []

    def submit(self, fn, *args, **kwargs):
        self.submitted.append((fn, args))
        future = Future()
        future.set_result(0.0)
        return future


def _call(ahead: CompileAhead, name: str, key: str, module: str = "kernels") -> bool | None:
    """The hook as Triton's JITFunction._call_hook calls it."""
    return ahead.hook(key=key, repr=name, fn=SimpleNamespace(module=module, name=name, jit_function=None),
                      compile={"key": key, "specialization_data": f"{name}:{key}"},
                      is_manual_warmup=False, already_compiled=False)


def test_each_variant_goes_to_the_pool_once_and_launches_nothing():
    pool = Recorder()
    ahead = CompileAhead(pool, threading.get_ident())
    assert _call(ahead, "shrink", "k1") is True and _call(ahead, "shrink", "k1") is True
    assert _call(ahead, "shrink", "k2") is True and _call(ahead, "expand", "k1") is True
    assert [args for _, args in pool.submitted] == [("kernels", "shrink", "shrink:k1"),
                                                    ("kernels", "shrink", "shrink:k2"),
                                                    ("kernels", "expand", "expand:k1")]
    assert all(fn is compile_variant for fn, _ in pool.submitted)


def test_other_threads_and_unimportable_kernels_compile_as_usual():
    pool = Recorder()
    ahead = CompileAhead(pool, threading.get_ident())
    answers = []
    other = threading.Thread(target=lambda: answers.append(_call(ahead, "merge", "k")))
    other.start()
    other.join()
    assert answers == [None]
    assert _call(ahead, "make.<locals>.kernel", "k") is None and ahead.skipped == 1
    assert pool.submitted == []


def test_the_hook_is_in_place_only_inside(monkeypatch):
    runtime = SimpleNamespace(jit_cache_hook="previous")
    monkeypatch.setattr(triton_compile, "_runtime_knobs", lambda: runtime)
    with compile_ahead(workers=1) as ahead:
        assert runtime.jit_cache_hook == ahead.hook
    assert runtime.jit_cache_hook == "previous"
    monkeypatch.setattr(triton_compile, "_runtime_knobs", lambda: None)  # a Triton without the hook
    with compile_ahead(workers=1) as ahead:
        assert ahead is None


def test_a_spawned_worker_finds_the_kernel_by_module_and_name(tmp_path):
    done = tmp_path / "done"
    with ProcessPoolExecutor(1, mp_context=WORKER_CONTEXT) as pool:
        compiled = pool.submit(compile_variant, __name__, "probe.kernel", str(done))
        seconds = compiled.result(timeout=CHILD_PROCESS_TIMEOUT_S)
    assert done.read_text() == "compiled" and seconds >= 0


def test_compile_workers_stay_within_the_cores():
    assert 1 <= compile_workers() <= 16


@pytest.mark.gpu
def test_variants_compiled_ahead_are_on_disk_before_any_launch(tmp_path, monkeypatch):
    """On the GPU: inside, launches compute nothing and the workers write each variant into Triton's disk
    cache; after, the same launches compute."""
    import torch

    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path))  # workers inherit it
    x = torch.zeros(100, device="cuda")
    with compile_ahead(workers=2) as ahead:
        for block in (128, 256, 128):
            add_one[(1,)](x, 100, BLOCK=block)
        torch.cuda.synchronize()
        assert x.sum().item() == 0  # launched nothing
    assert len(ahead.futures) == 2 and all(f.exception() is None for f in ahead.futures.values())
    assert len(list(tmp_path.rglob("add_one.cubin"))) == 2
    for block in (128, 256):
        add_one[(1,)](x, 100, BLOCK=block)
    assert x.tolist() == [2.0] * 100


def test_workers_by_default_only_on_cuda_with_an_empty_disk_cache(tmp_path, monkeypatch):
    cache = tmp_path / "triton"
    monkeypatch.setenv("TRITON_CACHE_DIR", str(cache))
    monkeypatch.setattr(triton_compile, "compile_workers", lambda: 16)
    monkeypatch.setattr(triton_compile, "_runtime_knobs", lambda: object())
    assert triton_compile.disk_cache_dir() == cache
    assert triton_compile.compile_workers_for(None, "cuda", 1) == 16  # no cache directory yet
    cache.mkdir()
    assert triton_compile.compile_workers_for(None, "cuda:0", 2) == 8  # empty: split over the ranks
    assert triton_compile.compile_workers_for(None, "cpu", 1) == 0
    (cache / "0123abcd").mkdir()  # a variant compiled before: loads are cheap, no pass ahead
    assert triton_compile.compile_workers_for(None, "cuda", 1) == 0
    assert triton_compile.compile_workers_for(3, "cuda", 1) == 3 and triton_compile.compile_workers_for(0, "cuda") == 0
    monkeypatch.setattr(triton_compile, "_runtime_knobs", lambda: None)  # a Triton without the hook
    (cache / "0123abcd").rmdir()
    assert triton_compile.compile_workers_for(None, "cuda", 1) == 0


def test_a_negative_worker_count_is_refused():
    from replicas.engine_args import EngineArgs

    with pytest.raises(ValueError, match="compile_workers must be >= 0"):
        EngineArgs(model="m", compile_workers=-1)


def test_compile_ahead_with_no_workers_changes_nothing(monkeypatch):
    runtime = SimpleNamespace(jit_cache_hook="previous")
    monkeypatch.setattr(triton_compile, "_runtime_knobs", lambda: runtime)
    with compile_ahead(workers=0) as ahead:
        assert ahead is None and runtime.jit_cache_hook == "previous"
