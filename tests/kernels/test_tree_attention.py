"""Token-tree attention (AttentionMetadata.tree_mask, tree verification): the Triton kernel against
the paged reference, on a batch mixing a tree, a prompt chunk (causal rows) and a decode row.
Runs on CUDA, or on CPU with TRITON_INTERPRET=1 (kernel_testing.triton_device)."""
from __future__ import annotations

import random

import pytest
import torch
from kernel_testing import TOLERANCE, low_precision_dtypes, relative_error
from test_kernel_attention import make_batch

from engine.executor.tree_batch import tree_mask
from kernels.attention import paged_attention_ref, write_kv_cache_ref
from kernels.triton_attention import paged_attention_triton
from kernel_testing import triton_device

DEVICE = triton_device()


def random_parents(n: int, rng: random.Random) -> list[int]:
    return [-1] + [rng.randrange(0, j) for j in range(1, n)]


def use_short_step_tiling(tiling: str, monkeypatch) -> None:
    """$TRITONLLM_SHORT_STEP_TILING for the short-step tests' shape (4 query heads a KV head of 32, a
    16-bit pool): "short" its own tiling, "prefill" (unset) the prompt chunk's, the default."""
    from kernels.triton_attention import SHORT_STEP_TILING_ENV, _prefill_config, _short_step_config

    if tiling == "short":
        monkeypatch.setenv(SHORT_STEP_TILING_ENV, "short")
        assert _short_step_config(4, 32, 2) == (64, 32, 8, 3)
    else:
        monkeypatch.delenv(SHORT_STEP_TILING_ENV, raising=False)
        assert _short_step_config(4, 32, 2) == _prefill_config(4, 32, 2)[:4]


def test_tree_bits_hold_the_mask_a_bit_a_key():
    """AttentionMetadata.tree_bits: bit k of word w of row t is mask[t, 32 w + k], the same from the host's
    numpy packing and the device's torch one."""
    from kernels.attention_metadata import pack_tree_mask, pack_tree_mask_torch

    gen = torch.Generator().manual_seed(2)
    for width in (1, 31, 32, 33, 65, 90):
        mask = torch.rand(7, width, generator=gen) > 0.5
        bits = pack_tree_mask(mask)
        assert bits.dtype == torch.int32 and bits.shape == (7, -(-width // 32))
        unpacked = (bits.to(torch.int64)[:, :, None] >> torch.arange(32)) & 1
        assert torch.equal(unpacked.reshape(7, -1)[:, :width].bool(), mask)
        assert not unpacked.reshape(7, -1)[:, width:].any()
        assert torch.equal(pack_tree_mask_torch(mask), bits)
        if torch.cuda.is_available():
            assert torch.equal(pack_tree_mask(mask.cuda()).cpu(), bits)


@pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("heads,mask_form", [((4, 2, 16), "bits"), ((4, 2, 16), "bytes"), ((9, 3, 64), "bits"),
                                             ((9, 3, 64), "bytes")])
def test_tree_mask_kernel_equals_reference(heads, mask_form, monkeypatch):
    """``mask_form``: the kernel reads meta.tree_bits (what the engine's steps pass) or the mask's bytes.
    With bits, wrong bits change the answer (they are what is read) unless $TRITONLLM_TREE_BITS=0."""
    from kernels.attention_metadata import pack_tree_mask
    from kernels.triton_attention import TREE_BITS_ENV

    num_heads, num_kv_heads, head_dim = heads
    rng = random.Random(0)
    # (cached, new): a 90-node tree after 45 cached tokens (several query tiles), a causal 7-token chunk, a decode row,
    # and a tree of 5 nodes after an empty prefix
    cases = [(45, 90), (5, 7), (30, 1), (0, 5)]
    parents = [random_parents(90, rng), None, None, random_parents(5, rng)]
    for dtype in low_precision_dtypes(DEVICE):
        k, v, k_cache, v_cache, meta = make_batch(cases, num_kv_heads, head_dim, 8, dtype, DEVICE)
        write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
        meta.tree_mask = tree_mask([n for _, n in cases], parents).to(DEVICE)
        if mask_form == "bits":
            meta.tree_bits = pack_tree_mask(meta.tree_mask)
        q = torch.randn(meta.cu_seqlens_q_host[-1], num_heads, head_dim, generator=torch.Generator().manual_seed(1))
        q = q.to(dtype).to(DEVICE)
        want = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5)
        if mask_form == "bytes":  # the reference reads the mask as the decode graphs stage it (int8) as the bool one
            as_bool, meta.tree_mask = meta.tree_mask, meta.tree_mask.to(torch.int8)
            assert torch.equal(paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5), want)
            meta.tree_mask = as_bool
        got = paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5)
        assert relative_error(got, want) < TOLERANCE[dtype]
        if mask_form == "bits" and heads == (4, 2, 16):
            meta.tree_bits = pack_tree_mask(meta.tree_mask.roll(1, 0))  # each row another row's ancestors
            assert relative_error(paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5)[:90],
                                  want[:90]) > 10 * TOLERANCE[dtype]
            monkeypatch.setenv(TREE_BITS_ENV, "0")
            got = paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5)
            assert relative_error(got, want) < TOLERANCE[dtype]
            monkeypatch.delenv(TREE_BITS_ENV)
        # the tree changed the answer (a wrong kernel could not pass as a causal one)
        meta.tree_mask = None
        causal = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5)
        assert relative_error(causal[:90], want[:90]) > 10 * TOLERANCE[dtype]


@pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("tile_map_form,one_launch,tiling", [(False, True, "prefill"), (True, True, "prefill"),
                                                             (True, False, "prefill"), (True, True, "short")])
def test_short_tree_step_splits_its_keys_and_matches_reference(tile_map_form, one_launch, tiling, monkeypatch):
    """A verify step's shape: a 16-node tree over a 300-token context, a decode row and a 3-token chunk.
    Few prefill tiles, so one launch over every sequence with its keys split (_short_step_splits),
    merged per token; the tree's masked keys lie in the last split. Also in a CUDA graph's form
    (a tile map with unused entries and a sequence row past the batch; the mask as bits, as the tree
    graphs pass it), and with the decode row in its own launch after the split one (a step that could
    hold many one-token rows). ``tiling`` short: the opt-in 32-key tiles over 8 warps (_short_step_config)."""
    use_short_step_tiling(tiling, monkeypatch)
    if not one_launch:
        monkeypatch.setattr("kernels.triton_attention.SHORT_STEP_ONE_LAUNCH", 0)
    from engine.executor.prefill_graphs import tile_map
    from kernels.attention_metadata import AttentionMetadata, pack_tree_mask
    from kernels.triton_attention import _short_step_splits, prefill_tokens_per_tile

    num_heads, num_kv_heads, head_dim = 8, 2, 32
    cases = [(300, 16), (200, 1), (100, 3)]
    parents = [random_parents(16, random.Random(3)), None, None]
    dtype = low_precision_dtypes(DEVICE)[0]
    k, v, k_cache, v_cache, meta = make_batch(cases, num_kv_heads, head_dim, 16, dtype, DEVICE, seed=5)
    write_kv_cache_ref(k, v, k_cache, v_cache, meta.slot_mapping)
    meta.tree_mask = tree_mask([n for _, n in cases], parents).to(DEVICE)
    q = torch.randn(20, num_heads, head_dim, generator=torch.Generator().manual_seed(6)).to(dtype).to(DEVICE)
    want = paged_attention_ref(q, k_cache, v_cache, meta, head_dim ** -0.5)
    per_tile = prefill_tokens_per_tile(num_heads // num_kv_heads, head_dim, k_cache.element_size(), k_cache.device)
    if tile_map_form:
        tile_seq, tile_m = tile_map([16, 1, 3, 0], per_tile, 6)
        cu = meta.cu_seqlens_q_host + [20]
        table = meta.block_tables
        meta = AttentionMetadata(
            slot_mapping=meta.slot_mapping, cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=DEVICE),
            block_tables=torch.cat([table, torch.zeros(1, table.shape[1], dtype=table.dtype, device=DEVICE)]),
            context_lens=torch.tensor(meta.context_lens_host + [0], dtype=torch.int32, device=DEVICE),
            max_seqlen_q=20, max_context_len=2048, is_decode_only=False, tree_mask=meta.tree_mask,
            tree_bits=pack_tree_mask(meta.tree_mask),
            tile_seq=torch.from_numpy(tile_seq).to(DEVICE), tile_m=torch.from_numpy(tile_m).to(DEVICE),
            tile_tokens=per_tile)
    assert _short_step_splits(3 * num_kv_heads, 3 * num_kv_heads, 20, meta.max_context_len, 64, 132) >= 2
    got = paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5)
    assert relative_error(got, want) < TOLERANCE[dtype]


def test_short_step_splits_cover_the_gpu_within_their_bounds():
    """Batch-1 Llama-8B verify step (16 tokens, one tile for each of 8 KV heads): 16 splits over a graph's
    4,096 keys, 4 over 512; no more programs than the GPU holds at once (two an SM); none from
    SHORT_STEP_PROGRAMS programs, for long rows of partials or huge grids."""
    from kernels.triton_attention import SHORT_STEP_PROGRAMS, _short_step_splits

    assert _short_step_splits(8, 16, 16, 4096, 64, 132) == 16
    assert _short_step_splits(8, 16, 16, 512, 64, 132) == 4
    assert _short_step_splits(40, 48, 65, 736, 64, 132) == 4  # 64 nodes: 5 tiles a KV head, 160 programs
    assert _short_step_splits(16, 24, 17, 736, 64, 132) == 8  # 16 nodes: 2 tiles a KV head, 128 programs
    assert _short_step_splits(64, 64, 64, 4096, 64, 132) == 4  # a batch-4 step of 16-token trees
    assert _short_step_splits(SHORT_STEP_PROGRAMS, SHORT_STEP_PROGRAMS, 256, 4096, 64, 132) == 1
    assert _short_step_splits(8, 16, 1000, 4096, 64, 132) == 1
    assert _short_step_splits(8, 8000, 16, 4096, 64, 132) == 1


@pytest.mark.skipif(DEVICE is None, reason="needs CUDA or TRITON_INTERPRET=1")
@pytest.mark.parametrize("rotate,tiling", [(True, "prefill"), (False, "prefill"), (True, "short")])
def test_short_tree_step_rotating_and_appending_in_the_launch_equals_the_two_kernels(rotate, tiling, monkeypatch):
    """A short step of one tile a sequence (short_step_appends) passes q, k unrotated: the split launch
    rotates each row at its own position (a tree's positions go by depth) and writes each new key from
    the split holding it. Output and pool equal rotary_and_write_kv (or write_kv_cache) + attention.
    ``tiling`` short: the opt-in 32-key tiles over 8 warps (_short_step_config)."""
    use_short_step_tiling(tiling, monkeypatch)
    from kernels.rotary import build_cos_sin_cache, rotary_and_write_kv_ref
    from kernels.triton_attention import prefill_tokens_per_tile, short_step_appends

    num_heads, num_kv_heads, head_dim = 8, 2, 32
    cases = [(300, 16), (200, 1), (100, 3)]
    parents = [random_parents(16, random.Random(4)), None, None]
    dtype = low_precision_dtypes(DEVICE)[0]
    k, v, k_cache, v_cache, meta = make_batch(cases, num_kv_heads, head_dim, 16, dtype, DEVICE, seed=8)
    meta.tree_mask = tree_mask([n for _, n in cases], parents).to(DEVICE)
    if rotate:  # the tree graphs' form: the mask as bits too
        from kernels.attention_metadata import pack_tree_mask
        meta.tree_bits = pack_tree_mask(meta.tree_mask)
    depth = [0] * 16
    for node in range(1, 16):
        depth[node] = depth[parents[0][node]] + 1
    positions = torch.tensor([300 + d for d in depth] + [200, 100, 101, 102], device=DEVICE)
    q = torch.randn(20, num_heads, head_dim, generator=torch.Generator().manual_seed(9)).to(dtype).to(DEVICE)
    cos_sin = build_cos_sin_cache(512, head_dim, 10000.0, device=DEVICE) if rotate else None
    k_ref, v_ref = k_cache.clone(), v_cache.clone()
    if rotate:
        q_ref = rotary_and_write_kv_ref(q.clone(), k, v, positions, cos_sin, k_ref, v_ref, meta.slot_mapping)
    else:
        q_ref = q
        write_kv_cache_ref(k, v, k_ref, v_ref, meta.slot_mapping)
    want = paged_attention_ref(q_ref, k_ref, v_ref, meta, head_dim ** -0.5)
    assert short_step_appends(q, k_cache, meta)
    got = paged_attention_triton(q, k_cache, v_cache, meta, head_dim ** -0.5, new_kv=(k, v, positions, cos_sin))
    assert relative_error(got, want) < TOLERANCE[dtype]
    assert relative_error(k_cache, k_ref) < TOLERANCE[dtype] and torch.equal(v_cache, v_ref)
    # a sequence of two tiles (16 tokens a tile, 32 on sm_90): another tile's program would read keys this one writes
    meta.max_seqlen_q = prefill_tokens_per_tile(num_heads // num_kv_heads, head_dim, 2, q.device) + 1
    assert not short_step_appends(q, k_cache, meta)
