"""kernels/mxfp4_gemv.py's word path for MXFP4 experts at 1-8 tokens: the formula variant (Triton's CPU
interpreter, TRITON_INTERPRET=1, or the GPU) and the inline-PTX variant (CUDA only) against moe_gemv_ref on the
experts widened exactly, routed in the prepare launch or given, with gpt-oss's biases and clamped SwiGLU; the
activation pair slots; what the path supports; an sm_90 compile without spills (TRITONLLM_AOT_SM90=1).

Tolerances (||kernel - reference|| / ||reference||, module docstring of kernels/mxfp4_gemv.py): float32 on the
interpreter: the activations rounded once to float16 (2^-12 relative) in both products, float32 sums: 2e-3 (the
inline PTX on float32 activations: 5e-3, its 8-product float16 sums ~1e-3);
bf16 on the GPU: the products and 4-word sums in float16 besides the reference's own bf16 roundings: 1e-2 (as
tests/kernels/test_moe_gemv.py's bf16 bound)."""
from __future__ import annotations


import pytest
import torch
from kernel_testing import relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage, stack_bytes
from test_fused_moe_mxfp4 import problem

from kernels.fused_moe import route_tokens_ref
from kernels.fused_moe_mxfp4 import prepare_mxfp4_experts
from kernels.moe_epilogue import ExpertEpilogue
from kernels.moe_gemv import moe_gemv_ref
from kernels.mxfp4_gemv import (SWEEP_TILES, WORD_TILES, down_shift, is_word_mark, mxfp4_words_triton, word_mark,
                                word_path_supported)

# K % 64 == 0 in both products; rows of 40 and 8 words, not multiples of 16 (as gpt-oss's 360: Triton specializes
# no divisibility for them, so the kernels must state the rows' 16-byte alignment themselves)
HIDDEN, INTER, EXPERTS, TOP_K = 320, 64, 8, 2
LIMIT = 0.4  # (small: the clamp bites on these products)
TILES = ((16, 2, 2), (32, 1, 2))  # HIDDEN 320: 5 groups a side, 2 full steps and a masked one; INTER 64: one group
TOLERANCES = {torch.float32: 2e-3, torch.bfloat16: 1e-2}
ASM_FLOAT32 = 5e-3  # float32 activations through the inline PTX: its float16 sums (~1e-3) besides the rounding


def gpt_oss_problem(num_tokens: int, *, seed: int, dtype=torch.float32, hidden: int = HIDDEN, inter: int = INTER):
    """x, logits, the experts in the kernel layout and widened (float32), the epilogue (kernel's, reference's)."""
    x, logits, gate_up_stored, down_stored, (gu_bias, d_bias) = problem(num_tokens, hidden, inter, EXPERTS, seed=seed)
    widened = [prepare_mxfp4_experts(*stored, torch.float32, for_kernel=False).dense
               for stored in (gate_up_stored, down_stored)]
    kernel = [prepare_mxfp4_experts(*stored, torch.float32, for_kernel=True).kernel
              for stored in (gate_up_stored, down_stored)]
    epilogue = ExpertEpilogue(gu_bias.to(dtype), d_bias.to(dtype), "swiglu_clamped", LIMIT)
    ref_epilogue = ExpertEpilogue(gu_bias.to(dtype).float(), d_bias.to(dtype).float(), "swiglu_clamped", LIMIT)
    return x.to(dtype), logits.to(dtype), kernel, widened, epilogue, ref_epilogue


def on(device, *tensors):
    return [t.to(device) for t in tensors]


def variants(device: str) -> list[bool]:
    """The asm variants that run here: the formula's everywhere, the inline PTX on CUDA only."""
    return [False, True] if device == "cuda" else [False]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3, 8])
def test_words_equal_the_widened_reference(device, num_tokens):
    """Routed in the prepare launch (unsummed rows, the routing's ids in the reference's order), both variants."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, logits, kernel, widened, epilogue, ref_epilogue = gpt_oss_problem(num_tokens, seed=90, dtype=dtype)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref = moe_gemv_ref(x.float(), *widened, weights, ids, epilogue=ref_epilogue)
    codes = [on(device, k["codes"], k["scales"]) for k in kernel]
    on_device = ExpertEpilogue(*on(device, epilogue.gate_up_bias, epilogue.down_bias), "swiglu_clamped", LIMIT)
    assert word_path_supported(x, codes[0][0], codes[0][1], on_device)
    for asm in variants(device):
        out = mxfp4_words_triton(x.to(device), codes[0][0], codes[1][0], codes[0][1], codes[1][1], top_k=TOP_K,
                                 epilogue=on_device, router_logits=logits.to(device), renormalize=True, tiles=TILES,
                                 sum_experts=False, asm=asm)
        assert out.shape == (num_tokens, TOP_K, HIDDEN) and out.dtype == dtype
        assert relative_error(out, ref) < TOLERANCES[dtype], asm
    # the clamp and biases matter: a plain-SiLU reference is far off
    assert relative_error(out, moe_gemv_ref(x.float(), *widened, weights, ids)) > 0.1


@pytest.mark.gpu
@pytest.mark.parametrize("options", ["", "fp"])
def test_given_routing_other_tiles_and_the_sum(device, options):
    """Routing given, several groups a step (H 320: 5 groups a side, 4 a step: a full step and a masked one; I 192:
    3 groups, 4 a step: a masked one), the rows summed over the K experts: by torch after the down launch, or ("f")
    inside it, each program summing its token's experts; "p": the codes prefetched a step ahead. Tiles among
    SWEEP_TILES (their asm packs checked by the sm_90 compile test)."""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, logits, kernel, widened, epilogue, ref_epilogue = gpt_oss_problem(2, seed=91, dtype=dtype, hidden=320, inter=192)
    weights, ids = route_tokens_ref(logits, TOP_K, False)
    ref = moe_gemv_ref(x.float(), *widened, weights, ids, epilogue=ref_epilogue).sum(dim=1)
    codes = [on(device, k["codes"], k["scales"]) for k in kernel]
    on_device = ExpertEpilogue(*on(device, epilogue.gate_up_bias, epilogue.down_bias), "swiglu_clamped", LIMIT)
    for asm in variants(device):
        out = mxfp4_words_triton(x.to(device), codes[0][0], codes[1][0], codes[0][1], codes[1][1], top_k=TOP_K,
                                 epilogue=on_device, topk_weights=weights.to(device), topk_ids=ids.to(device),
                                 tiles=((16, 4, 4, options.replace("f", "")), (32, 4, 4, options)), asm=asm)
        assert out.shape == (2, 320) and relative_error(out, ref) < TOLERANCES[dtype], asm


@pytest.mark.gpu
def test_split_folded_launches_and_the_last_arrivals_sum(device):
    """Splits over K (the tile option's digit: H 128 and I 128 are 2 groups a side, so 3 splits leave one empty)
    whose last arrival finishes the tile, and down's "r": the last of a token tile's K * splits arrivals sums its
    experts (no summing launch); then other activations through splits without "r" (unsummed rows; the first
    call's arrival counters are back at 0), and "r" without splits over the given routing. (Tiles of 128 rows: few
    programs on the interpreter.)"""
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    x, logits, kernel, widened, epilogue, ref_epilogue = gpt_oss_problem(1, seed=94, dtype=dtype, hidden=128,
                                                                         inter=128)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    codes = [on(device, k["codes"], k["scales"]) for k in kernel]
    on_device = ExpertEpilogue(*on(device, epilogue.gate_up_bias, epilogue.down_bias), "swiglu_clamped", LIMIT)
    routed = dict(router_logits=logits.to(device), renormalize=True)
    given = dict(topk_weights=weights.to(device), topk_ids=ids.to(device))
    for x_call, tiles, sum_experts, routing in ((x, ((128, 1, 4, "2"), (128, 1, 4, "r3")), True, routed),
                                                (-2 * x, ((128, 1, 4, "p3"), (128, 1, 4, "2")), False, routed),
                                                (x / 4, ((128, 1, 4), (128, 1, 4, "r")), True, given)):
        ref = moe_gemv_ref(x_call.float(), *widened, weights, ids, epilogue=ref_epilogue)
        out = mxfp4_words_triton(x_call.to(device), codes[0][0], codes[1][0], codes[0][1], codes[1][1], top_k=TOP_K,
                                 epilogue=on_device, tiles=tiles, sum_experts=sum_experts, asm=device == "cuda",
                                 **routing)
        ref = ref.sum(dim=1) if sum_experts else ref
        assert out.shape == ref.shape and relative_error(out, ref) < TOLERANCES[dtype], tiles


@pytest.mark.gpu
def test_large_and_small_activations_keep_their_precision(device):
    """x spanning 2^-20..2^20 in one token and 2^-30 in another: each row's own 2^p keeps float16 in range
    (no inf, no flush of a small row)."""
    x, logits, kernel, widened, epilogue, ref_epilogue = gpt_oss_problem(2, seed=92)
    x[0] *= torch.pow(2.0, torch.linspace(-20, 20, HIDDEN))
    x[1] *= 2.0 ** -30
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref = moe_gemv_ref(x, *widened, weights, ids, epilogue=ref_epilogue)
    codes = [on(device, k["codes"], k["scales"]) for k in kernel]
    on_device = ExpertEpilogue(*on(device, epilogue.gate_up_bias, epilogue.down_bias), "swiglu_clamped", LIMIT)
    for asm in variants(device):
        out = mxfp4_words_triton(x.to(device), codes[0][0], codes[1][0], codes[0][1], codes[1][1], top_k=TOP_K,
                                 epilogue=on_device, router_logits=logits.to(device), renormalize=True, tiles=TILES,
                                 sum_experts=False, asm=asm)
        for t in range(2):
            assert relative_error(out[t], ref[t]) < (ASM_FLOAT32 if asm else TOLERANCES[torch.float32]), (asm, t)


def test_support_and_marks():
    """The clamped SwiGLU bounds down's activations (its 2^p); silu does not (unsupported); K % 64 on both sides;
    uint8 exponents (not 4-bit grouped float32 scales); a mark's form."""
    x = torch.zeros(1, 128)
    codes, scales = torch.zeros(EXPERTS, 128, 64, dtype=torch.uint8), torch.zeros(EXPERTS, 4, 128, dtype=torch.uint8)
    clamped = ExpertEpilogue(activation="swiglu_clamped", swiglu_limit=7.0)
    assert down_shift(clamped) == 13 - 5  # |act| <= 7 * 8 = 56 < 2^6
    assert word_path_supported(x, codes, scales, clamped)
    assert not word_path_supported(x, codes, scales, ExpertEpilogue())  # silu: unbounded
    assert not word_path_supported(x, codes, scales.float(), clamped)
    assert not word_path_supported(torch.zeros(9, 128), codes, scales, clamped)
    assert not word_path_supported(x, torch.zeros(EXPERTS, 2 * 48, 64, dtype=torch.uint8), scales, clamped)
    mark = word_mark(((16, 4, 4), (32, 4, 4)))
    assert is_word_mark(mark) and is_word_mark(list(mark)) and not is_word_mark(((16, 512, 4, 2), (16, 256, 4, 2)))


# ---- ahead of time for sm_90 on the CPU (TRITONLLM_AOT_SM90=1) ---------------------------------

AOT = AOT_SM90


# (gate_up's; down's alike): Triton specializes those % 16 == 0
GPT_OSS_ARGS = dict(I=2880, H=2880, half_words=360, stride_we=5760 * 360, stride_wn=360, stride_se=90 * 5760,
                    stride_be=5760, stride_o=2880)


def compile_sm90(which: str, tiles: tuple, asm: bool = True):
    """gpt-oss-20b's launch (H = I = 2880, top 4 of 32, biases, clamped SwiGLU 7) compiled for sm_90, with the
    divisibility Triton's launcher would find in its arguments (a row is 360 words: not a multiple of 16)."""
    from kernels.mxfp4_gemv import _words_down_kernel, _words_gate_up_kernel, tile_split

    fn = _words_gate_up_kernel if which == "gate_up" else _words_down_kernel
    block_n, groups, warps, *options = tiles
    options = (options or [""])[0]
    pointers = dict(pairs_ptr="*i32", inv_ptr="*fp32", ids_ptr="*i32", weights_ptr="*fp32", w_ptr="*i32",
                    s_ptr="*u8", bias_ptr="*bf16", act_pairs_ptr="*fp16" if which == "gate_up" else "*i32",
                    x_ptr="*bf16", out_ptr="*bf16", part_ptr="*fp32", arrivals_ptr="*i32")  # (down: the pairs as words)
    const = dict(DOWN_SCALE=256.0, INV_SCALE=1 / 256, TOP_K=4, BLOCK_N=block_n, GROUPS=groups, HAS_BIAS=True,
                 ACTIVATION=1, SWIGLU_LIMIT=7.0, ASM=asm, PDL=True, FOLD="f" in options, PREFETCH="p" in options,
                 REDUCE="r" in options, SPLIT=tile_split(options))
    return compile_for_sm90(fn, pointers, const, warps=warps,
                            aligned_int=lambda name: GPT_OSS_ARGS.get(name, 1) % 16 == 0)


def asm_packs(llir: str) -> list[list[str]]:
    """Each inline-asm call's operand values (LLVM IR): outputs aside, 7 inputs x 4 elements."""
    calls = [line for line in llir.splitlines() if "fma.rn.f16x2" in line and " asm " in line]
    return [[v.strip().split()[-1] for v in call.rsplit('"(', 1)[1].split(")")[0].split(",")] for call in calls]


@AOT
@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("tiles", SWEEP_TILES)
def test_compiles_for_sm90_without_spills(which, tiles, tmp_path):
    """Triton's compiler and ptxas (no GPU), every candidate: the inline PTX assembles, no local memory."""
    if which == "gate_up" and "f" in (tiles[3:] or ("",))[0]:
        pytest.skip("summing the experts in the launch is down's option")
    compiled = compile_sm90(which, tiles)
    assert "fma.rn.f16x2" in compiled.asm["ptx"]
    # each pack of 4 words is one thread's 16-byte load of one row's scale group: one factor pair for all 4, and
    # 128-bit code loads (with rows of 360 words, as gpt-oss's, which Triton does not specialize)
    packs = asm_packs(compiled.asm["llir"])
    assert packs and all(len(set(p[20:24])) == 1 and len(set(p[24:28])) == 1 and len(set(p[0:4])) == 4 for p in packs)
    assert ".v4.b32" in compiled.asm["ptx"] or "ld.global.v4" in compiled.asm["ptx"]
    usage = resource_usage(compiled, tmp_path)
    if usage is not None:
        assert "LOCAL:0 " in usage and stack_bytes(usage) <= 8, usage


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the choice and the dispatch run on CUDA tensors only")
@pytest.mark.parametrize("words", ["1", "0"])
def test_choice_times_the_word_path_and_its_mark_dispatches(words, monkeypatch, tmp_path):
    """gpt-oss's experts listed as GptOssExperts.gemv_experts lists them: the choice times the word path beside
    moe_gemv's pair at 1, 2, 4, 8 tokens (not with $TRITONLLM_MXFP4_WORDS=0: the old paths alone) and checks it
    against the grouped path (a disagreeing word path is never marked); a forced word
    mark makes moe_forward_mxfp4 give the word path's summed rows, equal to the widened reference, also replayed
    from a CUDA graph. Two word candidates, two of moe_gemv's (its first alone where the word path is timed)."""
    from kernels import choice_cache, moe_gemv_choice
    from kernels.fused_moe_mxfp4 import moe_forward_mxfp4
    from kernels.moe_decode_tiles import choose_decode_tiles
    from kernels.moe_gemv import GEMV_TILES, GemvExperts, gemv_tiles, mark_gemv
    from kernels.mxfp4_gemv import WORDS_ENV

    monkeypatch.setenv(choice_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(WORDS_ENV, words)
    monkeypatch.setattr(moe_gemv_choice, "candidate_tiles", lambda kind: GEMV_TILES[:2])
    monkeypatch.setattr(moe_gemv_choice, "WORD_TILES", WORD_TILES[1:])  # (plain and "r2": both kinds of down)
    x, logits, gate_up_stored, down_stored, (gu_bias, d_bias) = problem(3, 320, 192, EXPERTS, seed=93)
    kernel = [prepare_mxfp4_experts(*[t.cuda() for t in stored], torch.bfloat16, for_kernel=True)
              for stored in (gate_up_stored, down_stored)]
    dense = [prepare_mxfp4_experts(*stored, torch.float32, for_kernel=False).dense.cuda()
             for stored in (gate_up_stored, down_stored)]
    gu_bias, d_bias = gu_bias.to("cuda", torch.bfloat16), d_bias.to("cuda", torch.bfloat16)
    epilogue = ExpertEpilogue(gu_bias, d_bias, "swiglu_clamped", LIMIT)
    entry = GemvExperts(kernel[0].kernel["codes"], kernel[1].kernel["codes"], TOP_K, torch.bfloat16,
                        kernel[0].kernel["scales"], kernel[1].kernel["scales"], mxfp4=tuple(kernel), epilogue=epilogue)
    (report,) = [r for key, r in choose_decode_tiles([entry]).items() if key[0] == "gemv"]
    assert set(report["tiles"]) == {1, 2, 4, 8}
    if words == "0":
        assert "words_us" not in report and not any(is_word_mark(t) for t in report["tiles"].values())
        return
    assert set(report["words_us"]) == {1, 2, 4, 8} and all(us > 0 for us in report["words_us"].values())
    assert all(diff < moe_gemv_choice.WORDS_AGREEMENT for diff in report["words_rel_diff"].values())
    # a word path that disagrees with the grouped path is never marked, however fast
    monkeypatch.setattr(moe_gemv_choice, "words_difference", lambda *args: float("nan"))
    monkeypatch.setenv(choice_cache.CACHE_ENV, str(tmp_path / "again"))
    (again,) = [r for key, r in choose_decode_tiles([entry]).items() if key[0] == "gemv"]
    assert not any(is_word_mark(t) for t in again["tiles"].values())
    for tokens, tiles in again["tiles"].items():  # the marks are the last choice's
        assert (gemv_tiles(entry.gate_up, tokens) == tiles) if tiles else gemv_tiles(entry.gate_up, tokens) is None
    mark_gemv(entry.gate_up, {t: word_mark(((16, 2, 2), (32, 1, 2))) for t in (1, 2, 4, 8)})
    x, logits = x.to("cuda", torch.bfloat16), logits.to("cuda", torch.bfloat16)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref_epilogue = ExpertEpilogue(gu_bias.float(), d_bias.float(), "swiglu_clamped", LIMIT)
    ref = moe_gemv_ref(x.float(), *dense, weights, ids, epilogue=ref_epilogue).sum(dim=1)

    def run():
        return moe_forward_mxfp4(x, logits, *kernel, TOP_K, True, gate_up_bias=gu_bias, down_bias=d_bias,
                                 activation="swiglu_clamped", swiglu_limit=LIMIT)

    assert relative_error(run(), ref) < TOLERANCES[torch.bfloat16]
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = run()
    out.zero_()
    graph.replay()
    torch.cuda.synchronize()
    assert relative_error(out, ref) < TOLERANCES[torch.bfloat16]
