"""The in-flight batching executor: a background loop that admits, schedules, runs, samples, emits.

    Executor(engine_dir, ExecutorConfig(...), response_callback=None)
      enqueue_request(s) -> ids      await_responses(timeout) -> [Response]
      cancel_request(id)             get_latest_iteration_stats()      shutdown()

Every iteration (``_step``) reads like a sentence: admit new requests, apply cancellations,
schedule a mixed batch of prefill chunks and decode tokens, run one forward, sample, update the
sequences, emit responses. A finished request leaves at once; a new one joins at the next
iteration. Nothing in the loop raises out of it: a failing forward fails the requests it carried
with an error response, and the loop goes on.
"""
from __future__ import annotations

import itertools
import os
import random
import sys
import threading
import time
import traceback
from collections import deque
from dataclasses import replace
from datetime import datetime, timezone
from typing import Callable

import torch

from engine.executor import beam_search
from engine.executor.guided import GrammarCache, GuideError, TokenMasks, make_matcher
from engine.lora.adapter import LoraError
from engine.lora.cache import AdapterCache, RunnerSlots
from engine.lora.prefetch import prefetch_adapters
from engine.executor import memory_profile
from engine.executor.device_memory import free_device_bytes, is_capped
from engine.executor.device_stream import enter_device, executor_stream, on_device, use_stream
from engine.executor.disaggregated import Disaggregation
from engine.executor.kv_cache import BlockManager
# The settings are part of this module's public surface (re-exported).
from engine.executor.executor_config import (  # noqa: F401
    ExecutorConfig, ExecutorConfigError, SpeculativeConfig,
)
from engine.executor.kv_events import KVEventPublisher, KVEventQueue, make_kv_event_publisher
from engine.executor.kv_host_tier import make_host_tier
from engine.executor.load_phases import load_phase
from engine.encoder_decoder.encoder_stage import encoder_decoder_runner, encoder_input_error, make_encoder_stage
from engine.executor import image_spans
from engine.executor.mrope_rotary import step_rotary_of
from engine.executor.prompt_table import gather_prompt_embeds, prompt_cache_keys
from engine.executor import state_cache
from engine.models.prompt_embeds import PromptEmbeds
from engine.executor.output import ResponseQueue, responses_for
from engine.executor.overlap import (
    InFlightStep, TokenTransfer, needs_tokens_on_host, pinned_token_buffers, placeholder,
)
from engine.executor.request import (
    FinishReason, Request, RequestLimits, RequestState, Response, Sequence, SequenceStatus, normalize_all,
    now_ns, prompt_keys_error, validate_request,
)
from engine.tensor_parallel.step_protocol import RankFailureError
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.sampler import build_sampling_metadata, process_logits, sample
from engine.executor.scheduler import Scheduler, SchedulerOutput
from engine.executor.speculative import DraftProposer, Verified, draft_room, make_proposer, verify_batch
from engine.executor.speculative.proposer import ProposerConfigError
from engine.executor.speculative.eagle3 import start_eagle3
from engine.executor.speculative.mtp import start_mtp
from engine.executor.speculative.lookahead import lookahead_request_error, start_lookahead
from engine.executor.speculative.medusa_executor import last_rows, start_medusa
from engine.executor.speculative.redrafter import start_redrafter
from engine.executor.speculative.tree_step import move_kv, path_kv_moves
from engine.executor.tree_batch import chunk_parents, tree_positions
from engine.pipeline.in_flight import make_pipelined_steps
# KvCacheStats and IterationStats are part of this module's public surface (re-exported).
from engine.executor.stats import (  # noqa: F401
    ITERATION_LOG_ENV, STATS_TIME_FORMAT, IterationLog, IterationStats, KvCacheStats, kv_cache_stats,
)

GPU_MEMORY_READ_PERIOD_S = 0.1  # IterationStats.gpu_mem_usage is at most this old
CPU_LORA_SLOTS = 8


class Executor:
    """Runs requests against one engine with in-flight batching on a background thread."""

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
        self._init_lora()  # the adapter slots come before the KV pool, which takes what is left
        self.state_slots = state_cache.start_state_cache(self.runner, self.max_batch_size, cfg)  # so do Mamba states
        with load_phase("draft model / proposer", self.runner.device):
            self.proposer = self._make_proposer(engine_dir)  # a draft model loads before the KV pools share the memory
        if getattr(self.proposer, "drafts_trees", False):  # tree verify steps get CUDA graphs of their own
            self.runner.tree_graph_width = 1 + cfg.speculative.max_draft_len
        kv_share = getattr(self.proposer, "target_kv_share", 1.0)  # the rest is the draft model's pool
        with load_phase("step memory profile and KV pool", self.runner.device):
            num_blocks = self.runner.num_kv_blocks_for(free_mem_fraction=cfg.kv_cache_free_gpu_mem_fraction * kv_share,
                                                       max_tokens=cfg.max_tokens_in_paged_kv_cache,
                                                       kv_cache_dtype=cfg.kv_cache_dtype,
                                                       reserve_bytes=self._step_memory_reserve())
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

    def _step_memory_reserve(self) -> int:
        """Bytes the KV pool must leave free for the steps (engine/executor/memory_profile.py):
        measured on one CUDA device, 0 elsewhere (leader mode keeps the fraction alone)."""
        if not isinstance(self.runner, ModelRunner) or self.runner.device.type != "cuda":
            return 0
        spec = self.config.speculative  # a verify step scores each sequence's drafts too
        logits_rows = self.max_batch_size * (1 + (spec.max_draft_len if spec is not None else 0))
        try:
            memory = memory_profile.measure_step_memory(self.runner, max_num_tokens=self.max_num_tokens,
                                                        max_batch_size=self.max_batch_size,
                                                        kv_cache_dtype=self.config.kv_cache_dtype,
                                                        logits_rows=min(logits_rows, self.max_num_tokens))
        except torch.OutOfMemoryError:
            free, total = free_device_bytes(self.runner.device), torch.cuda.mem_get_info(self.runner.device)[1]
            raise ExecutorConfigError(
                f"a step of max_num_tokens={self.max_num_tokens} tokens over max_batch_size={self.max_batch_size} "
                f"sequences does not fit in the {free / 2**30:.1f} GiB the weights leave free of {total / 2**30:.1f} "
                f"GiB, before any KV cache; lower max_num_tokens or max_batch_size") from None
        reserve = memory_profile.reserve_bytes(memory, cuda_graphs=True,
                                               count_outside=not is_capped(self.runner.device))
        print(f"[executor] a worst-case step ({self.max_num_tokens} tokens, {memory.logits_rows} sampled rows) "
              f"peaks at {memory.step / 2**30:.2f} GiB (its forward {memory.forward / 2**30:.2f}; outside the "
              f"caching allocator {memory.outside_allocator / 2**30:.2f}); the KV pool "
              f"leaves at least {reserve / 2**30:.2f} GiB free", file=sys.stderr, flush=True)
        return reserve

    def _make_proposer(self, engine_dir: str) -> DraftProposer | None:
        spec = self.config.speculative
        if spec is None:
            return None
        try:
            if spec.mode == "medusa":
                return start_medusa(self.runner, spec.medusa_model_path, spec.medusa_choices, engine_dir=engine_dir,
                                    has_state=self.state_slots is not None)
            if spec.mode == "lookahead":
                return start_lookahead(self.runner, spec, has_state=self.state_slots is not None)
            if spec.mode == "eagle":
                return start_eagle3(self.runner, spec, engine_dir=engine_dir, has_state=self.state_slots is not None)
            if spec.mode == "redrafter":
                return start_redrafter(self.runner, spec, engine_dir=engine_dir, has_state=self.state_slots is not None)
            if spec.mode == "mtp":
                return start_mtp(self.runner, has_state=self.state_slots is not None,
                                 kv_cache_dtype=self.config.kv_cache_dtype,
                                 enable_reuse=self.config.enable_kv_cache_reuse)
            return make_proposer(spec.mode, max_matching_ngram_size=spec.max_matching_ngram_size,
                                 draft_engine_dir=spec.draft_engine_dir, target_engine_dir=engine_dir,
                                 target_runner=self.runner, enable_reuse=self.config.enable_kv_cache_reuse,
                                 kv_cache_dtype=self.config.kv_cache_dtype)
        except ProposerConfigError as err:
            raise ExecutorConfigError(str(err)) from None

    def _init_lora(self) -> None:
        self.adapters: AdapterCache | None = None
        cfg = self.config
        if not cfg.enable_lora:
            return
        if cfg.max_loras is not None:
            num_slots = cfg.max_loras
        elif self.runner.device.type == "cuda":
            free_bytes = free_device_bytes(self.runner.device)
            num_slots = int(free_bytes * cfg.lora_cache_gpu_memory_fraction) // self.runner.lora_slot_bytes(cfg.max_lora_rank)
        else:
            num_slots = CPU_LORA_SLOTS
        num_slots = max(1, min(num_slots, self.max_batch_size))
        self.runner.enable_lora(num_slots, cfg.max_lora_rank)
        self.adapters = AdapterCache(RunnerSlots(self.runner), self.runner.model_config, max_rank=cfg.max_lora_rank,
                                     host_bytes=cfg.lora_cache_host_memory_bytes)
        if cfg.lora_prefetch_dir:
            prefetch_adapters(self.adapters, cfg.lora_prefetch_dir)

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
            mrope_width=self.runner.model_config.head_dim if build.tp_size == 1 and build.pp_size == 1
            and getattr(getattr(self.runner, "model", None), "supports_mrope", False) else 0)
        self._table_request_ids: set[int] = set()  # active requests with a prompt table
        # Gemma 3: an image's table rows attend both ways in prefill (engine/executor/image_spans.py)
        self._image_spans = self.limits.supports_prompt_tables and getattr(
            getattr(self.runner, "model", None), "bidirectional_prompt_tables", False)
        if self._image_spans:
            self.scheduler.chunk_limit = image_spans.chunk_limit(self.limits.vocab_size, self.max_num_tokens)
        self._mrope_request_ids: set[int] = set()  # active requests with M-RoPE rows (mrope_rotary.py)
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
        self._pinned = pinned_token_buffers(self.runner.sampled_tokens.shape[0] // 2, self.runner.device)
        self._sync_request_ids: set[int] = set()  # active requests that need each step's tokens on the host
        self._responses = ResponseQueue()
        self._callback = response_callback
        self._iteration = 0
        self._stats_history: deque[IterationStats] = deque(maxlen=self.config.iter_stats_max_iterations)
        # Before the first iteration too, the stats show every pool (metrics read them from the start:
        # an encoder-decoder engine's cross-KV gauge reads its max while nothing has run yet).
        self._latest_stats = IterationStats(**self._pool_stats())
        log_path = os.environ.get(ITERATION_LOG_ENV)
        self._iteration_log = IterationLog(log_path) if log_path else None
        self._deliver_ms = 0.0  # this iteration's time in _deliver (for the iteration log)
        self._gpu_memory_read_at, self._gpu_memory = float("-inf"), 0
        self.disagg = Disaggregation(self)  # context_only / generation_only requests (disaggregated.py)
        self.pipelined = make_pipelined_steps(self)  # pipeline stages: several steps in flight, or None

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
        return self._latest_stats

    def get_iteration_stats_history(self) -> list[IterationStats]:
        return list(self._stats_history)

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
            if self._iteration_log is not None:
                self._iteration_log.close()
                self._iteration_log = None
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

    def _rejection(self, request: Request) -> str | None:
        if self._stopping:
            return "the executor is shut down and accepts no requests"
        disagg_error = self.disagg.request_error(request)
        if disagg_error is not None:
            return disagg_error
        if request.guided_decoding is not None and self.grammars is None:
            return ("guided_decoding_guide_type: guided decoding is not enabled on this model; set the "
                    "tensorrt_llm parameter guided_decoding_backend to xgrammar, or send the request "
                    "without guided_decoding_guide_type/guided_decoding_guide")
        if self.config.speculative is not None and (request.sampling.beam_width or 1) > 1:
            return (f"beam_width {request.sampling.beam_width}: beam search is not supported with speculative "
                    f"decoding (speculative mode '{self.config.speculative.mode}' is on); send beam_width 1")
        if request.lookahead_config is not None and (error := lookahead_request_error(request, self.config.speculative)):
            return error
        if request.lora is not None and self.adapters is None:
            return ("lora_task_id: LoRA is not enabled on this model; set the tensorrt_llm parameter enable_lora "
                    "to true, or send the request without lora_task_id/lora_weights/lora_config/lora_path")
        if self.state_slots is not None:
            error = state_cache.request_error(request, self.runner.model_config.architecture)
            if error is not None:
                return error
        encoder_error = encoder_input_error(request, self.encoder_stage)
        if encoder_error is not None:
            return encoder_error
        limit = self.config.max_queue_size
        if limit and len(self._inbox) + self._num_unscheduled >= limit:
            return f"Maximum queue size of {limit} has been reached, rejecting request"
        try:
            return validate_request(request, self.limits)
        except (TypeError, ValueError) as err:
            return f"invalid request: {err}"

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
            self._latest_stats = replace(self._latest_stats, **self._pool_stats())  # (idle: no step records them)
        self._admit(new)
        self._cancel(cancels)
        for state in [self._active[i] for i in self._table_request_ids if i in self._active]:
            if (message := prompt_keys_error(state)) is not None:  # hashing its table failed: it alone ends
                for seq in state.sequences:
                    self._finish(seq, FinishReason.ERROR)  # (as a cancel: safe with a step in flight)
                self._fail(state, message)
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

    def _admit(self, new: list[RequestState]) -> None:
        for state in new:
            self._active[state.request_id] = state
            if needs_tokens_on_host(state.request) or _has_external_drafts(state.request):
                self._sync_request_ids.add(state.request_id)  # (external drafts: until they are verified)
            state.is_queued = True
            self._num_unscheduled += 1
            beam_width = state.request.sampling.beam_width or 1
            table = state.request.prompt_table
            cache_keys = None
            if table is not None:  # the prefix cache sees each fake id as its table's content
                self._table_request_ids.add(state.request_id)
                made = state.prompt_cache_keys  # at enqueue, off this thread (request.py normalize_all: keys or a Future)
                cache_keys = (made[2] if made is not None and made[0] is state.request.input_token_ids and made[1] is table
                              else prompt_cache_keys(state.request.input_token_ids, table, self.limits.vocab_size))
            if state.request.mrope is not None:
                self._mrope_request_ids.add(state.request_id)
            for index in range(state.num_streams if beam_width == 1 else beam_width):
                seq = Sequence(next(self._seq_ids), state, sequence_index=0 if beam_width > 1 else index,
                               beam_index=index if beam_width > 1 else 0)
                seq.can_reuse_prefix = not state.request.output.return_context_logits
                seq.prompt_cache_keys = cache_keys
                seq.seed = self._seed_for(state, index)
                self._attach_external_draft(seq)
                state.sequences.append(seq)
            if state.request.lora is not None and not self._prepare_adapter(state):
                continue
            self._prepare(state)

    def _prepare(self, state: RequestState) -> None:
        """A request joins the queue once what it waits for is ready, off the loop: its adapter's
        parse (engine/lora/cache.py), then its grammar (engine/executor/guided.py)."""
        if state.adapter_future is not None:
            self._wait_for(state, state.adapter_future)
        elif state.request.guided_decoding is not None and state.grammar_future is None:
            self._compile_guide(state)
        else:
            self._schedule_sequences(state)

    def _prepare_adapter(self, state: RequestState) -> bool:
        """Find or start loading the request's adapter; False (the request failed) if it cannot be."""
        lora = state.request.lora
        try:
            state.adapter_future = self.adapters.prepare(lora)
        except LoraError as err:
            self._fail(state, str(err))
            return False
        self.adapters.note_request(lora.task_id)
        state.lora_key = lora.task_id
        return True

    def _acquire_adapter(self, state: RequestState, behind_a_waiter: bool = False) -> bool:
        """The scheduler admits ``state``'s first sequence: it needs its adapter in a slot. False:
        every slot is held by running requests, or an earlier adapter request waits for one
        (``behind_a_waiter``: it gets the next slot first); it waits."""
        if state.lora_slot >= 0 or state.request.lora is None:
            return True
        if behind_a_waiter:
            return False
        slot = self.adapters.acquire(state.lora_key)
        if slot is None:
            return False
        state.lora_slot = slot
        return True

    def _wait_for(self, state: RequestState, future) -> None:
        self._compiling[state.request_id] = state
        if future.done():
            self._admit_compiled([state])
        else:
            future.add_done_callback(lambda _, state=state: self._grammar_ready(state))

    def _schedule_sequences(self, state: RequestState) -> None:
        if self.encoder_stage is not None and self.encoder_stage.take(state):
            return  # it waits for its encoder run (_step)
        if state.request.request_type == "generation_only":
            self._start_generation_only(state.sequences[0])
            return
        for index, seq in enumerate(state.sequences):
            if index == 0 or state.is_beam_search:
                self.scheduler.add(seq)
            # other returned sequences wait for sequence 0's prompt KV and then share it (_fork_siblings)

    def _start_generation_only(self, seq: Sequence) -> None:
        """The context phase's KV comes into this pool (a pull on streams of its own; on CUDA it finishes
        at a later step: engine/executor/disaggregated.py, kv_pull.py), then _continue_generation_only."""
        error = self.disagg.import_kv(seq)
        if error is not None:
            self._fail(seq.state, error)

    def _continue_generation_only(self, seq: Sequence, first_token: int) -> None:
        """The KV arrived: the context's first token is appended (with the usual stop checks); then the
        sequence decodes like any other."""
        seq.token_ids.append(first_token)
        seq.num_unresolved_tokens += 1
        self._resolve_token(seq, len(seq.token_ids) - 1, first_token, None, None, 0, now_ns())
        if not seq.is_finished:
            self.scheduler.add(seq)

    def _compile_guide(self, state: RequestState) -> None:
        """The request waits (queued, unscheduled) until its grammar is compiled off the loop."""
        state.grammar_future = self.grammars.compile(state.request.guided_decoding)
        self._wait_for(state, state.grammar_future)

    def _grammar_ready(self, state: RequestState) -> None:
        with self._cv:  # (on a compile thread)
            self._compiled.append(state)
            self._cv.notify()

    def _admit_compiled(self, ready: list[RequestState]) -> None:
        """Requests whose adapter was parsed go on to their grammar (or the queue); guided requests
        whose grammar compiled get a matcher per sequence and join the queue. A bad adapter or a
        guide that failed to compile fails its request."""
        for state in ready:
            if self._compiling.pop(state.request_id, None) is None or state.request_id not in self._active:
                continue  # cancelled, failed or shut down meanwhile
            if state.is_cancelled or all(seq.is_finished for seq in state.sequences):
                continue
            if state.adapter_future is not None:
                future, state.adapter_future = state.adapter_future, None
                try:
                    self.adapters.loaded(state.lora_key, future)
                except Exception as err:
                    self._fail(state, str(err) if isinstance(err, LoraError) else f"LoRA adapter: {err!r}")
                    continue
                self._prepare(state)
                continue
            try:
                compiled = state.grammar_future.result()
            except Exception as err:
                self._fail(state, str(err) if isinstance(err, GuideError) else f"guided decoding: {err!r}")
                continue
            for seq in state.sequences:
                seq.grammar = make_matcher(compiled, state.request.end_id)
            self._schedule_sequences(state)

    def _seed_for(self, state: RequestState, index: int) -> int:
        seed = state.request.sampling.seed
        if seed is None:
            return random.getrandbits(62)
        return (seed + index) % (1 << 62)  # each returned sequence draws its own stream

    def _cancel(self, request_ids: set[int]) -> None:
        for request_id in request_ids:
            state = self._active.get(request_id)
            if state is not None:
                state.is_cancelled = True
                for seq in state.sequences:
                    self._finish(seq, FinishReason.CANCELLED)

    # ----- launch: forward + sample, tokens left on the device -----
    def _launch(self, plan: SchedulerOutput, started: float) -> InFlightStep | None:
        """Run the batch and sample without waiting for the result; the sequences that sample get a
        placeholder token each. On failure, fail exactly the requests the batch carried."""
        num_active = len(self._active)  # in flight this step, those that finish in it included
        try:
            batch, rows, sampling, drafted = self._forward_batch(plan)
            if self.encoder_stage is not None:
                self.encoder_stage.fill_cross_rows(batch, plan)
            prompt_embeds = self._prompt_embeds(plan) if self._table_request_ids else None
            rotary = step_rotary_of(plan.scheduled, batch) if self._mrope_request_ids else None
            spans = image_spans.step_span_ahead_of(plan.scheduled, self.limits.vocab_size) if (
                self._image_spans and prompt_embeds is not None) else None
            logits = self.runner.forward(batch, **({} if prompt_embeds is None else {"prompt_embeds": prompt_embeds}),
                                         **({} if rotary is None else {"rotary": rotary}),
                                         **({} if spans is None else {"span_ahead": spans}))
            # A constrained row samples after the previous step's tokens reach its matcher (_sample_guided).
            guided = self.token_masks is not None and any(seq.grammar is not None for seq, _ in sampling)
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
        for i, (seq, row) in enumerate(sampling):
            if seq.is_finished:  # stopped by the step just finished (guided: sampled after it); dropped
                step.placeholders.append((seq, -1, row))
                continue
            step.placeholders.append((seq, len(seq.token_ids), row))
            seq.token_ids.append(placeholder(batch.sampled_tokens_slot + i))
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
        """Pack the plan. rows[i] = (first, end) logits rows of scheduled sequence i (end - first: 0
        or more); sampling = (sequence, logits row) of each non-beam sequence that samples;
        drafted = (sequence, first logits row, k) of each sequence verifying k drafts: its k + 1
        rows are its last known token's and its drafts' (speculative decoding)."""
        token_ids, positions, seq_lens, context_lens, tables, logits_indices, rows = [], [], [], [], [], [], []
        sampling, drafted, trees = [], [], []
        lora_slots = [item.seq.state.lora_slot for item in plan.scheduled] if self.adapters is not None else []
        T = self.blocks.tokens_per_block
        for item in plan.scheduled:  # runs once per sequence per step: kept free of calls in the decode case
            seq, start, n = item.seq, item.start, item.num_new_tokens
            offset, end = len(token_ids), start + n
            if n == 1:
                token_ids.append(seq.token_ids[start])
                positions.append(start)
            else:
                token_ids += seq.token_ids[start:end]
                positions += range(start, end)
            seq_lens.append(n)
            context_lens.append(end)
            tables.append(seq.block_ids[:-(-end // T)])
            first = len(logits_indices)
            if item.num_draft_tokens:  # known tokens, then the drafts; logits from the last known one on
                k = item.num_draft_tokens
                token_ids[offset + n - k:] = seq.draft_token_ids[:k]
                if seq.draft_parents is not None:  # a token tree: rotary positions by depth (tree_batch.py)
                    trees.append(chunk_parents(n, seq.draft_parents[:k]))
                    positions[offset:] = tree_positions(start, trees[-1])
                else:
                    trees.append(None)
                logits_indices += range(offset + n - k - 1, offset + n)
                rows.append((first, len(logits_indices)))
                drafted.append((seq, first, k))
                continue
            trees.append(None)
            if seq.state.request.output.return_context_logits:
                logits_indices += [offset + i for i in self._logit_positions(item)]
            elif item.samples:  # the chunk reaches the end: its last logits sample
                logits_indices.append(offset + n - 1)
            rows.append((first, len(logits_indices)))
            if item.samples and seq.state.request.sampling.beam_width <= 1:  # not is_beam_search
                sampling.append((seq, len(logits_indices) - 1))
        slot = self._parity * self.runner.sampled_tokens.shape[0] // 2 if sampling else -1
        batch = ForwardBatch(token_ids, positions, seq_lens, context_lens, tables, logits_indices, slot,
                             lora_slots if any(s >= 0 for s in lora_slots) else None)
        if any(tree is not None for tree in trees):
            batch.tree_parents = trees
        if self.state_slots is not None:
            batch.state_slots = self.state_slots.slots_of(plan.scheduled)
        return batch, rows, sampling, drafted

    def _prompt_embeds(self, plan: SchedulerOutput) -> PromptEmbeds | None:
        """The prompt-table rows of this step's chunks (in _forward_batch's packing order): every
        scheduled prompt token whose id is vocab_size + row takes that row of its request's table."""
        pieces, offset = [], 0
        for item in plan.scheduled:
            seq, start, n = item.seq, item.start, item.num_new_tokens
            table = seq.state.request.prompt_table
            if table is not None and start < seq.num_prompt_tokens:
                pieces.append((offset, seq.token_ids[start:min(start + n, seq.num_prompt_tokens)], table))
            offset += n
        return gather_prompt_embeds(pieces, self.limits.vocab_size) if pieces else None

    def _logit_positions(self, item) -> list[int]:
        """Chunk-relative tokens whose logits are needed: new prompt positions for context logits, then the last."""
        seq, start, n = item.seq, item.start, item.num_new_tokens
        state = seq.state
        if not state.request.output.return_context_logits:  # the common case, once per sequence per step
            return [n - 1] if item.samples else []
        wanted = []
        if seq is state.sequences[0]:
            have = sum(len(part) for part in state.context_logits_parts)
            wanted = [p - start for p in range(max(start, have), min(start + n, seq.num_prompt_tokens))]
        if item.samples and (not wanted or wanted[-1] != n - 1):
            wanted.append(n - 1)
        return wanted

    def _sample(self, logits: torch.Tensor, sampling: list[tuple[Sequence, int]], batch: ForwardBatch,
                guided: bool = False) -> TokenTransfer:
        """Sample every row in ``sampling`` on the device, leave the tokens in the runner's ring for
        the next step (which may be launched before the host sees them) and start their copy home.
        ``guided``: the constrained rows' grammars mask their logits first (TokenMasks.fill)."""
        seqs = [seq for seq, _ in sampling]
        try:
            token_masks = self.token_masks.fill(seqs) if guided else None
            want_log_probs = any(s.state.request.output.return_log_probs for s in seqs)  # (top implies it)
            md = build_sampling_metadata(seqs, self.runner.vocab_size, logits.device, want_log_probs)
            md.normalize_log_probs = self.config.normalize_log_probs
            if token_masks is not None:
                md.token_bitmask, md.token_bitmask_rows = token_masks
            sample_rows = [row for _, row in sampling]
            all_rows = sample_rows == list(range(len(logits)))  # plain decode: no gather needed
            out = sample(logits if all_rows else logits[sample_rows], md)
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
        for item, (first, end) in zip(step.plan.scheduled, step.rows):  # once per sequence per step: keep it lean
            seq = item.seq
            if seq.status is not SequenceStatus.RUNNING:
                continue  # finished (a stop known late, a cancel) or preempted since the launch
            state = seq.state
            if state.request.output.return_context_logits:  # slicing a tensor per sequence costs ~2 us
                self._collect_context_logits(item, step.logits[first:end])
            if item.num_draft_tokens:  # before registering: no block holding a rejected token is registered
                self._take_verified(item, step.verified[seq.seq_id], kv_moves)
            self.blocks.register_computed_blocks(seq)
            if item.samples and len(state.sequences) > 1 and (item.start + item.num_new_tokens - item.num_draft_tokens
                                                               == seq.num_prompt_tokens):
                self._fork_siblings(seq)
            if item.samples and state.is_beam_search:
                beam_rows.append((seq, step.logits[end - 1]))
            if item.num_draft_tokens:  # (after the fork: a stop here frees the blocks siblings share)
                self._resolve_verified(seq, step.verified[seq.seq_id], step.logits, first, now)
        move_kv(self.runner, kv_moves)  # the trees' accepted paths into place, every sequence's at once
        for i, (seq, index, row) in enumerate(step.placeholders):
            if not seq.is_finished:
                self._resolve_token(seq, index, token_ids[i], None if log_probs is None else log_probs[i],
                                    step.logits, row, now, None if top is None else top[i])
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
        finished_at = time.perf_counter()
        self._record_stats(step.plan, (finished_at - max(step.started, self._last_step_finished)) * 1e3,
                           step.num_active)
        self._last_step_finished = finished_at
        return True

    # ----- speculative decoding (engine/executor/speculative/) -----
    def _attach_external_draft(self, seq: Sequence) -> None:
        """The request's own drafts ride with each sequence's first sampling chunk (the prompt's
        last), cut so that keeping them all stays within max_tokens."""
        draft = seq.state.request.external_draft
        if draft is None or not draft.token_ids:
            return
        room = draft_room(seq, len(draft.token_ids))
        seq.draft_token_ids = list(draft.token_ids[:room])
        seq.draft_logits = None if draft.logits is None else torch.as_tensor(draft.logits)[:room]
        seq.draft_acceptance_threshold = draft.acceptance_threshold

    def _propose_drafts(self) -> None:
        """Ask the proposer for drafts for every running sequence about to decode one token."""
        seqs = [seq for seq in self.scheduler.running if seq.num_uncomputed_tokens == 1 and _may_draft(seq)]
        if not seqs:
            return
        for seq, drafts in zip(seqs, self.proposer.propose(seqs, self.config.speculative.max_draft_len)):
            if seq.state.request.prompt_table is not None:  # an n-gram may copy a prompt's image placeholders
                vocab = self.limits.vocab_size
                drafts = drafts[:next((i for i, t in enumerate(drafts) if t >= vocab), len(drafts))]
            seq.draft_token_ids = drafts

    def _verify(self, logits: torch.Tensor, drafted: list[tuple[Sequence, int, int]]) -> dict[int, Verified]:
        """Decide, per drafted sequence, which drafts the step keeps (applied when it finishes)."""
        return verify_batch([(seq, seq.draft_token_ids[:k], first) for seq, first, k in drafted], logits,
                            self.runner.vocab_size, self.config.normalize_log_probs)

    def _take_verified(self, item, verified: Verified, kv_moves: list) -> None:
        """Roll a drafted sequence back to its accepted tokens: they join token_ids (as unresolved
        tokens, until _resolve_verified checks stops on each), the KV of rejected positions is
        forgotten (num_computed_tokens stops after the last accepted draft; the target's own
        token has no KV yet), and blocks that held only rejected positions go back to the pool.
        A tree's accepted path: its KV moves into consecutive positions join ``kv_moves``, which the
        caller makes for the whole step before anything else reaches the device (a source in a
        block freed here is still read first)."""
        seq, state = item.seq, item.seq.state
        if verified.path is not None:
            kv_moves += path_kv_moves(seq.block_ids, len(seq.token_ids) - 1, verified.path,
                                      self.runner.tokens_per_block)
        seq.num_computed_tokens = len(seq.token_ids) + verified.num_accepted
        seq.token_ids += verified.token_ids
        seq.num_unresolved_tokens += len(verified.token_ids)
        seq.draft_token_ids, seq.draft_logits, seq.draft_probs, seq.draft_acceptance_threshold = [], None, None, None
        seq.draft_parents = None
        surplus = seq.block_ids[self.blocks.blocks_for_tokens(len(seq.token_ids)):]
        if surplus:  # fresh, unregistered blocks of this step (nothing else is in flight: synchronous)
            del seq.block_ids[-len(surplus):]
            self.blocks.free(surplus)
        perf = state.perf
        perf.total_draft_tokens += verified.num_draft_tokens
        perf.total_accepted_draft_tokens += verified.num_accepted
        perf.acceptance_rate = perf.total_accepted_draft_tokens / max(1, perf.total_draft_tokens)
        self._num_draft_tokens_total += verified.num_draft_tokens
        self._num_accepted_draft_tokens_total += verified.num_accepted
        if state.request_id in self._sync_request_ids and not needs_tokens_on_host(state.request) and not any(
                s.draft_token_ids for s in state.sequences if not s.is_finished):
            self._sync_request_ids.discard(state.request_id)  # its external drafts are all verified

    def _resolve_verified(self, seq: Sequence, verified: Verified, logits: torch.Tensor | None, first: int,
                          now: int) -> None:
        """Stop checks on each emitted token in order; a stop drops the tokens after it."""
        start = len(seq.token_ids) - len(verified.token_ids)
        for j, token in enumerate(verified.token_ids):
            if seq.is_finished:
                return
            log_prob = None if verified.log_probs is None else verified.log_probs[j]
            self._resolve_token(seq, start + j, token, log_prob, logits, first + j, now)

    def _fork_siblings(self, first: Sequence) -> None:
        """num_return_sequences > 1: sequences 1..n-1 take references on sequence 0's full prompt
        blocks (just computed) and join the queue; only the prompt's partial tail is recomputed."""
        state = first.state
        if state.is_beam_search:
            return
        T = self.blocks.tokens_per_block
        shared = first.block_ids[:(first.num_prompt_tokens - 1) // T]  # never the block of the last token
        for seq in state.sequences[1:]:
            if seq.status is SequenceStatus.WAITING and not seq.block_ids and seq not in self.scheduler.waiting:
                self.blocks.acquire(shared)
                seq.block_ids, seq.num_computed_tokens = list(shared), len(shared) * T
                seq.block_hashes, seq.num_registered_blocks = first.block_hashes[:len(shared)], len(shared)
                self.scheduler.add(seq)

    def _note_scheduled(self, state: RequestState, now: int) -> None:
        if not state.perf.first_scheduled_time_ns:
            state.perf.first_scheduled_time_ns = now
        self._leave_queue(state)

    def _leave_queue(self, state: RequestState) -> None:
        if state.is_queued:
            state.is_queued = False
            self._num_unscheduled -= 1

    def _collect_context_logits(self, item, chunk_logits: torch.Tensor) -> None:
        state = item.seq.state
        if not state.request.output.return_context_logits or item.seq is not state.sequences[0]:
            return
        have = sum(len(part) for part in state.context_logits_parts)
        new = max(0, min(item.start + item.num_new_tokens, item.seq.num_prompt_tokens) - have)
        if new:
            state.context_logits_parts.append(chunk_logits[:new].float().cpu())

    def _resolve_token(self, seq: Sequence, index: int, token: int, log_prob: float | None,
                       logits: torch.Tensor | None, row: int, now: int,
                       top: tuple[list[int], list[float]] | None = None) -> None:
        """seq.token_ids[index] (its oldest placeholder) becomes ``token``; then the stop checks.
        A stop drops the placeholders after it: their tokens are never emitted. ``top``: the
        step's K best (ids, log-probs) for this row, K >= the request's num_top_log_probs."""
        request, perf = seq.state.request, seq.state.perf
        perf.first_token_time_ns = perf.first_token_time_ns or now
        perf.last_token_time_ns = now
        if request.streaming:  # a non-streaming request has news only when it finishes (_finish touches it)
            self._touched[seq.request_id] = seq.state
        grammar = seq.grammar
        if grammar is not None and not grammar.accept_token(token):  # never, with the mask applied
            self._fail(seq.state, f"guided decoding: the grammar refused generated token {token}")
            return
        if token == request.end_id:
            self._drop_unresolved(seq, keep=index)
            self._finish(seq, FinishReason.END_ID)
            return
        seq.token_ids[index] = token
        seq.num_unresolved_tokens -= 1
        if log_prob is not None:
            seq.log_probs.append(log_prob)
            seq.cum_log_prob += log_prob
        if top is not None:
            k = request.output.num_top_log_probs
            seq.top_log_prob_ids.append(top[0][:k])
            seq.top_log_probs.append(top[1][:k])
        if request.output.return_generation_logits:
            seq.generation_logits.append(logits[row].float().cpu())
        length = index + 1
        if grammar is not None and grammar.is_terminated():  # complete, and the request has no end_id
            self._drop_unresolved(seq, keep=length)
            self._finish(seq, FinishReason.END_ID)
            return
        if request.stop_words or length - seq.num_prompt_tokens >= request.max_tokens:
            reason = self._stop_reason(seq, length)  # (else NOT_FINISHED, known without the call)
            if reason is not FinishReason.NOT_FINISHED:
                self._drop_unresolved(seq, keep=length)
                self._finish(seq, reason)

    @staticmethod
    def _drop_unresolved(seq: Sequence, keep: int) -> None:
        """Cut token_ids to ``keep`` tokens: every placeholder goes (they all sit at the tail)."""
        del seq.token_ids[keep:]
        seq.num_unresolved_tokens = 0

    def _stop_reason(self, seq: Sequence, length: int) -> FinishReason:
        """Why seq stops after its first ``length`` tokens, or NOT_FINISHED."""
        request = seq.state.request
        generated = length - seq.num_prompt_tokens
        for word in request.stop_words or ():
            if word and len(word) <= generated and seq.token_ids[length - len(word):length] == list(word):
                return FinishReason.STOP_WORDS
        if generated >= request.max_tokens:
            return FinishReason.LENGTH
        return FinishReason.NOT_FINISHED

    def _beam_step(self, beam_rows: list[tuple[Sequence, torch.Tensor]], now: int) -> None:
        for seq, raw in beam_rows:
            md = build_sampling_metadata([seq], self.runner.vocab_size, raw.device, False)
            seq.pending_logprobs = process_logits(raw.unsqueeze(0), md).log_softmax(dim=-1)[0]
        for state in {seq.state.request_id: seq.state for seq, _ in beam_rows}.values():
            live = [s for s in state.sequences if not s.is_finished]
            if live and all(s.pending_logprobs is not None for s in live):
                state.perf.first_token_time_ns = state.perf.first_token_time_ns or now
                state.perf.last_token_time_ns = now
                self._touched[state.request_id] = state
                beam_search.advance(state, live, self.blocks, self.scheduler)
                if beam_search.is_done(state):
                    for seq in state.sequences:
                        self._finish(seq, seq.finish_reason if seq.finish_reason is not FinishReason.NOT_FINISHED
                                     else FinishReason.LENGTH)

    def _finish(self, seq: Sequence, reason: FinishReason) -> None:
        if seq.is_finished:
            return
        if seq.num_unresolved_tokens:  # e.g. cancelled with a step in flight: its token is not sent
            self._drop_unresolved(seq, keep=len(seq.token_ids) - seq.num_unresolved_tokens)
        if seq.state.request.request_type == "context_only" and reason is not FinishReason.CANCELLED:
            if (error := self.disagg.export(seq)) is not None:  # pins the prompt's blocks before the scheduler
                self._fail(seq.state, error)  # frees the sequence's; a failed export pins none: this request alone
                return
        self.scheduler.finish(seq)
        seq.finish_reason = reason
        self._touched[seq.request_id] = seq.state

    def _fail(self, state: RequestState, message: str) -> None:
        for seq in state.sequences:
            if not seq.is_finished:
                self.scheduler.finish(seq)
                seq.finish_reason = FinishReason.ERROR
        self._retire(state)
        self._touched.pop(state.request_id, None)
        self._deliver([Response(state.request_id, error=message)])

    def _fail_all(self, message: str) -> None:
        for state in list(self._active.values()):
            self._fail(state, message)
        with self._cv:
            pending, self._inbox = self._inbox, []
        self._deliver([Response(state.request_id, error=message) for state in pending])

    # ----- emit -----
    def _emit(self) -> None:
        self._emit_after_launch = False
        responses = []
        for state in self._touched.values():
            new = responses_for(state, self.config.stream_interval)
            if self.encoder_stage is not None:  # Whisper token timestamps, before the cross K/V goes
                self.encoder_stage.add_token_timestamps(state, new)
            responses += new
            if all(s.is_finished for s in state.sequences):
                self._retire(state)
        self._touched.clear()
        if responses:
            self._deliver(responses)

    def _retire(self, state: RequestState) -> None:
        """The request has ended (every sequence finished, or failed): forget it."""
        if state.lora_key is not None:  # its adapter slot (or its claim on one) goes back
            if state.lora_slot >= 0:
                self.adapters.release(state.lora_key)
            else:
                self.adapters.forget_request(state.lora_key)
            state.lora_key, state.lora_slot = None, -1
        self._leave_queue(state)  # e.g. cancelled while still queued
        if self.encoder_stage is not None:  # its cross-KV blocks go back
            self.encoder_stage.release(state)
        if self.proposer is not None:
            for seq in state.sequences:
                self.proposer.release(seq)
        self._active.pop(state.request_id, None)
        self._sync_request_ids.discard(state.request_id)
        self._table_request_ids.discard(state.request_id)
        self._mrope_request_ids.discard(state.request_id)

    def _deliver(self, responses: list[Response]) -> None:
        started = time.perf_counter()
        if self._callback is None:
            self._responses.put(responses)
        else:
            try:
                self._callback(responses)
            except Exception:  # a broken callback must not stop the loop
                traceback.print_exc()
        self._deliver_ms += (time.perf_counter() - started) * 1e3

    # ----- stats -----
    def _gpu_memory_allocated(self) -> int:
        """torch.cuda.memory_allocated, read at most every GPU_MEMORY_READ_PERIOD_S: it builds the
        allocator's whole statistics dict, ~5% of a small model's decode loop when read every step."""
        now = time.monotonic()
        if now - self._gpu_memory_read_at >= GPU_MEMORY_READ_PERIOD_S:
            self._gpu_memory_read_at = now
            self._gpu_memory = torch.cuda.memory_allocated(self.runner.device)
        return self._gpu_memory

    def _pool_stats(self) -> dict:
        """IterationStats' pool fields now: the KV pool, the cross-KV pool (encoder-decoder engines) and LoRA."""
        return {"kv_cache_stats": kv_cache_stats(self.blocks),
                "cross_kv_cache_stats": (None if self.encoder_stage is None
                                         else KvCacheStats(**self.encoder_stage.cross_kv_counts())),
                "lora_cache_stats": None if self.adapters is None else self.adapters.snapshot()}

    def _record_stats(self, plan: SchedulerOutput, latency_ms: float, num_active: int) -> None:
        self._iteration += 1
        now = datetime.now(timezone.utc)
        kv_bytes = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        on_gpu = self.runner.device.type == "cuda"
        stats = IterationStats(
            timestamp=now.strftime(STATS_TIME_FORMAT), timestamp_ns=now_ns(), iter=self._iteration,
            iter_latency_ms=latency_ms,
            num_active_requests=num_active, max_num_active_requests=self.max_batch_size,
            num_queued_requests=len(self._inbox) + self._num_unscheduled,
            num_scheduled_requests=len({s.seq.request_id for s in plan.scheduled}),
            num_context_requests=plan.num_context_sequences,
            num_gen_requests=len(plan.scheduled) - plan.num_context_sequences,
            num_ctx_tokens=plan.num_context_tokens, num_gen_tokens=plan.num_tokens - plan.num_context_tokens,
            num_paused_requests=len(plan.preempted), num_preempted_requests=self.scheduler.num_preemptions,
            cpu_mem_usage=0 if on_gpu else kv_bytes,
            gpu_mem_usage=self._gpu_memory_allocated() if on_gpu else 0,
            **self._pool_stats(),
            num_draft_tokens_total=self._num_draft_tokens_total,
            num_accepted_draft_tokens_total=self._num_accepted_draft_tokens_total,
            **self.disagg.stats())
        self._stats_history.append(stats)
        if self._iteration_log is not None:
            self._iteration_log.write(stats, self._deliver_ms)
        self._deliver_ms = 0.0
        if not self._active:
            # Idle from here on. Metrics read the latest stats, so they must not keep reporting this
            # last iteration's requests as active and scheduled; not a new iteration, so not in history.
            stats = replace(stats, num_active_requests=0, num_scheduled_requests=0, num_context_requests=0,
                            num_gen_requests=0, num_ctx_tokens=0, num_gen_tokens=0, num_paused_requests=0)
        self._latest_stats = stats


def _has_external_drafts(request: Request) -> bool:
    return request.external_draft is not None and bool(request.external_draft.token_ids)


def _may_draft(seq: Sequence) -> bool:
    """Per-step drafts are for plain decoding: not beams (refused with a proposer), grammars (the
    matcher would need to follow each draft), top log-probs or context logits."""
    output = seq.state.request.output
    return (seq.grammar is None and not seq.state.is_beam_search and not output.num_top_log_probs
            and not output.return_context_logits)
