"""kernels/moe_gemv.py's GEMV launches for decode-sized routed experts: the kernels against their reference at
1, 2, 4 and 8 tokens in the model dtype, FP8 per channel and FP8 128 x 128 blocks, routed in the kernel or
given (GPU, or Triton's CPU interpreter with TRITON_INTERPRET=1); the reference against the grouped path's
references (the model dtype: the same products; FP8: the grouped path's W8A8 within an E4M3 step); the marks
and the dispatch; the load-time choice (CUDA only); an sm_90 compile (TRITONLLM_AOT_SM90=1).

Tolerances (||kernel - reference|| / ||reference||): the same float32 products in another order, the
activation and each expert's row rounded to the model dtype in both; 1e-5 in float32 (the interpreter), 1e-2
in bf16."""
from __future__ import annotations


import pytest
import torch
from kernel_testing import relative_error
from sm90_compile import AOT_SM90, compile_for_sm90, resource_usage, stack_bytes
from test_moe_decode import distinct_logits, randn
from test_moe_decode import experts as moe_decode_experts

from kernels.fused_moe import fused_moe_ref, route_tokens_ref
from kernels.fused_moe_fp8 import fused_moe_fp8_ref
from kernels.moe_decode_tiles import choose_decode_tiles
from kernels.moe_gemv import (AHEAD, BLOCK_SCALES, ONE_LOAD, STEP_SUMS, GEMV_ATTR, GEMV_TILES, INT4_GROUPS, MAX_TOKENS, MXFP4_GROUPS, NO_SCALES,
                              ROW_SCALES, WIDE_STEP_TILES, GemvExperts, candidate_tiles, gemv_supported, gemv_tiles, mark_gemv, moe_gemv_ref,
                              moe_gemv_triton)

HIDDEN, INTER, EXPERTS, TOP_K = 256, 128, 8, 2
TILES = ((64, 128, 8, 2), (64, 128, 8, 2))  # few programs: the interpreter's time
TOLERANCES = {torch.float32: 1e-5, torch.bfloat16: 1e-2, torch.float16: 2e-3}


def experts(kind: str, *, seed: int):
    """(gate_up, gate_up_scale, down, down_scale) of this file's shape on the CPU (test_moe_decode's)."""
    return moe_decode_experts(kind, HIDDEN, INTER, EXPERTS, seed=seed)


@pytest.mark.parametrize("kind", ["model", "fp8_channel", "fp8_block"])
def test_reference_against_the_grouped_references(kind):
    """8 tokens: model dtype equals fused_moe_ref (the same float32 products); FP8 lies within an E4M3 step of
    the grouped path's W8A8 reference (fused_moe_fp8_ref quantizes x and the SwiGLU output, this does not)."""
    gate_up, gu_s, down, d_s = experts(kind, seed=1)
    x = randn(MAX_TOKENS, HIDDEN, seed=2)
    weights, ids = route_tokens_ref(distinct_logits(MAX_TOKENS, EXPERTS, seed=3), TOP_K, True)
    out = moe_gemv_ref(x, gate_up, down, weights, ids, gu_s, d_s).sum(dim=1)
    if kind == "model":
        assert relative_error(out, fused_moe_ref(x, gate_up, down, weights, ids)) < 1e-5
    else:
        assert relative_error(out, fused_moe_fp8_ref(x, gate_up, gu_s, down, d_s, weights, ids)) < 0.06


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 2, 4, MAX_TOKENS])
@pytest.mark.parametrize("kind", ["model", "fp8_channel", "fp8_block"])
def test_kernel_equals_reference(device, num_tokens, kind):
    """Routed in the gate_up launch (the ids / weights it stores are the reference routing's), unsummed rows."""
    if kind != "fp8_block" and num_tokens in (2, 4) and device != "cuda":
        pytest.skip("in the interpreter, block FP8 alone at 2 and 4 tokens (its time)")
    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gate_up, gu_s, down, d_s = experts(kind, seed=10)
    if kind == "model":
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    x = randn(num_tokens, HIDDEN, seed=11).to(dtype)
    logits = distinct_logits(num_tokens, EXPERTS, seed=12).to(dtype)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref = moe_gemv_ref(x, gate_up, down, weights, ids, gu_s, d_s)
    on = [t.to(device) if t is not None else None for t in (x, logits, gate_up, gu_s, down, d_s)]
    out = moe_gemv_triton(on[0], on[2], on[4], top_k=TOP_K, router_logits=on[1], renormalize=True,
                          gate_up_scale=on[3], down_scale=on[5], tiles=TILES, sum_experts=False)
    assert out.shape == (num_tokens, TOP_K, HIDDEN)
    assert relative_error(out, ref) < TOLERANCES[dtype]


def int4_experts(*, seed: int, group: int = 64):
    """(gate_up, down) WNA16Experts pairs of this file's shape, 4 bits in groups of ``group``: (kernel layout,
    dequantized float32)."""
    from kernels.fused_moe_wna16 import prepare_wna16_experts
    from kernels.wna16 import quantize

    gate_up, _, down, _ = experts("model", seed=seed)
    stored = [quantize(w, 4, group, symmetric=False) for w in (gate_up, down)]
    return ([prepare_wna16_experts(*w, 4, torch.float32, for_kernel=True) for w in stored],
            [prepare_wna16_experts(*w, 4, torch.float32, for_kernel=False).dense for w in stored])


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, MAX_TOKENS])
def test_int4_experts_equal_the_dequantized_reference(device, num_tokens):
    """4-bit codes in kernels/fused_moe_wna16.py's kernel layout (groups of 64: two a row's half), routed in the
    kernel: the reference on the dequantized experts (float32 here: the same products)."""
    from kernels.fused_moe_wna16 import gemv_quantization

    (gate_up, down), (gate_up_dense, down_dense) = int4_experts(seed=60)
    x = randn(num_tokens, HIDDEN, seed=61)
    logits = distinct_logits(num_tokens, EXPERTS, seed=62)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref = moe_gemv_ref(x, gate_up_dense, down_dense, weights, ids)
    quantization = {k: v.to(device) for k, v in gemv_quantization(gate_up, down).items()}
    out = moe_gemv_triton(x.to(device), gate_up.kernel["weight"].to(device), down.kernel["weight"].to(device),
                          top_k=TOP_K, router_logits=logits.to(device), renormalize=True, tiles=TILES,
                          sum_experts=False, **quantization)
    assert relative_error(out, ref) < TOLERANCES[torch.float32]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens", [1, 3])
@pytest.mark.parametrize("activation", ["silu", "swiglu_clamped"])
def test_mxfp4_experts_with_biases_equal_the_widened_reference(device, num_tokens, activation):
    """MXFP4 experts (gpt-oss) in kernels/fused_moe_mxfp4.py's kernel layout, with both biases (the down bias on
    the expert's row before its routing weight) and silu or the clamped SwiGLU, routed in the kernel: the
    reference on the experts widened exactly (float32: the same products in another order)."""
    from test_fused_moe_mxfp4 import problem

    from kernels.fused_moe_mxfp4 import prepare_mxfp4_experts
    from kernels.moe_epilogue import ExpertEpilogue

    hidden, inter = 128, 64  # K % 64 == 0 for both products (the kernel layout unpadded)
    x, logits, gate_up_stored, down_stored, (gu_bias, d_bias) = problem(num_tokens, hidden, inter, EXPERTS, seed=70)
    limit = 0.4 if activation == "swiglu_clamped" else None  # (small: the clamp bites on these products)
    epilogue = ExpertEpilogue(gu_bias, d_bias, activation, limit)
    widened = [prepare_mxfp4_experts(*stored, torch.float32, for_kernel=False).dense
               for stored in (gate_up_stored, down_stored)]
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref = moe_gemv_ref(x, *widened, weights, ids, epilogue=epilogue)
    kernel = [prepare_mxfp4_experts(*[t.to(device) for t in stored], torch.float32, for_kernel=True).kernel
              for stored in (gate_up_stored, down_stored)]
    on_device = ExpertEpilogue(gu_bias.to(device), d_bias.to(device), activation, limit)
    tiles = ((32, 64, 4, 2), (32, 32, 4, 2))
    assert gemv_supported(x, kernel[0]["codes"], kernel[0]["scales"], kernel[1]["scales"], tiles=tiles,
                          epilogue=epilogue)
    out = moe_gemv_triton(x.to(device), kernel[0]["codes"], kernel[1]["codes"], top_k=TOP_K,
                          router_logits=logits.to(device), renormalize=True, tiles=tiles, sum_experts=False,
                          gate_up_scale=kernel[0]["scales"], down_scale=kernel[1]["scales"], epilogue=on_device)
    assert relative_error(out, ref) < TOLERANCES[torch.float32]
    if activation == "swiglu_clamped":  # the clamp and the biases matter: a plain-SiLU reference is far off
        assert relative_error(out, moe_gemv_ref(x, *widened, weights, ids)) > 0.1


def test_mxfp4_support_needs_unpadded_halves_and_a_gated_activation():
    """gemv_supported for MXFP4 experts: K a multiple of 64 in both products (no layout padding), groups of 32,
    and a gated activation (relu2 experts are not gated)."""
    from kernels.moe_epilogue import ExpertEpilogue

    x = torch.zeros(1, 128)
    codes, scales = torch.zeros(EXPERTS, 128, 64, dtype=torch.uint8), torch.zeros(EXPERTS, 4, 128, dtype=torch.uint8)
    down_scales = torch.zeros(EXPERTS, 2, 128, dtype=torch.uint8)
    assert gemv_supported(x, codes, scales, down_scales, tiles=((32, 64, 4, 2), (32, 32, 4, 2)))
    assert not gemv_supported(x, codes, scales, down_scales, tiles=((32, 64, 4, 2), (32, 32, 4, 2)),
                              epilogue=ExpertEpilogue(activation="relu2"))
    narrow = torch.zeros(EXPERTS, 2 * 48, 64, dtype=torch.uint8)  # I = 48: its down half would be padded
    assert not gemv_supported(x, narrow, scales[:, :, :96], torch.zeros(EXPERTS, 1, 128, dtype=torch.uint8))


@pytest.mark.gpu
@pytest.mark.parametrize("kind, tiles, num_tokens", [
    ("fp8_block", ((32, 256, 8, 2), (64, 256, 8, 2)), 3),
    # one token (the interpreter's time); AHEAD: two K steps each (the carried loads); ONE_LOAD: K 256 / 128 in two
    # steps / one
    ("fp8_block", ((32, 128, 4, 1, AHEAD), (64, 64, 8, 1, AHEAD + STEP_SUMS)), 1),
    ("fp8_block", ((32, 128, 4, 1, ONE_LOAD), (64, 256, 8, 1, ONE_LOAD)), 1),
    ("model", ((32, 64, 4, 1, AHEAD), (64, 128, 8, 1, ONE_LOAD)), 1),
])
def test_given_routing_other_tiles_and_the_sum(device, kind, tiles, num_tokens):
    """Routing given (no logits), the candidates' other tiles (a narrow one and a wide K step; AHEAD tiles, which
    load each step's weights a step ahead, with STEP_SUMS scaling each step's row sums; ONE_LOAD tiles, a step's
    pieces in one load), summed rows."""
    gate_up, gu_s, down, d_s = experts(kind, seed=20)
    x = randn(num_tokens, HIDDEN, seed=21)
    weights, ids = route_tokens_ref(distinct_logits(num_tokens, EXPERTS, seed=22), TOP_K, False)
    ref = moe_gemv_ref(x, gate_up, down, weights, ids, gu_s, d_s).sum(dim=1)
    on = [t.to(device) if t is not None else None for t in (x, gate_up, gu_s, down, d_s, weights, ids)]
    assert gemv_supported(on[0], on[1], on[2], on[4], tiles=tiles)
    out = moe_gemv_triton(on[0], on[1], on[3], top_k=TOP_K, topk_weights=on[5], topk_ids=on[6], gate_up_scale=on[2],
                          down_scale=on[4], tiles=tiles)
    assert out.shape == (num_tokens, HIDDEN) and relative_error(out, ref) < TOLERANCES[torch.float32]


# (num_tokens, kind, layout, (gate_up tiles, down tiles)): block FP8 at every timed count; "qwen3": routed in the
# gate_up launch from the logits (softmax top-4 of 12, renormalized), "deepseek": top-6 ids and unnormalized weights
# given (a K that is no power of two). Hidden 200: a partial 128-column scale block and a partial last step; inter 96
# (per channel, the model dtype): a partial row tile at 64 rows. Splits of 2 and 4 over K (4 over down's one or two
# steps: empty shares).
DOT_CASES = [
    (1, "fp8_block", "deepseek", ((16, 128, 1, 4, "d4"), (16, 128, 1, 4, "d"))),
    (2, "fp8_block", "qwen3", ((16, 128, 1, 4, "d2"), (32, 128, 2, 4, "d"))),
    (4, "fp8_block", "deepseek", ((64, 128, 4, 3, "d"), (64, 128, 4, 3, "d2"))),
    (8, "fp8_block", "qwen3", ((32, 128, 2, 4, "d2"), (64, 128, 4, 3, "d"))),
    (1, "fp8_channel", "deepseek", ((64, 128, 4, 3, "d2"), (16, 64, 1, 4, "d4"))),
    (3, "model", "qwen3", ((64, 64, 4, 3, "d"), (32, 128, 2, 4, "d2"))),
    # BITS (the codes widened by bits; on the GPU also with float16 activations: its own bit pattern)
    (1, "fp8_block", "qwen3", ((16, 128, 1, 4, "db2"), (16, 128, 1, 4, "db"))),
    (4, "fp8_channel", "deepseek", ((32, 128, 2, 4, "db2"), (64, 128, 4, 3, "db"))),
    (8, "fp8_block", "deepseek", ((64, 128, 4, 3, "db"), (64, 128, 4, 3, "db2"))),
    (2, "fp8_block", "qwen3-fp16", ((16, 128, 1, 4, "db4"), (32, 128, 2, 4, "db2"))),
    # the deep BITS tiles: more pipeline stages than the K steps (hidden 200: two; inter 128: one)
    (1, "fp8_block", "qwen3", ((16, 128, 1, 9, "db"), (16, 128, 1, 7, "db"))),
    # WIDE_STEP_TILES: a step of 2 / 4 scale blocks (gate_up: one step, its second block partial; down: one block
    # and three past K), and with a split (the second share empty)
    (1, "fp8_block", "qwen3", ((16, 256, 1, 4, "db"), (16, 512, 1, 3, "db"))),
    (2, "fp8_block", "deepseek", ((16, 256, 1, 4, "db2"), (32, 256, 2, 4, "db"))),
]


@pytest.mark.gpu
@pytest.mark.parametrize("num_tokens, kind, layout, tiles", DOT_CASES)
def test_dot_tiles_equal_the_reference(device, num_tokens, kind, layout, tiles):
    """DOT tiles (tensor-core steps, split K with the last arrival summing; BITS: FP8 codes widened by bits, in PTX
    on the GPU, the same bits in float32 on the interpreter): the reference at 1-8 tokens, in bfloat16 on the GPU
    ("-fp16": float16) and float32 on the interpreter, routed in the kernel (Qwen3) or given (DeepSeek)."""
    hidden, inter = 200, 128 if kind == "fp8_block" else 96
    layout, _, x_dtype = layout.partition("-")
    num_experts, top_k = (12, 4) if layout == "qwen3" else (16, 6)
    dtype = (torch.float16 if x_dtype == "fp16" else torch.bfloat16) if device == "cuda" else torch.float32
    gate_up, gu_s, down, d_s = moe_decode_experts(kind, hidden, inter, num_experts, seed=90)
    if kind == "model":
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    x = randn(num_tokens, hidden, seed=91).to(dtype)
    logits = distinct_logits(num_tokens, num_experts, seed=92).to(dtype)
    weights, ids = route_tokens_ref(logits, top_k, layout == "qwen3")
    ref = moe_gemv_ref(x, gate_up, down, weights, ids, gu_s, d_s)
    on = [t.to(device) if t is not None else None for t in (x, logits, gate_up, gu_s, down, d_s, weights, ids)]
    assert gemv_supported(on[0], on[2], on[3], on[5], tiles=tiles)
    routing = (dict(router_logits=on[1], renormalize=True) if layout == "qwen3" else
               dict(topk_weights=on[6], topk_ids=on[7]))
    out = moe_gemv_triton(on[0], on[2], on[4], top_k=top_k, gate_up_scale=on[3], down_scale=on[5], tiles=tiles,
                          sum_experts=False, **routing)
    assert out.shape == (num_tokens, top_k, hidden) and relative_error(out, ref) < TOLERANCES[dtype]
    if device == "cuda":  # (the counters were reset by the last arrivals: a second call agrees exactly)
        again = moe_gemv_triton(on[0], on[2], on[4], top_k=top_k, gate_up_scale=on[3], down_scale=on[5],
                                tiles=tiles, sum_experts=False, **routing)
        assert torch.equal(again, out)


@pytest.mark.gpu
@pytest.mark.parametrize("kind, tiles", [
    ("model", ((64, 128, 8, 2), (64, 128, 8, 2))),
    ("fp8_channel", ((64, 128, 4, 3, "db"), (64, 128, 8, 2))),
    ("fp8_block", ((64, 128, 8, 2), (64, 128, 4, 3, "db2"))),
])
def test_shared_expert_read_in_place_equals_it_stacked(device, kind, tiles):
    """A SharedExpert (Llama 4's shared expert as the experts' extra row, read from its own tensors): rows with id E
    give exactly what the same kernels give with it stacked as expert E (torch.cat, the load-time copy this avoids),
    and the reference; the routed rows beside them are untouched. Plain and DOT tiles, each weight kind (bfloat16
    activations on the GPU, float32 in the interpreter)."""
    from kernels.moe_gemv import SharedExpert

    dtype = torch.bfloat16 if device == "cuda" else torch.float32
    gate_up, gu_s, down, d_s = experts(kind, seed=95)  # EXPERTS of them: the last is the shared one
    if kind == "model":
        gate_up, down = gate_up.to(dtype), down.to(dtype)
    routed = [t[:-1].clone() if t is not None else None for t in (gate_up, gu_s, down, d_s)]
    shared = SharedExpert(*(t[-1].clone() if t is not None else None for t in (gate_up, down, gu_s, d_s)))
    ids = torch.tensor([[2], [5], [EXPERTS - 1], [EXPERTS - 1]], dtype=torch.int32)  # [routed; shared] rows
    x = randn(4, HIDDEN, seed=96).to(dtype)
    ones = torch.ones(4, 1)
    on = lambda *tensors: [t.to(device) if t is not None else None for t in tensors]  # noqa: E731
    x_d, ids_d, ones_d, gate_up_d, gu_s_d, down_d, d_s_d = on(x, ids, ones, gate_up, gu_s, down, d_s)
    r_gate_up, r_gu_s, r_down, r_d_s = on(*routed)
    shared = SharedExpert(*on(*shared))
    assert shared.suits(r_gate_up, r_down, r_gu_s, r_d_s)
    got = moe_gemv_triton(x_d, r_gate_up, r_down, top_k=1, topk_weights=ones_d, topk_ids=ids_d, gate_up_scale=r_gu_s,
                          down_scale=r_d_s, tiles=tiles, sum_experts=False, shared_expert=shared)
    stacked = moe_gemv_triton(x_d, gate_up_d, down_d, top_k=1, topk_weights=ones_d, topk_ids=ids_d,
                              gate_up_scale=gu_s_d, down_scale=d_s_d, tiles=tiles, sum_experts=False)
    assert torch.equal(got, stacked)
    ref = moe_gemv_ref(x, routed[0], routed[2], ones, ids, routed[1], routed[3],
                       shared_expert=SharedExpert(*(t.cpu() if t is not None else None for t in shared)))
    assert torch.equal(ref, moe_gemv_ref(x, gate_up, down, ones, ids, gu_s, d_s))
    assert relative_error(got.cpu(), ref) < TOLERANCES[dtype]
    assert not shared.suits(r_gate_up, r_down[:, :, :64], r_gu_s, r_d_s)  # (a slot shape it does not have)


def test_dot_tiles_are_candidates_of_the_model_dtype_and_fp8_alone(monkeypatch):
    """DOT tiles: candidates of model-dtype and FP8 experts by default (none with $TRITONLLM_MOE_GEMV_DOT=0), not of
    4-bit codes; blocked scales need BLOCK_K <= 128 (one scale block a step); the split is the options' digits."""
    from kernels.moe_gemv import (BITS_TILES, DOT_ENV, DOT_TILES, FP8_PLAIN_TILES, WIDE_STEP_CANDIDATES, bits_tile, dot_tile,
                                  tile_split)

    monkeypatch.setenv(DOT_ENV, "0")
    assert not any(dot_tile(t) for t in candidate_tiles(BLOCK_SCALES)) and len(candidate_tiles(BLOCK_SCALES)) == 8
    monkeypatch.delenv(DOT_ENV)
    assert [t for t in candidate_tiles(NO_SCALES) if dot_tile(t)] == list(DOT_TILES)
    assert {t for t in candidate_tiles(ROW_SCALES) if dot_tile(t)} == set(BITS_TILES)  # (FP8: widened by bits alone)
    assert {t for t in candidate_tiles(BLOCK_SCALES) if dot_tile(t)} == set(BITS_TILES + WIDE_STEP_CANDIDATES)
    for kind in (ROW_SCALES, BLOCK_SCALES):
        assert {t for t in candidate_tiles(kind) if not dot_tile(t)} == set(FP8_PLAIN_TILES)  # (beside them)
    assert len([t for t in candidate_tiles(NO_SCALES) if not dot_tile(t)]) == 8  # (model dtype: every plain tile)
    assert all(bits_tile(t) for t in BITS_TILES) and not any(bits_tile(t) for t in DOT_TILES)
    for kind in (INT4_GROUPS, MXFP4_GROUPS):
        assert not any(dot_tile(t) for t in candidate_tiles(kind))
    assert [tile_split(t) for t in ((16, 128, 1, 4, "d"), (16, 128, 1, 4, "db4"), (16, 512, 4, 2))] == [1, 4, 1]
    gate_up, gu_s, _, d_s = experts("fp8_block", seed=93)
    x = torch.zeros(1, HIDDEN)
    assert gemv_supported(x, gate_up, gu_s, d_s, tiles=((16, 128, 1, 4, "d"), (32, 64, 2, 4, "d2")))
    assert gemv_supported(x, gate_up, gu_s, d_s, tiles=WIDE_STEP_TILES)  # (whole scale blocks a step)
    assert not gemv_supported(x, gate_up, gu_s, d_s, tiles=((16, 192, 1, 4, "d"), (32, 64, 2, 4, "d")))
    # (the 256-column step a block-FP8 candidate alone: it won gate_up on an H200; the 512-column one never won)
    assert WIDE_STEP_CANDIDATES == ((16, 256, 1, 4, "db"),) and WIDE_STEP_CANDIDATES[0] in candidate_tiles(BLOCK_SCALES)
    assert not any(t in candidate_tiles(ROW_SCALES) for t in WIDE_STEP_TILES)
    assert not any(t in candidate_tiles(BLOCK_SCALES) for t in WIDE_STEP_TILES if t not in WIDE_STEP_CANDIDATES)


def test_marks_and_support():
    """mark_gemv fills the counts between timed ones from the next larger; a losing count stays unmarked;
    blocked scales need I % 128 == 0; more than MAX_TOKENS tokens are never taken."""
    gate_up, gu_s, _, _ = experts("fp8_block", seed=30)
    pair = (GEMV_TILES[0], GEMV_TILES[1])
    mark_gemv(gate_up, {1: pair, 2: None, 4: pair, 8: None})
    assert [gemv_tiles(gate_up, t) for t in range(1, 10)] == [pair, None, pair, pair, None, None, None, None, None]
    x = torch.zeros(1, HIDDEN)
    assert gemv_supported(x, gate_up, gu_s) and not gemv_supported(torch.zeros(MAX_TOKENS + 1, HIDDEN), gate_up, gu_s)
    odd = torch.zeros(EXPERTS, 2 * 96, HIDDEN, dtype=gate_up.dtype)
    assert not gemv_supported(x, odd, torch.ones(EXPERTS, 2, 2))
    assert gemv_supported(x, odd, torch.ones(EXPERTS, 2 * 96))  # (per channel: any width)
    assert not gemv_supported(x, torch.zeros(EXPERTS, 2 * INTER, HIDDEN, dtype=torch.bfloat16), None)  # x float32
    (gate_up_4, down_4), _ = int4_experts(seed=31)
    scales = (gate_up_4.kernel["scale"], down_4.kernel["scale"])
    assert gemv_supported(x, gate_up_4.kernel["weight"], *scales, tiles=GEMV_TILES)
    assert not gemv_supported(x, gate_up_4.kernel["weight"], scales[0])  # (no down scales: its groups unknown)


def test_choice_is_cuda_only():
    """CPU experts (and the interpreter) time nothing and get no mark."""
    gate_up, gu_s, down, d_s = experts("fp8_block", seed=40)
    assert choose_decode_tiles([GemvExperts(gate_up, down, TOP_K, torch.bfloat16, gu_s, d_s)]) == {}
    assert getattr(gate_up, GEMV_ATTR, None) is None


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the entries dispatch to Triton on CUDA tensors only")
@pytest.mark.parametrize("kind", ["model", "fp8_channel", "fp8_block"])
def test_the_choice_marks_and_the_entries_dispatch(kind, monkeypatch, tmp_path):
    """choose_decode_tiles on a layer listed with its scales times both paths at 1, 2, 4, 8 tokens and marks
    what won; moe_forward / moe_forward_fp8 then give this path's result at the marked counts (a mark forced
    at every count here), replayed from a CUDA graph. Two GEMV candidates (the compiles' time)."""
    from kernels import choice_cache, moe_gemv_choice
    from kernels.fused_moe import moe_forward
    from kernels.fused_moe_fp8 import moe_forward_fp8

    monkeypatch.setenv(choice_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(moe_gemv_choice, "candidate_tiles", lambda kind: GEMV_TILES[:2])
    gate_up, gu_s, down, d_s = [t.cuda() if t is not None else None for t in experts(kind, seed=50)]
    if kind == "model":
        gate_up, down = gate_up.bfloat16(), down.bfloat16()
    reports = choose_decode_tiles([GemvExperts(gate_up, down, TOP_K, torch.bfloat16, gu_s, d_s)])
    (report,) = [r for key, r in reports.items() if key[0] == "gemv"]
    assert set(report["tiles"]) == {1, 2, 4, 8}
    for tokens, tiles in report["tiles"].items():
        assert (gemv_tiles(gate_up, tokens) == tiles) if tiles else gemv_tiles(gate_up, tokens) is None
    mark_gemv(gate_up, {t: ((16, 128, 4, 2), (32, 256, 8, 2)) for t in (1, 2, 4, 8)})
    for num_tokens in (1, 5):
        x = randn(num_tokens, HIDDEN, seed=51).to("cuda", torch.bfloat16)
        logits = distinct_logits(num_tokens, EXPERTS, seed=52).to("cuda", torch.bfloat16)
        weights, ids = route_tokens_ref(logits, TOP_K, True)
        ref = moe_gemv_ref(x, gate_up, down, weights, ids, gu_s, d_s)
        run = ((lambda: moe_forward(x, logits, gate_up, down, TOP_K, True, sum_experts=False)) if kind == "model" else
               (lambda: moe_forward_fp8(x, logits, gate_up, gu_s, down, d_s, TOP_K, True, sum_experts=False)))
        assert relative_error(run(), ref) < TOLERANCES[torch.bfloat16]
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            out = run()
        graph.replay()
        torch.cuda.synchronize()
        assert out.shape == (num_tokens, TOP_K, HIDDEN) and relative_error(out, ref) < TOLERANCES[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the entries dispatch to Triton on CUDA tensors only")
def test_int4_choice_and_dispatch(monkeypatch, tmp_path):
    """4-bit experts listed with their WNA16Experts: the choice times against moe_forward_wna16 and marks the codes;
    a forced mark makes moe_forward_wna16 give this path's (summed) result. Two GEMV candidates."""
    from kernels import choice_cache, moe_gemv_choice
    from kernels.fused_moe_wna16 import gemv_quantization, moe_forward_wna16, prepare_wna16_experts
    from kernels.wna16 import quantize

    monkeypatch.setenv(choice_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setattr(moe_gemv_choice, "candidate_tiles", lambda kind: GEMV_TILES[:2])
    gate_up, _, down, _ = experts("model", seed=70)
    stored = [[t.cuda() for t in quantize(w, 4, 64, symmetric=False)] for w in (gate_up, down)]
    kernel = [prepare_wna16_experts(*w, 4, torch.bfloat16, for_kernel=True) for w in stored]
    dense = [prepare_wna16_experts(*w, 4, torch.bfloat16, for_kernel=False).dense for w in stored]
    entry = GemvExperts(kernel[0].kernel["weight"], kernel[1].kernel["weight"], TOP_K, torch.bfloat16,
                        **gemv_quantization(*kernel), wna16=tuple(kernel))
    (report,) = [r for key, r in choose_decode_tiles([entry]).items() if key[0] == "gemv"]
    assert set(report["tiles"]) == {1, 2, 4, 8}
    mark_gemv(entry.gate_up, {t: ((16, 256, 4, 2), (32, 256, 4, 2)) for t in (1, 2, 4, 8)})
    x = randn(3, HIDDEN, seed=71).to("cuda", torch.bfloat16)
    logits = distinct_logits(3, EXPERTS, seed=72).to("cuda", torch.bfloat16)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref = moe_gemv_ref(x, *dense, weights, ids).float().sum(dim=1)
    assert relative_error(moe_forward_wna16(x, logits, *kernel, TOP_K, True), ref) < TOLERANCES[torch.bfloat16]


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="the entries dispatch to Triton on CUDA tensors only")
def test_mxfp4_choice_and_dispatch(monkeypatch, tmp_path):
    """MXFP4 experts with biases and the clamped SwiGLU (gpt-oss's GptOssExperts.gemv_experts), the word path off
    ($TRITONLLM_MXFP4_WORDS=0): the choice times this pair against moe_forward_mxfp4 and marks the codes; a forced mark makes moe_forward_mxfp4 give this path's (summed)
    result, equal to the widened experts' reference. Two GEMV candidates."""
    from test_fused_moe_mxfp4 import problem

    from kernels import choice_cache, moe_gemv_choice
    from kernels.fused_moe_mxfp4 import moe_forward_mxfp4, prepare_mxfp4_experts
    from kernels.moe_epilogue import ExpertEpilogue
    from kernels.mxfp4_gemv import WORDS_ENV

    monkeypatch.setenv(choice_cache.CACHE_ENV, str(tmp_path))
    monkeypatch.setenv(WORDS_ENV, "0")  # (kernels/mxfp4_gemv.py's word path: tests/kernels/test_mxfp4_gemv.py)
    monkeypatch.setattr(moe_gemv_choice, "candidate_tiles", lambda kind: GEMV_TILES[:2])
    hidden, inter = 256, 128
    x, logits, gate_up_stored, down_stored, biases = problem(3, hidden, inter, EXPERTS, seed=80)
    kernel = [prepare_mxfp4_experts(*[t.cuda() for t in stored], torch.bfloat16, for_kernel=True)
              for stored in (gate_up_stored, down_stored)]
    dense = [prepare_mxfp4_experts(*stored, torch.float32, for_kernel=False).dense
             for stored in (gate_up_stored, down_stored)]
    gu_bias, d_bias = (b.to("cuda", torch.bfloat16) for b in biases)
    epilogue = ExpertEpilogue(gu_bias, d_bias, "swiglu_clamped", 0.4)
    entry = GemvExperts(kernel[0].kernel["codes"], kernel[1].kernel["codes"], TOP_K, torch.bfloat16,
                        kernel[0].kernel["scales"], kernel[1].kernel["scales"], mxfp4=tuple(kernel), epilogue=epilogue)
    (report,) = [r for key, r in choose_decode_tiles([entry]).items() if key[0] == "gemv"]
    assert set(report["tiles"]) == {1, 2, 4, 8}
    mark_gemv(entry.gate_up, {t: ((16, 256, 4, 2), (32, 256, 4, 2)) for t in (1, 2, 4, 8)})
    x, logits = x.to("cuda", torch.bfloat16), logits.to("cuda", torch.bfloat16)
    weights, ids = route_tokens_ref(logits, TOP_K, True)
    ref_epilogue = ExpertEpilogue(gu_bias.float(), d_bias.float(), "swiglu_clamped", 0.4)
    ref = moe_gemv_ref(x.float(), *[d.cuda() for d in dense], weights, ids, epilogue=ref_epilogue).sum(dim=1)
    out = moe_forward_mxfp4(x, logits, *kernel, TOP_K, True, gate_up_bias=gu_bias, down_bias=d_bias,
                            activation="swiglu_clamped", swiglu_limit=0.4)
    assert relative_error(out, ref) < TOLERANCES[torch.bfloat16]


# ---- ahead of time for sm_90 on the CPU (TRITONLLM_AOT_SM90=1) ---------------------------------

AOT = AOT_SM90


@AOT
@pytest.mark.parametrize("kind", [NO_SCALES, ROW_SCALES, BLOCK_SCALES, INT4_GROUPS, MXFP4_GROUPS])
@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("tiles", GEMV_TILES + tuple(t for t in WIDE_STEP_TILES if t not in GEMV_TILES))
def test_compiles_for_sm90_without_spills(kind, which, tiles, tmp_path, monkeypatch):
    """Triton's compiler and ptxas (no GPU) on the Qwen3-30B-A3B shape's kernels for every candidate (MXFP4:
    gpt-oss's, with its biases and clamped SwiGLU; AHEAD and DOT tiles as $TRITONLLM_MOE_GEMV_AHEAD=1 and
    $TRITONLLM_MOE_GEMV_DOT=1 have them timed): no local memory (spills)."""
    assert_compiles_without_spills(kind, which, tiles, tmp_path, monkeypatch)


@AOT
@pytest.mark.parametrize("kind", [NO_SCALES, ROW_SCALES, BLOCK_SCALES])
@pytest.mark.parametrize("which", ["gate_up", "down"])
@pytest.mark.parametrize("tiles", [(16, 128, 1, 4, "d"), (16, 128, 1, 4, "db"), (8, 1024, 4, 2)])
def test_shared_expert_compiles_for_sm90_without_spills(kind, which, tiles, tmp_path, monkeypatch):
    """With a SharedExpert (HAS_SHARED: each program's weight and scale bases a scalar select of two pointers) the
    kernels Llama 4 Scout's choice takes (DOT / BITS, and the plain (8, 1024, 4, 2)) compile without spills."""
    assert_compiles_without_spills(kind, which, tiles, tmp_path, monkeypatch, shared=True)


def assert_compiles_without_spills(kind, which, tiles, tmp_path, monkeypatch, shared=False):
    from kernels.moe_gemv import (AHEAD_ENV, DOT_COLS, DOT_ENV, _gemv_down_kernel, _gemv_gate_up_kernel, ahead,
                                  bits_tile, dot_tile, one_load, step_sums, tile_split)

    monkeypatch.setenv(AHEAD_ENV, "1")
    monkeypatch.setenv(DOT_ENV, "1")
    fn = _gemv_gate_up_kernel if which == "gate_up" else _gemv_down_kernel
    if tiles not in candidate_tiles(kind) and not (tiles in WIDE_STEP_TILES and kind == BLOCK_SCALES):
        pytest.skip("not a candidate of this weight kind (candidate_tiles; WIDE_STEP_TILES: block-FP8's alone)")
    block_n, block_k, warps, stages = tiles[:4]
    w = {NO_SCALES: "*bf16", INT4_GROUPS: "*u8", MXFP4_GROUPS: "*u8"}.get(kind, "*fp8e4nv")
    mxfp4 = kind == MXFP4_GROUPS
    pointers = dict(x_ptr="*bf16", logits_ptr="*bf16", ids_ptr="*i32", weights_ptr="*fp32", w_ptr=w,
                    s_ptr="*u8" if mxfp4 else "*fp32", z_ptr="*u8", bias_ptr="*bf16", act_ptr="*bf16", out_ptr="*bf16",
                    part_ptr="*fp32", arrivals_ptr="*i32", shared_w_ptr=w, shared_s_ptr="*u8" if mxfp4 else "*fp32")
    top_k = 1 if shared else 4 if mxfp4 else 8  # (shared: Llama 4's top-1 rows, the ids given)
    const = dict(TOP_K=top_k, K_PAD=top_k, E_PAD=32 if mxfp4 else 128, ROUTE_IN_KERNEL=not shared, RENORMALIZE=True,
                 SCALES=kind, BLOCK_N=block_n, BLOCK_K=block_k,
                 SUB_K=32 if mxfp4 else DOT_COLS if dot_tile(tiles)
                 else (1 if step_sums(tiles) or one_load(tiles) else block_k) if ahead(tiles)
                 else min(block_k, 128), HAS_BIAS=mxfp4, ACTIVATION=int(mxfp4), SWIGLU_LIMIT=7.0 if mxfp4 else 0.0,
                 PDL=True, AHEAD=ahead(tiles) and not one_load(tiles), ONE_LOAD=one_load(tiles), DOT=dot_tile(tiles),
                 SPLIT=tile_split(tiles), BITS=bits_tile(tiles), ASM=True, HAS_SHARED=shared)
    aligned = ("H", "I", "group", "stride_x", "stride_l", "stride_we", "stride_wn", "stride_act", "stride_o", "stride_se",
               "stride_sn", "stride_be")
    compiled = compile_for_sm90(fn, pointers, const, warps=warps, stages=stages, aligned_int=lambda name: name in aligned)
    usage = resource_usage(compiled, tmp_path)
    if usage is not None:
        assert "LOCAL:0 " in usage and stack_bytes(usage) <= 8, usage
