"""Rotary and bidirectional softmax attention within short runs of patches, one kernel reading a fused qkv
product: Qwen2.5-VL's window blocks (engine/vision/qwen2_5_vl.py).

``window_attention(qkv, heads, table, starts, lengths, scale) -> out``:
qkv (tokens, 3 * heads * head_dim), rows [q | k | v], each head's dims contiguous (the qkv product's output;
its row stride may be larger); table (tokens, head_dim) float32 [cos | sin] of the head_dim / 2 frequencies
of each token (row t rotates token t; engine/vision/tower_layout.py PatchRotary), None: no rotary;
starts, lengths (runs,) int32 or int64 on the device: each run's first token and token count (runs in any
order, disjoint); every run attends within itself, both ways -> out (tokens, heads * head_dim), q's dtype,
contiguous; rows of tokens in no run are left unwritten.

Per run and head: q and k rotated as kernels/rotary.py's apply_rotary (neox halves, fp32 math, rounded back
to the input dtype: what the unfused path's in-place rotation stores), then softmax(q k^T * scale) v with
fp32 scores and P rounded to v's dtype before the second product (as a flash kernel does).

Why: a window block of the 7B tower at 32 images of 448 x 448 (32,768 patches, 16 heads of 80) ran the
rotary as its own pass over q and k (read and written: ~0.34 GB), then SDPA over 512 windows of 64 patches,
whose flash kernel fills half of its 128-row query tile. Here each program loads its window's q, k, v once,
rotates in registers and needs no online softmax (the window is one key tile): no rotary pass, no q/k
write-back, 64-row tiles. Runs longer than ``MAX_RUN`` (full-frame blocks) stay with rotary + SDPA.

``window_attention_ref`` is the plain-torch reference (CPU, or CUDA without Triton); ``window_attention``
runs the kernel on CUDA, the reference elsewhere (the tests run ``window_attention_triton`` on CPU tensors
under TRITON_INTERPRET=1).
"""
from __future__ import annotations

import math
import os

import torch

from kernels._triton import jit, tl, triton, use_triton
from kernels.paged_kv_math import rotate_pair

MAX_RUN = 128  # the longest run one program takes whole (its key tile); longer runs: rotary + SDPA
# (heads a program, warps a program); TILING_ENV "h,w" overrides it. On the H200 (2026-11-30 call 34, the 7B tower at
# 32 images of 448 x 448) 1 head and 4 warps ran the tower at 380.6 images/s; TMA loads (descriptor boxes per rotary
# half, 102 registers a thread at 8 warps) 369.4-369.8, the v tiles loaded first at 8 warps 363.3: removed.
DEFAULT_TILING = (1, 4)
TILING_ENV = "TRITONLLM_WINDOW_ATTN_TILING"


@jit
def _window_attention_kernel(
    qkv_ptr, out_ptr, table_ptr, starts_ptr, lengths_ptr, qk_scale, stride_qkv, stride_out, stride_table,
    HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK: tl.constexpr,
    HEADS_PER_PROGRAM: tl.constexpr, ROTARY: tl.constexpr, PRECISION: tl.constexpr,
):
    """Program (run, head group). Each head is read as its two halves (dims j and j + HEAD_DIM / 2: the rotary's
    pairs, so the rotation needs no second load), and the products are sums over the halves: q k^T = q1 k1^T +
    q2 k2^T, P v = [P v1 | P v2]."""
    run = tl.program_id(0)
    start = tl.load(starts_ptr + run).to(tl.int64)
    n = tl.load(lengths_ptr + run)
    rows = tl.arange(0, BLOCK)
    half = tl.arange(0, HALF_PAD)
    row_ok = rows < n
    HALF: tl.constexpr = HEAD_DIM // 2
    mask = row_ok[:, None] & (half < HALF)[None, :]
    tokens = start + rows
    if ROTARY:  # each token's cos / sin of the HALF frequencies
        table = table_ptr + tokens[:, None] * stride_table + half[None, :]
        cos = tl.load(table, mask=mask, other=1.0)
        sin = tl.load(table + HALF, mask=mask, other=0.0)
    for i in tl.static_range(HEADS_PER_PROGRAM):
        head = tl.program_id(1) * HEADS_PER_PROGRAM + i
        if head < HEADS:
            q_row = qkv_ptr + tokens[:, None] * stride_qkv + head * HEAD_DIM + half[None, :]
            k_row = q_row + HEADS * HEAD_DIM
            v_row = k_row + HEADS * HEAD_DIM
            q1 = tl.load(q_row, mask=mask, other=0.0)
            q2 = tl.load(q_row + HALF, mask=mask, other=0.0)
            k1 = tl.load(k_row, mask=mask, other=0.0)
            k2 = tl.load(k_row + HALF, mask=mask, other=0.0)
            if ROTARY:  # kernels/rotary.py's rotation, rounded back to the input dtype as it stores it
                r1, r2 = rotate_pair(q1, q2, cos, sin)
                q1, q2 = r1.to(q1.dtype), r2.to(q1.dtype)
                r1, r2 = rotate_pair(k1, k2, cos, sin)
                k1, k2 = r1.to(k1.dtype), r2.to(k1.dtype)
            scores = tl.dot(q1, tl.trans(k1), input_precision=PRECISION)
            scores = tl.dot(q2, tl.trans(k2), scores, input_precision=PRECISION) * qk_scale  # log2 units
            scores = tl.where(row_ok[None, :], scores, float("-inf"))
            top = tl.max(scores, 1)
            p = tl.exp2(scores - top[:, None])
            total = tl.sum(p, 1)[:, None]
            v1 = tl.load(v_row, mask=mask, other=0.0)
            v2 = tl.load(v_row + HALF, mask=mask, other=0.0)
            p = p.to(v1.dtype)
            out = out_ptr + tokens[:, None] * stride_out + head * HEAD_DIM + half[None, :]
            tl.store(out, (tl.dot(p, v1, input_precision=PRECISION) / total).to(v1.dtype), mask=mask)
            tl.store(out + HALF, (tl.dot(p, v2, input_precision=PRECISION) / total).to(v1.dtype), mask=mask)


def tiling() -> tuple[int, int]:
    """(heads a program, warps a program): TILING_ENV ("2,8"), else DEFAULT_TILING."""
    value = os.environ.get(TILING_ENV)
    if not value:
        return DEFAULT_TILING
    try:
        heads, warps = (int(v) for v in value.split(","))
    except ValueError:
        heads = warps = 0
    if heads < 1 or warps not in (1, 2, 4, 8, 16):
        raise ValueError(f"{TILING_ENV}={value!r}: give 'heads a program,warps' (warps a power of two up to 16)")
    return heads, warps


def window_attention_triton(qkv: torch.Tensor, heads: int, table: torch.Tensor | None, starts: torch.Tensor,
                            lengths: torch.Tensor, max_run: int, scale: float | None = None) -> torch.Tensor:
    tokens, width = qkv.shape
    head_dim = width // (3 * heads)
    if qkv.stride(1) != 1 or width != 3 * heads * head_dim or head_dim % 2:
        raise ValueError(f"qkv {tuple(qkv.shape)} (strides {qkv.stride()}) is not [q | k | v] rows of {heads} heads "
                         "with unit column stride and an even head width")
    if max_run > MAX_RUN:
        raise ValueError(f"runs of up to {MAX_RUN} tokens (got {max_run}): longer ones take rotary + SDPA")
    if table is not None and (table.dtype != torch.float32 or table.stride(1) != 1 or table.shape[1] != head_dim):
        raise ValueError(f"table: (tokens, {head_dim}) float32 rows [cos | sin], got {table.dtype} {tuple(table.shape)}")
    out = torch.empty(tokens, heads * head_dim, dtype=qkv.dtype, device=qkv.device)
    runs = starts.numel()
    if runs == 0:
        return out
    per_program, warps = tiling()
    per_program = min(per_program, heads)
    half_pad = max(16, triton.next_power_of_2(head_dim // 2))  # (tl.dot: K >= 16)
    block = max(16, triton.next_power_of_2(max_run))
    scale = head_dim ** -0.5 if scale is None else scale
    _window_attention_kernel[(runs, triton.cdiv(heads, per_program))](
        qkv, out, qkv if table is None else table, starts, lengths, scale * math.log2(math.e), qkv.stride(0),
        out.stride(0), 0 if table is None else table.stride(0),
        HEADS=heads, HEAD_DIM=head_dim, HALF_PAD=half_pad, BLOCK=block, HEADS_PER_PROGRAM=per_program,
        ROTARY=table is not None, PRECISION="ieee" if qkv.dtype == torch.float32 else "tf32",
        num_warps=warps, num_stages=1)
    return out


def window_attention_ref(qkv: torch.Tensor, heads: int, table: torch.Tensor | None, starts: torch.Tensor,
                         lengths: torch.Tensor, scale: float | None = None) -> torch.Tensor:
    """The same in plain torch: the rotation as kernels/rotary.py's reference, then SDPA per run."""
    import torch.nn.functional as F

    from kernels.rotary import apply_rotary_ref

    tokens = qkv.shape[0]
    q, k, v = qkv.view(tokens, 3, heads, -1).unbind(1)
    if table is not None:
        q, k = apply_rotary_ref(q, k, torch.arange(tokens, device=qkv.device), table)
    out = torch.zeros(tokens, heads, q.shape[-1], dtype=qkv.dtype, device=qkv.device)
    for start, n in zip(starts.tolist(), lengths.tolist()):
        part = [t[start:start + n].transpose(0, 1) for t in (q, k, v)]  # (heads, n, head_dim)
        out[start:start + n] = F.scaled_dot_product_attention(*part, scale=scale).transpose(0, 1)
    return out.view(tokens, -1)


def window_attention(qkv: torch.Tensor, heads: int, table: torch.Tensor | None, starts: torch.Tensor,
                     lengths: torch.Tensor, max_run: int, scale: float | None = None) -> torch.Tensor:
    """The module docstring's entry: the kernel on CUDA, else the reference.
    ``max_run``: the longest run's token count (a Python int: the kernel's key tile)."""
    if use_triton(qkv):
        return window_attention_triton(qkv, heads, table, starts, lengths, max_run, scale)
    return window_attention_ref(qkv, heads, table, starts, lengths, scale)
