"""AsyncLLMEngine: the LLMEngine behind an asyncio API, for servers.

    engine = AsyncLLMEngine(EngineArgs(model=path, enable_lora=True))
    async for out in engine.generate("Hello", SamplingParams(max_tokens=16), "req-1", lora_request=sql):
        print(out.outputs[0].text)          # cumulative; the last one has finished=True
    await engine.shutdown()

One background thread owns the LLMEngine: it builds it, runs its step loop
(blocking torch code, kept off the event loop) and applies commands from
asyncio callers between steps. Commands travel through a lock-guarded deque;
each carries a concurrent Future that the caller awaits. Outputs reach each
request's asyncio.Queue through its loop's call_soon_threadsafe. The thread
sleeps on a condition while there is nothing to run.

A bad request raises its typed error from its own generator; the others keep
running. If a step raises, every in-flight request gets EngineDeadError and so
does every later call.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
from collections import deque
from collections.abc import AsyncIterator, Callable, Mapping
from concurrent.futures import Future
from dataclasses import dataclass, field, replace
from typing import Any

from lora_core.request import LoRARequest
from replicas.engine import EngineArgs, LLMEngine
from replicas.errors import EngineDeadError, InvalidRequestError, RequestAbortedError
from replicas.outputs import CompletionOutput, RequestOutput
from replicas.sampling_params import RequestOutputKind, SamplingParams

# How often an idle engine loop looks at background adapter loads (it never blocks on one).
_LOAD_POLL_S = 0.005


@dataclass
class _Stream:
    """One request's way back to its consumer. ``last`` is touched by the engine thread only."""

    request_id: str
    loop: asyncio.AbstractEventLoop
    delta: bool = False  # SamplingParams.output_kind DELTA: each output carries only what is new
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    last: RequestOutput | None = None

    def put(self, item: RequestOutput | BaseException) -> None:
        try:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, item)
        except RuntimeError:  # the consumer's loop is closed: nobody is listening any more
            pass


@dataclass
class _Command:
    fn: Callable[..., Any]
    args: tuple
    future: Future


class AsyncLLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        """Start the engine thread and wait until it has built the LLMEngine (errors re-raised here)."""
        self.args = args
        self.engine: LLMEngine | None = None
        self._cond = threading.Condition()
        self._commands: deque[_Command] = deque()
        self._closed: EngineDeadError | None = None  # set once the loop has stopped or died
        self._stopping = False
        self._streams: dict[str, _Stream] = {}  # engine thread only
        self._aborting: set[str] = set()  # engine thread only
        self._init_error: BaseException | None = None
        ready = threading.Event()
        self._thread = threading.Thread(target=self._run, args=(ready,), name="lorafleet-engine", daemon=True)
        self._thread.start()
        ready.wait()
        if self._init_error is not None:
            self._thread.join()
            raise self._init_error

    @classmethod
    def from_engine_args(cls, args: EngineArgs) -> AsyncLLMEngine:
        return cls(args)

    @property
    def is_running(self) -> bool:
        return self._closed is None and self._thread.is_alive()

    # ---- requests ---------------------------------------------------------------------------

    async def generate(self, prompt: str | dict, sampling_params: SamplingParams | Mapping | None,
                       request_id: str, lora_request: LoRARequest | None = None,
                       priority: int = 0, tenant: str | None = None) -> AsyncIterator[RequestOutput]:
        """Yield cumulative outputs of one request as tokens arrive; the last has finished=True.

        sampling_params may be a mapping of SamplingParams fields (as a server receives them).
        A request that cannot be served raises its typed error here; closing or cancelling the
        consumer before the end aborts the request in the engine.
        """
        if isinstance(sampling_params, Mapping):
            known = {f.name for f in dataclasses.fields(SamplingParams)}
            unknown = sorted(set(sampling_params) - known)
            if unknown:
                raise InvalidRequestError([(key, f"unknown sampling parameter {key!r}") for key in unknown])
            sampling_params = SamplingParams(**sampling_params)
        elif sampling_params is not None and not isinstance(sampling_params, SamplingParams):
            raise InvalidRequestError([("sampling_params", f"must be SamplingParams, a mapping of its fields or "
                                        f"None, got {type(sampling_params).__name__}")])
        if sampling_params is not None and sampling_params.structured_outputs is not None:
            # compiled here, on a worker thread, not by add_request on the engine's: a big schema (or the first
            # one, which scans the vocabulary) would hold up every running request's steps; add_request then
            # finds the grammar in the compiler's cache
            await asyncio.to_thread(self.engine.grammars.compile, sampling_params.structured_outputs)
        delta = sampling_params is not None and sampling_params.output_kind is RequestOutputKind.DELTA
        stream = _Stream(request_id, asyncio.get_running_loop(), delta)
        done = False
        try:
            await asyncio.wrap_future(
                self._submit(self._add_request, stream, prompt, sampling_params, lora_request, priority, tenant))
            while True:
                item = await stream.queue.get()
                # cumulative outputs: a slow consumer may skip to the newest (deltas: each one counts)
                while (not delta and isinstance(item, RequestOutput) and not item.finished
                       and not stream.queue.empty()):
                    item = stream.queue.get_nowait()
                if isinstance(item, BaseException):
                    done = True
                    raise item
                done = item.finished
                yield item
                if done:
                    return
        finally:
            if not done:
                try:
                    self._submit(self._abort_stream, stream)
                except EngineDeadError:
                    pass

    async def abort(self, request_id: str) -> bool:
        """Abort a request; its consumer gets a last output with finish_reason 'abort'. False if unknown."""
        return await self._call(self._abort, request_id)

    # ---- adapters ---------------------------------------------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter; running requests keep streaming while it loads (raises the load's error)."""
        # The engine loop finishes the load in one of its steps (it steps while a load is awaited).
        loaded = await self._call(lambda: self.engine.begin_add_lora(lora_request))
        await asyncio.wrap_future(loaded)

    async def remove_lora(self, lora_name: str) -> bool:
        return await self._call(lambda: self.engine.remove_lora(lora_name))

    async def list_loras(self) -> list[LoRARequest]:
        return await self._call(lambda: self.engine.list_loras())

    async def pin_lora(self, lora_name: str) -> bool:
        return await self._call(lambda: self.engine.pin_lora(lora_name))

    # ---- lifetime ---------------------------------------------------------------------------

    async def shutdown(self) -> None:
        """Stop the loop: in-flight requests get RequestAbortedError, later calls EngineDeadError."""
        with self._cond:
            self._stopping = True
            self._cond.notify()
        await asyncio.get_running_loop().run_in_executor(None, self._thread.join)

    # ---- caller side ------------------------------------------------------------------------

    def _submit(self, fn: Callable[..., Any], *args: Any) -> Future:
        command = _Command(fn, args, Future())
        with self._cond:
            if self._closed is not None:
                raise _with_cause(EngineDeadError(str(self._closed)), self._closed.__cause__)
            self._commands.append(command)
            self._cond.notify()
        return command.future

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.wrap_future(self._submit(fn, *args))

    # ---- engine thread ----------------------------------------------------------------------

    def _run(self, ready: threading.Event) -> None:
        try:
            self.engine = LLMEngine(self.args)
        except BaseException as exc:
            self._init_error = exc
            with self._cond:
                self._closed = EngineDeadError(f"the engine failed to start: {exc}")
            ready.set()
            return
        ready.set()
        try:
            while (commands := self._next_commands()) is not None:
                for command in commands:
                    self._apply(command)
                if self.engine.has_unfinished_requests() or self._aborting:
                    if self.engine.waiting_only_for_loads() and not self._aborting:
                        self._nap()  # poll the loads, but stay open to new commands meanwhile
                    self._deliver(self.engine.step(wait_for_loads=False))
        except BaseException as exc:
            dead = EngineDeadError(f"the engine loop died: {type(exc).__name__}: {exc}")
            dead.__cause__ = exc
            self._close(dead, lambda exc=exc: _with_cause(EngineDeadError(str(dead)), exc))
        else:
            self._close(EngineDeadError("the engine was shut down"),
                        lambda: RequestAbortedError("the engine was shut down before the request finished"))
        finally:
            try:
                self.engine.shutdown()
            except Exception:  # already dead; shutting down is best effort
                pass

    def _nap(self) -> None:
        """Wait a little, or until a command arrives: nothing runs while adapters load."""
        with self._cond:
            if not (self._commands or self._stopping):
                self._cond.wait(timeout=_LOAD_POLL_S)

    def _next_commands(self) -> list[_Command] | None:
        """Wait for work; the pending commands, or None once shutdown was asked for."""
        with self._cond:
            while not (self._commands or self._stopping or self._aborting or self.engine.has_unfinished_requests()):
                self._cond.wait()
            if self._stopping:
                return None
            commands = list(self._commands)
            self._commands.clear()
            return commands

    def _apply(self, command: _Command) -> None:
        if not command.future.set_running_or_notify_cancel():
            return  # the caller gave up before it ran
        try:
            result = command.fn(*command.args)
        except Exception as exc:  # the caller's own error; the loop keeps serving
            command.future.set_exception(exc)
        else:
            command.future.set_result(result)

    def _add_request(self, stream: _Stream, prompt: str | dict, params: SamplingParams | None,
                     lora_request: LoRARequest | None, priority: int, tenant: str | None) -> None:
        if stream.request_id in self._streams:
            raise InvalidRequestError([("request_id", f"request_id {stream.request_id!r} is already in use")])
        self.engine.add_request(stream.request_id, prompt, params, lora_request, priority, tenant)
        self._streams[stream.request_id] = stream

    def _abort(self, request_id: str) -> bool:
        if request_id not in self._streams:
            return False
        self.engine.abort(request_id)
        self._aborting.add(request_id)  # the next step reports it finished
        return True

    def _abort_stream(self, stream: _Stream) -> None:
        # by identity: a rejected duplicate request_id must not abort the request that holds it
        if self._streams.get(stream.request_id) is stream:
            self._abort(stream.request_id)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their streams: one call into each consumer loop for all of them (a call per
        output cost the engine's thread ~10 us each: 0.34 ms a step at 32 requests, now 0.05 ms;
        bench/stream_delivery.py)."""
        batch: list[tuple[_Stream, RequestOutput | BaseException]] = []
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:  # its consumer has gone
                continue
            stream.last = out
            if out.finished:
                del self._streams[out.request_id]
                self._aborting.discard(out.request_id)
            # a request that failed after it was accepted (its adapter's background load): its consumer gets the error
            batch.append((stream, out.error if out.error is not None else out))
        for request_id in self._aborting:  # aborted but not reported by the engine: end them here
            stream = self._streams.pop(request_id, None)
            if stream is not None:
                batch.append((stream, _aborted(request_id, stream.last, stream.delta)))
        self._aborting.clear()
        _put_all(batch)

    def _close(self, closed: EngineDeadError, error: Callable[[], Exception]) -> None:
        """Refuse new commands, then fail the pending ones and every in-flight request."""
        with self._cond:
            self._closed = closed
            pending = list(self._commands)
            self._commands.clear()
        for command in pending:
            if command.future.set_running_or_notify_cancel():
                command.future.set_exception(_with_cause(EngineDeadError(str(closed)), closed.__cause__))
        for stream in self._streams.values():
            stream.put(error())
        self._streams.clear()
        self._aborting.clear()


def _put_all(batch: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    """Each item into its stream's queue, in order, through one call_soon_threadsafe per consumer loop."""
    by_loop: dict[asyncio.AbstractEventLoop, list[tuple[_Stream, RequestOutput | BaseException]]] = {}
    for stream, item in batch:
        by_loop.setdefault(stream.loop, []).append((stream, item))
    for loop, items in by_loop.items():
        try:
            loop.call_soon_threadsafe(_put_now, items)
        except RuntimeError:  # that loop is closed: nobody is listening any more
            pass


def _put_now(items: list[tuple[_Stream, RequestOutput | BaseException]]) -> None:
    for stream, item in items:
        stream.queue.put_nowait(item)


def _aborted(request_id: str, last: RequestOutput | None, delta: bool = False) -> RequestOutput:
    """The last output of a request aborted before the engine reported its end: the last one it did report,
    its running completions ended by "abort" (with DELTA outputs, adding nothing to what came before)."""
    if last is None:
        return RequestOutput(request_id, None, [], [CompletionOutput(0, "", [], None, "abort")], True)

    def ended(c: CompletionOutput) -> CompletionOutput:
        if delta:
            c = replace(c, text="", token_ids=[], logprobs=None if c.logprobs is None else [])
        return c if c.finish_reason else replace(c, finish_reason="abort")

    return replace(last, finished=True, outputs=[ended(c) for c in last.outputs])


def _with_cause(error: Exception, cause: BaseException | None) -> Exception:
    error.__cause__ = cause
    return error
