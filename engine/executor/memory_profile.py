"""How much device memory a step needs beside the KV pool, measured before the pool is allocated.

Why: the pool takes ``kv_cache_free_gpu_mem_fraction`` of the free memory, and what is left must
hold every step's temporaries (a max_num_tokens prefill's activations, a MoE layer's sorted rows,
the logits of max_batch_size rows and the sampler's sort of them) and the CUDA graphs' private
pools. With 61 GB of bf16 weights (Qwen3-30B-A3B's shape on an 80 GB H100) the 10% left at 0.9
is ~1.7 GB: an engine of max_batch_size 768 ran out of memory in its first prefill step, and the
request failed (benchmarks/results/kernels.md, issue 31).

How (``measure_step_memory``): with a provisional pool just large enough, one eager step of
max_num_tokens prompt tokens spread over max_batch_size sequences (so its logits have
max_batch_size rows), then the sampler's worst case on those logits
(engine/executor/sampler.py ``worst_case_metadata``), each peak of allocated memory taken above
the start. ``reserve_bytes`` turns that into what the pool leaves free: the step's peak for the
caching allocator, plus, with CUDA graphs, the forward's activations again (the graphs captured
later keep a private pool of about one max_num_tokens forward; logits are computed outside them),
plus the memory the step made the driver take outside the caching allocator (the kernels' code
and local-memory pool, this thread's cuBLAS handle) twice over (the graphs and later steps load
more kernel variants, and the executor's loop thread gets a cuBLAS handle of its own), plus a
margin for the allocator's fragmentation. The pool then takes ``min(fraction * free, free -
reserve)``: a fraction that leaves enough keeps its pool, a large model's pool shrinks to what its
steps leave.

One GPU only (a leader-mode step runs on every rank together; those keep the fraction alone).
"""
from __future__ import annotations

import sys
from dataclasses import dataclass

import torch

from engine.executor.device_memory import free_device_bytes, is_capped
from engine.executor.executor_config import ExecutorConfig, ExecutorConfigError
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.sampler import sample, worst_case_metadata

# The caching allocator rounds and splits blocks: what a step needs is not all it can get.
FRAGMENTATION_MARGIN_BYTES = 512 << 20


def profile_batch(max_num_tokens: int, max_batch_size: int, max_seq_len: int, tokens_per_block: int,
                  logits_rows: int | None = None, vocab_size: int = 1000) -> ForwardBatch:
    """max_num_tokens prompt tokens (fewer when max_batch_size sequences of max_seq_len hold fewer)
    in max_batch_size fresh sequences, each on blocks of its own, ids below ``vocab_size``; a logits
    row for every sequence, or for the last ``logits_rows`` tokens when that is more (speculative
    verify steps score every draft)."""
    per_seq = max(1, min(max_num_tokens // max_batch_size, max_seq_len))
    lens = [per_seq] * max_batch_size
    lens[0] = max(1, min(max_seq_len, max_num_tokens - per_seq * (max_batch_size - 1)))
    token_ids, positions, tables, ends, next_block = [], [], [], [], 0
    for length in lens:
        token_ids += [(7 * p + 3) % min(vocab_size, 1000) for p in range(length)]
        positions += range(length)
        blocks = -(-length // tokens_per_block)
        tables.append(list(range(next_block, next_block + blocks)))
        next_block += blocks
        ends.append(len(token_ids) - 1)
    if logits_rows is not None and logits_rows > len(ends):
        ends = list(range(max(0, len(token_ids) - logits_rows), len(token_ids)))
    return ForwardBatch(token_ids, positions, lens, list(lens), tables, ends)


@dataclass(frozen=True)
class StepMemory:
    """Peaks of one worst-case step, in bytes above what was allocated before it."""

    forward: int  # the forward, its logits included
    logits: int  # the logits alone (logits_rows x vocab float32)
    logits_rows: int
    step: int  # the whole step: the forward or the sampler over its logits, whichever peaked higher
    outside_allocator: int  # what the driver took beside the caching allocator while the step ran


def measure_step_memory(runner, *, max_num_tokens: int, max_batch_size: int, kv_cache_dtype: str | None,
                        logits_rows: int | None = None) -> StepMemory:
    """One eager worst-case step (profile_batch, then the sampler); the runner is left without a KV
    pool."""
    device = runner.device
    batch = profile_batch(max_num_tokens, max_batch_size, runner.build_config.max_seq_len, runner.tokens_per_block,
                          logits_rows, runner.vocab_size)
    runner.allocate_kv_cache(sum(len(t) for t in batch.block_tables), kv_cache_dtype)
    try:
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        start = torch.cuda.memory_allocated(device)
        driver_before = _outside_allocator(device)
        logits = runner.forward(batch)
        torch.cuda.synchronize(device)
        forward = torch.cuda.max_memory_allocated(device) - start
        torch.cuda.reset_peak_memory_stats(device)
        sample(logits, worst_case_metadata(logits.shape[0], logits.shape[1], logits.device))
        torch.cuda.synchronize(device)
        sampler = torch.cuda.max_memory_allocated(device) - start
        outside = max(0, _outside_allocator(device) - driver_before)
        return StepMemory(forward=forward, logits=logits.numel() * logits.element_size(), logits_rows=logits.shape[0],
                          step=max(forward, sampler), outside_allocator=outside)
    finally:
        runner.kv_cache = None
        torch.cuda.empty_cache()


def _outside_allocator(device) -> int:
    """Device memory in use that the caching allocator does not hold (the driver's, other libraries')."""
    free, total = torch.cuda.mem_get_info(device)
    return total - free - torch.cuda.memory_reserved(device)


def reserve_bytes(memory: StepMemory, *, cuda_graphs: bool, count_outside: bool = True) -> int:
    """Memory the KV pool leaves free for such steps (module docstring). ``count_outside=False``
    under a per-process cap (engine/executor/device_memory.py): the cap bounds the caching
    allocator alone, and the driver's memory beside it is not taken from it."""
    graph_pool = memory.forward - memory.logits if cuda_graphs else 0
    outside = 2 * memory.outside_allocator if count_outside else 0
    return memory.step + graph_pool + outside + FRAGMENTATION_MARGIN_BYTES


def step_memory_reserve(runner, config: ExecutorConfig, *, max_num_tokens: int, max_batch_size: int) -> int:
    """Bytes the executor's KV pool must leave free for its steps: measured on one CUDA device (and
    printed), 0 elsewhere (leader mode keeps the fraction alone). ExecutorConfigError when even a
    step does not fit beside the weights."""
    if not isinstance(runner, ModelRunner) or runner.device.type != "cuda":
        return 0
    spec = config.speculative  # a verify step scores each sequence's drafts too
    logits_rows = max_batch_size * (1 + (spec.max_draft_len if spec is not None else 0))
    try:
        memory = measure_step_memory(runner, max_num_tokens=max_num_tokens, max_batch_size=max_batch_size,
                                     kv_cache_dtype=config.kv_cache_dtype,
                                     logits_rows=min(logits_rows, max_num_tokens))
    except torch.OutOfMemoryError:
        free, total = free_device_bytes(runner.device), torch.cuda.mem_get_info(runner.device)[1]
        raise ExecutorConfigError(
            f"a step of max_num_tokens={max_num_tokens} tokens over max_batch_size={max_batch_size} "
            f"sequences does not fit in the {free / 2**30:.1f} GiB the weights leave free of {total / 2**30:.1f} "
            f"GiB, before any KV cache; lower max_num_tokens or max_batch_size") from None
    reserve = reserve_bytes(memory, cuda_graphs=True, count_outside=not is_capped(runner.device))
    print(f"[executor] a worst-case step ({max_num_tokens} tokens, {memory.logits_rows} sampled rows) "
          f"peaks at {memory.step / 2**30:.2f} GiB (its forward {memory.forward / 2**30:.2f}; outside the "
          f"caching allocator {memory.outside_allocator / 2**30:.2f}); the KV pool "
          f"leaves at least {reserve / 2**30:.2f} GiB free", file=sys.stderr, flush=True)
    return reserve
