"""Sampling a batch of next tokens on the device in one pass, with no host sync.

``sample_tokens(logits, temperature, seeds, offsets)`` draws, for every row, token
``argmax_v(logits[v] / T + G[v])`` where G is Gumbel noise: the Gumbel-max trick, an exact
draw from ``softmax(logits / T)`` that needs no softmax, no sort and no normalisation: one read
of the logits. Rows with ``T == 0`` take the plain argmax (greedy). Tokens whose logit is
-inf (masked by top-k/top-p, bans, ...) are never drawn.

``greedy_tokens(logits)`` is ``logits.argmax(dim=-1)`` for batches where every row is greedy.

On CUDA both split a row over enough programs to cover the GPU (for a few rows), then pick among
their bests in a second small kernel: one thread block per row, as torch.argmax runs it, reads a
large vocabulary's 0.5 MB of logits at a fraction of the GPU's bandwidth.

Randomness is counter-based: the noise of (row, token v) is a function of ``seeds[row]``,
``offsets[row]`` and v only (Philox on the GPU), so a request that passes its own seed and its
step number as offset gets a reproducible stream that does not depend on which other requests
share the batch or in which row it sits, and two launches serve every row: the alternative, one
``torch.Generator`` per row, costs a kernel launch per row per step.

The CPU path (and test oracle of the properties above) is ``sample_tokens_ref``: the same
Gumbel-max draw with noise from a torch generator seeded from (seed, offset). It is reproducible
on its own but does not reproduce the GPU's random stream.

Shapes: logits (B, V) float32 (or bf16/fp16); temperature (B,) float32; seeds, offsets (B,)
int64; returns (B,) int64 token ids on the logits' device.
"""
from __future__ import annotations

import torch

from kernels._triton import dense, jit, num_sms, tl, triton, use_triton

_MIX = 0x5851F42D4C957F2D  # PCG's multiplier (odd, < 2**63): spreads (seed, offset) over the key space


def _row_key(seed: int, offset: int) -> int:
    return (seed * _MIX + offset) % (1 << 63)


def gumbel_noise_ref(num_tokens: int, seed: int, offset: int, device) -> torch.Tensor:
    """(num_tokens,) float32 standard Gumbel noise, reproducible from (seed, offset)."""
    generator = torch.Generator().manual_seed(_row_key(seed, offset))
    uniform = torch.rand(num_tokens, generator=generator, dtype=torch.float64).clamp_(1e-12, 1 - 1e-12)
    return (-torch.log(-torch.log(uniform))).float().to(device)


def sample_tokens_ref(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                      offsets: torch.Tensor) -> torch.Tensor:
    temps, seed_list, offset_list = temperature.tolist(), seeds.tolist(), offsets.tolist()
    out = torch.empty(logits.shape[0], dtype=torch.int64, device=logits.device)
    for row, (t, seed, offset) in enumerate(zip(temps, seed_list, offset_list)):
        scores = logits[row].float()
        if t > 0:
            scores = scores / t + gumbel_noise_ref(logits.shape[1], seed, offset, logits.device)
        out[row] = scores.argmax()
    return out


@jit
def _chunk_best_kernel(logits_ptr, temperature_ptr, seeds_ptr, offsets_ptr, best_value_ptr, best_index_ptr,
                       vocab, chunk, stride_row, GUMBEL: tl.constexpr, BLOCK: tl.constexpr, CHUNKS_PAD: tl.constexpr):
    """Program (row, c), over tokens [c * chunk, (c + 1) * chunk): the best score and the smallest
    token id holding it, into best_value / best_index (rows, CHUNKS_PAD).

    GUMBEL: the score is logits / T + Gumbel noise (the logit itself where T <= 0); tokens at -inf
    score -inf and are never the best (a chunk with none keeps index 2**31 - 1). The noise of
    (row, token) depends on the row's seed and offset and the token alone, so the chunks of a row
    draw what one program walking the whole row would.
    Otherwise plain argmax, as torch.argmax: NaN counts as the largest value (it becomes +inf
    here, so a row holding both may name either), and a row of -inf gives its first index."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.program_id(1)
    if GUMBEL:
        temperature = tl.load(temperature_ptr + row)
        greedy = temperature <= 0.0
        inv_t = tl.where(greedy, 1.0, 1.0 / tl.where(greedy, 1.0, temperature))
        key = (tl.load(seeds_ptr + row) * 0x5851F42D4C957F2D + tl.load(offsets_ptr + row)) & 0x7FFFFFFFFFFFFFFF
    best_value = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    best_index = tl.full([BLOCK], 2147483647, dtype=tl.int32)
    cols = tl.arange(0, BLOCK)
    end = tl.minimum((c + 1) * chunk, vocab)
    for start in range(c * chunk, end, BLOCK):
        v = start + cols
        valid = v < end
        x = tl.load(logits_ptr + row * stride_row + v, mask=valid, other=float("-inf")).to(tl.float32)
        if GUMBEL:
            uniform = tl.rand(key, v)  # in [0, 1): counter-based on (key, token)
            uniform = tl.minimum(tl.maximum(uniform, 1e-12), 1.0 - 1e-7)
            gumbel = -tl.log(-tl.log(uniform))
            score = tl.where(greedy, x, x * inv_t + gumbel)
            score = tl.where(valid & (x > float("-inf")), score, float("-inf"))
            better = score > best_value  # strict: a lane keeps its earliest token on ties
        else:
            score = tl.where(x != x, float("inf"), x)
            better = valid & ((score > best_value) | ((score == best_value) & (v < best_index)))
        best_value = tl.where(better, score, best_value)
        best_index = tl.where(better, v, best_index)
    top = tl.max(best_value, 0)
    tl.store(best_value_ptr + row * CHUNKS_PAD + c, top)
    tl.store(best_index_ptr + row * CHUNKS_PAD + c, tl.min(tl.where(best_value == top, best_index, 2147483647), 0))


@jit(do_not_specialize=["chunks"])  # one variant for every row count (see _best_per_row)
def _pick_chunk_kernel(best_value_ptr, best_index_ptr, out_ptr, chunks, CHUNKS_PAD: tl.constexpr):
    """One program per row: of the chunks' bests, the largest score; among equal ones the smallest
    token id; 0 where no chunk had a candidate (a row of masked tokens)."""
    row = tl.program_id(0).to(tl.int64)
    c = tl.arange(0, CHUNKS_PAD)
    values = tl.load(best_value_ptr + row * CHUNKS_PAD + c, mask=c < chunks, other=float("-inf"))
    indices = tl.load(best_index_ptr + row * CHUNKS_PAD + c, mask=c < chunks, other=2147483647)
    winner = tl.min(tl.where(values == tl.max(values, 0), indices, 2147483647), 0)
    tl.store(out_ptr + row, tl.where(winner == 2147483647, 0, winner).to(tl.int64))


_CHUNK_BLOCK = 1024


def _row_split(vocab: int, programs: int) -> tuple[int, int]:
    """(chunk, chunks): a row of ``vocab`` tokens over about ``programs`` programs of whole
    _CHUNK_BLOCK-token blocks each."""
    chunk = max(_CHUNK_BLOCK, triton.cdiv(triton.cdiv(vocab, programs), _CHUNK_BLOCK) * _CHUNK_BLOCK)
    return chunk, triton.cdiv(vocab, chunk)


def _split_launch(vocab: int, programs: int, sms: int) -> tuple[int, int, int, int, int]:
    """(chunk, chunks, CHUNKS_PAD, BLOCK, num_warps) of the split kernels for a row over ``programs`` programs.
    One CHUNKS_PAD per vocabulary (room for the one-row split's chunks), not one per row count: a kernel variant
    first launched while serving loads its module, and that load waited for the device's queued work (a 175-370
    ms step launch in the first image run on the H200, 2026-11-30). A program walking a whole row (a large
    batch) takes wider tiles: for 512 rows of sampled logits, 1,024 tokens over 4 warps measured 383 us against
    347 us for 2,048 over 8 (H100)."""
    chunk, chunks = _row_split(vocab, programs)
    chunks_pad = triton.next_power_of_2(max(chunks, _row_split(vocab, 2 * sms)[1]))
    return (chunk, chunks, chunks_pad, *((_CHUNK_BLOCK, 4) if chunks > 1 else (2 * _CHUNK_BLOCK, 8)))


def sampling_kernel_variants(vocab: int, rows: int, sms: int) -> tuple[int, int, int]:
    """(CHUNKS_PAD, BLOCK, num_warps) of the split kernels for ``rows`` rows: what picks a compiled
    variant besides the logits' dtype, row stride and GUMBEL (two per vocabulary: one program a row
    or many)."""
    return _split_launch(vocab, max(1, 2 * sms // rows), sms)[2:]


_warmed: set[tuple] = set()  # (vocab, row stride, logits dtype, device) whose variants have all launched


def _warm_other_variants(logits: torch.Tensor) -> None:
    """On the first split of a kind of logits, launch every variant serving can pick for it (greedy
    and sampled; a row over many programs and one program a row), so none is first launched while
    serving. Not while a CUDA graph is captured (the launches would join the graph)."""
    key = (logits.shape[1], logits.stride(0), logits.dtype, logits.device)
    if not logits.is_cuda or key in _warmed or torch.cuda.is_current_stream_capturing():
        return
    _warmed.add(key)
    width, stride = key[0], key[1]
    # One row of the same width and stride (a large batch's logits would take hundreds of MB of a device whose
    # KV pool was sized to its limit): split over many programs, and walking the row in one program, which is
    # the variant of every batch past 2 * SMs rows (sampled ones: greedy ones that large take torch.argmax).
    dummy = torch.zeros(1, stride, dtype=logits.dtype, device=logits.device)[:, :width]
    zeros = torch.zeros(1, dtype=torch.int64, device=logits.device)
    gumbel = (torch.ones(1, device=logits.device), zeros, zeros)
    _best_per_row(dummy, None, programs=2 * num_sms(logits.device))
    for programs in (2 * num_sms(logits.device), 1):
        _best_per_row(dummy, gumbel, programs=programs)


def _best_per_row(logits: torch.Tensor, gumbel: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None,
                  programs: int | None = None) -> torch.Tensor:
    """Each row split over enough programs to cover the GPU twice (at least 1,024 tokens each), then
    one small kernel picks among their bests. On an H100, for Llama-8B's 128,256 float32 logits
    (0.5 MB), one row took 26 us greedy (torch.argmax) and 109 us sampled (one program walking the
    row) against 3.4 and 4.2 us split; 8 rows 110 -> 10 us sampled, 64 rows 111 -> 59 us.
    ``gumbel``: (temperature, seeds, offsets) of the rows. ``programs`` per row overrides the split
    (tests: 1 is one program walking the whole row)."""
    rows, vocab = logits.shape
    assert logits.stride(1) == 1
    out = torch.empty(rows, dtype=torch.int64, device=logits.device)
    if rows == 0:
        return out
    if programs is None:
        _warm_other_variants(logits)
    sms = num_sms(logits.device)
    chunk, chunks, chunks_pad, block, warps = _split_launch(vocab, programs or max(1, 2 * sms // rows), sms)
    best_value = torch.empty(rows, chunks_pad, dtype=torch.float32, device=logits.device)
    best_index = torch.empty(rows, chunks_pad, dtype=torch.int32, device=logits.device)
    # read at ptr + row: per-row views (a column of a request table, one value broadcast) made dense
    temperature, seeds, offsets = dense(*gumbel) if gumbel is not None else (logits, logits, logits)
    _chunk_best_kernel[(rows, chunks)](logits, temperature, seeds, offsets, best_value, best_index, vocab, chunk,
                                       logits.stride(0), GUMBEL=gumbel is not None, BLOCK=block,
                                       CHUNKS_PAD=chunks_pad, num_warps=warps)
    _pick_chunk_kernel[(rows,)](best_value, best_index, out, chunks, CHUNKS_PAD=chunks_pad, num_warps=1)
    return out


def sample_tokens_triton(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                         offsets: torch.Tensor) -> torch.Tensor:
    return _best_per_row(logits, (temperature.float().contiguous(), seeds.long().contiguous(),
                                  offsets.long().contiguous()))


GREEDY_SPLIT_MAX_ROWS = 64  # beyond this many rows torch.argmax's one block per row fills the GPU


def greedy_tokens(logits: torch.Tensor) -> torch.Tensor:
    """logits (B, V) -> (B,) int64: torch.argmax(logits, dim=-1), the first index on ties; for up to
    GREEDY_SPLIT_MAX_ROWS rows on CUDA, each row split over many programs (``_best_per_row``)."""
    if not (use_triton(logits) and 0 < logits.shape[0] <= GREEDY_SPLIT_MAX_ROWS and logits.stride(1) == 1):
        return logits.argmax(dim=-1)
    return _best_per_row(logits, None)


def sample_tokens(logits: torch.Tensor, temperature: torch.Tensor, seeds: torch.Tensor,
                  offsets: torch.Tensor) -> torch.Tensor:
    """Gumbel-max draw per row (greedy where temperature <= 0); see the module docstring."""
    if use_triton(logits):
        return sample_tokens_triton(logits, temperature, seeds, offsets)
    return sample_tokens_ref(logits, temperature, seeds, offsets)

