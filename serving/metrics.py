"""Metric math for the `tensorrt_llm` model: gauge values from executor iteration stats, token
counts and latencies for the histograms. Plain Python; model.py owns the Triton metric objects.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

# (family, description, category label, {label value: stat getter})
GaugeSpec = tuple[str, str, str, dict[str, Callable[[Any], float]]]


def _kv(name: str) -> Callable[[Any], float]:
    return lambda stats: getattr(stats.kv_cache_stats, name)


def _kv_fraction(stats) -> float:
    kv = stats.kv_cache_stats
    return kv.used_num_blocks / kv.max_num_blocks if kv.max_num_blocks > 0 else 0.0


def _stat(name: str) -> Callable[[Any], float]:
    return lambda stats: getattr(stats, name)


def timestamp_seconds(value) -> float | None:
    """Seconds since the epoch from a number (s, or ns when huge) or a
    `%m-%d-%Y %H:%M:%S.%f` string (read as UTC); None for an empty value."""
    if value is None or value == "":
        return None
    if isinstance(value, str):
        from datetime import datetime, timezone

        parsed = datetime.strptime(value, "%m-%d-%Y %H:%M:%S.%f")
        return parsed.replace(tzinfo=timezone.utc).timestamp()
    value = float(value)
    return value / 1e9 if value > 1e14 else value


GAUGES: list[GaugeSpec] = [
    ("nv_trt_llm_request_metrics", "TRT LLM request metrics", "request_type", {
        "active": _stat("num_active_requests"), "max": _stat("max_num_active_requests"),
        "scheduled": _stat("num_scheduled_requests"), "context": _stat("num_context_requests"),
        "waiting": lambda s: s.num_active_requests - s.num_scheduled_requests,
    }),
    ("nv_trt_llm_runtime_memory_metrics", "TRT LLM runtime memory metrics", "memory_type", {
        "cpu": _stat("cpu_mem_usage"), "gpu": _stat("gpu_mem_usage"),
        "pinned": _stat("pinned_mem_usage"),
    }),
    ("nv_trt_llm_kv_cache_block_metrics", "TRT LLM KV cache block metrics", "kv_cache_block_type", {
        "max": _kv("max_num_blocks"), "free": _kv("free_num_blocks"), "used": _kv("used_num_blocks"),
        "tokens_per": _kv("tokens_per_block"), "fraction": _kv_fraction,
    }),
    ("nv_trt_llm_inflight_batcher_metrics", "TRT LLM inflight batcher metrics",
     "inflight_batcher_specific_metric", {
         "total_context_tokens": _stat("num_ctx_tokens"),
         "generation_requests": _stat("num_gen_requests"),
         "micro_batch_id": lambda s: getattr(s, "micro_batch_id", 0) or 0,
         "paused_requests": _stat("num_paused_requests"),
     }),
    # Cumulative over generation_only requests (engine/executor/disaggregated.py); the reference sums
    # its finished requests' kvCacheTransferMS.
    ("nv_trt_llm_disaggregated_serving_metrics", "TRT LLM disaggregated serving metrics", "disaggregated_serving_type", {
        "kv_cache_transfer_ms": _stat("kv_cache_transfer_ms_total"), "request_count": _stat("num_kv_transfers_total"),
    }),
    ("nv_trt_llm_general_metrics", "General TRT LLM metrics", "general_type", {
        "timestamp": lambda s: timestamp_seconds(getattr(s, "timestamp_ns", 0) or s.timestamp), "iteration_counter": _stat("iter"),
    }),
]

# Encoder-decoder engines (beyond the reference's families; TRT-LLM's executor reports them as
# crossKvCacheStats): the cross-KV pool's blocks; absent on decoder-only engines (stat None).
GAUGES.append(("tritonllm_cross_kv_cache_block_metrics", "Cross-attention KV cache blocks (encoder-decoder engines)",
               "kv_cache_block_type", {
                   "max": lambda s: s.cross_kv_cache_stats.max_num_blocks,
                   "free": lambda s: s.cross_kv_cache_stats.free_num_blocks,
                   "used": lambda s: s.cross_kv_cache_stats.used_num_blocks,
                   "tokens_per": lambda s: s.cross_kv_cache_stats.tokens_per_block}))

# LoRA (beyond the reference): adapters resident in the cache (engine/lora/cache.py); absent while
# LoRA is off (the getters then fail and gauge_values skips them).
GAUGES.append(("tritonllm_lora_adapters", "LoRA adapters resident in the adapter cache", "location", {
    "gpu": lambda s: s.lora_cache_stats.adapters_in_gpu, "host": lambda s: s.lora_cache_stats.adapters_in_host,
}))
# Cumulative LoRA counts, published as counters by their growth: cache events by kind, and
# requests per adapter (labelled by lora_name, or "lora_task_id N").
LORA_EVENTS_FAMILY = ("tritonllm_lora_cache_events_total", "LoRA adapter cache events", "event")
LORA_REQUESTS_FAMILY = ("tritonllm_lora_requests_total", "Requests served with each LoRA adapter", "adapter")
LORA_EVENTS = {"gpu_load": "gpu_loads", "gpu_eviction": "gpu_evictions", "gpu_hit": "gpu_hits",
               "host_load": "host_loads", "host_eviction": "host_evictions"}


# Cumulative KV-cache blocks given to requests, by where they came from (beyond the reference): "reused"
# from the prefix cache in device memory (a prompt's blocks another request already computed),
# "host" brought back from the KV host tier (kv_cache_host_memory_bytes; engine/executor/kv_host_tier.py),
# or "new". The sources do not overlap: the prefix-cache hit rate is (reused + host) / (reused + host + new).
KV_BLOCKS_FAMILY = ("tritonllm_kv_cache_blocks_total",
                    "KV cache blocks given to requests: reused from the prefix cache in device memory, "
                    "brought back from host memory, or newly allocated", "source")
# Speculative decoding (beyond the reference), cumulative over every request and draft source (the
# request's draft_input_ids, n-gram lookup, a draft model): draft tokens verified by the target,
# and those it accepted. Their ratio is the acceptance rate; accepted / verify steps the tokens a
# step gains. No label: one series per model.
SPECULATIVE_DRAFT_FAMILY = ("tritonllm_speculative_draft_tokens_total",
                            "Draft tokens verified by the target model (speculative decoding)", None)
SPECULATIVE_ACCEPTED_FAMILY = ("tritonllm_speculative_accepted_draft_tokens_total",
                               "Draft tokens the target model accepted (speculative decoding)", None)
COUNTER_FAMILIES = (KV_BLOCKS_FAMILY, LORA_EVENTS_FAMILY, LORA_REQUESTS_FAMILY, SPECULATIVE_DRAFT_FAMILY,
                    SPECULATIVE_ACCEPTED_FAMILY)


def kv_block_counts(stats: Any) -> dict[tuple[str, str], int]:
    """{(family, source): cumulative count} of KV_BLOCKS_FAMILY; {} where the stats have no such counts.
    The stats' reused_blocks include the onboarded ones; here they are split off as "host"."""
    kv = getattr(stats, "kv_cache_stats", None)
    if kv is None or not hasattr(kv, "reused_blocks") or not hasattr(kv, "alloc_new_blocks"):
        return {}
    onboarded = getattr(kv, "onboarded_blocks", 0)
    family = KV_BLOCKS_FAMILY[0]
    return {(family, "reused"): kv.reused_blocks - onboarded, (family, "host"): onboarded,
            (family, "new"): kv.alloc_new_blocks}


def cumulative_counts(stats: Any) -> dict[tuple[str, str], int]:
    """Every counter published by its growth: kv_block_counts, lora_counts and speculative_counts."""
    return {**kv_block_counts(stats), **lora_counts(stats), **speculative_counts(stats)}


def speculative_counts(stats: Any) -> dict[tuple[str, str], int]:
    """{(family, ""): cumulative count} of the two speculative-decoding counters (label-less);
    {} where the stats have no such counts."""
    if not hasattr(stats, "num_draft_tokens_total"):
        return {}
    return {(SPECULATIVE_DRAFT_FAMILY[0], ""): stats.num_draft_tokens_total,
            (SPECULATIVE_ACCEPTED_FAMILY[0], ""): getattr(stats, "num_accepted_draft_tokens_total", 0)}


def lora_counts(stats: Any) -> dict[tuple[str, str], int]:
    """{(family, label value): cumulative count} of the LoRA counters; {} while LoRA is off."""
    lora = getattr(stats, "lora_cache_stats", None)
    if lora is None:
        return {}
    counts = {(LORA_EVENTS_FAMILY[0], event): getattr(lora, field) for event, field in LORA_EVENTS.items()}
    counts.update({(LORA_REQUESTS_FAMILY[0], name): count for name, count in lora.requests.items()})
    return counts


# With static batching (gpt_model_type v1) this family replaces the in-flight batcher one.
V1_GAUGE: GaugeSpec = ("nv_trt_llm_v1_metrics", "TRT LLM v1-specific metrics", "v1_specific_metric", {
    "total_context_tokens": _stat("num_ctx_tokens"),
    "total_generation_tokens": _stat("num_gen_tokens"),
    "empty_generation_slots": lambda s: getattr(s, "empty_gen_slots", None),
})


def gauge_specs(static_batching: bool = False) -> list[GaugeSpec]:
    """The gauge families a model publishes: in-flight batcher metrics, or v1 ones when static."""
    if not static_batching:
        return GAUGES
    return [V1_GAUGE if spec[0] == "nv_trt_llm_inflight_batcher_metrics" else spec for spec in GAUGES]


TOKEN_LEN_BUCKETS = [10, 50, 100, 500, 1000]
TTFT_BUCKETS = [0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 30.0]
ITL_BUCKETS = [0.001, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0,
               2.5]
# (family, description, response_metric_type label value or None, buckets)
HISTOGRAMS = [
    ("nv_llm_input_token_len", "TRT LLM response metrics", "total_input_tokens", TOKEN_LEN_BUCKETS),
    ("nv_llm_output_token_len", "TRT LLM response metrics", "total_output_tokens",
     TOKEN_LEN_BUCKETS),
    ("nv_llm_time_to_first_token_seconds",
     "Time from a request's arrival at the executor to its first generated token", None,
     TTFT_BUCKETS),
    ("nv_llm_inter_token_latency_seconds",
     "Mean time between consecutive generated tokens of a request", None, ITL_BUCKETS),
]


def gauge_values(stats: Any, static_batching: bool = False) -> dict[tuple[str, str], float]:
    """{(family, label value): value} for every gauge; a missing stat is skipped, not fatal."""
    values = {}
    for family, _, _, getters in gauge_specs(static_batching):
        for label_value, getter in getters.items():
            try:
                value = getter(stats)
            except (AttributeError, ValueError):
                continue
            if value is not None:
                values[(family, label_value)] = float(value)
    return values


class GaugeChanges:
    """What a model sets of its gauges each stats period: the values that differ from those it set
    last. Each set is a round trip from the stub to the server (27 gauges every 100 ms), and an idle
    engine's stats stay put: an idle tensorrt_llm stub spent ~20 ms of CPU a second setting the same
    values again, and tritonserver ~8 ms a second receiving them. A scrape reads what was set last
    either way."""

    def __init__(self):
        self.last: dict[tuple[str, str], float] = {}

    def changed(self, values: dict[tuple[str, str], float]) -> dict[tuple[str, str], float]:
        """The items of ``values`` (``gauge_values``) to set now; remembered as set."""
        changed = {key: value for key, value in values.items() if self.last.get(key) != value}
        self.last.update(changed)
        return changed


def generated_token_count(sequence_lengths: list[int], prompt_len: int, prompt_included: bool) -> int:
    """Tokens generated in one response: per-beam lengths summed, the echoed prompt removed."""
    total = sum(sequence_lengths)
    if prompt_included:
        total -= prompt_len * len(sequence_lengths)
    return max(total, 0)


@dataclass
class RequestLatency:
    """Per executor request: timestamps (seconds, any common clock) of arrival, first and last
    token, and the number of generated tokens, for the TTFT / inter-token histograms."""

    arrival: float
    first_token: float | None = None
    last_token: float | None = None
    num_tokens: int = 0

    def on_tokens(self, now: float, count: int) -> None:
        if count <= 0:
            return
        if self.first_token is None:
            self.first_token = now
        self.last_token = now
        self.num_tokens += count

    def use_perf(self, perf: Any) -> None:
        """Prefer the executor's own timestamps (ns since epoch) when it reports them."""
        arrival = getattr(perf, "arrival_time_ns", 0) or 0
        first = getattr(perf, "first_token_time_ns", 0) or 0
        last = getattr(perf, "last_token_time_ns", 0) or 0
        if arrival and first and first >= arrival:
            self.arrival, self.first_token = arrival / 1e9, first / 1e9
            if last >= first:
                self.last_token = last / 1e9

    def time_to_first_token(self) -> float | None:
        return None if self.first_token is None else max(self.first_token - self.arrival, 0.0)

    def inter_token_latency(self) -> float | None:
        """Mean gap between tokens; None with fewer than two tokens."""
        if self.num_tokens < 2 or self.first_token is None or self.last_token is None:
            return None
        return max(self.last_token - self.first_token, 0.0) / (self.num_tokens - 1)
