"""LLMEngine: continuous batching over one replica (scheduler + executor + sampler + detokenizer).

add_request validates everything it can before accepting a request (prompt,
sampling parameters, adapter), so a bad request fails alone and the engine
keeps serving the others. step() runs one model step for the whole mixed
batch and returns a cumulative RequestOutput for every request it advanced
or finished.

Async scheduling (EngineArgs.async_scheduling, on by default on GPUs):
step() launches step N+1 before it reads back the tokens step N sampled, so
the host's work for a step (reading tokens back, stop checks, detokenizing,
outputs, scheduling, inputs) runs while the GPU computes instead of between
its steps. Step N's sampled tokens enter the scheduler as PENDING_TOKEN
placeholders (lengths and max_tokens are known without them) and reach step
N+1's inputs by a copy on the device. A request that a stop token or string
ends at step N has computed one more token in step N+1, which is dropped.
step() therefore returns the outputs of the previous step's tokens. Where
steps with prompt tokens run eagerly (CPU, enforce_eager, cudagraph_mode
"full_decode_only"), the previous tokens are read back before one of those
instead (read_back_before_prompt_steps): launching it costs the host about
what the step costs the GPU, so there is little to overlap.
"""

from __future__ import annotations

from concurrent.futures import Future

import torch

from lora_core.errors import LoRAError
from lora_core.request import LoRARequest
from replicas import prompt_logprobs
from replicas.block_manager import BlockManager
from replicas.engine_adapters import EngineAdapters
from replicas.engine_args import EngineArgs  # also imported from here, as replicas.engine.EngineArgs
from replicas.errors import EngineError, InvalidRequestError
from replicas.executor import make_executor
from replicas.grammar import GrammarBackend, SequenceGrammar
from replicas.model_runner import RunnerConfig
from replicas.outputs import RequestOutput
from replicas.parallel_sampling import FanOut, child_id, child_params
from replicas.request_inputs import (bad_words_ids, check_token_ids, checked_priority, checked_settings,
                                     checked_tenant, prompt_ids, truncated)
from replicas.request_state import RequestState
from replicas.sampled_step import SampledStep, step_input
from replicas.sampler import Sampler
from replicas.sampling_params import RequestOutputKind, SamplingParams
from replicas.scheduler import Scheduler, SchedulerConfig, SchedulerOutput
from replicas.sequence import PENDING_TOKEN, Sequence
from replicas.tokenizer import IncrementalDetokenizer, Tokenizer
from replicas.triton_compile import compile_workers_for


class LLMEngine:
    def __init__(self, args: EngineArgs) -> None:
        self.args = args
        device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.tokenizer = Tokenizer.from_pretrained(args.model)
        self.lora_config = args.lora_config()
        runner_cfg = RunnerConfig(model=args.model, dtype=args.dtype, device=device, block_size=args.block_size,
                                  num_blocks=args.num_kv_blocks, kv_cache_memory_bytes=args.kv_cache_memory_bytes,
                                  gpu_memory_utilization=args.gpu_memory_utilization,
                                  max_num_batched_tokens=args.max_num_batched_tokens,
                                  max_num_seqs=args.max_num_seqs, lora_config=self.lora_config,
                                  load_format=args.load_format, max_model_len=args.max_model_len,
                                  enforce_eager=args.enforce_eager or args.cudagraph_mode == "none",
                                  piecewise_graphs=args.cudagraph_mode == "full_and_piecewise",
                                  # decided here, for all ranks alike: their compile-only passes run collectives
                                  compile_workers=compile_workers_for(args.compile_workers, device,
                                                                      args.tensor_parallel_size),
                                  lora_load_processes=args.lora_load_processes,
                                  lora_load_switch_interval=args.lora_load_switch_interval,
                                  lora_host_pool=args.lora_host_pool, lora_merge_steps=args.lora_merge_steps,
                                  lora_stacked_max_tokens=args.lora_stacked_max_tokens,
                                  lora_fused_max_adapters=args.lora_fused_max_adapters,
                                  lora_compact_slots=args.lora_compact_slots,
                                  lora_pending_max_tokens=args.lora_pending_max_tokens,
                                  lora_pending_min_adapters=args.lora_pending_min_adapters,
                                  quantization=args.quantization, kv_cache_dtype=args.kv_cache_dtype)
        self.executor = make_executor(runner_cfg, args.tensor_parallel_size, args.distributed_executor_backend)
        # GPU: compile the kernels, capture the decode and piecewise graphs
        self.num_cuda_graphs = self.executor.call("warm_up")
        mc = self.executor.model_config
        self.model_config = mc
        self.max_model_len = min(args.max_model_len or mc.max_position_embeddings, mc.max_position_embeddings)
        self.scheduler = Scheduler(
            SchedulerConfig(max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
                            max_loras=args.max_loras if args.enable_lora else 0, max_model_len=self.max_model_len,
                            policy=args.scheduling_policy, fair_prompt_weight=args.fair_prompt_weight,
                            fair_output_weight=args.fair_output_weight),
            BlockManager(self.executor.runner.num_blocks, args.block_size, args.enable_prefix_caching,
                         mc.long_rope_from))
        self.sampler = Sampler(args.seed)
        self.grammars = GrammarBackend(self.tokenizer, mc.vocab_size)
        self._eos = tuple(mc.eos_token_ids) or ((self.tokenizer.eos_token_id,) if self.tokenizer.eos_token_id
                                               is not None else ())
        self._requests: dict[str, RequestState] = {}
        self._fanout = FanOut()  # requests with n > 1 and their child sequences
        self.adapters = EngineAdapters(self.executor, self.scheduler, self.lora_config)
        # Adapters named by requests load in the background while other requests run; their
        # requests wait here, outside the scheduler, until the load ends.
        self._parked: dict[int, list[Sequence]] = {}
        self._aborted_parked: list[Sequence] = []
        wanted = device.startswith("cuda") if args.async_scheduling is None else args.async_scheduling
        self.async_scheduling = bool(wanted) and getattr(self.executor, "takes_device_tokens", False)
        # An eager step with prompt tokens takes the host about as long to launch as the GPU to run, so
        # overlapping it buys little and would hold back the previous tokens (new requests' first tokens
        # among them) that long: read them back first. Replayed from piecewise graphs, it overlaps too.
        prompt_graphs = (device.startswith("cuda") and not args.enforce_eager
                         and args.cudagraph_mode == "full_and_piecewise")
        self.read_back_before_prompt_steps = not prompt_graphs
        self._in_flight: SampledStep | None = None  # launched, tokens not read back yet

    # ---- adapters (replicas/engine_adapters.py) ----------------------------------------------

    def add_lora(self, request: LoRARequest) -> None:
        """Load and validate an adapter on every rank; a bad adapter raises and changes nothing."""
        self.adapters.add(request)

    def begin_add_lora(self, request: LoRARequest) -> Future:
        """add_lora without waiting: the load runs in the background while step() keeps serving.

        The future resolves (None, or add_lora's exception) in the step that
        finishes the load, so keep stepping while has_unfinished_requests().
        """
        return self.adapters.begin_add(request)

    def remove_lora(self, name: str) -> bool:
        return self.adapters.remove(name, lambda lora_id: any(r.seq.lora_int_id == lora_id
                                                              for r in self._requests.values()))

    def list_loras(self) -> list[LoRARequest]:
        return list(self.adapters.registered.values())

    def pin_lora(self, name: str) -> bool:
        """Keep an adapter in a GPU slot for good; one slot always stays for unpinned adapters."""
        return self.adapters.pin(name)

    def _collect_loads(self, block: bool) -> list[RequestOutput]:
        """Admit the requests whose adapters finished loading; fail those whose adapter is broken.

        block: nothing else can run, so wait for the oldest load that requests wait on, rather than spin.
        """
        failed = []
        for lora_id in self.adapters.done(block, lambda i: bool(self._parked.get(i))):
            try:
                # Room in the host cache frees up as running requests finish: wait for it while any run.
                if not self.adapters.finish(lora_id, wait_for_room=self.scheduler.has_unfinished()):
                    continue
            except Exception as exc:  # its requests fail, nothing else does
                if isinstance(exc, EngineError):  # the engine's own failure (a lost load worker): not the client's
                    error = exc
                else:  # the adapter's own problem
                    error = InvalidRequestError([("lora_request", str(exc))])
                    error.__cause__ = exc
                failed += [self._failed(seq, error) for seq in self._parked.pop(lora_id, [])]
                continue
            for seq in self._parked.pop(lora_id, []):
                self.scheduler.add(seq)
        return failed

    def _failed(self, seq: Sequence, error: Exception) -> RequestOutput:
        return self._requests.pop(seq.request_id).failed(error)

    # ---- requests ---------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt: str | dict, params: SamplingParams | None = None,
                    lora_request: LoRARequest | None = None, priority: int = 0, tenant: str | None = None) -> None:
        """Queue a request; with params.n > 1, n child sequences that report as one (parallel_sampling.py).
        priority: lower is served first, under EngineArgs.scheduling_policy "priority" (else it must be 0).
        tenant: whose share it counts against under scheduling_policy "fair" (None: its adapter's); else unused."""
        params = checked_settings(params, lora_request)
        priority = checked_priority(priority, self.args.scheduling_policy)
        tenant = checked_tenant(tenant)
        text, ids = prompt_ids(self.tokenizer, self.model_config.vocab_size, prompt)
        ids = truncated(ids, params)
        check_token_ids(params, self.model_config.vocab_size)
        grammar = self.grammars.compile(params.structured_outputs) if params.structured_outputs else None
        children = [(request_id, params)] if params.n == 1 else [
            (child_id(request_id, i), child_params(params, i)) for i in range(params.n)]
        for rid in {request_id, *(cid for cid, _ in children)}:
            if rid in self._requests or rid in self._fanout:
                raise InvalidRequestError([("request_id", f"request_id {rid!r} is already in use")])
        # Past the first child's adapter start the others pass every check it passed: whole or not at all.
        first = self._add_sequence(*children[0], text, ids, lora_request, priority, grammar, tenant=tenant)
        if params.n > 1:
            self._fanout.add(request_id, params.n, params.output_kind is RequestOutputKind.FINAL_ONLY)
        # The others wait for the first to compute the prompt, then share its full blocks (scheduler.py).
        bm = self.scheduler.block_manager
        leader = first if bm.enable_prefix_caching and len(ids) > bm.block_size else None
        for cid, child in children[1:]:
            self._add_sequence(cid, child, text, ids, lora_request, priority, grammar, leader, tenant=tenant)

    def _add_sequence(self, request_id: str, params: SamplingParams, text: str | None, ids: list[int],
                      lora_request: LoRARequest | None, priority: int, grammar: object = None,  # compiled
                      prefix_leader: Sequence | None = None, tenant: str | None = None) -> Sequence:
        loading = False
        if lora_request is not None:
            try:
                loading = self.adapters.start(lora_request)
            except LoRAError as exc:  # the adapter's own problem, for this request only
                raise InvalidRequestError([("lora_request", str(exc))]) from exc
        seq = Sequence(request_id, ids, params, lora_request, eos_token_ids=self._eos,
                       bad_words_ids=bad_words_ids(self.tokenizer, params), priority=priority, tenant=tenant)
        seq.prefix_leader = prefix_leader
        if loading:  # a broken adapter fails this request later, as an output with .error
            self._parked.setdefault(lora_request.lora_int_id, []).append(seq)
        else:
            self.scheduler.add(seq)
        detok = IncrementalDetokenizer(self.tokenizer, ids, stop=params.stop,
                                       skip_special_tokens=params.skip_special_tokens,
                                       include_stop_str_in_output=params.include_stop_str_in_output,
                                       min_tokens=params.min_tokens)
        self._requests[request_id] = RequestState(seq, text, detok, lora_request.lora_name if lora_request else None,
                                              [] if params.logprobs is not None else None)
        if grammar is not None:
            self._requests[request_id].grammar = self.grammars.matcher(grammar, {*self._eos, *params.stop_token_ids})
        return seq

    def abort(self, request_id: str) -> bool:
        if request_id in self._fanout:
            return any([self._abort_one(cid) for cid in self._fanout.children(request_id)])
        return self._abort_one(request_id)

    def _abort_one(self, request_id: str) -> bool:
        for parked in self._parked.values():
            for seq in parked:
                if seq.request_id == request_id:
                    parked.remove(seq)
                    seq.set_finished("abort")
                    self._aborted_parked.append(seq)  # reported by the next step
                    return True
        seq = self.scheduler.abort(request_id)
        return seq is not None

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished() or self._unreported() or any(self._parked.values())
                or bool(self._aborted_parked) or self.adapters.has_waiters or self._in_flight is not None)

    def _unreported(self) -> bool:
        """A sequence finished between steps (aborted) whose output the next step gives."""
        return any((state := self._requests.get(seq.request_id)) is not None and state.seq is seq
                   for seq in self.scheduler.finished_since_step)

    # ---- one step ---------------------------------------------------------------------------

    def waiting_only_for_loads(self) -> bool:
        """Nothing to compute until an adapter load ends (requests or add_lora callers wait on one)."""
        return (not self.scheduler.has_unfinished() and not self._unreported() and not self._aborted_parked
                and self._in_flight is None
                and (any(self._parked.values()) or self.adapters.has_waiters))

    def step(self, wait_for_loads: bool = True) -> list[RequestOutput]:
        """One model step. When only adapter loads are pending, wait for one (wait_for_loads) or return.

        With async scheduling the outputs are those of the previous step's tokens (module docstring).
        """
        # With a step on the GPU, finished loads wait until the next step is launched: their requests then run
        # a step later, but their slot copies overlap that step instead of stalling every row of it (_prefetch).
        later = self._in_flight is not None
        failed = [] if later else self._collect_loads(block=wait_for_loads and self.waiting_only_for_loads())
        previous, self._in_flight = self._in_flight, None
        out = self.scheduler.schedule()
        touched: dict[str, Sequence] = {seq.request_id: seq for seq in self._aborted_parked}
        self._aborted_parked = []
        if previous is not None and self.read_back_before_prompt_steps and any(s.is_prefill for s in out.scheduled):
            self._read_back(previous, touched)
            previous = None
            out.scheduled = [s for s in out.scheduled if not s.seq.is_finished]  # stopped: blocks freed
        logits = None
        if out.scheduled:
            logits = prompt_logprobs.execute(self.executor, *self._step_input(out, previous), out.scheduled,
                                             self._prompt_logprobs_of)
        if later:
            failed = self._collect_loads(block=False)
        if out.scheduled:
            self._prefetch()  # on a GPU the step is still running: adapter copies overlap it
        if previous is not None:
            self._read_back(previous, touched)  # on a GPU this step runs meanwhile
        step = self._sample(out, logits) if out.scheduled else None
        if step is not None and not self.async_scheduling:
            self._advance(step)
            self._read_back(step, touched)
        results = self._outputs(touched, out.finished)
        if step is not None and self.async_scheduling:
            self._advance(step)  # after the outputs: no output may hold a placeholder
            self._in_flight = step
        return self._fanout.merge(failed + results, self._abort_one)

    def _sample(self, out: SchedulerOutput, logits: torch.Tensor) -> SampledStep:
        """Sample on the device and start copying the tokens back."""
        samplers = [s.seq for s in out.scheduled if s.samples]
        masks = self.grammars.token_masks([self._grammar_of(seq) for seq in samplers], pin=logits.is_cuda)
        step = SampledStep(out, samplers, self.sampler.sample(logits, samplers, token_masks=masks))
        ids = step.sampled.token_ids
        if ids.is_cuda:
            step.host_tokens = torch.empty(ids.shape, dtype=ids.dtype, pin_memory=True)
            step.host_tokens.copy_(ids, non_blocking=True)
            step.ready = torch.cuda.Event()
            step.ready.record()
        return step

    def _advance(self, step: SampledStep) -> None:
        """The scheduler records the step, with a placeholder for each sampled token."""
        samplers = step.samplers
        self.scheduler.update_from_output(step.out, dict.fromkeys((s.request_id for s in samplers), PENDING_TOKEN))
        for row, seq in enumerate(samplers):  # those finished before this step appended nothing
            if seq.output_token_ids and seq.output_token_ids[-1] == PENDING_TOKEN:
                step.pending.append((seq, seq.num_output_tokens - 1, row))

    def _read_back(self, step: SampledStep, touched: dict[str, Sequence]) -> None:
        """Put a sampled step's real tokens in place; stop tokens, EOS and stop strings finish requests."""
        tokens = step.tokens()
        constrained: list[tuple[Sequence, SequenceGrammar, int]] = []
        for seq, index, row in step.pending:
            token = tokens[row]
            seq.output_token_ids[index] = token
            state = self._requests.get(seq.request_id)
            if state is None or state.seq is not seq:  # aborted and reported while in flight: its id may be reused
                continue
            lp = step.sampled.logprobs[row]
            if state.logprobs is not None and lp is not None:
                state.logprobs.append(lp.as_dict())
            reason, stop = self.scheduler.token_stop(seq, token)
            if reason is not None:
                self._stop(seq, reason, stop)
            if state.grammar is not None:
                constrained.append((seq, state.grammar, token))
            params = seq.sampling_params
            # A stop token's text is not output, nor EOS's where it ends the sequence (skip_special_tokens off)
            ends = token in params.stop_token_ids or (token in seq.eos_token_ids and not params.ignore_eos)
            delta = state.detok.add_tokens([] if ends and not params.include_stop_str_in_output else [token])
            if delta.stopped:
                self._stop(seq, "stop", state.detok.stop_str)
            touched[seq.request_id] = seq
        for seq, ended in zip((c[0] for c in constrained), self.grammars.advance([c[1:] for c in constrained])):
            if ended:  # complete (EOS under ignore_eos); a refused token cannot have been sampled
                self._stop(seq, "stop", None)

    def _stop(self, seq: Sequence, reason: str, stop_reason: int | str | None) -> None:
        if not seq.is_finished:
            self.scheduler.finish(seq, reason, stop_reason)
        elif seq.finish_reason == "length":  # the last allowed token was also a stop token or string
            seq.set_finished(reason, stop_reason)

    def _outputs(self, touched: dict[str, Sequence], finished: list[Sequence]) -> list[RequestOutput]:
        for seq in finished:
            touched.setdefault(seq.request_id, seq)
        for request_id, seq in list(touched.items()):
            # A sequence finished in the step before is reported again (scheduler.finished): news only if still
            # known, and its id may name a new request by now (a client reusing ids).
            state = self._requests.get(request_id)
            if seq.is_finished and (state is None or state.seq is not seq):
                touched.pop(request_id)
            elif not seq.is_finished and seq.sampling_params.output_kind is RequestOutputKind.FINAL_ONLY:
                touched.pop(request_id)  # built for nothing: its caller takes the last output only
        results = [self._requests[seq.request_id].output() for seq in touched.values()]
        for seq in touched.values():
            if seq.is_finished:
                self._requests.pop(seq.request_id, None)
        return results

    def _prefetch(self) -> None:
        if self.lora_config is not None:
            ids = self.scheduler.adapters_to_prefetch(self.lora_config.max_loras)
            if ids:
                self.executor.call("prefetch_loras", ids, sorted(self.scheduler.running_lora_ids()))

    def _step_input(self, out: SchedulerOutput, previous: SampledStep | None) -> tuple:
        # a method: tests and benches wrap it per engine (bench/profile_step.py)
        return step_input(out, previous, self.model_config.long_rope_from)

    def _grammar_of(self, seq: Sequence) -> SequenceGrammar | None:
        state = self._requests.get(seq.request_id)
        return state.grammar if state is not None and state.seq is seq and not seq.is_finished else None

    def _prompt_logprobs_of(self, seq: Sequence) -> list | None:
        state = self._requests.get(seq.request_id)
        return state.prompt_logprobs if state is not None and state.seq is seq else None

    def shutdown(self) -> None:
        self.executor.shutdown()
