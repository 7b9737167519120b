"""The selective scan of Mamba-1 layers (Mamba, Jamba): prefill over a packed batch and the one-token update.

Per channel d (``D`` of them, the layer's inner width) and token t, with B_t, C_t (N,) shared by
every channel and dt_t = softplus(dt_raw_t + dt_bias_d) (no clamp: transformers' and mamba-ssm's
Mamba-1 paths clamp nothing):

    state_t = exp(dt_t * A_d) * state_{t-1} + dt_t * x_t * B_t       state: (D, N), A: (D, N)
    y_t     = (state_t . C_t + Dskip_d * x_t) * silu(z_t)

Unlike Mamba-2 (kernels/ssd_scan.py), A is a full (D, N) matrix, so the decay differs per state
entry and there is no chunked matrix form worth having: the prefill kernel walks a sequence's
tokens in order, one program per (sequence, channel tile) holding its (BLOCK_D, N) state in
registers. The sequential loop over time is the cost; parallelism is sequences x D / BLOCK_D
(Jamba-1.5-Mini: D = 8192, 128 tiles per sequence).

Shapes: x, z (num_tokens, D) (any row stride, channels contiguous), dt (num_tokens, D) before the
bias, A (D, N) float32, B, C (num_tokens, N), Dskip, dt_bias (D,), ssm_states (num_slots, D, N);
tokens of each sequence back to back (kernels/ssm_chunks.py SequenceChunks).

- ``selective_scan_prefill``: a sequence with ``has_state`` False starts from zeros, else from its
  slot's state (a later chunk of a chunked prompt); its final state replaces the slot's, so a
  prompt cut into chunks gives the outputs and state of one chunk.
- ``selective_scan_decode``: one token per row, rows ``slots`` (B,) int32 on the device (< 0:
  skipped, output zero), static shapes (CUDA-graph friendly).

Triton on CUDA tensors, else the references (the CPU path and the tests' oracle); all math in
float32, states stored in their pool's dtype, outputs in x's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, tl, triton, use_triton
from kernels.ssd_scan import _softplus_dt
from kernels.ssm_chunks import SequenceChunks


# ---- references ------------------------------------------------------------------------------

def _step(state, x, dt, A, B, C, Dskip, z):
    """One token of rows: state (R, D, N) float32, x/dt/z (R, D), B/C (R, N) -> (new state, y (R, D))."""
    state = state * torch.exp(dt[..., None] * A) + (dt * x)[..., None] * B[:, None, :]
    y = (state * C[:, None, :]).sum(-1) + Dskip * x
    return state, y * F.silu(z)


def selective_scan_prefill_ref(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states,
                               chunks: SequenceChunks) -> torch.Tensor:
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    A, Dskip = A.float(), Dskip.float()
    for i, slot in enumerate(chunks.slots):
        s, e = chunks.cu_seqlens[i], chunks.cu_seqlens[i + 1]
        state = (ssm_states[slot].float() if chunks.has_state[i]
                 else torch.zeros(ssm_states.shape[1:], dtype=torch.float32, device=x.device))[None]
        d = F.softplus(dt[s:e].float() + dt_bias.float())
        xs, Bs, Cs, zs = x[s:e].float(), B[s:e].float(), C[s:e].float(), z[s:e].float()
        for t in range(e - s):
            state, y = _step(state, xs[t:t + 1], d[t:t + 1], A, Bs[t:t + 1], Cs[t:t + 1], Dskip, zs[t:t + 1])
            out[s + t] = y[0].to(x.dtype)
        ssm_states[slot] = state[0].to(ssm_states.dtype)
    return out


def selective_scan_decode_ref(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, slots: torch.Tensor) -> torch.Tensor:
    keep = slots >= 0
    rows, idx = keep.nonzero().flatten(), slots[keep].long()
    d = F.softplus(dt[rows].float() + dt_bias.float())
    state, y = _step(ssm_states[idx].float(), x[rows].float(), d, A.float(), B[rows].float(), C[rows].float(),
                     Dskip.float(), z[rows].float())
    ssm_states[idx] = state.to(ssm_states.dtype)
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)
    out[rows] = y.to(x.dtype)
    return out


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _scan_token(state, x_row, dt_row, z_row, b_row, c_row, d, n, d_ok, n_ok, A, Dskip, bias):
    """One recurrence step of a (BLOCK_D, BLOCK_N) state tile for the token whose rows start at
    the given pointers -> (new state, gated y (BLOCK_D,) float32)."""
    x = tl.load(x_row + d, mask=d_ok, other=0.0).to(tl.float32)
    dt = _softplus_dt(tl.load(dt_row + d, mask=d_ok, other=0.0).to(tl.float32), bias, 0.0, float("inf"))
    z = tl.load(z_row + d, mask=d_ok, other=0.0).to(tl.float32)
    Bv = tl.load(b_row + n, mask=n_ok, other=0.0).to(tl.float32)
    Cv = tl.load(c_row + n, mask=n_ok, other=0.0).to(tl.float32)
    state = state * tl.exp(dt[:, None] * A) + (dt * x)[:, None] * Bv[None, :]
    y = tl.sum(state * Cv[None, :], 1) + Dskip * x
    return state, y * (z / (1.0 + tl.exp(-z)))


@jit
def _scan_prefill_kernel(x_ptr, dt_ptr, z_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, out_ptr,
                         cu_ptr, slots_ptr, has_state_ptr, num_channels,
                         stride_xt, stride_dtt, stride_zt, stride_bt, stride_ct, stride_ot, stride_s0, stride_sd,
                         N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (sequence, channel tile): its (BLOCK_D, N) state stays in registers over the
    sequence's tokens, taken in order; stored to the slot after the last one."""
    seq, pid_d = tl.program_id(0), tl.program_id(1)
    # (int64 token indices: rows x stride may pass 2**31 in a long packed step)
    start, end = tl.load(cu_ptr + seq).to(tl.int64), tl.load(cu_ptr + seq + 1).to(tl.int64)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
    n = tl.arange(0, BLOCK_N)
    d_ok, n_ok = d < num_channels, n < N
    mask = d_ok[:, None] & n_ok[None, :]
    A = tl.load(A_ptr + d[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
    Dskip = tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    bias = tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32)
    state_ptrs = state_ptr + slot * stride_s0 + d[:, None] * stride_sd + n[None, :]
    state = tl.zeros((BLOCK_D, BLOCK_N), dtype=tl.float32)
    if tl.load(has_state_ptr + seq) != 0:
        state = tl.load(state_ptrs, mask=mask, other=0.0).to(tl.float32)
    for t in range(start, end):
        state, y = _scan_token(state, x_ptr + t * stride_xt, dt_ptr + t * stride_dtt, z_ptr + t * stride_zt,
                               B_ptr + t * stride_bt, C_ptr + t * stride_ct, d, n, d_ok, n_ok, A, Dskip, bias)
        tl.store(out_ptr + t * stride_ot + d, y.to(out_ptr.dtype.element_ty), mask=d_ok)
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)


@jit
def _scan_decode_kernel(x_ptr, dt_ptr, z_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr,
                        num_channels, stride_xb, stride_dtb, stride_zb, stride_bb, stride_cb, stride_ob,
                        stride_s0, stride_sd, N: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row, channel tile): one step of a (BLOCK_D, N) slice of the row's slot state."""
    row, pid_d = tl.program_id(0), tl.program_id(1)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        d = pid_d * BLOCK_D + tl.arange(0, BLOCK_D)
        n = tl.arange(0, BLOCK_N)
        d_ok, n_ok = d < num_channels, n < N
        mask = d_ok[:, None] & n_ok[None, :]
        A = tl.load(A_ptr + d[:, None] * N + n[None, :], mask=mask, other=0.0).to(tl.float32)
        ptrs = state_ptr + slot * stride_s0 + d[:, None] * stride_sd + n[None, :]
        state = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32)
        state, y = _scan_token(state, x_ptr + row * stride_xb, dt_ptr + row * stride_dtb, z_ptr + row * stride_zb,
                               B_ptr + row * stride_bb, C_ptr + row * stride_cb, d, n, d_ok, n_ok, A,
                               tl.load(D_ptr + d, mask=d_ok, other=0.0).to(tl.float32),
                               tl.load(bias_ptr + d, mask=d_ok, other=0.0).to(tl.float32))
        tl.store(ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
        tl.store(out_ptr + row * stride_ob + d, y.to(out_ptr.dtype.element_ty), mask=d_ok)


def _tiles(D: int, N: int) -> tuple[int, int]:
    """Channel tile and padded state width: a (BLOCK_D, BLOCK_N) float32 state tile of at most
    64 x 16 = 1024 values per program (N = 16 in every released Mamba-1 and Jamba)."""
    block_n = triton.next_power_of_2(N)
    return max(1, min(triton.next_power_of_2(D), 1024 // block_n, 64)), block_n


def _check(x, A, B, ssm_states, *rows) -> None:
    """``rows``: dt, z, C (their rows are read at ptr + row * stride + channel, as x's and B's); the
    states' last dimension is addressed as packed too."""
    if any(t.stride(-1) != 1 for t in (x, B, ssm_states, *rows)) or not A.is_contiguous():
        raise ValueError("selective scan: x, z, dt, B, C, ssm_states need unit last strides; A (D, N) contiguous")


def _per_channel(Dskip, dt_bias, slots=None):
    """Dskip, dt_bias (D,) and the decode rows' slots, read at ptr + channel / + row: views made dense."""
    return dense(Dskip, dt_bias, slots)


def selective_scan_prefill_triton(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, chunks: SequenceChunks):
    """The Triton path of selective_scan_prefill (also runs under TRITON_INTERPRET=1 on CPU)."""
    _check(x, A, B, ssm_states, dt, z, C)
    T, D = x.shape
    N = A.shape[1]
    out = torch.empty((T, D), dtype=x.dtype, device=x.device)
    cu, slot_t, has_t = chunks.sequence_tensors  # (contiguous by construction: ssm_chunks)
    Dskip, dt_bias, _ = _per_channel(Dskip, dt_bias)
    BLOCK_D, BLOCK_N = _tiles(D, N)
    _scan_prefill_kernel[(chunks.num_seqs, triton.cdiv(D, BLOCK_D))](
        x, dt, z, A, B, C, Dskip, dt_bias, ssm_states, out, cu, slot_t, has_t, D,
        x.stride(0), dt.stride(0), z.stride(0), B.stride(0), C.stride(0), out.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), N=N, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N)
    return out


def selective_scan_decode_triton(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, slots) -> torch.Tensor:
    _check(x, A, B, ssm_states, dt, z, C)
    rows, D = x.shape
    N = A.shape[1]
    out = torch.zeros((rows, D), dtype=x.dtype, device=x.device)  # rows with slot < 0 stay zero
    Dskip, dt_bias, slots = _per_channel(Dskip, dt_bias, slots)
    BLOCK_D, BLOCK_N = _tiles(D, N)
    _scan_decode_kernel[(rows, triton.cdiv(D, BLOCK_D))](
        x, dt, z, A, B, C, Dskip, dt_bias, ssm_states, out, slots, D,
        x.stride(0), dt.stride(0), z.stride(0), B.stride(0), C.stride(0), out.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), N=N, BLOCK_D=BLOCK_D, BLOCK_N=BLOCK_N)
    return out


# ---- public entries ----------------------------------------------------------------------------

def selective_scan_prefill(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, chunks: SequenceChunks) -> torch.Tensor:
    """Gated y (num_tokens, D) of every sequence's chunk, each continuing from / updating its
    slot's state (module docstring); ``chunks``: the packed sequences."""
    if use_triton(x):
        return selective_scan_prefill_triton(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, chunks)
    return selective_scan_prefill_ref(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, chunks)


def selective_scan_decode(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, slots: torch.Tensor) -> torch.Tensor:
    """Gated y (rows, D) of one token per row, each advancing ``ssm_states[slots[row]]`` one step."""
    if use_triton(x):
        return selective_scan_decode_triton(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, slots)
    return selective_scan_decode_ref(x, dt, A, B, C, Dskip, dt_bias, z, ssm_states, slots)
