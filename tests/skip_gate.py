"""--strict-skips: the run fails when a test skips for any reason but a missing GPU.

A missing dependency, a server binary not found, a test body that gives up: each ends as a green skip, and a
run of green skips checks nothing. With --strict-skips (make test passes it) the only skips allowed are
gpu-marked tests on a machine without CUDA; any other skip, a module skipped at collection, or an xfail (an
expected failure checks nothing either) makes the run exit 1 and is listed at the end of the report.
"""

from __future__ import annotations

import pytest

GPU_SKIP_REASON = "needs a CUDA GPU (run on the device machine)"


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--strict-skips", action="store_true",
                     help="fail the run when a test skips or xfails, except gpu-marked tests on a machine without CUDA")


def pytest_configure(config: pytest.Config) -> None:
    if config.getoption("strict_skips"):
        config.pluginmanager.register(SkipGate(), "lorafleet-skip-gate")


def _reason(report: pytest.TestReport | pytest.CollectReport) -> str:
    if hasattr(report, "wasxfail"):
        return f"xfail: {report.wasxfail}"
    if isinstance(report.longrepr, tuple):  # (path, line, "Skipped: reason")
        return report.longrepr[2].removeprefix("Skipped: ")
    return str(report.longrepr)


def _no_cuda() -> bool:
    import torch  # here, so that the gate itself costs nothing where no gpu test skips

    return not torch.cuda.is_available()


class SkipGate:
    def __init__(self) -> None:
        self.unexpected: list[tuple[str, str]] = []  # (node id, reason)

    def pytest_runtest_logreport(self, report: pytest.TestReport) -> None:
        if not report.skipped:
            return
        # A gpu test may skip through its own skipif first (e.g. "needs 2 GPUs"): the marker decides, not the text.
        if not hasattr(report, "wasxfail") and "gpu" in report.keywords and _no_cuda():
            return
        self.unexpected.append((report.nodeid, _reason(report)))

    def pytest_collectreport(self, report: pytest.CollectReport) -> None:
        if report.skipped:
            self.unexpected.append((report.nodeid, _reason(report)))

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session: pytest.Session) -> None:
        if self.unexpected and session.exitstatus in (pytest.ExitCode.OK, pytest.ExitCode.NO_TESTS_COLLECTED):
            session.exitstatus = pytest.ExitCode.TESTS_FAILED

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if not self.unexpected:
            return
        terminalreporter.section("skips that are not a missing GPU (--strict-skips fails the run)", red=True)
        for nodeid, reason in self.unexpected:
            terminalreporter.line(f"{nodeid}: {reason}")
