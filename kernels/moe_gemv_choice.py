"""The load-time choice between the grouped one-token path and kernels/moe_gemv.py's two GEMV launches for a
layer's routed experts, per token count (1, 2, 4, 8), by timing both as the engine calls them.

For each count T: the grouped path (kernels/fused_moe.py moe_forward, or fused_moe_fp8.py moe_forward_fp8 for
FP8 experts, with whatever tiles are marked already) and the GEMV path with each of GEMV_TILES for gate_up (down
at the default), then each for down (gate_up at its best), all from router logits to the unsummed (T, K, H)
rows. CUDA-graph replays alternate up to four sets of experts, so the weights come from HBM as a decode step's
do (one token's eight Qwen3-30B-A3B block-FP8 experts, 38 MB, would fit in the H200's L2). The GEMV pair is
marked (kernels/moe_gemv.py mark_gemv) where it times at least 2% faster than the grouped path.

A choice goes through the persistent choice cache (kernels/choice_cache.py, family "moe_gemv"), so a restart on
the same GPU times nothing. $TRITONLLM_MOE_GEMV=0 leaves every layer on the grouped path (nothing timed).
"""
from __future__ import annotations

import os

import torch

from kernels import choice_cache, fused_moe, fused_moe_fp8, moe_gemv
from kernels._triton import use_triton
from kernels.moe_gemv import DEFAULT_TILES, GEMV_ATTR, GEMV_TILES, gemv_supported, mark_gemv, moe_gemv_triton

GEMV_ENV = "TRITONLLM_MOE_GEMV"
TIMED_TOKENS = (1, 2, 4, 8)
MARGIN = 0.98  # the GEMV pair must take at most this share of the grouped path's time


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
def choose_gemv(gate_up: torch.Tensor, down: torch.Tensor, top_k: int, gate_up_scale: torch.Tensor | None,
                down_scale: torch.Tensor | None, dtype: torch.dtype) -> dict | None:
    """Times (or reads from the cache) and marks ``gate_up``; returns the report, or None where the path does not
    apply (off CUDA, the interpreter, unsupported experts, or $TRITONLLM_MOE_GEMV=0)."""
    probe = torch.empty(1, gate_up.shape[2], dtype=dtype, device=gate_up.device)
    if (os.environ.get(GEMV_ENV, "1").strip() == "0" or gate_up.device.type != "cuda" or not use_triton(gate_up)
            or dtype not in (torch.float16, torch.bfloat16) or not gemv_supported(probe, gate_up, gate_up_scale, GEMV_TILES)):
        return None
    kind = moe_gemv.scale_kind(gate_up, gate_up_scale)
    key = (*gate_up.shape, top_k, str(gate_up.dtype).removeprefix("torch."), kind, str(dtype).removeprefix("torch."))
    if hasattr(gate_up, GEMV_ATTR):
        delattr(gate_up, GEMV_ATTR)  # (the grouped path is timed as itself)
    report = choice_cache.timed_report(
        "moe_gemv", key, gate_up.device, lambda: time_gemv(gate_up, down, top_k, gate_up_scale, down_scale, dtype),
        sources=(__file__, moe_gemv.__file__, fused_moe.__file__, fused_moe_fp8.__file__), candidates=GEMV_TILES,
        valid=lambda r: set(r.get("tiles", {})) == set(TIMED_TOKENS))
    mark_gemv(gate_up, report["tiles"])
    return report


def time_gemv(gate_up: torch.Tensor, down: torch.Tensor, top_k: int, gate_up_scale: torch.Tensor | None,
              down_scale: torch.Tensor | None, dtype: torch.dtype) -> dict:
    """{"tiles": {T: (gate_up tiles, down tiles) or None}, "grouped_us": {T: us}, "gemv_us": {T: us},
    "gate_up_us" / "down_us": {T: {tiles: us}}}: device microseconds a call, routing included."""
    from kernels.linear import _TOO_LARGE, graph_time_ms

    num_experts, _, hidden = gate_up.shape
    device = gate_up.device
    report: dict = {"tiles": {}, "grouped_us": {}, "gemv_us": {}, "gate_up_us": {}, "down_us": {}}
    for tokens in TIMED_TOKENS:
        sets = routing_sets(tokens, num_experts, top_k, device)
        x = torch.randn(tokens, hidden, device=device, dtype=dtype)
        turn = [0]

        def logits() -> torch.Tensor:
            turn[0] += 1
            return sets[turn[0] % len(sets)]

        def grouped() -> None:
            if gate_up_scale is None:
                fused_moe.moe_forward(x, logits(), gate_up, down, top_k, True, sum_experts=False)
            else:
                fused_moe_fp8.moe_forward_fp8(x, logits(), gate_up, gate_up_scale, down, down_scale, top_k, True,
                                              sum_experts=False)

        def gemv(tiles: tuple) -> None:
            moe_gemv_triton(x, gate_up, down, top_k=top_k, router_logits=logits(), renormalize=True,
                            gate_up_scale=gate_up_scale, down_scale=down_scale, tiles=tiles, sum_experts=False)

        def timed(tiles: tuple) -> float | None:
            try:
                gemv(tiles)  # compile
            except _TOO_LARGE:
                return None
            return graph_time_ms(lambda: gemv(tiles)) * 1e3

        grouped_us = graph_time_ms(grouped) * 1e3
        gate_up_us = {t: us for t in GEMV_TILES if (us := timed((t, DEFAULT_TILES[1]))) is not None}
        best_gate_up = min(gate_up_us, key=gate_up_us.get)
        down_us = {t: us for t in GEMV_TILES if (us := timed((best_gate_up, t))) is not None}
        best_down = min(down_us, key=down_us.get)
        report["grouped_us"][tokens] = grouped_us
        report["gemv_us"][tokens] = down_us[best_down]
        report["gate_up_us"][tokens], report["down_us"][tokens] = gate_up_us, down_us
        report["tiles"][tokens] = (best_gate_up, best_down) if down_us[best_down] <= MARGIN * grouped_us else None
    return report
