"""Disaggregated prefill/decode on 2 GPUs (issue 57): context on one GPU and generation on the other,
against two aggregated executors on the same GPUs, at the same Poisson load; and the KV transfer alone.

    python benchmarks/engine/disagg_bench.py --out disagg.json --results-md benchmarks/results/engine.md

One process, two Executors (engine/executor/disaggregated.py's ``local`` transport: the blocks are
copied between the pools of the two GPUs, a peer copy over NVLink). They share one interpreter, so each
loop's host work waits for the other's GIL. ``--context_process`` runs the first GPU's executor (the
context side when disaggregated, in both modes) in an engine process of its own
(engine/executor/engine_process.py, as ``tritonllm serve --disaggregated`` does): the KV then goes
through ``--kv_transfer``: ``shm`` (the default; pinned host memory and a file in
``TRITONLLM_KV_TRANSFER_DIR``, else /dev/shm, else the output's folder when /dev/shm has less than 8 GB
free), ``cuda_ipc`` (GPU to GPU: the generation process maps the context pool through CUDA IPC), ``auto``
(cuda_ipc where the generation side can, else shm) or ``nixl``. Random weights of the model's
shape made on each GPU from the same seed (``extra.random_weights_seed``), so both executors hold the
same model. Sections (``--sections``):

- ``transfer``: ``copy_blocks`` of one prompt's blocks from a pool on ``--devices``' first GPU to one
  on the second, the pools laid out as the executors' (layers, 2, blocks, T, kv heads, head dim; FP8
  or the model's dtype), median of ``--transfer_repeats``: ms and GB/s per prompt length.
- ``serve``: the same seeded requests (prompt lengths uniform in ``--prompt_lens``, ``--output_len``
  tokens, streaming, greedy) arrive at each of ``--rates`` requests/s (Poisson) for ``--seconds`` in two modes:
  ``aggregated`` (each request to one of the two executors, in turn) and ``disaggregated`` (a
  ``context_only`` request on the first GPU; when its first token and ``context_phase_params``
  come back, a ``generation_only`` request with them on the second). Per mode: TTFT and ITL
  (inter-token gaps of the stream, a coalesced chunk's gap shared by its tokens) p50/p99, output
  tok/s per GPU, and for disaggregated the hand-off (context's first token to the generation
  stream's first token) and the executor's own KV-transfer time (``kv_cache_transfer_ms``, the
  figure nv_trt_llm_disaggregated_serving_metrics reports).

``--model tiny --device cpu`` runs both sections on the CPU (two executors of one device) as a
rehearsal; the figures then say nothing.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import threading
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (add_model_arguments, command_line, git_commit, percentile, print_table,  # noqa: E402
                               utc_now, write_config_only_engine)
from engine.executor.disaggregated import copy_blocks  # noqa: E402
from engine.executor.load_phases import LOAD_LOG_ENV  # noqa: E402

SECTIONS = ("transfer", "serve")


def devices_of(args) -> tuple[str, str]:
    if args.device == "cpu":
        return "cpu", "cpu"
    if torch.cuda.device_count() < 2:
        raise SystemExit(f"disagg_bench needs 2 GPUs, found {torch.cuda.device_count()} (--device cpu rehearses it)")
    return "cuda:0", "cuda:1"


# ---- the KV transfer alone ---------------------------------------------------------------------------


def bench_transfer(args, model_cfg: dict) -> list[dict]:
    """copy_blocks of one prompt's blocks between two pools shaped as the executors' pools."""
    src_device, dst_device = devices_of(args)
    dtype = torch.float8_e4m3fn if args.kv_cache_dtype == "fp8" else getattr(torch, args.dtype)
    layers, heads = model_cfg["num_layers"], model_cfg["num_kv_heads"]
    head_dim = model_cfg.get("head_dim") or model_cfg["hidden_size"] // model_cfg["num_heads"]
    page = args.tokens_per_block
    blocks = -(-max(args.transfer_lens) // page) + 1
    shape = (layers, 2, blocks, page, heads, head_dim)
    src = torch.empty(shape, dtype=dtype, device=src_device)  # contents do not matter to a copy
    dst = torch.empty(shape, dtype=dtype, device=dst_device)
    rows = []
    for tokens in args.transfer_lens:
        n = -(-tokens // page)
        ids = list(range(1, n + 1))
        copy_blocks(src, ids, dst, ids)  # warm-up (peer access set up, kernels loaded)
        times, device_ms = [], []
        for _ in range(args.transfer_repeats):
            started = time.perf_counter()
            device_ms.append(copy_blocks(src, ids, dst, ids))  # the serving path's pull; returns once it is done
            times.append(time.perf_counter() - started)
        seconds = statistics.median(times)
        nbytes = n * src[:, :, 0].numel() * src.element_size()
        rows.append({"tokens": tokens, "blocks": n, "mb": nbytes / 1e6, "ms": seconds * 1e3, "gb_s": nbytes / seconds / 1e9,
                     "device_ms": statistics.median(device_ms)})  # events on the pull stream (kv_cache_transfer_ms)
        print(f"[disagg_bench] transfer {tokens} tokens ({n} blocks, {nbytes / 1e6:.1f} MB): "
              f"{seconds * 1e3:.3f} ms, {rows[-1]['gb_s']:.1f} GB/s (device {rows[-1]['device_ms']:.3f} ms)", flush=True)
    return rows


# ---- serving at a Poisson load -----------------------------------------------------------------------


def make_engine(args) -> str:
    max_prompt = max(args.prompt_lens)
    return write_config_only_engine(args.model, args.dtype, args.max_batch_size, max_prompt + args.output_len + 64,
                                    args.max_num_tokens, args.tokens_per_block,
                                    None if args.quantization == "none" else args.quantization,
                                    max_input_len=max_prompt)


def start_executors(args, engine_dir: str):
    from engine.executor.engine_process import EngineProcess
    from engine.executor.executor import Executor, ExecutorConfig

    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=0.85, enable_kv_cache_reuse=False, enable_chunked_context=True,
                            kv_cache_dtype=args.kv_cache_dtype if args.kv_cache_dtype != "auto" else None,
                            max_tokens_in_paged_kv_cache=args.kv_tokens)
    first, second = devices_of(args)
    if args.context_process:
        transfer_dir = os.environ.get("TRITONLLM_KV_TRANSFER_DIR", "/dev/shm")
        if not os.path.isdir(transfer_dir) or shutil.disk_usage(transfer_dir).free < 8 << 30:  # (a container's 64 MB)
            os.environ["TRITONLLM_KV_TRANSFER_DIR"] = str(Path(args.out).resolve().parent)
        print(f"[disagg_bench] context executor in its own process; KV files in "
              f"{os.environ.get('TRITONLLM_KV_TRANSFER_DIR', transfer_dir)}", flush=True)
        executors = [EngineProcess(engine_dir, config, device=first), Executor(engine_dir, config, device=second)]
    else:
        executors = [Executor(engine_dir, config, device=first), Executor(engine_dir, config, device=second)]
    for ex in executors:  # warm-up: compile the prefill and decode shapes before anything is timed
        warm(ex, [Request_(list(range(1, 300)), 8) for _ in range(4)])
    # one hand-off of the longest prompt: the transfer's streams, staging and pinned buffers exist before timing
    vocab = executors[1].runner.vocab_size
    context = Request_([1 + i % (vocab - 1) for i in range(max(args.prompt_lens))], 1, request_type="context_only",
                       kv_transfer=args.kv_transfer if args.context_process else None)
    (rid,) = executors[0].enqueue_requests([context])
    params = None
    while params is None:
        for response in executors[0].await_responses(timeout=1.0):
            if response.request_id == rid and (response.error or response.result.is_final):
                assert response.error is None, response.error
                params = response.result.context_phase_params
    warm(executors[1], [Request_(list(context.input_token_ids), 4, request_type="generation_only",
                                 context_phase_params=params)])
    return executors


def Request_(prompt: list[int], max_tokens: int, **kw):
    from engine.executor.request import OutputConfig, Request, SamplingConfig

    return Request(prompt, max_tokens, sampling=SamplingConfig(top_k=1),
                   output=OutputConfig(exclude_input_from_output=True), **kw)


def warm(executor, requests: list) -> None:
    ids = set(executor.enqueue_requests(requests))
    while ids:
        for response in executor.await_responses(timeout=1.0):
            if response.error or response.result.is_final:
                ids.discard(response.request_id)


def workload(args, vocab: int, rate: float) -> list[tuple[float, list[int]]]:
    """(arrival offset in s, prompt) of every request at ``rate``: the same for both modes."""
    rng = random.Random(57)
    low, high = min(args.prompt_lens), max(args.prompt_lens)
    at, out = 0.0, []
    for _ in range(max(4, int(rate * args.seconds))):
        out.append((at, [rng.randrange(1, vocab) for _ in range(rng.randint(low, high))]))
        at += rng.expovariate(rate)
    return out


class Streams:
    """Per request: when it was sent, when each token batch arrived; filled by one thread per executor."""

    def __init__(self):
        self.lock = threading.Lock()
        self.sent, self.first, self.last, self.count, self.gaps, self.handoff = {}, {}, {}, {}, [], []
        self.done = 0
        self.errors = []

    def tokens(self, key, n: int, now: float) -> None:
        with self.lock:
            if n and key not in self.first:
                self.first[key] = now
            elif n:
                self.gaps.append((now - self.last[key]) / n)
            if n:
                self.last[key] = now
                self.count[key] = self.count.get(key, 0) + n


def pump(executor, streams: Streams, keys: dict, handle, stop: threading.Event) -> None:
    """Collect ``executor``'s responses; ``keys`` maps its request ids to the bench's request keys;
    ``handle(key, response or None on an error, arrival time)``."""
    while not stop.is_set():
        for response in executor.await_responses(timeout=0.2):
            now = time.perf_counter()
            with streams.lock:
                key = keys.get(response.request_id)
            if key is None:
                continue
            if response.error:
                streams.errors.append(response.error)
            handle(key, None if response.error else response, now)


def run_mode(mode: str, executors, requests, args, rate: float) -> dict:
    streams, stop = Streams(), threading.Event()
    keys = [{}, {}]  # per executor: its request id -> the bench's key (index into requests)
    context, generation = executors
    pending_handoff, repeat_pending = set(), set()

    def finish() -> None:
        with streams.lock:
            streams.done += 1

    def plain(key, response, now):  # aggregated: a whole request on one executor
        if response is None:
            return finish()
        streams.tokens(key, len(response.result.output_token_ids[0]), now)
        if response.result.is_final:
            finish()

    def context_phase(key, response, now):  # context executor: first token + params -> generation_only
        if response is None:
            return finish()
        if not response.result.is_final:
            return
        streams.tokens(key, len(response.result.output_token_ids[0]), now)  # the first token: TTFT
        request = Request_(requests[key][1], args.output_len, streaming=True, request_type="generation_only",
                           context_phase_params=response.result.context_phase_params)
        with streams.lock:
            pending_handoff.add(key)
            repeat_pending.add(key)
            (rid,) = generation.enqueue_requests([request])
            keys[1][rid] = key

    def generation_phase(key, response, now):
        # A generation_only stream sends the context's first token again first: only what is new counts.
        if response is None:
            return finish()
        new = len(response.result.output_token_ids[0])
        with streams.lock:
            if key in repeat_pending and new:
                repeat_pending.discard(key)
                new -= 1
            if key in pending_handoff and new:  # the first new token: the hand-off (also an ITL gap, as a client sees it)
                pending_handoff.discard(key)
                streams.handoff.append((now - streams.last[key]) * 1e3)
        if new:
            streams.tokens(key, new, now)
        if response.result.is_final:
            finish()

    callbacks = [plain, plain] if mode == "aggregated" else [context_phase, generation_phase]
    threads = [threading.Thread(target=pump, args=(ex, streams, keys[i], callbacks[i], stop), daemon=True)
               for i, ex in enumerate(executors)]
    for thread in threads:
        thread.start()
    imports = generation.disagg.imports  # (the generation side: kv_import.py)
    transfers_before = (imports.num_transfers, imports.kv_cache_transfer_ms)
    started = time.perf_counter()
    for key, (at, prompt) in enumerate(requests):
        delay = started + at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        if mode == "aggregated":
            target, request = key % 2, Request_(prompt, args.output_len, streaming=True)
        else:
            target, request = 0, Request_(prompt, 1, request_type="context_only",
                                          kv_transfer=args.kv_transfer if args.context_process else None)
        with streams.lock:
            (rid,) = executors[target].enqueue_requests([request])
            keys[target][rid] = key
            streams.sent[key] = time.perf_counter()
    deadline = time.perf_counter() + args.drain_timeout
    while streams.done < len(requests) and time.perf_counter() < deadline:
        time.sleep(0.05)
    elapsed = time.perf_counter() - started
    stop.set()
    for thread in threads:
        thread.join()
    ttft = [(streams.first[k] - streams.sent[k]) * 1e3 for k in streams.first]
    output = sum(streams.count.values())  # requests x output_len when every request finished
    row = {"mode": mode, "rate": rate, "requests": len(requests), "finished": streams.done, "errors": streams.errors[:3],
           "output_tokens": output,
           "seconds": elapsed, "output_tok_s": output / elapsed, "output_tok_s_per_gpu": output / elapsed / 2,
           "ttft_ms_p50": percentile(ttft, 50), "ttft_ms_p99": percentile(ttft, 99),
           "itl_ms_p50": percentile(streams.gaps, 50) * 1e3, "itl_ms_p99": percentile(streams.gaps, 99) * 1e3}
    if mode == "disaggregated":
        transfers = imports.num_transfers - transfers_before[0]
        row.update({"handoff_ms_p50": percentile(streams.handoff, 50), "handoff_ms_p99": percentile(streams.handoff, 99),
                    "kv_transfers": transfers,
                    "kv_transfer_ms_mean": (imports.kv_cache_transfer_ms - transfers_before[1]) / max(1, transfers),
                    "kv_transfer_chosen": dict(generation.disagg.ipc.chosen)})  # (cuda_ipc / auto: what moved the KV)
    print(f"[disagg_bench] {mode}: " + json.dumps({k: (round(v, 2) if isinstance(v, float) else v) for k, v in row.items()}),
          flush=True)
    return row


def bench_serve(args, rows: list, save) -> list[dict]:
    """Appends a row per rate and mode to ``rows``, ``save()`` after each (a run cut short keeps them)."""
    engine_dir = make_engine(args)
    executors = start_executors(args, engine_dir)
    try:
        for rate in args.rates:
            requests = workload(args, executors[1].runner.vocab_size, rate)  # (executors[0] may be a process)
            print(f"[disagg_bench] {len(requests)} requests at {rate}/s, prompts {min(args.prompt_lens)}-"
                  f"{max(args.prompt_lens)}, {args.output_len} out", flush=True)
            for mode in args.modes:
                rows.append(run_mode(mode, executors, requests, args, rate))
                save()
        return rows
    finally:
        for ex in executors:
            ex.shutdown()


def markdown(results: dict) -> str:
    lines = [f"\n### Disaggregated prefill/decode: {results['model']} random weights, {results['date']}\n",
             f"`{results['command']}` on {results['gpus']} (commit {results['commit']}"
             f"{'; GPU 0 executor in its own process, KV over ' + results.get('kv_transfer', 'shm') if results.get('context_process') else ''}).\n"]
    if results.get("transfer"):
        lines += ["| KV transfer, prompt tokens | MB | ms | GB/s |", "|---:|---:|---:|---:|"]
        lines += [f"| {r['tokens']} | {r['mb']:.1f} | {r['ms']:.3f} | {r['gb_s']:.1f} |" for r in results["transfer"]]
        lines.append("")
    if results.get("serve"):
        lines += ["| mode | rate req/s | finished | TTFT p50 / p99 ms | ITL p50 / p99 ms | out tok/s per GPU | hand-off p50 / p99 ms | "
                  "KV transfer ms (mean) |", "|---|---:|---:|---:|---:|---:|---:|---:|"]
        for r in results["serve"]:
            handoff = (f"{r['handoff_ms_p50']:.1f} / {r['handoff_ms_p99']:.1f}" if "handoff_ms_p50" in r else "-")
            transfer = f"{r['kv_transfer_ms_mean']:.2f}" if "kv_transfer_ms_mean" in r else "-"
            lines.append(f"| {r['mode']} | {r['rate']:g} | {r['finished']}/{r['requests']} | {r['ttft_ms_p50']:.1f} / {r['ttft_ms_p99']:.1f} | "
                         f"{r['itl_ms_p50']:.2f} / {r['itl_ms_p99']:.2f} | {r['output_tok_s_per_gpu']:.0f} | {handoff} | {transfer} |")
    return "\n".join(lines) + "\n"


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, device_help="cuda (GPUs 0 and 1) or cpu (a rehearsal: two executors on the CPU)")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma list of " + ", ".join(SECTIONS))
    parser.add_argument("--modes", default="aggregated,disaggregated", help="serve: comma list of aggregated, disaggregated")
    parser.add_argument("--quantization", default="fp8", help="the engine's weights: fp8 or none")
    parser.add_argument("--kv_cache_dtype", default="fp8", choices=["fp8", "auto"])
    parser.add_argument("--tokens_per_block", type=int, default=32)
    parser.add_argument("--max_batch_size", type=int, default=128)
    parser.add_argument("--max_num_tokens", type=int, default=8192, help="tokens per step (prompts are chunked to it)")
    parser.add_argument("--kv_tokens", type=int, default=None, help="KV pool tokens per executor (default: 85%% of free memory)")
    parser.add_argument("--prompt_lens", default="2048,8192", help="serve: prompt lengths drawn uniformly between these")
    parser.add_argument("--output_len", type=int, default=256)
    parser.add_argument("--rates", default="1,2", help="serve: comma list of requests/s (Poisson), each run in every mode")
    parser.add_argument("--seconds", type=float, default=60.0, help="serve: arrivals span this long (rate x seconds requests per rate)")
    parser.add_argument("--drain_timeout", type=float, default=120.0, help="serve: seconds after the last arrival, per mode")
    parser.add_argument("--transfer_lens", default="2048,4096,8192", help="transfer: prompt lengths")
    parser.add_argument("--transfer_repeats", type=int, default=20)
    parser.add_argument("--context_process", action="store_true",
                        help="serve: the first GPU's executor in an engine process of its own (KV over --kv_transfer)")
    parser.add_argument("--kv_transfer", default="shm", choices=["shm", "cuda_ipc", "auto", "nixl"],
                        help="with --context_process: how the KV leaves the context process")
    parser.add_argument("--out", default="disagg_bench.json")
    parser.add_argument("--results-md", dest="results_md", default=None, help="append the markdown table here")
    args = parser.parse_args(argv)
    args.sections = [s for s in args.sections.split(",") if s]
    args.modes = [m for m in args.modes.split(",") if m]
    bad = sorted(set(args.sections) - set(SECTIONS)) + sorted(set(args.modes) - {"aggregated", "disaggregated"})
    if bad:
        parser.error(f"unknown section(s) or mode(s) {bad}")
    args.prompt_lens = [int(x) for x in args.prompt_lens.split(",")]
    args.rates = [float(x) for x in args.rates.split(",")]
    args.transfer_lens = [int(x) for x in args.transfer_lens.split(",")]
    return args


def main(argv=None) -> dict:
    from benchmarks.common import MODELS

    args = parse_args(argv)
    devices_of(args)
    os.environ.setdefault(LOAD_LOG_ENV, "1")  # a timestamped line per phase of each executor's start
    results = {"date": utc_now(), "model": args.model, "commit": git_commit(), "command": command_line(__file__),
               "gpus": f"2x {torch.cuda.get_device_name(0)}" if args.device != "cpu" else "cpu",
               "context_process": args.context_process, "kv_transfer": args.kv_transfer}
    def save() -> None:  # whatever ran is kept if a later part fails or is cut
        with open(args.out, "w") as f:
            json.dump(results, f, indent=2)

    for section in args.sections:
        if section == "transfer":
            results["transfer"] = bench_transfer(args, MODELS[args.model])
        else:
            bench_serve(args, results.setdefault("serve", []), save)
        save()
    print_table(markdown(results), args.results_md)
    return results


if __name__ == "__main__":
    main()
