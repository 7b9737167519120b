#!/usr/bin/env python3
"""Tree verification on the Llama-3.1-8B shape (issue 56's GPU figures), random weights, bf16 and FP8:
what a tree verify step costs against a decode step, and the batch-1 speed-up EAGLE-3 trees buy at
forced acceptance lengths, driven through the executor.

    python benchmarks/speculative/tree_bench.py [--dtypes bf16,fp8] [--nodes 16,32,64] [--batches 1,8,32]
        [--lengths 3,4,5] [--loop-nodes 16] [--loop-depth 5] [--context 512] [--output-len 96] [--other-head]
        [--oracle-nodes 15] [--kernels N] [--step-kernels N] [--draft-kernels N] [--out tree_bench.json]
    python benchmarks/speculative/tree_bench.py --tiny     # the tiny model on the CPU: a smoke run

Per dtype one in-process Executor runs ``decoding_mode eagle`` with random EAGLE-3 heads of the
target's shape (the authors' layout: H = 4096, 32 heads, 8 KV heads, MLP 14336, draft vocabulary
32000, written to a temporary directory), max_draft_len 64, so its runner captures the tree
graphs (engine/executor/prefill_graphs.py: one per token bucket up to max batch x 65 tokens, the
engine's max_num_tokens, so the loop's prompt is prefilled in chunks of that many) and taps the
heads' three layers inside every graph (engine/executor/layer_taps.py). Sections:

1. ``verify``: ModelRunner.forward of a batch of B sequences each verifying a random tree of n nodes
   (parent of node i uniform among the root and nodes < i; rotary positions by depth, consecutive
   KV slots, logits at the root and every node, as Executor._forward_batch packs a tree row) plus
   the argmax read back, against a plain decode step of the same B sequences, both at ``--context``
   tokens of context: median wall ms (benchmarks/speculative/speculative_bench.py time_step).
   Goal: 64 nodes at batch 1 <= 1.3x a decode step.
2. ``loop``: batch 1, greedy, through the executor, every step a tree verify step over a
   ``--loop-nodes`` static tree (a chain of ``--loop-depth`` 5 plus siblings), drafted by the oracle
   (``OracleTrees``: no model run, what tree verification alone costs; ``--oracle-nodes``: also
   oracle trees of other sizes, after the EAGLE-3 rows) and then by the executor's
   own EAGLE-3 heads (the draft layer with its KV cache, its cost included; ``--other-head``: then
   the same heads in the other precision, "EAGLE-3 FP8 head" on a bf16 target), with acceptance forced: after the drafter ran, the tree's first-child chain gets the
   target's own continuation to depth L - 1 and every other node a wrong token, so each step
   accepts L - 1 drafts and emits L tokens. The continuation is plain greedy decoding's; on random
   weights a tree step and a decode step may round a near-tie differently, so the run is repeated
   (off the clock) with its own output as the continuation until they agree (at least 2 runs, the
   first a warm-up; at most tree_runs.MAX_FORCED_RUNS, 8: each run moves the first difference on); the
   table says whether they did, where each run left its continuation ("left at"), and the acceptance
   length measured (a run that left its continuation at position p accepts little after p: its chain
   holds another context's tokens). Which near-ties a tree step rounds away depends on its products:
   17-128-token trees take the skinny kernel or the library product by a load-time timing
   (kernels/wide_rows.py), printed per shape at load ("-> kernel" / "-> library", cached choices too).
   Per run also the median and slowest step (the executor's iteration history) and Python's full
   GC collections inside it, so one pause reads apart from a slower loop. Tokens/s from the request's first
   to last token against plain decoding's on the same engine (the proposer detached: the plain,
   overlapped loop); and, robust to such misses, the speed-up at exactly the forced length: L tokens
   per mean step of the loop against plain decoding's step. Goal: >= 2.5x at acceptance length 4.
   Where a run's ids leave plain decoding's, the table names the first such position and, from plain
   decoding's own logits there (a second plain run returning them, off the clock), the gap between
   plain's token and the run's and the logits' spread: a gap under NEAR_TIE of the spread is a
   near-tie that differing kernels round either way (random weights' logits are nearly flat), a
   larger one a bug to look at. (On the CPU in float32, --tiny, the ids equal plain decoding's, as
   tests/executor/test_speculative_eagle3.py asserts against transformers.)
   Then for each ``--batches`` size B > 1: B different prompts at once (the loop's and B - 1 others),
   plain, oracle and EAGLE-3 at the middle forced length, each row forced to its own continuation
   from this batch's plain run (batch B's decode may round a near-tie otherwise than batch 1's; one
   shared prompt would hide a step that verified a row against another row's logits), repeated as
   at batch 1: each step's drafting for all B sequences is one replay of a batched
   window (eagle3_graphs.py), so EAGLE-3's step minus the oracle's (drafting) should stay near batch
   1's, not B times it (rows with ``batch`` B; the drafter column says "x B").
   With ``--step-kernels N``: for the oracle and for EAGLE-3 one more forced run with the executor's
   phases timed (``PHASES``: ms a step of drafting, schedule, packing, the forward's launch, the
   verify read that waits for it, finishing, emitting), then one under torch.profiler: per step the
   GPU us and launches against the step's ms (the rest: host work, sync gaps) and the N costliest
   kernels. (``--kernels N`` does the same for the verify section's first batch: the tree
   step's and the decode step's kernels and the ones the tree step spends most more time in.)
   Last, on CUDA, the GPU time of one replay of each drafting window the loop used (the rest of
   EAGLE-3's step over the oracle's is host work and the gaps its synchronisations leave) and, with
   ``--draft-kernels N``, the one-slot replay's N costliest kernels.

This file: the engine and its random heads, the command line, the sections' dispatch and the tables.
Beside it: tree_verify.py (section 1), tree_loop.py (section 2), tree_runs.py (the forced runs, the
oracle, the timed runs' profile) and tree_kernels.py (the kernel tables and the executor's phases).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (MODELS, command_line, device_name, free_device_memory, git_commit,  # noqa: E402
                               int_list, print_table, utc_now, write_config_only_engine)
from benchmarks.speculative.tree_loop import bench_loop, difference_text, left_text  # noqa: E402
from benchmarks.speculative.tree_runs import LOOP_DEPTH, loop_choices  # noqa: E402
from benchmarks.speculative.tree_verify import bench_verify  # noqa: E402

DTYPES = {"bf16": None, "fp8": "fp8"}
GOAL_TREE_RATIO = 1.3  # 64 nodes at batch 1 against a decode step
GOAL_SPEEDUP = 2.5  # batch 1 at acceptance length 4


def save_random_eagle3(directory: str, model: dict, draft_vocab: int, device: str) -> str:
    """Random EAGLE-3 heads of ``model``'s shape in the authors' layout (bf16 on disk)."""
    import torch
    from safetensors.torch import save_file

    h, heads, kv = model["hidden_size"], model["num_heads"], model["num_kv_heads"]
    d, inter = model["head_dim"], model["intermediate_size"]
    g = torch.Generator(device=device).manual_seed(0)

    def r(*shape):
        return (torch.randn(*shape, generator=g, device=device) * shape[-1] ** -0.5).to(torch.bfloat16).cpu()

    def ones():
        return torch.ones(h, dtype=torch.bfloat16)

    state = {"fc.weight": r(h, 3 * h), "norm.weight": ones(), "midlayer.hidden_norm.weight": ones(),
             "midlayer.input_layernorm.weight": ones(), "midlayer.post_attention_layernorm.weight": ones(),
             "midlayer.self_attn.q_proj.weight": r(heads * d, 2 * h), "midlayer.self_attn.k_proj.weight": r(kv * d, 2 * h),
             "midlayer.self_attn.v_proj.weight": r(kv * d, 2 * h), "midlayer.self_attn.o_proj.weight": r(h, heads * d),
             "midlayer.mlp.gate_proj.weight": r(inter, h), "midlayer.mlp.up_proj.weight": r(inter, h),
             "midlayer.mlp.down_proj.weight": r(h, inter), "lm_head.weight": r(draft_vocab, h),
             "d2t": torch.zeros(draft_vocab, dtype=torch.int64)}
    Path(directory).mkdir(parents=True, exist_ok=True)
    (Path(directory) / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLMEagle3"], "hidden_size": h, "intermediate_size": inter,
        "num_attention_heads": heads, "num_key_value_heads": kv, "head_dim": d, "rms_norm_eps": 1e-5,
        "rope_theta": model.get("rope_theta", 10000.0), "vocab_size": model["vocab_size"],
        "draft_vocab_size": draft_vocab, "num_hidden_layers": 1}))
    save_file(state, str(Path(directory) / "model.safetensors"))
    return directory


def wide_entry(report: dict) -> dict:
    """A wide-row timing report (kernels/wide_rows.py) -> what the table keeps: the timings (a cached
    choice's are those of the load that timed it), whether it was cached, and the product the tree
    steps of that many rows use ("kernel" or "library"), as choose_wide_variants decides."""
    from kernels.wide_rows import takes_kernel

    return {"kernel_us": round(report["kernel_us"], 1), "library_us": round(report["library_us"], 1),
            "tiling": report["tiling"], "cached": bool(report.get("cached")),
            "uses": "kernel" if takes_kernel(report) else "library"}


def start(args, label: str):
    from engine.executor.executor import Executor, ExecutorConfig, SpeculativeConfig
    from engine.executor.load_phases import load_phase

    free_device_memory(args.device)
    started = time.perf_counter()
    model = MODELS[args.model]
    with load_phase("EAGLE-3 heads written", args.device):
        heads = args.heads_dir = save_random_eagle3(tempfile.mkdtemp(prefix="eagle3-"), model, args.draft_vocab,
                                                    args.device)
    engine_dir = write_config_only_engine(args.model, args.model_dtype, args.max_batch_size, args.max_seq_len,
                                          args.max_batch_size * 65, args.tokens_per_block, DTYPES[label])
    spec = SpeculativeConfig("eagle", max_draft_len=64, eagle_model_path=heads,
                             eagle_choices=loop_choices(args.loop_nodes, args.loop_depth))
    # max_num_tokens is max_batch x 65 (the largest tree step), so the graphs' buckets stop there; a prompt
    # longer than that (the loop's --context at batch 1) is prefilled in chunks of it.
    config = ExecutorConfig(max_tokens_in_paged_kv_cache=args.kv_tokens, enable_kv_cache_reuse=True,
                            enable_chunked_context=True, speculative=spec)
    executor = Executor(engine_dir, config, device=args.device)
    prefill = getattr(executor.runner, "prefill_graphs", None)
    # Per weight shape and padded row count, the skinny kernel's and the library product's microseconds
    # (kernels/wide_rows.py) and the product the tree steps take (the kernel where it took at most
    # WIDE_MIN_GAIN of the library's time). A choice read from the choice cache (kernels/choice_cache.py)
    # says "cached": its timings are the load's that made it.
    wide = {"x".join(map(str, key[1:])): {rows: wide_entry(r) for rows, r in report.items()}
            for key, report in (getattr(executor.runner, "gemm_choices", None) or {}).items() if key[0] == "wide"}
    info = {"load_seconds": round(time.perf_counter() - started, 1),
            "tree_graph_buckets": [] if prefill is None else sorted(prefill.tree_graphs), "wide_rows": wide,
            "kernel_choice_cache": getattr(executor.runner, "choice_cache_counts", None)}
    print(f"    load {info['load_seconds']} s; tree graph buckets {info['tree_graph_buckets']}", flush=True)
    for shape, rows in wide.items():
        print(f"    {shape}: " + ", ".join(f"{m} rows {'cached ' if r['cached'] else ''}kernel {r['kernel_us']} us / "
                                           f"library {r['library_us']} us -> {r['uses']}" for m, r in rows.items()),
              flush=True)
    return executor, info


def markdown(results: dict) -> str:
    lines = [f"`{results['command']}` on {results['device']}, {results['date']}, commit {results['commit']}", ""]
    lines += ["| dtype | batch | nodes (depth) | tokens | path | tree verify ms | decode ms | ratio |",
              "|---|---:|---:|---:|---|---:|---:|---:|"]
    for label, entry in results["dtypes"].items():
        for r in entry.get("verify", []):
            lines.append(f"| {label} | {r['batch']} | {r['nodes']} ({r['depth']}) | {r['tokens']} | {r['path']} | "
                         f"{r['tree_ms']:.3f} | {r['plain_ms']:.3f} | **{r['ratio']:.2f}x** |")
    lines += ["", "| dtype | drafter | forced acceptance length | measured | tok/s | plain tok/s | speed-up | "
              "step ms (plain) | speed-up at the forced length | ids = continuation (runs) / = plain | "
              "first difference from plain | step ms median / max (full GCs) |",
              "|---|---|---:|---:|---:|---:|---:|---:|---:|---|---|---|"]
    for label, entry in results["dtypes"].items():
        loop = entry.get("loop")
        for r in (loop or {}).get("rows", []):
            drafter = r["drafter"] + (f" x {r['batch']}" if r.get("batch", 1) > 1 else "")
            lines.append(f"| {label} | {drafter} | {r['forced_length']} | {r['measured_length']:.2f} | "
                         f"{r['tok_s']:.1f} | {r['plain_tok_s']:.1f} | **{r['speedup']:.2f}x** | {r['step_ms']:.2f} "
                         f"({1e3 / r['plain_tok_s']:.2f}) | {r['speedup_at_length']:.2f}x | "
                         f"{'yes' if r['ids_agree'] else 'no'} ({r['runs']}{left_text(r.get('left_at', []))}) / "
                         f"{'yes' if r['ids_equal_plain'] else 'no'} | "
                         f"{difference_text(r.get('first_difference'))} | {steps_cell(r)} |")
    return "\n".join(lines)


def steps_cell(row: dict) -> str:
    if row.get("median_step_ms") is None:
        return "-"
    return f"{row['median_step_ms']:.2f} / {row['max_step_ms']:.2f} ({row['gc_full']})"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp8")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (float32): a smoke run")
    parser.add_argument("--device", default=None)
    parser.add_argument("--sections", default="verify,loop")
    parser.add_argument("--nodes", default="16,32,64")
    parser.add_argument("--batches", default="1,8,32")
    parser.add_argument("--lengths", default="3,4,5")
    parser.add_argument("--loop-nodes", type=int, default=16)
    parser.add_argument("--loop-depth", type=int, default=LOOP_DEPTH,
                        help="the loop tree's chain; forced length L needs L - 1 (EAGLE-3: a forward a depth)")
    parser.add_argument("--context", type=int, default=None, help="tokens of context (512; --tiny: 24)")
    parser.add_argument("--output-len", type=int, default=None, help="tokens per request (96; --tiny: 12)")
    parser.add_argument("--draft-vocab", type=int, default=32000)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--draft-kernels", type=int, default=0,
                        help="loop, CUDA: also list this many of the one-slot drafting replay's costliest kernels")
    parser.add_argument("--oracle-nodes", default="",
                        help="loop, batch 1: also oracle trees of these sizes (the loop tree's chain plus siblings)")
    parser.add_argument("--kernels", type=int, default=0,
                        help="verify, CUDA: the first batch's tree and decode steps' N costliest kernels, launches "
                             "a step, and the kernels the tree step spends most more time in")
    parser.add_argument("--step-kernels", type=int, default=0,
                        help="loop, CUDA: one more forced run of the oracle and of EAGLE-3 under the profiler: GPU us "
                             "and launches a step against its wall ms, and the N costliest kernels a step")
    parser.add_argument("--other-head", action="store_true",
                        help="loop, batch 1: also EAGLE-3 with the heads' products in the other precision (FP8 for a "
                             "bf16 target, whose default head is bf16; bf16 for an FP8 target)")
    parser.add_argument("--out", default="tree_bench.json")
    parser.add_argument("--markdown", default=None)
    args = parser.parse_args(argv)
    args.nodes, args.batches, args.lengths = int_list(args.nodes), int_list(args.batches), int_list(args.lengths)
    args.oracle_nodes = int_list(args.oracle_nodes) if args.oracle_nodes else []
    args.sections = args.sections.split(",")
    args.model_dtype = "bfloat16"
    if args.tiny:
        args.model, args.model_dtype, args.device = "tiny", "float32", args.device or "cpu"
        args.dtypes, args.draft_vocab = "bf16", 64
        args.output_len = args.output_len or 12
        args.context = args.context or 24
        args.repeat, args.warmup = 2, 1
    args.device = args.device or "cuda"
    args.context = args.context or 512
    args.output_len = args.output_len or 96
    args.max_batch_size = max(args.batches)
    args.max_seq_len = args.context + args.output_len + 128
    args.kv_tokens = args.max_batch_size * args.max_seq_len + 4096
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault("TRITONLLM_LOAD_LOG", "1")  # engine/executor/load_phases.py: a line per load phase
    results = {"command": command_line(__file__, argv), "device": device_name(args.device), "date": utc_now(),
               "commit": git_commit(), "dtypes": {}}
    for label in args.dtypes.split(","):
        print(f"--- {label}", flush=True)
        executor, info = start(args, label)
        entry = results["dtypes"][label] = {"engine": info}
        try:
            for section in args.sections:  # in the order asked; the JSON after each
                args.save = lambda partial, section=section: Path(args.out).write_text(json.dumps(
                    dict(results, partial={label: {section: partial}}), indent=1))
                entry[section] = {"verify": bench_verify, "loop": bench_loop}[section](executor, args)
                Path(args.out).write_text(json.dumps(results, indent=1))
        finally:
            executor.shutdown()
            del executor
    print_table(markdown(results), args.markdown)
    return results


if __name__ == "__main__":
    main()
