"""Executors: what the multiprocess and Ray executors share (replicas.executor.Rank0Executor), and the
multiprocess one's error path with real worker processes."""

from __future__ import annotations

import pytest

from replicas.executor import MultiprocExecutor, Rank0Executor
from replicas.model_runner import RunnerConfig


class _Runner:
    def __init__(self, fail: bool = False) -> None:
        self.fail, self.calls = fail, []

    def ping(self, value):
        self.calls.append(value)
        if self.fail:
            raise ValueError("rank 0 failed")
        return value * 2


class _Fake(Rank0Executor):
    """Ranks 1..tp-1 as a list of answers: the error each one raises, or its result."""

    def __init__(self, runner: _Runner, workers: list[BaseException | None]) -> None:
        self.runner, self.workers, self.sent, self.gathered = runner, workers, [], 0

    def _send(self, method, args):
        self.sent.append((method, args))
        return list(self.workers)

    def _gather(self, pending):
        self.gathered += 1
        error = next((e for e in pending if isinstance(e, BaseException)), None)
        return error, [None if isinstance(e, BaseException) else e for e in pending]


def test_a_call_runs_on_every_rank_and_errors_wait_for_all_of_them():
    ok = _Fake(_Runner(), [None, None])
    assert ok.call("ping", 3) == 6 and ok.sent == [("ping", (3,))] and ok.gathered == 1
    worker = _Fake(_Runner(), [None, KeyError("rank 2")])
    with pytest.raises(KeyError, match="rank 2"):
        worker.call("ping", 1)
    assert worker.runner.calls == [1] and worker.gathered == 1  # rank 0 ran too
    both = _Fake(_Runner(fail=True), [RuntimeError("rank 1")])
    with pytest.raises(ValueError, match="rank 0 failed"):  # rank 0's error first
        both.call("ping", 1)
    assert both.gathered == 1  # the other ranks' answers were still collected: the next call starts in step
    assert _Fake(_Runner(), [4, 5]).call_all("ping", 1) == [2, 4, 5]  # every rank's result, rank 0's first


def test_execute_sends_the_step_to_the_workers_and_the_device_tokens_to_rank_0_only():
    class _StepRunner:
        def execute(self, step, previous_tokens=None):
            return (step, previous_tokens)

    ex = _Fake(_StepRunner(), [None])
    assert ex.execute("step", "tokens") == ("step", "tokens")
    assert ex.sent == [("execute", ("step",))] and ex.takes_device_tokens


def test_multiproc_executor_raises_a_workers_error_and_keeps_serving(tiny_checkpoint):
    ex = MultiprocExecutor(RunnerConfig(model=str(tiny_checkpoint("llama3_tied")), num_blocks=8), 2)
    try:
        assert ex.call("lora_in_host_cache", 1) is False
        assert ex.call_all("lora_loads_done") == [[], []]
        with pytest.raises(AttributeError, match="no_such_method"):
            ex.call("no_such_method")
        assert ex.call("list_loras") == []  # the pipes are still in step
    finally:
        ex.shutdown()


def test_a_workers_start_up_error_is_read_from_its_pipe():
    """Where rank 0 only saw a peer vanish from a collective, the worker's own error says why it went."""
    import multiprocessing

    ex = MultiprocExecutor.__new__(MultiprocExecutor)
    quiet, quiet_end = multiprocessing.Pipe()
    failed, failed_end = multiprocessing.Pipe()
    ex._conns = [quiet, failed]
    assert ex._worker_failure(wait_s=0.05) is None  # nothing sent: no reason, after the wait
    failed_end.send(("error", "AssertionError: daemonic processes are not allowed to have children"))
    assert "daemonic" in ex._worker_failure(wait_s=0.05)
    quiet_end.close()  # a worker gone without a word is skipped
    failed_end.send(("error", "boom"))
    assert ex._worker_failure(wait_s=0.05) == "boom"


def test_a_load_counts_as_done_once_every_rank_has_it():
    """finish() waits for each rank's own load: one that only rank 0 has finished would stall the step (TP)."""
    from lora_core.request import LoRARequest
    from replicas.engine_adapters import EngineAdapters

    class _Ranks:
        def __init__(self, done_per_rank):
            self.done_per_rank = done_per_rank

        def call_all(self, method):
            assert method == "lora_loads_done"
            return self.done_per_rank

    ranks = _Ranks([[1, 2, 3], [3, 1]])
    adapters = EngineAdapters(ranks, scheduler=None, lora_config=None)
    adapters.loading = {i: LoRARequest(f"a{i}", i, "/x") for i in (1, 2, 3)}
    assert adapters.done(block=False, awaited=lambda i: True) == [1, 3]  # rank 0's order
    ranks.done_per_rank = [[2], []]
    assert adapters.done(block=False, awaited=lambda i: True) == []
    # nothing else can run: wait for the oldest load a request waits on, wherever it stands
    assert adapters.done(block=True, awaited=lambda i: i == 2) == [2]
