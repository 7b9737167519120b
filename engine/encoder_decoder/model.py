"""The encoder and the decoder of a T5 / BART model (options: engine/encoder_decoder/spec.py).

Encoder: a padded batch of whole inputs at once (each request's encoder runs once), dense
bidirectional attention with a key-padding mask; its output (per request (L_enc, d_model)) is
projected by every decoder layer's cross-attention into K/V once (runner.py ``encode_into``, all of
a pass's inputs at once) and kept in the cross-KV pool.

Decoder: the executor's packed, ragged step like any decoder-only model: self-attention through
the paged KV pool (kernels/attention.py; T5's relative bias: t5_attention.py),
then cross-attention of every new token over its request's cross K/V, read from the cross pool
by block table. Cross-attention is not causal: each new token is handed to the paged attention
as its own one-token sequence whose context is the whole encoder output (``cross_metadata``),
the shape decode attention already has.

Math is in the model dtype except norms, softmax and scores (float32), as transformers does.

Tensor parallelism (``TensorParallel``: an engine built with tp_size > 1, build.py writes each rank's
shard): every attention (encoder self, decoder self, cross) holds heads / tp of its heads (q, k, v split
by output rows, o by input columns), every MLP width / tp of its width (gate, up by rows, down by
columns); o and down are row-parallel products (``project``), each rank's partial sum all-reduced before
the bias and the residual add (one all-reduce after each attention and each MLP). T5's relative-position
table holds this rank's heads' columns. The token embeddings, positions, norms and Whisper's
convolutions are replicated (no collective for the lookup); the LM head (and BART's final_logits_bias)
holds ceil(vocab / tp) rows, the last rank's padded with zeros, and the logits are all-gathered and
cut to the vocabulary, so a vocabulary tp does not divide (BART's 50,265) still splits.

FP8 engines (``--quantization fp8``, engine/encoder_decoder/build.py): every linear of both stacks'
layers (q, k, v, o of self- and cross-attention, the MLP's) is an ``Fp8Linear``: E4M3 weight with
per-output-channel float32 ``weight_scale`` (kernels/fp8.py's scheme, activations per token at run
time). The embeddings, the LM head, Whisper's convolutions and the norms stay in the model dtype.
Every product of a layer goes through ``product`` (or a module's call, which goes through it), which
runs fp8_linear for an E4M3 weight and kernels/linear.py's linear otherwise; the fused tensors
(``MLP.gate_up``, cross_kv.py's ``kv_weight``) carry their concatenated row scales beside them.
Where the W8A8 path runs (CUDA), q, k and v's shared input is quantized per token once for the three
(``Attention.qkv_heads``), not once in each product: the same values, two quantize passes fewer. In a
pre-norm decoder step (T5, Whisper) each norm does the previous sublayer's residual add in its own
kernel and, FP8, quantizes its output there too (``Norm.add_and_norm``), and T5 v1.1's gated-GELU
quantizes the down product's input in its kernel: per layer three residual adds and three (Whisper)
or four (T5 v1.1) quantize kernels fewer (each ~2-4 us at batch 64-256).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from engine.encoder_decoder.cross_attention import cross_attention
from engine.encoder_decoder.spec import EncDecSpec
from engine.encoder_decoder.t5_attention import decoder_self_attention, encoder_attention, kernels_enabled
from engine.models.layers import tp_all_reduce
from engine.models.tables import uninitialized_table
from engine.planless_attention import planless_sdpa
from kernels.activation import gelu_tanh_and_mul
from kernels.attention import write_kv_cache
from kernels.attention_metadata import AttentionMetadata
from kernels.fp8 import (FP8_DTYPE, QuantizedRows, ScaledProduct, apply_scales, as_quantized_rows, fp8_linear,
                         fp8_linear_activated, gelu_tanh_and_mul_quantized, layer_norm_quantized, quantizes_activations,
                         rms_norm_quantized)
from kernels.layernorm import layer_norm
from kernels.linear import linear, linear_activated, linear_float32_out
from kernels.relative_position_bias import position_bias
from kernels.rmsnorm import rms_norm
from kernels.rope_attention import append_paged_attention

# spec.activation -> kernels/linear.py's name for it (the skinny kernel's fused epilogue)
LINEAR_ACTIVATIONS = {"relu": "relu", "gelu": "gelu", "gelu_new": "gelu_tanh"}


class Norm(nn.Module):
    def __init__(self, spec: EncDecSpec, dtype, device):
        super().__init__()
        self.rms, self.eps = spec.norm == "rms", spec.norm_eps
        self.weight = nn.Parameter(torch.ones(spec.d_model, dtype=dtype, device=device))
        self.bias = None if self.rms else nn.Parameter(torch.zeros(spec.d_model, dtype=dtype, device=device))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.rms:  # T5: no mean subtraction, no bias
            if x.is_cuda and x.dtype == self.weight.dtype:  # one kernel, the same formula (fp32 statistics)
                return rms_norm(x.reshape(-1, x.shape[-1]), self.weight, self.eps)[0].view(x.shape)
            x32 = x.float()
            return (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype) * self.weight
        if x.dtype == self.weight.dtype:  # one kernel: torch's layer norm computes in float32 and rounds once
            return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)
        return F.layer_norm(x.float(), (x.shape[-1],), self.weight.float(), self.bias.float(), self.eps).to(x.dtype)

    def add_and_norm(self, x: torch.Tensor, residual: torch.Tensor | None, *, quantize: bool = False
                     ) -> tuple[torch.Tensor | QuantizedRows, torch.Tensor]:
        """(norm(x + residual), x + residual) of a decoder step's (num_tokens, d_model) rows (residual None:
        x itself): a pre-norm sublayer's residual add done by the next norm, in one kernel on CUDA
        (kernels/rmsnorm.py for T5's RMS norm, kernels/layernorm.py for Whisper's LayerNorm), and with
        ``quantize`` (the norm's output feeds FP8 products on the W8A8 path) its output quantized per token
        in it too (QuantizedRows: the values fp8_linear would make of the plain output). The CPU references
        give the values of ``x + residual`` then ``forward`` exactly; the LayerNorm kernel is within an
        output rounding of torch's F.layer_norm (its statistics summed in another order)."""
        if isinstance(x, ScaledProduct):  # an FP8 product's deferred scales: the quantizing RMS norm applies them
            if self.rms and quantize:
                return rms_norm_quantized(x, self.weight, self.eps, residual)
            x = apply_scales(x)
        if x.dtype == self.weight.dtype:
            if self.rms:
                return (rms_norm_quantized if quantize else rms_norm)(x, self.weight, self.eps, residual)
            if quantize:
                return layer_norm_quantized(x, self.weight, self.bias, self.eps, residual)
            out, total, _ = layer_norm(x, self.weight, self.bias, self.eps, () if residual is None else (residual,))
            return out, total
        total = x if residual is None else residual + x
        out = self(total)
        return (as_quantized_rows(out) if quantize else out), total


QUANTIZATIONS = (None, "fp8")  # what these stacks' linears take (build.py refuses the rest by name)


@dataclass(frozen=True)
class TensorParallel:
    """This rank's place in a tensor-parallel engine: ``size`` ranks, this one ``rank``, their ``group``
    (None on one rank; at build time the shapes only, for the shards)."""

    size: int = 1
    rank: int = 0
    group: Any = None

    def split(self, total: int, what: str) -> int:
        """``total`` / size; a ValueError naming ``what`` when size does not divide it."""
        if total % self.size:
            raise ValueError(f"tp_size {self.size} does not divide {what} ({total})")
        return total // self.size


ONE_RANK = TensorParallel()


def vocab_rows(vocab_size: int, tp_size: int) -> int:
    """Rows of the LM head per rank: ceil(vocab / tp) (the last rank's tail padded with zero rows)."""
    return -(-vocab_size // tp_size)


def product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None,
            scale: torch.Tensor | None = None, *, defer_scales: bool = False) -> torch.Tensor | ScaledProduct:
    """x (..., K) @ weight (N, K).T (+ bias): the one product every linear of these stacks takes. An
    E4M3 weight (an FP8 engine) with its per-output-channel ``scale`` runs kernels/fp8.py's fp8_linear
    over x's rows (CUDA: the W8A8 kernels, skinny for decode rows; CPU: its plain-torch reference); a
    weight in the model dtype runs kernels/linear.py's linear (F.linear, or the skinny kernel chosen
    at load). An E4M3 weight without a scale is refused, never multiplied as raw codes. x may be
    QuantizedRows (rows already quantized per token for FP8 products: ``Attention.qkv_heads``).
    ``defer_scales`` (FP8, (rows, K) x): the reader takes a ScaledProduct (kernels/fp8.py "Deferred scales": the
    quantizing RMS norm, the quantizing gated-GELU); one comes back where the runner's load-time timing
    (choose_fp8_scaling) found the tensor-wise product faster at this many rows."""
    if weight.dtype == FP8_DTYPE:
        if scale is None:
            raise ValueError(f"an FP8 weight {tuple(weight.shape)} needs its per-output-channel scale")
        if isinstance(x, QuantizedRows) or defer_scales:
            return fp8_linear(x, weight, scale, bias, defer_scales=defer_scales)
        rows = x.reshape(-1, x.shape[-1])
        return fp8_linear(rows, weight, scale, bias).view(*x.shape[:-1], weight.shape[0])
    return linear(x, weight, bias)


def project(proj: nn.Module, x: torch.Tensor, *, defer_scales: bool = False) -> torch.Tensor | ScaledProduct:
    """``product`` through a linear module (nn.Linear or Fp8Linear). A row-parallel one (its ``tp_group``
    set: o and down of a tensor-parallel engine) all-reduces this rank's partial product, then adds its
    (replicated) bias; its scales are never deferred (the sum needs the real values)."""
    scale = getattr(proj, "weight_scale", None)
    group = getattr(proj, "tp_group", None)
    if group is None:
        return product(x, proj.weight, proj.bias, scale, defer_scales=defer_scales)
    out = tp_all_reduce(product(x, proj.weight, None, scale).contiguous(), group)
    return out if proj.bias is None else out + proj.bias


class RowParallelLinear(nn.Linear):
    """nn.Linear whose call goes through ``project`` (its ``tp_group``: the all-reduce of the partial sums)."""

    tp_group: Any = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x)


class Fp8Linear(nn.Module):
    """A linear of an FP8 engine: ``weight`` (out, in) float8_e4m3fn, ``weight_scale`` (out,) float32
    (row n of the real weight is weight[n] * weight_scale[n]), ``bias`` in the model dtype or None.
    The state dict's names are nn.Linear's plus ``weight_scale`` (engine.build's FP8 layout)."""

    def __init__(self, n_in: int, n_out: int, bias: bool, dtype, device):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(n_out, n_in, dtype=FP8_DTYPE, device=device), requires_grad=False)
        self.weight_scale = nn.Parameter(torch.empty(n_out, dtype=torch.float32, device=device), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(n_out, dtype=dtype, device=device), requires_grad=False) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return project(self, x)


def _linear(n_in: int, n_out: int, bias: bool, dtype, device, quantization: str | None = None,
            tp_group=None) -> nn.Module:
    """A linear; with ``tp_group`` a row-parallel one (its input columns split across the group's ranks)."""
    if quantization not in QUANTIZATIONS:
        raise ValueError(f"quantization {quantization!r} is not supported by encoder-decoder stacks; allowed: fp8")
    if quantization == "fp8":
        module = Fp8Linear(n_in, n_out, bias, dtype, device)
    elif tp_group is not None:
        module = RowParallelLinear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    else:
        return nn.Linear(n_in, n_out, bias=bias, dtype=dtype, device=device)
    module.tp_group = tp_group
    return module


def is_fp8(stack: nn.Module) -> bool:
    """Whether ``stack``'s layer linears are FP8 (an engine built with --quantization fp8)."""
    return any(isinstance(m, Fp8Linear) for m in stack.modules())


class Attention(nn.Module):
    """q, k, v, o projections of ``heads`` heads of ``head_dim`` (this rank's heads / tp of them)."""

    def __init__(self, spec: EncDecSpec, heads: int, head_dim: int, dtype, device, quantization=None,
                 tp: TensorParallel = ONE_RANK, what: str = "heads"):
        super().__init__()
        self.heads, self.head_dim = tp.split(heads, what), head_dim
        self.scale = head_dim ** -0.5 if spec.scale_scores else 1.0
        inner = self.heads * head_dim
        self.q = _linear(spec.d_model, inner, spec.bias, dtype, device, quantization)
        self.k = _linear(spec.d_model, inner, spec.bias and spec.key_bias, dtype, device, quantization)
        self.v = _linear(spec.d_model, inner, spec.bias, dtype, device, quantization)
        self.o = _linear(inner, spec.d_model, spec.bias, dtype, device, quantization, tp.group)
        # [q | k | v] as one product once fuse_qkv ran (a decoder's self-attention): weight, bias, FP8 row scales
        self.qkv_weight: torch.Tensor | None = None
        self.qkv_bias: torch.Tensor | None = None
        self.qkv_scale: torch.Tensor | None = None

    def fuse_qkv(self) -> None:
        """q's, k's and v's weights become the thirds of one (3 * inner, d_model) tensor (their Parameters views of
        it: no extra memory, state dicts unchanged), so q, k and v take one product (``qkv_heads``) instead of
        three: at a decode step's 64-256 rows each product is a few microseconds of launch-bound GEMM whatever
        its width. Biases likewise, a zero k bias where k has none (BART's, Whisper's k); FP8 weights' per-row
        scales concatenate exactly (``qkv_scale``). Idempotent."""
        if self.qkv_weight is not None:
            return
        projections = (self.q, self.k, self.v)
        inner = self.q.weight.shape[0]
        self.qkv_weight = torch.cat([p.weight.detach() for p in projections])
        for index, proj in enumerate(projections):
            proj.weight = nn.Parameter(self.qkv_weight[index * inner:(index + 1) * inner], requires_grad=False)
        if isinstance(self.q, Fp8Linear):
            self.qkv_scale = torch.cat([p.weight_scale.detach() for p in projections])
            for index, proj in enumerate(projections):
                proj.weight_scale = nn.Parameter(self.qkv_scale[index * inner:(index + 1) * inner],
                                                 requires_grad=False)
        biases = [p.bias for p in projections]
        if any(b is not None for b in biases):
            dtype, device = next(b for b in biases if b is not None).dtype, self.qkv_weight.device
            self.qkv_bias = torch.cat([torch.zeros(inner, dtype=dtype, device=device) if b is None else b.detach()
                                       for b in biases])
            for index, proj in enumerate(projections):
                if proj.bias is not None:
                    proj.bias = nn.Parameter(self.qkv_bias[index * inner:(index + 1) * inner], requires_grad=False)

    def heads_of(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        return proj(x).view(*x.shape[:-1], self.heads, self.head_dim)

    def qkv_heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(q, k, v), each (..., heads, head_dim), of x (..., d_model) through ``product``. FP8 weights where
        the W8A8 path runs (CUDA: kernels/fp8.py quantizes_activations): x quantized per token once for the
        three products (QuantizedRows: the values each would make itself), not once in each."""
        if self.qkv_weight is not None:  # (a decoder's rows, (num_tokens, d_model) or QuantizedRows): one product
            qkv = product(x, self.qkv_weight, self.qkv_bias, self.qkv_scale)
            return qkv.view(-1, 3, self.heads, self.head_dim).unbind(1)
        if isinstance(x, QuantizedRows):  # (a decoder step's rows, quantized by their norm: Norm.add_and_norm)
            return tuple(project(p, x).view(-1, self.heads, self.head_dim) for p in (self.q, self.k, self.v))
        lead = x.shape[:-1]
        if isinstance(self.q, Fp8Linear) and quantizes_activations(x.device):
            x = as_quantized_rows(x.reshape(-1, x.shape[-1]))
        return tuple(project(p, x).view(*lead, self.heads, self.head_dim) for p in (self.q, self.k, self.v))

    def rows_of(self, proj: nn.Module, x: torch.Tensor) -> torch.Tensor:
        """heads_of for a decoder step's (num_tokens, d_model) rows, through ``product`` (kernels/linear.py:
        the skinny kernel where the runner chose it at load for the weight, else F.linear; or fp8_linear).
        x may be QuantizedRows (Norm.add_and_norm)."""
        return project(proj, x).view(-1, self.heads, self.head_dim)


class MLP(nn.Module):
    def __init__(self, spec: EncDecSpec, width: int, dtype, device, quantization=None, tp: TensorParallel = ONE_RANK,
                 what: str = "ffn"):
        super().__init__()
        width = tp.split(width, what)
        self.gate = _linear(spec.d_model, width, spec.bias, dtype, device, quantization) if spec.gated_mlp else None
        self.up = _linear(spec.d_model, width, spec.bias, dtype, device, quantization)
        self.down = _linear(width, spec.d_model, spec.bias, dtype, device, quantization, tp.group)
        self.activation = {"relu": F.relu, "gelu": F.gelu,
                           "gelu_new": lambda x: F.gelu(x, approximate="tanh")}[spec.activation]
        self.activation_name = LINEAR_ACTIVATIONS[spec.activation]
        self.gate_up: torch.Tensor | None = None  # (2 * width, d_model) once fuse_gate_up ran
        self.gate_up_scale: torch.Tensor | None = None  # FP8: its (2 * width,) row scales, [gate's | up's]

    def fuse_gate_up(self) -> None:
        """Gated MLP without biases (T5 v1.1 / Flan): gate's and up's weights become the two halves of
        one (2 * width, d_model) tensor, so each forward takes one product and one activation-and-
        product pass (kernels/activation.py) instead of two products and two elementwise passes.
        The parameters stay (views of it; state dicts unchanged) and the memory is not doubled.
        FP8 weights fuse the same way: their scales are per output row, so [gate's | up's] scales
        are the fused weight's, exactly (``gate_up_scale``)."""
        if self.gate is None or self.gate.bias is not None or self.gate_up is not None:
            return
        fused = torch.cat([self.gate.weight.detach(), self.up.weight.detach()])
        width = self.gate.weight.shape[0]
        self.gate.weight = nn.Parameter(fused[:width], requires_grad=False)
        self.up.weight = nn.Parameter(fused[width:], requires_grad=False)
        if isinstance(self.gate, Fp8Linear):
            scales = torch.cat([self.gate.weight_scale.detach(), self.up.weight_scale.detach()])
            self.gate.weight_scale = nn.Parameter(scales[:width], requires_grad=False)
            self.up.weight_scale = nn.Parameter(scales[width:], requires_grad=False)
            self.gate_up_scale = scales
        self.gate_up = fused

    def _gated(self, h: torch.Tensor) -> torch.Tensor:
        """(n, 2 * width) [gate | up] -> activation(gate) * up, gelu-tanh (T5's gated-gelu) in one pass."""
        if self.activation_name == "gelu_tanh":
            return gelu_tanh_and_mul(h)
        gate, up = h.chunk(2, dim=-1)
        return self.activation(gate) * up

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.gate_up is not None:
            h = F.linear(x, self.gate_up) if self.gate_up_scale is None else product(x, self.gate_up,
                                                                                   scale=self.gate_up_scale)
            return project(self.down, self._gated(h.view(-1, h.shape[-1])).view(*x.shape[:-1], -1))
        if self.gate is not None:
            return project(self.down, self.activation(self.gate(x)) * self.up(x))
        return project(self.down, self.activation(self.up(x)))

    def rows(self, x: torch.Tensor | QuantizedRows, *, defer_scales: bool = False) -> torch.Tensor | ScaledProduct:
        """forward for a decoder step's (num_tokens, d_model) rows (or QuantizedRows: Norm.add_and_norm)
        through kernels/linear.py: the up product, its bias and activation one skinny kernel where the
        runner chose it at load (FP8 weights: kernels/fp8.py's fp8_linear_activated, the same fusion in the
        W8A8 skinny kernel, also at 17-128 rows with a wide-row tiling). FP8 [gate | up] with the gated-GELU
        on the W8A8 path: the activation's output quantized per token in its kernel for the down product
        (gelu_tanh_and_mul_quantized: the values fp8_linear would make of it, one kernel fewer); then the
        [gate | up] product may defer its scales to that kernel, and with ``defer_scales`` the down product
        its own to the reader (``product``)."""
        if self.gate_up is not None:
            values = x.values if isinstance(x, QuantizedRows) else x
            if (self.gate_up_scale is not None and self.activation_name == "gelu_tanh"
                    and quantizes_activations(values.device)):
                h = product(x, self.gate_up, scale=self.gate_up_scale, defer_scales=True)
                return project(self.down, gelu_tanh_and_mul_quantized(h), defer_scales=defer_scales)
            h = product(x, self.gate_up, scale=self.gate_up_scale)
            return project(self.down, self._gated(h))
        if self.gate is not None:
            return project(self.down, self.activation(project(self.gate, x)) * project(self.up, x),
                           defer_scales=defer_scales)
        if isinstance(self.up, Fp8Linear):  # (the activation in the skinny kernel's epilogue where it runs)
            up = fp8_linear_activated(x, self.up.weight, self.up.weight_scale, self.up.bias, self.activation_name)
            return project(self.down, up, defer_scales=defer_scales)
        return project(self.down, linear_activated(x, self.up.weight, self.up.bias, self.activation_name))


def fuse_self_attention_qkv(decoder: nn.Module) -> nn.Module:
    """Attention.fuse_qkv on every decoder layer's self-attention (after its weights are loaded); returns it."""
    for layer in decoder.layers:
        layer.self_attn.fuse_qkv()
    return decoder


def fuse_gated_mlps(stack: nn.Module) -> nn.Module:
    """MLP.fuse_gate_up on every gated MLP of ``stack`` (after its weights are loaded); returns it."""
    for module in stack.modules():
        if isinstance(module, MLP):
            module.fuse_gate_up()
    return stack


def _sublayer(norm: Norm, pre_norm: bool, x: torch.Tensor, fn) -> torch.Tensor:
    """Pre-norm: x + fn(norm(x)); post-norm (BART): norm(x + fn(x))."""
    return x + fn(norm(x)) if pre_norm else norm(x + fn(x))


class _Stack(nn.Module):
    """What both stacks hold: token embeddings (times embed_scale), learned positions or a
    relative-bias table of ``heads`` columns, an embedding norm, ``layers`` and a final norm."""

    def __init__(self, spec: EncDecSpec, layers: list[nn.Module], heads: int, dtype, device, *,
                 tokens: bool = True, positions: int = 0, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.spec, self.tp = spec, tp
        # Tables left uninitialized, the weights loaded over them (engine.models.tables.uninitialized_table says why)
        def table(rows: int, width: int) -> nn.Embedding:
            return uninitialized_table(rows, width, dtype=dtype, device=device, frozen=False)

        self.embed_tokens = table(spec.vocab_size, spec.d_model) if tokens else None
        rows = (positions or spec.max_positions) + spec.position_offset
        self.embed_positions = table(rows, spec.d_model) if spec.positions == "learned" else None
        # (T5: this rank's heads' columns of the relative-position table)
        self.position_bias = table(spec.relative_buckets, heads // tp.size) if spec.positions == "relative" else None
        self.embedding_norm = Norm(spec, dtype, device) if spec.embedding_norm else None
        self.layers = nn.ModuleList(layers)
        self.final_norm = Norm(spec, dtype, device) if spec.final_norm else None

    def embed(self, ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        x = self.embed_tokens(ids)
        if self.spec.embed_scale != 1.0:
            x = x * self.spec.embed_scale
        if self.embed_positions is not None:
            x = x + self.embed_positions(positions + self.spec.position_offset)
        return x if self.embedding_norm is None else self.embedding_norm(x)


class EncoderLayer(nn.Module):
    def __init__(self, spec: EncDecSpec, dtype, device, quantization=None, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.pre_norm = spec.pre_norm
        self.attn_norm, self.mlp_norm = Norm(spec, dtype, device), Norm(spec, dtype, device)
        self.attn = Attention(spec, spec.encoder_heads, spec.encoder_head_dim, dtype, device, quantization, tp,
                              "encoder_heads")
        self.mlp = MLP(spec, spec.encoder_ffn, dtype, device, quantization, tp, "encoder_ffn")

    def forward(self, x: torch.Tensor, bias: torch.Tensor | None, t5=None) -> torch.Tensor:
        """x: (B, L, d); bias: (B or 1, heads or 1, L or 1, L), -inf at padded keys, or None (no
        padding, no position bias). CPU: float32 scores (bias float32); CUDA: torch's fused
        attention in the model dtype (bias in it too; engine/planless_attention.py), as transformers' sdpa
        attention runs it.
        ``t5`` (T5 on CUDA): (stack, lengths) for t5_attention.encoder_attention instead of ``bias``.
        (Pre-norm stacks run ``pre_norm_step`` instead: Encoder.encode.)"""
        x = _sublayer(self.attn_norm, self.pre_norm, x, lambda h: self.attend(h, bias, t5))
        return _sublayer(self.mlp_norm, self.pre_norm, x, self.mlp)

    def attend(self, h: torch.Tensor | QuantizedRows, bias: torch.Tensor | None, t5=None,
               shape: torch.Size | None = None) -> torch.Tensor:
        """The self-attention sublayer (forward's bias and t5) of h (B, L, d), or with ``shape`` (B, L, d) of its
        (B * L, d) rows, a tensor or QuantizedRows (Norm.add_and_norm) -> (B, L, d)."""
        q, k, v = self.attn.qkv_heads(h)
        if shape is not None:
            q, k, v = (t.view(*shape[:2], self.attn.heads, self.attn.head_dim) for t in (q, k, v))
        if t5 is not None:
            return project(self.attn.o, encoder_attention(t5[0], q, k, v, t5[1], self.attn.scale).flatten(2))
        if q.is_cuda:
            out = planless_sdpa(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), attn_mask=bias,
                                scale=self.attn.scale).transpose(1, 2)  # (no cuDNN plan per new batch)
            return project(self.attn.o, out.flatten(2))
        dtype = q.dtype
        q, k, v = q.float(), k.float(), v.float()
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * self.attn.scale
        if bias is not None:
            scores = scores + bias
        out = torch.einsum("bhqk,bkhd->bqhd", torch.softmax(scores, dim=-1), v).to(dtype)
        return project(self.attn.o, out.flatten(2))

    def pre_norm_step(self, x: torch.Tensor, residual: torch.Tensor | None, bias: torch.Tensor | None, t5,
                      shape: torch.Size, quantize: bool) -> tuple[torch.Tensor, torch.Tensor]:
        """A pre-norm layer over the (B * L, d) rows of a (B, L, d) = ``shape`` batch, the decoder step's way:
        (this layer's last sublayer output, the residual stream without it). Each norm does the residual add
        before it and, ``quantize`` (FP8 on the W8A8 path), quantizes its output for the products after it in
        its kernel (Norm.add_and_norm); the MLP runs as MLP.rows (T5 v1.1's gated-GELU quantizing the down
        product's input). The same values as forward's (up to the kernels' rounding on CUDA)."""
        h, residual = self.attn_norm.add_and_norm(x, residual, quantize=quantize)
        x = self.attend(h, bias, t5, shape).reshape(-1, shape[-1])
        h, residual = self.mlp_norm.add_and_norm(x, residual, quantize=quantize)
        return self.mlp.rows(h), residual


class Encoder(_Stack):
    """The encoder stack; ``encode`` takes whole inputs and returns their outputs. Whisper's
    (spec.num_mel_bins > 0) takes log-mel features through its convolutions instead of tokens."""

    def __init__(self, spec: EncDecSpec, *, dtype=torch.float32, device="cpu", quantization: str | None = None,
                 tp: TensorParallel = ONE_RANK):
        super().__init__(spec, [EncoderLayer(spec, dtype, device, quantization, tp) for _ in range(spec.encoder_layers)],
                         spec.encoder_heads, dtype, device, tokens=not spec.num_mel_bins,
                         positions=spec.encoder_max_positions, tp=tp)
        if spec.num_mel_bins:
            self.conv1 = nn.Conv1d(spec.num_mel_bins, spec.d_model, 3, padding=1, dtype=dtype, device=device)
            self.conv2 = nn.Conv1d(spec.d_model, spec.d_model, 3, stride=2, padding=1, dtype=dtype, device=device)

    def front_end(self, features: torch.Tensor) -> torch.Tensor:
        """(B, T, num_mel_bins) log-mel frames of B inputs of one length T -> (B, ceil(T / 2), d_model)
        with positions (inputs of different lengths go apart: padding would change the last frames
        the stride-2 convolution sees)."""
        x = features.to(self.conv1.weight.dtype).transpose(1, 2)
        x = F.gelu(self.conv2(F.gelu(self.conv1(x)))).transpose(1, 2)
        return x + self.embed_positions.weight[:x.shape[1]]

    def front_ends(self, inputs: list, device) -> list[torch.Tensor]:
        """front_end of each (T_i, num_mel_bins) input, those of one length in one batch (30-s windows
        are all 3,000 frames: one convolution pass instead of one per clip)."""
        by_length: dict[int, list[int]] = {}
        for index, f in enumerate(inputs):
            by_length.setdefault(len(f), []).append(index)
        out: list = [None] * len(inputs)
        for indices in by_length.values():
            batch = torch.stack([torch.as_tensor(inputs[i], dtype=torch.float32) for i in indices]).to(device)
            for i, embedded in zip(indices, self.front_end(batch)):
                out[i] = embedded
        return out

    @staticmethod
    def output_length(input_length: int, spec: EncDecSpec) -> int:
        """Encoder outputs of an input of ``input_length`` tokens or feature frames."""
        return (input_length + 1) // 2 if spec.num_mel_bins else input_length

    @torch.inference_mode()
    def encode(self, inputs: list) -> list[torch.Tensor]:
        """Each input's encoder output (L_i, d_model), from one padded pass over all of them: token
        lists, or (T, num_mel_bins) feature tensors for Whisper. Nothing here waits for the device
        (the lengths are known on the host), so the caller's host work overlaps the pass."""
        device = self.layers[0].attn.q.weight.device
        if self.spec.num_mel_bins:
            embedded = self.front_ends(inputs, device)
            sizes = [e.shape[0] for e in embedded]
            longest = max(sizes)
            x = torch.stack([F.pad(e, (0, 0, 0, longest - e.shape[0])) for e in embedded])
        else:
            sizes = [len(t) for t in inputs]
            longest = max(sizes)
            ids = torch.tensor([list(t) + [0] * (longest - len(t)) for t in inputs], device=device)
            x = self.embed(ids, torch.arange(longest, device=device).expand(len(inputs), -1))
        positions = torch.arange(longest, device=device)
        lengths = torch.tensor(sizes, device=device)
        if self.position_bias is not None and kernels_enabled(x):  # the bias is made in the kernel
            bias, t5 = None, (self, lengths.to(torch.int32))
        else:
            bias, t5 = self._attention_bias(positions, lengths, x.dtype if x.is_cuda else torch.float32,
                                            padded=min(sizes) < longest), None
        if self.spec.pre_norm:  # T5, Whisper: the residual adds in the norms (EncoderLayer.pre_norm_step)
            shape = x.shape
            quantize = isinstance(self.layers[0].attn.q, Fp8Linear) and quantizes_activations(x.device)
            x, residual = x.reshape(-1, shape[-1]), None
            for layer in self.layers:
                x, residual = layer.pre_norm_step(x, residual, bias, t5, shape, quantize)
            x = (x + residual if self.final_norm is None else self.final_norm.add_and_norm(x, residual)[0]).view(shape)
        else:
            for layer in self.layers:
                x = layer(x, bias, t5)
            if self.final_norm is not None:
                x = self.final_norm(x)
        return [x[i, :length] for i, length in enumerate(sizes)]


    def _attention_bias(self, positions: torch.Tensor, lengths: torch.Tensor, dtype, *,
                        padded: bool) -> torch.Tensor | None:
        """The encoder layers' additive bias in ``dtype``: -inf at each input's padded keys
        (B, 1, 1, L), plus T5's bidirectional position bias (1, heads, L, L); None when there is
        neither (``padded`` False: all inputs of one length; learned positions: the fused attention
        needs no mask)."""
        longest, batch = positions.shape[0], lengths.shape[0]
        bias = None
        if padded:
            beyond = positions.view(1, -1) >= lengths.view(-1, 1)  # (B, L) keys beyond each input
            bias = torch.zeros(batch, 1, 1, longest, dtype=dtype, device=positions.device)
            bias.masked_fill_(beyond.view(batch, 1, 1, longest), float("-inf"))
        if self.position_bias is not None:
            table = position_bias(self.position_bias.weight, positions, positions, bidirectional=True,
                                  max_distance=self.spec.relative_max_distance).unsqueeze(0).to(dtype)
            bias = table if bias is None else bias + table
        return bias


@dataclass
class CrossAttentionBatch:
    """A decoder step's cross-attention inputs: the cross pool (num_layers, 2, blocks,
    tokens_per_block, heads, head_dim) and one-token-sequence metadata (``cross_metadata``)."""

    pool: torch.Tensor
    meta: AttentionMetadata


def cross_metadata(block_tables: list[list[int]], encoder_lengths: list[int], device) -> AttentionMetadata:
    """Metadata making each new token (row i) its own sequence of one query over its request's
    encoder output: ``block_tables[i]`` holds its cross blocks, ``encoder_lengths[i]`` its length."""
    width = max(len(t) for t in block_tables)
    n = len(block_tables)
    return AttentionMetadata(
        slot_mapping=torch.empty(0, dtype=torch.int64, device=device),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in block_tables], dtype=torch.int32,
                                  device=device),
        cu_seqlens_q=torch.arange(n + 1, dtype=torch.int32, device=device),
        context_lens=torch.tensor(encoder_lengths, dtype=torch.int32, device=device),
        max_seqlen_q=1, max_context_len=max(encoder_lengths), is_decode_only=True,
        cu_seqlens_q_host=list(range(n + 1)), context_lens_host=list(encoder_lengths))


class DecoderLayer(nn.Module):
    def __init__(self, spec: EncDecSpec, dtype, device, quantization=None, tp: TensorParallel = ONE_RANK):
        super().__init__()
        self.pre_norm = spec.pre_norm
        self.self_norm, self.cross_norm, self.mlp_norm = (Norm(spec, dtype, device) for _ in range(3))
        self.self_attn = Attention(spec, spec.decoder_heads, spec.head_dim, dtype, device, quantization, tp,
                                   "decoder_heads")
        self.cross_attn = Attention(spec, spec.decoder_heads, spec.head_dim, dtype, device, quantization, tp,
                                    "decoder_heads")
        self.mlp = MLP(spec, spec.decoder_ffn, dtype, device, quantization, tp, "decoder_ffn")


class Decoder(_Stack):
    """The decoder stack with the model surface the runner drives (engine/models/__init__.py),
    plus the cross-attention inputs of each step."""

    def __init__(self, spec: EncDecSpec, *, dtype=torch.float32, device="cpu", quantization: str | None = None,
                 tp: TensorParallel = ONE_RANK):
        super().__init__(spec, [DecoderLayer(spec, dtype, device, quantization, tp) for _ in range(spec.decoder_layers)],
                         spec.decoder_heads, dtype, device, tp=tp)
        rows = vocab_rows(spec.vocab_size, tp.size)  # (this rank's slice of the vocabulary: module docstring)
        self.lm_head = nn.Linear(spec.d_model, rows, bias=False, dtype=dtype, device=device)
        if spec.final_logits_bias:
            self.final_logits_bias = nn.Parameter(torch.zeros(rows, dtype=dtype, device=device))
        else:
            self.final_logits_bias = None

    def init_buffers(self, device) -> None:  # (the model surface; nothing to make)
        pass

    def decode_step_weights(self) -> list[torch.Tensor]:
        """The weights a decode step multiplies through kernels/linear.py's linear / linear_float32_out or
        kernels/fp8.py's fp8_linear, each once: every layer's self-attention q, k, v (one [q | k | v] weight once
        fused: Attention.fuse_qkv), o, cross-attention q, o
        (its k and v are projected at encode time, fused: cross_kv.py), the MLP's products ([gate | up] in
        place of its two halves once fused: its GELU is not the SiLU of the skinny kernel's gated form, so
        it is a plain product here) and the LM head. What the runner times its load-time tilings for."""
        weights = []
        for layer in self.layers:
            attn = layer.self_attn
            qkv = [attn.qkv_weight] if attn.qkv_weight is not None else [p.weight for p in (attn.q, attn.k, attn.v)]
            weights += qkv
            weights += [p.weight for p in (attn.o, layer.cross_attn.q, layer.cross_attn.o)]
            mlp = layer.mlp
            halves = [mlp.gate_up] if mlp.gate_up is not None else [
                m.weight for m in (mlp.gate, mlp.up) if m is not None]
            weights += halves + [mlp.down.weight]
        return weights + [self.lm_head.weight]

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor,
                meta: AttentionMetadata, *, cross: CrossAttentionBatch) -> torch.Tensor:
        """input_ids, positions: (num_tokens,); kv_cache: the paged self-attention pool -> (num_tokens, d)."""
        x = self.embed(input_ids, positions)
        # Pre-norm (T5, Whisper): each sublayer's residual add is done by the next norm (Norm.add_and_norm: it
        # adds, normalizes and, FP8 on the W8A8 path, quantizes for the next products in one kernel).
        quantize = isinstance(self.layers[0].self_attn.q, Fp8Linear) and quantizes_activations(x.device)
        # FP8 products read by a quantizing RMS norm (T5's o, cross o and down but the last layer's, which the
        # final norm reads) may hand it their scales to apply (kernels/fp8.py "Deferred scales", chosen at load)
        defers = quantize and self.spec.norm == "rms"
        residual = None
        for index, layer in enumerate(self.layers):
            def attend_self(h, layer=layer, index=index, defer_scales=False):
                attn = layer.self_attn
                q, k, v = attn.qkv_heads(h)
                k_cache, v_cache = kv_cache[index, 0], kv_cache[index, 1]
                if self.position_bias is None:  # (a decode step on CUDA: the write and attention in one kernel)
                    out = append_paged_attention(q, k, v, k_cache, v_cache, meta, attn.scale)
                else:  # T5 (t5_attention.py)
                    write_kv_cache(k, v, k_cache, v_cache, meta.slot_mapping)
                    out = decoder_self_attention(self, q, k_cache, v_cache, meta, attn.scale)
                return project(attn.o, out.flatten(1), defer_scales=defer_scales)

            def attend_encoder(h, layer=layer, index=index, defer_scales=False):
                attn = layer.cross_attn
                out = cross_attention(attn.rows_of(attn.q, h), cross.pool[index, 0], cross.pool[index, 1],
                                      cross.meta, attn.scale, decode_step=meta.is_decode_only)
                return project(attn.o, out.flatten(1), defer_scales=defer_scales)

            if not layer.pre_norm:  # BART: norm(x + sublayer(x))
                x = _sublayer(layer.self_norm, False, x, attend_self)
                x = _sublayer(layer.cross_norm, False, x, attend_encoder)
                x = _sublayer(layer.mlp_norm, False, x, layer.mlp.rows)
                continue
            last = index == len(self.layers) - 1
            for norm, sublayer, defer in ((layer.self_norm, attend_self, defers),
                                          (layer.cross_norm, attend_encoder, defers),
                                          (layer.mlp_norm, layer.mlp.rows, defers and not last)):
                h, residual = norm.add_and_norm(x, residual, quantize=quantize)
                x = sublayer(h, defer_scales=defer)
        if residual is not None:  # (pre-norm: x is the last sublayer's output, not yet added)
            if self.final_norm is None:
                return apply_scales(x) + residual
            return self.final_norm.add_and_norm(x, residual)[0]
        return x if self.final_norm is None else self.final_norm(x)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if self.spec.logits_scale != 1.0:
            hidden = hidden * self.spec.logits_scale
        logits = linear_float32_out(hidden, self.lm_head.weight)
        if self.final_logits_bias is not None:
            logits = logits + self.final_logits_bias.float()
        if self.tp.group is None:
            return logits
        shards = [torch.empty_like(logits) for _ in range(self.tp.size)]  # (each rank's vocabulary slice)
        dist.all_gather(shards, logits.contiguous(), group=self.tp.group)
        return torch.cat(shards, dim=-1)[:, :self.spec.vocab_size]
