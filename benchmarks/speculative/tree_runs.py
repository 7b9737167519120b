"""tree_bench's forced runs through the executor: the loop tree's shape, a drafter whose trees are
forced to accept a chosen length, the oracle that only drafts, and a timed run of requests with its
step profile and full GC pauses (benchmarks/speculative/tree_bench.py, the loop section).
"""
from __future__ import annotations

import gc
import statistics

from benchmarks.engine.gc_pauses import GcPauses
from benchmarks.speculative.speculative_bench import greedy_request, steps_since

LOOP_DEPTH = 5  # the loop tree's chain (--loop-depth): EAGLE-3 drafts it in as many forwards of its layer
# A forced run that leaves its continuation at output position p (a near-tie that the tree step
# rounds otherwise than the run it was forced to) is the next run's continuation; that run drafts
# and steps as it did up to p, so it keeps p's token and can only leave later: each run moves the
# first difference on. 3 runs were too few for the 16-node tree on an H200 in calls 15 and 16 (its
# 32-row gate/up product through the library there, call 13's skinny kernel before: load-time timings
# within 5%, kernels/wide_rows.py), 2-3 enough for every other row.
MAX_FORCED_RUNS = 8


def loop_choices(nodes: int, chain: int = LOOP_DEPTH) -> list[list[int]]:
    """A chain of ``chain`` first children, then siblings breadth-first, ``nodes`` paths in all."""
    choices = [[0] * depth for depth in range(1, chain + 1)]
    for rank in range(1, nodes):
        for depth in range(chain):
            if len(choices) < nodes:
                choices.append([0] * depth + [rank])
    return choices[:nodes]


def force_acceptance(proposer, state: dict, vocab: int) -> None:
    """After the drafter ran: the tree's first-child chain takes the sequence's truth to depth
    state["depth"], every other node a wrong token. state["truth"]: one list (prompt + continuation)
    for every sequence, or a dict {tuple(prompt): prompt + continuation}, a truth per prompt (a batch
    of different prompts: each row is forced to its own continuation, not row 0's; a prompt not in
    it keeps the drafter's tokens). Past its truth's end a node keeps the drafter's token too. Drafts
    left on the device (engine/executor/speculative/device_drafts.py: placeholder ids) are not read
    back here, which would wait for the drafting: a placeholder off the chain becomes a wrong token."""
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
                elif tokens[i] == true or tokens[i] < 0:  # (< 0: a draft left on the device, made wrong unread)
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


def timed(executor, requests: list) -> tuple[list, dict]:
    """Run ``requests`` together -> (their results, the run's profile: median and slowest step ms
    from the executor's iteration history (decode steps only), the slowest step's index, the steps
    over 1.5x the median and their ms beyond it, full GC collections and their ms inside the run):
    one slow step (a pause) reads apart from a slower loop."""
    from engine.executor.request import now_ns

    since = now_ns()
    # Full (generation 2) collections are a pause inside one step (~200k tracked objects in a loaded
    # executor: ~85 ms on the CPU runner of 2026-11-29); one collection first so the garbage of the
    # runs before is not collected on this run's clock.
    gc.collect()
    with GcPauses() as pauses:
        results = run_all(executor, requests)
    full_ms = [ms for _, ms, generation, _ in pauses.collections if generation == 2]
    latencies = [s.iter_latency_ms for s in steps_since(executor, since) if not s.num_ctx_tokens]
    slowest = max(range(len(latencies)), key=latencies.__getitem__) if latencies else None
    median = statistics.median(latencies) if latencies else None
    slow = [ms - median for ms in latencies if ms > 1.5 * median] if latencies else []
    return results, {"median_step_ms": median, "max_step_ms": None if slowest is None else latencies[slowest],
                     "max_step_at": slowest, "steps": len(latencies), "steps_total_ms": round(sum(latencies), 1),
                     "slow_steps": len(slow),
                     "slow_excess_ms": round(sum(slow), 1), "gc_full": len(full_ms), "gc_full_ms": round(sum(full_ms), 1)}


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
    uploads), at most MAX_FORCED_RUNS; after a run that left a continuation (a near-tie rounded the
    other way), its own ids are the next run's. -> (results of the last run, its profile, runs, whether
    they agreed, where each run first left its continuation: the earliest row's output position, None
    where every row kept it)."""
    state["depth"], state["truth"] = length - 1, truths
    left_at = []
    for attempt in range(1, MAX_FORCED_RUNS + 1):
        results, profile = timed(executor, [greedy_request(p, args.output_len) for p in prompts])
        ids = [list(r.output_token_ids[0]) for r in results]
        left = [first_left(i, truths[tuple(p)][len(p):]) for p, i in zip(prompts, ids)]
        left_at.append(min((at for at in left if at is not None), default=None))
        agrees = left_at[-1] is None
        if agrees and attempt >= 2:
            break
        truths = state["truth"] = {tuple(p): p + i for p, i in zip(prompts, ids)}
    return results, profile, attempt, agrees, left_at


def first_left(ids: list[int], continuation: list[int]) -> int | None:
    """The first output position where ``ids`` leave ``continuation`` (a shorter one counts), None if never."""
    if ids == continuation:
        return None
    return next((at for at, (a, b) in enumerate(zip(ids, continuation)) if a != b), min(len(ids), len(continuation)))
