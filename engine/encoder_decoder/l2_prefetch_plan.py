"""Which weights (and cross K/V pages) a decoder step prefetches into L2 ahead of the kernels that read them.

Opt-in, read at graph capture (runner.capture_cuda_graphs):

- $TRITONLLM_ENCDEC_PREFETCH=N (1-3): before each sub-layer of a decode step (self-attention, cross-attention, MLP
  of each layer, in order), the weights of the sub-layer N ahead (its products' weights and biases) are prefetched
  from a side stream (kernels/l2_prefetch.py; the first N at the step's start);
- $TRITONLLM_ENCDEC_PREFETCH_KV=1: before each layer's self-attention sub-layer, also that layer's cross K/V
  pages of the step's rows (read by its cross-attention a sub-layer later).

Both decode paths take it: the unfused layer (model.py Decoder.forward) and the fused one (fused_decode.py). Hopper
GPUs only; elsewhere ``for_decoder`` gives None and nothing changes.
"""
from __future__ import annotations

import os

import torch
from torch import nn

from kernels.l2_prefetch import L2Prefetcher, region_table

PREFETCH_ENV = "TRITONLLM_ENCDEC_PREFETCH"
PREFETCH_KV_ENV = "TRITONLLM_ENCDEC_PREFETCH_KV"
SUBLAYERS = 3  # self-attention, cross-attention, MLP
KV_PREFETCH_SUBLAYER = 0  # a layer's cross pages go out before its self-attention sub-layer


def sublayer_tensors(layer: nn.Module) -> list[list[torch.Tensor]]:
    """The weights and biases each of ``layer``'s three sub-layers multiplies by, in the order it runs them (q/k/v
    as one fused weight where fused; a gated MLP's [gate | up] where fused; FP8 weights' scales with them)."""
    attn, cross, mlp = layer.self_attn, layer.cross_attn, layer.mlp

    def of(*modules):
        return [t for m in modules for t in (m.weight, m.bias, getattr(m, "weight_scale", None)) if t is not None]

    if getattr(attn, "qkv_weight", None) is not None:
        qkv = [t for t in (attn.qkv_weight, attn.qkv_bias, getattr(attn, "qkv_scale", None)) if t is not None]
    else:
        qkv = of(attn.q, attn.k, attn.v)
    if getattr(mlp, "gate_up", None) is not None:
        up = [mlp.gate_up] + [t for t in (getattr(mlp, "gate_up_scale", None),) if t is not None]
    else:
        up = of(*[m for m in (mlp.gate, mlp.up) if m is not None])
    return [qkv + of(attn.o), of(cross.q, cross.o), up + of(mlp.down)]


class PrefetchPlan:
    """A decoder's prefetch schedule (module docstring): region tables made once (the weights never move)."""

    def __init__(self, decoder: nn.Module, distance: int, kv: bool = False):
        groups = [tensors for layer in decoder.layers for tensors in sublayer_tensors(layer)]
        device = groups[0][0].device
        self.prefetcher = L2Prefetcher(device)
        tables = [region_table([t for t in tensors if t.is_contiguous()], device) for tensors in groups]
        self.start_tables = tables[:distance]
        # ahead[g]: what sub-layer g (layer g // 3, its (g % 3)-th) prefetches before it runs
        self.ahead = tables[distance:] + [None] * distance if distance else [None] * len(tables)
        self.kv = kv

    @classmethod
    def for_decoder(cls, decoder: nn.Module, distance: int | None = None, kv: bool | None = None
                    ) -> PrefetchPlan | None:
        """The plan of the switches (or the arguments), or None where nothing would be prefetched (distance 0
        without kv, or no Hopper GPU)."""
        distance = int(os.environ.get(PREFETCH_ENV, "0") or 0) if distance is None else distance
        kv = os.environ.get(PREFETCH_KV_ENV, "0") == "1" if kv is None else kv
        if distance <= 0 and not kv:
            return None
        plan = cls(decoder, max(distance, 0), kv)
        return plan if plan.prefetcher.on else None

    def start(self) -> None:
        for table in self.start_tables:
            self.prefetcher.issue(table)

    def before(self, layer: int, sublayer: int, cross_pool: torch.Tensor, cross_meta) -> None:
        """Before ``layer``'s ``sublayer`` runs: the weights ahead, and that layer's cross pages where asked
        (``cross_pool``: the layer's (2, blocks, page, heads, head_dim) pool; ``cross_meta``: the step's)."""
        self.prefetcher.issue(self.ahead[SUBLAYERS * layer + sublayer])
        if self.kv and sublayer == KV_PREFETCH_SUBLAYER:
            self.prefetcher.issue_pages(cross_pool[0], cross_pool[1], cross_meta.block_tables,
                                        cross_meta.context_lens)

    def join(self) -> None:
        self.prefetcher.join()
