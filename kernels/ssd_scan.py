"""The selective state-space scan of Mamba-2 layers: SSD chunked prefill and the one-token update.

Per head h (H of them, ``P`` = head_dim channels each) and token t, with B_t, C_t (N,) taken from
group g = h // (H / G) and dt_t = clamp(softplus(dt_raw_t + dt_bias_h), dt_min, dt_max):

    state_t = exp(dt_t * A_h) * state_{t-1} + dt_t * x_t (outer) B_t        state: (P, N)
    y_t     = state_t @ C_t + D_h * x_t

SSD (state-space duality) computes a prompt chunk of Q tokens at once: within the chunk the
output is a masked, decayed "attention" y = (C B^T * L * dt) x with L[t, u] = exp(cs_t - cs_u)
(cs the cumulative sum of dt * A over the chunk, u <= t), plus the carried state's
contribution C_t state * exp(cs_t); the state then moves to the chunk's end in one product.
So a prompt is a loop over chunks of matrix products instead of a loop over tokens.

Shapes: x (num_tokens, H, P) (any row stride), dt (num_tokens, H), A, D, dt_bias (H,) float32,
B, C (num_tokens, G, N), ssm_states (num_slots, H, P, N); tokens of each sequence back to back.

- ``ssd_prefill``: a sequence with ``has_state`` False starts from zeros, else from its slot's
  state (a later chunk of a chunked prompt); its final state replaces the slot's. The result does
  not depend on how the prompt was cut into chunks (up to float rounding).
- ``ssm_decode``: one token per row, rows ``slots`` (B,) int32 on the device (< 0: skipped),
  static shapes (CUDA-graph friendly). dt is not clamped here: transformers' and mamba-ssm's
  one-token update do not clamp either, so greedy ids follow theirs.

Triton on CUDA tensors, else the references (the CPU path and the tests' oracle); all math in
float32, states stored in their pool's dtype.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import dense, dense_rows, jit, tl, triton, use_triton
from kernels.ssm_chunks import SequenceChunks

SSD_CHUNK = 64  # tokens per chunk of the Triton prefill (the result does not depend on it)


def _dt(dt_raw: torch.Tensor, dt_bias: torch.Tensor, dt_min: float, dt_max: float) -> torch.Tensor:
    return F.softplus(dt_raw.float() + dt_bias.float()).clamp(dt_min, dt_max)


def _heads(t: torch.Tensor, num_heads: int) -> torch.Tensor:
    """(..., G, N) per group -> (..., H, N) per head (head h reads group h // (H / G))."""
    return t.float().repeat_interleave(num_heads // t.shape[-2], dim=-2)


# ---- references ------------------------------------------------------------------------------

def ssd_sequence_ref(x, dt, A, B, C, init: torch.Tensor | None, chunk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One sequence in float32: x (L, H, P), dt (L, H) (already softplus'd), A (H,), B, C (L, H, N),
    init (H, P, N) or None -> y without the D term (L, H, P), final state (H, P, N)."""
    L, H, P = x.shape
    state = x.new_zeros(H, P, B.shape[-1]) if init is None else init.float()
    ys = []
    for s in range(0, L, chunk):
        xs, dts, Bs, Cs = x[s:s + chunk], dt[s:s + chunk], B[s:s + chunk], C[s:s + chunk]
        cs = (dts * A).cumsum(0)  # (Q, H)
        q = xs.shape[0]
        causal = torch.ones(q, q, dtype=torch.bool, device=x.device).tril()
        seg = (cs[:, None, :] - cs[None, :, :]).masked_fill(~causal[..., None], float("-inf"))  # (t, u, H)
        scores = torch.einsum("thn,uhn->tuh", Cs, Bs) * seg.exp() * dts[None, :, :]
        y = torch.einsum("tuh,uhp->thp", scores, xs)
        y = y + torch.einsum("thn,hpn->thp", Cs, state) * cs.exp()[..., None]
        decay = (cs[-1:] - cs).exp() * dts  # (Q, H): how much of token u's input reaches the chunk end
        state = state * cs[-1].exp()[:, None, None] + torch.einsum("uh,uhp,uhn->hpn", decay, xs, Bs)
        ys.append(y)
    return torch.cat(ys), state


def ssd_prefill_ref(x, dt, A, B, C, D, dt_bias, ssm_states, chunks: SequenceChunks,
                    dt_limit: tuple[float, float] = (0.0, float("inf")), chunk: int = SSD_CHUNK) -> torch.Tensor:
    H = x.shape[1]
    cu_seqlens, has_state = chunks.cu_seqlens, chunks.has_state
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    for i, slot in enumerate(chunks.slots):
        s, e = cu_seqlens[i], cu_seqlens[i + 1]
        xs = x[s:e].float()
        y, final = ssd_sequence_ref(xs, _dt(dt[s:e], dt_bias, *dt_limit), A.float(), _heads(B[s:e], H),
                                    _heads(C[s:e], H), ssm_states[slot] if has_state[i] else None, chunk)
        out[s:e] = (y + D.float()[:, None] * xs).to(x.dtype)
        ssm_states[slot] = final.to(ssm_states.dtype)
    return out


def ssm_decode_ref(x, dt, A, B, C, D, dt_bias, ssm_states, slots: torch.Tensor) -> torch.Tensor:
    H = x.shape[1]
    keep = slots >= 0
    rows, idx = keep.nonzero().flatten(), slots[keep].long()
    xs = x[rows].float()
    d = _dt(dt[rows], dt_bias, 0.0, float("inf"))  # (B', H)
    state = ssm_states[idx].float() * (d * A.float()).exp()[..., None, None]
    state = state + (d[..., None] * xs)[..., None] * _heads(B[rows], H)[:, :, None, :]
    ssm_states[idx] = state.to(ssm_states.dtype)
    y = (state * _heads(C[rows], H)[:, :, None, :]).sum(-1) + D.float()[:, None] * xs
    out = torch.zeros_like(x)
    out[rows] = y.to(x.dtype)
    return out


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _softplus_dt(raw, bias, dt_min, dt_max):
    v = raw + bias
    v = tl.where(v > 20.0, v, tl.log(1.0 + tl.exp(tl.minimum(v, 20.0))))  # torch's softplus threshold
    return tl.minimum(tl.maximum(v, dt_min), dt_max)


@jit
def _ssd_prefill_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, out_ptr,
                        cu_ptr, slots_ptr, has_state_ptr, dt_min, dt_max,
                        stride_xt, stride_dtt, stride_bt, stride_ct, stride_ot,
                        stride_s0, stride_sh, stride_sp,
                        HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                        BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, Q: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Program (sequence, head, channel tile): its (BLOCK_P, N) state stays in registers across the
    sequence's chunks of Q tokens (module docstring); tokens past the end get dt = 0 (no decay, no
    input), so the chunk's total decay is the sum over the whole tile."""
    seq, h, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    g = h // HEADS_PER_GROUP
    p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
    n = tl.arange(0, BLOCK_N)
    p_ok, n_ok = p < P, n < N
    state_ptrs = state_ptr + slot * stride_s0 + h * stride_sh + p[:, None] * stride_sp + n[None, :]
    state_mask = p_ok[:, None] & n_ok[None, :]
    state = tl.zeros((BLOCK_P, BLOCK_N), dtype=tl.float32)
    if tl.load(has_state_ptr + seq) != 0:
        state = tl.load(state_ptrs, mask=state_mask, other=0.0).to(tl.float32)
    A = tl.load(A_ptr + h).to(tl.float32)
    D = tl.load(D_ptr + h).to(tl.float32)
    bias = tl.load(bias_ptr + h).to(tl.float32)
    r = tl.arange(0, Q)
    causal = r[:, None] >= r[None, :]
    for c0 in range(start, end, Q):
        t = c0 + r
        t_ok = t < end
        dt = _softplus_dt(tl.load(dt_ptr + t * stride_dtt + h, mask=t_ok, other=0.0).to(tl.float32), bias,
                          dt_min, dt_max)
        dt = tl.where(t_ok, dt, 0.0)
        cs = tl.cumsum(dt * A, 0)  # (Q,)
        total = tl.sum(dt * A, 0)
        x = tl.load(x_ptr + t[:, None] * stride_xt + h * P + p[None, :], mask=t_ok[:, None] & p_ok[None, :],
                    other=0.0).to(tl.float32)  # (Q, BLOCK_P)
        Bq = tl.load(B_ptr + t[:, None] * stride_bt + g * N + n[None, :], mask=t_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)  # (Q, BLOCK_N)
        Cq = tl.load(C_ptr + t[:, None] * stride_ct + g * N + n[None, :], mask=t_ok[:, None] & n_ok[None, :],
                     other=0.0).to(tl.float32)
        decay = tl.exp(tl.where(causal, cs[:, None] - cs[None, :], 0.0))
        scores = tl.where(causal, tl.dot(Cq, tl.trans(Bq), input_precision=DOT_PRECISION) * decay * dt[None, :],
                          0.0)  # (Q, Q)
        y = (tl.dot(scores, x, input_precision=DOT_PRECISION)
             + tl.dot(Cq, tl.trans(state), input_precision=DOT_PRECISION) * tl.exp(cs)[:, None] + D * x)
        tl.store(out_ptr + t[:, None] * stride_ot + h * P + p[None, :], y.to(out_ptr.dtype.element_ty),
                 mask=t_ok[:, None] & p_ok[None, :])
        weight = tl.exp(total - cs) * dt  # (Q,): token u's input as it reaches the chunk's end
        state = state * tl.exp(total) + tl.dot(tl.trans(x * weight[:, None]), Bq, input_precision=DOT_PRECISION)
    tl.store(state_ptrs, state.to(state_ptr.dtype.element_ty), mask=state_mask)


@jit
def _ssm_decode_kernel(x_ptr, dt_ptr, A_ptr, B_ptr, C_ptr, D_ptr, bias_ptr, state_ptr, out_ptr, slots_ptr,
                       stride_xb, stride_dtb, stride_bb, stride_cb, stride_ob, stride_s0, stride_sh, stride_sp,
                       HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr,
                       BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr):
    """Program (row, head, channel tile): one recurrence step of a (BLOCK_P, N) slice of the state."""
    row, h, pid_p = tl.program_id(0), tl.program_id(1), tl.program_id(2)
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        g = h // HEADS_PER_GROUP
        p = pid_p * BLOCK_P + tl.arange(0, BLOCK_P)
        n = tl.arange(0, BLOCK_N)
        p_ok, n_ok = p < P, n < N
        dt = _softplus_dt(tl.load(dt_ptr + row * stride_dtb + h).to(tl.float32), tl.load(bias_ptr + h).to(tl.float32),
                          0.0, float("inf"))
        dA = tl.exp(dt * tl.load(A_ptr + h).to(tl.float32))
        x = tl.load(x_ptr + row * stride_xb + h * P + p, mask=p_ok, other=0.0).to(tl.float32)
        Bv = tl.load(B_ptr + row * stride_bb + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
        Cv = tl.load(C_ptr + row * stride_cb + g * N + n, mask=n_ok, other=0.0).to(tl.float32)
        ptrs = state_ptr + slot * stride_s0 + h * stride_sh + p[:, None] * stride_sp + n[None, :]
        mask = p_ok[:, None] & n_ok[None, :]
        state = tl.load(ptrs, mask=mask, other=0.0).to(tl.float32) * dA + (dt * x)[:, None] * Bv[None, :]
        tl.store(ptrs, state.to(state_ptr.dtype.element_ty), mask=mask)
        y = tl.sum(state * Cv[None, :], 1) + tl.load(D_ptr + h).to(tl.float32) * x
        tl.store(out_ptr + row * stride_ob + h * P + p, y.to(out_ptr.dtype.element_ty), mask=p_ok)


def _tiles(P: int, N: int) -> tuple[int, int]:
    """Channel tile and padded state width; 16 at least (the smallest tl.dot operand)."""
    return max(16, min(64, triton.next_power_of_2(P))), max(16, triton.next_power_of_2(N))


def _as_read(x, dt, B, C, A, D, dt_bias, slots=None):
    """The kernels' inputs as they address them: rows of x (H, P), dt (H,), B and C (G, N) at ptr + row *
    stride + flat index; A, D, dt_bias (H,) and slots at ptr + i. Views that are not so become dense."""
    return (*dense_rows(x, dt, B, C), *dense(A, D, dt_bias, slots))


def _check_states(ssm_states) -> None:
    if ssm_states.stride(-1) != 1:  # written at slot * stride + head * stride + p * stride + n
        raise ValueError(f"ssm_states needs a contiguous state dimension, got strides {ssm_states.stride()}")


def ssd_prefill_triton(x, dt, A, B, C, D, dt_bias, ssm_states, chunks: SequenceChunks,
                       dt_limit=(0.0, float("inf"))) -> torch.Tensor:
    """The Triton path of ssd_prefill (also runs under TRITON_INTERPRET=1 on CPU)."""
    _, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    cu, slot_t, has_t = chunks.sequence_tensors  # (contiguous by construction: ssm_chunks)
    x, dt, B, C, A, D, dt_bias, _ = _as_read(x, dt, B, C, A, D, dt_bias)
    _check_states(ssm_states)
    BLOCK_P, BLOCK_N = _tiles(P, N)
    grid = (chunks.num_seqs, H, triton.cdiv(P, BLOCK_P))
    _ssd_prefill_kernel[grid](x, dt, A, B, C, D, dt_bias, ssm_states, out, cu, slot_t, has_t,
                              float(dt_limit[0]), float(dt_limit[1]),
                              x.stride(0), dt.stride(0), B.stride(0), C.stride(0), out.stride(0),
                              ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
                              HEADS_PER_GROUP=H // G, P=P, N=N, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N, Q=SSD_CHUNK,
                              # float32 models: IEEE dots (as the other kernels take for float32
                              # operands); else tf32 over the operands widened from bf16/fp16
                              DOT_PRECISION="ieee" if x.dtype == torch.float32 else "tf32")
    return out


def ssm_decode_triton(x, dt, A, B, C, D, dt_bias, ssm_states, slots) -> torch.Tensor:
    rows, H, P = x.shape
    G, N = B.shape[1], B.shape[2]
    out = torch.zeros(x.shape, dtype=x.dtype, device=x.device)  # rows with slot < 0 stay zero
    x, dt, B, C, A, D, dt_bias, slots = _as_read(x, dt, B, C, A, D, dt_bias, slots)
    _check_states(ssm_states)
    BLOCK_P, BLOCK_N = _tiles(P, N)
    _ssm_decode_kernel[(rows, H, triton.cdiv(P, BLOCK_P))](
        x, dt, A, B, C, D, dt_bias, ssm_states, out, slots,
        x.stride(0), dt.stride(0), B.stride(0), C.stride(0), out.stride(0),
        ssm_states.stride(0), ssm_states.stride(1), ssm_states.stride(2),
        HEADS_PER_GROUP=H // G, P=P, N=N, BLOCK_P=BLOCK_P, BLOCK_N=BLOCK_N)
    return out


# ---- public entries ----------------------------------------------------------------------------

def ssd_prefill(x, dt, A, B, C, D, dt_bias, ssm_states, chunks: SequenceChunks,
                dt_limit: tuple[float, float] = (0.0, float("inf"))) -> torch.Tensor:
    """y (num_tokens, H, P) of every sequence's chunk, each continuing from / updating its slot's
    state (module docstring); ``chunks``: the packed sequences (kernels/ssm_chunks.py). x, B, C:
    the rows' head/group views; inner dims contiguous."""
    if use_triton(x):
        return ssd_prefill_triton(x, dt, A, B, C, D, dt_bias, ssm_states, chunks, dt_limit)
    return ssd_prefill_ref(x, dt, A, B, C, D, dt_bias, ssm_states, chunks, dt_limit)


def ssm_decode(x, dt, A, B, C, D, dt_bias, ssm_states, slots: torch.Tensor) -> torch.Tensor:
    """y (rows, H, P) of one token per row, each advancing ``ssm_states[slots[row]]`` by one step."""
    if use_triton(x):
        return ssm_decode_triton(x, dt, A, B, C, D, dt_bias, ssm_states, slots)
    return ssm_decode_ref(x, dt, A, B, C, D, dt_bias, ssm_states, slots)
