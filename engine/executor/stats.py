"""Iteration statistics the executor publishes after every iteration (Triton's metrics read them)."""
from __future__ import annotations

from dataclasses import dataclass, field

from engine.executor.kv_cache import BlockManager

STATS_TIME_FORMAT = "%m-%d-%Y %H:%M:%S.%f"  # TRT-LLM's timestamp layout (UTC here)


@dataclass
class KvCacheStats:
    max_num_blocks: int = 0
    free_num_blocks: int = 0
    used_num_blocks: int = 0
    tokens_per_block: int = 0
    reused_blocks: int = 0  # cumulative prefix-cache hits
    alloc_new_blocks: int = 0  # cumulative fresh allocations
    alloc_total_blocks: int = 0


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


def kv_cache_stats(blocks: BlockManager) -> KvCacheStats:
    return KvCacheStats(
        max_num_blocks=blocks.num_blocks, free_num_blocks=blocks.num_free_blocks,
        used_num_blocks=blocks.num_used_blocks, tokens_per_block=blocks.tokens_per_block,
        reused_blocks=blocks.total_reused_blocks, alloc_new_blocks=blocks.total_new_blocks,
        alloc_total_blocks=blocks.total_new_blocks + blocks.total_reused_blocks)

