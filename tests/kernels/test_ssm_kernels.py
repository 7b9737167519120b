"""Mamba-2 kernels (kernels/ssd_scan.py, kernels/causal_conv1d.py) against a token-by-token recurrence.

The oracle is the recurrence itself (state = exp(dt A) state + dt x B^T; y = state C + D x), one
token at a time, written here independently of the kernels' chunked (SSD) form. References are
checked against it on CPU in every run; the Triton kernels against the references on a GPU or
under TRITON_INTERPRET=1. Batches pack sequences of different lengths (1 included), some starting
from a slot's state and some from zeros, in shuffled slots; decode batches skip a padding row.
"""
from __future__ import annotations

import functools

import pytest
import torch
import torch.nn.functional as F
from kernel_testing import relative_error

from kernels.causal_conv1d import (causal_conv1d_decode_ref, causal_conv1d_decode_triton, causal_conv1d_prefill_ref,
                                   causal_conv1d_prefill_triton)
from kernels.ssd_scan import ssd_prefill_ref, ssd_prefill_triton, ssm_decode_ref, ssm_decode_triton
from kernels.ssm_chunks import SequenceChunks

H, P, G, N, CONV, K, SLOTS = 4, 16, 2, 16, 40, 4, 6
LENS = [20, 2, 70, 1]  # 70 spans two Triton chunks of 64; 2 is shorter than the conv window (K - 1 = 3)
SLOT_OF = [3, 0, 5, 1]
HAS_STATE = [True, True, True, False]


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _ssm_inputs(seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    T = sum(LENS)
    t = {"x": torch.randn(T, H, P, generator=g), "dt": torch.randn(T, H, generator=g),
         "A": -torch.rand(H, generator=g) - 0.5, "B": torch.randn(T, G, N, generator=g),
         "C": torch.randn(T, G, N, generator=g), "D": torch.randn(H, generator=g),
         "dt_bias": 0.3 * torch.randn(H, generator=g), "states": torch.randn(SLOTS, H, P, N, generator=g)}
    return {k: v.to(device) for k, v in t.items()}


@functools.cache
def _recurrence_of(seed: int, dt_limit: tuple[float, float]):
    return _recurrence(_ssm_inputs(seed), dt_limit)


def _recurrence(t, dt_limit=(0.0, float("inf"))):
    """Token-by-token oracle: (y, final states) for the LENS/SLOT_OF/HAS_STATE batch."""
    states, cu = t["states"].clone(), _cu(LENS)
    y = torch.zeros_like(t["x"])
    for i, slot in enumerate(SLOT_OF):
        s = states[slot].clone() if HAS_STATE[i] else torch.zeros(H, P, N)
        for row in range(cu[i], cu[i + 1]):
            d = F.softplus(t["dt"][row] + t["dt_bias"]).clamp(*dt_limit)
            B, C = (t[k][row].repeat_interleave(H // G, 0) for k in ("B", "C"))
            s = s * torch.exp(d * t["A"])[:, None, None] + (d[:, None] * t["x"][row])[..., None] * B[:, None, :]
            y[row] = (s * C[:, None, :]).sum(-1) + t["D"][:, None] * t["x"][row]
        states[slot] = s
    return y, states


def _chunks(device="cpu") -> SequenceChunks:
    return SequenceChunks(SLOT_OF, _cu(LENS), HAS_STATE, torch.device(device))


def _prefill(fn, t, dt_limit=(0.0, float("inf")), **kw):
    states = t["states"].clone()
    y = fn(t["x"], t["dt"], t["A"], t["B"], t["C"], t["D"], t["dt_bias"], states, _chunks(t["x"].device), dt_limit,
           **kw)
    return y, states


@pytest.mark.parametrize("chunk", [7, 64])
@pytest.mark.parametrize("dt_limit", [(0.0, float("inf")), (0.5, 2.0)])
def test_ssd_reference_equals_the_recurrence(chunk, dt_limit):
    t = _ssm_inputs()
    y, states = _prefill(ssd_prefill_ref, t, dt_limit, chunk=chunk)
    y_ref, states_ref = _recurrence_of(0, dt_limit)
    assert relative_error(y, y_ref) < 1e-5 and relative_error(states, states_ref) < 1e-5


def test_decode_reference_is_one_step_of_the_recurrence_and_skips_padding():
    t = _ssm_inputs(1)
    rows = torch.tensor([0, 21, 30])
    slots = torch.tensor([4, -1, 2], dtype=torch.int32)
    states = t["states"].clone()
    y = ssm_decode_ref(t["x"][rows], t["dt"][rows], t["A"], t["B"][rows], t["C"][rows], t["D"], t["dt_bias"],
                       states, slots)
    for r, (row, slot) in enumerate(zip(rows.tolist(), slots.tolist())):
        if slot < 0:
            assert y[r].abs().max() == 0
            continue
        d = F.softplus(t["dt"][row] + t["dt_bias"])
        B, C = (t[k][row].repeat_interleave(H // G, 0) for k in ("B", "C"))
        s = t["states"][slot] * torch.exp(d * t["A"])[:, None, None] + (d[:, None] * t["x"][row])[..., None] * B[:, None]
        assert torch.allclose(states[slot], s, atol=1e-5)
        assert torch.allclose(y[r], (s * C[:, None]).sum(-1) + t["D"][:, None] * t["x"][row], atol=1e-5)
    untouched = [i for i in range(SLOTS) if i not in (4, 2)]
    assert torch.equal(states[untouched], t["states"][untouched])


def _conv_inputs(seed: int = 0, device: str = "cpu"):
    g = torch.Generator().manual_seed(seed)
    t = {"x": torch.randn(sum(LENS), CONV, generator=g), "w": torch.randn(CONV, K, generator=g),
         "b": torch.randn(CONV, generator=g), "states": torch.randn(SLOTS, CONV, K - 1, generator=g)}
    return {k: v.to(device) for k, v in t.items()}


def test_conv_reference_chunks_equal_one_chunk():
    """A 70-token sequence cut into chunks of 1, 2 and 67 tokens (shorter than the window, then
    longer) gives the outputs and the state of one chunk."""
    t = _conv_inputs()
    x = t["x"][:70]
    one = torch.zeros(1, CONV, K - 1)
    out = causal_conv1d_prefill_ref(x, t["w"], t["b"], one, SequenceChunks([0], [0, 70], [False]))
    parts, chunked = [], torch.zeros(1, CONV, K - 1)
    for start, end in [(0, 1), (1, 3), (3, 70)]:
        parts.append(causal_conv1d_prefill_ref(x[start:end], t["w"], t["b"], chunked,
                                               SequenceChunks([0], [0, end - start], [start > 0])))
    assert relative_error(torch.cat(parts), out) < 1e-6 and torch.equal(chunked, one)
    expected = F.silu(F.conv1d(x.t()[None], t["w"][:, None], t["b"], padding=K - 1, groups=CONV)[0, :, :70]).t()
    assert relative_error(out, expected) < 1e-6


# ---- Triton (GPU; or TRITON_INTERPRET=1 on CPU) ---------------------------------------------

def test_ssd_prefill_kernel_matches_reference(device):
    t = _ssm_inputs(2, device)
    y, states = _prefill(ssd_prefill_triton, t, (0.01, float("inf")))
    y_ref, states_ref = _prefill(ssd_prefill_ref, {k: v.cpu() for k, v in t.items()}, (0.01, float("inf")))
    bound = 1e-5  # float32 inputs: IEEE dots on a GPU too
    assert relative_error(y, y_ref) < bound and relative_error(states, states_ref) < bound


def test_decode_kernels_match_references(device):
    t, c = _ssm_inputs(3, device), _conv_inputs(3, device)
    slots = torch.tensor([4, -1, 2, 0], dtype=torch.int32, device=device)
    rows = torch.tensor([0, 21, 30, 92], device=device)
    args = (t["x"][rows], t["dt"][rows], t["A"], t["B"][rows], t["C"][rows], t["D"], t["dt_bias"])
    s1, s2 = t["states"].clone(), t["states"].clone()
    y1, y2 = ssm_decode_triton(*args, s1, slots), ssm_decode_ref(*args, s2, slots)
    assert relative_error(y1, y2) < 1e-5 and relative_error(s1, s2) < 1e-5
    # The model hands the conv its xBC columns as a view of the packed projection rows [z | xBC | dt]
    # (engine/ssm/mamba2.py), so rows are farther apart than the output's: each stride must be its own
    # (a decode-only step of several rows wrote row 1 on at x's stride; only row 0 came out right).
    packed = torch.cat([torch.randn(4, 9, device=device), c["x"][rows], torch.randn(4, 5, device=device)], dim=1)
    xbc = packed[:, 9:9 + CONV]
    c1, c2 = c["states"].clone(), c["states"].clone()
    o1 = causal_conv1d_decode_triton(xbc, c["w"], c["b"], c1, slots)
    o2 = causal_conv1d_decode_ref(xbc, c["w"], c["b"], c2, slots)
    assert relative_error(o1, o2) < 1e-5 and torch.equal(c1, c2)


def test_conv_prefill_kernel_matches_reference(device):
    c = _conv_inputs(4, device)
    c1, c2 = c["states"].clone(), c["states"].clone()
    o1 = causal_conv1d_prefill_triton(c["x"], c["w"], c["b"], c1, _chunks(device))
    o2 = causal_conv1d_prefill_ref(c["x"], c["w"], c["b"], c2, _chunks(device))
    assert relative_error(o1, o2) < 1e-5 and torch.equal(c1, c2)
