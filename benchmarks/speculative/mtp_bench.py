#!/usr/bin/env python3
"""Multi-token prediction drafts (decoding_mode mtp, engine/executor/speculative/mtp.py) on the
DeepSeek-V2-Lite shape with a V3-style MTP module, random weights: what a batch-1 step costs with k
chained drafts, and the speed-up that buys at a stated acceptance (issue 55).

    python benchmarks/speculative/mtp_bench.py [--model deepseek_v2_lite_mtp] [--dtype bfloat16] [--ks 1,2,3,4]
        [--context 512] [--acceptance 0.85,0.7,0.5] [--repeat 20] [--out mtp.json] [--markdown PATH]
    python benchmarks/speculative/mtp_bench.py --tiny          # the tiny DeepSeek on the CPU, seconds

Per k, one sequence at ``--context`` tokens, each time the median of ``--repeat`` runs:

- ``decode_ms``: a plain step, one token through the target (a decode-graph replay on CUDA) and its
  argmax copied to the host;
- ``verify_ms``: the target forward of the executor's verify step, the last known token and k drafts
  with logits at all k + 1 (on CUDA a replay of the prefill graphs' 16-token bucket; ``verify_graphed``
  says whether it was), and the argmaxes to the host;
- ``draft_ms``: the MTP module's part of a step, as MtpProposer.propose runs it: slot L-2 (the target's
  last hidden state and token), then k - 1 chained one-row runs (on CUDA replays of the module's own
  decode graphs, engine/executor/speculative/mtp_graphs.py), each draft's argmax to the host.

Random weights say nothing about acceptance, so it is stated (``--acceptance``, the chance that a
draft is kept given the drafts before it were; DeepSeek-V3's report gives 85-90% for its MTP
module's token). A step then emits E = 1 + a + a^2 + ... + a^k tokens on average, and the
projected speed-up over plain decoding is E x decode_ms / (verify_ms + draft_ms).
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from benchmarks.common import (command_line, git_commit, int_list, machine_summary, print_table, utc_now,
                               write_config_only_engine)
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.speculative.mtp import MtpProposer, _MtpSeq


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="deepseek_v2_lite_mtp")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--device", default="cuda")
    p.add_argument("--ks", type=int_list, default=[1, 2, 3, 4])
    p.add_argument("--context", type=int, default=512)
    p.add_argument("--acceptance", default="0.85,0.7,0.5", help="stated per-draft acceptances, comma-separated")
    p.add_argument("--repeat", type=int, default=20)
    p.add_argument("--tiny", action="store_true", help="deepseek_tiny, float32, on the CPU, few repeats")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    p.add_argument("--markdown", default=None, help="append the table to this file")
    args = p.parse_args(argv)
    if args.tiny:
        args.model, args.dtype, args.device, args.context = "deepseek_tiny", "float32", "cpu", 64
        args.repeat = min(args.repeat, 3)
    args.acceptance = [float(a) for a in args.acceptance.split(",")]
    return args


def _median_ms(fn, repeat: int, device: torch.device) -> float:
    for _ in range(2):  # warm-up: kernels compiled, allocator settled
        fn()
    times = []
    for _ in range(repeat):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        fn()  # every measured call ends in a copy to the host, as the executor's step does
        times.append((time.perf_counter() - start) * 1e3)
    return statistics.median(times)


def measure(runner: ModelRunner, proposer: MtpProposer, k: int, context: int, repeat: int) -> dict:
    """decode_ms, verify_ms and draft_ms of one sequence at ``context`` tokens with k drafts."""
    T = runner.tokens_per_block
    table = list(range(-(-(context + k + 1) // T)))
    tokens = torch.randint(0, runner.vocab_size, (context + k,), generator=torch.Generator().manual_seed(k)).tolist()

    def decode():
        batch = ForwardBatch([tokens[context - 1]], [context - 1], [1], [context], [table[:-(-context // T)]], [0])
        runner.forward(batch).argmax(dim=-1).tolist()

    def verify():
        n = k + 1
        batch = ForwardBatch(tokens[context - 1:context + k], list(range(context - 1, context + k)), [n],
                             [context + k], [table[:-(-(context + k) // T)]], list(range(n)))
        runner.forward(batch).argmax(dim=-1).tolist()

    state = _MtpSeq(runner.model_config.hidden_size, runner.dtype, runner.device)
    assert proposer._reserve_slots(state, context + k)
    state.file_hidden(0, torch.zeros(context - 1, runner.model_config.hidden_size))
    proposer._catch_up([(state, tokens, context)])  # the prompt's slots, off the clock

    def draft():
        state.num_true = context - 2  # as propose: slot L-2 runs, then the chain
        g = proposer._catch_up([(state, tokens, context)])[0]
        drafts = proposer._argmax(g[None])
        proposer._chain([(drafts, state, context, k, g)])

    device = runner.device
    graphs = runner.prefill_graphs
    figures = {"k": k, "decode_ms": _median_ms(decode, repeat, device), "verify_ms": _median_ms(verify, repeat, device),
               "draft_ms": _median_ms(draft, repeat, device),
               "verify_graphed": graphs is not None and k + 1 <= graphs.buckets[-1]}
    proposer.blocks.free(state.block_ids)
    return figures


def speedup(figures: dict, acceptance: float) -> float:
    expected = sum(acceptance ** i for i in range(figures["k"] + 1))
    return expected * figures["decode_ms"] / (figures["verify_ms"] + figures["draft_ms"])


def markdown(result: dict) -> str:
    accs = result["acceptance"]
    head = "| k | decode ms | verify ms | MTP drafts ms | " + " | ".join(f"speed-up at {a:.2f}" for a in accs) + " |"
    rows = [head, "|" + "---|" * (4 + len(accs))]
    for f in result["rows"]:
        rows.append(f"| {f['k']} | {f['decode_ms']:.2f} | {f['verify_ms']:.2f} | {f['draft_ms']:.2f} | "
                    + " | ".join(f"{speedup(f, a):.2f}x" for a in accs) + " |")
    return (f"MTP drafts, {result['model']} {result['dtype']}, batch 1 at {result['context']} tokens, "
            f"{result['machine']}:\n\n" + "\n".join(rows) + "\n")


def main(argv: list[str] | None = None) -> dict:
    args = parse_args(argv)
    max_tokens = args.context + max(args.ks) + 8
    # max_num_tokens 32: the prefill graphs' 16- and 32-token buckets, which a verify step of k < 32
    # drafts replays (fewer captures: the run fits the GPU command's 90 s)
    engine_dir = write_config_only_engine(args.model, args.dtype, max_batch_size=4, max_seq_len=max_tokens,
                                          max_num_tokens=max(32, max(args.ks) + 1), tokens_per_block=64)
    runner = ModelRunner(engine_dir, device=args.device)
    num_blocks = 4 * -(-max_tokens // runner.tokens_per_block)
    runner.allocate_kv_cache(num_blocks)
    proposer = MtpProposer(runner)  # as the executor: its last-layer tap before the graphs are captured
    proposer.start(num_blocks * runner.tokens_per_block, 1, max(args.ks))
    runner.capture_cuda_graphs()
    runner.warmup()
    rows = []
    for k in args.ks:
        rows.append(measure(runner, proposer, k, args.context, args.repeat))
        print(json.dumps(rows[-1]), file=sys.stderr, flush=True)
    proposer.close()
    result = {"model": args.model, "dtype": args.dtype, "context": args.context, "acceptance": args.acceptance,
              "rows": rows, "machine": machine_summary(args.device), "commit": git_commit(), "date": utc_now(),
              "command": command_line(__file__, argv)}
    print_table(markdown(result), args.markdown)
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
