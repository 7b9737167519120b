"""What an expert MLP does around its two products, beyond the plain SiLU MLP of Mixtral and
Qwen3-MoE: per-expert biases and the gated activation (gpt-oss has both).

For one expert e and the assignment rows it received (n, H):

    h   = rows @ gate_up[e].T + gate_up_bias[e]          (n, 2I), columns [gate | up]
    act = activation(gate, up)                           (n, I)
    y   = act @ down[e].T + down_bias[e]                 (n, H), then scaled by the routing weight

Activations (``ACTIVATIONS``; the integer is the kernels' constexpr):
    silu:            silu(gate) * up
    swiglu_clamped:  (clamp(up, -L, L) + 1) * g * sigmoid(1.702 * g),  g = min(gate, L), L = swiglu_limit
    relu2:           relu(h)^2, not gated (Nemotron-H's experts): gate_up holds I rows per expert (up
                     only), h = rows @ up[e].T (n, I). The block-tiled kernels (kernels/fused_moe.py)
                     take it; the sorted-rows path and the quantized experts' kernels do not.

Shared by the grouped-GEMM kernels' epilogue (kernels/moe_blocks.py store_rows) and the
sorted-rows path (kernels/moe_grouped_mm.py), which applies it in ``expert_activation``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, tl, triton, use_triton

ACTIVATIONS = {"silu": 0, "swiglu_clamped": 1, "relu2": 2}
SWIGLU_ALPHA = 1.702  # gpt-oss's sigmoid slope (fixed in its reference code, not in its config)


@dataclass(frozen=True)
class ExpertEpilogue:
    """gate_up_bias (E, 2I) rows [gate | up], down_bias (E, H), both in the activations' dtype or
    None; activation a key of ACTIVATIONS, with swiglu_limit for (and only for) swiglu_clamped."""

    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    activation: str = "silu"
    swiglu_limit: float | None = None

    def __post_init__(self):
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation {self.activation!r} is not supported; allowed: {', '.join(ACTIVATIONS)}")
        if (self.activation == "swiglu_clamped") != (self.swiglu_limit is not None):
            raise ValueError("swiglu_limit goes with activation 'swiglu_clamped', and only with it")


    @property
    def gated(self) -> bool:
        """[gate | up] rows (2I per expert), or up rows only (relu2)."""
        return self.activation != "relu2"


PLAIN_SILU = ExpertEpilogue()


def activate_ref(gate_up: torch.Tensor, epilogue: ExpertEpilogue = PLAIN_SILU) -> torch.Tensor:
    """Gated activation of product rows (n, 2I) [gate | up] (relu2: (n, I) up rows) -> (n, I) in their dtype. silu rounds
    as F.silu(gate) * up does (silu to the dtype, then the product); swiglu_clamped is computed
    in float32 and rounded once, as the kernels do."""
    if epilogue.activation == "relu2":  # not gated: gate_up is (n, I), rounded as F.relu(h).square()
        return F.relu(gate_up).square()
    gate, up = gate_up.chunk(2, dim=-1)
    if epilogue.activation == "silu":
        return F.silu(gate) * up
    return swiglu_clamped_ref(gate.float(), up.float(), epilogue.swiglu_limit).to(gate_up.dtype)


def swiglu_clamped_ref(gate: torch.Tensor, up: torch.Tensor, limit: float) -> torch.Tensor:
    """gpt-oss's clamped SwiGLU of float32 gate and up, unrounded."""
    gate = gate.clamp(max=limit)
    up = up.clamp(-limit, limit)
    return (up + 1.0) * gate * torch.sigmoid(SWIGLU_ALPHA * gate)


def expert_activation_ref(h: torch.Tensor, row_expert: torch.Tensor, epilogue: ExpertEpilogue) -> torch.Tensor:
    """h (n, 2I) rows of products, row_expert (n,) the expert of each row -> (n, I): the expert's
    gate_up bias added (rounded to h's dtype), then the activation."""
    if epilogue.gate_up_bias is not None:
        h = h + epilogue.gate_up_bias[row_expert.long()]
    return activate_ref(h, epilogue)


@jit
def gated_activation(gate, up, OUT_DTYPE: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr):
    """activate_ref inside a kernel: gate, up float32 tiles (their products, bias included) ->
    the float32 activation, rounded to OUT_DTYPE where activate_ref rounds (the caller rounds the
    result once more when it stores it)."""
    gate = gate.to(OUT_DTYPE).to(tl.float32)
    up = up.to(OUT_DTYPE).to(tl.float32)
    if ACTIVATION == 0:
        return (gate / (1.0 + tl.exp(-gate))).to(OUT_DTYPE).to(tl.float32) * up
    return swiglu_clamped(gate, up, SWIGLU_LIMIT)


@jit
def swiglu_clamped(gate, up, SWIGLU_LIMIT: tl.constexpr):
    """swiglu_clamped_ref in a kernel: float32 gate and up tiles -> the float32 activation, unrounded."""
    gate = tl.minimum(gate, SWIGLU_LIMIT)
    up = tl.minimum(tl.maximum(up, -SWIGLU_LIMIT), SWIGLU_LIMIT)
    return (up + 1.0) * gate / (1.0 + tl.exp(-1.702 * gate))  # SWIGLU_ALPHA


@jit
def _expert_activation_kernel(h_ptr, out_ptr, row_expert_ptr, bias_ptr, inter, stride_h, stride_o, stride_b,
                              HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, SWIGLU_LIMIT: tl.constexpr,
                              BLOCK: tl.constexpr):
    """Program (row, column tile): BLOCK columns of row ``row``'s activation (expert_activation_ref)."""
    row = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    ok = cols < inter
    gate = tl.load(h_ptr + row * stride_h + cols, mask=ok, other=0.0)
    up = tl.load(h_ptr + row * stride_h + inter + cols, mask=ok, other=0.0)
    if HAS_BIAS:
        bias_row = bias_ptr + tl.load(row_expert_ptr + row).to(tl.int64) * stride_b
        gate = (gate.to(tl.float32) + tl.load(bias_row + cols, mask=ok, other=0.0).to(tl.float32)).to(gate.dtype)
        up = (up.to(tl.float32) + tl.load(bias_row + inter + cols, mask=ok, other=0.0).to(tl.float32)).to(up.dtype)
    act = gated_activation(gate.to(tl.float32), up.to(tl.float32), out_ptr.dtype.element_ty, ACTIVATION,
                           SWIGLU_LIMIT)
    tl.store(out_ptr + row * stride_o + cols, act.to(out_ptr.dtype.element_ty), mask=ok)


def expert_activation(h: torch.Tensor, row_expert: torch.Tensor, epilogue: ExpertEpilogue) -> torch.Tensor:
    """expert_activation_ref: Triton on CUDA, else the reference."""
    if not use_triton(h):
        return expert_activation_ref(h, row_expert, epilogue)
    rows, inter = h.shape[0], h.shape[1] // 2
    assert h.stride(1) == 1  # (rows at h_ptr + row * stride + column)
    out = torch.empty(rows, inter, dtype=h.dtype, device=h.device)
    if rows:
        # read at row_expert_ptr + row and bias_ptr + expert * stride + column
        row_expert, bias = dense(row_expert, epilogue.gate_up_bias)
        block = min(1024, triton.next_power_of_2(inter))
        _expert_activation_kernel[(rows, triton.cdiv(inter, block))](
            h, out, row_expert, bias if bias is not None else h, inter, h.stride(0), out.stride(0),
            bias.stride(0) if bias is not None else 0, HAS_BIAS=bias is not None,
            ACTIVATION=ACTIVATIONS[epilogue.activation], SWIGLU_LIMIT=float(epilogue.swiglu_limit or 0.0),
            BLOCK=block, num_warps=4)
    return out
