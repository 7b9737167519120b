"""kernels/window_attention.py: rotary and attention within runs, read from a fused qkv product, against the
plain-torch reference (rotary as kernels/rotary.py's, SDPA per run). Runs of several lengths in a shuffled order,
one token in no run (left unwritten), head_dim 80 (not a power of two, as Qwen2.5-VL's tower) and 8 (halves padded
to the dot's 16), 3 heads, one and two heads a program (the last program's second head past the count), 4 and 8
warps, and no rotary table."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip

from kernels.window_attention import TILING_ENV, window_attention_ref, window_attention_triton

HEADS, HEAD_DIM = 3, 80
LENGTHS = [16, 9, 16, 4, 12]  # runs in token order; token 57 belongs to none
ORDER = [2, 0, 4, 1, 3]  # the order the runs are passed in


def runs(device):
    starts = torch.tensor([0, 16, 25, 41, 45])[ORDER]
    return starts.to(device), torch.tensor(LENGTHS)[ORDER].to(device)


def rotary_table(tokens: int, device, head_dim: int = HEAD_DIM) -> torch.Tensor:
    angles = torch.randn(tokens, head_dim // 2, generator=torch.Generator().manual_seed(3)) * 4
    return torch.cat([angles.cos(), angles.sin()], dim=-1).to(device)


@pytest.mark.parametrize("tiling, head_dim", [("1,4", 80), ("2,8", 80), ("1,4", 8)])
def test_window_attention_equals_rotary_then_attention_per_run(device, monkeypatch, tiling, head_dim):
    monkeypatch.setenv(TILING_ENV, tiling)
    tokens = 58
    starts, lengths = runs(device)
    covered = torch.zeros(tokens, dtype=torch.bool)
    for start, n in zip(starts.tolist(), lengths.tolist()):
        covered[start:start + n] = True
    for dtype in low_precision_dtypes(device):
        wide = torch.randn(tokens, 3 * HEADS * head_dim + 16, generator=torch.Generator().manual_seed(1)).to(dtype)
        qkv = wide.to(device)[:, :3 * HEADS * head_dim]  # a row stride past the width
        for table in (rotary_table(tokens, device, head_dim), None):
            want = window_attention_ref(qkv.cpu().float(), HEADS, None if table is None else table.cpu(),
                                        starts.cpu(), lengths.cpu())
            got = window_attention_triton(qkv, HEADS, table, starts, lengths, max(LENGTHS)).cpu()
            assert got.shape == (tokens, HEADS * head_dim) and got.dtype == dtype
            assert relative_error(got[covered], want[covered]) < TOLERANCE[dtype]


def test_window_attention_refuses_long_runs_and_bad_tables():
    qkv = torch.zeros(8, 3 * HEADS * HEAD_DIM)
    starts, lengths = torch.tensor([0]), torch.tensor([8])
    with pytest.raises(ValueError, match="runs of up to"):
        window_attention_triton(qkv, HEADS, None, starts, lengths, 256)
    with pytest.raises(ValueError, match="float32 rows"):
        window_attention_triton(qkv, HEADS, torch.zeros(8, HEAD_DIM, dtype=torch.float16), starts, lengths, 8)


@AOT_SM90
@pytest.mark.parametrize("per_program, warps", [(1, 4), (2, 8)])
def test_window_kernel_compiles_for_sm90_without_spills(per_program, warps, tmp_path):
    """Triton's compiler and ptxas (no GPU) on the kernel at the 7B tower's shape (16 heads of 80, windows of 64
    patches) with rotary: no local memory (spills)."""
    from kernels.window_attention import _window_attention_kernel

    pointers = dict(qkv_ptr="*bf16", out_ptr="*bf16", table_ptr="*fp32", starts_ptr="*i64", lengths_ptr="*i64")
    const = dict(HEADS=16, HEAD_DIM=80, HALF_PAD=64, BLOCK=64, HEADS_PER_PROGRAM=per_program, ROTARY=True,
                 PRECISION="tf32")
    compiled = compile_for_sm90(_window_attention_kernel, pointers, const, warps=warps, stages=1, floats=("qk_scale",),
                                aligned_int=lambda name: name.startswith("stride") and name != "stride_table")
    usage = resource_usage_or_skip(compiled, tmp_path)
    assert "LOCAL:0 " in usage, usage
