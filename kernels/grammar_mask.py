"""Guided decoding: a grammar's token bitmask applied to the logits before sampling (issue 28).

``apply_token_bitmask_(logits, bitmask, rows=None)`` sets, in place, every logit of a token the
grammar does not allow to -inf, and returns ``logits``.

Bitmask format: xgrammar's (``xgr.allocate_token_bitmask``, ``fill_next_token_bitmask``), an
int32 tensor (R, W) with W = ceil(vocab / 32) usually: bit j of word w, ``(word >> j) & 1``, set
means token ``32 * w + j`` is allowed, cleared means its logit becomes -inf.

- Row map: row b of ``logits`` takes mask row ``rows[b]``, or b when ``rows`` is None; a row
  index of -1 (any negative) leaves row b as it is (an unconstrained request). The executor can
  so pass one mask tensor holding only the constrained requests' rows, in any order; two logits
  rows may share one mask row. ``rows`` is (B,) int64 (int32 works) on the logits' device.
- Widths: tokens at or beyond ``32 * W`` (a mask narrower than the logits, e.g. a vocabulary
  padded past the tokenizer's) are disallowed in constrained rows; bits of a mask wider than
  the logits are ignored. (xgrammar instead leaves tokens beyond ``32 * W`` unmasked, with a
  warning: a grammar can then be broken by sampling a padding token.)
- Dtypes: logits float32, bfloat16 or float16, any row stride; bitmask int32 on the same device.

On CUDA one Triton program per (row, block of BLOCK tokens) loads the block's BLOCK / 32 mask
words once and expands their bits in registers, 16 bytes of logits (4 float32, 8 bf16) at a
time: a group with every token banned gets one vector store of -inf and is not read, a group
with none banned is not touched, and only a group that mixes both is read and written back
(see the kernel's docstring). Nothing reads ``rows`` or the mask on the host, so the call is
CUDA-graph safe; it launches with PDL where the other decode kernels do (kernels/_triton.py).
The row indices are not bounds-checked on the GPU (as with any indexing kernel): a row index
>= R reads out of bounds.

The CPU path and the test oracle is ``apply_token_bitmask_reference``: plain torch (unpack the
words with shifts, ``masked_fill_``), vectorised, with no host read of ``rows`` either.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, num_sms, pdl_options, pdl_prologue, tl, triton, use_triton

_SHIFTS: dict[torch.device, torch.Tensor] = {}


def _bit_shifts(device: torch.device) -> torch.Tensor:
    if device not in _SHIFTS:
        _SHIFTS[device] = torch.arange(32, dtype=torch.int32, device=device)
    return _SHIFTS[device]


def _check(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> None:
    """Shape, dtype and device checks only (tensor metadata: no host sync)."""
    if logits.dim() != 2:
        raise ValueError(f"logits must be (batch, vocab), got shape {tuple(logits.shape)}")
    if logits.dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"logits must be float32, bfloat16 or float16, got {logits.dtype}")
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask must be a 2-D int32 tensor, got {bitmask.dtype} {tuple(bitmask.shape)}")
    if bitmask.device != logits.device:
        raise ValueError(f"bitmask is on {bitmask.device}, logits on {logits.device}")
    if rows is None:
        if bitmask.shape[0] < logits.shape[0]:
            raise ValueError(f"rows=None needs a mask row per logits row: {bitmask.shape[0]} < {logits.shape[0]}")
        return
    if rows.shape != (logits.shape[0],) or rows.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"rows must be ({logits.shape[0]},) int64, got {rows.dtype} {tuple(rows.shape)}")
    if rows.device != logits.device:
        raise ValueError(f"rows is on {rows.device}, logits on {logits.device}")


def apply_token_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor,
                                  rows: torch.Tensor | None = None) -> torch.Tensor:
    """Plain torch, any device, no host sync: the same contract as ``apply_token_bitmask_`` (in
    place on ``logits``, which it returns). The allowed-token mask is built in fresh tensors
    before ``logits`` is written."""
    _check(logits, bitmask, rows)
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        return logits
    words = bitmask.shape[1]
    used = min(words, -(-vocab // 32))  # words that cover tokens < vocab
    if rows is None:
        picked = bitmask[:batch, :used]
        constrained = None
    elif bitmask.shape[0] == 0 or used == 0:  # no mask row to read: every constrained row allows nothing
        picked = torch.zeros(batch, used, dtype=torch.int32, device=logits.device)
        constrained = rows >= 0
    else:
        constrained = rows >= 0
        picked = bitmask[:, :used].index_select(0, rows.clamp(min=0))  # (B, used); -1 rows read row 0, unused
    bits = (picked.unsqueeze(-1) >> _bit_shifts(logits.device)) & 1  # (B, used, 32): bit j of word w
    allowed = bits.reshape(batch, used * 32).bool()
    if used * 32 >= vocab:
        allowed = allowed[:, :vocab]
    else:  # the mask is narrower than the logits: tokens past it are disallowed
        allowed = torch.cat([allowed, allowed.new_zeros(batch, vocab - used * 32)], dim=1)
    if constrained is not None:
        allowed |= ~constrained.unsqueeze(1)
    return logits.masked_fill_(~allowed, float("-inf"))


@jit
def _apply_token_bitmask_kernel(logits_ptr, bitmask_ptr, rows_ptr, vocab, words,
                                stride_logits_row, stride_logits_col, stride_mask_row, stride_mask_col,
                                HAS_ROWS: tl.constexpr, BLOCK: tl.constexpr, GROUP: tl.constexpr, PDL: tl.constexpr):
    """Program (b, k): tokens [k * BLOCK, (k + 1) * BLOCK) of logits row b, against mask row
    rows[b] (b without HAS_ROWS); nothing when that index is negative.

    The tile is (BLOCK // GROUP, GROUP): groups of GROUP consecutive tokens (16 bytes of logits
    by default), each within one mask word (GROUP divides 32). Per group, from its GROUP bits:
    none banned -> nothing written; all banned -> one vector store of -inf, nothing read; some
    banned -> the group is read, its banned lanes set to -inf and the group written back whole
    (allowed lanes keep their bits). So stores are whole 16-byte vectors, and logits are read only
    in groups that mix allowed and banned tokens. (Storing just the banned lanes of such groups,
    with a per-token mask, reads nothing but measured 1.5-2x slower on an H100 wherever many
    groups mix: a per-token mask makes every store a 4-byte one.) The vector store needs Triton to
    prove alignment: row stride and vocabulary size multiples of 16 (as Llama 3's 128,256), else
    it is done token by token, still right. Each mask word is read from memory once (the groups of
    a word share the load)."""
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    k = tl.program_id(1)
    if HAS_ROWS:
        row = tl.load(rows_ptr + b).to(tl.int64)
    else:
        row = b
    # An unconstrained row (negative index) reads no word and writes no token: its limits are 0.
    # (Limits, not a scalar `active & mask`: Triton's CPU interpreter rejects that broadcast.)
    word_limit = tl.where(row >= 0, words, 0)
    token_limit = tl.where(row >= 0, vocab, 0)
    first = k * BLOCK + tl.arange(0, BLOCK // GROUP) * GROUP  # each group's first token
    word = first // 32
    # A word past the mask's width reads as 0 (its tokens disallowed); words past the vocabulary
    # are not read at all.
    packed = tl.load(bitmask_ptr + row * stride_mask_row + word * stride_mask_col,
                     mask=(word < word_limit) & (first < vocab), other=0)
    ALL: tl.constexpr = (1 << GROUP) - 1
    bits = (packed >> (first % 32)) & ALL  # bit i: token first + i allowed
    some_banned = bits != ALL
    mixed = some_banned & (bits != 0)
    lane = tl.arange(0, GROUP)
    token = first[:, None] + lane[None, :]
    inside = token < token_limit
    banned = ((bits[:, None] >> lane[None, :]) & 1) == 0
    pointers = logits_ptr + b * stride_logits_row + token * stride_logits_col
    # Masks constant across a group (broadcast from one value per group): whole-vector accesses.
    kept = tl.load(pointers, mask=mixed[:, None] & inside, other=float("-inf"))
    minus_inf = tl.full([BLOCK // GROUP, GROUP], float("-inf"), kept.dtype)
    tl.store(pointers, tl.where(banned, minus_inf, kept), mask=some_banned[:, None] & inside)


def choose_block(batch: int, vocab: int, device: torch.device) -> int:
    """Tokens per program: 1,024 (4 warps) for a few rows, 4,096 (8 warps) once there are enough
    rows to fill the GPU several times over, where fewer, longer programs save scheduling. On an
    H100 (V = 128,256; B = 1, 8, 64, 256; 1%, 50% and 99% of tokens allowed; float32 and bf16)
    this came within 5% of the best of BLOCK 1,024-16,384 over 4-16 warps, except 8 rows at 99%
    allowed (1.5 us against 1.2 us at 2,048)."""
    if batch * triton.cdiv(vocab, 4096) >= 8 * num_sms(device):
        return 4096
    return 1024


def apply_token_bitmask_triton(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None,
                               *, block: int | None = None, group: int | None = None,
                               num_warps: int | None = None) -> torch.Tensor:
    """The Triton kernel (CUDA tensors, or CPU ones under TRITON_INTERPRET=1). ``block`` overrides
    ``choose_block`` (a power of two >= 32), ``group`` the tokens per decision (16 bytes of logits:
    4 float32, 8 bf16/fp16; a power of two <= 16), ``num_warps`` the warps per program; tests and
    the benchmark sweep them."""
    _check(logits, bitmask, rows)
    batch, vocab = logits.shape
    if batch == 0 or vocab == 0:
        return logits
    words = bitmask.shape[1]
    if bitmask.numel() == 0:  # no word to read (every constrained row allows nothing), but a real pointer
        bitmask, words = torch.zeros(1, 1, dtype=torch.int32, device=logits.device), 0
    block = block or choose_block(batch, vocab, logits.device)
    group = group or 16 // logits.element_size()
    assert block >= 32 and block & (block - 1) == 0, block
    assert 1 <= group <= 16 and group & (group - 1) == 0, group
    num_warps = num_warps or max(1, min(8, block // 256))
    # At most 32 tokens a thread: Triton 3.6 on an H100 miscompiled BLOCK 8192 over 4 warps
    # (64 float32 a thread; lane 3 of some groups got the wrong bit), 8 warps were right.
    num_warps = max(num_warps, block // 1024)
    grid = (batch, triton.cdiv(vocab, block))
    rows, = dense(rows)  # read at rows_ptr + b
    _apply_token_bitmask_kernel[grid](
        logits, bitmask, rows if rows is not None else bitmask, vocab, words,
        logits.stride(0), logits.stride(1), bitmask.stride(0), bitmask.stride(1),
        HAS_ROWS=rows is not None, BLOCK=block, GROUP=group, num_warps=num_warps, **pdl_options(logits),
    )
    return logits


def apply_token_bitmask_(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None = None) -> torch.Tensor:
    """Disallowed tokens' logits -> -inf, in place; returns ``logits``. See the module docstring.
    CUDA: the Triton kernel (no host sync, CUDA-graph safe); elsewhere the torch reference."""
    if use_triton(logits):
        return apply_token_bitmask_triton(logits, bitmask, rows)
    return apply_token_bitmask_reference(logits, bitmask, rows)
