"""Grammar token bitmask (kernels/grammar_mask.py): the torch reference against a per-token loop and
against xgrammar's own apply_token_bitmask_inplace (CPU, always run); the Triton kernel bit-exactly
against both (GPU, or TRITON_INTERPRET=1 on CPU), and inside a captured CUDA graph (GPU).

Comparisons with xgrammar map our (bitmask, rows) onto its (bitmask, indices) contract: xgrammar
indexes the logits and the mask with the same row, so the mask is expanded to one row per logits
row and the constrained rows become ``indices``. xgrammar leaves tokens at or beyond 32 x the
mask's width unmasked where ours disallows them, so there the expected tail is set to -inf.
"""
from __future__ import annotations

import contextlib

import pytest
import torch

from kernels.grammar_mask import (apply_token_bitmask_, apply_token_bitmask_reference,
                                  apply_token_bitmask_triton)
from kernel_testing import triton_device

NEG_INF = float("-inf")


def random_bitmask(rows: int, words: int, seed: int, density: float = 0.5) -> torch.Tensor:
    """(rows, words) int32 with each bit set (token allowed) with probability ``density``; every
    bit pattern, the sign bit included, occurs."""
    generator = torch.Generator().manual_seed(seed)
    bits = (torch.rand(rows, words, 32, generator=generator) < density).to(torch.int64)
    packed = (bits << torch.arange(32)).sum(-1)  # 0 .. 2**32 - 1
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def make_case(batch, vocab, mask_rows, words, rows, dtype=torch.float32, seed=0, density=0.5):
    generator = torch.Generator().manual_seed(seed + 1)
    logits = torch.randn(batch, vocab, generator=generator).to(dtype)
    bitmask = random_bitmask(mask_rows, words, seed, density)
    row_map = None if rows is None else torch.tensor(rows, dtype=torch.int64)
    return logits, bitmask, row_map


def naive(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
    """The contract, one token at a time in Python."""
    out = logits.clone()
    words = bitmask.tolist()
    width = bitmask.shape[1]
    for b in range(logits.shape[0]):
        r = b if rows is None else int(rows[b])
        if r < 0:
            continue
        for t in range(logits.shape[1]):
            allowed = t < 32 * width and (words[r][t // 32] >> (t % 32)) & 1
            if not allowed:
                out[b, t] = NEG_INF
    return out


def via_xgrammar(logits: torch.Tensor, bitmask: torch.Tensor, rows: torch.Tensor | None, backend: str = "auto"):
    """Our contract computed with xgrammar.apply_token_bitmask_inplace (see the module docstring)."""
    import xgrammar as xgr

    out = logits.clone()
    batch, vocab = logits.shape
    row_list = list(range(batch)) if rows is None else rows.tolist()
    indices = [b for b, r in enumerate(row_list) if r >= 0]
    if not indices or vocab == 0:
        return out
    expanded = torch.zeros(batch, bitmask.shape[1], dtype=torch.int32)
    expanded[indices] = bitmask.cpu()[[row_list[b] for b in indices]]
    expanded = expanded.to(logits.device)
    if backend == "auto" and logits.is_cuda:
        backend = "triton"
    index_arg = None if rows is None else torch.tensor(indices, dtype=torch.int32, device=logits.device)
    if backend == "cpu":
        index_arg = None if rows is None else indices
    with pytest.warns(UserWarning) if 32 * bitmask.shape[1] < vocab else contextlib.nullcontext():
        xgr.apply_token_bitmask_inplace(out, expanded, indices=index_arg, backend=backend)
    if 32 * bitmask.shape[1] < vocab:  # xgrammar leaves the tail; ours disallows it
        out[indices, 32 * bitmask.shape[1]:] = NEG_INF
    return out


# (batch, vocab, mask rows, mask words, rows): rows=None means logits row b takes mask row b.
CASES = {
    "exact_width": (3, 128, 3, 4, None),
    "vocab_not_multiple_of_32": (4, 100, 4, 4, None),          # bits 100..127 of the last word ignored
    "mask_wider_than_vocab": (3, 100, 5, 9, None),             # extra words and extra mask rows ignored
    "mask_narrower_than_vocab": (3, 100, 3, 3, None),          # tokens 96..99 disallowed
    "rows_with_minus_one": (5, 200, 2, 7, [1, -1, 0, -1, 1]),  # a compact mask; two rows share mask row 1
    "rows_all_minus_one": (3, 70, 1, 3, [-1, -1, -1]),
    "rows_permuted": (4, 161, 4, 6, [3, 0, 2, 1]),
    "narrow_with_rows": (4, 130, 3, 2, [2, -1, 0, 1]),
}


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_reference_equals_a_per_token_loop(case, dtype):
    logits, bitmask, rows = make_case(*CASES[case], dtype=dtype, seed=len(case))
    expected = naive(logits, bitmask, rows)
    out = apply_token_bitmask_reference(logits, bitmask, rows)
    assert out is logits  # in place
    assert torch.equal(out, expected)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_reference_equals_xgrammar_cpu(case, dtype):
    pytest.importorskip("xgrammar")
    logits, bitmask, rows = make_case(*CASES[case], dtype=dtype, seed=7 + len(case))
    expected = via_xgrammar(logits, bitmask, rows, backend="cpu")
    assert torch.equal(apply_token_bitmask_reference(logits, bitmask, rows), expected)


@pytest.mark.parametrize("rows", [None, [0, -1, 2, 1]])
def test_reference_llama3_vocab_equals_xgrammar_cpu(rows):
    pytest.importorskip("xgrammar")
    vocab = 128256
    logits, bitmask, rows = make_case(4, vocab, 4, (vocab + 31) // 32, rows, seed=3, density=0.02)
    expected = via_xgrammar(logits, bitmask, rows, backend="cpu")
    assert torch.equal(apply_token_bitmask_(logits, bitmask, rows), expected)  # the CPU dispatch


def test_a_matchers_mask_leaves_only_its_tokens():
    """End to end with a real xgrammar matcher on a toy vocabulary: bit order and word order as
    xgrammar fills them. A JSON boolean after '{"ok": ' allows exactly 't' and 'f' prefixes."""
    xgr = pytest.importorskip("xgrammar")
    vocab = ["{", "}", '"', "ok", ":", " ", "true", "false", "t", "f", "rue", "alse", "null", "1", "</s>"]
    vocab += [f"pad{i}" for i in range(70 - len(vocab))]  # 70 tokens: 3 words, the last one partial
    info = xgr.TokenizerInfo(vocab, stop_token_ids=[14])
    compiled = xgr.GrammarCompiler(info).compile_json_schema(
        {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}, any_whitespace=False)
    matcher = xgr.GrammarMatcher(compiled)
    for token in (0, 2, 3, 2, 4, 5):  # {"ok":<space>
        assert matcher.accept_token(token), vocab[token]
    bitmask = xgr.allocate_token_bitmask(2, len(vocab))
    matcher.fill_next_token_bitmask(bitmask, 1)
    logits = torch.zeros(3, len(vocab))
    apply_token_bitmask_(logits, bitmask, torch.tensor([1, -1, 1]))
    allowed = {vocab[t] for t in torch.nonzero(logits[0] == 0).flatten().tolist()}
    assert allowed == {"true", "false", "t", "f"}
    assert torch.equal(logits[0], logits[2]) and torch.equal(logits[1], torch.zeros(len(vocab)))


def test_unconstrained_rows_are_untouched_bit_for_bit():
    logits, bitmask, rows = make_case(3, 300, 1, 10, [-1, 0, -1], seed=5)
    logits[0, 5], logits[2, 7] = float("nan"), float("inf")
    before = logits.clone()
    apply_token_bitmask_(logits, bitmask, rows)
    assert torch.equal(logits[0].view(torch.int32), before[0].view(torch.int32))
    assert torch.equal(logits[2].view(torch.int32), before[2].view(torch.int32))


def test_empty_shapes_and_bad_arguments():
    logits = torch.zeros(0, 50)
    assert apply_token_bitmask_(logits, torch.zeros(0, 2, dtype=torch.int32), None) is logits
    logits = torch.zeros(2, 50)
    apply_token_bitmask_(logits, torch.zeros(0, 2, dtype=torch.int32), torch.tensor([-1, -1]))
    assert torch.equal(logits, torch.zeros(2, 50))
    apply_token_bitmask_(logits, torch.full((2, 0), -1, dtype=torch.int32), None)  # no words: nothing allowed
    assert bool((logits == NEG_INF).all())
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 50), torch.zeros(2, 2, dtype=torch.int64))
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(3, 50), torch.zeros(2, 2, dtype=torch.int32))  # rows=None: 3 > 2
    with pytest.raises(ValueError):
        apply_token_bitmask_(torch.zeros(2, 50), torch.zeros(2, 2, dtype=torch.int32), torch.tensor([0]))


# ---- Triton kernel (GPU; or TRITON_INTERPRET=1 on CPU) ----------------------------------------

KERNEL_CASES = dict(CASES, **{
    "llama3_b1": (1, 128256, 1, 4008, None),
    "llama3_b8_half": (8, 128256, 4, 4008, [0, -1, 1, -1, 2, -1, 3, -1]),
    "llama3_padded_vocab": (2, 128512, 2, 4008, None),  # logits padded past the mask: tail disallowed
    "llama3_b64_half": (64, 128256, 32, 4008, [i // 2 if i % 2 == 0 else -1 for i in range(64)]),  # larger BLOCK
    "gpt2_vocab": (3, 50257, 3, 1571, [2, 1, -1]),  # V not a multiple of 16: token-by-token stores
})
GPU_ONLY = {"llama3_b64_half"}  # slow in the interpreter


def kernel_dtypes(device):
    return [torch.float32, torch.bfloat16, torch.float16] if device == "cuda" else [torch.float32, torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.parametrize("case", KERNEL_CASES)
def test_kernel_equals_reference_bit_for_bit(device, case):
    if case in GPU_ONLY and device != "cuda":
        pytest.skip("slow in the interpreter")
    batch, vocab, mask_rows, words, rows = KERNEL_CASES[case]
    # (block, group): the defaults, then tiles of one word, one token per decision, 16 per decision
    tilings = [(None, None), (32, 1), (32, 16), (1024, 2), (4096, 8)] if vocab < 1000 or device == "cuda" \
        else [(None, None)]
    for dtype in kernel_dtypes(device):
        logits, bitmask, row_map = make_case(batch, vocab, mask_rows, words, rows, dtype=dtype, seed=11,
                                             density=0.5 if vocab < 1000 else 0.05)
        expected = apply_token_bitmask_reference(logits.clone(), bitmask, row_map)
        for block, group in tilings:
            got = logits.to(device)
            out = apply_token_bitmask_triton(got, bitmask.to(device), None if row_map is None else row_map.to(device),
                                             block=block, group=group)
            assert out is got
            assert torch.equal(got.cpu().view(torch.int8), expected.view(torch.int8)), (dtype, block, group)


@pytest.mark.gpu
def test_kernel_rewrites_allowed_logits_bit_for_bit(device):
    """Groups that mix allowed and banned tokens are read and written back whole: the allowed
    values, NaNs with payloads, infinities and -0.0 included, come back with the same bits."""
    vocab = 4096
    for dtype, int_view in ((torch.float32, torch.int32), (torch.bfloat16, torch.int16)):
        logits = torch.randn(3, vocab).to(dtype)
        raw = logits.view(int_view)
        raw[:, 0::5] = 0x7FC1 if dtype == torch.bfloat16 else 0x7FC00123  # quiet NaN with a payload
        logits[:, 2::11] = float("inf")
        logits[:, 3::13] = -0.0
        bitmask = random_bitmask(3, vocab // 32, seed=4, density=0.7)
        expected = apply_token_bitmask_reference(logits.clone(), bitmask)
        for group in (None, 1, 4, 16):
            got = logits.to(device)
            apply_token_bitmask_triton(got, bitmask.to(device), block=1024, group=group)
            assert torch.equal(got.cpu().view(int_view), expected.view(int_view)), (dtype, group)


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["rows_with_minus_one", "mask_narrower_than_vocab", "llama3_b8_half", "llama3_b1"])
def test_kernel_equals_xgrammar(device, case):
    pytest.importorskip("xgrammar")
    batch, vocab, mask_rows, words, rows = KERNEL_CASES[case]
    for dtype in kernel_dtypes(device):
        logits, bitmask, row_map = make_case(batch, vocab, mask_rows, words, rows, dtype=dtype, seed=13)
        logits = logits.to(device)
        # xgrammar's own kernel on the GPU (its Triton backend), its C++ one under the interpreter
        expected = via_xgrammar(logits, bitmask.to(device), row_map, backend="auto" if device == "cuda" else "cpu")
        apply_token_bitmask_triton(logits, bitmask.to(device), None if row_map is None else row_map.to(device))
        assert torch.equal(logits.cpu(), expected.cpu()), dtype


@pytest.mark.gpu
def test_kernel_strided_logits_and_int32_rows(device):
    """Logits rows padded in memory (a view of a wider buffer) and an int32 row map."""
    buffer = torch.randn(4, 160)
    logits = buffer[:, :130]
    bitmask = random_bitmask(3, 5, seed=2)
    rows = torch.tensor([2, -1, 0, 1], dtype=torch.int32)
    expected_buffer = buffer.clone()
    apply_token_bitmask_reference(expected_buffer[:, :130], bitmask, rows)
    got = buffer.to(device)
    apply_token_bitmask_triton(got[:, :130], bitmask.to(device), rows.to(device), block=64)
    assert torch.equal(got.cpu(), expected_buffer)  # the padding columns untouched


@pytest.mark.skipif(not torch.cuda.is_available(), reason="captures a CUDA graph")
def test_public_entry_replays_from_a_cuda_graph():
    """No host sync: the call captures, and replays with new logits, masks and row maps (written
    into the captured tensors) give the new answers."""
    vocab, words = 128256, 4008
    logits = torch.empty(8, vocab, device="cuda")
    bitmask = torch.empty(4, words, dtype=torch.int32, device="cuda")
    rows = torch.empty(8, dtype=torch.int64, device="cuda")
    inputs = []
    for seed, row_list in ((1, [0, -1, 1, -1, 2, -1, 3, -1]), (2, [-1, -1, 3, 2, 1, 0, 0, -1]), (3, [-1] * 8)):
        fresh, mask, row_map = make_case(8, vocab, 4, words, row_list, seed=seed, density=0.1)
        inputs.append((fresh, mask, row_map))
    fresh, mask, row_map = inputs[0]
    logits.copy_(fresh), bitmask.copy_(mask), rows.copy_(row_map)
    apply_token_bitmask_(logits, bitmask, rows)  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_token_bitmask_(logits, bitmask, rows)
    for fresh, mask, row_map in inputs:
        logits.copy_(fresh), bitmask.copy_(mask), rows.copy_(row_map)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(logits.cpu(), apply_token_bitmask_reference(fresh.clone(), mask, row_map))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_public_entry_uses_the_kernel_on_cuda(monkeypatch):
    import kernels.grammar_mask as module

    def refuse(*_args, **_kwargs):
        raise AssertionError("the CUDA path must not use the torch reference")

    monkeypatch.setattr(module, "apply_token_bitmask_reference", refuse)
    logits, bitmask, rows = make_case(2, 1000, 2, 32, [1, -1])
    expected = naive(logits, bitmask, rows)
    out = module.apply_token_bitmask_(logits.cuda(), bitmask.cuda(), rows.cuda())
    assert torch.equal(out.cpu(), expected)
