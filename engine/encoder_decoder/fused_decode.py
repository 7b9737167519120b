"""A pre-norm LayerNorm decoder layer (Whisper, mBART) at decode batches in ~9 launches instead of ~18.

OPT-IN ($TRITONLLM_ENCDEC_FUSED=1), because it measured slower (last on an H200, 2026-11-30 call 33: graph replay
2.301 ms in 298 kernels against the unfused default's 1.734 ms in 426). At batch 1 a Whisper large-v3
decode step takes ~18 kernels a layer (three LayerNorms, three residual adds, q/k/v as three
products, the MLP's up product through cuBLAS with its split-K reduce, two attentions and the
cross-attention's split merge) and ~80 us a layer for 11 us of weight bytes. Here a layer is

    LN + qkv product (one weight [q | k | v])  -> self-attention with the new K/V appended (one kernel)
    -> o product + residual -> LN + cross q product -> cross-attention over the cached cross K/V
    -> cross o product + residual -> LN + fc1 + bias + activation -> fc2 + residual,

the products through kernels/norm_linear.py (LayerNorm prologue, bias/activation/residual
epilogue) with the tiling the load-time timing chose for each weight shape (kernels/linear.py),
or its PRELOAD tiling ($TRITONLLM_NORM_LINEAR_PRELOAD=1: each program's weight tile read before
the PDL wait; then up to 64 rows); the cross-attention as the unfused decode step takes it
(engine/encoder_decoder/cross_attention.py: the one-query decode kernel unless
$TRITONLLM_ENCDEC_CROSS_KERNEL=0). The arithmetic is the unfused layer's, rounding for rounding (the
normalized rows and each product rounded to the model dtype once, then the residual add), so the
result differs only by the products' summation order.

Each LayerNorm but the first layer's reads its rows' mean and variance from the partial sums the
residual product before it emitted (kernels/norm_linear.py ``row_stats``: o + residual -> cross
q, cross o + residual -> fc1, fc2 + residual -> the next layer's qkv) instead of re-reading the
rows in every program; $TRITONLLM_ENCDEC_ROW_STATS=0 recomputes them as before (for comparison).

Measured on an H200, 2026-11-29, before the row statistics (benchmarks/engine/encdec_bench.py,
benchmarks/results/engine.md): the batch-1 step took 298 kernels instead of 586 but 2.79 ms
instead of 2.66 (graph replay 2.59 against 2.49): each LayerNorm prologue costs its product ~4 us
(every program re-reads the rows for their statistics in dependent round trips), more than the
LayerNorm launch it saves. With PRELOAD, the cross kernel of then (K/V read before the PDL wait, since replaced) and 64 rows it
was slower still (batch 1 3.10 ms; batch 64 10.2 ms a step against 7.4 unfused: that cross kernel
193 us a layer at batch 64 against the general kernel's ~145). The row statistics above are what should make it pay (not
yet measured: benchmarks/engine/encdec_bench.py --step-variants times fused, fused-recompute and
fused-cross beside the default in one run).

Not for FP8 engines (--quantization fp8): kernels/norm_linear.py multiplies weights in the model
dtype only (no E4M3 tiles, no per-channel scales), so the runner leaves this path off for them
whatever $TRITONLLM_ENCDEC_FUSED says, and ``prepare`` refuses FP8 weights by name.

``prepare`` fuses each layer's self-attention q/k/v weights into one (3 inner, d_model) tensor,
of which the q, k and v Parameters become views (no extra memory; the state dict is unchanged).
"""
from __future__ import annotations

import os

import torch
from torch import nn

from engine.encoder_decoder.cross_attention import cross_attention
from kernels.linear import MAX_SKINNY_ROWS
from kernels.norm_linear import MAX_ROWS, PRELOAD_ENV, norm_linear
from kernels.rope_attention import append_paged_attention

# Opt-in switches, read at graph capture ("1": on); off by default (measured slower: module docstring).
FUSED_ENV = "TRITONLLM_ENCDEC_FUSED"  # the fused layer for decode steps of up to 16 rows


# "0": the fused layer's LayerNorms recompute their rows' statistics (each program of the product
# re-reads the rows) instead of reading the partials the residual product before them emitted.
ROW_STATS_ENV = "TRITONLLM_ENCDEC_ROW_STATS"


def enabled(name: str, default: str = "0") -> bool:
    return os.environ.get(name, default) == "1"


def fusable(spec) -> bool:
    """Pre-norm LayerNorm layers with learned positions and a non-gated MLP (Whisper, mBART)."""
    return spec.pre_norm and spec.norm == "layernorm" and spec.positions == "learned" and not spec.gated_mlp


def takes(decoder, x: torch.Tensor, meta) -> bool:
    """Whether this step runs through ``layer_step``: the decoder was prepared, decode rows only, at
    most 16 (the load-time tilings' rows), or MAX_ROWS with norm_linear's PRELOAD tiling switched on."""
    most = MAX_ROWS if enabled(PRELOAD_ENV) else MAX_SKINNY_ROWS
    return getattr(decoder, "fused_decode", False) and meta.is_decode_only and x.shape[0] <= most


def fuse_qkv(attn: nn.Module) -> None:
    """One [q | k | v] weight (and bias: a zero k bias where k has none) of ``attn``; q, k, v views of it
    (model.py Attention.fuse_qkv, which the runner runs at load anyway)."""
    attn.fuse_qkv()


def prepare(decoder: nn.Module) -> list[torch.Tensor]:
    """Fuse every layer's q/k/v and mark the decoder (``takes``); returns the fused weights (for the
    load-time tiling choice, beside the decoder's other weights). FP8 weights are refused (module docstring)."""
    if any(getattr(layer.self_attn.q, "weight_scale", None) is not None for layer in decoder.layers):
        raise ValueError("the fused decode layer (TRITONLLM_ENCDEC_FUSED) takes weights in the model dtype; "
                         "this decoder's are FP8 (--quantization fp8): leave it off")
    for layer in decoder.layers:
        fuse_qkv(layer.self_attn)
    decoder.fused_decode = True
    return [layer.self_attn.qkv_weight for layer in decoder.layers]


def mark_tilings(decoder: nn.Module, reports: dict) -> None:
    """Each product's tiling: the best the load-time timing found for its weight shape (``reports``:
    kernels/linear.py's choose_* reports, keyed by (N, K) or ("activated", act, N, K)); absent or
    not a tiling: norm_linear's default."""
    def best(key):
        entry = reports.get(key)
        variant = entry.get("best_variant") if isinstance(entry, dict) else None
        return variant if isinstance(variant, tuple) else None

    for layer in decoder.layers:
        mlp = layer.mlp
        for weight in (layer.self_attn.qkv_weight, layer.self_attn.o.weight, layer.cross_attn.q.weight,
                       layer.cross_attn.o.weight, mlp.down.weight):
            weight.norm_linear_variant = best(tuple(weight.shape))
        mlp.up.weight.norm_linear_variant = best(("activated", mlp.activation_name) + tuple(mlp.up.weight.shape))


def _norm(norm: nn.Module) -> tuple:
    return norm.weight, norm.bias, norm.eps


def _product(x, weight, bias, **options):
    return norm_linear(x, weight, bias, variant=getattr(weight, "norm_linear_variant", None), **options)


def _residual_product(x, weight, bias, residual):
    """residual + x @ weight.T + bias, and the sum's row statistics for the LayerNorm after it (None
    with $TRITONLLM_ENCDEC_ROW_STATS=0 or on the reference path: the consumer then reads its rows)."""
    if not enabled(ROW_STATS_ENV, "1"):
        return _product(x, weight, bias, residual=residual), None
    return _product(x, weight, bias, residual=residual, emit_stats=True)


def decode_layers(decoder: nn.Module, x: torch.Tensor, kv_cache: torch.Tensor, cross_pool: torch.Tensor, meta,
                  cross_meta) -> torch.Tensor:
    """Every layer of ``decoder`` through ``layer_step`` (with the L2 prefetches of ``decoder.l2_plan``, if any:
    engine/encoder_decoder/l2_prefetch_plan.py, joined at the end) -> the last layer's output rows."""
    plan = getattr(decoder, "l2_plan", None)
    if plan is not None:
        plan.start()
    stats = None  # the rows' statistics for the next LayerNorm, as the layer's last product emitted them
    for index, layer in enumerate(decoder.layers):
        prefetch = None if plan is None else (
            lambda sublayer, index=index: plan.before(index, sublayer, cross_pool[index], cross_meta))
        x, stats = layer_step(layer, x, stats, kv_cache[index], cross_pool[index], meta, cross_meta, prefetch)
    if plan is not None:
        plan.join()
    return x


def layer_step(layer: nn.Module, x: torch.Tensor, stats, kv_cache: torch.Tensor, cross_pool: torch.Tensor, meta,
               cross_meta, prefetch=None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One decoder layer over (rows, d_model) decode rows -> (the layer's output rows, their row
    statistics or None). ``stats``: x's row statistics as the previous layer's fc2 product emitted
    them (kernels/norm_linear.py ``row_stats``), or None (the first layer: its norm reads x);
    kv_cache / cross_pool: this layer's (2, blocks, tokens_per_block, heads, head_dim) self and cross
    pools; meta / cross_meta: the step's metadata; ``prefetch(s)``, if given, runs before the layer's sub-layer s
    (0 self-attention, 1 cross-attention, 2 MLP: l2_prefetch_plan.PrefetchPlan.before)."""
    rows, attn, cross, mlp = x.shape[0], layer.self_attn, layer.cross_attn, layer.mlp
    before = prefetch or (lambda sublayer: None)
    before(0)
    qkv = _product(x, attn.qkv_weight, attn.qkv_bias, norm=_norm(layer.self_norm), row_stats=stats)
    q, k, v = qkv.view(rows, 3, attn.heads, attn.head_dim).unbind(1)
    out = append_paged_attention(q, k, v, kv_cache[0], kv_cache[1], meta, attn.scale)
    x, stats = _residual_product(out.flatten(1), attn.o.weight, attn.o.bias, x)
    before(1)
    q = _product(x, cross.q.weight, cross.q.bias, norm=_norm(layer.cross_norm),
                 row_stats=stats).view(rows, cross.heads, cross.head_dim)
    out = cross_attention(q, cross_pool[0], cross_pool[1], cross_meta, cross.scale, decode_step=True)
    x, stats = _residual_product(out.flatten(1), cross.o.weight, cross.o.bias, x)
    before(2)
    h = _product(x, mlp.up.weight, mlp.up.bias, norm=_norm(layer.mlp_norm), activation=mlp.activation_name,
                 row_stats=stats)
    return _residual_product(h, mlp.down.weight, mlp.down.bias, x)
