"""Hybrid Mamba-2 engine (Nemotron-H-8B shape) beside an attention model of about its size (Llama-3.1-8B), one GPU.

    python benchmarks/engine/hybrid_bench.py --out hybrid.json --results-md benchmarks/results/engine.md

Sections (``--sections``, all by default):

1. ``decode``: batch-1 greedy decode through the runner (decode CUDA graphs), tokens/s against the
   model's weight-read roofline: the bytes one step must move (every weight but the embedding
   table, one embedding row, each Mamba layer's state read and written, the attention layers' KV
   so far) over the bandwidth of a device-to-device copy.
2. ``offline``: output tokens/s through the in-flight-batching executor, every request enqueued at
   once, at input/output lengths 128/128 and 1000/1000, for each model.
3. ``capacity``: how many requests of ``--long-context`` tokens (32k by default) each model's
   executor holds at once on this GPU: the KV blocks and (hybrid) state slots it allocated at start,
   with ``--capacity-batch`` as max_batch_size, divided by what one such request needs. The memory
   advantage of the hybrid, in requests.

Random weights of the real shapes (benchmarks/common.py MODELS: ``nemotron_h_8b``, ``llama8b``; also
``jamba_mini``, Jamba-1.5-Mini's Mamba-1 / MoE shape, 104 GB in bf16), made on the GPU at load.
``--device cpu --models nemotron_h_tiny,tiny`` (or ``jamba_tiny``) is a smoke run. ``--quantization fp8``
gives every engine FP8 weights (per-channel, as ``engine.build --quantization fp8``): the Mamba-2
hybrids' in_proj/out_proj and attention/MLP projections, Llama's linears; the roofline counts the
bytes the parameters really hold.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (command_line, copy_bandwidth, device_name, free_device_memory, git_commit,  # noqa: E402
                               utc_now, write_config_only_engine)
from benchmarks.engine.engine_bench import bench_offline  # noqa: E402
from engine.executor.executor import Executor, ExecutorConfig  # noqa: E402
from engine.executor.runner import ForwardBatch, ModelRunner  # noqa: E402

SECTIONS = ["decode", "offline", "capacity"]
GOALS = {"hybrid_roofline_fraction": 0.70}  # issue 58: batch-1 decode of the Nemotron-H-8B shape


def step_bytes(runner: ModelRunner, context: int) -> int:
    """What one batch-1 decode step must move: weights (one embedding row of the table; of routed
    experts the top_k a row picks), each Mamba layer's state read and written, and ``context``
    tokens of the attention layers' KV."""
    model = runner.model
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    embed = model.embed_tokens.weight
    if not runner.model_config.tie_word_embeddings:  # the table is gathered, not streamed
        weights -= embed.numel() * embed.element_size() - embed.shape[1] * embed.element_size()
    for module in model.modules():  # routed experts (Jamba): one row reads top_k of them
        if hasattr(module, "top_k") and hasattr(module, "gate_up_proj"):
            experts = sum(p.numel() * p.element_size() for p in (module.gate_up_proj, module.down_proj))
            weights -= experts - experts * module.top_k // module.gate_up_proj.shape[0]
    state = 2 * model.state_slot_bytes() if getattr(model, "uses_state_cache", False) else 0
    return weights + state + context * runner.kv_block_bytes // runner.tokens_per_block


def bench_decode(args, model: str, bandwidth: float, prompt_len: int = 128, steps: int = 256) -> dict:
    engine_dir = write_config_only_engine(model, args.dtype, max_batch_size=8, max_seq_len=prompt_len + steps + 64,
                                          max_num_tokens=1024, tokens_per_block=32, quantization=args.quantization)
    runner = ModelRunner(engine_dir, device=args.device)
    hybrid = getattr(runner.model, "uses_state_cache", False)
    if hybrid:
        runner.allocate_state_cache(8)
    runner.allocate_kv_cache(runner.num_kv_blocks_for(max_tokens=4096))
    runner.capture_cuda_graphs()
    runner.warmup()
    page, slots = runner.tokens_per_block, ([0] if hybrid else None)
    table = list(range(1, -(-(prompt_len + steps + 1) // page) + 1))
    prompt = [random.randrange(runner.vocab_size) for _ in range(prompt_len)]
    logits = runner.forward(ForwardBatch(prompt, list(range(prompt_len)), [prompt_len], [prompt_len],
                                         [table[:-(-prompt_len // page)]], [prompt_len - 1], state_slots=slots))
    token = int(logits.argmax(-1).item())
    times = []
    for i in range(steps):
        position = prompt_len + i
        started = time.perf_counter()
        logits = runner.forward(ForwardBatch([token], [position], [1], [position + 1], [table[:position // page + 1]],
                                             [0], state_slots=slots))
        token = int(logits.argmax(-1).item())  # the sampler's sync
        times.append(time.perf_counter() - started)
    steady = times[16:]
    entry = {"model": model, "tok_s": len(steady) / sum(steady), "step_ms_median": statistics.median(steady) * 1e3,
             "graphed": runner.decode_graphs is not None, "bytes_per_step": step_bytes(runner, prompt_len + steps // 2)}
    if bandwidth:
        entry["roofline_tok_s"] = bandwidth / entry["bytes_per_step"]
        entry["roofline_fraction"] = entry["tok_s"] / entry["roofline_tok_s"]
    del runner
    free_device_memory(args.device)
    return entry


def bench_model_offline(args, model: str) -> list[dict]:
    shapes = [tuple(int(v) for v in s.split("x")) for s in args.offline.split(",")]
    longest = max(i + o for i, o, _ in shapes)
    engine_dir = write_config_only_engine(model, args.dtype, max_batch_size=args.max_batch_size,
                                          max_seq_len=longest + 8, max_num_tokens=args.max_num_tokens,
                                          tokens_per_block=32, max_input_len=longest, quantization=args.quantization)
    results: dict = {}
    from benchmarks.common import MODELS

    with Executor(engine_dir, ExecutorConfig(enable_chunked_context=True), device=args.device) as executor:
        bench_offline(results, executor, MODELS[model]["vocab_size"], shapes)
    del executor  # a shut-down executor still holds its runner: the next model's load needs that memory
    free_device_memory(args.device)
    return [dict(row, model=model) for row in results["offline"]]


def _capacity_run(args, model: str, max_batch_size: int) -> dict:
    """Start an executor for requests of --long-context tokens; what it allocated and how many such
    requests it holds at once (KV blocks, and for a hybrid its state slots, whichever runs out first)."""
    context = args.long_context
    engine_dir = write_config_only_engine(model, args.dtype, max_batch_size=max_batch_size,
                                          max_seq_len=context + 128, max_num_tokens=args.max_num_tokens,
                                          tokens_per_block=32, max_input_len=context, quantization=args.quantization)
    with Executor(engine_dir, ExecutorConfig(enable_chunked_context=True), device=args.device) as executor:
        runner = executor.runner
        blocks, page = executor.blocks.num_blocks, executor.blocks.tokens_per_block
        slots = executor.state_slots.num_slots if executor.state_slots is not None else None
        per_request_blocks = -(-(context + 128) // page)
        entry = {"model": model, "context": context, "max_batch_size": max_batch_size, "kv_blocks": blocks,
                 "tokens_per_block": page, "kv_GiB": runner.kv_cache.numel() * runner.kv_cache.element_size() / 2**30,
                 "state_slots": slots,
                 "requests_at_context": min(max_batch_size, blocks // per_request_blocks,
                                            slots if slots is not None else max_batch_size),
                 "request_bytes": per_request_blocks * runner.kv_block_bytes}
        if slots is not None:
            entry["state_GiB"] = slots * runner.model.state_slot_bytes() / 2**30
            entry["request_bytes"] += runner.model.state_slot_bytes()
    del executor, runner  # as in bench_model_offline: the second start needs the first one's memory
    free_device_memory(args.device)
    return entry


def bench_capacity(args, model: str) -> dict:
    """The largest batch of --long-context requests that fits. A hybrid's state slots are allocated
    for max_batch_size up front (capped at half the pool's memory), so a first start at
    --capacity-batch measures the memory the pools get, and a second start at the batch that memory
    holds (state + KV of each request) reports what it really allocated."""
    first = _capacity_run(args, model, args.capacity_batch)
    if first["state_slots"] is None:
        return first
    pool_bytes = (first["kv_GiB"] + first["state_GiB"]) * 2**30
    batch = max(1, min(args.capacity_batch, int(pool_bytes // first["request_bytes"])))
    return dict(_capacity_run(args, model, batch), first_start=first)


def markdown(results: dict) -> str:
    weights = f", {results['quantization']} weights" if results.get("quantization") else ""
    lines = [f"### Hybrid Mamba-2 beside attention ({results['device']}{weights}, {results['date']}, "
             f"commit {results['commit']})",
             "", f"`{results['command']}`", "", "| measurement | model | value |", "|---|---|---|"]
    for d in results.get("decode", []):
        frac = f" = {d['roofline_fraction']:.0%} of {d['roofline_tok_s']:.0f}" if "roofline_fraction" in d else ""
        lines.append(f"| batch-1 decode (graphs: {d['graphed']}) | {d['model']} | {d['tok_s']:.1f} tok/s{frac} |")
    for row in results.get("offline", []):
        lines.append(f"| offline {row['input_len']}/{row['output_len']} x {row['requests']} | {row['model']} | "
                     f"{row['output_tok_s']:.0f} output tok/s |")
    for c in results.get("capacity", []):
        state = f", {c['state_slots']} state slots ({c['state_GiB']:.1f} GiB)" if c.get("state_slots") else ""
        lines.append(f"| requests of {c['context']} tokens held at once | {c['model']} | {c['requests_at_context']} "
                     f"({c['kv_GiB']:.1f} GiB KV{state}) |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--models", default="nemotron_h_8b,llama8b", help="comma-separated benchmarks/common.py MODELS")
    p.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--offline", default="128x128x1024,1000x1000x256", help="inputxoutputxrequests, comma-separated")
    p.add_argument("--max-batch-size", type=int, default=256)
    p.add_argument("--max-num-tokens", type=int, default=8192)
    p.add_argument("--long-context", type=int, default=32768)
    p.add_argument("--capacity-batch", type=int, default=1024, help="max_batch_size of the capacity executors")
    p.add_argument("--quantization", default=None, choices=["fp8"], help="FP8 weights for every model's engine")
    p.add_argument("--out", default="hybrid_bench.json")
    p.add_argument("--results-md", default=None, help="append the markdown table to this file")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    models, sections = args.models.split(","), args.sections.split(",")
    results = {"date": utc_now(), "device": device_name(args.device), "commit": git_commit(),
               "command": command_line("benchmarks/engine/hybrid_bench.py", argv), "quantization": args.quantization}
    bandwidth = copy_bandwidth(args.device)
    results["copy_GBps"] = bandwidth / 1e9
    if "decode" in sections:
        results["decode"] = [bench_decode(args, m, bandwidth) for m in models]
    if "offline" in sections:
        results["offline"] = [row for m in models for row in bench_model_offline(args, m)]
    if "capacity" in sections:
        results["capacity"] = [bench_capacity(args, m) for m in models]
    Path(args.out).write_text(json.dumps(results, indent=2))
    table = markdown(results)
    print(table)
    if args.results_md:
        with open(args.results_md, "a") as f:
            f.write("\n" + table)
    return results


if __name__ == "__main__":
    main()
