"""Block-FP8 products at decode rows on the skinny kernel, activations unquantized (kernels/fp8_block_skinny.py):
the reference against a block-by-block float64 accumulation (CPU), the kernel against the reference at 1, 2, 8
and 16 rows with partial row and column blocks, split-K on and off, swapped operands and balanced tiles (GPU, or
Triton's CPU interpreter with TRITON_INTERPRET=1: float16 there, whose bf16 dots are wrong, kernel_testing), and
on CUDA fp8_block_linear's routing of a marked weight, a CUDA-graph replay and the load-time choice.

Tolerances (||kernel - reference|| / ||reference||): both multiply the same E4M3 weight values (exact in bf16/fp16)
by the same unquantized rows with the same block scales in float32 and differ only in the order of accumulation
and the one rounding to the output dtype: kernel_testing.TOLERANCE per dtype."""
from __future__ import annotations

import pytest
import torch
from kernel_testing import TOLERANCE, relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage, stack_bytes

from kernels.fp8_block import BLOCK, dequantize_blocks, fp8_block_linear, fp8_block_linear_ref, quantize_blocks
from kernels.fp8_block_skinny import (BITS_VARIANTS, VARIANT_ATTR, fp8_block_skinny_ref, fp8_block_skinny_triton,
                                      skinny_options, skinny_variant)

# N = 300, K = 320: 3 x 3 scale blocks, the last row block 44 features and the last column block 64 columns.
N, K = 300, 320
TILINGS = {
    "plain": (16, 256, 4, 4),  # one split; K steps of two 128-column blocks, the second step's second block empty
    "split_k": (32, 128, 4, 6, 4),  # three splits of one block each (split_k 4 asks more than there are blocks)
    "swap_ab_split_k": (64, 256, 4, 4, 2, 1),  # the weight tile first in the dot; two splits, the second partial
    # 3 features a program on 132 SMs (on more, fewer): programs start at program_id * 3, so one tile holds
    # features 126-128, two row blocks with their own scales
    "balanced": (64, 128, 4, 6, 1, 1, 1),
    # BITS: the tiles widened by bits (kernels/e4m3_bits.py; PTX on the GPU, the same bits in float32 on the
    # interpreter), split-K and swapped operands
    "bits_split_k": (16, 256, 4, 4, 2, 0, 0, 1),
    "bits_swap_ab": (64, 128, 4, 6, 1, 1, 0, 1),
    "bits_balanced": (64, 128, 4, 6, 1, 1, 1, 1),
}


def randn(*shape, seed, scale=1.0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed)) * scale


def block_weight(seed: int = 3):
    """(E4M3 codes (N, K), block scales (3, 3)) of a weight with blocks of very different magnitudes, so that a
    scale applied to the wrong block shows."""
    weight = randn(N, K, seed=seed, scale=K**-0.5)
    weight[:128, 128:256] *= 50.0
    weight[256:, 256:] *= 0.01
    return quantize_blocks(weight)


def test_reference_is_the_blockwise_float32_product_of_unquantized_rows():
    """y = sum over K blocks of s_w * (x . w_q over the block) + bias, x as it is (no E4M3 rounding):
    more exact than the W8A8 block scheme, whose activation rounding costs ~2-3% here."""
    x, bias = randn(5, K, seed=1), randn(N, seed=2)
    w_q, w_scale = block_weight()
    expected = torch.zeros(5, N, dtype=torch.float64)
    for b in range(-(-K // BLOCK)):
        cols = slice(b * BLOCK, (b + 1) * BLOCK)
        scale = w_scale[:, b].repeat_interleave(BLOCK)[:N].double()
        expected += (x[:, cols].double() @ w_q[:, cols].double().T) * scale
    out = fp8_block_skinny_ref(x, w_q, w_scale, bias)
    assert relative_error(out, expected + bias.double()) < 1e-6
    exact = x.double() @ dequantize_blocks(w_q, w_scale).double().T + bias.double()
    assert relative_error(out, exact) < 1e-6 < relative_error(fp8_block_linear_ref(x, w_q, w_scale, bias), exact)


@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16])
@pytest.mark.parametrize("tiling", sorted(TILINGS))
def test_kernel_equals_reference(device, rows, tiling):
    w_q, w_scale = (t.to(device) for t in block_weight())
    for dtype in (torch.bfloat16, torch.float16) if device == "cuda" else (torch.float16,):
        x, bias = randn(rows, K, seed=rows).to(device, dtype), randn(N, seed=7).to(device, dtype)
        with_bias = tiling != "plain"  # both epilogues: with and without a bias
        out = fp8_block_skinny_triton(x, w_q, w_scale, bias if with_bias else None,
                                      **skinny_options(TILINGS[tiling]))
        assert out.dtype == dtype and out.shape == (rows, N)
        expected = fp8_block_skinny_ref(x.cpu(), w_q.cpu(), w_scale.cpu(), bias.cpu() if with_bias else None)
        assert relative_error(out, expected) < TOLERANCE[dtype], (tiling, dtype)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="fp8_block_linear runs Triton on CUDA tensors only")
def test_a_marked_weight_takes_the_kernel_at_decode_rows_only_and_replays_from_a_cuda_graph():
    """fp8_block_linear with a weight marked as choose_fp8_block_skinny marks it: up to 16 rows (3-D input too)
    the kernel's values, the activations unquantized; 17 rows and an unmarked weight the W8A8 block GEMM."""
    w_q, w_scale = (t.cuda() for t in block_weight())
    x = randn(2, 3, K, seed=4).cuda().bfloat16()
    unquantized = fp8_block_skinny_ref(x.reshape(6, K), w_q, w_scale).reshape(2, 3, N)
    assert relative_error(fp8_block_linear(x, w_q, w_scale), fp8_block_linear_ref(x, w_q, w_scale)) < 1e-2
    setattr(w_q, VARIANT_ATTR, TILINGS["split_k"])
    assert skinny_variant(x.reshape(6, K), w_q) == TILINGS["split_k"]
    out = fp8_block_linear(x, w_q, w_scale)
    kernel = fp8_block_skinny_triton(x.reshape(6, K), w_q, w_scale, **skinny_options(TILINGS["split_k"]))
    assert out.shape == (2, 3, N) and torch.equal(out.reshape(6, N), kernel)
    assert relative_error(out, unquantized) < TOLERANCE[torch.bfloat16]
    assert skinny_variant(randn(17, K, seed=5).cuda().bfloat16(), w_q) is None
    assert skinny_variant(randn(4, K, seed=5).cuda(), w_q) is None  # float32 rows keep the block GEMM
    rows = torch.zeros(4, K, device="cuda", dtype=torch.bfloat16)
    fp8_block_linear(rows, w_q, w_scale)  # (compiled outside the capture)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fp8_block_linear(rows, w_q, w_scale)
    rows.copy_(randn(4, K, seed=6))
    graph.replay()
    assert relative_error(out, fp8_block_skinny_ref(rows, w_q, w_scale)) < TOLERANCE[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the choice times kernels on CUDA")
def test_load_time_choice_marks_each_weight_with_its_report(monkeypatch):
    """Two candidate tilings (the full list costs a compile each): the report has both paths' timings at 1 and 8
    rows, and the weight carries the report's verdict (a candidate where it won at both, else False)."""
    from kernels import fp8_block_choice, fp8_block_skinny

    from kernels.fp8_block_skinny import BITS_ENV

    monkeypatch.setenv("TRITONLLM_KERNEL_CHOICE_CACHE", "off")
    monkeypatch.setenv(BITS_ENV, "0")  # (the two tilings alone)
    monkeypatch.setattr(fp8_block_skinny, "SKINNY_BLOCK_VARIANTS", (TILINGS["plain"], TILINGS["split_k"]))
    w_q, _ = (t.cuda() for t in block_weight())
    report = fp8_block_choice.choose_fp8_block_skinny([w_q, w_q.clone()], torch.bfloat16)
    assert list(report) == [(N, K)]
    chosen = report[(N, K)]
    assert set(chosen["block_gemm_us"]) == set(chosen["best_us"]) == {1, 8}
    assert set(chosen["variant_us"]) == {TILINGS["plain"], TILINGS["split_k"]}
    assert chosen["variant"] in (False, TILINGS["plain"], TILINGS["split_k"])
    assert getattr(w_q, VARIANT_ATTR) == chosen["variant"]
    assert fp8_block_choice.choose_fp8_block_skinny([w_q], torch.float32) == {}  # float32 rows: not this kernel


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="every tiling compiled for the GPU (slow interpreted)")
def test_every_load_time_tiling_is_correct():
    """Each candidate the load may choose, at 1 and 16 rows with a bias: a tiling that compiles but indexes
    wrongly on the device would otherwise only show as wrong tokens."""
    from kernels.fp8_block_skinny import SKINNY_BLOCK_VARIANTS

    w_q, w_scale = (t.cuda() for t in block_weight())
    bias = randn(N, seed=7).cuda().bfloat16()
    for rows in (1, 16):
        x = randn(rows, K, seed=rows).cuda().bfloat16()
        expected = fp8_block_skinny_ref(x, w_q, w_scale, bias)
        for variant in SKINNY_BLOCK_VARIANTS:
            out = fp8_block_skinny_triton(x, w_q, w_scale, bias, **skinny_options(variant))
            assert relative_error(out, expected) < TOLERANCE[torch.bfloat16], (variant, rows)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="compiled for the GPU (the interpreter runs two BITS cases)")
@pytest.mark.parametrize("variant", BITS_VARIANTS)
def test_every_bits_tiling_is_correct(variant):
    """Each BITS candidate (the PTX widening) at 1 and 16 rows with a bias, bf16 and fp16 rows."""
    w_q, w_scale = (t.cuda() for t in block_weight())
    for dtype in (torch.bfloat16, torch.float16):
        bias = randn(N, seed=7).cuda().to(dtype)
        for rows in (1, 16):
            x = randn(rows, K, seed=rows).cuda().to(dtype)
            out = fp8_block_skinny_triton(x, w_q, w_scale, bias, **skinny_options(variant))
            assert relative_error(out, fp8_block_skinny_ref(x, w_q, w_scale, bias)) < TOLERANCE[dtype], (dtype, rows)


def test_bits_variants_are_candidates_unless_switched_off(monkeypatch):
    """The load-time choice times the BITS tilings by default, beside one of Triton's widening;
    $TRITONLLM_FP8_BLOCK_BITS=0 leaves them out and times every plain tiling."""
    from kernels.fp8_block_skinny import (BITS_ENV, PLAIN_BESIDE_BITS, SKINNY_BLOCK_VARIANTS, bits_variants,
                                          candidate_variants)

    monkeypatch.delenv(BITS_ENV, raising=False)
    assert bits_variants() == BITS_VARIANTS and all(skinny_options(v)["bits"] for v in BITS_VARIANTS)
    assert candidate_variants() == PLAIN_BESIDE_BITS + BITS_VARIANTS
    assert set(PLAIN_BESIDE_BITS) <= set(SKINNY_BLOCK_VARIANTS) and len(set(BITS_VARIANTS)) == len(BITS_VARIANTS)
    monkeypatch.setenv(BITS_ENV, "0")
    assert bits_variants() == () and candidate_variants() == SKINNY_BLOCK_VARIANTS


# ---- ahead of time for sm_90 on the CPU (TRITONLLM_AOT_SM90=1) ---------------------------------

@AOT_SM90
@pytest.mark.parametrize("dtype", ["*bf16", "*fp16"])
@pytest.mark.parametrize("variant", BITS_VARIANTS)
def test_bits_variants_compile_for_sm90_without_spills(variant, dtype, tmp_path):
    """Triton's compiler and ptxas (no GPU) on the kernel as a BITS variant's launch specializes it (Qwen3-30B-A3B's
    qkv at one row): the PTX widening compiles, no local memory."""
    from kernels.fp8_block_skinny import _fp8_block_skinny_kernel

    options = skinny_options(variant)
    pointers = dict(x_ptr=dtype, w_ptr="*fp8e4nv", s_ptr="*fp32", bias_ptr=dtype, out_ptr=dtype, part_ptr="*fp32",
                    arrivals_ptr="*i32")
    const = dict(HAS_BIAS=False, SWAP_AB=options["swap_ab"], M_PAD=16, BLOCK_N=options["block_n"],
                 SUB_BLOCKS=options["block_k"] // BLOCK, SCALE_K=BLOCK, SPLIT_K=options["split_k"], BALANCED=False,
                 PDL=True, BITS=True, ASM=True)
    compiled = compile_for_sm90(_fp8_block_skinny_kernel, pointers, const, warps=options["num_warps"],
                                stages=options["num_stages"], aligned_int=lambda name: name not in ("M", "ROWS"))
    assert "prmt.b32" in compiled.asm["ptx"] and "cvt.rn.f16x2.e4m3x2" not in compiled.asm["ptx"]
    usage = resource_usage(compiled, tmp_path)
    if usage is not None:
        assert "LOCAL:0 " in usage and stack_bytes(usage) <= 8, usage
