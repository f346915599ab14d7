"""SimReplica: one engine replica at step granularity, with the app's own slot and host-cache rules.

Continuous batching: a step runs every running request's next token plus the
prompts of the requests admitted at its start; its time is the calibrated
StepModel's for that batch, plus a slot write for each adapter it activates.
While the batch does not change the steps are identical, so a run of decode
steps is one event (cut short at the next step boundary when new work can be
admitted). A request is admitted FIFO when its adapter is in the host tier and
the step's distinct adapters fit the GPU slots (others wait, as in the engine's
scheduler); loads into the host tier start as soon as a request is accepted
(the engine prefetches for its queue) and come from whatever the cluster's
fetcher says.

Both tiers are lora_core's HostLRUCache: the host tier as LoRAModelManager
builds it (max_cpu_loras, nothing the running batch uses evicted, a host
eviction frees the adapter's slot), and the GPU slots with the same rule
LoRAModelManager applies to its slots (least recently used, not running).
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable

from lora_core.errors import LoRACapacityError
from lora_core.host_cache import HostLRUCache

from cluster.simulator.calibration import StepModel, TierCosts
from cluster.simulator.events import EventLoop
from cluster.simulator.workload import Request


@dataclass
class SimRequest:
    rid: int
    req: Request
    replica: int = -1
    first_token_s: float = -1.0
    finish_s: float = -1.0
    remaining: int = 0  # output tokens still to come, once running


@dataclass
class ReplicaConfig:
    max_loras: int = 16  # GPU slots
    max_cpu_loras: int = 32  # host LRU entries
    max_num_seqs: int = 32  # the engine's batch cap
    max_num_batched_tokens: int = 8192  # prompt tokens per step
    max_ongoing: int = 64  # Serve's max_ongoing_requests: accepted, running or queued


@dataclass
class ReplicaCounters:
    host_loads: int = 0
    slot_loads: int = 0
    steps: int = 0
    busy_s: float = 0.0
    load_wait_s: float = 0.0


class SimReplica:
    def __init__(self, index: int, node: int, cfg: ReplicaConfig, model: StepModel, costs: TierCosts,
                 loop: EventLoop, fetch: Callable[["SimReplica", str, int, Callable[[], None]], None],
                 on_finish: Callable[[SimRequest], None]) -> None:
        self.index, self.node, self.cfg = index, node, cfg
        self.model, self.costs, self.loop = model, costs, loop
        self._fetch, self._on_finish = fetch, on_finish
        self._step_adapters: frozenset[str] = frozenset()  # the running batch's: neither tier may evict them
        self.host: HostLRUCache[str, int] = HostLRUCache(
            cfg.max_cpu_loras, can_evict=lambda a: a not in self._step_adapters, on_evict=self._on_host_evict)
        self.slots: HostLRUCache[str, int] = HostLRUCache(
            cfg.max_loras, can_evict=lambda a: a not in self._step_adapters)
        self.waiting: deque[SimRequest] = deque()
        self.running: list[SimRequest] = []
        self.loading: set[str] = set()
        self.parked: list[tuple[str, int]] = []  # loaded, no host entry could be freed yet
        self.counters = ReplicaCounters()
        self._stepping = False
        self._run: tuple[int, float, float, int] | None = None  # (version, start, dt, steps) of a decode run
        self._version = 0

    # ---- what the router sees ----

    @property
    def queue_len(self) -> int:
        return len(self.waiting) + len(self.running)

    def accepts(self) -> bool:
        return self.queue_len < self.cfg.max_ongoing

    def report(self) -> dict:
        """The replica's record_routing_stats dict (cluster/deployments.py's fields)."""
        gpu = list(self.slots)
        return {"gpu_adapters": gpu, "host_adapters": list(self.host), "free_slots": self.cfg.max_loras - len(gpu),
                "queue_len": self.queue_len, "max_loras": self.cfg.max_loras}

    # ---- requests ----

    def accept(self, r: SimRequest) -> None:
        r.replica = self.index
        self.waiting.append(r)
        if r.req.adapter is not None:
            self._ensure_loaded(r.req.adapter, r.req.rank)
        self._kick()

    def _ensure_loaded(self, adapter: str, rank: int) -> None:
        if adapter in self.host:
            return
        if adapter not in self.loading:
            self.loading.add(adapter)
            self.counters.host_loads += 1
            self._fetch(self, adapter, rank, lambda: self._loaded(adapter, rank))

    def _loaded(self, adapter: str, rank: int) -> None:
        try:
            self.host.put(adapter, rank)
        except LoRACapacityError:
            self.parked.append((adapter, rank))  # every entry is in use: retried when a request finishes
            return
        self.loading.discard(adapter)
        self._kick()

    def _on_host_evict(self, adapter: str, _rank: int) -> None:
        if adapter in self.slots:
            self.slots.remove(adapter)

    # ---- steps ----

    def _kick(self) -> None:
        if not self._stepping:
            self._start_step()
        elif self._run is not None and self._admissible():
            self._cut_run()

    def _admissible(self) -> bool:
        if len(self.running) >= self.cfg.max_num_seqs:
            return False
        return any(r.req.adapter is None or r.req.adapter in self.host for r in self.waiting)

    def _admit(self) -> list[SimRequest]:
        batch_adapters = {r.req.adapter for r in self.running if r.req.adapter is not None}
        room = self.cfg.max_num_seqs - len(self.running)
        budget = self.cfg.max_num_batched_tokens
        admitted, kept = [], deque()
        for r in self.waiting:
            a = r.req.adapter
            ok = room > 0 and (budget >= r.req.prompt_tokens or not admitted)
            if ok and a is not None:
                if a not in self.host:
                    ok = False
                    self._ensure_loaded(a, r.req.rank)  # its host entry was evicted while it waited
                elif a not in batch_adapters and len(batch_adapters) >= self.cfg.max_loras:
                    ok = False
            if ok:
                admitted.append(r)
                room -= 1
                budget -= r.req.prompt_tokens
                if a is not None:
                    batch_adapters.add(a)
            else:
                kept.append(r)
        self.waiting = kept
        return admitted

    def _start_step(self) -> None:
        admitted = self._admit()
        if not self.running and not admitted:
            self._stepping = False
            return
        self._stepping = True
        batch = self.running + admitted
        adapters = {r.req.adapter: r.req.rank for r in batch if r.req.adapter is not None}
        self._step_adapters = frozenset(adapters)
        write_s = 0.0
        for a, rank in adapters.items():
            if a in self.slots:
                self.slots.touch(a)
            else:
                self.slots.put(a, rank)  # the batch fits the slots (_admit), so a victim exists
                self.counters.slot_loads += 1
                write_s += self.costs.slot_write_s(self.model.adapter_bytes(rank))
            self.host.touch(a)
        prompt = sum(r.req.prompt_tokens for r in admitted)
        dt = self.model.step_s(len(self.running), prompt, len(adapters), max(adapters.values(), default=0))
        self._version += 1
        if admitted:
            self.running = batch
            self._run = None
            self.loop.after(dt + write_s, self._end_steps, self._version, 1, dt + write_s, admitted)
        else:
            steps = min(r.remaining for r in self.running)
            self._run = (self._version, self.loop.now, dt, steps)
            self.loop.after(dt * steps, self._end_steps, self._version, steps, dt, ())

    def _cut_run(self) -> None:
        """New work can join: end the decode run at the end of the step in progress."""
        version, start, dt, steps = self._run
        done = min(steps, int((self.loop.now - start) / dt) + 1)
        if done < steps:
            self._version += 1
            self._run = None
            self.loop.at(start + done * dt, self._end_steps, self._version, done, dt, ())

    def _end_steps(self, version: int, steps: int, dt: float, admitted) -> None:
        if version != self._version:
            return  # a cut run's original end
        self._run = None
        now = self.loop.now
        c = self.counters
        c.steps += steps
        c.busy_s += steps * dt
        for r in admitted:
            r.first_token_s = now
            r.remaining = r.req.output_tokens
        still = []
        for r in self.running:
            r.remaining -= steps
            if r.remaining <= 0:
                r.finish_s = now
                self._on_finish(r)
            else:
                still.append(r)
        finished = len(still) < len(self.running)
        self.running = still
        if finished and self.parked:
            parked, self.parked = self.parked, []
            self._step_adapters = frozenset(r.req.adapter for r in still if r.req.adapter is not None)
            for a, rank in parked:
                self._loaded(a, rank)
        self._start_step()
