"""EventLoop: a simulated clock and a heap of timed callbacks (discrete-event simulation).

Events at the same time run in the order they were scheduled (a sequence
number breaks ties), so a run is a pure function of its inputs and seed.
"""

from __future__ import annotations

import heapq
from typing import Any, Callable


class EventLoop:
    def __init__(self) -> None:
        self.now = 0.0
        self._heap: list[tuple[float, int, Callable[..., None], tuple[Any, ...]]] = []
        self._seq = 0
        self.events_run = 0

    def clock(self) -> float:
        """The simulated time: handed to the app's policy objects in place of time.monotonic."""
        return self.now

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        # Never schedule into the past: a callback computed from stale state still runs "now".
        heapq.heappush(self._heap, (max(when, self.now), self._seq, fn, args))
        self._seq += 1

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def run(self, until: float | None = None) -> None:
        heap = self._heap
        while heap:
            if until is not None and heap[0][0] > until:
                break
            when, _, fn, args = heapq.heappop(heap)
            self.now = when
            self.events_run += 1
            fn(*args)
