"""The job the pipeline-parallel engine test sends gloo_ranks.py's shared pair: an engine built
with pp_size 2 (tp_size 1), rank r running stage r, driven through engine_testing.tp_reference_steps
(a prefill of two sequences on shuffled blocks, then a mixed chunk + decode step)."""
from __future__ import annotations

import os

import torch

from engine_testing import tp_reference_steps


class _LogitsOnEveryRank:
    """A StageRunner whose forward gives zeros where it returns None (ranks other than 0), so the
    same session code drives every rank; only rank 0's logits are compared."""

    def __init__(self, runner):
        self.runner = runner

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def forward(self, batch, **kwargs):
        logits = self.runner.forward(batch, **kwargs)
        return torch.zeros(len(batch.logits_indices), self.runner.vocab_size) if logits is None else logits


def pp_rank_logits(rank: int, engine_dirs: dict, micro_batches: int) -> dict:
    """name -> this rank's tp_reference_steps logits (rank 0: the step's; rank 1: zeros) and the
    layers its KV pool holds."""
    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    os.environ[MICRO_BATCHES_ENV] = str(micro_batches)
    try:
        out = {}
        for name, engine_dir in engine_dirs.items():
            runner = StageRunner(engine_dir, rank=rank, device="cpu")
            logits = tp_reference_steps(_LogitsOnEveryRank(runner))
            out[name] = (logits, runner.kv_cache.shape[0])
        return out
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)


def graph_reference_steps(runner) -> torch.Tensor:
    """Prompts of three sequences, four decode steps of all three, one of sequence 1 alone, then a
    mixed chunk + decode step; every step's logits, stacked. On CUDA (or emulated) the decode steps
    replay graphs, the others run eagerly."""
    from engine_testing import PagedSession, random_tokens

    prompts = [random_tokens(n, seed=20 + n) for n in (5, 9, 3)]
    session = PagedSession(runner, num_blocks=16)
    runner.capture_cuda_graphs()
    out = session.step(list(enumerate(prompts)))
    for step in range(4):
        out += session.step([(seq, [(7 * seq + 3 * step) % 50]) for seq in range(3)])
    out += session.step([(1, [11])])
    out += session.step([(0, random_tokens(6, seed=30)), (2, [13])])
    return torch.cat(out)


def pp_graph_logits(rank: int, engine_dir: str, micro_batches: int, graphed_ranks: tuple[int, ...]) -> tuple:
    """graph_reference_steps on this rank's stage, CUDA graphs emulated (graph_emulation.py) on
    ``graphed_ranks`` only: (rank 0's logits or zeros, this rank's (decode, prefill) graph replays)."""
    import pytest
    from graph_emulation import emulate_cuda_graphs

    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    os.environ[MICRO_BATCHES_ENV] = str(micro_batches)
    try:
        with pytest.MonkeyPatch.context() as patch:
            replays = emulate_cuda_graphs(patch) if rank in graphed_ranks else {}
            runner = StageRunner(engine_dir, rank=rank, device="cpu")
            logits = graph_reference_steps(_LogitsOnEveryRank(runner))
            return logits, (replays["StageStep-decode"], replays["StageStep-prefill"]) if replays else (0, 0)
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)


def pp_p2p_order(rank: int, engine_dir: str) -> list[str]:
    """This rank's point-to-point calls over one step of two micro-batches that both carry logits
    rows (a decode row and a prompt's last token in each), e.g. ["send", "recv", "send", "recv"]."""
    import pytest
    import torch.distributed as dist

    from engine.executor.runner import ForwardBatch
    from engine.pipeline.runner import MICRO_BATCHES_ENV, StageRunner

    calls = []

    def recorded(kind, fn):
        def call(*args, **kwargs):
            calls.append(kind)
            return fn(*args, **kwargs)
        return call

    os.environ[MICRO_BATCHES_ENV] = "2"
    try:
        with pytest.MonkeyPatch.context() as patch:
            runner = StageRunner(engine_dir, rank=rank, device="cpu")
            runner.allocate_kv_cache(8)
            for name, kind in (("send", "send"), ("isend", "send"), ("recv", "recv"), ("irecv", "recv")):
                patch.setattr(dist, name, recorded(kind, getattr(dist, name)))
            runner.forward(ForwardBatch(token_ids=[1, 2, 3, 4, 5, 6], positions=[0, 1, 2, 0, 1, 2], seq_lens_q=[3, 3],
                                        context_lens=[3, 3], block_tables=[[0], [1]], logits_indices=[2, 5]))
        return calls
    finally:
        os.environ.pop(MICRO_BATCHES_ENV, None)
