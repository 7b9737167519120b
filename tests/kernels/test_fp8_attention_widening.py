"""FP8 pools' decode attention widens E4M3 K/V to float16 in one of kernels/triton_attention.py's FP8_WIDENINGS
($TRITONLLM_ATTN_FP8_BITS): Triton's conversion, V by bits (value * 2^-8, multiplied back at the end), K and V by
bits, V by the conversion unit in its loaded layout. Every one widens to the same values (powers of two, nothing
near float32's subnormals), over every E4M3 code (subnormals, +-0, +-448) and queries from tiny to past fp16's
range: the interpreter's outputs are equal bit for bit; on the GPU an MMA's k-order may differ between the
operand layouts (H200: 2 bf16 outputs in 12,288 one rounding apart), so there they agree within 1e-3; each is
within the dots' rounding of the torch reference.

On CPU under TRITON_INTERPRET=1 (the bits by float32 arithmetic: e4m3_bits' ASM=False) and on CUDA (inline PTX).
The sm_90 compiles (TRITONLLM_AOT_SM90=1) check what the variants are for: no byte-wise shared-memory loads
(LDS.U8) for V and no spills, in the decode tilings _decode_tiling chooses for Llama-8B heads."""
from __future__ import annotations

import subprocess
from pathlib import Path

import pytest
import torch

from kernels.attention import KV_FP8_DTYPE, paged_attention_ref
from kernel_testing import TOLERANCE, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage_or_skip, strides_but_block_table
from test_kernel_attention import make_batch

triton_attention = pytest.importorskip("kernels.triton_attention")
WIDENINGS = list(triton_attention.FP8_WIDENINGS)
# The new key ends a page (16), starts one (17), is the only key (1), lies deep in the last split (299).
BATCH = [(0, 1), (15, 1), (16, 1), (298, 1), (40, 1)]
HEADS, KV_HEADS, HEAD_DIM, PAGE = 8, 2, 32, 16


def every_code_pool(shape, seed: int, device: str = "cpu") -> torch.Tensor:
    """A pool of random E4M3 codes (all but NaN) whose first page also holds every extreme of each sign: 448,
    the smallest subnormal 2^-9, the largest subnormal 7 * 2^-9, the smallest normal 2^-6 and zero. Made on
    ``device`` by its own generator: the Llama-heads cases' pools (800 contexts of ~800 keys, 0.6 G codes each)
    took ~40 s of a suite worker's CPU."""
    gen = torch.Generator(device).manual_seed(seed)
    codes = torch.randint(0, 256, shape, generator=gen, dtype=torch.int32, device=device)
    codes = torch.where(codes % 128 == 127, codes - 1, codes)  # 0x7F / 0xFF are NaN: 448 instead
    extremes = torch.tensor([0x7E, 0x01, 0x07, 0x08, 0x00], device=device)
    extremes = torch.cat([extremes, extremes | 0x80])
    flat = codes.view(-1)
    flat[:extremes.numel()] = extremes
    pool = codes.to(torch.uint8).view(KV_FP8_DTYPE)
    assert torch.isfinite(pool.float()).all()
    return pool


def fp8_decode_case(device: str, seed: int, q_scale: float, kv_heads: int = KV_HEADS, heads: int = HEADS,
                    head_dim: int = HEAD_DIM, batch=BATCH):
    k, v, k_cache, v_cache, meta = make_batch(batch, kv_heads, head_dim, PAGE, torch.bfloat16, device, seed=seed,
                                              fill_pool=False)
    k_cache = every_code_pool(k_cache.shape, seed + 1, device)
    v_cache = every_code_pool(v_cache.shape, seed + 2, device)
    q = torch.randn(len(batch), heads, head_dim, generator=torch.Generator().manual_seed(seed + 3)) * q_scale
    return q.to(torch.bfloat16).to(device), k, v, k_cache, v_cache, meta


def assert_same(out: torch.Tensor, base: torch.Tensor, what: str) -> None:
    """Bit for bit under the interpreter; within 1e-3 (a few one-rounding differences) on the GPU (module docstring)."""
    if out.is_cuda:
        assert relative_error(out, base) < 1e-3, (what, relative_error(out, base))
    else:
        assert torch.equal(out, base), what


def by_each_widening(monkeypatch, run) -> dict[str, torch.Tensor]:
    outs = {}
    for widening in WIDENINGS:
        monkeypatch.setenv(triton_attention.FP8_WIDEN_ENV, widening)
        outs[widening] = run()
    return outs


@pytest.mark.parametrize("num_splits", [1, 4])
@pytest.mark.parametrize("q_scale", [0.02, 1e-6, 1e5])
def test_decode_is_the_same_whichever_way_e4m3_widens(device, monkeypatch, num_splits, q_scale):
    """Decode over every E4M3 code, whole and split: each widening's output equals Triton's conversion's bit for bit,
    for queries whose scores are O(1) (0.02 against codes up to 448), whose fp16 copies are subnormal (1e-6) or
    saturate at 65504 (1e5); at O(1) scores it is also the reference's, within bf16's rounding."""
    q, _, _, k_cache, v_cache, meta = fp8_decode_case(device, 7, q_scale)
    scale = HEAD_DIM**-0.5
    outs = by_each_widening(monkeypatch, lambda: triton_attention.paged_attention_triton(
        q, k_cache, v_cache, meta, scale, num_splits=num_splits))
    for widening, out in outs.items():
        assert torch.isfinite(out).all(), widening
        assert_same(out, outs["0"], widening)
    if q_scale == 0.02:
        ref = paged_attention_ref(q, k_cache, v_cache, meta, scale)
        assert relative_error(outs["0"], ref) < TOLERANCE[torch.bfloat16]


def test_subnormal_values_come_out_as_themselves(device, monkeypatch):
    """Every V of the pool the smallest E4M3 subnormal (2^-9, 2^-17 as V's bits): every row's output is 2^-9
    whatever the scores (a softmax-weighted mean of equal values; within fp16 p's and bf16's rounding), in each
    widening alike: nothing flushed to zero."""
    q, _, _, k_cache, v_cache, meta = fp8_decode_case(device, 11, 0.02)
    v_cache = torch.full_like(v_cache.view(torch.uint8), 0x01).view(KV_FP8_DTYPE)
    outs = by_each_widening(monkeypatch, lambda: triton_attention.paged_attention_triton(
        q, k_cache, v_cache, meta, HEAD_DIM**-0.5, num_splits=2))
    for widening, out in outs.items():
        assert_same(out, outs["0"], widening)
        assert ((out.float() * 2**9 - 1).abs() < 1e-2).all(), widening


@pytest.mark.parametrize("num_splits", [None, 4])
def test_rotary_append_decode_is_the_same_whichever_way_e4m3_widens(device, monkeypatch, num_splits):
    """The served form (kernels/rope_attention.py: q and the new k rotated, the new K/V written in the kernel, read
    back by the split that holds it): the same cache bytes and output bit for bit in each widening."""
    from kernels.rotary import build_cos_sin_cache

    q, k, v, k_cache, v_cache, meta = fp8_decode_case(device, 13, 0.02)
    positions = (meta.context_lens - 1).long()
    cos_sin = build_cos_sin_cache(1024, HEAD_DIM, 500000.0, device=device)
    k = k * 40  # new keys past +-448 saturate (cache_value)
    caches = {}

    def run():
        k_pool, v_pool = k_cache.clone(), v_cache.clone()
        out = triton_attention.paged_attention_triton(q, k_pool, v_pool, meta, HEAD_DIM**-0.5, num_splits=num_splits,
                                                      new_kv=(k, v, positions, cos_sin))
        caches[len(caches)] = (k_pool.view(torch.uint8), v_pool.view(torch.uint8))
        return out

    outs = by_each_widening(monkeypatch, run)
    for i, (widening, out) in enumerate(outs.items()):
        assert_same(out, outs["0"], widening)
        assert torch.equal(caches[i][0], caches[0][0]) and torch.equal(caches[i][1], caches[0][1]), widening
    assert not torch.equal(caches[0][0], k_cache.view(torch.uint8))  # the new keys were written


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="Llama-8B's heads at a long context: CUDA only")
@pytest.mark.parametrize("num_seqs", [3, 400, 800])  # the pointer walk of 64 keys, TMA's 32 x 1 x 6, 32 x 1 x 3
def test_llama_heads_decode_on_a_head_major_pool_is_the_same_whichever_way_e4m3_widens(monkeypatch, num_seqs):
    """Llama-8B's heads (32 / 8 / 128) on the runner's head-major pool, in each decode tiling _decode_tiling picks
    for an FP8 pool (TMA from 384 sequences): each widening within 1e-3 of Triton's conversion (H200, session 29
    call 4: 2 of 12,288 outputs one bf16 rounding apart) and of the reference within bf16's rounding."""
    batch = [(600 + 37 * (i % 11), 1) for i in range(num_seqs)]
    q, _, _, k_cache, v_cache, meta = fp8_decode_case("cuda", 17, 0.02, 8, 32, 128, batch)
    head_major = lambda cache: cache.transpose(1, 2).contiguous().transpose(1, 2)  # noqa: E731
    k_cache, v_cache = head_major(k_cache), head_major(v_cache)
    outs = by_each_widening(monkeypatch, lambda: triton_attention.paged_attention_triton(
        q, k_cache, v_cache, meta, 128**-0.5))
    ref = paged_attention_ref(q, k_cache, v_cache, meta, 128**-0.5)
    report = {widening: differences(out, outs["0"], ref) for widening, out in outs.items()}
    for widening, out in outs.items():
        assert relative_error(out, outs["0"]) < 1e-3 and relative_error(out, ref) < 1e-2, report


def differences(out: torch.Tensor, base: torch.Tensor, ref: torch.Tensor) -> str:
    """How ``out`` differs from ``base`` (the "0" widening's) and from the reference: a failure's message."""
    unequal = (out != base).sum().item()
    return (f"{'equal' if unequal == 0 else f'{unequal} of {out.numel()} unequal'} (max |diff| "
            f"{(out.float() - base.float()).abs().max().item():.3g}), relative error {relative_error(out, ref):.3g}, "
            f"finite {bool(torch.isfinite(out).all())}")


def test_the_default_widens_by_tiling_and_an_unknown_widening_is_refused(monkeypatch):
    """Unset or "auto": V by the conversion in its loaded layout for 64-key tiles (faster on the H200), Triton's
    own widening for 32-key ones (slower there); a name not in FP8_WIDENINGS is a clear error."""
    monkeypatch.delenv(triton_attention.FP8_WIDEN_ENV, raising=False)
    assert triton_attention.fp8_widening(64) == triton_attention.FP8_WIDENINGS["vcvt"]
    assert triton_attention.fp8_widening(32) == triton_attention.FP8_WIDENINGS["0"]
    monkeypatch.setenv(triton_attention.FP8_WIDEN_ENV, "v")
    assert triton_attention.fp8_widening(32) == triton_attention.FP8_WIDENINGS["v"]
    monkeypatch.setenv(triton_attention.FP8_WIDEN_ENV, "bits")
    with pytest.raises(ValueError, match="TRITONLLM_ATTN_FP8_BITS='bits': one of 0, v, kv, vcvt, auto"):
        triton_attention.fp8_widening(64)


def _sass(compiled, tmp_path: Path) -> str:
    import triton

    cubin = Path(tmp_path) / "kernel.cubin"
    cubin.write_bytes(compiled.asm["cubin"])
    cuobjdump = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump"
    return subprocess.run([str(cuobjdump), "-sass", str(cubin)], capture_output=True, text=True).stdout


@AOT_SM90
@pytest.mark.parametrize("widening", WIDENINGS)
@pytest.mark.parametrize("tiling", [(64, 2, 5, False), (32, 1, 6, True), (32, 1, 3, False)])
def test_decode_widenings_compile_for_sm90(widening, tiling, tmp_path):
    """Llama-8B's decode kernel over an FP8 pool (group 4, 128 dims, page 32), each tiling of _decode_tiling for
    16-row tiles, in each widening: V by bits or by the conversion kept in its loaded layout never reads shared
    memory a byte at a time (Triton's own widening, V's operand read across its rows, does: LDS.U8), and
    spills nothing."""
    block_n, warps, stages, tma = tiling
    k_bits, v_widen = triton_attention.FP8_WIDENINGS[widening]
    pointers = {name: "*bf16" for name in ("q_ptr", "out_ptr", "k_new_ptr", "v_new_ptr", "q_norm_ptr", "k_norm_ptr",
                                           "sinks_ptr", "alibi_ptr")}
    pointers.update({name: "*fp8e4nv" for name in ("k_cache_ptr", "v_cache_ptr", "k_desc", "v_desc")})
    if tma:
        pointers.update({name: f"tensordesc<fp8e4nv[{block_n}, 128]>" for name in ("k_desc", "v_desc")})
    pointers.update({name: "*fp32" for name in ("part_out_ptr", "part_lse_ptr", "cos_sin_ptr")})
    pointers.update({name: "*i32" for name in ("block_tables_ptr", "cu_seqlens_q_ptr", "context_lens_ptr",
                                               "tile_seq_ptr", "tile_m_ptr", "active_splits_ptr", "span_ptr",
                                               "tree_ptr")})
    pointers.update(positions_ptr="*i64", slot_ptr="*i64")
    const = dict(GROUP=4, HEAD_DIM=128, DIM_PAD=128, PAGE_SIZE=32, BLOCK_M=16, BLOCK_N=block_n, NUM_SPLITS=1,
                 PRECISION="tf32", FP16_MATH=True, ROTARY_APPEND=True, ROTATE=True, HAS_WINDOW=False,
                 HAS_SOFTCAP=False, HAS_TILE_MAP=False, HAS_SINKS=False, HAS_ALIBI=False, SEQ_KIND=0, TMA=tma,
                 DYNAMIC_SPLITS=False, PDL=False, HAS_TREE=False, TREE_AS_BITS=False, HAS_SPANS=False,
                 APPEND_ROWS=False, QK_NORM=False, K_BITS=k_bits, V_WIDEN=v_widen, ASM=True)
    compiled = compile_for_sm90(triton_attention._paged_attention_kernel, pointers, const, warps=warps, stages=stages,
                                floats=("qk_scale", "softcap_log2", "qk_eps", "temp_scale"),
                                aligned_int=strides_but_block_table)
    usage = resource_usage_or_skip(compiled, tmp_path)
    byte_loads = _sass(compiled, tmp_path).count("LDS.U8")
    if v_widen == triton_attention.V_BY_TRITON:
        assert byte_loads > 0  # (what the other widenings are for)
    else:
        assert byte_loads == 0
    if widening in ("v", "vcvt"):  # (Triton's own widening and "kv" take up to 255 registers and some stack)
        assert "LOCAL:0 " in usage and "STACK:0 " in usage, usage
