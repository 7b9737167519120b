"""Iteration statistics the executor publishes after every iteration (Triton's metrics read them)."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from engine.executor.kv_cache import BlockManager

STATS_TIME_FORMAT = "%m-%d-%Y %H:%M:%S.%f"  # TRT-LLM's timestamp layout (UTC here)


@dataclass
class KvCacheStats:
    max_num_blocks: int = 0
    free_num_blocks: int = 0
    used_num_blocks: int = 0
    tokens_per_block: int = 0
    reused_blocks: int = 0  # cumulative prefix-cache hits (onboarded ones included)
    alloc_new_blocks: int = 0  # cumulative fresh allocations
    alloc_total_blocks: int = 0
    # KV host tier (engine/executor/kv_host_tier.py), cumulative: prefix hits copied back from host
    # memory (part of reused_blocks), and evicted reusable blocks copied out to it.
    onboarded_blocks: int = 0
    offloaded_blocks: int = 0
    max_num_host_blocks: int = 0  # host tier slots (0: no tier)
    used_num_host_blocks: int = 0


@dataclass
class IterationStats:
    timestamp: str = ""  # UTC, "%m-%d-%Y %H:%M:%S.%f" like TRT-LLM
    timestamp_ns: int = 0
    iter: int = 0
    iter_latency_ms: float = 0.0
    num_active_requests: int = 0
    max_num_active_requests: int = 0
    num_queued_requests: int = 0
    num_scheduled_requests: int = 0
    num_context_requests: int = 0
    num_gen_requests: int = 0
    num_ctx_tokens: int = 0
    num_gen_tokens: int = 0
    num_paused_requests: int = 0
    num_preempted_requests: int = 0
    cpu_mem_usage: int = 0
    gpu_mem_usage: int = 0
    pinned_mem_usage: int = 0
    kv_cache_stats: KvCacheStats = field(default_factory=KvCacheStats)
    # Encoder-decoder engines: the cross-KV pool's blocks (TRT-LLM's crossKvCacheStats); None otherwise.
    cross_kv_cache_stats: KvCacheStats | None = None
    # LoRA: a snapshot of engine.lora.stats.LoraCacheStats (None when LoRA is off).
    lora_cache_stats: Any = None
    # Speculative decoding, cumulative since the executor started: draft tokens verified, and accepted.
    num_draft_tokens_total: int = 0
    num_accepted_draft_tokens_total: int = 0
    # Disaggregated serving, cumulative: generation_only requests whose KV arrived here, and the copies' time.
    num_kv_transfers_total: int = 0
    kv_cache_transfer_ms_total: float = 0.0
    # ... and KV blocks taken out of the pool for good: a failed NIXL READ into them that NIXL could not cancel.
    num_kv_blocks_quarantined: int = 0


def kv_cache_stats(blocks: BlockManager) -> KvCacheStats:
    host = blocks.host_tier
    return KvCacheStats(
        max_num_blocks=blocks.num_blocks, free_num_blocks=blocks.num_free_blocks,
        used_num_blocks=blocks.num_used_blocks, tokens_per_block=blocks.tokens_per_block,
        reused_blocks=blocks.total_reused_blocks, alloc_new_blocks=blocks.total_new_blocks,
        alloc_total_blocks=blocks.total_new_blocks + blocks.total_reused_blocks,
        onboarded_blocks=blocks.total_onboarded_blocks, offloaded_blocks=blocks.total_offloaded_blocks,
        max_num_host_blocks=0 if host is None else host.num_slots,
        used_num_host_blocks=0 if host is None else host.num_used_slots)


# Diagnostics: with $TRITONLLM_ITERATION_LOG set to a file path, every executor appends one line per
# iteration there (benchmarks/serving/serving_bench.py reads it to tell a slow engine step from a slow relay).
ITERATION_LOG_ENV = "TRITONLLM_ITERATION_LOG"
ITERATION_LOG_FIELDS = ("timestamp_ns", "iter", "latency_ms", "num_ctx_tokens", "num_gen_tokens",
                        "num_active_requests", "deliver_ms")


class IterationLog:
    """Space-separated ITERATION_LOG_FIELDS, one line per iteration, written as it ends (line
    buffered: a reader sees every finished iteration). ``deliver_ms``: of ``latency_ms``, the time
    the loop spent handing that iteration's responses on (to the queue or the engine process's
    clients); a relay that reads slowly shows up there."""

    def __init__(self, path: str):
        self._file = open(path, "a", buffering=1)

    def write(self, stats: IterationStats, deliver_ms: float) -> None:
        self._file.write(f"{stats.timestamp_ns} {stats.iter} {stats.iter_latency_ms:.3f} {stats.num_ctx_tokens} "
                         f"{stats.num_gen_tokens} {stats.num_active_requests} {deliver_ms:.3f}\n")

    def close(self) -> None:
        self._file.close()


def read_iteration_log(path: str, start_ns: int = 0, end_ns: int | None = None) -> list[dict]:
    """The iterations of an IterationLog that ended in [start_ns, end_ns] (wall-clock ns)."""
    rows = []
    try:
        with open(path) as log:
            lines = log.readlines()
    except FileNotFoundError:
        return rows
    for line in lines:
        values = line.split()
        if len(values) != len(ITERATION_LOG_FIELDS):
            continue  # a line being written
        row = {name: (float(v) if name.endswith("_ms") else int(v)) for name, v in zip(ITERATION_LOG_FIELDS, values)}
        if row["timestamp_ns"] >= start_ns and (end_ns is None or row["timestamp_ns"] <= end_ns):
            rows.append(row)
    return rows
