"""Gumbel-max sampling: properties that pin a correct categorical draw, on GPU and on CPU.

The GPU's Philox stream and the CPU reference's generator differ, so instead of comparing
tokens the tests check what any correct sampler must do: greedy rows equal argmax; masked
(-inf) tokens are never drawn; the same (seed, offset) gives the same token whatever the
batch around it; and drawn frequencies match softmax(logits / T) within 5 standard errors
(a wrong temperature or a biased noise shifts them by far more at 20k draws).
"""
from __future__ import annotations

import math

import pytest
import torch

from kernels.sampling import sample_tokens, sample_tokens_ref
from kernel_testing import triton_device


def sampler_for(device: str):
    if device == "cpu":
        return sample_tokens_ref
    from kernels.sampling import sample_tokens_triton

    return sample_tokens_triton


DEVICES = ["cpu"] + (["cuda"] if triton_device() == "cuda" else [])


def rows(n: int, device: str, value: float = 0.0, dtype=torch.float32) -> torch.Tensor:
    return torch.full((n,), value, dtype=dtype, device=device)


@pytest.mark.parametrize("device", DEVICES)
def test_greedy_rows_take_the_argmax(device):
    logits = torch.randn(5, 128256, device=device)
    ids = sampler_for(device)(logits, rows(5, device), torch.arange(5, device=device), rows(5, device, 0, torch.int64))
    assert torch.equal(ids.cpu(), logits.argmax(-1).cpu())


@pytest.mark.parametrize("device", DEVICES)
def test_masked_tokens_are_never_drawn(device):
    logits = torch.randn(64, 1000, device=device)
    logits[:, 10:] = float("-inf")  # a top-10 mask
    ids = sampler_for(device)(logits, rows(64, device, 5.0), torch.arange(64, device=device), rows(64, device, 3, torch.int64))
    assert int(ids.max()) < 10


@pytest.mark.parametrize("device", DEVICES)
def test_same_seed_and_offset_same_token_in_any_batch(device):
    sample = sampler_for(device)
    logits = torch.randn(1, 5000, device=device)
    alone = sample(logits, rows(1, device, 1.0), torch.tensor([42], device=device), torch.tensor([7], device=device))
    batch = torch.cat([torch.randn(3, 5000, device=device), logits])
    inside = sample(batch, rows(4, device, 1.0), torch.tensor([1, 2, 3, 42], device=device),
                    torch.tensor([0, 0, 0, 7], device=device))
    assert int(inside[3]) == int(alone[0])
    steps = sample(logits.expand(32, -1).contiguous(), rows(32, device, 1.0), torch.full((32,), 42, device=device),
                   torch.arange(32, device=device))
    assert len(set(steps.tolist())) > 1  # the offset (step) moves the stream


@pytest.mark.parametrize("device", DEVICES)
def test_frequencies_match_softmax_with_temperature(device):
    n, temperature = 20000 if device == "cuda" else 4000, 0.7
    base = torch.tensor([2.0, 1.0, 0.5, 0.0, -1.0, float("-inf")])
    logits = base.to(device).expand(n, -1).contiguous()
    ids = sampler_for(device)(logits, rows(n, device, temperature), torch.arange(n, device=device) * 7919,
                              rows(n, device, 0, torch.int64))
    expected = torch.softmax(base / temperature, 0)
    counts = torch.bincount(ids.cpu(), minlength=6).double()
    for token in range(6):
        p = expected[token].item()
        sigma = math.sqrt(max(p * (1 - p), 1e-12) / n)
        assert abs(counts[token].item() / n - p) <= 5 * sigma + 1e-9, (token, counts[token].item() / n, p)


def test_public_entry_on_cpu_is_the_reference():
    logits = torch.randn(3, 50)
    args = (logits, torch.tensor([0.0, 1.0, 0.5]), torch.tensor([1, 2, 3]), torch.tensor([0, 1, 2]))
    assert torch.equal(sample_tokens(*args), sample_tokens_ref(*args))


@pytest.mark.parametrize("rows", [1, 3, 64, 65])
@pytest.mark.parametrize("vocab", [1000, 49152, 128256, 128257])
def test_greedy_tokens_equal_torch_argmax(device, rows, vocab):
    """greedy_tokens (split over programs for few rows on CUDA) is torch.argmax: the first index on
    ties, also across chunks, an all -inf row gives 0, and a NaN counts as the largest value."""
    from kernels.sampling import greedy_tokens

    torch.manual_seed(rows * 7 + vocab)
    logits = torch.randn(rows, vocab, device=device)
    logits[0, vocab // 2] = logits[0, vocab - 1] = logits[0, 5] = 100.0  # ties in three chunks: 5 wins
    if rows > 2:
        logits[1] = float("-inf")
        logits[2, vocab - 3] = float("nan")
    if rows > 1:
        logits[-1, 1:] = logits[-1, 0]  # a whole row of equal values
    got = greedy_tokens(logits)
    assert got.dtype == torch.int64 and got.shape == (rows,)
    assert torch.equal(got.cpu(), logits.argmax(dim=-1).cpu())
    assert got[0].item() == 5


@pytest.mark.skipif(triton_device() != "cuda", reason="needs a CUDA device")
@pytest.mark.parametrize("batch", [1, 5, 300])
def test_split_rows_draw_what_one_program_per_row_draws(batch):
    """A row split over many programs draws exactly the token that one program walking the whole
    row draws (the noise depends on the token, not on who reads it): sampled and greedy rows, a
    top-k mask, and a row with every token masked (token 0)."""
    from kernels.sampling import _best_per_row

    torch.manual_seed(batch)
    logits = torch.randn(batch, 128256, device="cuda") * 3
    logits[0, 50:] = float("-inf")
    if batch > 1:
        logits[1] = float("-inf")
    temperature = torch.rand(batch, device="cuda") * 2
    temperature[::3] = 0.0  # every third row greedy
    for step in range(4):
        seeds = torch.arange(batch, device="cuda") * 1000 + 17
        offsets = torch.full((batch,), step, device="cuda", dtype=torch.int64)
        split = _best_per_row(logits, (temperature, seeds, offsets))
        whole = _best_per_row(logits, (temperature, seeds, offsets), programs=1)
        assert torch.equal(split, whole)
        assert int(split[0]) < 50
        if batch > 1:
            assert int(split[1]) == 0


@pytest.mark.parametrize("sms", [78, 114, 132])
@pytest.mark.parametrize("vocab", [1000, 32000, 50257, 128256, 151936, 262208])
def test_every_row_count_maps_to_one_of_two_kernel_variants(vocab, sms):
    """The split kernels' compile-time shape (CHUNKS_PAD, BLOCK, warps) does not follow the row
    count: a variant first launched while serving stalled a step by 175-370 ms (its module load
    waited for the device), and a batch's count of finishing prompts is anything from 1 to the
    batch size. Every count's chunks fit its CHUNKS_PAD."""
    from kernels.sampling import _row_split, sampling_kernel_variants

    variants = {sampling_kernel_variants(vocab, rows, sms) for rows in range(1, 1025)}
    assert len(variants) <= 2
    for rows in range(1, 1025):
        chunks_pad = sampling_kernel_variants(vocab, rows, sms)[0]
        assert _row_split(vocab, max(1, 2 * sms // rows))[1] <= chunks_pad


@pytest.mark.skipif(triton_device() != "cuda", reason="needs a CUDA device")
def test_first_split_launches_every_variant_serving_can_pick():
    """After the first greedy call for a vocabulary, no row count, greedy or sampled, compiles or
    loads another variant of the split kernels."""
    from kernels.sampling import _chunk_best_kernel, _pick_chunk_kernel, greedy_tokens, sample_tokens

    def variants() -> int:
        return sum(len(kernel.device_caches[torch.cuda.current_device()][0])
                   for kernel in (_chunk_best_kernel, _pick_chunk_kernel))

    vocab = 128256 + 16 * 7  # a width no other test used: the first call warms it
    greedy_tokens(torch.randn(3, vocab, device="cuda"))
    before = variants()
    for rows in (1, 2, 5, 8, 17, 33, 64, 65, 100, 133, 264, 300, 512):
        logits = torch.randn(rows, vocab, device="cuda")
        greedy_tokens(logits)
        zeros = torch.zeros(rows, dtype=torch.int64, device="cuda")
        sample_tokens(logits, torch.full((rows,), 0.8, device="cuda"), zeros, zeros)
    torch.cuda.synchronize()
    assert variants() == before
