"""The GIL switch interval lowered while adapter loads run on loader threads (replicas/gil.py)."""

from __future__ import annotations

import sys
import threading
from types import SimpleNamespace

import pytest

from lora_core.config import LoRAConfig
from lora_core.request import LoRARequest
from replicas import adapter_loads
from replicas.engine_args import EngineArgs
from replicas.gil import SwitchInterval
from tests.timeouts import HANG_TIMEOUT_S


@pytest.fixture
def python_interval():
    """A known interval to start from, and the session's own back after the test."""
    before = sys.getswitchinterval()
    sys.setswitchinterval(0.004)
    yield 0.004
    sys.setswitchinterval(before)


def test_lowered_while_inside_and_back_after(python_interval):
    scope = SwitchInterval()
    with scope.lowered(2e-4):
        assert sys.getswitchinterval() == pytest.approx(2e-4)
        assert scope.holders == 1
    assert sys.getswitchinterval() == pytest.approx(python_interval)
    assert scope.holders == 0


def test_the_smallest_of_the_holders_until_the_last_leaves(python_interval):
    scope = SwitchInterval()
    outer = scope.lowered(1e-3)
    outer.__enter__()
    assert sys.getswitchinterval() == pytest.approx(1e-3)
    with scope.lowered(1e-4):
        assert sys.getswitchinterval() == pytest.approx(1e-4)
    assert sys.getswitchinterval() == pytest.approx(1e-3)  # the remaining holder's
    outer.__exit__(None, None, None)
    assert sys.getswitchinterval() == pytest.approx(python_interval)


def test_never_raised_above_what_the_process_had(python_interval):
    scope = SwitchInterval()
    with scope.lowered(0.05):  # larger than the process's own
        assert sys.getswitchinterval() == pytest.approx(python_interval)
    assert sys.getswitchinterval() == pytest.approx(python_interval)


def test_zero_leaves_the_interval_alone_and_errors_restore_it(python_interval):
    scope = SwitchInterval()
    with scope.lowered(0.0):
        assert sys.getswitchinterval() == pytest.approx(python_interval)
        assert scope.holders == 0
    with pytest.raises(RuntimeError, match="load failed"):
        with scope.lowered(2e-4):
            raise RuntimeError("load failed")
    assert sys.getswitchinterval() == pytest.approx(python_interval)
    assert scope.holders == 0


def test_a_thread_load_runs_under_the_lowered_interval(python_interval):
    """AdapterLoads on loader threads: the read and the layout run with the interval lowered, and the
    process's own comes back once no load runs, also after a load that failed."""
    seen: list[float] = []

    def prepare_adapter(lora):
        seen.append(sys.getswitchinterval())
        if lora.bad:
            raise ValueError("a bad adapter")
        return "prepared"

    manager = SimpleNamespace(preparer=None, host_pool=None, prepare_adapter=prepare_adapter)
    loads = adapter_loads.AdapterLoads(manager, LoRAConfig(max_loras=2), [], switch_interval=2e-4)
    reads = iter([SimpleNamespace(rank=8, bad=False), SimpleNamespace(rank=8, bad=True)])
    loads.load = lambda request: next(reads)  # the disk read; the lowered scope covers it too
    try:
        loads.start(LoRARequest("a", 1, "/adapters/a"))
        assert loads.future(1).result(timeout=HANG_TIMEOUT_S) == (8, "prepared")
        loads.start(LoRARequest("b", 2, "/adapters/b"))
        with pytest.raises(ValueError, match="a bad adapter"):
            loads.future(2).result(timeout=HANG_TIMEOUT_S)
    finally:
        loads.close()
    assert seen == [pytest.approx(2e-4), pytest.approx(2e-4)]
    assert sys.getswitchinterval() == pytest.approx(python_interval)


def test_loads_in_processes_leave_the_interval_alone(monkeypatch, python_interval):
    seen: list[float] = []

    class FakeProcessLoader:  # the worker processes hold no GIL of this process
        def __init__(self, *args, **kwargs):
            pass

        def load(self, request):
            seen.append(sys.getswitchinterval())
            return 8, "prepared"

        def shutdown(self):
            pass

    monkeypatch.setattr(adapter_loads, "ProcessAdapterLoader", FakeProcessLoader)
    loads = adapter_loads.AdapterLoads(SimpleNamespace(preparer=None, host_pool=None), LoRAConfig(max_loras=2), [],
                                       processes=2, switch_interval=2e-4)
    try:
        loads.start(LoRARequest("a", 1, "/adapters/a"))
        assert loads.future(1).result(timeout=HANG_TIMEOUT_S) == (8, "prepared")
    finally:
        loads.close()
    assert seen == [pytest.approx(python_interval)]


def test_concurrent_holders_on_threads_end_at_the_process_interval(python_interval):
    scope = SwitchInterval()
    start = threading.Barrier(8, timeout=HANG_TIMEOUT_S)

    def hold(interval: float) -> None:
        start.wait()
        for _ in range(200):
            with scope.lowered(interval):
                assert sys.getswitchinterval() <= interval + 1e-9

    threads = [threading.Thread(target=hold, args=(1e-4 * (k + 1),)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert scope.holders == 0
    assert sys.getswitchinterval() == pytest.approx(python_interval)


def test_engine_args_refuse_a_negative_interval():
    with pytest.raises(ValueError, match="lora_load_switch_interval"):
        EngineArgs(model="unused", lora_load_switch_interval=-1.0)
