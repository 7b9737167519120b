"""One tensor-parallel rank's part of a Mamba-2 layer: its heads, its B/C groups, and the split of
the layer's checkpoint tensors.

Heads split evenly: rank r holds heads [r * H / tp, (r + 1) * H / tp), and with them their channels
of z, x, the gated norm's weight and out_proj's input columns (out_proj is row-parallel: partial
sums all-reduced, as the attention layers' o_proj), and their dt, dt_bias, A_log, D. Head h reads
B/C group h // (H / G), so:

- G divisible by tp: rank r holds groups [r * G / tp, (r + 1) * G / tp), each rank's heads read
  only those;
- tp divisible by G (fewer groups than ranks, Nemotron-H-8B's 8 groups at tp 16, Mamba-2's one
  group at tp 2): every rank's heads fall in one group, g = r // (tp / G), which it holds as a
  replica (the same B/C rows of in_proj and the same conv channels on tp / G ranks);
- other pairs (G 3 at tp 2) put some ranks' heads in two groups unevenly: refused by name.

The conv (depthwise) follows its channels: x's by head, B's and C's by group. The gated RMSNorm
normalizes per group of d_ssm / G channels (mamba_ssm's RMSNormGated group_size, transformers >=
5.24), aligned with the B/C groups: with G divisible by tp each rank normalizes its own groups;
with fewer groups than ranks one group spans tp / G ranks, and its mean square is summed across
them (``norm_spans_ranks``: one all-reduce of a (tokens, G) tensor per layer).
"""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from engine.config import ConfigError, mamba_tp_error
from engine.ssm.spec import SsmSpec


@dataclass(frozen=True)
class MambaShard:
    """Rank ``rank`` of ``size``: ``spec`` is the rank's layer (num_heads and n_groups local, the
    rest as the checkpoint's), ``first_head`` / ``first_group`` where its heads and groups start in
    the whole layer, ``norm_group`` the gated norm's group width in channels (the whole layer's)."""

    rank: int
    size: int
    spec: SsmSpec
    first_head: int
    first_group: int
    norm_group: int
    norm_groups: int  # the whole layer's n_groups

    @property
    def norm_spans_ranks(self) -> bool:
        """A norm group is wider than this rank's channels (fewer groups than ranks)."""
        return self.norm_group > self.spec.inner


def mamba_shard(spec: SsmSpec, rank: int = 0, size: int = 1) -> MambaShard:
    error = mamba_tp_error(spec.num_heads, spec.n_groups, size)
    if error:
        raise ConfigError(error)
    heads = spec.num_heads // size
    if spec.n_groups % size == 0:
        groups, first_group = spec.n_groups // size, rank * (spec.n_groups // size)
    else:  # tp a multiple of G: tp / G consecutive ranks share (replicate) one group
        groups, first_group = 1, rank // (size // spec.n_groups)
    return MambaShard(rank, size, replace(spec, num_heads=heads, n_groups=groups), rank * heads, first_group,
                      spec.inner // spec.n_groups, spec.n_groups)


# ---- the checkpoint's tensors, split (engine/ssm/convert.py) ----------------------------------

def _rows(t: torch.Tensor, sizes: list[int]) -> list[torch.Tensor]:
    return list(t.split(sizes, dim=0))


def _shard_heads(t: torch.Tensor, shard: MambaShard) -> torch.Tensor:
    """Rows of a head-major section (z, x: head h's head_dim rows together; dt: one per head)."""
    per = t.shape[0] // (shard.spec.num_heads * shard.size)
    start = shard.first_head * per
    return t[start:start + shard.spec.num_heads * per]


def _shard_groups(t: torch.Tensor, shard: MambaShard) -> torch.Tensor:
    """Rows of a group-major section (B or C: group g's d_state rows together)."""
    n = shard.spec.d_state
    return t[shard.first_group * n:(shard.first_group + shard.spec.n_groups) * n]


def shard_in_proj(t: torch.Tensor, whole: SsmSpec, shard: MambaShard) -> torch.Tensor:
    """in_proj weight (or bias) rows [z | x | B | C | dt] -> this rank's [z_r | x_r | B_r | C_r | dt_r]."""
    bc = whole.n_groups * whole.d_state
    z, x, B, C, dt = _rows(t, [whole.inner, whole.inner, bc, bc, whole.num_heads])
    return torch.cat([_shard_heads(z, shard), _shard_heads(x, shard), _shard_groups(B, shard),
                      _shard_groups(C, shard), _shard_heads(dt, shard)])


def shard_conv(t: torch.Tensor, whole: SsmSpec, shard: MambaShard) -> torch.Tensor:
    """conv weight (conv_dim, d_conv) or bias rows [x | B | C] -> this rank's [x_r | B_r | C_r]."""
    bc = whole.n_groups * whole.d_state
    x, B, C = _rows(t, [whole.inner, bc, bc])
    return torch.cat([_shard_heads(x, shard), _shard_groups(B, shard), _shard_groups(C, shard)])


def shard_head_channels(t: torch.Tensor, shard: MambaShard, dim: int = 0) -> torch.Tensor:
    """Per-head tensors (dt_bias, A_log, D: (H,)), the gated norm's weight (inner,) and out_proj's
    input columns (dim 1): this rank's heads' part."""
    return _shard_heads(t.movedim(dim, 0), shard).movedim(0, dim)
