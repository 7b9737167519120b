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

All-reduces go through ``tp_all_reduce``: NCCL, or for small messages on GPUs (decode steps:
batch x hidden values) a one-shot all-reduce over symmetric memory (each rank stages its partial
sums in a buffer every peer can read over NVLink, and one kernel sums the peers' copies). NCCL
inside a CUDA graph cost ~21 us per 8 KB all-reduce on 2 H200s, the one-shot ~8 us; a decode step
of an 8B model runs 65 of them (benchmarks/results/engine.md, "Tensor parallelism").
"""
from __future__ import annotations

import logging
import os
import warnings
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.config import INT8_SQ, WeightOnlyScheme
from kernels.fp8 import (FP8_DTYPE, QuantizedRows, ScaledProduct, apply_scales, fp8_gated_linear, fp8_linear,
                         quantizes_activations, rms_norm_quantized)
from kernels.fp8_block import blocks, fp8_block_linear
from kernels.int8_sq import int8_gated_linear, int8_linear, rms_norm_quantized_int8
from kernels.activation import silu_and_mul
from kernels.linear import activation_ref, gated_linear, linear, linear_activated, linear_float32_out
from kernels.rmsnorm import qk_rms_norm, rms_norm
from kernels.wna16 import WNA16Weight, prepare_wna16, stored_columns, wna16_linear

if TYPE_CHECKING:
    from engine.lora.pool import LinearLora
    from kernels.lora import LoraBatch

logger = logging.getLogger(__name__)

# Messages up to this size take the one-shot path: it reads every peer's whole buffer, which
# beats NCCL's ring only while latency, not bandwidth, dominates.
ONE_SHOT_MAX_BYTES = 2 << 20


class SymmetricAllReduce:
    """One-shot sum over ``group`` for messages up to ``max_bytes``, through torch's symmetric
    memory (peer loads, no NVLink multicast). The op's kernel has a barrier on entry and on exit,
    so staging the next message into the same buffer cannot race a peer still reading this one.
    Creating it is collective: every rank of the group, at the same point."""

    def __init__(self, group, device: torch.device, max_bytes: int = ONE_SHOT_MAX_BYTES):
        import torch.distributed._symmetric_memory as symm_mem

        self.group_name = group.group_name
        self.max_bytes = max_bytes
        with warnings.catch_warnings():  # older torch needs the call, newer ones deprecate it
            warnings.simplefilter("ignore")
            if hasattr(symm_mem, "enable_symm_mem_for_group"):
                symm_mem.enable_symm_mem_for_group(self.group_name)
        self.buffer = symm_mem.empty(max_bytes, dtype=torch.uint8, device=device)
        symm_mem.rendezvous(self.buffer, self.group_name)

    def fits(self, x: torch.Tensor) -> bool:
        return x.is_cuda and x.is_contiguous() and x.numel() * x.element_size() <= self.max_bytes

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        staging = self.buffer[:x.numel() * x.element_size()].view(x.dtype).view(x.shape)
        staging.copy_(x)
        return torch.ops.symm_mem.one_shot_all_reduce(staging, "sum", self.group_name)


_one_shot: dict[str, SymmetricAllReduce] = {}


def enable_one_shot_all_reduce(group, device: torch.device) -> bool:
    """Set up the one-shot path for ``group`` on every rank (collective); False (NCCL only) when
    any rank cannot, or when TRITONLLM_ONE_SHOT_ALLREDUCE=0. All ranks take the same decision."""
    if device.type != "cuda" or os.environ.get("TRITONLLM_ONE_SHOT_ALLREDUCE", "1") == "0":
        return False
    try:
        candidate = SymmetricAllReduce(group, device)
        ok = 1
    except Exception as err:  # no symmetric memory here (driver, torch build, no peer access)
        logger.warning("one-shot all-reduce unavailable, using NCCL for every all-reduce: %s", err)
        candidate, ok = None, 0
    agreed = torch.tensor([ok], dtype=torch.int32, device=device)
    dist.all_reduce(agreed, op=dist.ReduceOp.MIN, group=group)
    if int(agreed) == 1:
        _one_shot[group.group_name] = candidate
        return True
    return False


def disable_one_shot_all_reduce() -> None:
    """Drop the symmetric buffers (before the process groups are destroyed)."""
    _one_shot.clear()


def tp_all_reduce(x: torch.Tensor, group) -> torch.Tensor:
    """Sum of ``x`` over ``group``; may return a new tensor (use the result, not ``x``)."""
    one_shot = _one_shot.get(group.group_name) if _one_shot else None
    if one_shot is not None and one_shot.fits(x):
        return one_shot(x)
    dist.all_reduce(x, group=group)
    return x


def _empty(*shape: int, dtype: torch.dtype, device) -> nn.Parameter:
    return nn.Parameter(torch.empty(*shape, dtype=dtype, device=device), requires_grad=False)


LinearQuantization = str | WeightOnlyScheme | None  # None, "fp8", "fp8_block", "int8_sq", or a weight-only scheme


class Linear(nn.Module):
    """y = x @ weight.T (+ bias). weight: (out_local, in_local). Holds no parallel logic itself.

    ``quantization="fp8"``: weight is float8_e4m3fn with ``weight_scale`` (out_local,) float32 per
    output channel, and the product runs the FP8 scheme of kernels/fp8.py (the bias stays in dtype). A
    layer an FP8 checkpoint left unquantized is loaded with its weight in the model dtype (its
    weight_scale, all ones, is unread), as for fp8_block: the weight's dtype says which product runs.

    ``quantization="fp8_block"``: weight is float8_e4m3fn with ``weight_scale`` float32
    (ceil(out_local / 128), ceil(in_local / 128)), one per 128 x 128 block, and the product runs
    kernels/fp8_block.py (activations per token and 128-column group). A layer the checkpoint left
    unquantized is loaded with its weight in the model dtype (its weight_scale, all ones, is unread):
    the weight's dtype says which product runs.

    ``quantization="int8_sq"``: weight is int8 with ``weight_scale`` (out_local,) float32 per output
    channel, activations int8 per token (SmoothQuant W8A8, kernels/int8_sq.py; the bias stays in dtype).

    ``quantization=WeightOnlyScheme``: integer codes (kernels/wna16.py): ``weight`` uint8
    (out_local, in_local * bits / 8), ``weight_scale`` float32 and ``weight_zero`` uint8, both
    (out_local, groups), and with act-order ``input_perm`` int32 (in_local,): column j of the stored
    weight multiplies input column input_perm[j]. ``prepare_weights()`` (once, after loading) turns
    them into the kernels' layout; the stored tensors are then released on CUDA.

    ``lora``: this projection's slots of the adapter pool (engine/lora/pool.py), set when the
    executor enables LoRA; a plain attribute, so the state dict keeps the engine-directory names.
    A forward given a LoraBatch adds each token's adapter product to the base output.
    """

    def __init__(self, in_features: int, out_features: int, *, bias: bool, dtype: torch.dtype, device=None,
                 quantization: LinearQuantization = None):
        super().__init__()
        if not (quantization in (None, "fp8", "fp8_block", INT8_SQ) or isinstance(quantization, WeightOnlyScheme)):
            raise ValueError(f"quantization {quantization!r} is not supported; allowed: fp8, fp8_block, int8_sq, a "
                             "weight-only integer scheme, or none")
        self.in_features, self.out_features = in_features, out_features
        self.weight_only = quantization if isinstance(quantization, WeightOnlyScheme) else None
        self.input_perm = None
        self.wna16: WNA16Weight | None = None  # the kernels' layout, made by prepare_weights()
        if self.weight_only is not None:
            scheme, groups = self.weight_only, self.weight_only.groups(in_features)
            self.weight = _empty(out_features, stored_columns(in_features, scheme.bits), dtype=torch.uint8,
                                 device=device)
            self.weight_scale = _empty(out_features, groups, dtype=torch.float32, device=device)
            self.weight_zero = _empty(out_features, groups, dtype=torch.uint8, device=device)
            if scheme.act_order:
                self.input_perm = _empty(in_features, dtype=torch.int32, device=device)
        else:
            weight_dtype = FP8_DTYPE if quantization in ("fp8", "fp8_block") else torch.int8 \
                if quantization == INT8_SQ else dtype
            self.weight = _empty(out_features, in_features, dtype=weight_dtype, device=device)
            blocked = quantization == "fp8_block"
            scale_shape = (blocks(out_features), blocks(in_features)) if blocked else (out_features,)
            self.weight_scale = _empty(*scale_shape, dtype=torch.float32, device=device) if quantization else None
        self.block_scales = quantization == "fp8_block"
        self.int8 = quantization == INT8_SQ
        self.dtype = dtype
        self.bias = _empty(out_features, dtype=dtype, device=device) if bias else None
        self.lora: LinearLora | None = None
        self._permutes_input = True

    @property
    def is_fp8(self) -> bool:
        """Per-channel FP8 (the W8A8 path whose input may come as QuantizedRows); not a layer of an fp8 engine
        that holds its checkpoint's unquantized weight in the model dtype."""
        return (self.weight_scale is not None and self.weight_only is None and not self.block_scales and not self.int8
                and self.weight.dtype == FP8_DTYPE)

    @torch.no_grad()
    def prepare_weights(self) -> None:
        """Integer weights -> the kernels' layout (kernels/wna16.py); a no-op for other layers.
        An act-order permutation that is the identity is dropped (no gather per forward)."""
        if self.weight_only is None or self.wna16 is not None:
            return
        self.wna16 = prepare_wna16(self.weight, self.weight_scale, self.weight_zero, self.weight_only.bits, self.dtype)
        if self.input_perm is not None:
            identity = torch.arange(self.in_features, device=self.input_perm.device, dtype=self.input_perm.dtype)
            self._permutes_input = not torch.equal(self.input_perm, identity)
            self.input_perm = nn.Parameter(self.input_perm.long(), requires_grad=False)
        if self.weight.is_cuda:  # the kernels hold their own copy; keep only the shapes
            for name in ("weight", "weight_scale", "weight_zero"):
                setattr(self, name, nn.Parameter(getattr(self, name).new_empty(0), requires_grad=False))

    def forward(self, x: torch.Tensor | QuantizedRows, lora: LoraBatch | None = None) -> torch.Tensor:
        out = self._product(x, self.bias)
        if lora is not None and self.lora is not None:
            self.lora.add(x, out, lora)
        return out

    def _product(self, x: torch.Tensor | QuantizedRows, bias: torch.Tensor | None) -> torch.Tensor:
        if self.weight_only is not None:
            if self.wna16 is None:
                self.prepare_weights()
            if self.input_perm is not None and self._permutes_input:
                x = x.index_select(-1, self.input_perm)
            return wna16_linear(x, self.wna16, bias)
        if self.int8:
            return int8_linear(x, self.weight, self.weight_scale, bias)
        if self.block_scales and self.weight.dtype == FP8_DTYPE:
            return fp8_block_linear(x, self.weight, self.weight_scale, bias)
        if self.is_fp8:
            return fp8_linear(x, self.weight, self.weight_scale, bias)
        return linear(x, self.weight, bias)  # F.linear, or a skinny Triton GEMM chosen at engine load

    def takes_quantized_rows(self, x: torch.Tensor) -> bool:
        """Whether this layer would quantize x per token itself (an FP8 weight on the W8A8 path, or an
        int8_sq weight: E4M3 or int8 rows), so that the kernel making x may hand it QuantizedRows
        instead. Not with LoRA slots: the adapters read x in the model dtype."""
        return (self.is_fp8 or self.int8) and self.lora is None and quantizes_activations(x.device)

    def activated(self, x: torch.Tensor, activation: str) -> torch.Tensor:
        """act(x @ weight.T + bias), act one of kernels.linear.ACTIVATIONS (a non-gated MLP's up
        projection): one skinny kernel with the bias and activation in its epilogue when the weight
        in the model dtype was marked at load, else this layer's product then the activation."""
        if self.weight_scale is None and self.weight_only is None and self.lora is None:
            return linear_activated(x, self.weight, self.bias, activation)
        return activation_ref(self(x), activation)

    def gated(self, x: torch.Tensor | QuantizedRows, *, quantize_output: bool = False,
              lora: LoraBatch | None = None) -> torch.Tensor | QuantizedRows:
        """silu(x @ gate.T) * (x @ up.T) for a fused [gate | up] weight (2 * inter, in).
        ``quantize_output``: the result feeds an FP8 layer; it may come back as QuantizedRows.
        With a LoraBatch the adapters' products join gate and up before the activation, so the
        fused gated kernels give way to the plain product."""
        if lora is not None and self.lora is not None:
            gate_up = self._product(x, None)
            self.lora.add(x, gate_up, lora)
            return silu_and_mul(gate_up)
        if self.int8:  # decode rows: one skinny int8 kernel with the SiLU-and-mul in its epilogue
            return int8_gated_linear(x, self.weight, self.weight_scale)
        if self.weight_only is not None or self.block_scales:
            return silu_and_mul(self._product(x, None))
        if self.is_fp8:
            return fp8_gated_linear(x, self.weight, self.weight_scale, quantize_output=quantize_output)
        return gated_linear(x, self.weight)  # one fused skinny kernel for decode batches when chosen at load


class RowParallelLinear(Linear):
    """Partial product on each rank, all-reduced; the (replicated) bias is added after the reduce
    (on one rank, in the product)."""

    def __init__(self, in_local: int, out_features: int, *, bias: bool, tp_group, dtype, device=None,
                 quantization: LinearQuantization = None):
        super().__init__(in_local, out_features, bias=bias, dtype=dtype, device=device, quantization=quantization)
        self.tp_group = tp_group

    def forward(self, x: torch.Tensor, lora: LoraBatch | None = None, *,
                defer_scales: bool = False) -> torch.Tensor | ScaledProduct:
        """``defer_scales``: the caller reads the output with ``rms_norm_into`` (which takes a
        ScaledProduct, kernels/fp8.py); honoured on one rank without a bias or an adapter in the batch."""
        if (defer_scales and self.is_fp8 and self.tp_group is None and self.bias is None
                and (lora is None or self.lora is None)):
            return fp8_linear(x, self.weight, self.weight_scale, defer_scales=True)
        if self.tp_group is None:  # one rank: the bias joins the product (no add of its own)
            out = self._product(x, self.bias)
            if lora is not None and self.lora is not None:
                self.lora.add(x, out, lora)
            return out
        out = self._product(x, None)
        if lora is not None and self.lora is not None:
            # A holds this rank's input columns: B(A_r x_r) summed over ranks is B(A x), so the
            # adapter's partial product joins the base one before the all-reduce.
            self.lora.add(x, out, lora)
        out = tp_all_reduce(out, self.tp_group)
        return out if self.bias is None else out + self.bias


def rms_norm_into(linear: Linear | None, x: torch.Tensor | ScaledProduct, weight: torch.Tensor, eps: float,
                  residual: torch.Tensor | None) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
    """kernels.rmsnorm.rms_norm for a norm whose output only ``linear`` reads: with an FP8 layer on
    the W8A8 path the norm quantizes its output per token in the same kernel (to int8 for an int8_sq
    layer). x may be a ScaledProduct (an FP8 projection's deferred scales): the quantizing norm
    applies them itself (only FP8 products defer their scales)."""
    values = x.values if isinstance(x, ScaledProduct) else x
    if linear is not None and linear.takes_quantized_rows(values):
        if linear.int8:
            return rms_norm_quantized_int8(apply_scales(x), weight, eps, residual)
        return rms_norm_quantized(x, weight, eps, residual)
    return rms_norm(apply_scales(x), weight, eps, residual)


class Norm(nn.Module):
    """Holder of a norm's weight (and bias, for LayerNorm); the math lives in the model files."""

    def __init__(self, size: int, *, bias: bool, dtype: torch.dtype, device=None):
        super().__init__()
        self.weight = _empty(size, dtype=dtype, device=device)
        self.bias = _empty(size, dtype=dtype, device=device) if bias else None


def qkv_heads(qkv: torch.Tensor, num_heads: int, num_kv_heads: int, head_dim: int,
              q_norm: Norm | None = None, k_norm: Norm | None = None, eps: float = 0.0
              ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The fused projection's output (num_tokens, (num_heads + 2 * num_kv_heads) * head_dim), rows
    [q | k | v], as q (num_tokens, num_heads, head_dim) and k, v (num_tokens, num_kv_heads, head_dim);
    q and k through their per-head RMSNorms where the family has them (Qwen3, Gemma 3)."""
    q_size, kv_size = num_heads * head_dim, num_kv_heads * head_dim
    q, k, v = qkv.split([q_size, kv_size, kv_size], dim=-1)
    if q_norm is not None:
        q, k = qk_rms_norm(qkv, num_heads, num_kv_heads, head_dim, q_norm.weight, k_norm.weight, eps)
        return q, k, v.view(-1, num_kv_heads, head_dim)
    return q.view(-1, num_heads, head_dim), k.view(-1, num_kv_heads, head_dim), v.view(-1, num_kv_heads, head_dim)


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
        return tp_all_reduce(out, self.tp_group)


def vocab_parallel_logits(hidden: torch.Tensor, weight: torch.Tensor, tp_group,
                          bias: torch.Tensor | None = None) -> torch.Tensor:
    """hidden: (n, hidden) -> float32 logits (n, vocab), gathering each rank's vocab slice;
    ``bias``: this rank's (vocab / tp,) slice of an lm_head bias (GPT-J), or None."""
    logits = linear_float32_out(hidden, weight)
    if bias is not None:
        logits = logits + bias.float()
    if tp_group is None:
        return logits
    shards = [torch.empty_like(logits) for _ in range(dist.get_world_size(tp_group))]
    dist.all_gather(shards, logits.contiguous(), group=tp_group)
    return torch.cat(shards, dim=-1)


def wide_row_weights(model: nn.Module) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """(plain, gated) weights of the model's Linear layers whose 17-128-row products kernels/wide_rows.py
    may take: those multiplied by linear() / fp8_linear() (plain) and the layers' fused gate_up_proj
    (gated_linear() / fp8_gated_linear()); not integer, block-scaled or activated (GELU up) weights."""
    def multiplies_plainly(module) -> bool:
        return (isinstance(module, Linear) and module.weight_only is None and not module.int8
                and not module.block_scales)

    activated = {id(w) for weights in getattr(model, "activated_weights", dict)().values() for w in weights}
    gate_ups = [layer.gate_up_proj for layer in getattr(model, "layers", []) if hasattr(layer, "gate_up_proj")]
    skip = activated | {id(m.weight) for m in gate_ups}
    plain = [m.weight for m in model.modules() if multiplies_plainly(m) and id(m.weight) not in skip]
    return plain, [m.weight for m in gate_ups if multiplies_plainly(m)]


def prepare_weights(model: nn.Module) -> None:
    """Once after loading: every module with integer weights (a Linear, a block of experts) lays
    them out for its kernels (kernels/wna16.py, kernels/fused_moe_wna16.py)."""
    for module in model.modules():
        if getattr(module, "weight_only", None) is not None:
            module.prepare_weights()
