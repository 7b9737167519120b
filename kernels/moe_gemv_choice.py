"""The load-time choice between the grouped one-token path and kernels/moe_gemv.py's two GEMV launches for a
layer's routed experts, per token count (1, 2, 4, 8), by timing both as the engine calls them.

For each count T: the grouped path (kernels/fused_moe.py moe_forward, fused_moe_fp8.py moe_forward_fp8 for FP8
experts, fused_moe_wna16.py moe_forward_wna16 for 4-bit ones or fused_moe_mxfp4.py moe_forward_mxfp4 for MXFP4
ones, the experts' biases and activation included, with whatever tiles are marked already) and the
GEMV path with each of GEMV_TILES for gate_up (down at the default), then each for down (gate_up at its best),
all from router logits to the unsummed (T, K, H) rows (4 bits and MXFP4: summed, as their grouped paths return them).
CUDA-graph replays alternate up to four sets of experts, so the weights come from HBM as a decode step's do
(one token's eight Qwen3-30B-A3B block-FP8 experts, 38 MB, would fit in the H200's L2). The GEMV pair is marked
(kernels/moe_gemv.py mark_gemv) where it times at least 2% faster than the grouped path.

A choice goes through the persistent choice cache (kernels/choice_cache.py, family "moe_gemv"), so a restart on
the same GPU times nothing. $TRITONLLM_MOE_GEMV=0 leaves every layer on the grouped path (nothing timed).
"""
from __future__ import annotations

import os
import time

import torch

from kernels import (choice_cache, e4m3_bits, fused_moe, fused_moe_fp8, fused_moe_mxfp4, fused_moe_wna16, moe_gemv,
                     mxfp4_gemv)
from kernels._triton import use_triton
from kernels.linear import _arrival_counters
from kernels.moe_gemv import (DEFAULT_TILES, GEMV_ATTR, GemvExperts, candidate_tiles, gemv_supported,
                              mark_gemv, moe_gemv_triton)
from kernels.mxfp4_gemv import (DEFAULT_WORD_TILES, WORD_TILES, WORDS_ENV, mxfp4_words_triton, word_mark,
                                word_path_supported)

GEMV_ENV = "TRITONLLM_MOE_GEMV"
TIMED_TOKENS = (1, 2, 4, 8)
MARGIN = 0.98  # the GEMV pair must take at most this share of the grouped path's time
# The word path's summed rows must lie this close to the grouped path's (||words - grouped|| / ||grouped||, both in
# the activations' dtype; ~3e-3 in bf16) for its mark: a layout that broke the inline asm's packs (H200 call 27)
# would otherwise be chosen for its speed.
WORDS_AGREEMENT = 3e-2


def routing_sets(num_tokens: int, num_experts: int, top_k: int, device) -> list[torch.Tensor]:
    """Router logits (T, E) of up to four sets of distinct experts (fewer where the experts run out): token t of
    set s prefers experts (s * T * K + t * K + j) % E, j = 0..K-1, in that order."""
    per_set = num_tokens * top_k
    sets = []
    for s in range(max(1, min(4, num_experts // per_set))):
        logits = torch.zeros(num_tokens, num_experts)
        for t in range(num_tokens):
            for j in range(top_k):
                logits[t, (s * per_set + t * top_k + j) % num_experts] = 8.0 - 0.01 * j
        sets.append(logits.to(device))
    return sets


@torch.inference_mode()
def choose_gemv(experts: GemvExperts) -> dict | None:
    """Times (or reads from the cache) and marks ``experts.gate_up``; returns the report, or None where the path
    does not apply (off CUDA, the interpreter, unsupported experts, or $TRITONLLM_MOE_GEMV=0)."""
    gate_up, dtype = experts.gate_up, experts.dtype
    if (os.environ.get(GEMV_ENV, "1").strip() == "0" or gate_up.device.type != "cuda" or not use_triton(gate_up)
            or dtype not in (torch.float16, torch.bfloat16)
            or (gate_up.dtype == torch.uint8 and experts.wna16 is None and experts.mxfp4 is None)):
        return None
    probe = torch.empty(1, experts.down.shape[1], dtype=dtype, device=gate_up.device)  # (one token's activations)
    tiles = candidate_tiles(moe_gemv.scale_kind(gate_up, experts.gate_up_scale))
    if not gemv_supported(probe, gate_up, experts.gate_up_scale, experts.down_scale, tiles=tiles,
                          epilogue=experts.epilogue):
        return None
    if hasattr(gate_up, GEMV_ATTR):
        delattr(gate_up, GEMV_ATTR)  # (the grouped path is timed as itself)
    report = choice_cache.timed_report(
        "moe_gemv", gemv_key(experts), gate_up.device, lambda: time_gemv(experts),
        sources=(__file__, moe_gemv.__file__, fused_moe.__file__, fused_moe_fp8.__file__, fused_moe_wna16.__file__,
                 fused_moe_mxfp4.__file__, mxfp4_gemv.__file__, e4m3_bits.__file__),
        # the tiles time_gemv times (candidate_tiles: with $TRITONLLM_MOE_GEMV_AHEAD=1 the AHEAD ones too), so a
        # choice stored without them is not served to a run that asks for them (H200, 2026-12-01: it was)
        candidates=(tiles, WORD_TILES if words_enabled(experts) else ()),
        valid=lambda r: set(r.get("tiles", {})) == set(TIMED_TOKENS))
    mark_gemv(gate_up, report["tiles"])
    if words_enabled(experts) or any(moe_gemv.tile_split(t) > 1 for t in tiles):
        # (split / "r" word tiles and split DOT tiles count arrivals: the counters allocated now, eagerly, even
        # when the report came from the cache: never in a graph's capture)
        _arrival_counters(gate_up.device, 1)
    return report


def words_enabled(experts: GemvExperts) -> bool:
    """MXFP4 experts that kernels/mxfp4_gemv.py's word path takes (gpt-oss's clamped SwiGLU), unless
    $TRITONLLM_MXFP4_WORDS is 0: the choice times it beside moe_gemv's pair."""
    if experts.mxfp4 is None or os.environ.get(WORDS_ENV, "1").strip() == "0":
        return False
    probe = torch.empty(1, experts.down.shape[1], dtype=experts.dtype, device=experts.gate_up.device)
    return word_path_supported(probe, experts.gate_up, experts.gate_up_scale, experts.epilogue)


def words_difference(experts: GemvExperts, x: torch.Tensor, logits: torch.Tensor, tiles: tuple) -> float:
    """||word path - grouped path|| / ||grouped path|| of the summed rows for x routed by logits (float, NaN if
    either is not finite)."""
    epilogue = experts.epilogue
    expected = fused_moe_mxfp4.moe_forward_mxfp4(
        x, logits, *experts.mxfp4, experts.top_k, True, gate_up_bias=epilogue.gate_up_bias,
        down_bias=epilogue.down_bias, activation=epilogue.activation, swiglu_limit=epilogue.swiglu_limit).float()
    got = mxfp4_words_triton(x, experts.gate_up, experts.down, experts.gate_up_scale, experts.down_scale,
                             top_k=experts.top_k, epilogue=epilogue, router_logits=logits, renormalize=True,
                             tiles=tiles).float()
    return ((got - expected).norm() / expected.norm().clamp_min(1e-30)).item()


def gemv_key(experts: GemvExperts) -> tuple:
    """What a choice depends on: the experts' shapes and dtypes, their scales' shape and dtype, K, the activations'
    dtype and the epilogue (which biases, which activation)."""
    scale, epilogue = experts.gate_up_scale, experts.epilogue
    key = (*experts.gate_up.shape, *experts.down.shape[1:], experts.top_k,
           str(experts.gate_up.dtype).removeprefix("torch."), None if scale is None else tuple(scale.shape[1:]),
           str(experts.dtype).removeprefix("torch."))
    if scale is not None and scale.dtype == torch.uint8:
        key += ("e8m0",)
    if epilogue.activation != "silu" or epilogue.gate_up_bias is not None or epilogue.down_bias is not None:
        key += (epilogue.activation, epilogue.gate_up_bias is not None, epilogue.down_bias is not None)
    return key


def time_gemv(experts: GemvExperts) -> dict:
    """{"tiles": {T: (gate_up tiles, down tiles) or None}, "grouped_us": {T: us}, "gemv_us": {T: us},
    "gate_up_us" / "down_us": {T: {tiles: us}}}: device microseconds a call, routing included. MXFP4 experts the
    word path takes (``words_enabled``; then moe_gemv's pair with its first candidate alone) also: "words_us":
    {T: us}, "words_gate_up_us" / "words_down_us": {T: {tiles: us}} (kernels/mxfp4_gemv.py's candidates, likewise
    gate_up first), "words_rel_diff": {T: its best pair's difference to the grouped path (words_difference)}, and
    the mark is the word path's (mxfp4_gemv.word_mark) where it times faster than moe_gemv's pair and within MARGIN
    of the grouped path, and agrees with the grouped path within WORDS_AGREEMENT. "seconds": this timing's wall time,
    compiles included (what the choice adds to a cold load)."""
    from kernels.linear import _TOO_LARGE, graph_time_ms

    began = time.perf_counter()

    gate_up, down, top_k, dtype = experts.gate_up, experts.down, experts.top_k, experts.dtype
    num_experts, hidden = gate_up.shape[0], down.shape[1]
    candidates = candidate_tiles(moe_gemv.scale_kind(gate_up, experts.gate_up_scale))
    device = gate_up.device
    report: dict = {"tiles": {}, "grouped_us": {}, "gemv_us": {}, "gate_up_us": {}, "down_us": {}}
    words = words_enabled(experts)
    if words:
        report.update(words_us={}, words_gate_up_us={}, words_down_us={}, words_rel_diff={})
        # moe_gemv's MXFP4 pair: its first tile alone, a timed fallback (H200 calls 28 and 33: the best of its
        # candidates 2.1-2.9x the word path's time at every count; each candidate is a compile at a cold load,
        # whose 18 choices took 99.0 s in call 34)
        candidates = candidates[:1]
    for tokens in TIMED_TOKENS:
        sets = routing_sets(tokens, num_experts, top_k, device)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        turn = [0]

        def logits() -> torch.Tensor:
            turn[0] += 1
            return sets[turn[0] % len(sets)]

        epilogue = experts.epilogue
        biases = dict(gate_up_bias=epilogue.gate_up_bias, down_bias=epilogue.down_bias,
                      activation=epilogue.activation, swiglu_limit=epilogue.swiglu_limit)

        def grouped() -> None:
            if experts.wna16 is not None:
                fused_moe_wna16.moe_forward_wna16(x, logits(), *experts.wna16, top_k, True)
            elif experts.mxfp4 is not None:
                fused_moe_mxfp4.moe_forward_mxfp4(x, logits(), *experts.mxfp4, top_k, True, **biases)
            elif experts.gate_up_scale is None:
                fused_moe.moe_forward(x, logits(), gate_up, down, top_k, True, sum_experts=False, **biases)
            else:
                fused_moe_fp8.moe_forward_fp8(x, logits(), gate_up, experts.gate_up_scale, down, experts.down_scale,
                                              top_k, True, sum_experts=False)

        def gemv(tiles: tuple) -> None:
            moe_gemv_triton(x, gate_up, down, top_k=top_k, router_logits=logits(), renormalize=True, tiles=tiles,
                            sum_experts=experts.wna16 is not None or experts.mxfp4 is not None,
                            **experts.quantization())

        def word_path(tiles: tuple) -> None:
            mxfp4_words_triton(x, gate_up, down, experts.gate_up_scale, experts.down_scale, top_k=top_k,
                               epilogue=experts.epilogue, router_logits=logits(), renormalize=True, tiles=tiles)

        def timed(tiles: tuple, run=None) -> float | None:
            run = run or gemv
            try:
                run(tiles)  # compile
            except _TOO_LARGE:
                return None
            return graph_time_ms(lambda: run(tiles)) * 1e3

        grouped_us = graph_time_ms(grouped) * 1e3
        gate_up_us = {t: us for t in candidates if (us := timed((t, DEFAULT_TILES[1]))) is not None}
        best_gate_up = min(gate_up_us, key=gate_up_us.get) if gate_up_us else DEFAULT_TILES[0]
        down_us = {t: us for t in candidates if (us := timed((best_gate_up, t))) is not None}
        best_down = min(down_us, key=down_us.get) if down_us else None  # (None: nothing fit this GPU)
        report["grouped_us"][tokens] = grouped_us
        report["gemv_us"][tokens] = down_us[best_down] if down_us else None
        report["gate_up_us"][tokens], report["down_us"][tokens] = gate_up_us, down_us
        faster = down_us and down_us[best_down] <= MARGIN * grouped_us
        report["tiles"][tokens] = (best_gate_up, best_down) if faster else None
        if words:
            gu_words = {t: us for t in WORD_TILES if "f" not in (t[3:] or ("",))[0]  # ("f": down's option)
                        and (us := timed((t, DEFAULT_WORD_TILES[1]), word_path)) is not None}
            best_gu = min(gu_words, key=gu_words.get) if gu_words else DEFAULT_WORD_TILES[0]
            d_words = {t: us for t in WORD_TILES if (us := timed((best_gu, t), word_path)) is not None}
            report["words_gate_up_us"][tokens], report["words_down_us"][tokens] = gu_words, d_words
            if d_words:
                best_d = min(d_words, key=d_words.get)
                report["words_us"][tokens] = d_words[best_d]
                diff = words_difference(experts, x, sets[0], (best_gu, best_d))
                report["words_rel_diff"][tokens] = diff
                best_other = min(down_us[best_down] if down_us else float("inf"), grouped_us)
                if (d_words[best_d] < best_other and d_words[best_d] <= MARGIN * grouped_us
                        and diff <= WORDS_AGREEMENT):  # (NaN fails)
                    report["tiles"][tokens] = word_mark((best_gu, best_d))
    report["seconds"] = time.perf_counter() - began
    return report
