"""Tensor-parallel building blocks shared by the model files.

Each rank holds only its shard; the modules hold plain ``weight``/``bias`` parameters so the
state-dict names are exactly the engine-directory names. Parallel layout (Megatron style):

- column-parallel linear: weight rows split across ranks, output stays sharded, no communication;
- row-parallel linear: weight columns split, each rank makes a partial sum, all-reduced over
  ``tp_group``; the bias (full, replicated) is added once, after the reduce;
- vocab-parallel embedding: rank r holds rows [r * V/tp, (r+1) * V/tp); ids outside are looked
  up as zero and the all-reduce fills them in;
- vocab-parallel lm_head: each rank computes its vocab slice, then logits are all-gathered.

``tp_group`` is None for a single rank, and then no collective runs.
"""
from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from kernels.linear import linear


def _empty(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). weight: (out_local, in_local). Holds no parallel logic itself."""

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _empty(out_features, in_features, dtype=dtype, device=device)
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return linear(x, self.weight, self.bias)  # F.linear, or a skinny Triton GEMM chosen at engine load


class RowParallelLinear(Linear):
    """Partial product on each rank, all-reduced; the (replicated) bias is added after the reduce."""

    def __init__(self, in_local: int, out_features: int, *, bias: bool, tp_group, dtype, device=None):
        super().__init__(in_local, out_features, bias=bias, dtype=dtype, device=device)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = linear(x, self.weight)
        if self.tp_group is not None:
            dist.all_reduce(out, group=self.tp_group)
        return out if self.bias is None else out + self.bias


class Norm(nn.Module):
    """Holder of a norm's weight (and bias, for LayerNorm); the math lives in the model files."""

    def __init__(self, size: int, *, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.bias = _empty(size, dtype=dtype, device=device) if bias else None


class VocabParallelEmbedding(nn.Module):
    """weight: (vocab / tp, hidden), rows [tp_rank * vocab_local, (tp_rank + 1) * vocab_local)."""

    def __init__(self, vocab_local: int, hidden: int, *, tp_rank: int, tp_group, dtype, device=None):
        super().__init__()
        self.weight = _empty(vocab_local, hidden, dtype=dtype, device=device)
        self.vocab_start = tp_rank * vocab_local
        self.tp_group = tp_group

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_group is None:
            return F.embedding(input_ids, self.weight)
        local_ids = input_ids - self.vocab_start
        outside = (local_ids < 0) | (local_ids >= self.weight.shape[0])
        out = F.embedding(local_ids.masked_fill(outside, 0), self.weight)
        out.masked_fill_(outside.unsqueeze(-1), 0)
        dist.all_reduce(out, group=self.tp_group)
        return out


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp_group) -> torch.Tensor:
    """hidden: (n, hidden) -> float32 logits (n, vocab), gathering each rank's vocab slice."""
    logits = linear(hidden, weight).float()
    if tp_group is None:
        return logits
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, logits.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)
