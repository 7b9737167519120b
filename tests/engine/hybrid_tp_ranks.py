"""Tensor-parallel jobs for the hybrid models' gloo test (gloo_ranks.py runs ``hybrid_steps`` on
both ranks; it lives here, importable, because the pair pickles jobs by reference)."""
from __future__ import annotations

import random

import torch

from engine.executor.runner import ForwardBatch, ModelRunner

# Two sequences: A's 30-token prompt in chunks of 11 and 19 (edges inside SSD chunks and conv
# windows), B's 5-token prompt beside A's second chunk, then decodes of both, and a last step
# that mixes B's decode with a fresh 9-token prompt C.
PROMPT_A, PROMPT_B, PROMPT_C = (30, 5, 9)
DECODES = 3


def _tokens(n: int, seed: int, vocab: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, vocab) for _ in range(n)]


def hybrid_steps(runner: ModelRunner, vocab: int, feed: list[int] | None = None,
                 graphs: bool = False) -> tuple[torch.Tensor, list[int]]:
    """Logits of every new token over the steps above (rows stacked) and the greedy ids of A's and
    B's decodes (each decode feeds the previous step's argmax back, or with ``feed`` those ids:
    another engine's greedy ids, so that both engines' logits are of the same tokens). ``graphs``
    (CUDA): decode-only steps replay the runner's captured graphs."""
    runner.allocate_state_cache(4)
    runner.allocate_kv_cache(16)
    if graphs:
        runner.capture_cuda_graphs()
    blocks = {0: [5, 2, 9], 1: [7], 2: [11]}  # 16-token blocks, scattered
    lengths = {0: 0, 1: 0, 2: 0}
    slots = {0: 3, 1: 0, 2: 1}
    a, b, c = _tokens(PROMPT_A, 1, vocab), _tokens(PROMPT_B, 2, vocab), _tokens(PROMPT_C, 3, vocab)

    def step(chunks: list[tuple[int, list[int]]]) -> list[torch.Tensor]:
        ids, positions, seq_lens, context, tables = [], [], [], [], []
        for seq, tokens in chunks:
            start = lengths[seq]
            ids += tokens
            positions += range(start, start + len(tokens))
            seq_lens.append(len(tokens))
            lengths[seq] = start + len(tokens)
            context.append(lengths[seq])
            tables.append(blocks[seq][:-(-lengths[seq] // runner.tokens_per_block)])
        batch = ForwardBatch(ids, positions, seq_lens, context, tables, list(range(len(ids))),
                             state_slots=[slots[seq] for seq, _ in chunks])
        return list(runner.forward(batch).float().cpu().split(seq_lens))

    outs = step([(0, a[:11])])
    outs += step([(0, a[11:]), (1, b)])
    greedy = []
    for i in range(DECODES + 1):
        nxt = [int(outs[-2][-1].argmax()), int(outs[-1][-1].argmax())]
        greedy += nxt
        fed = nxt if feed is None else feed[2 * i:2 * i + 2]
        if i < DECODES:
            outs += step([(0, [fed[0]]), (1, [fed[1]])])
    outs += step([(1, [fed[1]]), (2, c)])
    return torch.cat(outs), greedy


def tp_hybrid_steps(rank: int, engine_dirs: dict, vocab: int) -> dict:
    """One rank's job: each tp 2 engine's hybrid_steps on this rank, by name."""
    import torch.distributed as dist

    return {name: hybrid_steps(ModelRunner(engine_dir, rank=rank, tp_group=dist.group.WORLD), vocab)
            for name, engine_dir in engine_dirs.items()}
