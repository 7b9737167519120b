"""Mamba-1 selective scan (kernels/selective_scan.py) against transformers' own scan, and its Triton kernels.

The oracle is transformers' torch path of Mamba-1 (modeling_mamba.mamba_selective_scan, from zeros,
and mamba_selective_state_update, one token): the references must equal it, a prompt cut into
chunks (each continuing its slot's state) must give the outputs and final state of one chunk, and
the Triton kernels must equal the references (on a GPU, or under TRITON_INTERPRET=1 on CPU). Batches
pack sequences of different lengths (1 included) in shuffled slots; decode batches skip a padding row.
"""
from __future__ import annotations

import pytest
import torch
from kernel_testing import relative_error
from transformers.models.mamba import modeling_mamba

from kernels.selective_scan import (selective_scan_decode_ref, selective_scan_decode_triton, selective_scan_prefill_ref,
                                    selective_scan_prefill_triton)
from kernels.ssm_chunks import SequenceChunks

D, N, SLOTS = 24, 16, 5  # 24 channels: a partial channel tile
LENS = [9, 1, 13]
SLOT_OF = [4, 0, 2]


def _cu(lens):
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    return cu


def _inputs(seed: int, device: str = "cpu", tokens: int = sum(LENS)):
    g = torch.Generator().manual_seed(seed)
    # (x and z as column views of one packed projection, as the mixer passes them)
    xz = torch.randn(tokens, 2 * D, generator=g)
    t = {"xz": xz, "dt": torch.randn(tokens, D, generator=g), "A": -torch.rand(D, N, generator=g) * 2 - 0.1,
         "B": torch.randn(tokens, N, generator=g), "C": torch.randn(tokens, N, generator=g),
         "Dskip": torch.randn(D, generator=g), "dt_bias": 0.3 * torch.randn(D, generator=g),
         "states": torch.randn(SLOTS, D, N, generator=g)}
    return {k: v.to(device) for k, v in t.items()}


def _args(t, rows=slice(None)):
    x, z = t["xz"][rows, :D], t["xz"][rows, D:]
    return x, t["dt"][rows], t["A"], t["B"][rows], t["C"][rows], t["Dskip"], t["dt_bias"], z


def test_prefill_reference_equals_transformers_scan_and_chunks_equal_one_chunk():
    t = _inputs(0)
    x, dt, A, B, C, Dskip, dt_bias, z = _args(t)
    states = t["states"].clone()
    y = selective_scan_prefill_ref(x, dt, A, B, C, Dskip, dt_bias, z, states,
                                   SequenceChunks(SLOT_OF, _cu(LENS), [False] * 3))
    for i, slot in enumerate(SLOT_OF):
        s, e = _cu(LENS)[i], _cu(LENS)[i + 1]
        # transformers' layout: (batch, channels, time), B/C (batch, N, time); it adds the bias and softplus
        ref, last = modeling_mamba.mamba_selective_scan(
            x[s:e].t()[None], dt[s:e].t()[None], A, B[s:e].t()[None], C[s:e].t()[None], D=Dskip, z=z[s:e].t()[None],
            delta_bias=dt_bias, delta_softplus=True, return_last_state=True, use_associative_scan=False)
        assert relative_error(y[s:e], ref[0].t()) < 1e-5 and relative_error(states[slot], last[0]) < 1e-5
    # the 13-token sequence in chunks of 1, 5 and 7, each continuing the slot's state
    one = states[2].clone()
    chunked = torch.zeros(1, D, N)
    parts = []
    for start, end in [(10, 11), (11, 16), (16, 23)]:
        rows = slice(start, end)
        parts.append(selective_scan_prefill_ref(*_args(t, rows), chunked,
                                                SequenceChunks([0], [0, end - start], [start > 10])))
    assert relative_error(torch.cat(parts), y[10:23]) < 1e-6 and relative_error(chunked[0], one) < 1e-6


def test_decode_reference_equals_transformers_state_update_and_skips_padding():
    t = _inputs(1)
    rows, slots = torch.tensor([0, 7, 12]), torch.tensor([3, -1, 1], dtype=torch.int32)
    states = t["states"].clone()
    y = selective_scan_decode_ref(*_args(t, rows), states, slots)
    x, dt, A, B, C, Dskip, dt_bias, z = _args(t, rows)
    for r, slot in enumerate(slots.tolist()):
        if slot < 0:
            assert y[r].abs().max() == 0
            continue
        state = t["states"][slot:slot + 1].clone()
        ref = modeling_mamba.mamba_selective_state_update(state, x[r:r + 1], dt[r:r + 1], A, B[r:r + 1], C[r:r + 1],
                                                          Dskip, dt_bias=dt_bias, dt_softplus=True, z=z[r:r + 1])
        assert relative_error(y[r], ref[0]) < 1e-5 and relative_error(states[slot], state[0]) < 1e-5
    assert torch.equal(states[[0, 2, 4]], t["states"][[0, 2, 4]])


# ---- Triton (GPU; or TRITON_INTERPRET=1 on CPU) ---------------------------------------------

def test_prefill_kernel_matches_reference(device):
    t = _inputs(2, device)
    chunks = SequenceChunks(SLOT_OF, _cu(LENS), [True, False, True], torch.device(device))
    s1, s2 = t["states"].clone(), t["states"].clone()
    y1 = selective_scan_prefill_triton(*_args(t), s1, chunks)
    y2 = selective_scan_prefill_ref(*_args(t), s2, chunks)
    assert relative_error(y1, y2) < 1e-5 and relative_error(s1, s2) < 1e-5


def test_decode_kernel_matches_reference(device):
    t = _inputs(3, device)
    rows = torch.tensor([0, 7, 12, 20], device=device)
    slots = torch.tensor([3, -1, 1, 0], dtype=torch.int32, device=device)
    s1, s2 = t["states"].clone(), t["states"].clone()
    y1 = selective_scan_decode_triton(*_args(t, rows), s1, slots)
    y2 = selective_scan_decode_ref(*_args(t, rows), s2, slots)
    assert relative_error(y1, y2) < 1e-5 and relative_error(s1, s2) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cuda_prefill_and_decode_at_jamba_width(dtype):
    """Jamba-1.5-Mini's layer width (D 8192, N 16), bf16 states: a 600-token and a 3-token prompt,
    then a decode step, against the references on the same device."""
    g = torch.Generator(device="cuda").manual_seed(0)
    width, lens = 8192, [600, 3]
    T = sum(lens)
    xz = torch.randn(T, 2 * width, device="cuda", generator=g).to(dtype)
    dt = torch.randn(T, width, device="cuda", generator=g).to(dtype)
    A = -torch.rand(width, N, device="cuda", generator=g) * 2 - 0.1
    B, C = (torch.randn(T, N, device="cuda", generator=g).to(dtype) for _ in range(2))
    Dskip, bias = torch.randn(width, device="cuda", generator=g), 0.3 * torch.randn(width, device="cuda", generator=g)
    states = torch.zeros(4, width, N, device="cuda", dtype=dtype)
    chunks = SequenceChunks([2, 0], _cu(lens), [False, False], torch.device("cuda"))
    args = (xz[:, :width], dt, A, B, C, Dskip, bias, xz[:, width:])
    s1, s2 = states.clone(), states.clone()
    y1, y2 = selective_scan_prefill_triton(*args, s1, chunks), selective_scan_prefill_ref(*args, s2, chunks)
    bound = 1e-5 if dtype == torch.float32 else 1e-2
    assert relative_error(y1, y2) < bound and relative_error(s1, s2) < bound
    rows = torch.tensor([599, 602], device="cuda")
    slots = torch.tensor([2, 0], dtype=torch.int32, device="cuda")
    dec = (xz[rows, :width], dt[rows], A, B[rows], C[rows], Dskip, bias, xz[rows, width:])
    o1, o2 = selective_scan_decode_triton(*dec, s1, slots), selective_scan_decode_ref(*dec, s2, slots)
    assert relative_error(o1, o2) < bound and relative_error(s1, s2) < bound
