"""tree_bench's loop section: batch 1 (then ``--batches``) greedy through the executor, plain decoding
against the oracle's and EAGLE-3's trees at forced acceptance lengths, and where a run's ids first
leave plain decoding's (benchmarks/speculative/tree_bench.py).
"""
from __future__ import annotations

import random

from benchmarks.speculative.speculative_bench import decode_seconds, greedy_request, run_one
from benchmarks.speculative.tree_kernels import draft_replays, loop_kernels
from benchmarks.speculative.tree_runs import OracleTrees, force_acceptance, forced_runs, profile_text, run_all

NEAR_TIE = 0.05  # a first difference whose logit gap is under this share of the logits' std: rounding


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


def left_text(left_at: list) -> str:
    """Where the forced runs left their continuations (", left at 55, 61, -": the last kept it), or
    nothing when only the warm-up did."""
    if not any(at is not None for at in left_at[1:]):
        return ""
    return ", left at " + ", ".join("-" if at is None else str(at) for at in left_at)


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
            [result], profile, attempt, agrees, left_at = forced_runs(executor, args, [prompt], truths, state, length)
            ids = list(result.output_token_ids[0])
            accepted = result.perf.total_accepted_draft_tokens
            steps = len(ids) - 1 - accepted
            tps = (len(ids) - 1) / decode_seconds(result)
            step_ms = decode_seconds(result) * 1e3 / max(steps, 1)
            rows.append({"drafter": drafter, "batch": 1, "forced_length": length,
                         "measured_length": (len(ids) - 1) / max(steps, 1),
                         "runs": attempt, "ids_agree": agrees, "left_at": left_at, "ids_equal_plain": ids == plain_ids,
                         "first_difference": first_difference(ids, plain_ids, logits), "tok_s": tps,
                         "plain_tok_s": plain, "speedup": tps / plain, "step_ms": step_ms, **profile,
                         # at exactly the forced length: L tokens per step of the loop's mean step time
                         "speedup_at_length": length * (1e3 / plain) / step_ms})
            print(f"    {drafter} L={length}: {tps:.1f} tok/s vs plain {plain:.1f}: {tps / plain:.2f}x (measured L "
                  f"{rows[-1]['measured_length']:.2f}, runs {attempt}{left_text(left_at)}; step {step_ms:.2f} ms: "
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
        results, profile, attempt, agrees, left_at = forced_runs(executor, args, prompts, truths, state, length)
        ids = [list(r.output_token_ids[0]) for r in results]
        steps = [len(i) - 1 - r.perf.total_accepted_draft_tokens for i, r in zip(ids, results)]
        step_ms = 1e3 * sum(decode_seconds(r) / max(n, 1) for r, n in zip(results, steps)) / batch
        measured = sum((len(i) - 1) / max(n, 1) for i, n in zip(ids, steps)) / batch
        plain_tok_s = 1e3 / plain_ms
        tps = measured * 1e3 / step_ms
        differ = next((r for r in range(batch) if ids[r] != plain_ids[r]), None)  # the first row leaving plain
        rows.append({"drafter": drafter, "batch": batch, "forced_length": length, "measured_length": measured,
                     "runs": attempt, "ids_agree": agrees, "left_at": left_at, "ids_equal_plain": differ is None,
                     "first_difference": None if differ is None else first_difference(ids[differ], plain_ids[differ],
                                                                                       None),
                     "tok_s": tps, "plain_tok_s": plain_tok_s, "speedup": tps / plain_tok_s, "step_ms": step_ms,
                     "speedup_at_length": length * plain_ms / step_ms, **profile})
        print(f"    {drafter} x{batch} L={length}: step {step_ms:.2f} ms vs plain {plain_ms:.2f} ms (measured L "
              f"{measured:.2f}: {tps / plain_tok_s:.2f}x; {length * plain_ms / step_ms:.2f}x at L; every row's ids "
              f"{'equal' if agrees else 'do NOT equal'} its continuation, runs {attempt}{left_text(left_at)}; "
              f"{'= plain' if differ is None else f'row {differ} leaves plain'}; {profile_text(profile)})", flush=True)
    return rows
