"""EngineAdapters: the adapters an engine has registered, and their loads in flight.

A load runs in the background on every rank (the runners' loader threads or
processes); the engine finishes it in a later step, so requests for the
base model or other adapters keep running meanwhile. An adapter the host
cache dropped since it was registered is reloaded the same way. Names and
ids are checked here, before any load starts: a clash is an
InvalidRequestError and changes nothing.
"""

from __future__ import annotations

from concurrent.futures import Future
from typing import Any, Callable

from lora_core.config import LoRAConfig
from lora_core.errors import UnknownLoRAError
from lora_core.request import LoRARequest
from replicas.errors import InvalidRequestError
from replicas.scheduler import Scheduler


class EngineAdapters:
    def __init__(self, executor: Any, scheduler: Scheduler, lora_config: LoRAConfig | None) -> None:
        self.executor, self.scheduler, self.lora_config = executor, scheduler, lora_config
        self.registered: dict[str, LoRARequest] = {}
        self.loading: dict[int, LoRARequest] = {}
        self.waiters: dict[int, list[Future]] = {}  # begin_add futures, by lora id

    def add(self, request: LoRARequest) -> None:
        """Load and validate an adapter on every rank; a bad adapter raises and changes nothing."""
        if self.start(request):
            self.finish(request.lora_int_id)

    def begin_add(self, request: LoRARequest) -> Future:
        """add without waiting: the future resolves (None, or add's exception) in the engine step that
        finishes the load."""
        future: Future = Future()
        try:
            loading = self.start(request)
        except Exception as exc:
            future.set_exception(exc)
            return future
        if loading:
            self.waiters.setdefault(request.lora_int_id, []).append(future)
        else:
            future.set_result(None)
        return future

    def start(self, request: LoRARequest) -> bool:
        """Check the request against what is registered; start loading it if new, or if the host cache
        dropped it since (a reload). True: a load is in flight."""
        known = self.registered.get(request.lora_name)
        if known is not None:
            if known != request:
                raise InvalidRequestError([("lora_request", f"adapter {request.lora_name!r} is already registered "
                                            f"as id {known.lora_int_id} at {known.lora_path}")])
            if request.lora_int_id in self.loading:
                return True
            if self.executor.call("lora_in_host_cache", request.lora_int_id):
                return False
            # Evicted from host memory: reload in the background too. (Evicted again before its step, the
            # runner reloads it synchronously: rare, and never wrong.)
            return self._begin(request)
        if self.lora_config is None:
            raise InvalidRequestError([("lora_request", "this engine was started without enable_lora")])
        loading = self.loading.get(request.lora_int_id)
        if loading is not None:
            if loading != request:
                raise InvalidRequestError([("lora_request", f"lora_int_id {request.lora_int_id} is being loaded "
                                            f"as {loading.lora_name!r} from {loading.lora_path}")])
            return True
        if any(r.lora_int_id == request.lora_int_id or r.lora_name == request.lora_name
               for r in self.registered.values()) or any(r.lora_name == request.lora_name
                                                         for r in self.loading.values()):
            raise InvalidRequestError([("lora_request", f"lora_int_id {request.lora_int_id} or name "
                                        f"{request.lora_name!r} is already in use")])
        return self._begin(request)

    def _begin(self, request: LoRARequest) -> bool:
        self.executor.call("start_lora_load", request)
        self.loading[request.lora_int_id] = request
        return True

    def finish(self, lora_id: int, wait_for_room: bool = False) -> bool:
        """Wait for one background load and register it on every rank; raises its error (nothing registered).

        wait_for_room: False (and nothing done) while the host cache is full of
        adapters that running requests use; the load is kept for a later step.
        """
        request = self.loading[lora_id]
        try:
            if self.executor.call("finish_lora_load", lora_id, wait_for_room) is None:
                return False
        except BaseException as exc:
            del self.loading[lora_id]
            for waiter in self.waiters.pop(lora_id, []):
                waiter.set_exception(exc)
            raise
        del self.loading[lora_id]
        self.registered[request.lora_name] = request
        for waiter in self.waiters.pop(lora_id, []):
            waiter.set_result(None)
        return True

    def done(self, block: bool, awaited: Callable[[int], bool]) -> list[int]:
        """Loads that have finished on every rank. block: none has, and nothing else can run, so return
        the oldest one something waits on (awaited(lora_id): requests park on it; or a begin_add)."""
        if not self.loading:
            return []
        # Finished on every rank: finish() waits for each rank's own load, so one that rank 0 finished first
        # would stall the step for the others' (with TP each rank reads the adapter and keeps its own shard).
        per_rank = self.executor.call_all("lora_loads_done")
        done = [i for i in per_rank[0] if all(i in other for other in per_rank[1:])]
        if block and not done:
            done = [next(i for i in self.loading if awaited(i) or self.waiters.get(i))]
        return done

    @property
    def has_waiters(self) -> bool:
        return any(self.waiters.values())

    def remove(self, name: str, in_use: Callable[[int], bool]) -> bool:
        request = self.registered.get(name)
        if request is None:
            return False
        if in_use(request.lora_int_id):
            raise InvalidRequestError([("lora_name", f"adapter {name!r} is in use by running requests")])
        self.executor.call("remove_lora", request.lora_int_id)
        self.scheduler.pinned.discard(request.lora_int_id)
        del self.registered[name]
        # Cached KV blocks are keyed by lora id; a later adapter under the same id must not reuse them.
        self.scheduler.block_manager.reset_prefix_cache()
        return True

    def pin(self, name: str) -> bool:
        """Keep an adapter in a GPU slot for good; one slot always stays for unpinned adapters."""
        if name not in self.registered:
            raise UnknownLoRAError(f"unknown adapter {name!r}")
        lora_id = self.registered[name].lora_int_id
        pinned = self.scheduler.pinned
        if lora_id not in pinned and len(pinned) + 1 >= self.lora_config.max_loras:
            raise InvalidRequestError([("lora_name", f"pinning {name!r} would leave no GPU slot for unpinned "
                                        f"adapters (max_loras={self.lora_config.max_loras}, "
                                        f"{len(pinned)} pinned)")])
        result = self.executor.call("pin_lora", lora_id)
        pinned.add(lora_id)
        return result
