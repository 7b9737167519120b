"""tree_bench's kernel tables and phase timings: torch.profiler over a verify step against a decode
step (``--kernels``), over a forced loop run with the executor's phases timed (``--step-kernels``),
and the GPU time and kernels of each drafting window's replay (``--draft-kernels``)
(benchmarks/speculative/tree_bench.py).
"""
from __future__ import annotations

import statistics
import time

from benchmarks.speculative.speculative_bench import greedy_request, steps_since
from benchmarks.speculative.tree_runs import run_all


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


def kernel_rows(kernels: dict, top: int, per: str = "per_step") -> list[dict]:
    """The ``top`` costliest of ``kernels`` ({name: (us, launches)}) for the JSON: [{"kernel", "us", ``per``}]."""
    ranked = sorted(kernels.items(), key=lambda kv: -kv[1][0])
    return [{"kernel": k, "us": us, per: n} for k, (us, n) in ranked[:top]]


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
        entry["kernels"] = kernel_rows(entry["kernels"], top)
    found["extra"] = kernel_rows(extra, top)
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
            "kernels": kernel_rows(per_step, args.step_kernels)}


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
    """The kernels of a recorded graph's replay by GPU time (profile_kernels over 5 replays)."""
    kernels, _ = profile_kernels(graph.replay, 5, True)
    total, launches = sum(us for us, _ in kernels.values()), sum(n for _, n in kernels.values())
    print(f"      kernels of one replay: {total:.1f} us in all ({launches:.0f} launches)", flush=True)
    print("\n".join(kernel_lines(kernels, top)), flush=True)
    return kernel_rows(kernels, top, "per_replay")
