"""Engine load time with the load-time kernel choices cached (kernels/choice_cache.py).

Loads one config-only engine (random weights; Llama-8B shape by default) --loads times, each in a
fresh process as a server restart is, all sharing one choice-cache directory (new and empty unless
--cache-dir) and the machine's Triton cache. Each load prints its [load] lines
($TRITONLLM_LOAD_LOG=1); the first on an empty cache times every choice, the later ones should say
"(cached: M of M)" and make the same choices. --first-off: one load more first with the cache off
(it warms Triton's cache, so the next load shows a restart's choices without this cache). Writes a
JSON with, per load, the choices' and captures' seconds, the cache counts and whether its choices
equal those of the load that wrote the cache.

    python benchmarks/engine/choice_cache_bench.py --first-off --loads 2 --out choices.json
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))


def load_once(args) -> dict:
    """One load in this process: ModelRunner, KV pool, capture_cuda_graphs (the kernel choices first)."""
    import torch

    from engine.executor.runner import ModelRunner
    from kernels.choice_cache import without_timings

    started = time.perf_counter()
    runner = ModelRunner(args.engine_dir, device=args.device)
    runner.allocate_kv_cache(args.kv_blocks)
    choices_started = time.perf_counter()
    runner.capture_cuda_graphs()
    if runner.device.type == "cuda":
        torch.cuda.synchronize()
    return {"load_s": round(time.perf_counter() - started, 1),
            "choices_and_capture_s": round(time.perf_counter() - choices_started, 1),
            "cache": getattr(runner, "choice_cache_counts", {"hits": 0, "lookups": 0}),  # (CPU: no choices)
            "choices": {repr(k): repr(without_timings(v)) for k, v in getattr(runner, "gemm_choices", {}).items()},
            "pdl": getattr(runner, "launch_choice", {}).get("pdl")}


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", default="llama8b")
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--quantization", default=None, help="fp8, ... (default: none)")
    parser.add_argument("--max-batch-size", type=int, default=16)
    parser.add_argument("--max-num-tokens", type=int, default=1040, help="1040: the wide-row choices up to 128 rows")
    parser.add_argument("--max-seq-len", type=int, default=2048)
    parser.add_argument("--kv-blocks", type=int, default=256)
    parser.add_argument("--loads", type=int, default=2)
    parser.add_argument("--cache-dir", default=None, help="default: a new empty directory")
    parser.add_argument("--first-off", action="store_true",
                        help="one load more first, with the choice cache off: it warms Triton's cache, so the next "
                             "load times every choice from compiled kernels (a restart without this cache)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default="choice_cache_bench.json")
    parser.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--engine-dir", default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.child:
        result = load_once(args)
        with open(args.out, "w") as f:
            json.dump(result, f)
        return result

    from benchmarks.common import write_config_only_engine
    from kernels.choice_cache import CACHE_ENV

    engine_dir = write_config_only_engine(args.model, args.dtype, args.max_batch_size, args.max_seq_len,
                                          args.max_num_tokens, 32, args.quantization)
    cache_dir = args.cache_dir or tempfile.mkdtemp(prefix="choice-cache-")
    env = dict(os.environ, TRITONLLM_LOAD_LOG="1", **{CACHE_ENV: cache_dir})
    loads = []
    modes = ["off"] * args.first_off + ["cache"] * args.loads
    for i, mode in enumerate(modes):
        out = f"{args.out}.load{i}"
        started = time.perf_counter()
        print(f"== load {i + 1} of {len(modes)} (choice cache {'off' if mode == 'off' else cache_dir})", flush=True)
        subprocess.run([sys.executable, os.path.abspath(__file__), "--child", "--engine-dir", engine_dir,
                        "--device", args.device, "--kv-blocks", str(args.kv_blocks), "--out", out],
                       env=dict(env, **{CACHE_ENV: "off"}) if mode == "off" else env, check=True)
        with open(out) as f:
            load = json.load(f)
        os.unlink(out)
        load["process_s"], load["choice_cache"] = round(time.perf_counter() - started, 1), mode
        # Against the load that wrote the cache (an uncached load may choose otherwise within timing noise).
        writer = next((earlier for earlier in loads if earlier["choice_cache"] == "cache"), None)
        load["same_choices_as_writer"] = None if mode == "off" or writer is None else (
            load["choices"] == writer["choices"] and load["pdl"] == writer["pdl"])
        loads.append(load)
        print(f"   load {i + 1}: {load['process_s']} s in all, choices + capture {load['choices_and_capture_s']} s, "
              f"cached {load['cache']['hits']} of {load['cache']['lookups']}, same choices as the load that wrote "
              f"the cache: {load['same_choices_as_writer']}", flush=True)
        write_result(args, cache_dir, loads)  # after every load: a run cut by its timeout keeps the loads done
    return write_result(args, cache_dir, loads)


def write_result(args, cache_dir: str, loads: list[dict]) -> dict:
    result = {"args": {k: v for k, v in vars(args).items() if k not in ("child", "engine_dir")},
              "cache_dir": cache_dir,
              "loads": [{k: v for k, v in load.items() if k != "choices"} for load in loads],
              "choices": next((load["choices"] for load in loads if load["choice_cache"] == "cache"), {})}
    with open(args.out, "w") as f:
        json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
