"""EmulatedEngine: a stand-in for a GPU engine whose steps wait the replica model's time (bench only).

It is the surface of replicas.async_engine.AsyncLLMEngine that LoRAServer uses
(generate, abort, add_lora, remove_lora, shutdown, and the `engine` attributes
that routing_stats and metrics_samples read), over the simulator's own
SimReplica: continuous batching with its admission rules (FIFO, max_num_seqs,
max_num_batched_tokens, a host-resident adapter, distinct adapters <=
max_loras), its HostLRUCache host tier and GPU slots, the calibrated StepModel
for a step's time and TierCosts for a host load. Nothing is computed: a step
is a timer. So eight replicas of the real Serve stack (ingress, router, tier,
origin) fit on a two-core machine, and the simulator's predictions can be
checked against that stack (bench/fidelity.py, docs/simulator.md).

RealtimeLoop runs SimReplica on asyncio's clock, `time_factor` times slower
than modeled time, so that the real stack's own overheads are small against
the modeled durations. An event sees `now` as its scheduled time, so a late
wake-up does not push the steps after it back.

No generated text: every output token is TOKEN, a request always produces
max_tokens of them (as with ignore_eos), and a stream carries two outputs, the
first token and the finished one (what a slow consumer of a real engine's
cumulative outputs may see too).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
from collections.abc import AsyncIterator, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from lora_core.request import LoRARequest
from replicas.engine_args import EngineArgs
from replicas.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import SamplingParams

from cluster.simulator.calibration import TierCosts
from cluster.simulator.emulated_view import EngineView
from cluster.simulator.replica import ReplicaConfig, SimReplica, SimRequest
from cluster.simulator.tiers import PerReplicaDownload
from cluster.simulator.sim import step_model
from cluster.simulator.workload import Request

TOKEN = 0  # the id of every emulated output token


@dataclass(frozen=True)
class Emulation:
    """What an emulated replica models beyond its EngineArgs (the engine's limits)."""

    gpu: str = "h200-llama3-8b"  # a calibration.ROWS table
    time_factor: float = 1.0  # wall seconds per modeled second
    rank: int = 16  # the modeled rank of every adapter (the files served stand in for its bytes)
    max_ongoing: int = 64  # Serve's max_ongoing_requests of the deployment (SimReplica accepts up to it)
    costs: TierCosts = field(default_factory=TierCosts)
    same_node: bool = True  # on the tier's node: a host load reads the object store without the network
    # Ray Serve LLM's loader: a replica's first use of an adapter downloads it from the origin to its own disk
    # (the simulator's PerReplicaDownload); the shared tier then only stands in for the bytes.
    per_replica_origin: bool = False

    def __post_init__(self) -> None:
        if not self.time_factor > 0:
            raise ValueError(f"time_factor must be > 0, got {self.time_factor!r}")
        if isinstance(self.costs, Mapping):
            object.__setattr__(self, "costs", TierCosts(**self.costs))

    @classmethod
    def from_dict(cls, d: Mapping[str, Any] | None) -> "Emulation":
        return cls(**(d or {}))

    def origin_wall_s(self) -> float:
        """Wall seconds an origin fetch of one adapter takes at least (TierCosts.origin_s, scaled)."""
        return self.costs.origin_s(step_model(self.gpu).adapter_bytes(self.rank)) * self.time_factor


class RealtimeLoop:
    """cluster.simulator.events.EventLoop's interface (now, at, after) on asyncio's clock, time_factor x slower.

    Inside an event, `now` is its scheduled time; an entry from outside (a new request) calls sync() first,
    which moves `now` to the wall clock's. `now` never goes back.
    """

    def __init__(self, time_factor: float, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self.time_factor = time_factor
        self.loop = loop or asyncio.get_running_loop()
        self._origin = self.loop.time()
        self.now = 0.0
        self.closed = False
        self.events_run = 0
        self.late_max_s = 0.0  # how far behind its time an event ran, at worst (wall seconds)
        self.late_sum_s = 0.0

    def sync(self) -> float:
        self.now = max(self.now, (self.loop.time() - self._origin) / self.time_factor)
        return self.now

    def clock(self) -> float:
        return self.sync()

    def at(self, when: float, fn: Callable[..., None], *args: Any) -> None:
        when = max(when, self.now)
        self.loop.call_at(self._origin + when * self.time_factor, self._fire, when, fn, args)

    def after(self, delay: float, fn: Callable[..., None], *args: Any) -> None:
        self.at(self.now + delay, fn, *args)

    def _fire(self, when: float, fn: Callable[..., None], args: tuple) -> None:
        if self.closed:
            return
        late = self.loop.time() - (self._origin + when * self.time_factor)
        self.late_max_s = max(self.late_max_s, late)
        self.late_sum_s += max(late, 0.0)
        self.events_run += 1
        self.now = max(self.now, when)
        fn(*args)


class _EngineReplica(SimReplica):
    """SimReplica that also tells when a request's first token is out (the end of its prompt step)."""

    def __init__(self, *args: Any, on_first_token: Callable[[SimRequest], None], **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._on_first_token = on_first_token

    def _end_steps(self, version: int, steps: int, dt: float, admitted) -> None:
        super()._end_steps(version, steps, dt, admitted)
        for r in admitted:
            if r.first_token_s >= 0:
                self._on_first_token(r)


@dataclass
class _Stream:
    request_id: str
    prompt: str | None
    prompt_ids: list[int]
    max_tokens: int
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    first_sent: bool = False
    done: bool = False


class EmulatedEngine:
    """AsyncLLMEngine's surface for LoRAServer, with SimReplica's batching on a RealtimeLoop (see the module)."""

    def __init__(self, args: EngineArgs, emulation: Emulation, tokenizer: Callable[[], Any] | None = None) -> None:
        self.args, self.emulation = args, emulation
        self.model = step_model(emulation.gpu)
        lora = args.lora_config()
        self.config = ReplicaConfig(max_loras=args.max_loras, max_cpu_loras=lora.max_cpu_loras if lora else 1,
                                    max_num_seqs=args.max_num_seqs,
                                    max_num_batched_tokens=args.max_num_batched_tokens,
                                    max_ongoing=emulation.max_ongoing)
        self.engine = EngineView(self, tokenizer)
        self.clock: RealtimeLoop | None = None
        self.replica: _EngineReplica | None = None
        self.adapters: dict[str, LoRARequest] = {}  # added (add_lora), by lora_name
        self._streams: dict[int, _Stream] = {}
        self._requests: dict[str, SimRequest] = {}  # by request_id
        self._rids = itertools.count()
        self._closed = False
        self._downloads: PerReplicaDownload | None = None  # per_replica_origin: the simulator's own loader

    @property
    def is_running(self) -> bool:
        return not self._closed

    def _start(self) -> _EngineReplica:
        """The replica and its clock, on the first caller's event loop."""
        if self._closed:
            raise EngineDeadError("the engine was shut down")
        if self.replica is None:
            self.clock = RealtimeLoop(self.emulation.time_factor)
            if self.emulation.per_replica_origin:
                self._downloads = PerReplicaDownload(self.clock, self.model, self.emulation.costs)
            self.replica = _EngineReplica(0, 0, self.config, self.model, self.emulation.costs, self.clock,
                                          self._fetch, self._finished, on_first_token=self._first_token)
        elif asyncio.get_running_loop() is not self.clock.loop:
            raise RuntimeError("an EmulatedEngine serves one event loop")
        self.clock.sync()
        return self.replica

    def _fetch(self, replica: SimReplica, adapter: str, rank: int, done: Callable[[], None]) -> None:
        """A host load: the adapter's bytes read into the host tier from the object store (or node-local disk)."""
        if self._downloads is not None:  # the origin on this replica's first use, then its disk
            self._downloads.fetch(replica, adapter, rank, done)
            return
        nbytes = self.model.adapter_bytes(rank)
        cost = self.emulation.costs.local_load_s(nbytes)
        if not self.emulation.same_node:
            cost += self.emulation.costs.remote_read_s(nbytes)
        self.clock.after(cost, done)

    # ---- requests ----------------------------------------------------------------------------

    async def generate(self, prompt: str | dict, sampling_params: SamplingParams | Mapping | None,
                       request_id: str, lora_request: LoRARequest | None = None,
                       priority: int = 0, tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """The first-token output, then the finished one; closing the consumer early aborts the request."""
        params = _sampling(sampling_params)
        ids = self._prompt_ids(prompt)
        if request_id in self._requests:
            raise InvalidRequestError([("request_id", f"request_id {request_id!r} is already in use")])
        adapter = None
        if lora_request is not None:
            if self.adapters.get(lora_request.lora_name) != lora_request:
                raise InvalidRequestError([("lora_request", f"adapter {lora_request.lora_name!r} was not added")])
            adapter = lora_request.lora_name
        replica = self._start()
        r = SimRequest(next(self._rids), Request(self.clock.now, adapter, len(ids), params.max_tokens,
                                                 self.emulation.rank if adapter else 0))
        stream = _Stream(request_id, prompt if isinstance(prompt, str) else None, ids, params.max_tokens)
        self._streams[r.rid] = stream
        self._requests[request_id] = r
        replica.accept(r)
        try:
            while True:
                item = await stream.queue.get()
                if isinstance(item, BaseException):
                    raise item
                yield item
                if item.finished:
                    return
        finally:
            if not stream.done:
                self._drop(r)
            self._streams.pop(r.rid, None)
            self._requests.pop(request_id, None)

    def _prompt_ids(self, prompt: str | dict) -> list[int]:
        if isinstance(prompt, Mapping) and "prompt_token_ids" in prompt:
            ids = list(prompt["prompt_token_ids"])
        elif isinstance(prompt, str):
            ids = self.engine.tokenizer.encode(prompt)
        else:
            raise InvalidRequestError([("prompt", "a string or {'prompt_token_ids': [...]}")])
        if not ids:
            raise InvalidRequestError([("prompt", "the prompt is empty")])
        return ids

    def _output(self, s: _Stream, tokens: int, finish_reason: str | None = None) -> RequestOutput:
        outputs = [CompletionOutput(0, "", [TOKEN] * tokens, None, finish_reason)]
        return RequestOutput(s.request_id, s.prompt, s.prompt_ids, outputs, finish_reason is not None)

    def _first_token(self, r: SimRequest) -> None:
        s = self._streams.get(r.rid)
        if s is not None and not s.done and not s.first_sent:
            s.first_sent = True
            s.queue.put_nowait(self._output(s, 1))

    def _finished(self, r: SimRequest) -> None:
        s = self._streams.get(r.rid)
        if s is not None and not s.done:
            s.done = True
            s.queue.put_nowait(self._output(s, s.max_tokens, "length"))

    def _drop(self, r: SimRequest) -> None:
        """A request leaves before its end: out of the queue or the running batch."""
        replica = self.replica
        if r in replica.waiting:
            replica.waiting.remove(r)
        elif r in replica.running:
            replica.running.remove(r)

    async def abort(self, request_id: str) -> bool:
        r = self._requests.get(request_id)
        s = None if r is None else self._streams.get(r.rid)
        if s is None or s.done:
            return False
        self._drop(r)
        s.done = True
        s.queue.put_nowait(self._output(s, int(s.first_sent), "abort"))
        return True

    # ---- adapters ----------------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Known from now on; its host load runs when a request needs it (SimReplica.accept), as the engine
        prefetches a queued request's adapter."""
        self._start()
        if lora_request.lora_name in self.adapters:
            raise InvalidRequestError([("lora_name", f"adapter {lora_request.lora_name!r} is already added")])
        self.adapters[lora_request.lora_name] = lora_request

    async def remove_lora(self, lora_name: str) -> bool:
        replica = self._start()
        if lora_name not in self.adapters:
            return False
        if any(r.req.adapter == lora_name for r in (*replica.waiting, *replica.running)):
            raise InvalidRequestError([("lora_name", f"adapter {lora_name!r} is in use")])
        for tier in (replica.slots, replica.host):
            if lora_name in tier:
                tier.remove(lora_name)
        del self.adapters[lora_name]
        return True

    async def list_loras(self) -> list[LoRARequest]:
        return list(self.adapters.values())

    async def shutdown(self) -> None:
        self._closed = True
        if self.clock is not None:
            self.clock.closed = True
        for s in self._streams.values():
            if not s.done:
                s.done = True
                s.queue.put_nowait(RequestAbortedError("the engine was shut down before the request finished"))

    def counters(self) -> dict[str, float]:
        """SimReplica's counters (host and slot loads, steps, busy and load-wait seconds), the origin downloads
        (per_replica_origin) and the clock's lag."""
        out = dataclasses.asdict(self.replica.counters) if self.replica else {}
        out["origin_downloads"] = self._downloads.counters.origin_fetches if self._downloads else 0
        if self.clock is not None:
            out.update(events=self.clock.events_run, late_max_s=self.clock.late_max_s,
                       late_sum_s=self.clock.late_sum_s)
        return out


def _sampling(params: SamplingParams | Mapping | None) -> SamplingParams:
    """SamplingParams from what a server passes, checked as the engine checks them."""
    if params is None:
        return SamplingParams()
    if isinstance(params, SamplingParams):
        return params
    known = {f.name for f in dataclasses.fields(SamplingParams)}
    unknown = sorted(set(params) - known)
    if unknown:
        raise InvalidRequestError([(key, f"unknown sampling parameter {key!r}") for key in unknown])
    return SamplingParams(**params)
