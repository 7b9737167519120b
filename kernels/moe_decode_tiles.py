"""The tiles of the single-token grouped expert GEMMs (kernels/fused_moe.py fused_moe_triton at one token:
batch-1 decode), chosen per expert shape at load by timing a few candidates.

Why: at one token each of the K assignments is a block of its own (ONE_PER_BLOCK), so a GEMM's grid is
K x cdiv(N, BLOCK_N) programs that each stream BLOCK_N weight rows; how the programs spread over the SMs
(shared memory: (stages - 1) buffers of a stage's tiles), how much each keeps in flight and how soon the
first bytes arrive decide the bandwidth, and that is the GPU's to say. DeepSeek-V2-Lite (6 routed + 2
appended shared experts, I 1408, hidden 2048) with the table's (32, 128, 4 warps, 4 stages): gate_up 8 x
44 = 352 programs at 60 KB (3 an SM: 88 SMs hold 3, 44 hold 2), down 8 x 64 = 512 at 36 KB (sm_90
compile, Triton 3.9); both GEMMs together streamed ~3.6 TB/s on an H200 (1.003 ms for 26 layers' 3.6 GB,
2026-11-29), the copy bandwidth being 4.19: ~5 us a layer over the bytes' time, about what a launch's
ramp and tail cost twice. The candidates trade programs for shared memory and depth
(DECODE_TILE_CANDIDATES). gate_up and down are timed apart (each its best), from CUDA-graph replays that
alternate two sets of K experts, so the timed weights come from HBM as a decode step's do (one set of
V2-Lite's down weights, 46 MB, nearly fits in L2).

A choice goes through the persistent choice cache (kernels/choice_cache.py, family "moe_decode"), so a
restart on the same GPU compiles only the winner. $TRITONLLM_MOE_DECODE_TILES=0 leaves the table's
tiles (nothing timed). Choices are marked on the gate_up tensor (fused_moe.DECODE_TILES_ATTR), which
fused_moe_triton reads at one token when no config is passed.
"""
from __future__ import annotations

import os

import torch

from kernels import choice_cache, fused_moe
from kernels._triton import use_triton
from kernels.fused_moe import DECODE_TILES_ATTR, SINGLE_TOKEN_TILES, _grouped_gemm
from kernels.moe_gemv import GemvExperts, mark_gemv
from kernels.moe_gemv_choice import choose_gemv, gemv_key

TILES_ENV = "TRITONLLM_MOE_DECODE_TILES"

# (BLOCK_N, BLOCK_K, num_warps, num_stages). The first is the table's (gemm_config(16)). Shared memory a
# program at BLOCK_M 16 in bf16, gate_up / down, and V2-Lite's programs (sm_90 compile, Triton 3.9; no
# spills, 40-106 registers): (32, 128, 4, 4) 60 / 36 KB, 352 / 512; (32, 128, 4, 3) 40 / 24 KB, the same
# programs one buffer shallower (5 an SM by shared memory); (16, 256, 4, 3) 48 / 32 KB, twice the programs
# (704 / 1,024); (64, 64, 4, 4) 54 / 30 KB, half (176 / 256); (64, 128, 4, 3) 72 / 40 KB, half.
DECODE_TILE_CANDIDATES = ((32, 128, 4, 4), (32, 128, 4, 3), (16, 256, 4, 3), (64, 64, 4, 4), (64, 128, 4, 3))
assert DECODE_TILE_CANDIDATES[0] == tuple(SINGLE_TOKEN_TILES[0][k] for k in ("BLOCK_N", "BLOCK_K", "num_warps",
                                                                              "num_stages"))


def tile_config(variant: tuple[int, int, int, int]) -> dict:
    """A candidate as _grouped_gemm's config dict."""
    block_n, block_k, warps, stages = variant
    return {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}


def mark_decode_tiles(gate_up: torch.Tensor, gate_up_variant: tuple, down_variant: tuple) -> None:
    """gate_up's single-token GEMMs take these tiles (fused_moe_triton reads the mark)."""
    setattr(gate_up, DECODE_TILES_ATTR, (tile_config(gate_up_variant), tile_config(down_variant)))


@torch.inference_mode()
def choose_decode_tiles(experts: list[tuple]) -> dict[tuple, dict]:
    """experts: (gate_up (E, 2I, H), down (E, H, I), assignments a token K) of each sparse layer, as
    fused_moe_triton gets them at one token. Times the candidates once per distinct shape (on the first
    such layer's own weights: no second copy is allocated) and marks every gate_up of that shape with
    the fastest pair. Returns {(E, 2I, H, K, dtype): report} for the load log / benches; {} off CUDA
    (the interpreter included), for other dtypes, or with $TRITONLLM_MOE_DECODE_TILES=0.

    An entry may also be a GemvExperts (kernels/moe_gemv.py): experts that moe_forward / moe_forward_fp8 /
    moe_forward_wna16 take, for which kernels/moe_gemv_choice.py also chooses, per token count, between their
    grouped path and the GEMV launches (reports keyed ("gemv", ...)); model-dtype ones get the tile choice too."""
    reports: dict[tuple, dict] = {}
    gemv_reports: dict[tuple, dict | None] = {}
    for entry in experts:
        if not isinstance(entry, GemvExperts):
            _choose_tiles(*entry, reports)
            continue
        if entry.gate_up_scale is None:
            _choose_tiles(entry.gate_up, entry.down, entry.top_k, reports)
        key = ("gemv", *gemv_key(entry))
        if key not in gemv_reports:
            gemv_reports[key] = choose_gemv(entry)
        elif gemv_reports[key] is not None:
            mark_gemv(entry.gate_up, gemv_reports[key]["tiles"])
    return {**reports, **{key: report for key, report in gemv_reports.items() if report is not None}}


def _choose_tiles(gate_up: torch.Tensor, down: torch.Tensor, top_k: int, reports: dict) -> None:
    """choose_decode_tiles' grouped-tile choice for one layer (reports: the shapes chosen so far)."""
    if os.environ.get(TILES_ENV, "1").strip() == "0":
        return
    if (gate_up.device.type != "cuda" or not use_triton(gate_up)  # (timed from CUDA graphs: not in the interpreter)
            or gate_up.dtype not in (torch.float16, torch.bfloat16)):
        return
    key = (*gate_up.shape, top_k, str(gate_up.dtype).removeprefix("torch."))
    if key not in reports:
        reports[key] = choice_cache.timed_report(
            "moe_decode", key, gate_up.device, lambda: time_decode_tiles(gate_up, down, top_k),
            sources=(__file__, fused_moe.__file__), candidates=DECODE_TILE_CANDIDATES,
            valid=lambda r: r["gate_up"] in DECODE_TILE_CANDIDATES and r["down"] in DECODE_TILE_CANDIDATES)
    mark_decode_tiles(gate_up, reports[key]["gate_up"], reports[key]["down"])


def time_decode_tiles(gate_up: torch.Tensor, down: torch.Tensor, top_k: int) -> dict:
    """Device microseconds of each candidate for the gate_up GEMM and the down GEMM of one token over
    ``top_k`` experts of these weights, and the fastest of each: {"gate_up_us": {variant: us}, "down_us":
    ..., "gate_up": variant, "down": variant}. A candidate that does not fit the GPU's shared memory drops out."""
    from kernels.linear import _TOO_LARGE, graph_time_ms

    num_experts, two_inter, hidden = gate_up.shape
    inter = two_inter // 2
    device, dtype = gate_up.device, gate_up.dtype
    # Two sets of experts, alternated call by call (one set when there are too few experts for two)
    sets = [torch.arange(s * top_k, (s + 1) * top_k, device=device, dtype=torch.int32) % num_experts
            for s in range(2 if num_experts >= 2 * top_k else 1)]
    weights = torch.full((top_k,), 1.0 / top_k, device=device, dtype=torch.float32)
    x = torch.randn(1, hidden, device=device, dtype=dtype)
    act = torch.randn(top_k, inter, device=device, dtype=dtype) * 0.1
    act_out = torch.empty(top_k, inter, device=device, dtype=dtype)
    out_k = torch.empty(top_k, hidden, device=device, dtype=dtype)
    turn = [0]

    def ids() -> torch.Tensor:
        turn[0] += 1
        return sets[turn[0] % len(sets)]

    def gate_up_call(config: dict) -> None:
        _grouped_gemm(x, gate_up, act_out, None, ids(), weights, n=inter, top_k=top_k, rows_per_token=True,
                      gated=True, mul_weight=False, block_m=16, config=config)

    def down_call(config: dict) -> None:
        _grouped_gemm(act, down, out_k, None, ids(), weights, n=hidden, top_k=top_k, rows_per_token=False,
                      gated=False, mul_weight=True, block_m=16, config=config)

    report: dict = {}
    for name, call in (("gate_up", gate_up_call), ("down", down_call)):
        times = {}
        for variant in DECODE_TILE_CANDIDATES:
            config = tile_config(variant)
            try:
                call(config)  # compile (and drop a candidate that outgrows shared memory here)
            except _TOO_LARGE:
                continue
            times[variant] = graph_time_ms(lambda: call(config)) * 1e3
        report[name + "_us"] = times
        report[name] = min(times, key=times.get)
    return report
