"""kernels/mla_latent_write.py: kv_a_layernorm + rope of q and k_r + the latent row's write in one kernel
(GPU, or TRITON_INTERPRET=1 on CPU) against the three reference calls it replaces: the pool's rows
(slot -1 writing nothing) and the rotated queries (a strided view of the q projection, in place)."""
from __future__ import annotations

import pytest
import torch

from kernels.attention import KV_FP8_DTYPE
from kernels.mla_latent_write import latent_rope_write_ref, latent_rope_write_triton
from kernels.rotary import build_cos_sin_cache

HEADS, RANK, ROPE, NOPE, PAGE = 5, 40, 8, 12, 4


def layer_inputs(seed: int, dtype):
    """(generator, q (3, H, N + P), kv (3, R + P), norm weight, positions, rope table, slots (one -1))."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(3, HEADS, NOPE + ROPE, generator=gen).to(dtype)
    kv = torch.randn(3, RANK + ROPE, generator=gen).to(dtype)
    weight = (1 + 0.1 * torch.randn(RANK, generator=gen)).to(dtype)
    cos_sin = build_cos_sin_cache(64, ROPE, 10000.0, None, "cpu")
    return gen, q, kv, weight, torch.tensor([7, 0, 30]), cos_sin, torch.tensor([9, -1, 2])


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,cache_dtype", [(torch.float32, None), (torch.bfloat16, None),
                                               (torch.bfloat16, KV_FP8_DTYPE)])
def test_one_launch_equals_norm_rotary_and_write(device, dtype, cache_dtype):
    if device != "cuda" and dtype != torch.float32:
        pytest.skip("the interpreter runs float32 here; bf16 and the FP8 pool on a GPU")
    gen, q, kv, weight, positions, cos_sin, slots = layer_inputs(5, dtype)
    want_cache = torch.zeros(4, PAGE, RANK + ROPE, dtype=cache_dtype or dtype)
    want_q = latent_rope_write_ref(q[..., NOPE:].clone(), kv, weight, 1e-6, positions, cos_sin, want_cache, slots)
    q_dev, kv_dev, cache = q.to(device), kv.to(device), torch.zeros_like(want_cache, device=device)
    out = latent_rope_write_triton(q_dev[..., NOPE:], kv_dev, weight.to(device), 1e-6, positions.to(device),
                                   cos_sin.to(device), cache, slots.to(device))
    assert out.data_ptr() == q_dev[..., NOPE:].data_ptr()  # rotated in place; the nope part untouched
    torch.testing.assert_close(q_dev[..., :NOPE].cpu(), q[..., :NOPE])
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(out.cpu().float(), want_q.float(), **tol)
    torch.testing.assert_close(cache.cpu().float(), want_cache.float(), **tol)  # slot -1: nothing written


@pytest.mark.gpu
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_w_uk_product_in_the_same_launch(device, dtype):
    """latent_rope_write_absorb's launch: the rows' write and rope as above, and q_latent = q_nope @ W_UK
    per head (kernels/head_matmul.py's tiles as more programs of the grid) equal to the reference calls."""
    if device != "cuda" and dtype != torch.float32:
        pytest.skip("the interpreter runs float32 here; bf16 on a GPU")
    from kernels.head_matmul import head_matmul_ref

    gen, q, kv, weight, positions, cos_sin, slots = layer_inputs(6, dtype)
    w_uk = (torch.randn(HEADS, NOPE, RANK, generator=gen) * NOPE ** -0.5).to(dtype)
    want_cache = torch.zeros(4, PAGE, RANK + ROPE, dtype=dtype)
    want_q = latent_rope_write_ref(q[..., NOPE:].clone(), kv, weight, 1e-6, positions, cos_sin, want_cache, slots)
    want_latent = head_matmul_ref(q[..., :NOPE], w_uk)
    q_dev, cache = q.to(device), torch.zeros_like(want_cache, device=device)
    q_rope, q_latent = latent_rope_write_triton(q_dev[..., NOPE:], kv.to(device), weight.to(device), 1e-6,
                                                positions.to(device), cos_sin.to(device), cache, slots.to(device),
                                                q_dev[..., :NOPE], w_uk.to(device))
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(q_rope.cpu().float(), want_q.float(), **tol)
    torch.testing.assert_close(cache.cpu().float(), want_cache.float(), **tol)
    torch.testing.assert_close(q_latent.cpu().float(), want_latent.float(), **tol)
