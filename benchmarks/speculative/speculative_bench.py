#!/usr/bin/env python3
"""Speculative decoding on the Llama-3.1-8B shape (issue 34's GPU figures): what a verify step costs,
and the batch-1 speed-up it buys, bf16 and FP8, on random weights.

    python benchmarks/speculative/speculative_bench.py [--dtypes bf16,fp8] [--batches 1,8,64] [--ks 1,2,4,8]
        [--context 512] [--loop-ks 4,2,8] [--output-len 120] [--ngram-k 4] [--time-budget S]
        [--kv-cache-dtype auto|fp8]
        [--out speculative.json] [--markdown PATH]
    python benchmarks/speculative/speculative_bench.py --tiny            # the tiny model on the CPU, seconds
    python benchmarks/speculative/speculative_bench.py --report a.json,b.json [--markdown PATH]   # tables again

Per ``--dtypes`` label (bf16: bfloat16 weights; fp8: FP8 E4M3 linear weights as engine.build
quantizes them; the KV pool in bf16 for both unless ``--kv-cache-dtype fp8``, as engine_bench's
``--quantization fp8`` that gave the issue's 272 tok/s), one random-weight engine of ``--model``'s
shape (benchmarks/common.py's config-only engine) runs in an in-process Executor (CUDA graphs,
prefix reuse on). Sections:

1. ``verify``: the cost of one target forward in which each of B sequences carries 1 + k tokens (its
   last known token and k drafts) with logits at all k + 1 positions, against a plain 1-token decode
   step, both at ``--context`` tokens of context. Timed through ``ModelRunner.forward`` (the
   executor's runner, idle) with the ForwardBatch the executor builds for drafted rows
   (Executor._forward_batch): so each step takes the path the executor's would (decode graph,
   prefill graph of a token bucket, or eager), followed by the argmax copied to the host that both
   a greedy verify and batch-1 sampling wait for. ``step_ms``: median wall time of that. ``graph_ms``
   (section ``graphs``, CUDA): the same forward captured into one CUDA graph at exactly its tokens,
   device time per replay (benchmarks/common.py ``graph_call_us``): the GPU's floor, what a verify step would
   cost with no host work and no bucket padding. The goal: k = 4 at batch 1 costs <= 1.2x plain.
2. ``external``: batch 1, greedy, through the Executor with client drafts
   (``Request.external_draft``) at a fixed acceptance. External drafts are verified only at a
   request's first generation step, so this is the loop a BLS runs: each call sends prompt + the
   tokens accepted so far with k drafts, of which the first a are the target's own greedy
   continuation (the reference, made beforehand) and the rest wrong; every call is thus one verify
   step emitting a + 1 tokens (acceptance length a + 1). ``max_tokens`` is k + 1 as the reference's
   client sends, and ``stop_words`` holds the a + 1 tokens the step must emit when a < k: without it
   the executor would go on with k - a plain decode steps inside the same call, and the call would
   no longer be one step at acceptance a + 1 (the stop only cuts what follows; it changes no token).
   Tokens/s = tokens / wall time of all calls (each call's admission, prefix-cache lookup, the
   recomputed tail of the prompt's last KV block and its response included) against plain decoding's
   tokens/s (one request, first to last token). The reference is made by one-token calls (no
   drafts), not by plain decoding: random weights leave the top logits near-tied, and a decode
   step and a verify step round differently enough to flip some of them, which would turn "right"
   drafts wrong (bench_external says how the numerics are kept alike). Each loop's ids are checked
   against the reference (drafts must change nothing) and against plain decoding (reported; on the
   GPU it can differ for that reason, and the one-token calls' row shows whether it does without
   any draft). A call that emits another token than the reference is recorded, and the reference
   is remade from there off the clock. The goal: >= 1.8x plain at acceptance length 3 (k = 4, a = 2).
3. ``ngram``: ``ExecutorConfig.speculative = SpeculativeConfig("ngram", max_draft_len=--ngram-k)``
   on a repetitive prompt set (random phrases that recur), batch 1, one request at a time, against
   the same prompts decoded plainly: the measured mean acceptance length, tokens/s, whether the ids
   are plain decoding's (on the GPU the near-ties above may make them differ: a verify step is not
   a decode step), and the n-gram executor's step times with and without drafts. On random
   weights the acceptance says nothing about real text, so the speed-up at the acceptance lengths
   that benchmarks/speculative/speculative_acceptance.py measured on SmolLM2's real weights (``--acceptance``:
   summarisation 3.01, code edit 1.85 at k = 4) is *projected*: from section 2's curve (interpolated
   at L), as tokens/s = L / (a drafted step of the n-gram executor), and from section 1's step costs
   (L x plain / verify).

Order per dtype: 1, 2, section 1 again as single CUDA graphs (``graphs``), then 3 (a second engine
load: what ``--time-budget`` drops first).

Output: a markdown table per section (stdout, appended to ``--markdown``) with commit, GPU and date;
``--out`` JSON rewritten after every section, so a run cut short keeps what it measured.
``--time-budget`` skips what no longer fits (the n-gram executor is a second engine load).
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

from benchmarks.common import (MODELS, command_line, device_name, free_device_memory, git_commit, graph_call_us,  # noqa: E402
                               int_list, print_table, utc_now, write_config_only_engine)

DTYPES = {  # label -> write_config_only_engine's quantization (the KV pool stays in the model dtype)
    "bf16": None,
    "fp8": "fp8",
}
SECTIONS = ["verify", "external", "ngram", "graphs"]
# Mean acceptance lengths of n-gram drafts on real weights: benchmarks/speculative/speculative_acceptance.py,
# SmolLM2-135M-Instruct greedy, max_draft_len 4, max_matching_ngram_size 3 (issue 34).
REAL_WEIGHT_ACCEPTANCE = {"summarisation": 3.01, "code_edit": 1.85}
GOAL_VERIFY_RATIO = 1.2  # k = 4 at batch 1, against a plain step
GOAL_SPEEDUP = 1.8  # batch-1 decode at acceptance length 3
GOAL_ACCEPTANCE_LENGTH = 3


# ------------------------------------------------------------------------------------------------
# the engine
# ------------------------------------------------------------------------------------------------


def start_executor(args, label: str, speculative=None):
    """An Executor over a fresh random-weight engine (same seed every time: the n-gram executor's
    weights are the plain one's); returns (executor, facts about its load)."""
    import torch

    from engine.executor.executor import Executor, ExecutorConfig

    free_device_memory(args.device)
    started = time.perf_counter()
    engine_dir = write_config_only_engine(args.model, args.model_dtype, args.max_batch_size, args.max_seq_len,
                                          args.max_num_tokens, args.tokens_per_block, DTYPES[label])
    config = ExecutorConfig(max_tokens_in_paged_kv_cache=args.kv_tokens, enable_kv_cache_reuse=True,
                            kv_cache_dtype=args.kv_cache_dtype,
                            max_draft_len=max(args.loop_ks + [1]), speculative=speculative,
                            iter_stats_max_iterations=1 << 16)  # every step of a section kept for its timings
    executor = Executor(engine_dir, config, device=args.device)
    runner = executor.runner
    info = {"load_seconds": time.perf_counter() - started, "kv_dtype": str(runner.kv_cache.dtype).replace("torch.", ""),
            "kv_blocks": runner.num_kv_blocks, "tokens_per_block": runner.tokens_per_block,
            "decode_graphs": getattr(runner, "decode_graphs", None) is not None,
            "prefill_graphs": getattr(runner, "prefill_graphs", None) is not None,
            "speculative": None if speculative is None else f"{speculative.mode}, max_draft_len {speculative.max_draft_len}"}
    if args.device.startswith("cuda"):
        info["gpu_memory_allocated"] = torch.cuda.memory_allocated()
    return executor, info


def run_one(executor, request) -> object:
    """Enqueue one request, wait for its final result (an error response is a failed benchmark)."""
    request_id = executor.enqueue_request(request)
    while True:
        for response in executor.await_responses(timeout=1.0):
            if response.request_id != request_id:
                continue
            if response.error:
                raise RuntimeError(f"request {request_id} failed: {response.error}")
            if response.result.is_final:
                return response.result


def greedy_request(prompt: list[int], max_tokens: int, **kwargs):
    from engine.executor.request import OutputConfig, Request

    # end_id -1: no stop token, so every run makes exactly the tokens asked for.
    return Request(list(prompt), max_tokens, end_id=-1,
                   output=OutputConfig(exclude_input_from_output=True, return_perf_metrics=True), **kwargs)


def decode_seconds(result) -> float:
    perf = result.perf
    return (perf.last_token_time_ns - perf.first_token_time_ns) / 1e9


def plain_run(executor, prompt: list[int], max_tokens: int) -> tuple[list[int], float]:
    """Plain greedy decoding -> (output ids, decode tokens/s from its first to its last token)."""
    result = run_one(executor, greedy_request(prompt, max_tokens))
    ids = list(result.output_token_ids[0])
    return ids, (len(ids) - 1) / max(decode_seconds(result), 1e-9)


def steps_since(executor, since_ns: int) -> list:
    """The executor's iterations (IterationStats) with work since ``since_ns``. Only this script's
    requests run, one at a time; a step's stats are recorded just after its responses go out, so
    this first waits for the history to stop growing (the last step's record may trail its response)."""
    history, deadline = executor.get_iteration_stats_history(), time.monotonic() + 0.5
    while time.monotonic() < deadline:
        time.sleep(0.02)
        newer = executor.get_iteration_stats_history()
        if (newer[-1].iter if newer else 0) == (history[-1].iter if history else 0):
            break
        history = newer
    return [h for h in history if h.num_scheduled_requests and h.timestamp_ns >= since_ns]


def median_or_none(values):
    return statistics.median(values) if values else None


# ------------------------------------------------------------------------------------------------
# 1. the verify step against a plain decode step
# ------------------------------------------------------------------------------------------------


def verify_batch(tables: list[list[int]], context: int, k: int, rng: random.Random, vocab: int, page: int):
    """The ForwardBatch Executor._forward_batch builds for B decoding sequences of ``context`` known
    tokens (KV for the first context - 1) verifying k drafts each: per sequence its last known token
    then the drafts, at positions context - 1 ... context - 1 + k, logits at every one of them.
    k = 0 is a plain decode step."""
    from engine.executor.runner import ForwardBatch

    n = k + 1
    token_ids, positions, logits_indices = [], [], []
    for i in range(len(tables)):
        token_ids += [rng.randrange(vocab) for _ in range(n)]
        positions += range(context - 1, context - 1 + n)
        logits_indices += range(i * n, (i + 1) * n)
    end = context + k
    return ForwardBatch(token_ids, positions, [n] * len(tables), [end] * len(tables),
                        [t[:-(-end // page)] for t in tables], logits_indices)


def step_path(runner, batch) -> str:
    """Which way runner.forward runs ``batch`` (the runner's own tests, repeated here to label rows)."""
    if runner.device.type != "cuda":
        return "eager (CPU)"
    num_tokens, num_seqs = len(batch.token_ids), len(batch.seq_lens_q)
    decode = getattr(runner, "decode_graphs", None)
    if decode is not None and num_tokens == num_seqs and num_seqs <= decode.max_batch_size:
        return f"decode graph, bucket {decode.bucket_for(num_seqs)}"
    prefill = getattr(runner, "prefill_graphs", None)
    if prefill is not None and num_tokens != num_seqs and num_tokens <= prefill.buckets[-1]:
        return f"prefill graph, {prefill.bucket_for(num_tokens)}-token bucket"
    return "eager"


def time_step(runner, batch, warmup: int, repeat: int) -> float:
    """Median wall milliseconds of runner.forward(batch) and its argmax on the host: what a step of
    the synchronous loop (speculative decoding's) waits for before it can schedule the next."""
    def step():
        return runner.forward(batch).argmax(dim=-1).tolist()

    for _ in range(warmup):
        step()
    times = []
    for _ in range(repeat):
        started = time.perf_counter()
        step()
        times.append((time.perf_counter() - started) * 1e3)
    return statistics.median(times)


def graph_ms(runner, batch) -> float:
    """Device milliseconds of batch's forward + logits captured as one CUDA graph at exactly its
    tokens (no bucket padding, no host work): graph_call_us over the runner's packing."""
    import torch

    with torch.inference_mode():
        input_ids, positions, meta = runner._prepare(batch)
        rows = torch.tensor(batch.logits_indices, dtype=torch.int64, device=runner.device)
        model, kv_cache = runner.model, runner.kv_cache
        return graph_call_us(lambda: model.compute_logits(model(input_ids, positions, kv_cache, meta)[rows]),
                             [()], replays=10) / 1e3


def with_blocks(executor, batch_size: int, blocks_per_seq: int, fn):
    """Run fn(tables) over blocks taken from the executor's own pool (it is idle: nothing else is
    scheduled), so no cached prefix block is overwritten; they go back unregistered afterwards."""
    block_ids = executor.blocks.allocate(batch_size * blocks_per_seq)
    try:
        return fn([block_ids[i * blocks_per_seq:(i + 1) * blocks_per_seq] for i in range(batch_size)])
    finally:
        executor.blocks.free(block_ids)


def bench_verify(executor, args, graphs: bool) -> list[dict]:
    """Section 1 (``graphs``: the device-only column instead of the wall times) -> one row per
    (batch, k), k = 0 being the plain decode step."""
    runner = executor.runner
    page, vocab = runner.tokens_per_block, runner.vocab_size
    blocks_per_seq = -(-(args.context + max(args.ks)) // page)
    if not graphs:  # the first steps of a process run slower (allocator, thread pools), whatever the shape
        with_blocks(executor, 1, blocks_per_seq, lambda tables: time_step(
            runner, verify_batch(tables, args.context, 0, random.Random(0), vocab, page), 10, 1))
    rows = []
    for batch_size in args.batches:
        rng = random.Random(batch_size)

        def measure(tables):
            out = []
            for k in [0] + args.ks:
                batch = verify_batch(tables, args.context, k, rng, vocab, page)
                row = {"batch": batch_size, "k": k, "tokens": len(batch.token_ids), "path": step_path(runner, batch)}
                if graphs:
                    row["graph_ms"] = graph_ms(runner, batch)
                else:
                    row["step_ms"] = time_step(runner, batch, args.warmup, args.repeat)
                out.append(row)
                print(f"    batch {batch_size} k={k}: {row.get('graph_ms', row.get('step_ms')):.3f} ms ({row['path']})",
                      flush=True)
            return out

        rows += with_blocks(executor, batch_size, blocks_per_seq, measure)
    return rows


def verify_table_rows(verify: list[dict], graphs: list[dict] | None) -> list[dict]:
    """Section 1's rows with the plain step of their batch and the ratios."""
    device = {(g["batch"], g["k"]): g["graph_ms"] for g in graphs or []}
    plain = {r["batch"]: r for r in verify if r["k"] == 0}
    out = []
    for row in verify:
        if row["k"] == 0:
            continue
        base = plain[row["batch"]]
        entry = dict(row, plain_step_ms=base["step_ms"], ratio=row["step_ms"] / base["step_ms"], plain_path=base["path"])
        g, g0 = device.get((row["batch"], row["k"])), device.get((row["batch"], 0))
        if g is not None and g0:
            entry.update(graph_ms=g, plain_graph_ms=g0, graph_ratio=g / g0)
        out.append(entry)
    return out


# ------------------------------------------------------------------------------------------------
# 2. client drafts at a fixed acceptance, the BLS's loop
# ------------------------------------------------------------------------------------------------


def wrong(token: int, vocab: int) -> int:
    return (token + 1) % vocab


MAX_MISMATCHES = 10  # a loop whose calls disagree with its reference more often stops there (reported)
REFERENCE_CHUNK = 16  # after a mismatch, the reference is remade this many tokens at a time


def one_token_calls(executor, prompt: list[int], n: int) -> tuple[list[int], float]:
    """n greedy tokens, one request of max_tokens 1 each, no drafts -> (ids, tokens/s). Every token is
    the target's argmax at the last row of a step like a loop call's (the tail of the prompt's last
    KV block, from that block's start), so a loop's draft rows see the same numerics (see
    bench_external); also the client loop's cost without drafts."""
    out, started = [], time.perf_counter()
    for _ in range(n):
        out += run_one(executor, greedy_request(prompt + out, 1)).output_token_ids[0]
    return out, n / (time.perf_counter() - started)


def draft_loop(executor, prompt: list[int], truth: list[int], k: int, a: int, vocab: int) -> dict:
    """Generate len(truth) tokens by calls of k drafts, a of them right (module docstring, section 2).
    ``truth``: the target's own continuation (one_token_calls); a call that emits something else
    (numerics, see bench_external) is recorded in ``mismatches``, and the reference goes on from the
    loop's own tokens, remade REFERENCE_CHUNK tokens at a time off the clock (at most MAX_MISMATCHES)."""
    from engine.executor.request import ExternalDraftTokens

    n = len(truth)
    truth = list(truth)
    out, call_ms, mismatches = [], [], []
    drafted = accepted = 0
    elapsed, since_ns = 0.0, time.time_ns()
    while len(out) < n:
        pos = len(out)
        kk = min(k, n - pos - 1)  # the last calls: no drafts past the tokens wanted
        aa = min(a, kk)
        if len(truth) < pos + kk + 1:  # (only after a mismatch)
            more, _ = one_token_calls(executor, prompt + truth, min(n, pos + max(kk + 1, REFERENCE_CHUNK)) - len(truth))
            truth += more
        drafts = truth[pos:pos + aa] + [wrong(t, vocab) for t in truth[pos + aa:pos + kk]]
        expected = truth[pos:pos + aa + 1]
        # max_tokens k + 1 as the reference's client sends; the stop word (exactly the a + 1 tokens
        # the step emits) ends the call after its verify step instead of k - a plain steps more.
        request = greedy_request(prompt + out, kk + 1, stop_words=[expected] if aa < kk else None,
                                 external_draft=ExternalDraftTokens(drafts) if kk else None)
        started = time.perf_counter()
        result = run_one(executor, request)
        call_ms.append((time.perf_counter() - started) * 1e3)
        elapsed += call_ms[-1] / 1e3
        got = list(result.output_token_ids[0])
        drafted += result.perf.total_draft_tokens
        accepted += result.perf.total_accepted_draft_tokens
        out = (out + got)[:n]  # (longer than asked only after a mismatch: a call that ran past its stop)
        if got != expected:
            index = next((j for j, (x, y) in enumerate(zip(got, expected)) if x != y), min(len(got), len(expected)))
            mismatches.append(pos + index)
            if len(mismatches) > MAX_MISMATCHES:
                break
            truth = list(out)
    steps = steps_since(executor, since_ns)  # (those remaking the reference, if any, among them)
    return {"k": k, "accepted_drafts": a, "acceptance_length": a + 1, "tokens": len(out), "calls": len(call_ms),
            "measured_acceptance_length": len(out) / len(call_ms), "seconds": elapsed, "tok_s": len(out) / elapsed,
            "draft_tokens": drafted, "accepted_draft_tokens": accepted, "mismatches": mismatches,
            "stopped_early": len(out) < n, "output_ids": out, "call_ms_median": statistics.median(call_ms),
            "step_ms_median": median_or_none([h.iter_latency_ms for h in steps]), "steps": len(steps)}


def bench_external(executor, args, vocab: int, out: dict, deadline: float, save) -> None:
    """Section 2 into ``out``: the references, then one loop per (k, a) while time is left.

    The drafts that must be accepted are the target's greedy tokens as a verify step computes them,
    not as a plain decode step does: on random weights the top logits are close (128k near-equal
    logits), and the decode graph's GEMMs (one row, skinny kernels) and a verify step's (a 64-token
    bucket) round differently, enough to flip a near-tie every few dozen tokens; a flipped "right"
    draft would be rejected and the acceptance would no longer be the one asked for. So the
    reference comes from one-token calls (one_token_calls), and every KV block the loops read from
    the prefix cache is computed the way a loop call computes it in-step, from the block's start in
    a step of the same bucket: the prompt's last block is left out of the first prefill (it is
    computed by the first call), and plain decoding runs after the reference (the cache keeps the
    first writer of a block). Plain decoding's ids are compared too (``ids_equal_plain``)."""
    rng = random.Random(34)
    page = executor.runner.tokens_per_block
    prompt = [rng.randrange(vocab) for _ in range(args.context)]
    # The prompt's blocks but its last into the cache: no loop call recomputes those.
    run_one(executor, greedy_request(prompt[:page * ((len(prompt) - 1) // page) + 1], 1))
    truth, calls_tok_s = one_token_calls(executor, prompt, args.output_len)
    plain_ids, tok_s = plain_run(executor, prompt, args.output_len)
    again, tok_s_again = plain_run(executor, prompt, args.output_len)
    first_difference = next((i for i, (x, y) in enumerate(zip(truth, plain_ids)) if x != y), None)
    out["plain"] = {"tokens": len(plain_ids), "decode_tok_s": max(tok_s, tok_s_again),
                    "repeat_identical": again == plain_ids}
    out["one_token_calls"] = {"tok_s": calls_tok_s, "ids_equal_plain": truth == plain_ids,
                              "first_difference_from_plain": first_difference}
    out["plain_ids"], out["reference_ids"] = plain_ids, truth
    print(f"    plain decoding {out['plain']['decode_tok_s']:,.1f} tok/s; one-token calls {calls_tok_s:,.1f} tok/s, "
          f"their ids {'equal' if first_difference is None else f'differ from token {first_difference} on'}", flush=True)
    # Warm-up, outside the loops' time: a call recomputes the tail of the prompt's last KV block
    # (1 to tokens_per_block tokens) + its drafts, so one block's worth of single-token calls per k
    # meets every step size the loops will (eager steps, FP8: the kernels' variants compile here).
    for k in args.loop_ks:
        draft_loop(executor, prompt, truth[:page + 1], k, 0, vocab)
    out["loops"] = []
    for k in args.loop_ks:
        for a in range(k + 1):
            if deadline and time.monotonic() > deadline:
                out.setdefault("skipped", []).append([k, a])
                continue
            row = draft_loop(executor, prompt, truth, k, a, vocab)
            row["speedup"] = row["tok_s"] / out["plain"]["decode_tok_s"]
            row["ids_equal_reference"] = row["output_ids"] == truth
            row["ids_equal_plain"] = row["output_ids"] == plain_ids
            out["loops"].append(row)
            print(f"    k={k} a={a}: {row['tok_s']:,.1f} tok/s ({row['speedup']:.2f}x plain's "
                  f"{out['plain']['decode_tok_s']:,.1f}), {row['calls']} calls, call/step "
                  f"{row['call_ms_median']:.2f}/{fmt(row['step_ms_median'])} ms, mismatches {len(row['mismatches'])}",
                  flush=True)
            save()


def curve_at(loops: list[dict], k: int, length: float) -> float | None:
    """Section 2's speed-up at a fractional acceptance length, interpolated between the measured
    acceptance lengths of the k-draft loops (their measured lengths: a mismatch moves them)."""
    points = sorted((r["measured_acceptance_length"], r["speedup"]) for r in loops if r["k"] == k)
    for (x0, y0), (x1, y1) in zip(points, points[1:]):
        if x0 <= length <= x1 and x1 > x0:
            return y0 + (y1 - y0) * (length - x0) / (x1 - x0)
    return None


# ------------------------------------------------------------------------------------------------
# 3. n-gram drafts
# ------------------------------------------------------------------------------------------------


def repetitive_prompts(count: int, length: int, vocab: int) -> list[list[int]]:
    """Prompts in which a few random phrases recur (as a document an answer quotes would), with
    random tokens between them: prompt lookup finds n-gram matches in them."""
    rng = random.Random(3401)
    prompts = []
    for _ in range(count):
        phrases = [[rng.randrange(vocab) for _ in range(rng.randrange(12, 40))] for _ in range(3)]
        prompt = []
        while len(prompt) < length:
            prompt += rng.choice(phrases) + [rng.randrange(vocab) for _ in range(rng.randrange(0, 6))]
        prompts.append(prompt[:length])
    return prompts


def run_prompt_set(executor, prompts: list[list[int]], max_tokens: int) -> dict:
    """One request at a time (batch 1) -> ids, decode tokens/s, acceptance, step times by kind."""
    ids, decode_s, generated, drafted, accepted, since_ns = [], 0.0, 0, 0, 0, time.time_ns()
    for prompt in prompts:
        result = run_one(executor, greedy_request(prompt, max_tokens))
        ids.append(list(result.output_token_ids[0]))
        decode_s += decode_seconds(result)
        generated += len(ids[-1])
        drafted += result.perf.total_draft_tokens
        accepted += result.perf.total_accepted_draft_tokens
    steps = [h for h in steps_since(executor, since_ns) if not h.num_context_requests]
    decode_steps = generated - len(prompts) - accepted  # the first token of each comes from its prompt's step
    return {"prompts": len(prompts), "generated_tokens": generated, "draft_tokens": drafted,
            "accepted_draft_tokens": accepted, "acceptance_rate": accepted / max(1, drafted),
            "mean_acceptance_length": (generated - len(prompts)) / max(1, decode_steps),
            "decode_tok_s": (generated - len(prompts)) / max(decode_s, 1e-9), "output_ids": ids,
            "drafted_step_ms": median_or_none([h.iter_latency_ms for h in steps if h.num_gen_tokens > 1]),
            "drafted_steps": sum(1 for h in steps if h.num_gen_tokens > 1),
            "plain_step_ms": median_or_none([h.iter_latency_ms for h in steps if h.num_gen_tokens == 1]),
            "plain_steps": sum(1 for h in steps if h.num_gen_tokens == 1)}


def projections(entry: dict, acceptance: dict[str, float], ngram_k: int) -> list[dict]:
    """Projected batch-1 speed-ups at the real-weight acceptance lengths (module docstring, section 3)."""
    ngram, plain = entry.get("ngram"), (entry.get("ngram_plain") or {})
    verify = {(r["batch"], r["k"]): r for r in entry.get("verify_rows", [])}
    loops = (entry.get("external") or {}).get("loops", [])
    rows = []
    for name, length in acceptance.items():
        row = {"set": name, "acceptance_length": length, "k": ngram_k}
        if ngram and ngram.get("drafted_step_ms") and plain.get("decode_tok_s"):
            row["ngram_tok_s"] = length * 1e3 / ngram["drafted_step_ms"]
            row["ngram_speedup"] = row["ngram_tok_s"] / plain["decode_tok_s"]
        v = verify.get((1, ngram_k))
        if v:
            row["verify_cost_speedup"] = length / v["ratio"]
        row["client_loop_speedup"] = curve_at(loops, ngram_k, length)
        rows.append(row)
    return rows


# ------------------------------------------------------------------------------------------------
# one dtype
# ------------------------------------------------------------------------------------------------


def run_dtype(args, label: str, results: dict, save, t0: float) -> None:
    """The sections of one dtype, cheapest and most wanted first: verify steps, client drafts and the
    verify steps as CUDA graphs on the plain executor, then the n-gram executor (a second engine
    load), which a short budget drops first. The graphs run on the plain executor, after the loops:
    a capture failing there costs at most the n-gram runs."""
    from engine.executor.executor import SpeculativeConfig

    entry = results["dtypes"].setdefault(label, {"engines": []})
    vocab = MODELS[args.model]["vocab_size"]
    deadline = t0 + args.time_budget if args.time_budget else 0.0

    def left() -> float:
        return deadline - time.monotonic() if deadline else float("inf")

    print(f"--- {label}: engine (plain)", flush=True)
    executor, info = start_executor(args, label)
    entry["engines"].append(info)
    save()
    print(f"    loaded in {info['load_seconds']:.0f} s; prefill graphs {'on' if info['prefill_graphs'] else 'off'}", flush=True)
    try:
        if "verify" in args.sections:
            print(f"--- {label}: verify steps", flush=True)
            entry["verify"] = bench_verify(executor, args, graphs=False)
            entry["verify_rows"] = verify_table_rows(entry["verify"], None)
            save()
        if "external" in args.sections:
            print(f"--- {label}: client drafts at fixed acceptance", flush=True)
            entry["external"] = {}
            # The loops leave 20 s for the graphs and the shutdown; the n-gram runs get what is left.
            bench_external(executor, args, vocab, entry["external"], deadline - 20 if deadline else 0.0, save)
            save()
        if "graphs" in args.sections and "verify" in args.sections and args.device.startswith("cuda"):
            if left() > 10:
                print(f"--- {label}: verify steps as single CUDA graphs", flush=True)
                try:
                    entry["verify_graphs"] = bench_verify(executor, args, graphs=True)
                except Exception as error:  # noqa: BLE001  (a capture failure must not lose the rest)
                    entry["verify_graphs_error"] = f"{type(error).__name__}: {error}"
                entry["verify_rows"] = verify_table_rows(entry["verify"], entry.get("verify_graphs"))
            else:
                entry["verify_graphs_error"] = "skipped: time budget"
            save()
        prompts = repetitive_prompts(args.ngram_prompts, args.context, vocab)
        # Another engine load (assumed as long as the first: the kernels it compiled stay compiled),
        # the prompt set twice, each prompt about as long as one draft loop.
        needed = info["load_seconds"] + 2 * args.ngram_prompts * max(2.0, plain_seconds(entry)) + 10
        if "ngram" in args.sections and left() < needed:
            entry["ngram_skipped"] = f"time budget: {left():.0f} s left, ~{needed:.0f} s needed"
        elif "ngram" in args.sections:
            print(f"--- {label}: plain decoding of the n-gram prompt set", flush=True)
            entry["ngram_plain"] = run_prompt_set(executor, prompts, args.output_len)
            save()
            executor.shutdown()
            executor = None
            print(f"--- {label}: engine (n-gram, k={args.ngram_k})", flush=True)
            speculative = SpeculativeConfig("ngram", max_draft_len=args.ngram_k,
                                            max_matching_ngram_size=args.max_matching_ngram_size)
            executor, info2 = start_executor(args, label, speculative)
            entry["engines"].append(info2)
            print(f"    loaded in {info2['load_seconds']:.0f} s", flush=True)
            run_prompt_set(executor, prompts[:1], 8)  # warm-up
            entry["ngram"] = run_prompt_set(executor, prompts, args.output_len)
            entry["ngram"]["ids_equal_plain"] = entry["ngram"]["output_ids"] == entry["ngram_plain"]["output_ids"]
            entry["ngram"]["speedup"] = entry["ngram"]["decode_tok_s"] / entry["ngram_plain"]["decode_tok_s"]
            save()
            n = entry["ngram"]
            print(f"    mean acceptance length {n['mean_acceptance_length']:.2f}, {n['decode_tok_s']:,.1f} tok/s "
                  f"({n['speedup']:.2f}x plain), ids equal plain: {n['ids_equal_plain']}", flush=True)
    finally:
        if executor is not None:
            executor.shutdown()
        executor = None
        free_device_memory(args.device)
        # From whatever was measured, also when a later section failed.
        entry["projections"] = projections(entry, args.acceptance, args.ngram_k)
        entry["goals"] = goals(entry)
        save()


def plain_seconds(entry: dict) -> float:
    """Seconds one plain run of --output-len tokens took in section 2 (0 when it did not run)."""
    plain = (entry.get("external") or {}).get("plain") or {}
    return plain["tokens"] / plain["decode_tok_s"] if plain.get("decode_tok_s") else 0.0


def goals(entry: dict) -> dict:
    out = {}
    v = next((r for r in entry.get("verify_rows", []) if r["batch"] == 1 and r["k"] == 4), None)
    if v:
        out["verify_k4_batch1_ratio"] = v["ratio"]
        out["verify_k4_batch1_met"] = v["ratio"] <= GOAL_VERIFY_RATIO
    loops = (entry.get("external") or {}).get("loops", [])
    at3 = [r for r in loops if r["acceptance_length"] == GOAL_ACCEPTANCE_LENGTH]
    if at3:
        best = max(at3, key=lambda r: r["speedup"])
        out["speedup_at_3"] = {f"k{r['k']}": r["speedup"] for r in at3}
        out["speedup_at_3_met"] = best["speedup"] >= GOAL_SPEEDUP
    return out


# ------------------------------------------------------------------------------------------------
# tables
# ------------------------------------------------------------------------------------------------


def fmt(value, spec: str = ".2f", suffix: str = "") -> str:
    return "-" if value is None else format(value, spec) + suffix


def markdown(results: dict) -> str:
    lines = [f"### Speculative decoding: verify-step cost and batch-1 speed-up ({results['model']}, random weights)", "",
             f"Commit {results['commit']}, {results['gpu']}, {results['date']}. `{results['command']}`.",
             f"Context {results['context']} tokens; greedy; KV pool {results.get('kv_cache_dtype', 'auto')}; prefix reuse on."]
    for label, entry in results["dtypes"].items():
        if entry.get("error"):
            lines.append(f"- {label}: FAILED: {entry['error'][:300]}")
        for e in entry.get("engines", []):
            lines.append(f"- {label} engine{' (' + e['speculative'] + ')' if e.get('speculative') else ''}: loaded in "
                         f"{e['load_seconds']:.0f} s, prefill graphs {'on' if e['prefill_graphs'] else 'off'}, "
                         f"KV {e['kv_dtype']}.")
    lines += ["", "**Verify step vs plain decode step** (runner.forward as the executor calls it + argmax to the host, "
              "median wall ms; GPU only: the same forward as one CUDA graph at exactly its tokens). "
              f"Goal: k = 4 at batch 1 <= {GOAL_VERIFY_RATIO}x.", "",
              "| dtype | batch | k | tokens | path | verify ms | plain ms (path) | ratio | GPU only: verify / plain ms | GPU ratio |",
              "|---|---:|---:|---:|---|---:|---:|---:|---:|---:|"]
    for label, entry in results["dtypes"].items():
        for r in entry.get("verify_rows", []):
            device = ((f"{r['graph_ms']:.3f} / {r['plain_graph_ms']:.3f}", f"{r['graph_ratio']:.2f}x")
                      if "graph_ms" in r else ("-", "-"))
            lines.append(f"| {label} | {r['batch']} | {r['k']} | {r['tokens']} | {r['path']} | {r['step_ms']:.3f} | "
                         f"{r['plain_step_ms']:.3f} ({r['plain_path']}) | **{r['ratio']:.2f}x** | {device[0]} | {device[1]} |")
        if entry.get("verify_graphs_error"):
            lines.append(f"| {label} | | | | GPU-only column: {entry['verify_graphs_error'][:150]} | | | | | |")
    lines += ["", "**Client drafts at a fixed acceptance, batch 1** (the BLS loop: each call = prompt + accepted tokens "
              "with k drafts, the first a right; one verify step per call; tokens/s over the calls' wall time, against "
              "plain decoding's first-to-last-token rate; right drafts = the reference, the target's tokens from "
              "one-token calls, whose steps round as a verify step does; plain decoding's ids compared too). "
              f"Goal: >= {GOAL_SPEEDUP}x at acceptance length {GOAL_ACCEPTANCE_LENGTH}.", "",
              "| dtype | k | a | acceptance length (measured) | calls | tok/s | plain tok/s | speed-up | ids = reference / "
              "= plain decoding | call / step ms |", "|---|---:|---:|---|---:|---:|---:|---:|---|---|"]
    for label, entry in results["dtypes"].items():
        ext = entry.get("external") or {}
        plain = (ext.get("plain") or {}).get("decode_tok_s")
        for r in ext.get("loops", []):
            same = "yes" if r.get("ids_equal_reference") else (
                f"no ({len(r['mismatches'])} call(s) emitted another token, first at {(r['mismatches'] or ['?'])[0]}"
                f"{'; stopped there' if r.get('stopped_early') else ''})")
            same += " / " + ("yes" if r["ids_equal_plain"] else "no")
            mark = "**" if r["acceptance_length"] == GOAL_ACCEPTANCE_LENGTH else ""
            lines.append(f"| {label} | {r['k']} | {r['accepted_drafts']} | {r['acceptance_length']} "
                         f"({r['measured_acceptance_length']:.2f}) | {r['calls']} | {r['tok_s']:,.1f} | {plain:,.1f} | "
                         f"{mark}{r['speedup']:.2f}x{mark} | {same} | {r['call_ms_median']:.2f} / {fmt(r['step_ms_median'])} |")
        calls = ext.get("one_token_calls")
        if calls:
            differ = calls["first_difference_from_plain"]
            lines.append(f"| {label} | 0 | 0 | 1 (one-token calls, no drafts: the reference) | {ext['plain']['tokens']} | "
                         f"{calls['tok_s']:,.1f} | {plain:,.1f} | {calls['tok_s'] / plain:.2f}x | - / "
                         f"{'yes' if differ is None else f'no, from token {differ}'} | |")
        if ext.get("skipped"):
            skipped = ", ".join(f"({k}, {a})" for k, a in ext["skipped"])
            lines.append(f"| {label} | skipped (time budget): (k, a) = {skipped} | | | | | | | | |")
    lines += ["", "**n-gram drafts** (SpeculativeConfig(\"ngram\"), batch 1, a repetitive random-token prompt set; "
              "random weights: the acceptance is not that of real text, and near-tied logits may round to other ids "
              "in a verify step than in a decode step).", "",
              "| dtype | k | prompts | tokens | mean acceptance length (measured) | n-gram tok/s | plain tok/s | speed-up (measured) | "
              "ids = plain | n-gram executor step ms: drafted / not |", "|---|---:|---:|---:|---:|---:|---:|---:|---|---|"]
    for label, entry in results["dtypes"].items():
        n, p = entry.get("ngram"), entry.get("ngram_plain")
        if n and p:
            lines.append(f"| {label} | {results['ngram_k']} | {n['prompts']} | {n['generated_tokens']} | "
                         f"{n['mean_acceptance_length']:.2f} | {n['decode_tok_s']:,.1f} | {p['decode_tok_s']:,.1f} | "
                         f"{n['speedup']:.2f}x | {'yes' if n['ids_equal_plain'] else 'no'} | "
                         f"{fmt(n['drafted_step_ms'])} ({n['drafted_steps']}) / {fmt(n['plain_step_ms'])} ({n['plain_steps']}) |")
        elif entry.get("ngram_skipped"):
            lines.append(f"| {label} | skipped: {entry['ngram_skipped']} | | | | | | | | |")
    lines += ["", "**Projected batch-1 speed-up at real-weight acceptance lengths L** (n-gram drafts on SmolLM2, "
              "benchmarks/speculative/speculative_acceptance.py). PROJECTED, not measured, three ways: section 2's client-loop "
              "curve interpolated at L (per-call overhead included: the low one); L tokens per drafted step of the "
              "n-gram executor (section 3's median step with drafts) against plain decoding; L / the verify-step "
              "ratio of section 1 (batch 1, k as shown).", "",
              "| dtype | set | L (k) | from client-loop curve | n-gram executor: tok/s | n-gram executor: speed-up | "
              "from verify-step cost |", "|---|---|---|---:|---:|---:|---:|"]
    for label, entry in results["dtypes"].items():
        for r in entry.get("projections", []):
            lines.append(f"| {label} | {r['set']} | {r['acceptance_length']:.2f} ({r['k']}) | "
                         f"{fmt(r.get('client_loop_speedup'), '.2f', 'x')} | {fmt(r.get('ngram_tok_s'), ',.1f')} | "
                         f"{fmt(r.get('ngram_speedup'), '.2f', 'x')} | {fmt(r.get('verify_cost_speedup'), '.2f', 'x')} |")
    lines += ["", "Goals:"]
    for label, entry in results["dtypes"].items():
        g = entry.get("goals", {})
        if "verify_k4_batch1_ratio" in g:
            lines.append(f"- {label}: verify k = 4 at batch 1 costs {g['verify_k4_batch1_ratio']:.2f}x a plain step "
                         f"(goal <= {GOAL_VERIFY_RATIO}x): {'met' if g['verify_k4_batch1_met'] else 'not met'}.")
        if "speedup_at_3" in g:
            text = ", ".join(f"{k} {v:.2f}x" for k, v in g["speedup_at_3"].items())
            lines.append(f"- {label}: batch-1 speed-up at acceptance length {GOAL_ACCEPTANCE_LENGTH} with client drafts: "
                         f"{text} (goal >= {GOAL_SPEEDUP}x): {'met' if g['speedup_at_3_met'] else 'not met'}.")
    return "\n".join(lines) + "\n"


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtypes", default="bf16,fp8", help=f"comma-separated, of {sorted(DTYPES)}")
    parser.add_argument("--model", choices=sorted(MODELS), default="llama8b")
    parser.add_argument("--tiny", action="store_true", help="the tiny model on the CPU (float32): a smoke run in seconds")
    parser.add_argument("--device", default=None, help="default cuda (cpu with --tiny)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--batches", default="1,8,64", help="section 1's batch sizes")
    parser.add_argument("--ks", default="1,2,4,8", help="section 1's draft lengths")
    parser.add_argument("--context", type=int, default=512, help="tokens of context (section 1) and prompt length (2, 3)")
    parser.add_argument("--loop-ks", default="4,2,8", help="section 2's draft lengths (each with a = 0..k right), in this order")
    parser.add_argument("--output-len", type=int, default=120,
                        help="tokens generated per plain run / draft loop / prompt (120: a whole number of calls at lengths 1-6, 8)")
    parser.add_argument("--ngram-k", type=int, default=4, help="section 3's max_draft_len (the real-weight lengths are for 4)")
    parser.add_argument("--max-matching-ngram-size", type=int, default=3)
    parser.add_argument("--ngram-prompts", type=int, default=4)
    parser.add_argument("--acceptance", default=",".join(f"{k}={v}" for k, v in REAL_WEIGHT_ACCEPTANCE.items()),
                        help="name=mean acceptance length,... measured on real weights (for the projection)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=15, help="timed steps per section-1 row (median)")
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the KV pool: auto (the model dtype) or fp8 (then no step with drafts replays a prefill graph)")
    parser.add_argument("--time-budget", type=float, default=0.0,
                        help="seconds for the whole run (0: none): later loops / the n-gram engine are skipped to fit")
    parser.add_argument("--out", default="speculative_bench.json")
    parser.add_argument("--markdown", default=None, help="append the markdown tables to this file")
    parser.add_argument("--report", default=None, help="only render the tables of these JSON files (comma-separated)")
    args = parser.parse_args(argv)
    if args.tiny:
        args.model = "tiny"
        args.device = args.device or "cpu"
    args.device = args.device or "cuda"
    # bf16 on the GPU; float32 on the CPU, where the tiny model's ids must match plain decoding exactly.
    args.model_dtype = "bfloat16" if args.device.startswith("cuda") else "float32"
    args.dtype_labels = [d for d in args.dtypes.split(",") if d]
    unknown = sorted(set(args.dtype_labels) - set(DTYPES)) + sorted(set(args.sections.split(",")) - set(SECTIONS) - {""})
    if unknown:
        parser.error(f"unknown dtypes/sections {unknown}")
    args.sections = [s for s in args.sections.split(",") if s]
    args.batches, args.ks, args.loop_ks = int_list(args.batches), int_list(args.ks), int_list(args.loop_ks)
    if args.ngram_k not in args.ks:  # the projection reads the verify cost at the n-gram's k
        args.ks = sorted(args.ks + [args.ngram_k])
    args.acceptance = {name: float(value) for name, value in (p.split("=") for p in args.acceptance.split(",") if p)}
    # Engine limits from what the sections ask for: section 1's widest step is max batch x (max k + 1)
    # tokens (the prefill graphs go up to max_num_tokens, so it is replayed, not run eagerly); without
    # chunked context a prompt must fit one step, and section 2's last calls send context + output
    # tokens as their prompt (only its last block's tail is computed: the rest is in the prefix cache).
    page = args.tokens_per_block
    args.max_batch_size = max(args.batches + [1])
    needed = max(args.max_batch_size * (max(args.ks) + 1), args.context + args.output_len + max(args.loop_ks + [0]) + 1)
    args.max_num_tokens = -(-needed // 64) * 64
    args.max_seq_len = -(-(args.context + args.output_len + max(args.ks + args.loop_ks) + 2) // page) * page
    blocks = args.max_batch_size * -(-(args.context + max(args.ks)) // page) + 4 * (args.max_seq_len // page)
    args.kv_tokens = blocks * page
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.report:
        results = None
        for path in args.report.split(","):
            with open(path) as f:
                part = json.load(f)
            if results is None:
                results = part
            else:
                results["dtypes"].update(part["dtypes"])
                results["command"] += "; " + part["command"]
        for entry in results["dtypes"].values():  # a run killed by its time limit never made these
            if "projections" not in entry:
                entry["projections"] = projections(entry, results["acceptance"], results["ngram_k"])
                entry["goals"] = goals(entry)
        print_table(markdown(results), args.markdown)
        return results
    import torch

    t0 = time.monotonic()
    on_gpu = args.device.startswith("cuda")
    results = {"date": utc_now(), "commit": git_commit(), "gpu": device_name(args.device), "model": args.model,
               "model_dtype": args.model_dtype, "torch": torch.__version__, "command": command_line(__file__, argv),
               "context": args.context, "batches": args.batches, "ks": args.ks, "loop_ks": args.loop_ks,
               "output_len": args.output_len, "ngram_k": args.ngram_k, "acceptance": args.acceptance,
               "kv_cache_dtype": args.kv_cache_dtype, "max_num_tokens": args.max_num_tokens,
               "max_seq_len": args.max_seq_len, "dtypes": {}}
    print(f"speculative_bench: {args.model} on {results['gpu']}, commit {results['commit']}, dtypes {args.dtype_labels}",
          flush=True)

    def save() -> None:
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    save()
    # CPU (the smoke run): one intra-op thread. On a machine whose cores other processes share, a
    # thread pool's barriers wait for descheduled threads and a tiny step's time swings 100x.
    threads = torch.get_num_threads()
    if not on_gpu:
        torch.set_num_threads(1)
    try:
        for label in args.dtype_labels:
            try:
                run_dtype(args, label, results, save, t0)
            except Exception as error:  # noqa: BLE001  (one dtype failing must not cost the other)
                import traceback

                traceback.print_exc()
                results["dtypes"].setdefault(label, {})["error"] = f"{type(error).__name__}: {error}"
                save()
    finally:
        torch.set_num_threads(threads)
    print_table(markdown(results), args.markdown)
    print(f"speculative_bench: done in {time.monotonic() - t0:,.0f} s; results in {args.out}", flush=True)
    return results


if __name__ == "__main__":
    import signal

    # `timeout` ends a run with SIGTERM: raised as SystemExit, the dtype's finally block still adds
    # the projections and goals to the JSON and shuts its executor down.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    main()
