"""What a request joining a busy batch costs: the engine's time to its first token, and the step
that carries its prompt, with and without the CUDA graphs of steps with prompt tokens.

An in-process Executor on a random-weight shape keeps ``--decoding`` streams generating (one that ends is
replaced); groups of k requests of ``--prompt_len`` tokens join, ``--repeats`` times per k, after one
unmeasured group of each k (the first prompt steps of a shape compile kernels and capture graphs).
Reported per k: the median time from a joining request's arrival at the executor to its first token
(its perf metrics), and the median period of the steps that carried prompt tokens (the iteration log). Both with
overlapped scheduling (the default) and without it, where a step's period is its own work.
Engines are built in this process one after another, with ``TRITONLLM_PREFILL_GRAPHS`` set for each.

    python benchmarks/engine/join_latency_bench.py --model smollm2 --results_md benchmarks/results/engine.md
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (command_line, environment_set, git_commit, int_list,  # noqa: E402
                               machine_description, print_table, utc_now, write_config_only_engine)

from engine.executor.runner import PREFILL_GRAPHS_ENV  # noqa: E402
from engine.executor.stats import ITERATION_LOG_ENV, read_iteration_log  # noqa: E402


def measure(engine_dir: str, args, *, graphs: bool, overlap: bool, log_path: str) -> dict[int, dict]:
    """{k: {"ttft_ms": median, "prompt_step_ms": median}} for one executor configuration.

    Each group is waited for: every joining request's first token and a logged step with prompt tokens, so a
    slow step is measured in its own group, never left to spill into the next one's window. A group of each k
    runs first unmeasured: the first prompt steps of a shape compile kernels (and capture graphs); on the
    H200 one such step (306 ms) ran past the k=1 window, which then held no step at all."""
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import OutputConfig, Request

    Path(log_path).unlink(missing_ok=True)
    config = ExecutorConfig(max_tokens_in_paged_kv_cache=args.max_batch_size * args.max_seq_len,
                            enable_kv_cache_reuse=False, disable_overlap_scheduler=not overlap)
    from engine.config import EngineConfig

    vocab_size = EngineConfig.load(engine_dir).model.vocab_size
    rng = random.Random(0)
    prompt = lambda n: [rng.randrange(vocab_size) for _ in range(n)]  # noqa: E731
    first_token_ms: dict[int, float] = {}
    decoding: set[int] = set()
    drain_failed: list[BaseException] = []
    stop = threading.Event()
    label = f"graphs {'on' if graphs else 'off'}, overlap {'on' if overlap else 'off'}"
    with environment_set({PREFILL_GRAPHS_ENV: "1" if graphs else "0", ITERATION_LOG_ENV: log_path}):
        executor = Executor(engine_dir, config)

    def decode_streams(n: int) -> None:  # streams that generate until the run ends (the busy batch joined)
        decoding.update(executor.enqueue_requests([Request(prompt(16), args.max_seq_len - 32, streaming=True,
                                                           end_id=-1) for _ in range(n)]))

    def join(k: int) -> tuple[list[int], list[float]]:
        """k joining requests' ids and the periods of the steps with prompt tokens, once all are in."""
        start = time.time_ns()
        ids = executor.enqueue_requests([Request(prompt(args.prompt_len), 2, end_id=-1, streaming=True,
                                                 output=OutputConfig(return_perf_metrics=True)) for _ in range(k)])
        deadline = time.monotonic() + args.wait_s
        while True:
            missing = [i for i in ids if i not in first_token_ms]  # before the log: its rows up to the first tokens
            steps = [row["latency_ms"] for row in read_iteration_log(log_path, start, time.time_ns())
                     if row["num_ctx_tokens"] > 0]
            if not missing and steps:
                break
            if drain_failed:
                raise RuntimeError(f"{label}, k={k}: reading the responses failed") from drain_failed[0]
            if time.monotonic() > deadline:
                raise RuntimeError(f"{label}, k={k}: within --wait_s {args.wait_s} s, {len(missing)} of {k} joining "
                                   f"requests had no first token, {len(steps)} steps with prompt tokens were logged")
            time.sleep(0.005)
        time.sleep(max(0.0, args.gap_s - (time.time_ns() - start) / 1e9))  # the batch back to decoding only
        return ids, steps

    try:
        def drain() -> None:  # the responses; a joining request's first one carries its perf metrics
            try:
                while not stop.is_set():
                    for response in executor.await_responses(timeout=0.05):
                        perf = response.result.perf if response.result is not None else None
                        if perf is not None and perf.first_token_time_ns and response.request_id not in first_token_ms:
                            first_token_ms[response.request_id] = \
                                (perf.first_token_time_ns - perf.arrival_time_ns) / 1e6
                        if response.request_id in decoding and response.is_final and not stop.is_set():
                            decoding.discard(response.request_id)  # its length reached: another keeps the batch
                            decode_streams(1)
            except BaseException as err:  # the waits in join() raise it
                drain_failed.append(err)

        threading.Thread(target=drain, daemon=True).start()
        decode_streams(args.decoding)
        time.sleep(args.settle_s)
        for k in args.joining:  # warm-up, not measured
            join(k)
        found = {}
        for k in args.joining:
            ids, steps = [], []
            for _ in range(args.repeats):
                group, group_steps = join(k)
                ids += group
                steps += group_steps
            found[k] = {"ttft_ms": statistics.median(first_token_ms[i] for i in ids),
                        "prompt_step_ms": statistics.median(steps)}
            print(f"{label}, k={k}: {found[k]}", flush=True)
        return found
    finally:
        stop.set()
        executor.shutdown()


def markdown(results: dict) -> str:
    runs = results["runs"]
    ms = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    lines = [f"### Requests joining {results['decoding']} decoding streams, {results['model']}: "
             f"{results['date']}, {results['machine']}, commit {results['commit']}", "",
             f"`{results['command']}`  ",
             f"{results['prompt_len']}-token prompts join in groups of k, {results['repeats']} times each. "
             "TTFT: median ms from a joining request's arrival at the executor to its first token. Prompt step: "
             "median period of the steps that carried prompt tokens (with overlap on, a step's period also "
             "holds the next step's launch).", "",
             "| joining k | TTFT eager | TTFT graphs | prompt step eager | prompt step graphs "
             "| TTFT eager, no overlap | TTFT graphs, no overlap | prompt step eager, no overlap | prompt step graphs, no overlap |",
             "|---|---|---|---|---|---|---|---|---|"]
    for k in results["joining"]:
        cells = []
        for overlap in ("overlap", "no_overlap"):
            for field in ("ttft_ms", "prompt_step_ms"):
                for graphs in ("eager", "graphs"):
                    cells.append(ms(runs[f"{graphs}_{overlap}"][str(k)][field]))
        lines.append(f"| {k} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="smollm2", help="a shape of benchmarks/common.py MODELS")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--decoding", type=int, default=56, help="streams generating while requests join")
    parser.add_argument("--joining", default="1,4,16,32,64", help="group sizes k")
    parser.add_argument("--prompt_len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=4)
    parser.add_argument("--gap_s", type=float, default=0.2, help="seconds from a group's arrival to the next one's")
    parser.add_argument("--wait_s", type=float, default=120.0,
                        help="a group's first tokens and prompt step must come within this (else the run stops, named)")
    parser.add_argument("--settle_s", type=float, default=2.0)
    parser.add_argument("--max_batch_size", type=int, default=128)
    parser.add_argument("--max_seq_len", type=int, default=4096)
    parser.add_argument("--out", default="join_latency_bench.json")
    parser.add_argument("--results_md", default=None, help="append the dated table to this file")
    args = parser.parse_args(argv)
    args.joining = int_list(args.joining)

    work = Path(tempfile.mkdtemp(prefix="join-latency-"))
    engine_dir = work / "engine"
    engine_dir.mkdir()
    write_config_only_engine(args.model, args.dtype, args.max_batch_size, args.max_seq_len, 8192, 32,
                             engine_dir=str(engine_dir), max_input_len=args.max_seq_len)
    results = {"date": utc_now(), "commit": git_commit(), "machine": machine_description(),
               "command": command_line(__file__, argv), "model": args.model, "decoding": args.decoding,
               "joining": args.joining, "prompt_len": args.prompt_len, "repeats": args.repeats, "runs": {}}
    for overlap in (True, False):
        for graphs in (False, True):
            name = f"{'graphs' if graphs else 'eager'}_{'overlap' if overlap else 'no_overlap'}"
            found = measure(str(engine_dir), args, graphs=graphs, overlap=overlap, log_path=str(work / f"{name}.log"))
            results["runs"][name] = {str(k): v for k, v in found.items()}
    Path(args.out).write_text(json.dumps(results, indent=1))
    print_table(markdown(results), args.results_md)
    return results


if __name__ == "__main__":
    main()
