"""The interpreter's GIL switch interval, lowered while adapter loads run on loader threads.

A thread that wants the GIL while another thread runs Python waits up to the
switch interval (sys.getswitchinterval(), 5 ms unless changed) before the
holder must let go. An adapter load on a loader thread runs Python between its
torch calls (hundreds of small tensors to read, check and lay out), and each
torch call of an engine step gives the GIL up and takes it back, so each
taking back can wait that long: the step's host work stretches, and with it
the GPU's idle time between steps. The other way round hurts more: a load
gives the GIL up at each of its own ~1,600 torch calls, and beside a thread
that runs Python it waits at each one, so with Python's 5 ms a load that
takes 75 ms alone took 6-17 s beside a busy thread, and 0.7 s with 0.2 ms
(bench/load_contention.py).

The interval is the interpreter's, so one SwitchInterval per process holds it:
while any load is inside, the smallest interval asked for; the value found
before the first one entered comes back when the last one leaves, so a
process with no load running keeps whatever its owner set.
"""

from __future__ import annotations

import sys
import threading
from contextlib import contextmanager
from typing import Iterator


class SwitchInterval:
    """Holders lower the interpreter's switch interval while they are inside (lowered())."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: list[float] = []
        self._saved = 0.0  # the interval before the first holder entered

    @contextmanager
    def lowered(self, interval: float) -> Iterator[None]:
        """At most ``interval`` seconds while inside (0 or less: leave the interval alone)."""
        if interval <= 0:
            yield
            return
        with self._lock:
            if not self._held:
                self._saved = sys.getswitchinterval()
            self._held.append(interval)
            sys.setswitchinterval(min([self._saved, *self._held]))
        try:
            yield
        finally:
            with self._lock:
                self._held.remove(interval)
                sys.setswitchinterval(min([self._saved, *self._held]))

    @property
    def holders(self) -> int:
        return len(self._held)


# One per process, as the interval itself.
LOADER_SWITCH_INTERVAL = SwitchInterval()
