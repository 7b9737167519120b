"""The executor's iteration statistics as it records them: one IterationStats per finished step.

``StepStats`` keeps what only the statistics use (the iteration count, the history ring, the latest
stats that metrics read, the optional iteration log and the time the iteration spent delivering
responses, the throttled GPU memory reading); the executor hands it each step's figures
(``record``). ``pool_stats``: the pool fields (KV, cross-KV, LoRA), read both by ``record`` and while
idle. The dataclasses themselves are in stats.py.
"""
from __future__ import annotations

import os
import time
from collections import deque
from dataclasses import replace
from datetime import datetime, timezone

import torch

from engine.executor.request import now_ns
from engine.executor.scheduler import SchedulerOutput
from engine.executor.stats import (
    ITERATION_LOG_ENV, STATS_TIME_FORMAT, IterationLog, IterationStats, KvCacheStats, kv_cache_stats,
)

GPU_MEMORY_READ_PERIOD_S = 0.1  # IterationStats.gpu_mem_usage is at most this old


def pool_stats(blocks, encoder_stage, adapters) -> dict:
    """IterationStats' pool fields now: the KV pool, the cross-KV pool (encoder-decoder engines) and LoRA."""
    return {"kv_cache_stats": kv_cache_stats(blocks),
            "cross_kv_cache_stats": (None if encoder_stage is None
                                     else KvCacheStats(**encoder_stage.cross_kv_counts())),
            "lora_cache_stats": None if adapters is None else adapters.snapshot()}


class StepStats:
    """The statistics of one executor's iterations (written on its loop thread only)."""

    def __init__(self, runner, max_batch_size: int, max_iterations: int, pools: dict):
        self.runner, self.max_batch_size = runner, max_batch_size
        self.iteration = 0
        self.history: deque[IterationStats] = deque(maxlen=max_iterations)
        # Before the first iteration too, the stats show every pool (metrics read them from the start:
        # an encoder-decoder engine's cross-KV gauge reads its max while nothing has run yet).
        self.latest = IterationStats(**pools)
        log_path = os.environ.get(ITERATION_LOG_ENV)
        self.log = IterationLog(log_path) if log_path else None
        self.deliver_ms = 0.0  # this iteration's time in the executor's _deliver (for the iteration log)
        self._gpu_memory_read_at, self._gpu_memory = float("-inf"), 0

    def close(self) -> None:
        if self.log is not None:
            self.log.close()
            self.log = None

    def gpu_memory_allocated(self) -> int:
        """torch.cuda.memory_allocated, read at most every GPU_MEMORY_READ_PERIOD_S: it builds the
        allocator's whole statistics dict, ~5% of a small model's decode loop when read every step."""
        now = time.monotonic()
        if now - self._gpu_memory_read_at >= GPU_MEMORY_READ_PERIOD_S:
            self._gpu_memory_read_at = now
            self._gpu_memory = torch.cuda.memory_allocated(self.runner.device)
        return self._gpu_memory

    def record(self, plan: SchedulerOutput, latency_ms: float, num_active: int, *, num_queued: int,
               num_preemptions: int, pools: dict, num_draft_tokens_total: int,
               num_accepted_draft_tokens_total: int, disagg: dict, idle: bool, end_ns: int | None = None) -> None:
        """One finished step's stats into the history (and the log). ``idle``: no request is active
        after it, so the latest stats read no active or scheduled requests. ``end_ns``: the step's end
        (now_ns's clock; default now), the stats' timestamp_ns."""
        self.iteration += 1
        end_ns = now_ns() if end_ns is None else end_ns
        now = datetime.fromtimestamp(end_ns / 1e9, timezone.utc)  # (the same instant as timestamp_ns)
        kv_bytes = self.runner.kv_cache.numel() * self.runner.kv_cache.element_size()
        on_gpu = self.runner.device.type == "cuda"
        # Each count is a pass over the batch (~12 us at 256 sequences): each once, none in a decode-only step.
        num_context = plan.num_context_sequences
        num_ctx_tokens = plan.num_context_tokens if num_context else 0
        num_tokens = plan.num_tokens
        stats = IterationStats(
            timestamp=now.strftime(STATS_TIME_FORMAT), timestamp_ns=end_ns, iter=self.iteration,
            iter_latency_ms=latency_ms,
            num_active_requests=num_active, max_num_active_requests=self.max_batch_size,
            num_queued_requests=num_queued,
            num_scheduled_requests=len({s.seq.state.request_id for s in plan.scheduled}),
            num_context_requests=num_context, num_gen_requests=len(plan.scheduled) - num_context,
            num_ctx_tokens=num_ctx_tokens, num_gen_tokens=num_tokens - num_ctx_tokens,
            num_paused_requests=len(plan.preempted), num_preempted_requests=num_preemptions,
            cpu_mem_usage=0 if on_gpu else kv_bytes,
            gpu_mem_usage=self.gpu_memory_allocated() if on_gpu else 0,
            **pools,
            num_draft_tokens_total=num_draft_tokens_total,
            num_accepted_draft_tokens_total=num_accepted_draft_tokens_total,
            **disagg)
        self.history.append(stats)
        if self.log is not None:
            self.log.write(stats, self.deliver_ms)
        self.deliver_ms = 0.0
        if idle:
            # Idle from here on. Metrics read the latest stats, so they must not keep reporting this
            # last iteration's requests as active and scheduled; not a new iteration, so not in history.
            stats = replace(stats, num_active_requests=0, num_scheduled_requests=0, num_context_requests=0,
                            num_gen_requests=0, num_ctx_tokens=0, num_gen_tokens=0, num_paused_requests=0)
        self.latest = stats
