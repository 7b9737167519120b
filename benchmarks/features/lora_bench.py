"""What LoRA adapters cost through the executor, each figure beside its base-model baseline from
the same executor and lease (issue 29).

    python benchmarks/features/lora_bench.py [--model llama8b] [--dtype bfloat16] [--quantization fp8]
        [--rank 16] [--sections decode,offline,first_use,mixed] [--results-md benchmarks/results/features.md]

An executor with LoRA on (``--adapters`` slots of rank ``--rank``, 64 for ``mixed``; random-weight engine of the
model's shape, as benchmarks/common.py write_config_only_engine makes it). Random adapters of rank ``--rank`` on all
seven projections (q, k, v, o, gate, up, down), weights in the model dtype, loaded through the
executor's own path (a PEFT directory per adapter, written first). Base rows on that executor
replay the plain decode graphs, the path of an engine without LoRA.

Sections:
- ``decode``: batch-1 decode tok/s (256 tokens after a 128-token prompt), base and with an adapter.
- ``offline``: 128/128, ``--requests`` at once, base, then spread round-robin over ``--adapters``
  adapters; output tok/s.
- ``first_use``: time to first token of a request whose adapter was never seen (PEFT directory read,
  parsed, copied into a slot) and of the same request once the adapter is cached; a base request's
  for reference.
- ``mixed``: decode tok/s of 64 rows spread over 1, 4, 16 and 64 adapters, and of 64 base rows.
"""
from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
from safetensors.torch import save_file

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (add_model_arguments, command_line, device_name, git_commit, print_table, utc_now,  # noqa: E402
                               write_config_only_engine)
from benchmarks.engine.engine_bench import iteration_breakdown  # noqa: E402

PEFT_NAMES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj", "o": "self_attn.o_proj",
              "gate": "mlp.gate_proj", "up": "mlp.up_proj", "down": "mlp.down_proj"}


def write_peft_adapter(config, path: str, rank: int, seed: int, dtype: torch.dtype, b_std: float = 0.01) -> str:
    """A PEFT directory (adapter_config.json + adapter_model.safetensors) with random weights on
    every projection of ``config``'s model: A ~ N(0, 1/in_features), B ~ N(0, b_std^2), as peft's
    save_pretrained lays them out. (The integration tests use it too, with a B large enough to
    move greedy decoding.)"""
    from engine.lora.adapter import module_shape

    generator = torch.Generator().manual_seed(seed)
    tensors = {}
    for layer in range(config.num_layers):
        for module, name in PEFT_NAMES.items():
            fan_in, fan_out = module_shape(config, module)
            prefix = f"base_model.model.model.layers.{layer}.{name}"
            tensors[f"{prefix}.lora_A.weight"] = (torch.randn(rank, fan_in, generator=generator) / fan_in ** 0.5).to(dtype)
            tensors[f"{prefix}.lora_B.weight"] = (torch.randn(fan_out, rank, generator=generator) * b_std).to(dtype)
    os.makedirs(path, exist_ok=True)
    save_file(tensors, os.path.join(path, "adapter_model.safetensors"))
    with open(os.path.join(path, "adapter_config.json"), "w") as f:
        json.dump({"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": rank, "lora_alpha": 2 * rank,
                   "target_modules": [n.split(".")[1] for n in PEFT_NAMES.values()], "bias": "none",
                   "use_rslora": False, "use_dora": False, "modules_to_save": None, "fan_in_fan_out": False}, f)
    return path


def run_requests(executor, requests) -> list:
    """Enqueue all at once; every request's final Result (errors raise)."""
    ids = executor.enqueue_requests(requests)
    pending, results = set(ids), {}
    while pending:
        for response in executor.await_responses(timeout=1.0):
            if response.error:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
            if response.result.is_final and response.request_id in pending:
                pending.discard(response.request_id)
                results[response.request_id] = response.result
    return [results[i] for i in ids]


def make_requests(vocab: int, loras: list, prompt_len: int, out_len: int, seed: int):
    from engine.executor.request import OutputConfig, Request

    rng = random.Random(seed)
    output = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
    return [Request(input_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)], max_tokens=out_len,
                    output=output, lora=lora) for lora in loras]


def decode_tok_s(results) -> float:
    """Rows x the median request's decode rate (first to last token)."""
    rates = [(len(r.output_token_ids[0]) - 1) / max(1e-9, (r.perf.last_token_time_ns - r.perf.first_token_time_ns) / 1e9)
             for r in results]
    return len(results) * statistics.median(rates)


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_arguments(parser)
    parser.add_argument("--quantization", default=None, choices=[None, "fp8"])
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--adapters", type=int, default=16, help="adapters the offline requests spread over")
    parser.add_argument("--requests", type=int, default=1024)
    parser.add_argument("--max-batch-size", type=int, default=256)
    parser.add_argument("--sections", default="decode,offline,first_use,mixed")
    parser.add_argument("--out", default="lora_bench.json")
    parser.add_argument("--results-md", default=None)
    return parser.parse_args(argv)


def offline(executor, vocab: int, loras: list, label: str) -> tuple[float, dict]:
    """128/128, all requests at once: (output tok/s, where the steps' time went)."""
    requests = make_requests(vocab, loras, 128, 128, seed=3)
    since_ns = time.time_ns()
    started = time.perf_counter()
    done = run_requests(executor, requests)
    elapsed = time.perf_counter() - started
    return sum(len(r.output_token_ids[0]) for r in done) / elapsed, iteration_breakdown(executor, since_ns)


def main(argv=None) -> dict:
    args = parse_args(argv)
    import gc

    from engine.executor.executor import Executor, ExecutorConfig
    from engine.executor.request import LoraRequest
    from engine.lora.adapter import load_peft_adapter

    sections = args.sections.split(",")
    engine_dir = write_config_only_engine(args.model, args.dtype, args.max_batch_size, 2048, 8192, 32, args.quantization)

    def start(max_loras: int):
        config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=0.4, enable_kv_cache_reuse=False, enable_lora=True,
                                max_loras=max_loras, max_lora_rank=args.rank, iter_stats_max_iterations=5000,
                                lora_cache_host_memory_bytes=32 << 30)
        started = time.perf_counter()
        executor = Executor(engine_dir, config, device=args.device)
        return executor, time.perf_counter() - started

    max_loras = max(args.adapters, 2)
    executor, load_s = start(max_loras)
    model_config, vocab = executor.runner.model_config, executor.runner.vocab_size
    dtype = executor.runner.dtype
    work = tempfile.mkdtemp(prefix="lora-bench-")
    started = time.perf_counter()
    dirs = [write_peft_adapter(model_config, os.path.join(work, f"a{i}"), args.rank, seed=i, dtype=dtype)
            for i in range(max(64, args.adapters) + 2)]
    print(f"engine loaded in {load_s:.1f} s; {len(dirs)} adapters written in {time.perf_counter() - started:.1f} s",
          flush=True)

    def lora(i: int):
        return LoraRequest(task_id=i + 1, path=dirs[i], name=f"a{i}")

    def warm_up(executor, count: int) -> None:
        """Prefill and decode kernels compiled, ``count`` adapters parsed and in slots."""
        run_requests(executor, make_requests(vocab, [None] * 4 + [lora(i) for i in range(count)], 64, 8, seed=1))

    results = {"date": utc_now(), "gpu": device_name(args.device), "commit": git_commit(), "model": args.model, "dtype": args.dtype, "quantization": args.quantization,
               "rank": args.rank, "max_loras": max_loras, "engine_load_s": load_s,
               "slot_mib": executor.runner.lora_slot_bytes(args.rank) / 2**20,
               "command": command_line(__file__, argv)}
    warm_up(executor, max_loras)

    if "decode" in sections:
        base = decode_tok_s(run_requests(executor, make_requests(vocab, [None], 128, 256, seed=2)))
        adapted = decode_tok_s(run_requests(executor, make_requests(vocab, [lora(0)], 128, 256, seed=2)))
        base_again = decode_tok_s(run_requests(executor, make_requests(vocab, [None], 128, 256, seed=2)))
        results["decode"] = {"base_tok_s": [base, base_again], "lora_tok_s": adapted,
                             "ratio": adapted / statistics.mean([base, base_again])}
        print("decode", results["decode"], flush=True)

    if "offline" in sections:
        rows = {}
        rows["base"], rows["base_steps"] = offline(executor, vocab, [None] * args.requests, "base")
        rows["lora"], rows["lora_steps"] = offline(
            executor, vocab, [lora(i % args.adapters) for i in range(args.requests)], "lora")
        rows["ratio"] = rows["lora"] / rows["base"]
        results["offline"] = {"requests": args.requests, "adapters": args.adapters, "slots": max_loras, **rows}
        print("offline", results["offline"], flush=True)

    if "first_use" in sections:
        def ttft_ms(lora_request) -> float:
            (result,) = run_requests(executor, make_requests(vocab, [lora_request], 128, 4, seed=4))
            return (result.perf.first_token_time_ns - result.perf.arrival_time_ns) / 1e6

        fresh = len(dirs) - 1
        started = time.perf_counter()  # the parse alone (a loader thread's part), of the spare adapter
        load_peft_adapter(dirs[fresh - 1], model_config, args.rank)
        parse_ms = (time.perf_counter() - started) * 1e3
        results["first_use"] = {"parse_ms": parse_ms, "base_ttft_ms": ttft_ms(None),
                                "new_adapter_ttft_ms": ttft_ms(lora(fresh)),
                                "cached_adapter_ttft_ms": ttft_ms(lora(fresh)),
                                "adapter_file_mib": os.path.getsize(os.path.join(dirs[fresh], "adapter_model.safetensors")) / 2**20}
        print("first_use", results["first_use"], flush=True)

    if "mixed" in sections:  # 64 adapters need 64 slots: an executor of its own
        executor.shutdown()
        del executor
        gc.collect()
        torch.cuda.empty_cache()
        executor, _ = start(64)
        warm_up(executor, 64)
        mixed = {"base": decode_tok_s(run_requests(executor, make_requests(vocab, [None] * 64, 128, 128, seed=5)))}
        for count in (1, 4, 16, 64):
            done = run_requests(executor, make_requests(vocab, [lora(i % count) for i in range(64)], 128, 128, seed=5))
            mixed[count] = decode_tok_s(done)
        results["mixed_64_rows"] = mixed
        print("mixed", mixed, flush=True)
        if "offline" in sections:  # the same offline run with 64 slots
            rows = {}
            rows["base"], rows["base_steps"] = offline(executor, vocab, [None] * args.requests, "base")
            rows["lora"], rows["lora_steps"] = offline(
                executor, vocab, [lora(i % args.adapters) for i in range(args.requests)], "lora")
            rows["ratio"] = rows["lora"] / rows["base"]
            results["offline_64_slots"] = rows
            print("offline_64_slots", rows, flush=True)
    executor.shutdown()
    with open(args.out, "w") as f:
        json.dump(results, f, indent=2)
    print_table(markdown(results), args.results_md)
    return results


def markdown(r: dict) -> str:
    lines = [f"### {r['date']}, {r['gpu']}, commit {r['commit']}: {r['model']} {r['dtype']}"
             f"{' FP8 weights' if r['quantization'] else ''}, rank {r['rank']}, {r['max_loras']} slots "
             f"({r['slot_mib']:.0f} MiB each)", "", f"`{r['command']}`", "",
             "| measure | base | with adapters | ratio |", "|---|---|---|---|"]
    if "decode" in r:
        d = r["decode"]
        lines.append(f"| batch-1 decode, tok/s (rank {r['rank']} on q,k,v,o,gate,up,down) | "
                     f"{' / '.join(f'{v:.1f}' for v in d['base_tok_s'])} | {d['lora_tok_s']:.1f} | {d['ratio']:.3f} |")
    if "offline" in r:
        o = r["offline"]
        lines.append(f"| 128/128 offline, {o['requests']} requests over {o['adapters']} adapters ({o['slots']} slots), "
                     f"output tok/s | {o['base']:.0f} | {o['lora']:.0f} | {o['ratio']:.3f} |")
    if "offline_64_slots" in r:
        o = r["offline_64_slots"]
        lines.append(f"| the same with 64 slots, output tok/s | {o['base']:.0f} | {o['lora']:.0f} | {o['ratio']:.3f} |")
    if "mixed_64_rows" in r:
        m = r["mixed_64_rows"]
        for count in (1, 4, 16, 64):
            value = m.get(count, m.get(str(count)))
            lines.append(f"| 64 decode rows over {count} adapter{'s' if count > 1 else ''}, tok/s | {m['base']:.0f} | "
                         f"{value:.0f} | {value / m['base']:.3f} |")
    if "first_use" in r:
        f = r["first_use"]
        lines += ["", f"Time to first token of a 128-token prompt, idle engine: base {f['base_ttft_ms']:.1f} ms; "
                  f"an adapter never seen before, read from its PEFT directory ({f['adapter_file_mib']:.0f} MiB) "
                  f"{f['new_adapter_ttft_ms']:.1f} ms (of which parsing the directory took {f.get('parse_ms', 0):.0f} ms); "
                  f"the same adapter again {f['cached_adapter_ttft_ms']:.1f} ms."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    main()
