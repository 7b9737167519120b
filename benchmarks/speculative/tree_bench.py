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
   first a warm-up; at most 3); the table says whether they did and the acceptance length measured
   (a run that left its continuation at position p accepts nothing after p: 1 token a step there).
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
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (MODELS, command_line, device_name, free_device_memory, git_commit,  # noqa: E402
                               int_list, print_table, utc_now, write_config_only_engine)
from benchmarks.speculative.speculative_bench import (decode_seconds, greedy_request, run_one, step_path,  # noqa: E402
                                                      steps_since, time_step, verify_batch, with_blocks)

DTYPES = {"bf16": None, "fp8": "fp8"}
GOAL_TREE_RATIO = 1.3  # 64 nodes at batch 1 against a decode step
GOAL_SPEEDUP = 2.5  # batch 1 at acceptance length 4
LOOP_DEPTH = 5  # the loop tree's chain (--loop-depth): EAGLE-3 drafts it in as many forwards of its layer
NEAR_TIE = 0.05  # a first difference whose logit gap is under this share of the logits' std: rounding


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


def loop_choices(nodes: int, chain: int = LOOP_DEPTH) -> list[list[int]]:
    """A chain of ``chain`` first children, then siblings breadth-first, ``nodes`` paths in all."""
    choices = [[0] * depth for depth in range(1, chain + 1)]
    for rank in range(1, nodes):
        for depth in range(chain):
            if len(choices) < nodes:
                choices.append([0] * depth + [rank])
    return choices[:nodes]


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
    # (kernels/wide_rows.py); the tree steps take the kernel where it was the faster.
    # A choice read from the choice cache (kernels/choice_cache.py) says "cached" instead of timings.
    wide = {"x".join(map(str, key[1:])): {rows: {"tiling": r["tiling"], "cached": True} if r.get("cached") else
                                          {"kernel_us": round(r["kernel_us"], 1),
                                           "library_us": round(r["library_us"], 1), "tiling": r["tiling"]}
                                          for rows, r in report.items()}
            for key, report in (getattr(executor.runner, "gemm_choices", None) or {}).items() if key[0] == "wide"}
    info = {"load_seconds": round(time.perf_counter() - started, 1),
            "tree_graph_buckets": [] if prefill is None else sorted(prefill.tree_graphs), "wide_rows": wide,
            "kernel_choice_cache": getattr(executor.runner, "choice_cache_counts", None)}
    print(f"    load {info['load_seconds']} s; tree graph buckets {info['tree_graph_buckets']}", flush=True)
    for shape, rows in wide.items():
        print(f"    {shape}: " + ", ".join(f"{m} rows cached {r['tiling']}" if r.get("cached") else
                                           f"{m} rows kernel {r['kernel_us']} us / library {r['library_us']} us"
                                           for m, r in rows.items()), flush=True)
    return executor, info


def tree_batch(tables, context: int, parents: list[int], rng: random.Random, vocab: int, page: int):
    """verify_batch's packing for a tree: per sequence the root (last known token) then the nodes."""
    from engine.executor.tree_batch import chunk_parents, tree_positions

    n = len(parents) + 1
    batch = verify_batch(tables, context, n - 1, rng, vocab, page)
    trees = [chunk_parents(n, parents) for _ in tables]
    batch.tree_parents = trees
    batch.positions = [p for tree in trees for p in tree_positions(context - 1, tree)]
    return batch


def tree_path(runner, batch) -> str:
    prefill = getattr(runner, "prefill_graphs", None)
    if prefill is not None and prefill.tree_buckets and len(batch.token_ids) <= prefill.tree_buckets[-1]:
        return f"tree graph, {prefill.bucket_for(len(batch.token_ids))}-token bucket"
    return "eager" if runner.device.type == "cuda" else "eager (CPU)"


def bench_verify(executor, args) -> list[dict]:
    runner = executor.runner
    page, vocab = runner.tokens_per_block, runner.vocab_size
    blocks_per_seq = -(-(args.context + max(args.nodes)) // page)
    rows = []
    for batch_size in args.batches:
        rng = random.Random(batch_size)

        def measure(tables):
            plain = verify_batch(tables, args.context, 0, rng, vocab, page)
            base = time_step(runner, plain, 10, args.repeat)
            out = []
            for n in args.nodes:
                parents = [rng.randrange(-1, i) for i in range(n)]
                batch = tree_batch(tables, args.context, parents, rng, vocab, page)
                ms = time_step(runner, batch, args.warmup, args.repeat)
                depth = max(len(set(tree_depths(parents))), 1)
                out.append({"batch": batch_size, "nodes": n, "depth": depth, "tokens": len(batch.token_ids),
                            "path": tree_path(runner, batch), "tree_ms": ms, "plain_ms": base,
                            "plain_path": step_path(runner, plain), "ratio": ms / base})
                print(f"    batch {batch_size} nodes {n}: {ms:.3f} ms vs {base:.3f} ({out[-1]['path']})", flush=True)
                if args.kernels and batch_size == args.batches[0]:
                    out[-1]["kernels"] = verify_kernels(runner, plain, batch, args.kernels, f"nodes {n}")
            return out

        rows += with_blocks(executor, batch_size, blocks_per_seq, measure)
    return rows


def profile_kernels(fn, calls: int, cuda: bool) -> tuple[dict, float]:
    """Run fn() ``calls`` times under torch.profiler -> ({kernel name: (us, launches) per call}, wall
    ms per call of the profiled calls). ``cuda``: the CUDA kernels (graph replays' included); else
    (the CPU runner, --tiny: a smoke run of these tables) the torch ops by their self CPU time."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if cuda else [])
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    sync()
    with torch.profiler.profile(activities=activities) as prof:
        started = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        wall = (time.perf_counter() - started) * 1e3 / calls
    kernels = {}
    for e in prof.key_averages():
        spent = e.self_device_time_total if cuda else e.self_cpu_time_total
        if spent > 0:
            us, n = kernels.get(e.key, (0.0, 0.0))
            kernels[e.key] = (us + spent / calls, n + e.count / calls)
    return kernels, wall


def kernel_lines(kernels: dict, top: int, indent: str = "      ") -> list[str]:
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return [f"{indent}{us:8.1f} us  x{n:<5.1f} {name[:110]}" for name, (us, n) in ranked[:top]]


def verify_kernels(runner, plain, tree, top: int, label: str) -> dict:
    """A tree verify step's kernels against a plain decode step's (5 steps each, as time_step runs
    them: forward + the argmax read back): GPU us and launches a step, the ``top`` costliest of each
    and the kernels the tree step spends most MORE time in (by name): where its extra ms go."""
    def step(batch):
        return lambda: runner.forward(batch).argmax(dim=-1).tolist()

    found = {}
    for name, batch in (("decode", plain), ("tree", tree)):
        kernels, wall = profile_kernels(step(batch), 5, runner.device.type == "cuda")
        total, launches = sum(us for us, _ in kernels.values()), sum(n for _, n in kernels.values())
        found[name] = {"gpu_us": total, "launches": launches, "wall_ms": wall, "kernels": kernels}
        print(f"      {label} {name} step: {total:.1f} us GPU in {launches:.0f} launches (wall {wall:.3f} ms "
              f"profiled: {wall * 1e3 - total:.0f} us not in kernels)", flush=True)
        print("\n".join(kernel_lines(kernels, top)), flush=True)
    base = found["decode"]["kernels"]
    extra = {k: (us - base.get(k, (0.0, 0.0))[0], n - base.get(k, (0.0, 0.0))[1])
             for k, (us, n) in found["tree"]["kernels"].items()}
    extra.update({k: (-us, -n) for k, (us, n) in base.items() if k not in found["tree"]["kernels"]})
    print(f"      {label}: tree - decode = {found['tree']['gpu_us'] - found['decode']['gpu_us']:+.1f} us GPU, "
          f"{found['tree']['launches'] - found['decode']['launches']:+.0f} launches; most extra time:", flush=True)
    print("\n".join(kernel_lines(extra, top)), flush=True)
    for entry in found.values():  # (the JSON keeps the top ones)
        entry["kernels"] = [{"kernel": k, "us": us, "per_step": n}
                            for k, (us, n) in sorted(entry["kernels"].items(), key=lambda kv: -kv[1][0])[:top]]
    found["extra"] = [{"kernel": k, "us": us, "per_step": n} for k, (us, n) in
                      sorted(extra.items(), key=lambda kv: -kv[1][0])[:top]]
    return found


def loop_kernels(executor, args, prompt: list[int], truth: list[int], state: dict, drafter: str) -> dict:
    """One more forced run of the loop (off the clock, at the middle forced length) under
    torch.profiler: per decode step the GPU us and launches (the target's graphs, the drafting
    replay, the small kernels between them) against the step's wall ms: the difference is the
    host's share (scheduling, packing, the syncs' idle gaps), and the ``top`` costliest kernels."""
    from engine.executor.request import now_ns

    length = args.lengths[len(args.lengths) // 2]
    state["depth"], state["truth"] = length - 1, {tuple(prompt): truth}
    phases = loop_phases(executor, [greedy_request(prompt, args.output_len)])
    print(f"    {drafter} L={length} host phases a step (ms, no profiler): " + ", ".join(
        f"{name} {ms:.3f}" for name, ms in phases.items()), flush=True)
    since, box = now_ns(), {}
    kernels, wall = profile_kernels(lambda: box.setdefault("r", run_all(
        executor, [greedy_request(prompt, args.output_len)])), 1, executor.runner.device.type == "cuda")
    latencies = [s.iter_latency_ms for s in steps_since(executor, since) if not s.num_ctx_tokens]
    steps = max(len(latencies), 1)
    per_step = {k: (us / steps, n / steps) for k, (us, n) in kernels.items()}
    total, launches = sum(us for us, _ in per_step.values()), sum(n for _, n in per_step.values())
    step_ms = statistics.mean(latencies) if latencies else float("nan")
    note = "" if kernels else " (none seen: on the CPU the executor's thread is not profiled)"
    print(f"    {drafter} L={length} profiled: {len(latencies)} steps, {step_ms:.2f} ms a step (profiler on); per step "
          f"{total:.1f} us GPU in {launches:.0f} launches{note} ({step_ms * 1e3 - total:.0f} us of the step not in "
          f"kernels: host work and sync gaps; the prompt's last chunk's kernels counted in)", flush=True)
    print("\n".join(kernel_lines(per_step, args.step_kernels, "      ")), flush=True)
    return {"drafter": drafter, "forced_length": length, "steps": len(latencies), "step_ms": step_ms,
            "gpu_us": total, "launches": launches, "phases_ms": phases,
            "kernels": [{"kernel": k, "us": us, "per_step": n} for k, (us, n) in
                        sorted(per_step.items(), key=lambda kv: -kv[1][0])[:args.step_kernels]]}


# The executor's phases of a step, in the order a speculative step runs them (Executor._step):
# drafting (EAGLE-3: observe_batch, the replay, the drafts' read: a wait for the replay), the
# schedule, the packing, runner.forward (the prefill graphs' host fill and copies, the replay and
# the logits product's launch: the device's work itself is not waited for), _verify (the argmax's
# read: waits for the forward), _finish_in_flight (acceptance, KV moves, tokens, stop checks), _emit.
PHASES = (("propose", "_propose_drafts"), ("schedule", "scheduler.schedule"), ("pack", "_forward_batch"),
          ("forward launch", "runner.forward"), ("verify (waits for the forward)", "_verify"),
          ("finish", "_finish_in_flight"), ("emit", "_emit"), ("step", "_step"))


def loop_phases(executor, requests: list) -> dict:
    """Run ``requests`` once with each PHASES method of the executor (its instance attribute) timed
    -> {phase: ms per decode step}, decode steps = runner.forward calls without prompt tokens' chunks
    told apart (the prompt is in the prefix cache, its step one among ~25)."""
    owners = {"scheduler.schedule": (executor.scheduler, "schedule"), "runner.forward": (executor.runner, "forward")}
    spent, wrapped = dict.fromkeys((name for _, name in PHASES), 0.0), []
    for _, name in PHASES:
        owner, attr = owners.get(name, (executor, name))
        method = getattr(owner, attr)

        def timed_call(*a, _method=method, _name=name, **k):
            started = time.perf_counter()
            try:
                return _method(*a, **k)
            finally:
                spent[_name] += time.perf_counter() - started
        setattr(owner, attr, timed_call)
        wrapped.append((owner, attr))
    calls = [0]
    forward = executor.runner.forward

    def counted(*a, **k):
        calls[0] += 1
        return forward(*a, **k)
    executor.runner.forward = counted
    try:
        run_all(executor, requests)
    finally:
        del executor.runner.forward
        for owner, attr in wrapped:
            if attr in vars(owner):
                delattr(owner, attr)
    return {label: round(spent[name] * 1e3 / max(calls[0], 1), 3) for label, name in PHASES}


def tree_depths(parents: list[int]) -> list[int]:
    depths = []
    for p in parents:
        depths.append(1 if p < 0 else depths[p] + 1)
    return depths


def force_acceptance(proposer, state: dict, vocab: int) -> None:
    """After the drafter ran: the tree's first-child chain takes the sequence's truth to depth
    state["depth"], every other node a wrong token. state["truth"]: one list (prompt + continuation)
    for every sequence, or a dict {tuple(prompt): prompt + continuation}, a truth per prompt (a batch
    of different prompts: each row is forced to its own continuation, not row 0's; a prompt not in
    it keeps the drafter's tokens). Past its truth's end a node keeps the drafter's token too."""
    propose = proposer.propose
    memo = {}  # seq_id -> (the truths it was looked up in, its truth): one prompt lookup a sequence

    def truth_of(seq) -> list[int]:
        truths = state["truth"]
        if isinstance(truths, list):
            return truths
        hit = memo.get(seq.seq_id)
        if hit is None or hit[0] is not truths:
            hit = memo[seq.seq_id] = (truths, truths.get(tuple(seq.token_ids[:seq.num_prompt_tokens]), []))
        return hit[1]

    def forced(seqs, max_draft_len):
        drafts = propose(seqs, max_draft_len)
        depth_limit = state["depth"]
        for seq, tokens in zip(seqs, drafts):
            truth = truth_of(seq)
            chain, extended, depth = {-1}, set(), {-1: 0}
            for i, parent in enumerate(seq.draft_parents or []):
                depth[i] = depth[parent] + 1
                at = len(seq.token_ids) + depth[i] - 1
                if at >= len(truth):
                    continue
                true = truth[at]
                if parent in chain and parent not in extended and depth[i] <= depth_limit:
                    extended.add(parent)
                    chain.add(i)
                    tokens[i] = true
                elif tokens[i] == true:
                    tokens[i] = (true + 1) % vocab
        return drafts
    proposer.propose = forced


class OracleTrees:
    """A proposer that only drafts: the loop tree's shape with placeholder tokens (force_acceptance
    fills them), no model run. Its loop shows what tree verification alone costs in the executor."""

    def __init__(self, nodes: int, chain: int = LOOP_DEPTH):
        from engine.executor.speculative.tree import shape_from_choices

        shape = shape_from_choices(loop_choices(nodes, chain), field="eagle_choices")
        self.parents = [p - 1 for p in shape.parents[1:]]

    def propose(self, seqs, max_draft_len: int) -> list[list[int]]:
        from engine.executor.speculative.proposer import draft_room

        drafts = []
        for seq in seqs:
            room = draft_room(seq, max_draft_len)
            seq.draft_parents = self.parents[:room] if room else None
            drafts.append([0] * len(self.parents[:room]))
        return drafts

    def release(self, seq) -> None:
        pass


def first_difference(ids: list[int], plain_ids: list[int], logits) -> dict | None:
    """Where ``ids`` first leave plain decoding's ``plain_ids`` (after that the contexts differ):
    position, plain's logit gap between its token and the run's there (>= 0), the top-2 margin, the
    logits' std and whether the gap is a near-tie (under NEAR_TIE of the std). None: no difference."""
    at = next((i for i, (a, b) in enumerate(zip(ids, plain_ids)) if a != b), None)
    if at is None or logits is None or at >= logits.shape[0]:
        return None if at is None else {"position": at}
    row = logits[at].float()
    top = row.topk(2).values
    gap, std = (row[plain_ids[at]] - row[ids[at]]).item(), row.std().item()
    return {"position": at, "gap": gap, "margin": (top[0] - top[1]).item(), "logit_std": std,
            "near_tie": gap <= NEAR_TIE * std}


def difference_text(diff: dict | None) -> str:
    if diff is None:
        return "none"
    if "gap" not in diff:
        return f"at {diff['position']}"
    return (f"at {diff['position']}: gap {diff['gap']:.3g} (std {diff['logit_std']:.3g}): "
            f"{'near-tie' if diff['near_tie'] else 'NOT a near-tie'}")


class GcPauses:
    """Python's full (generation 2) collections while a run is timed: how many and their ms. A full
    collection walks every tracked object (~200k in a loaded executor: ~85 ms on the CPU runner of
    2026-11-29), a pause inside one step; a collection is made just before each run so the garbage
    of the runs before is not collected on its clock."""

    def __init__(self):
        self.count, self.ms, self._started = 0, 0.0, None

    def __call__(self, phase: str, info: dict) -> None:
        if info.get("generation") != 2:
            return
        if phase == "start":
            self._started = time.perf_counter()
        elif self._started is not None:
            self.count += 1
            self.ms += (time.perf_counter() - self._started) * 1e3
            self._started = None

    def __enter__(self) -> "GcPauses":
        gc.collect()
        gc.callbacks.append(self)
        return self

    def __exit__(self, *exc) -> None:
        gc.callbacks.remove(self)


def timed(executor, requests: list) -> tuple[list, dict]:
    """Run ``requests`` together -> (their results, the run's profile: median and slowest step ms
    from the executor's iteration history (decode steps only), the slowest step's index, the steps
    over 1.5x the median and their ms beyond it, full GC collections and their ms inside the run):
    one slow step (a pause) reads apart from a slower loop."""
    from engine.executor.request import now_ns

    since = now_ns()
    with GcPauses() as pauses:
        results = run_all(executor, requests)
    latencies = [s.iter_latency_ms for s in steps_since(executor, since) if not s.num_ctx_tokens]
    slowest = max(range(len(latencies)), key=latencies.__getitem__) if latencies else None
    median = statistics.median(latencies) if latencies else None
    slow = [ms - median for ms in latencies if ms > 1.5 * median] if latencies else []
    return results, {"median_step_ms": median, "max_step_ms": None if slowest is None else latencies[slowest],
                     "max_step_at": slowest, "steps": len(latencies), "steps_total_ms": round(sum(latencies), 1),
                     "slow_steps": len(slow),
                     "slow_excess_ms": round(sum(slow), 1), "gc_full": pauses.count, "gc_full_ms": round(pauses.ms, 1)}


def profile_text(profile: dict) -> str:
    if profile.get("median_step_ms") is None:
        return "no step history"
    # (steps' sum well under the run's decode time: the time went between the executor's iterations)
    return (f"steps median {profile['median_step_ms']:.2f} / max {profile['max_step_ms']:.2f} ms (step "
            f"{profile['max_step_at']} of {profile['steps']}, sum {profile['steps_total_ms']} ms), "
            f"{profile['slow_steps']} over 1.5x the median "
            f"(+{profile['slow_excess_ms']} ms); full GCs {profile['gc_full']} ({profile['gc_full_ms']} ms)")


def forced_runs(executor, args, prompts: list[list[int]], truths: dict, state: dict, length: int) -> tuple:
    """The prompts together with acceptance forced to ``length``, each row to its own continuation
    (``truths``: tuple(prompt) -> prompt + continuation), until every row's ids equal the continuation
    it was forced to: at least 2 runs (the first a warm-up: a batch size's first tree steps, graph
    uploads), at most 3; after a run that left a continuation (a near-tie rounded the other way), its
    own ids are the next run's. -> (results of the last run, its profile, runs, whether they agreed)."""
    state["depth"], state["truth"] = length - 1, truths
    for attempt in range(1, 4):
        results, profile = timed(executor, [greedy_request(p, args.output_len) for p in prompts])
        ids = [list(r.output_token_ids[0]) for r in results]
        agrees = all(i == truths[tuple(p)][len(p):] for p, i in zip(prompts, ids))
        if agrees and attempt >= 2:
            break
        truths = state["truth"] = {tuple(p): p + i for p, i in zip(prompts, ids)}
    return results, profile, attempt, agrees


def bench_loop(executor, args) -> dict:
    vocab = executor.runner.vocab_size
    prompt = [random.Random(7).randrange(vocab) for _ in range(args.context)]
    eagle = executor.proposer
    executor.proposer = None  # plain decoding: the overlapped loop, no drafts
    result = run_one(executor, greedy_request(prompt, args.output_len))
    plain_ids = list(result.output_token_ids[0])
    plain = (len(plain_ids) - 1) / decode_seconds(result)
    request = greedy_request(prompt, args.output_len)  # plain decoding's logits, off the clock
    request.output.return_generation_logits = True
    with_logits = run_one(executor, request)
    logits = with_logits.generation_logits[0] if list(with_logits.output_token_ids[0]) == plain_ids else None
    if logits is None:
        print("    plain decoding with logits returned other ids: first differences reported without gaps", flush=True)
    state = {"truth": prompt + plain_ids, "depth": 0}
    oracle = OracleTrees(args.loop_nodes, args.loop_depth)
    drafters = [("oracle", oracle), ("EAGLE-3", eagle)]
    if args.other_head:  # (made before force_acceptance patches eagle's propose: the copy would carry it)
        drafters.append(other_head(executor, eagle, args.heads_dir))
    # oracle trees of other sizes (--oracle-nodes): e.g. 15 nodes = 16 tokens stay in the 16-token
    # bucket (the skinny decode products) where the loop tree's 16 nodes = 17 tokens take the 32-token one
    drafters += [(f"oracle {n} nodes", OracleTrees(n, args.loop_depth)) for n in args.oracle_nodes]
    for _, proposer in drafters:
        force_acceptance(proposer, state, vocab)
    rows = []
    for drafter, proposer in drafters:
        executor.proposer = proposer
        for length in args.lengths:
            truths = {tuple(prompt): prompt + plain_ids}
            [result], profile, attempt, agrees = forced_runs(executor, args, [prompt], truths, state, length)
            ids = list(result.output_token_ids[0])
            accepted = result.perf.total_accepted_draft_tokens
            steps = len(ids) - 1 - accepted
            tps = (len(ids) - 1) / decode_seconds(result)
            step_ms = decode_seconds(result) * 1e3 / max(steps, 1)
            rows.append({"drafter": drafter, "batch": 1, "forced_length": length,
                         "measured_length": (len(ids) - 1) / max(steps, 1),
                         "runs": attempt, "ids_agree": agrees, "ids_equal_plain": ids == plain_ids,
                         "first_difference": first_difference(ids, plain_ids, logits), "tok_s": tps,
                         "plain_tok_s": plain, "speedup": tps / plain, "step_ms": step_ms, **profile,
                         # at exactly the forced length: L tokens per step of the loop's mean step time
                         "speedup_at_length": length * (1e3 / plain) / step_ms})
            print(f"    {drafter} L={length}: {tps:.1f} tok/s vs plain {plain:.1f}: {tps / plain:.2f}x (measured L "
                  f"{rows[-1]['measured_length']:.2f}, runs {attempt}; step {step_ms:.2f} ms: "
                  f"{rows[-1]['speedup_at_length']:.2f}x at L; first difference from plain "
                  f"{difference_text(rows[-1]['first_difference'])}; {profile_text(profile)})", flush=True)
            args.save({"plain_tok_s": plain, "rows": rows})  # a run cut short keeps its rows
    profiles = []
    if args.step_kernels:
        for drafter, proposer in (("oracle", oracle), ("EAGLE-3", eagle)):
            executor.proposer = proposer
            try:
                profiles.append(loop_kernels(executor, args, prompt, prompt + plain_ids, state, drafter))
            except Exception as err:  # (a diagnostic: the rows above stand without it)
                print(f"    {drafter} loop not profiled: {err!r}", flush=True)
    for batch in (b for b in args.batches if b > 1):
        rows += loop_at_batch(executor, args, batch, prompt, {"oracle": oracle, "EAGLE-3": eagle}, state)
        args.save({"plain_tok_s": plain, "rows": rows})
    executor.proposer = eagle
    replays = []
    for drafter, proposer in drafters[1:]:  # (oracles have no drafting graphs: draft_replays skips them)
        try:
            replays += [{"drafter": drafter, **r} for r in draft_replays(proposer, args.draft_kernels, drafter)]
        except Exception as err:  # (a diagnostic: the rows above stand without it)
            print(f"    {drafter} drafting replays not timed: {err!r}", flush=True)
    return {"plain_tok_s": plain, "plain_step_ms": 1e3 / plain, "rows": rows, "draft_replays": replays,
            "step_profiles": profiles}


def other_head(executor, eagle, heads_dir: str) -> tuple[str, object]:
    """(label, proposer) drafting with the same heads in the other precision: FP8 products if the
    executor's head is not FP8 (a bf16 target's default), else the target's dtype (speculative/eagle3.py
    Eagle3Head ``fp8``), over the same taps (Eagle3DraftProposer.with_head). Its GEMM tilings are not
    timed (on a cold choice cache the FP8 ones take tens of seconds: kernels/choice_cache.py): the
    FP8 products run the skinny kernel's default tiling, bf16 ones the library: a served head (timed
    at load) is at least as fast."""
    from engine.executor.speculative.eagle3 import load_eagle3

    runner, fp8 = executor.runner, not eagle.head.fp8
    head, _ = load_eagle3(heads_dir, hidden_size=runner.model_config.hidden_size, vocab_size=runner.vocab_size,
                          num_layers=len(runner.model.layers), device=runner.device, dtype=eagle.head.dtype, fp8=fp8)
    return f"EAGLE-3 {'FP8' if fp8 else 'bf16'} head", eagle.with_head(head, choose_kernels=False)


def draft_replays(eagle, kernels: int, drafter: str = "EAGLE-3") -> list[dict]:
    """After the loop, on CUDA: the GPU time of one replay of each drafting window the loop used
    (eagle3_graphs.py; 20 replays back to back between two events, so the host's launches hide
    behind the GPU's work), i.e. EAGLE-3's step minus the oracle's less this is host time and the
    gaps its synchronisations leave. ``kernels`` > 0: also the one-slot window's kernels (a
    profiler over 5 replays), the ``kernels`` costliest with their microseconds a replay."""
    import torch

    graphs = getattr(eagle, "graphs", None)
    if graphs is None or not graphs.use_graphs:
        return []
    used = [((1, c), w) for c, w in sorted(graphs.windows.items())] + sorted(graphs.batch_windows.items())
    out = []
    for (slots, capacity), w in used:
        if w.graph is None or all(serial < 0 for serial in w.serials):
            continue  # never served a proposal
        w.graph.replay()  # (its rows and tokens are rewritten with what they held: the loop is over)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            w.graph.replay()
        end.record()
        end.synchronize()
        out.append({"slots": slots, "capacity": capacity, "replay_ms": start.elapsed_time(end) / 20})
        print(f"    {drafter} drafting replay, {slots} slot(s) x {capacity} rows: {out[-1]['replay_ms']:.3f} ms GPU",
              flush=True)
        if kernels and slots == 1:
            out[-1]["kernels"] = replay_kernels(w.graph, kernels)
    return out


def replay_kernels(graph, top: int) -> list[dict]:
    """The kernels of a recorded graph's replay by GPU time (torch.profiler over 5 replays)."""
    import torch

    activities = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(5):
            graph.replay()
        torch.cuda.synchronize()
    found = [{"kernel": e.key, "per_replay": e.count / 5, "us": e.self_device_time_total / 5}
             for e in prof.key_averages() if e.self_device_time_total > 0]
    found.sort(key=lambda k: -k["us"])
    total = sum(k["us"] for k in found)
    print(f"      kernels of one replay: {total:.1f} us in all ({sum(k['per_replay'] for k in found):.0f} launches)",
          flush=True)
    for k in found[:top]:
        print(f"      {k['us']:8.1f} us  x{k['per_replay']:<4.0f} {k['kernel'][:110]}", flush=True)
    return found[:top]


def run_all(executor, requests: list) -> list:
    """Enqueue requests together, wait for every final result (an error fails the benchmark)."""
    ids = executor.enqueue_requests(requests)
    results = {}
    while len(results) < len(ids):
        for response in executor.await_responses(timeout=1.0):
            if response.error:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
            if response.request_id in ids and response.result.is_final:
                results[response.request_id] = response.result
    return [results[i] for i in ids]


def loop_at_batch(executor, args, batch: int, prompt: list[int], drafters: dict, state: dict) -> list[dict]:
    """The loop at ``batch`` different prompts (``prompt`` and batch - 1 others): plain (no proposer),
    then each drafter at the middle forced length, each row forced to its own continuation from this
    batch's plain run (a batch's decode steps may round a near-tie otherwise than batch 1's, and rows
    of one prompt would hide a step that verified one row against another's logits) -> rows (batch,
    step ms = each request's decode time over its steps, averaged)."""
    length = args.lengths[len(args.lengths) // 2]
    vocab = executor.runner.vocab_size
    prompts = [prompt] + [[random.Random(7 + i).randrange(vocab) for _ in range(len(prompt))] for i in range(1, batch)]
    executor.proposer = None
    # twice, the first a warm-up that leaves the prompts in the prefix cache: every later run's rows
    # then start together (their prompts' chunks would otherwise share the first rows' decode steps)
    for _ in range(2):
        results = run_all(executor, [greedy_request(p, args.output_len) for p in prompts])
    plain_ids = [list(r.output_token_ids[0]) for r in results]
    plain_ms = 1e3 * sum(decode_seconds(r) / (len(r.output_token_ids[0]) - 1) for r in results) / batch
    print(f"    batch {batch}: plain step {plain_ms:.2f} ms", flush=True)
    rows = []
    for drafter, proposer in drafters.items():
        executor.proposer = proposer
        truths = {tuple(p): p + i for p, i in zip(prompts, plain_ids)}
        results, profile, attempt, agrees = forced_runs(executor, args, prompts, truths, state, length)
        ids = [list(r.output_token_ids[0]) for r in results]
        steps = [len(i) - 1 - r.perf.total_accepted_draft_tokens for i, r in zip(ids, results)]
        step_ms = 1e3 * sum(decode_seconds(r) / max(n, 1) for r, n in zip(results, steps)) / batch
        measured = sum((len(i) - 1) / max(n, 1) for i, n in zip(ids, steps)) / batch
        plain_tok_s = 1e3 / plain_ms
        tps = measured * 1e3 / step_ms
        differ = next((r for r in range(batch) if ids[r] != plain_ids[r]), None)  # the first row leaving plain
        rows.append({"drafter": drafter, "batch": batch, "forced_length": length, "measured_length": measured,
                     "runs": attempt, "ids_agree": agrees, "ids_equal_plain": differ is None,
                     "first_difference": None if differ is None else first_difference(ids[differ], plain_ids[differ],
                                                                                       None),
                     "tok_s": tps, "plain_tok_s": plain_tok_s, "speedup": tps / plain_tok_s, "step_ms": step_ms,
                     "speedup_at_length": length * plain_ms / step_ms, **profile})
        print(f"    {drafter} x{batch} L={length}: step {step_ms:.2f} ms vs plain {plain_ms:.2f} ms (measured L "
              f"{measured:.2f}: {tps / plain_tok_s:.2f}x; {length * plain_ms / step_ms:.2f}x at L; every row's ids "
              f"{'equal' if agrees else 'do NOT equal'} its continuation, runs {attempt}; "
              f"{'= plain' if differ is None else f'row {differ} leaves plain'}; {profile_text(profile)})", flush=True)
    return rows


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
                         f"{'yes' if r['ids_agree'] else 'no'} ({r['runs']}) / {'yes' if r['ids_equal_plain'] else 'no'} | "
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
