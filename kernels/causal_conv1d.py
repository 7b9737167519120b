"""Causal depthwise conv1d of Mamba-2 layers over a packed batch, with a per-request conv state.

A Mamba-2 layer convolves its x|B|C channels (``C`` of them) along time with a short filter
(``K`` taps, 4 in every released model), each channel on its own, then applies SiLU. The conv
state of a request is the last ``K - 1`` inputs it saw: the window the next token's output needs.
States live in a pool indexed by slot (engine/executor/state_cache.py).

Shapes: x, out (num_tokens, C), tokens of each sequence back to back (``cu_seqlens``);
weight (C, K); bias (C,) or None; conv_states (num_slots, C, K - 1), oldest input first.

- ``causal_conv1d_prefill``: chunks of any length. A sequence with ``has_state`` False starts
  from zeros (its first chunk); otherwise from its slot's state (a later chunk of a chunked
  prompt). Every sequence's state is then replaced by its last K - 1 inputs (zeros where the
  sequence is shorter), so chunked prefill gives the same outputs and states as one chunk.
- ``causal_conv1d_decode``: one token per row; row b reads and shifts ``conv_states[slots[b]]``.
  Static shapes and slot indices on the device: a decode step of it can be captured in a CUDA
  graph; rows with slot < 0 (padding of a graph's bucket) are skipped.

Triton on CUDA tensors, else the plain-torch references (the CPU path and the tests' oracle).
Products accumulate in float32; outputs and states are in x's dtype (the states' dtype).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F

from kernels._triton import dense, jit, tl, triton, use_triton
from kernels.ssm_chunks import SequenceChunks


# ---- references ------------------------------------------------------------------------------

def causal_conv1d_prefill_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                              conv_states: torch.Tensor, chunks: SequenceChunks) -> torch.Tensor:
    K = weight.shape[1]
    cu_seqlens, has_state = chunks.cu_seqlens, chunks.has_state
    out = torch.empty_like(x)
    for i, slot in enumerate(chunks.slots):
        start, end = cu_seqlens[i], cu_seqlens[i + 1]
        init = conv_states[slot] if has_state[i] else x.new_zeros(x.shape[1], K - 1)
        full = torch.cat([init.to(x.dtype), x[start:end].t()], dim=1)  # (C, K - 1 + L)
        y = F.conv1d(full.unsqueeze(0).float(), weight.float().unsqueeze(1), None if bias is None else bias.float(),
                     groups=x.shape[1])[0]  # (C, L): no padding, the state is the left context
        out[start:end] = F.silu(y).t().to(x.dtype)
        conv_states[slot] = full[:, full.shape[1] - (K - 1):].to(conv_states.dtype)
    return out


def causal_conv1d_decode_ref(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                             conv_states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    keep = slots >= 0
    rows, idx = keep.nonzero().flatten(), slots[keep].long()
    window = torch.cat([conv_states[idx].float(), x[rows].float().unsqueeze(-1)], dim=-1)  # (B', C, K)
    y = (window * weight.float()).sum(-1)
    if bias is not None:
        y = y + bias.float()
    conv_states[idx] = window[..., 1:].to(conv_states.dtype)
    out = torch.zeros_like(x)
    out[rows] = F.silu(y).to(x.dtype)
    return out


# ---- Triton ----------------------------------------------------------------------------------

@jit
def _conv_prefill_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, tok_start_ptr, tok_slot_ptr,
                         num_tokens, C, stride_x, stride_s, stride_sc,
                         K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (token tile, channel tile). Token t of a sequence starting at row start[t] reads
    input t - (K - 1) + k for tap k: a packed row when it is >= start[t], else the state entry
    (K - 1) + (src - start) of slot[t] (zero when slot[t] < 0: the sequence starts fresh)."""
    t = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    t_ok, c_ok = t < num_tokens, c < C
    start = tl.load(tok_start_ptr + t, mask=t_ok, other=0)
    slot = tl.load(tok_slot_ptr + t, mask=t_ok, other=-1)
    acc = tl.zeros((BLOCK_T, BLOCK_C), dtype=tl.float32)
    if HAS_BIAS:
        acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)[None, :]
    for k in tl.static_range(K):
        src = t - (K - 1) + k
        in_seq = src >= start
        xv = tl.load(x_ptr + src[:, None] * stride_x + c[None, :],
                     mask=(t_ok & in_seq)[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        pos = (K - 1) + (src - start)  # index into the state when src precedes the chunk
        from_state = t_ok & (~in_seq) & (slot >= 0)
        sv = tl.load(state_ptr + slot[:, None].to(tl.int64) * stride_s + c[None, :] * stride_sc + pos[:, None],
                     mask=from_state[:, None] & c_ok[None, :], other=0.0).to(tl.float32)
        w = tl.load(w_ptr + c * K + k, mask=c_ok, other=0.0).to(tl.float32)
        acc += (xv + sv) * w[None, :]
    y = acc / (1.0 + tl.exp(-acc))
    tl.store(out_ptr + t[:, None] * stride_x + c[None, :], y.to(out_ptr.dtype.element_ty),
             mask=t_ok[:, None] & c_ok[None, :])


@jit
def _conv_decode_kernel(x_ptr, w_ptr, b_ptr, state_ptr, out_ptr, slots_ptr, C, stride_x, stride_o, stride_s,
                        stride_sc, K: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (row, channel tile): the K-tap window is the slot's K - 1 inputs and this token;
    the state shifts by one (its oldest input drops out). x's rows may lie farther apart than the
    output's (stride_x vs stride_o): the model passes a column view of its packed projection."""
    row = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    slot = tl.load(slots_ptr + row).to(tl.int64)
    if slot >= 0:
        xv = tl.load(x_ptr + row * stride_x + c, mask=c_ok, other=0.0).to(tl.float32)
        acc = tl.load(w_ptr + c * K + (K - 1), mask=c_ok, other=0.0).to(tl.float32) * xv
        if HAS_BIAS:
            acc += tl.load(b_ptr + c, mask=c_ok, other=0.0).to(tl.float32)
        base = state_ptr + slot * stride_s + c * stride_sc
        prev = tl.load(base, mask=c_ok, other=0.0)
        for k in tl.static_range(K - 1):
            acc += prev.to(tl.float32) * tl.load(w_ptr + c * K + k, mask=c_ok, other=0.0).to(tl.float32)
            if k + 1 < K - 1:
                nxt = tl.load(base + k + 1, mask=c_ok, other=0.0)
                tl.store(base + k, nxt, mask=c_ok)
                prev = nxt
        tl.store(base + (K - 2), xv.to(state_ptr.dtype.element_ty), mask=c_ok)
        y = acc / (1.0 + tl.exp(-acc))
        tl.store(out_ptr + row * stride_o + c, y.to(out_ptr.dtype.element_ty), mask=c_ok)


def _block_c(C: int) -> int:
    return min(256, triton.next_power_of_2(C))


def causal_conv1d_prefill_triton(x, weight, bias, conv_states, chunks: SequenceChunks) -> torch.Tensor:
    """The Triton path of causal_conv1d_prefill (also runs under TRITON_INTERPRET=1 on CPU)."""
    num_tokens, C = x.shape
    K = weight.shape[1]
    tok_start, tok_slot = chunks.token_tensors  # contiguous by construction (ssm_chunks)
    weight, bias = dense(weight, bias)  # read at w_ptr + c * K + k
    assert x.stride(1) == 1 and conv_states.stride(2) == 1
    out = torch.empty_like(x)
    BLOCK_T, BLOCK_C = 16, _block_c(C)
    grid = (triton.cdiv(num_tokens, BLOCK_T), triton.cdiv(C, BLOCK_C))
    _conv_prefill_kernel[grid](x, weight, bias if bias is not None else weight, conv_states, out, tok_start, tok_slot,
                               num_tokens, C, x.stride(0), conv_states.stride(0), conv_states.stride(1),
                               K=K, HAS_BIAS=bias is not None, BLOCK_T=BLOCK_T, BLOCK_C=BLOCK_C)
    _store_final_states(x, conv_states, chunks, K)
    return out


@jit
def _conv_final_state_kernel(x_ptr, state_ptr, cu_ptr, slots_ptr, has_state_ptr, C, stride_x, stride_s, stride_sc,
                             K: tl.constexpr, BLOCK_C: tl.constexpr):
    """Program (sequence, channel tile), after the conv kernel has read the old states: the slot
    keeps the sequence's last K - 1 inputs, taken from the packed rows or, for a chunk shorter than
    that, partly from the old state (zeros when the sequence started fresh). Entries are written in
    increasing j: a short chunk's new entry j comes from old entry j + length (> j), which this same
    program has not overwritten yet, and each lane reads and writes only its own channel."""
    seq = tl.program_id(0)
    c = tl.program_id(1) * BLOCK_C + tl.arange(0, BLOCK_C)
    c_ok = c < C
    start, end = tl.load(cu_ptr + seq), tl.load(cu_ptr + seq + 1)
    slot = tl.load(slots_ptr + seq).to(tl.int64)
    has_state = (tl.load(has_state_ptr + seq) + c * 0) != 0  # (vectors: masks are per channel)
    base = state_ptr + slot * stride_s + c * stride_sc
    for j in tl.static_range(K - 1):
        src = end - (K - 1) + j + c * 0
        in_chunk = src >= start
        from_x = tl.load(x_ptr + src * stride_x + c, mask=c_ok & in_chunk, other=0.0)
        from_state = tl.load(base + (K - 1) + (src - start), mask=c_ok & (~in_chunk) & has_state, other=0.0)
        value = tl.where(in_chunk, from_x.to(tl.float32), from_state.to(tl.float32))
        tl.store(base + j, value.to(state_ptr.dtype.element_ty), mask=c_ok)


def _store_final_states(x, conv_states, chunks: SequenceChunks, K) -> None:
    cu, slots, has_state = chunks.sequence_tensors
    C = x.shape[1]
    BLOCK_C = _block_c(C)  # (the sequence tensors are contiguous by construction: ssm_chunks)
    _conv_final_state_kernel[(chunks.num_seqs, triton.cdiv(C, BLOCK_C))](
        x, conv_states, cu, slots, has_state, C, x.stride(0), conv_states.stride(0), conv_states.stride(1),
        K=K, BLOCK_C=BLOCK_C)


def causal_conv1d_decode_triton(x, weight, bias, conv_states, slots) -> torch.Tensor:
    B, C = x.shape
    weight, bias, slots = dense(weight, bias, slots)  # read at w_ptr + c * K + k, slots_ptr + row
    assert x.stride(1) == 1 and conv_states.stride(2) == 1
    # rows with slot < 0 stay zero, as in the reference; contiguous whatever x's row stride is
    out = torch.zeros((B, C), dtype=x.dtype, device=x.device)
    BLOCK_C = _block_c(C)
    _conv_decode_kernel[(B, triton.cdiv(C, BLOCK_C))](
        x, weight, bias if bias is not None else weight, conv_states, out, slots, C, x.stride(0), out.stride(0),
        conv_states.stride(0), conv_states.stride(1), K=weight.shape[1], HAS_BIAS=bias is not None, BLOCK_C=BLOCK_C)
    return out


# ---- public entries ----------------------------------------------------------------------------

def causal_conv1d_prefill(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                          conv_states: torch.Tensor, chunks: SequenceChunks) -> torch.Tensor:
    """silu(conv(x)) per sequence, continuing from / updating each sequence's state (module
    docstring); ``chunks``: the packed sequences (kernels/ssm_chunks.py)."""
    if use_triton(x):
        return causal_conv1d_prefill_triton(x, weight, bias, conv_states, chunks)
    return causal_conv1d_prefill_ref(x, weight, bias, conv_states, chunks)


def causal_conv1d_decode(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None,
                         conv_states: torch.Tensor, slots: torch.Tensor) -> torch.Tensor:
    """One token per row (x: (B, C)); ``slots`` (B,) int32 on x's device, < 0 for rows to skip."""
    if use_triton(x):
        return causal_conv1d_decode_triton(x, weight, bias, conv_states, slots)
    return causal_conv1d_decode_ref(x, weight, bias, conv_states, slots)
