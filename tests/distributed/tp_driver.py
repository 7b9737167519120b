"""Rank 0 of an engine-level tensor-parallel test: greedy decoding straight on ``make_runner``.

    python tests/distributed/tp_driver.py --engine_dir DIR --prompts '[[1,2,3],[4,5]]' \
        --max_tokens 8 --out result.json [--then_wait_for_failure 20]

Runs on world size 1 (a plain ModelRunner) or as rank 0 of many (a LeaderRunner; the other
ranks are ``python -m engine.tensor_parallel.worker``), so the test compares the two with the same code.
Writes JSON: ``tokens`` (generated ids per prompt), ``first_logits`` (the prefill step's last-token
logits per prompt). With ``--then_wait_for_failure S`` it then prints ``IDLE`` and waits up to S
seconds for the leader to notice a lost rank on its own (heartbeat), then tries one more step,
and records ``detected_after_s``, ``failure`` and ``step_error``.
"""
from __future__ import annotations

import argparse
import json
import sys
import time

from engine.executor.overlap import placeholder
from engine.executor.runner import ForwardBatch
from engine.tensor_parallel.distributed import make_runner


class GreedyDecoder:
    """Packs every prompt into one prefill, then decodes one token per sequence per step.

    Sequence i owns blocks [i * blocks_per_seq, (i + 1) * blocks_per_seq) of the pool.
    """

    def __init__(self, runner, prompts: list[list[int]], max_tokens: int):
        self.runner = runner
        self.prompts = prompts
        self.max_tokens = max_tokens
        tpb = runner.tokens_per_block
        longest = max(len(p) for p in prompts) + max_tokens
        self.blocks_per_seq = -(-longest // tpb)
        wanted = self.blocks_per_seq * len(prompts)
        agreed = runner.num_kv_blocks_for(free_mem_fraction=None, max_tokens=wanted * tpb)
        if agreed < wanted:
            raise RuntimeError(f"the ranks agreed on {agreed} KV blocks; this run needs {wanted}")
        runner.allocate_kv_cache(agreed)

    def table(self, seq: int, length: int) -> list[int]:
        first = seq * self.blocks_per_seq
        return list(range(first, first + -(-length // self.runner.tokens_per_block)))

    def prefill_batch(self) -> ForwardBatch:
        tokens, positions, ends = [], [], []
        for prompt in self.prompts:
            tokens += prompt
            positions += range(len(prompt))
            ends.append(len(tokens) - 1)
        lens = [len(p) for p in self.prompts]
        return ForwardBatch(tokens, positions, lens, lens, [self.table(i, n) for i, n in enumerate(lens)], ends)

    def decode_batch(self, last: list[int], lengths: list[int]) -> ForwardBatch:
        n = len(last)
        return ForwardBatch(list(last), [length - 1 for length in lengths], [1] * n, list(lengths),
                            [self.table(i, length) for i, length in enumerate(lengths)], list(range(n)))

    def run_overlapped(self) -> tuple[list[list[int]], list[list[float]]]:
        """As run(), but as the overlapped executor drives it: each step samples into the runner's
        ring (every rank gets the tokens) and the next step names them by placeholder ids, sent
        before this rank reads them."""
        half = self.runner.sampled_ring_slots // 2
        batch = self.prefill_batch()
        batch.sampled_tokens_slot = 0
        logits = self.runner.forward(batch)
        first_logits = logits.tolist()
        on_device = [logits.argmax(-1)]  # each step's tokens, read by the host only at the end
        self.runner.store_sampled_tokens(on_device[-1], batch)
        lengths = [len(p) for p in self.prompts]
        for step in range(1, self.max_tokens):
            lengths = [n + 1 for n in lengths]
            previous = batch.sampled_tokens_slot
            batch = self.decode_batch([placeholder(previous + i) for i in range(len(lengths))], lengths)
            batch.sampled_tokens_slot = (step % 2) * half
            on_device.append(self.runner.forward(batch).argmax(-1))
            self.runner.store_sampled_tokens(on_device[-1], batch)
        columns = [t.tolist() for t in on_device]
        return [list(row) for row in zip(*columns)], first_logits

    def run(self) -> tuple[list[list[int]], list[list[float]]]:
        logits = self.runner.forward(self.prefill_batch())
        first_logits = logits.tolist()
        outputs = [[t] for t in logits.argmax(-1).tolist()]
        lengths = [len(p) for p in self.prompts]
        for _ in range(self.max_tokens - 1):
            lengths = [n + 1 for n in lengths]
            logits = self.runner.forward(self.decode_batch([o[-1] for o in outputs], lengths))
            for out, token in zip(outputs, logits.argmax(-1).tolist()):
                out.append(token)
        return outputs, first_logits


def wait_for_failure(runner, decoder: GreedyDecoder, limit_s: float) -> dict:
    print("IDLE", flush=True)
    started = time.monotonic()
    while getattr(runner, "failure", None) is None and time.monotonic() - started < limit_s:
        time.sleep(0.05)
    result = {"detected_after_s": time.monotonic() - started, "failure": getattr(runner, "failure", None)}
    step_started = time.monotonic()
    try:
        runner.forward(decoder.prefill_batch())
        result["step_error"] = None
    except Exception as err:
        result["step_error"] = f"{type(err).__name__}: {err}"
    result["step_error_after_s"] = time.monotonic() - step_started
    return result


def refuse_bad_batch_then_generate(runner, decoder: GreedyDecoder) -> dict:
    bad = ForwardBatch(token_ids=[1, 2], positions=[0], seq_lens_q=[2], context_lens=[2], block_tables=[[0]],
                       logits_indices=[1])  # two tokens, one position
    try:
        runner.forward(bad)
        refusal = None
    except Exception as err:
        refusal = f"{type(err).__name__}: {err}"
    tokens, _ = decoder.run()
    return {"refusal": refusal, "failure_after_refusal": getattr(runner, "failure", None), "tokens_after": tokens}


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--engine_dir", required=True)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max_tokens", type=int, default=8)
    parser.add_argument("--out", required=True)
    parser.add_argument("--overlapped", action="store_true",
                        help="decode with placeholder ids read from the sampled-token ring, as the executor does")
    parser.add_argument("--then_overlapped", action="store_true",
                        help="then decode the prompts again as --overlapped does (overlapped_tokens)")
    parser.add_argument("--then_wait_for_failure", type=float, default=0.0)
    parser.add_argument("--then_refuse_a_bad_batch", action="store_true",
                        help="then send an inconsistent batch, and generate once more")
    args = parser.parse_args()
    runner = make_runner(args.engine_dir, device="cpu")
    decoder = GreedyDecoder(runner, json.loads(args.prompts), args.max_tokens)
    tokens, first_logits = decoder.run_overlapped() if args.overlapped else decoder.run()
    channel = getattr(runner, "channel", None)
    result = {"tokens": tokens, "first_logits": first_logits, "runner": type(runner).__name__,
              "plans": None if channel is None else ("shared memory" if channel.shm is not None else "gloo")}
    if args.then_overlapped:  # from a fresh prefill into the same blocks: the first run's KV is overwritten
        result["overlapped_tokens"], _ = decoder.run_overlapped()
    if args.then_refuse_a_bad_batch:
        result.update(refuse_bad_batch_then_generate(runner, decoder))
    if args.then_wait_for_failure:
        result.update(wait_for_failure(runner, decoder, args.then_wait_for_failure))
    with open(args.out, "w") as f:
        json.dump(result, f)
    if hasattr(runner, "shutdown"):
        runner.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(main())
