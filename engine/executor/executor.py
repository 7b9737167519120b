"""The in-flight batching executor: a background loop that admits, schedules, runs, samples, emits.

    Executor(engine_dir, ExecutorConfig(...), response_callback=None)
      enqueue_request(s) -> ids      await_responses(timeout) -> [Response]
      cancel_request(id)             get_latest_iteration_stats()      shutdown()

Every iteration (``_step``) reads like a sentence: admit new requests, apply cancellations,
schedule a mixed batch of prefill chunks and decode tokens, run one forward, sample, update the
sequences, emit responses. A finished request leaves at once; a new one joins at the next
iteration. Nothing in the loop raises out of it: a failing forward fails the requests it carried
with an error response, and the loop goes on.

This file holds the class, its public API, its construction and the loop (``_run``, ``_step``,
``_launch``, sampling, ``_finish_in_flight``). Its parts beside it: admission.py (enqueue checks, a
request's way into the queue, cancellations) and finishing.py (tokens resolved, stops, finish / fail,
emit, retire), both mixins; batch_packing.py (a plan into a ForwardBatch), executor_stats.py
(IterationStats per step), lora_slots.py (adapter slots), memory_profile.py (what the KV pool leaves
for the steps); speculative/start_proposer.py and speculative/executor_drafts.py (drafts in a step).
"""
from __future__ import annotations

import inspect
import itertools
import threading
import time
import traceback
from dataclasses import replace
from typing import Callable

import torch

from engine.encoder_decoder.encoder_stage import encoder_decoder_runner, make_encoder_stage
from engine.executor import image_spans, state_cache
from engine.executor.admission import Admission
from engine.executor.batch_packing import pack_batch, prompt_embeds_of
from engine.executor.device_stream import enter_device, executor_stream, on_device, use_stream
from engine.executor.disaggregated import Disaggregation
# The settings are part of this module's public surface (re-exported).
from engine.executor.executor_config import (  # noqa: F401
    ExecutorConfig, ExecutorConfigError, SpeculativeConfig,
)
from engine.executor.executor_stats import StepStats, pool_stats
from engine.executor.finishing import Finishing
from engine.executor.guided import GrammarCache, TokenMasks
from engine.executor.kv_cache import BlockManager
from engine.executor.kv_events import KVEventPublisher, KVEventQueue, make_kv_event_publisher
from engine.executor.kv_host_tier import make_host_tier
from engine.executor.load_phases import load_phase
from engine.executor.lora_slots import start_adapters
from engine.executor.memory_profile import step_memory_reserve
from engine.executor.mrope_rotary import step_rotary_of
from engine.executor.output import ResponseQueue
from engine.executor.overlap import InFlightStep, TokenTransfer, pinned_token_buffers, placeholder
from engine.executor.request import (
    FinishReason, Request, RequestLimits, RequestState, Response, Sequence, SequenceStatus, normalize_all,
    now_ns, prompt_keys_error, prompt_keys_settled,
)
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.packed_draws import pack_draws
from engine.executor.sampler import build_sampling_metadata, draws_alone, greedy_metadata, sample
from engine.executor.scheduler import Scheduler, SchedulerOutput
from engine.executor.speculative import Verified, verify_batch
from engine.executor.speculative.executor_drafts import propose_drafts, resolve_device_drafts
from engine.executor.speculative.medusa_executor import last_rows
from engine.executor.speculative.proposer import ProposerConfigError
from engine.executor.speculative.start_proposer import start_proposer
from engine.executor.speculative.tree_step import move_kv
# KvCacheStats and IterationStats are part of this module's public surface (re-exported).
from engine.executor.stats import IterationStats, KvCacheStats  # noqa: F401
from engine.lora.cache import AdapterCache
from engine.pipeline.in_flight import make_pipelined_steps
from engine.tensor_parallel.step_protocol import RankFailureError


class Executor(Admission, Finishing):
    """Runs requests against one engine with in-flight batching on a background thread. Admission
    (engine/executor/admission.py) and token resolution and finishing (finishing.py) are mixins: they
    work on most of this class's state."""

    def __init__(self, engine_dir: str, config: ExecutorConfig | None = None, *, device: str | None = None,
                 response_callback: Callable[[list[Response]], None] | None = None):
        self.config = (config or ExecutorConfig()).validate()
        with on_device(device or self.config.device):  # an executor on cuda:1 builds there, whatever is current
            self._init_runner(engine_dir, device or self.config.device)
            self._init_scheduler()
            self._init_queues(response_callback)
            self._init_guided_decoding(engine_dir)
            self.device_stream = executor_stream(self.runner)  # (a vision-language engine's: engine/executor/device_stream.py)
        self._thread = threading.Thread(target=self._run, name="executor-loop", daemon=True)
        self._thread.start()

    # ----- construction -----
    def _init_runner(self, engine_dir: str, device: str | None) -> None:
        from engine.tensor_parallel.distributed import make_runner  # one rank: a ModelRunner; rank 0 of N: a LeaderRunner

        with load_phase("weights", device):  # $TRITONLLM_LOAD_LOG=1: a timestamped line per phase (load_phases.py)
            self.runner = make_runner(engine_dir, device=device,
                                      runner_class=encoder_decoder_runner(engine_dir, self.config) or ModelRunner)
        build = self.runner.build_config
        cfg = self.config
        for name in ("max_batch_size", "max_num_tokens"):
            value = getattr(cfg, name)
            if value is not None and value > getattr(build, name):
                raise ExecutorConfigError(f"ExecutorConfig.{name} ({value}) exceeds the engine's {name} "
                                          f"({getattr(build, name)}); rebuild the engine or lower it")
        self.max_batch_size = cfg.max_batch_size or build.max_batch_size
        self.max_num_tokens = max(cfg.max_num_tokens or build.max_num_tokens, self.max_batch_size)
        # The adapter slots come before the KV pool, which takes what is left (lora_slots.py).
        self.adapters: AdapterCache | None = start_adapters(self.runner, cfg, self.max_batch_size)
        self.state_slots = state_cache.start_state_cache(self.runner, self.max_batch_size, cfg)  # so do Mamba states
        with load_phase("draft model / proposer", self.runner.device):
            try:  # a draft model loads before the KV pools share the memory
                self.proposer = start_proposer(self.runner, cfg.speculative, engine_dir=engine_dir,
                                               has_state=self.state_slots is not None,
                                               kv_cache_dtype=cfg.kv_cache_dtype, enable_reuse=cfg.enable_kv_cache_reuse)
            except ProposerConfigError as err:
                raise ExecutorConfigError(str(err)) from None
        if getattr(self.proposer, "drafts_trees", False):  # tree verify steps get CUDA graphs of their own
            self.runner.tree_graph_width = 1 + cfg.speculative.max_draft_len
        kv_share = getattr(self.proposer, "target_kv_share", 1.0)  # the rest is the draft model's pool
        with load_phase("step memory profile and KV pool", self.runner.device):
            num_blocks = self.runner.num_kv_blocks_for(free_mem_fraction=cfg.kv_cache_free_gpu_mem_fraction * kv_share,
                                                       max_tokens=cfg.max_tokens_in_paged_kv_cache,
                                                       kv_cache_dtype=cfg.kv_cache_dtype,
                                                       reserve_bytes=step_memory_reserve(
                                                           self.runner, cfg, max_num_tokens=self.max_num_tokens,
                                                           max_batch_size=self.max_batch_size))
            self.runner.allocate_kv_cache(num_blocks, kv_cache_dtype=cfg.kv_cache_dtype)
        if hasattr(self.proposer, "start"):  # the draft model's pool (as many tokens) and CUDA graphs
            with load_phase("draft pool and graphs", self.runner.device):
                self.proposer.start(num_blocks * self.runner.tokens_per_block, self.max_batch_size,
                                    cfg.speculative.max_draft_len)
        self.runner.capture_cuda_graphs()  # CUDA: GEMM choice + decode graphs (the "compiled engine"); CPU: no-op
        with load_phase("warm-up batch (prefill kernels)", self.runner.device):
            self.runner.warmup()  # CUDA: compile the prefill kernels before the first request; CPU: no-op
        # Encoder-decoder engines: encoder runs and the cross-KV pool (engine/encoder_decoder/encoder_stage.py)
        self.encoder_stage = make_encoder_stage(self.runner)

    def _init_scheduler(self) -> None:
        cfg = self.config
        if self.state_slots is not None:  # a cached KV prefix has no Mamba state at its end (state_cache.py)
            cfg = replace(cfg, enable_kv_cache_reuse=False)
        host_tier = make_host_tier(self.runner, host_memory_bytes=cfg.kv_cache_host_memory_bytes,
                                   onboard_blocks=cfg.kv_cache_onboard_blocks, enable_reuse=cfg.enable_kv_cache_reuse)
        self.blocks = BlockManager(self.runner.num_kv_blocks, self.runner.tokens_per_block,
                                   cfg.enable_kv_cache_reuse, host_tier=host_tier)
        self.kv_events = make_kv_event_publisher(self.runner.tokens_per_block, cfg.kv_cache_events_endpoint,
                                                 cfg.kv_cache_events_topic)
        self.blocks.events = None if self.kv_events is None else self.kv_events.queue
        self.scheduler = Scheduler(self.blocks, max_batch_size=self.max_batch_size,
                                   max_num_tokens=self.max_num_tokens, policy=self.config.batch_scheduler_policy,
                                   enable_chunked_context=self.config.enable_chunked_context,
                                   static_batching=self.config.batching_type == "static",
                                   kv_window=self.runner.model_config.kv_window,  # frees blocks that left it
                                   acquire_adapter=None if self.adapters is None else self._acquire_adapter,
                                   state_slots=self.state_slots)
        build = self.runner.build_config
        self.limits = RequestLimits(
            vocab_size=self.runner.vocab_size, max_seq_len=build.max_seq_len,
            max_beam_width=self.config.max_beam_width, max_num_tokens=self.max_num_tokens,
            enable_chunked_context=self.config.enable_chunked_context,
            num_kv_blocks=self.blocks.num_blocks, tokens_per_block=self.blocks.tokens_per_block,
            max_batch_size=self.max_batch_size, max_draft_len=self.config.max_draft_len,
            hidden_size=self.runner.model_config.prompt_table_width,  # Qwen3-VL: DeepStack levels beside
            # One rank only: the step protocol sends token ids, not the table rows the splice needs.
            supports_prompt_tables=build.tp_size == 1
            and getattr(getattr(self.runner, "model", None), "supports_prompt_tables", False),
            prompt_tables_refusal=prompt_tables_refusal(build),
            mrope_width=self.runner.model_config.head_dim if build.tp_size == 1 and build.pp_size == 1
            and getattr(getattr(self.runner, "model", None), "supports_mrope", False) else 0)
        self._table_request_ids: set[int] = set()  # active requests with a prompt table
        # ... of them, those whose table digests may still fail (request.py prompt_keys_settled): checked each step
        self._keys_pending_ids: set[int] = set()
        # Gemma 3: an image's table rows attend both ways in prefill (engine/executor/image_spans.py)
        self._image_spans = self.limits.supports_prompt_tables and getattr(
            getattr(self.runner, "model", None), "bidirectional_prompt_tables", False)
        if self._image_spans:
            self.scheduler.chunk_limit = image_spans.chunk_limit(self.limits.vocab_size, self.max_num_tokens)
        self._mrope_request_ids: set[int] = set()  # active requests with M-RoPE rows (mrope_rotary.py)
        # active requests whose rows are not sampler.greedy_alone; while there are none, _sample makes no pass over
        # a step's rows to build its metadata (~0.3 us a row of host time)
        self._sampler_request_ids: set[int] = set()
        self._num_draft_tokens_total = 0  # cumulative, for IterationStats
        self._num_accepted_draft_tokens_total = 0

    def _init_queues(self, response_callback) -> None:
        self._cv = threading.Condition()
        self._inbox: list[RequestState] = []
        self._cancel_ids: set[int] = set()
        self._stopping = False
        self._runner_released = False
        self._ids = itertools.count(1)
        self._seq_ids = itertools.count(1)
        self._active: dict[int, RequestState] = {}
        self._num_unscheduled = 0  # admitted requests not scheduled yet (they count as queued)
        self._touched: dict[int, RequestState] = {}  # requests with news this iteration
        self._in_flight: InFlightStep | None = None  # launched, tokens not read yet (engine/executor/overlap.py)
        self._last_step_finished = 0.0  # perf_counter() when the last step's tokens were read
        self._parity = 0  # which half of the sampled-token ring and pinned buffers the next step uses
        self._pinned = pinned_token_buffers(self.runner.sampled_ring_slots // 2, self.runner.device)
        self._sync_request_ids: set[int] = set()  # active requests that need each step's tokens on the host
        self._responses = ResponseQueue()
        self._callback = response_callback
        self._step_stats = StepStats(self.runner, self.max_batch_size, self.config.iter_stats_max_iterations,
                                     self._pool_stats())  # (executor_stats.py)
        self.disagg = Disaggregation(self)  # context_only / generation_only requests (disaggregated.py)
        self.pipelined = make_pipelined_steps(self)  # pipeline stages: several steps in flight, or None
        # pipeline stages: steps that only draw are sampled on the last stage (engine/pipeline/runner.py)
        self._last_stage_sampling = bool(getattr(self.runner, "samples_on_last_stage", False))
        # Runners whose forward may hand a decode graph's head-graph logits and greedy ids (ModelRunner's own;
        # the encoder-decoder, pipeline and tensor-parallel leaders' forwards take no graph_logits)
        self._graph_logits = "graph_logits" in inspect.signature(self.runner.forward).parameters

    def _init_guided_decoding(self, engine_dir: str) -> None:
        self.grammars: GrammarCache | None = None
        self.token_masks: TokenMasks | None = None
        self._compiling: dict[int, RequestState] = {}  # guided requests waiting for their grammar
        self._compiled: list[RequestState] = []  # ... whose grammar is ready (guarded by _cv)
        self._emit_after_launch = False  # a guided step's news waits for the next launch (_step)
        if self.config.guided_decoding_backend is None:
            return
        self.grammars = GrammarCache(self.config.tokenizer_dir or engine_dir, self.runner.vocab_size,
                                     capacity=self.config.grammar_cache_size)
        self.token_masks = TokenMasks(self.max_batch_size, self.runner.vocab_size, self.runner.device)

    # ----- public API -----
    def enqueue_request(self, request: Request) -> int:
        return self.enqueue_requests([request])[0]

    def enqueue_requests(self, requests: list[Request], request_ids: list[int] | None = None) -> list[int]:
        """Accept requests; invalid ones (and any beyond a full queue) get a final error Response.

        ``request_ids``: ids chosen by the caller (the engine process's client numbers them itself,
        so it can answer without a round trip); they must be unique. Default: the executor's own.
        """
        if request_ids is not None and len(request_ids) != len(requests):
            raise ValueError(f"{len(request_ids)} request_ids for {len(requests)} requests")
        ids, errors = [], []
        prepared = normalize_all(requests, self.limits.vocab_size)  # unlocked (digests of several tables at once)
        with self._cv:
            for index, (request, cache_keys, failure) in enumerate(prepared):
                request_id = next(self._ids) if request_ids is None else request_ids[index]
                ids.append(request_id)
                try:
                    if failure is not None:
                        raise failure
                    request = self.disagg.prepare(request)
                    if self.encoder_stage is not None:
                        request = self.encoder_stage.complete(request)
                    error = self._rejection(request)
                except (TypeError, ValueError, AttributeError) as err:
                    error = f"invalid request: {err}"
                if error is not None:
                    errors.append(Response(request_id, error=error))
                    continue
                exclude = request.output.exclude_input_from_output
                state = RequestState(request_id, request, self.config.exclude_input_from_output
                                     if exclude is None else bool(exclude))
                state.prompt_cache_keys = cache_keys
                self._inbox.append(state)
            self._cv.notify()
        if errors:
            self._deliver(errors)
        return ids

    def cancel_request(self, request_id: int) -> None:
        """End the request within one iteration: its blocks are freed and a final response is sent."""
        with self._cv:
            self._cancel_ids.add(request_id)
            self._cv.notify()

    def await_responses(self, timeout: float | None = None) -> list[Response]:
        return self._responses.take(timeout)

    def get_latest_iteration_stats(self) -> IterationStats:
        return self._step_stats.latest

    def get_iteration_stats_history(self) -> list[IterationStats]:
        return list(self._step_stats.history)

    def subscribe_kv_events(self, callback) -> None:
        """Call ``callback(KVEventBatch)`` (engine/executor/kv_events.py) on the executor's thread once
        per iteration that stored or removed prefix blocks; subscribe before enqueuing requests."""
        if self.kv_events is None:
            self.kv_events = KVEventPublisher(KVEventQueue(self.blocks.tokens_per_block))
            self.blocks.events = self.kv_events.queue
        self.kv_events.sinks.append(callback)

    def can_enqueue_requests(self) -> bool:
        return not self._stopping

    @property
    def failure(self) -> str | None:
        """Why this executor can no longer serve (leader mode: a lost rank), or None."""
        return getattr(self.runner, "failure", None)

    def shutdown(self) -> None:
        with self._cv:
            self._stopping = True
            self._cv.notify()
        if self._thread.is_alive() and threading.current_thread() is not self._thread:
            self._thread.join()
            self._step_stats.close()
        self.disagg.shutdown()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.grammars is not None:
            self.grammars.shutdown()
        if self.adapters is not None:
            self.adapters.shutdown()
        if hasattr(self.runner, "shutdown") and not self._runner_released:  # leader mode: release the workers
            self._runner_released = True
            self.runner.shutdown()

    def __enter__(self):
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    # ----- the loop -----
    def _run(self) -> None:
        enter_device(self.runner.device)  # the loop launches on its runner's GPU (two executors, two GPUs)
        use_stream(self.device_stream)  # None: this thread's default stream
        while True:
            with self._cv:
                while not (self._inbox or self._cancel_ids or self.scheduler.has_unfinished or self._stopping
                           or self._in_flight is not None or self._compiled
                           or (self.pipelined is not None and self.pipelined.pending)
                           or (self.encoder_stage is not None and self.encoder_stage.has_pending)
                           or self.disagg.has_work()):
                    self._cv.wait(self.disagg.wait_timeout())  # (a pinned context KV may expire)
                if self._stopping:
                    break
                new, self._inbox = self._inbox, []
                cancels, self._cancel_ids = self._cancel_ids, set()
                compiled, self._compiled = self._compiled, []
            try:
                self._admit_compiled(compiled)
                self._step(new, cancels)
            except Exception:  # our own bug: fail everything in flight loudly, keep serving
                self._in_flight = None
                if self.pipelined is not None:
                    self.pipelined.drop()
                self._fail_all(f"internal executor error: {traceback.format_exc()}")
        try:
            if self.pipelined is not None:
                self.pipelined.drain()  # (several steps in flight: engine/pipeline/in_flight.py)
            self._finish_in_flight()  # what the last step produced goes out before the shutdown errors
        except Exception:
            traceback.print_exc()
        self._fail_all("the executor was shut down")

    def _step(self, new: list[RequestState], cancels: set[int]) -> None:
        """One iteration: admit -> cancel -> schedule -> launch step N -> finish step N-1 -> emit.

        Overlapped (engine/executor/overlap.py): step N is launched on the device before the
        host waits for step N-1's tokens, so appending them, stop checks, responses and the
        next schedule all run while the GPU computes. While a request that needs its tokens on
        the host is active (``needs_tokens_on_host``), or with ``disable_overlap_scheduler``,
        each step is finished before the next is scheduled. A step with guided rows samples
        only once step N-1's tokens have reached their grammars, and step N-1's responses then
        wait until step N+1 is launched (engine/executor/guided.py). Speculative decoding
        (engine/executor/speculative/): a step that verifies drafts is finished before the next
        schedule (how many tokens it keeps decides the next step's inputs), and with a proposer
        every step is, so the proposer sees every token; drafted steps run eagerly or, on CUDA,
        through the prefill graphs' token buckets (they are not 1-token decodes).
        """
        started = time.perf_counter()
        if self.disagg.service() and not self._active:  # frees context KV fetched by a generation side, or expired
            stats = self._step_stats  # (idle: no step records the pools)
            stats.latest = replace(stats.latest, **self._pool_stats())
        self._admit(new)
        self._cancel(cancels)
        for state in [self._active[i] for i in self._keys_pending_ids if i in self._active]:
            if (message := prompt_keys_error(state)) is not None:  # hashing its table failed: it alone ends
                for seq in state.sequences:
                    self._finish(seq, FinishReason.ERROR)  # (as a cancel: safe with a step in flight)
                self._fail(state, message)
            elif prompt_keys_settled(state):  # no error can come any more: not checked again
                self._keys_pending_ids.discard(state.request_id)
        if self.encoder_stage is not None:  # encoder runs of waiting requests, then they queue
            for state in self.encoder_stage.encode_pending(self._fail):
                self._schedule_sequences(state)
        pipelined = self.pipelined is not None and self.pipelined.eligible()  # several steps in flight
        if self.pipelined is not None and self.pipelined.pending and not pipelined:
            self.pipelined.drain()  # a request that needs its tokens on the host arrived, or one step pays more
        if self._must_sync():
            self._finish_in_flight()
        if self.proposer is not None:
            self._propose_drafts()
        if pipelined:  # (engine/pipeline/in_flight.py: schedules one group, launches it, samples the oldest step)
            plan, launched = self.pipelined.step(started)
        else:
            plan = self.scheduler.schedule()
            launched = None if plan.is_empty else self._launch(plan, started)
        if self._emit_after_launch:
            self._emit()  # step N-2's news (guided sampling deferred it until step N was launched)
        try:
            finished = self._finish_in_flight(launched)  # step N-1, while the device runs step N
        except BaseException:
            self._abandon_sample(launched)
            raise
        if launched is not None and launched.pending_sample is not None:  # (nothing was in flight)
            self._sample_guided(launched)
        self._in_flight = None if launched is None or launched.failed else launched
        if launched is not None and (self._must_sync() or launched.verified):
            finished = self._finish_in_flight()  # (a drafted step's tokens decide the next schedule)
        if self.kv_events is not None:
            self.kv_events.publish()  # this iteration's block stored/removed events, as one batch
        if not self._emit_after_launch or self._in_flight is None:
            self._emit()  # cancellations and errors of this iteration
        if plan.is_empty and launched is None and not finished and not new and not cancels:
            time.sleep(0.001)  # nothing runnable right now; do not spin

    def _must_sync(self) -> bool:
        # With a proposer every step is read before the next is scheduled: drafts are made from
        # the tokens on the host, so overlap would leave the newest token unknown to it.
        return self.config.disable_overlap_scheduler or bool(self._sync_request_ids) or self.proposer is not None

            # other returned sequences wait for sequence 0's prompt KV and then share it (_fork_siblings)

    # ----- launch: forward + sample, tokens left on the device -----
    def _launch(self, plan: SchedulerOutput, started: float) -> InFlightStep | None:
        """Run the batch and sample without waiting for the result; the sequences that sample get a
        placeholder token each. On failure, fail exactly the requests the batch carried."""
        num_active = len(self._active)  # in flight this step, those that finish in it included
        try:
            batch, rows, sampling, drafted = self._forward_batch(plan)
            self._mark_last_stage_sampling(batch, sampling, drafted)
            if self.encoder_stage is not None:
                self.encoder_stage.fill_cross_rows(batch, plan)
            prompt_embeds = prompt_embeds_of(plan, self.limits.vocab_size) if self._table_request_ids else None
            rotary = step_rotary_of(plan.scheduled, batch) if self._mrope_request_ids else None
            spans = image_spans.step_span_ahead_of(plan.scheduled, self.limits.vocab_size) if (
                self._image_spans and prompt_embeds is not None) else None
            # graph_logits: this step's logits are read before the next forward (sampled below; a guided step's in
            # _finish_in_flight, before the next launch), unless requests keep them (_sync_request_ids) or drafts
            # verify against them
            logits = self.runner.forward(batch, **({} if prompt_embeds is None else {"prompt_embeds": prompt_embeds}),
                                         **({} if rotary is None else {"rotary": rotary}),
                                         **({} if spans is None else {"span_ahead": spans}),
                                         **({"graph_logits": True} if self._graph_logits and not (
                                             self._sync_request_ids or drafted) else {}))
            # A constrained row samples after the previous step's tokens reach its matcher (_sample_guided).
            guided = self.token_masks is not None and any(seq.grammar is not None for seq, _ in sampling)
            if batch.sample_on_last_stage:  # (``logits``: the token ids the last stage sampled)
                transfer = self._store_last_stage_tokens(logits, batch)
            else:
                transfer = self._sample(logits, sampling, batch) if sampling and not guided else None
            verified = self._verify(logits, drafted) if drafted else None
            if getattr(self.runner, "keep_hidden_rows", False):  # Medusa heads read the last computed token's hidden state
                self.proposer.observe(self.runner.last_hidden_rows, last_rows(sampling, drafted, verified))
            if verified and hasattr(self.proposer, "observe_verified"):  # lookahead: the target's choice at each node
                self.proposer.observe_verified(drafted, verified)
            if hasattr(self.proposer, "observe_batch"):  # EAGLE-3, MTP: the hooked rows of every scheduled token
                self.proposer.observe_batch(plan.scheduled, verified)
        except Exception as err:
            self._fail_step(plan, err, "forward failed")
            return None
        self._mark_launched(plan)
        keep_logits = bool(self._sync_request_ids)  # context/generation logits and beams read them later
        step = InFlightStep(plan, rows, logits if keep_logits else None, [], transfer, started, num_active,
                            verified=verified)
        if guided:
            step.pending_sample = (logits, sampling, batch)
        else:
            self._add_placeholders(step, sampling, batch)
        return step

    def _mark_launched(self, plan: SchedulerOutput) -> None:
        """The plan's tokens are computed as far as the host is concerned (their KV is on its way)."""
        now = now_ns()
        for item in plan.scheduled:
            state = item.seq.state
            if state.is_queued or not state.perf.first_scheduled_time_ns:
                self._note_scheduled(state, now)
            item.seq.num_computed_tokens += item.num_new_tokens
        self.disagg.ready.launched(plan.scheduled)  # context_only prompts whose KV this step completes

    def _sample_guided(self, step: InFlightStep) -> None:
        """Sample a launched step whose batch has constrained rows: their token masks are built now,
        while the device still runs the step's forward (engine/executor/guided.py). On failure
        the step's requests fail and ``step.failed`` is set."""
        logits, sampling, batch = step.pending_sample
        step.pending_sample = None
        try:
            step.transfer = self._sample(logits, sampling, batch, guided=True)
        except Exception as err:
            step.failed = True
            self._fail_step(step.plan, err, "sampling failed")
            return
        self._add_placeholders(step, sampling, batch)

    def _abandon_sample(self, step: InFlightStep | None) -> None:
        """A launched step will never be sampled (the loop is failing everything): leader mode's
        workers still wait for its tokens after the forward; they get zeros, as when sampling fails."""
        if step is None or step.pending_sample is None:
            return
        logits, sampling, batch = step.pending_sample
        step.pending_sample = None
        try:
            self._store_no_tokens(len(sampling), logits.device, batch)
        except Exception:
            traceback.print_exc()

    def _store_no_tokens(self, count: int, device: torch.device, batch: ForwardBatch) -> None:
        """Leader mode: the workers wait for a sampled step's tokens; when sampling fails or never
        happens they get zeros (the step's requests fail; its tokens are never read)."""
        self.runner.store_sampled_tokens(torch.zeros(count, dtype=torch.int64, device=device), batch)

    def _add_placeholders(self, step: InFlightStep, sampling: list[tuple[Sequence, int]], batch: ForwardBatch) -> None:
        """Each sampled row's token stays on the device; its sequence gets a placeholder for it."""
        placeholders, finished = step.placeholders, SequenceStatus.FINISHED
        first = placeholder(batch.sampled_tokens_slot)  # row i's: placeholder(slot + i) == first - i
        for i, (seq, row) in enumerate(sampling):  # once per sequence per step: kept free of calls
            if seq.status is finished:  # stopped by the step just finished (guided: sampled after it); dropped
                placeholders.append((seq, -1, row))
                continue
            token_ids = seq.token_ids
            placeholders.append((seq, len(token_ids), row))
            token_ids.append(first - i)
            seq.num_unresolved_tokens += 1
        self._parity ^= 1

    def _fail_step(self, plan: SchedulerOutput, err: Exception, what: str) -> None:
        """Fail exactly the requests a step carried. A lost rank (leader mode) is an operational
        fault whose message says it all; anything else is a bug, reported with its traceback."""
        message = str(err) if isinstance(err, RankFailureError) else f"{what}: {traceback.format_exc(limit=4)}"
        for state in {s.seq.state.request_id: s.seq.state for s in plan.scheduled}.values():
            self._fail(state, message)

    def _forward_batch(self, plan: SchedulerOutput) -> tuple[ForwardBatch, list[tuple[int, int]],
                                                              list[tuple[Sequence, int]], list[tuple[Sequence, int, int]]]:
        """Pack the plan (batch_packing.py): the batch, each scheduled sequence's logits rows, the
        rows that sample and the drafted sequences; this step's tokens go to the parity's ring half."""
        return pack_batch(plan, tokens_per_block=self.blocks.tokens_per_block, lora=self.adapters is not None,
                          sampled_tokens_slot=self._parity * self.runner.sampled_ring_slots // 2,
                          state_slots=self.state_slots)

    def _mark_last_stage_sampling(self, batch: ForwardBatch, sampling: list[tuple[Sequence, int]],
                                  drafted: list) -> None:
        """Have a pipeline's last stage sample this step (ForwardBatch.sample_on_last_stage) where the
        runner offers it, no request needs the step's logits on the host or a proposer, each logits
        row samples and every row only draws (sampler.draws_alone): the last stage's ids are then the
        ones ``_sample`` would draw (greedy rows alone: its argmax; else from the packed draws)."""
        if not self._last_stage_sampling:  # (every step of a runner that is not a pipeline: nothing to build)
            return
        seqs = [seq for seq, _ in sampling]
        if not (seqs and not drafted and not self._sync_request_ids
                and self.proposer is None and [row for _, row in sampling] == list(range(len(batch.logits_indices)))
                and all(map(draws_alone, seqs))):
            return
        batch.sample_on_last_stage = True
        if not all(seq.state.request.sampling.is_greedy for seq in seqs):
            batch.last_stage_draws = pack_draws(seqs, self.runner.vocab_size)

    def _store_last_stage_tokens(self, token_ids: torch.Tensor, batch: ForwardBatch) -> TokenTransfer:
        """A step sampled on the last stage: its int64 ids (one per logits row, each a sampling row's)
        go where ``_sample``'s would."""
        self.runner.store_sampled_tokens(token_ids, batch)
        return TokenTransfer(token_ids, None, self._pinned[self._parity])

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[Sequence, int]], batch: ForwardBatch,
                guided: bool = False) -> TokenTransfer:
        """Sample every row in ``sampling`` on the device, leave the tokens in the runner's ring for
        the next step (which may be launched before the host sees them) and start their copy home.
        ``guided``: the constrained rows' grammars mask their logits first (TokenMasks.fill)."""
        seqs = [seq for seq, _ in sampling]
        try:
            token_masks = self.token_masks.fill(seqs) if guided else None
            if self._sampler_request_ids:  # some active request's rows have settings of their own
                want_log_probs = any(s.state.request.output.return_log_probs for s in seqs)  # (top implies it)
                md = build_sampling_metadata(seqs, self.runner.vocab_size, logits.device, want_log_probs)
            else:  # every row is greedy_alone: the metadata is the same whatever the rows
                md = greedy_metadata()
            md.normalize_log_probs = self.config.normalize_log_probs
            if token_masks is not None:
                md.token_bitmask, md.token_bitmask_rows = token_masks
            sample_rows = [row for _, row in sampling]
            all_rows = sample_rows == list(range(len(logits)))  # plain decode: no gather needed
            out = sample(logits if all_rows else logits[sample_rows], md,
                         self.runner.greedy_of(logits) if all_rows and self._graph_logits else None)
        except Exception:
            self._store_no_tokens(len(seqs), logits.device, batch)  # then the step fails
            raise
        self.runner.store_sampled_tokens(out.token_ids, batch)
        return TokenTransfer(out.token_ids, out.log_probs, self._pinned[self._parity],
                             out.top_log_probs, out.top_log_prob_ids, md.top_log_prob_rows)

    # ----- finish: the tokens of a launched step reach the host -----
    def _finish_in_flight(self, launched: InFlightStep | None = None) -> bool:
        """Wait for the in-flight step's tokens, put them in place of its placeholders, check stops,
        emit; False when no step was in flight. ``launched``: the step just launched; if its
        sampling waits for these tokens (guided decoding), it is sampled before the emit."""
        step, self._in_flight = self._in_flight, None
        if step is None:
            return False
        token_ids, log_probs, top = step.transfer.wait() if step.transfer is not None else ([], None, None)
        now = now_ns()
        beam_rows, kv_moves = [], []
        running, finished = SequenceStatus.RUNNING, SequenceStatus.FINISHED
        register = self.blocks.register_computed_blocks if self.blocks.enable_reuse else None  # (else a no-op)
        T = self.blocks.tokens_per_block
        for item, (first, end) in zip(step.plan.scheduled, step.rows):  # once per sequence per step: keep it lean
            seq = item.seq
            if seq.status is not running:
                continue  # finished (a stop known late, a cancel) or preempted since the launch
            state = seq.state
            request = state.request
            if request.output.return_context_logits:  # slicing a tensor per sequence costs ~2 us
                self._collect_context_logits(item, step.logits[first:end])
            if item.num_draft_tokens:  # before registering: no block holding a rejected token is registered
                self._take_verified(item, step.verified[seq.seq_id], kv_moves)
            if register is not None and seq.num_computed_tokens // T > seq.num_registered_blocks:
                register(seq)  # (a block filled up; else the call registers nothing: 1 step in T calls it)
            if item.samples and len(state.sequences) > 1 and (item.start + item.num_new_tokens - item.num_draft_tokens
                                                               == seq.num_prompt_tokens):
                self._fork_siblings(seq)
            if item.samples and request.sampling.beam_width > 1:  # (state.is_beam_search)
                beam_rows.append((seq, step.logits[end - 1]))
            if item.num_draft_tokens:  # (after the fork: a stop here frees the blocks siblings share)
                self._resolve_verified(seq, step.verified[seq.seq_id], step.logits, first, now)
        move_kv(self.runner, kv_moves)  # the trees' accepted paths into place, every sequence's at once
        resolve, logits = self._resolve_token, step.logits
        for i, (seq, index, row) in enumerate(step.placeholders):
            if seq.status is not finished:
                resolve(seq, index, token_ids[i], None if log_probs is None else log_probs[i],
                        logits, row, now, None if top is None else top[i])
        if beam_rows:
            self._beam_step(beam_rows, now)
        if launched is not None and launched.pending_sample is not None:
            # The matchers know step N-1's tokens now. Its responses wait until step N+1's forward
            # is launched: until then the device has only step N queued (engine/executor/guided.py).
            self._sample_guided(launched)
            self._emit_after_launch = True
        else:
            self._emit()
        # The step's period: from when it began, or, overlapped, from when the step before it
        # finished (steps in flight overlap; their latencies must add up to the wall time).
        finished_at, finished_ns = time.perf_counter(), now_ns()  # (read together: the stats' timestamp is the
        # step's end, so timestamp - latency is its start whatever delays the record after it on a loaded host)
        self._record_stats(step.plan, (finished_at - max(step.started, self._last_step_finished)) * 1e3,
                           step.num_active, finished_ns)
        self._last_step_finished = finished_at
        return True

    # ----- speculative decoding (engine/executor/speculative/executor_drafts.py) -----
    def _propose_drafts(self) -> None:
        """Drafts for every running sequence about to decode one token (the proposer's)."""
        propose_drafts(self.proposer, self.scheduler.running, self.config.speculative.max_draft_len,
                       self.limits.vocab_size)

    def _verify(self, logits: torch.Tensor, drafted: list[tuple[Sequence, int, int]]) -> dict[int, Verified]:
        """Decide, per drafted sequence, which drafts the step keeps (applied when it finishes)."""
        resolve_device_drafts(self.proposer, drafted)  # (drafts left on the device: their ids, now)
        return verify_batch([(seq, seq.draft_token_ids[:k], first) for seq, first, k in drafted], logits,
                            self.runner.vocab_size, self.config.normalize_log_probs)

    # ----- stats (engine/executor/executor_stats.py) -----
    def _pool_stats(self) -> dict:
        return pool_stats(self.blocks, self.encoder_stage, self.adapters)

    def _record_stats(self, plan: SchedulerOutput, latency_ms: float, num_active: int,
                      end_ns: int | None = None) -> None:
        self._step_stats.record(plan, latency_ms, num_active, end_ns=end_ns,
                                num_queued=len(self._inbox) + self._num_unscheduled,
                                num_preemptions=self.scheduler.num_preemptions, pools=self._pool_stats(),
                                num_draft_tokens_total=self._num_draft_tokens_total,
                                num_accepted_draft_tokens_total=self._num_accepted_draft_tokens_total,
                                disagg=self.disagg.stats(), idle=not self._active)


def prompt_tables_refusal(build) -> str:
    """prompt_table_error's reason for an engine whose layout, not its architecture, refuses prompt tables
    ("" where the architecture decides): a tensor-parallel engine's ranks step on token ids, not table rows, and
    a pipeline stage takes hidden states, not embeddings, from the stage before."""
    if build.tp_size > 1:
        return (f"by a tensor-parallel engine (tp_size {build.tp_size}): its ranks' steps carry token ids, not "
                "table rows; serve images from an engine built with tp_size 1")
    if build.pp_size > 1:
        return (f"by a pipeline-parallel engine (pp_size {build.pp_size}); serve images from an engine built with "
                "pp_size 1")
    return ""
