"""Engine benchmark on one GPU, against the memory roofline and against transformers, in one run.

    python benchmarks/engine/engine_bench.py --out bench.json --results-md benchmarks/results/engine.md

Sections (``--sections``, all by default), in the order they run:

1. ``bandwidth``: HBM bandwidth measured by a large device-to-device copy (bytes read + written),
   and the decode roofline of the model: bytes one decode step must read / bandwidth.
2. ``kernels``: the paged-attention kernel alone (decode and prefill), device time per call.
3. ``gemm``: every decode-step weight shape at 1 and 8 rows, cuBLAS against the skinny Triton
   kernel's tilings, as TB/s of weight streamed. ``moe_kernel`` (MoE models): one layer's
   routed experts through the fused-MoE Triton kernel beside its torch reference, at decode
   and prefill token counts.
4. ``decode``: batch-1 decode tokens/s through the model runner (CUDA graphs), as a fraction of
   the roofline, the replay time of the graph alone, and a profile of one eager step.
5. ``engine_offline``: the runner alone, static batches, 128/128: the engine's capacity.
6. ``offline``: output tokens/s through the in-flight-batching executor with every request
   enqueued at once, at input/output lengths 128/128, 128/2048 and 2048/128, with a breakdown
   of the executor's iteration times (prefill-carrying vs decode-only steps vs graph replay).
7. ``latency``: Poisson arrivals at fixed rates; median and p99 time to first token and
   inter-token latency, measured by the client (streaming responses).
8. ``hf``: the same model through transformers' ``generate`` with static batches (64/128/256,
   the best taken), the baseline a user would otherwise pick.

The model has random weights of a real shape (``--model llama8b``: Llama-3.1-8B, bf16;
``--model qwen3_30b_a3b``: Qwen3-30B-A3B's mixture of experts, whose decode roofline counts the
parameters a batch-1 step reads: attention, the router and 8 of 128 experts per layer), created on the GPU: nothing is loaded from disk, so the numbers are the engine's, not the
disk's. Results go to ``--out`` (JSON), a markdown table appended to ``--results-md``, and a
PNG of the latency curve next to the JSON.
"""
from __future__ import annotations

import argparse
import dataclasses
import gc
import json
import os
import random
import statistics
import sys
import threading
import time
from pathlib import Path

import torch
from tqdm import tqdm

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the checkout: engine, kernels, benchmarks

from benchmarks.common import (MODELS, add_model_arguments, command_line, copy_bandwidth, cuda_time_ms,  # noqa: E402
                               device_name, free_device_memory, git_commit, graph_call_us, insert_before_marker,
                               percentile, utc_now, write_config_only_engine)
from benchmarks.engine.step_timeline import profile_device, reset, summarize, timed  # noqa: E402
from engine.config import ModelConfig  # noqa: E402
from engine.executor.load_phases import LOAD_LOG_ENV, load_phase  # noqa: E402
from engine.executor.overlap import placeholder  # noqa: E402
from engine.executor.runner import ForwardBatch, ModelRunner  # noqa: E402
from kernels.sampling import greedy_tokens  # noqa: E402

SECTIONS = ["bandwidth", "kernels", "gemm", "fp8_gemm", "sampling", "moe_kernel", "decode", "engine_offline", "offline", "executor_decode", "latency", "hf"]
GOALS = {
    "decode_tok_s": 160.0,  # beat gpt-fast's 153.7 tok/s on the same H100
    "roofline_fraction": 0.85,
    "moe_roofline_fraction": 0.60,  # issue 13: a Qwen3-30B-A3B-shaped MoE, of its active-parameter roofline
    "offline_128_128_tok_s": 15648.0,  # TensorRT-LLM v0.13 FP16, Llama-3.1-8B, one H100
    "vs_hf": 5.0,
    "ttft_ms": 80.0,
    "itl_ms": 12.0,
}

# ------------------------------------------------------------------------------------------------
# the engine under test: random weights made on the GPU (benchmarks.common), decode through CUDA graphs
# ------------------------------------------------------------------------------------------------


def make_runner(engine_dir: str, device: str, max_tokens: int) -> ModelRunner:
    """The engine's own runner (random weights from the config-only dir), loaded as the executor
    loads it: KV pool, then GEMM choice and decode graphs, then warm-up."""
    with load_phase("weights", device):
        runner = ModelRunner(engine_dir, device=device)
    runner.allocate_kv_cache(runner.num_kv_blocks_for(max_tokens=max_tokens))
    runner.capture_cuda_graphs()  # (its own phase lines: the kernel choices, decode and prefill graphs)
    with load_phase("warm-up batch (prefill kernels)", device):
        runner.warmup()
    return runner


def param_bytes(model: torch.nn.Module) -> tuple[int, int]:
    """(all parameter bytes, embedding-table bytes) of the model; parameters that are views of one storage (Llama 4's
    shared expert, a slot of its expert stacks) counted once."""
    storages = {p.untyped_storage().data_ptr(): p.untyped_storage().nbytes() for p in model.parameters()}
    total = sum(storages.values())
    embed = model.embed_tokens.weight
    return total, embed.numel() * embed.element_size()


# ------------------------------------------------------------------------------------------------
# sections
# ------------------------------------------------------------------------------------------------


def bench_bandwidth(results: dict, model_cfg: ModelConfig, dtype_bytes: int, quantization: str | None = None) -> None:
    """Device-to-device copy of 2 GiB (counting read + write bytes), and the model's roofline."""
    bandwidth = copy_bandwidth("cuda")
    c = model_cfg
    blocks_read, blocks_all = decoder_block_params(c)
    lm_head = c.vocab_size * c.hidden_size
    embed = 0 if c.tie_word_embeddings else c.vocab_size * c.hidden_size
    read_params = blocks_read + lm_head + c.hidden_size  # + one embedding row
    all_params = blocks_all + lm_head + embed + c.hidden_size
    kv_per_token = c.num_layers * 2 * c.num_kv_heads * c.head_dim * dtype_bytes
    if c.kv_lora_rank:  # MLA: one latent row (kv_lora_rank + rope key) per token and layer, not per head
        kv_per_token = c.num_layers * (c.kv_lora_rank + c.head_dim) * dtype_bytes
    weight_bytes = read_params * dtype_bytes
    if quantization is not None:  # the blocks' linear weights quantized; norms, lm_head and the embedding row stay
        linear_params = blocks_read - c.num_layers * 2 * c.hidden_size
        linear_bytes = linear_params * QUANTIZED_BYTES_PER_WEIGHT[quantization]
        weight_bytes = linear_bytes + (read_params - linear_params) * dtype_bytes
        all_params_bytes = linear_bytes + (all_params - linear_params) * dtype_bytes
    else:
        all_params_bytes = all_params * dtype_bytes
    if getattr(c, "expert_quantization", None) == "mxfp4":  # the experts' 4-bit codes and E8M0 scales
        expert = 3 * c.hidden_size * c.moe_intermediate_size
        sparse_layers = sum(c.is_moe_layer(layer) for layer in range(c.num_layers))
        saved = dtype_bytes - MXFP4_BYTES_PER_WEIGHT
        weight_bytes -= sparse_layers * c.num_experts_per_tok * expert * saved
        all_params_bytes -= sparse_layers * c.num_experts * expert * saved
    results["bandwidth"] = {
        "copy_GBps": bandwidth / 1e9,
        "params": all_params,
        "bytes_read_per_step_ctx0": weight_bytes,
        "kv_bytes_per_token": kv_per_token,
        # The definition (every parameter once per step) and the stricter one (the
        # embedding table is gathered, not streamed: only one row is read).
        "roofline_tok_s_all_params": bandwidth / all_params_bytes,
        "roofline_tok_s": bandwidth / weight_bytes,
        "quantization": quantization,
        "moe": bool(c.num_experts),
    }


# Bytes a decode step reads per linear weight: FP8 1; INT8 per channel 1; INT4 group 128 half a
# byte plus a float16 scale and a uint8 zero per 128 weights (the kernels' layout, kernels/wna16.py).
MXFP4_BYTES_PER_WEIGHT = 0.5 + 1 / 32  # two codes a byte, one E8M0 scale byte a 32 values
QUANTIZED_BYTES_PER_WEIGHT = {"fp8": 1.0, "fp8_block": 1.0, "int8_wo": 1.0, "int8_sq": 1.0, "int4_wo": 0.5 + 3 / 128,
                              "int4_awq": 0.5 + 3 / 128}


def decoder_block_params(c: ModelConfig) -> tuple[int, int]:
    """(parameters a batch-1 decode step reads, all parameters) of the decoder blocks. A sparse
    (MoE) layer reads its router and its top-k experts only: the active-parameter roofline."""
    attention = (c.hidden_size * (c.num_heads + 2 * c.num_kv_heads) * c.head_dim
                 + c.num_heads * c.head_dim * c.hidden_size + 2 * c.hidden_size
                 + (2 * c.head_dim if getattr(c, "qk_norm", False) else 0))
    attention += 2 * c.hidden_size if c.norm_kind == "layernorm" and c.norm_bias else 0  # the norms' biases
    if c.kv_lora_rank:  # MLA (DeepSeek; head_dim is the rope key's width): q (low-rank or one q_proj),
        # kv_a_proj_with_mqa + its norm, kv_b_proj (W_UK | W_UV), o_proj, the two block norms
        qk = c.qk_nope_head_dim + c.head_dim
        q = (c.hidden_size * c.q_lora_rank + c.q_lora_rank + c.q_lora_rank * c.num_heads * qk if c.q_lora_rank
             else c.hidden_size * c.num_heads * qk)
        attention = (q + c.hidden_size * (c.kv_lora_rank + c.head_dim) + c.kv_lora_rank
                     + c.kv_lora_rank * c.num_heads * (c.qk_nope_head_dim + c.v_head_dim)
                     + c.num_heads * c.v_head_dim * c.hidden_size + 2 * c.hidden_size)
    mlp = (3 if c.mlp_gated else 2) * c.hidden_size * c.intermediate_size  # [gate | up] + down, or up + down
    shared = c.n_shared_experts * 3 * c.hidden_size * c.moe_intermediate_size  # read by every token (DeepSeek, Llama 4)
    read = total = 0
    for layer in range(c.num_layers):
        if c.is_moe_layer(layer):
            expert = 3 * c.hidden_size * c.moe_intermediate_size
            router = c.num_experts * c.hidden_size
            read += attention + router + c.num_experts_per_tok * expert + shared
            total += attention + router + c.num_experts * expert + shared
        else:
            read += attention + mlp
            total += attention + mlp
    return read, total


MOE_TILE_VARIANTS = [  # (BLOCK_N, BLOCK_K, num_warps, num_stages) of the grouped GEMMs, tried at every size
    (32, 128, 4, 4), (64, 128, 4, 4), (32, 256, 4, 3), (16, 256, 4, 4), (64, 64, 4, 4), (128, 64, 8, 3),
]


def bench_moe_kernel(results: dict, model_cfg: ModelConfig, dtype: torch.dtype,
                     token_counts=(1, 8, 64, 256, 2048)) -> None:
    """One sparse layer after its router: routing and the experts through the Triton kernels as the
    engine runs them (moe_forward; also with the routing given, and with each GEMM tiling) beside
    the torch reference, device time from graph replays (the reference, which syncs on the host,
    from CUDA events), with the expert bytes the step must read (the distinct experts hit) per
    second."""
    from kernels.fused_moe import (choose_block_m, fused_moe_ref, fused_moe_triton, gemm_config, moe_forward,
                                   route_tokens_ref)
    from kernels.linear import graph_time_ms

    c = model_cfg
    if not c.num_experts:
        return
    experts, hidden, inter, top_k = c.num_experts, c.hidden_size, c.moe_intermediate_size, c.num_experts_per_tok
    gate_up = torch.randn(experts, 2 * inter, hidden, dtype=dtype, device="cuda") * 0.02
    down = torch.randn(experts, hidden, inter, dtype=dtype, device="cuda") * 0.02
    rows = []
    for tokens in token_counts:
        x = torch.randn(tokens, hidden, dtype=dtype, device="cuda")
        # Two sets of router logits used in turn, so consecutive calls read other experts (not from L2).
        logits = [torch.randn(tokens, experts, dtype=dtype, device="cuda") for _ in range(2)]
        routings = [route_tokens_ref(row, top_k, c.norm_topk_prob) for row in logits]
        turn = iter(range(1 << 30))

        def layer():  # what a sparse layer runs after its router: routing, then the experts
            return moe_forward(x, logits[next(turn) % 2], gate_up, down, top_k, c.norm_topk_prob)

        def routed(**kwargs):  # the experts alone, routing given
            weights, ids = routings[next(turn) % 2]
            return fused_moe_triton(x, gate_up, down, weights, ids, **kwargs)

        def reference():
            return fused_moe_ref(x, gate_up, down, *route_tokens_ref(logits[0], top_k, c.norm_topk_prob))

        hit = int(torch.unique(routings[0][1]).numel())
        expert_bytes = hit * 3 * hidden * inter * gate_up.element_size()
        block_m = choose_block_m(tokens * top_k, experts)
        row = {"tokens": tokens, "experts_hit": hit, "block_m": block_m,
               "triton_us": graph_time_ms(layer, repeat=10) * 1e3,
               "triton_routing_given_us": graph_time_ms(routed, repeat=10) * 1e3,
               "torch_ref_us": cuda_time_ms(reference, repeat=5) * 1e3}
        for block_n, block_k, warps, stages in MOE_TILE_VARIANTS:
            config = {"BLOCK_N": block_n, "BLOCK_K": block_k, "num_warps": warps, "num_stages": stages}
            row[f"tiles_{block_n}_{block_k}_{warps}_{stages}_us"] = graph_time_ms(
                lambda: routed(block_m=block_m, config=config), repeat=10) * 1e3
        best = min((v, k) for k, v in row.items() if k.startswith("tiles_"))
        row["best_tiles"], row["best_tiles_us"] = best[1][len("tiles_"):-len("_us")], best[0]
        row["engine_tiles"] = "_".join(str(v) for v in gemm_config(block_m).values())
        row["expert_TBps"] = expert_bytes / row["triton_us"] / 1e6
        rows.append(row)
    results["moe_kernel"] = rows


def bench_kernels(results: dict, model_cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Paged attention alone: decode at several batch/context sizes and one prefill, as GB/s of K/V read
    (device time per call from CUDA-graph replays, so launch overhead is excluded)."""
    from kernels.attention_metadata import AttentionMetadata
    from kernels.linear import graph_time_ms
    from kernels.triton_attention import paged_attention_triton

    c, page = model_cfg, 16
    rows = []
    cases = [(batch, context, None) for batch, context in
             [(1, 1024), (1, 8192), (1, 32768), (64, 1024), (256, 256), (256, 2048)]]
    if c.sliding_window is not None:  # the model's sliding layers: only the window's K/V is read
        cases += [(batch, context, c.sliding_window) for batch, context in [(1, 8192), (1, 32768), (64, 8192)]]
    for batch, context, window in cases:
        blocks_per_seq = -(-context // page)
        num_blocks = batch * blocks_per_seq + 1
        k_cache = torch.randn(num_blocks, page, c.num_kv_heads, c.head_dim, dtype=dtype, device="cuda")
        v_cache = torch.randn_like(k_cache)
        tables = torch.randperm(num_blocks - 1, device="cuda")[: batch * blocks_per_seq].view(batch, -1).int() + 1
        meta = AttentionMetadata(
            slot_mapping=torch.zeros(batch, dtype=torch.int64, device="cuda"), block_tables=tables,
            cu_seqlens_q=torch.arange(batch + 1, dtype=torch.int32, device="cuda"),
            context_lens=torch.full((batch,), context, dtype=torch.int32, device="cuda"),
            max_seqlen_q=1, max_context_len=context, is_decode_only=True,
        )
        q = torch.randn(batch, c.num_heads, c.head_dim, dtype=dtype, device="cuda")
        ms = graph_time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, c.head_dim**-0.5,
                                                          sliding_window=window), repeat=10)
        keys_read = context if window is None else min(context, window)
        kv_bytes = 2 * batch * keys_read * c.num_kv_heads * c.head_dim * k_cache.element_size()
        rows.append({"kind": "decode" if window is None else f"decode, window {window}", "batch": batch,
                     "context": context, "us": ms * 1e3, "GBps": kv_bytes / ms / 1e6})
        del k_cache, v_cache
    # Prefill: 4 sequences of 2048 new tokens, no prefix; report TFLOP/s of the causal attention.
    batch, q_len = 4, 2048
    blocks_per_seq = q_len // page
    k_cache = torch.randn(batch * blocks_per_seq + 1, page, c.num_kv_heads, c.head_dim, dtype=dtype, device="cuda")
    v_cache = torch.randn_like(k_cache)
    meta = AttentionMetadata(
        slot_mapping=torch.zeros(batch * q_len, dtype=torch.int64, device="cuda"),
        block_tables=(torch.arange(batch * blocks_per_seq, device="cuda").view(batch, -1) + 1).int(),
        cu_seqlens_q=torch.arange(0, batch * q_len + 1, q_len, dtype=torch.int32, device="cuda"),
        context_lens=torch.full((batch,), q_len, dtype=torch.int32, device="cuda"),
        max_seqlen_q=q_len, max_context_len=q_len, is_decode_only=False,
    )
    q = torch.randn(batch * q_len, c.num_heads, c.head_dim, dtype=dtype, device="cuda")
    ms = graph_time_ms(lambda: paged_attention_triton(q, k_cache, v_cache, meta, c.head_dim**-0.5), repeat=5)
    flops = batch * 4 * c.num_heads * c.head_dim * q_len * q_len / 2
    rows.append({"kind": "prefill", "batch": batch, "context": q_len, "us": ms * 1e3, "TFLOPs": flops / ms / 1e9})
    results["kernels"] = rows


GEMM_VARIANTS = [  # (block_n, block_k, num_warps, num_stages) of the skinny Triton kernel
    (16, 512, 4, 4), (32, 256, 4, 4), (16, 256, 4, 6), (64, 128, 4, 4), (32, 512, 8, 3),
]


def bench_sampling(results: dict, model_cfg: ModelConfig, rows=(1, 8, 64, 512)) -> None:
    """Choosing the next token from float32 logits over the model's vocabulary: torch.argmax beside
    kernels.sampling.greedy_tokens (all rows greedy) and sample_tokens (Gumbel-max at temperature 0.8),
    device time per call from CUDA-graph replays."""
    from kernels.linear import graph_time_ms
    from kernels.sampling import greedy_tokens, sample_tokens

    out = []
    for m in rows:
        logits = torch.randn(m, model_cfg.vocab_size, device="cuda")
        temperature = torch.full((m,), 0.8, device="cuda")
        seeds, offsets = torch.arange(m, device="cuda"), torch.zeros(m, dtype=torch.int64, device="cuda")
        out.append({"rows": m, "vocab": model_cfg.vocab_size,
                    "torch_argmax_us": graph_time_ms(lambda: logits.argmax(-1)) * 1e3,
                    "greedy_us": graph_time_ms(lambda: greedy_tokens(logits)) * 1e3,
                    "sampled_us": graph_time_ms(lambda: sample_tokens(logits, temperature, seeds, offsets)) * 1e3})
    results["sampling"] = out


def bench_fp8_gemm(results: dict, model_cfg: ModelConfig, dtype: torch.dtype, rows=(1, 8, 64, 512)) -> None:
    """Every decoder-block weight shape at 1, 8, 64 and 512 rows: bf16 (the engine's choice of
    cuBLAS or skinny kernel) beside FP8 (W8A8: skinny kernel up to 16 rows, torch._scaled_mm beyond;
    the bf16 rows are quantized inside the timed call, as o_proj's input is), device time from graph
    replays, with the weight bytes streamed per second."""
    from kernels.fp8 import choose_fp8_skinny_variants, fp8_linear, l2_defeating_copies, quantize_weight
    from kernels.linear import ONE_ROW_SUFFIX, choose_skinny_weights, graph_time_ms, linear

    c = model_cfg
    shapes = {"qkv_proj": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
              "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size)}
    out = []
    for name, (n, k) in shapes.items():
        weight = torch.randn(n, k, device="cuda", dtype=dtype) * 0.02
        choose_skinny_weights([weight])
        w_q, w_scale = quantize_weight(weight)
        choose_fp8_skinny_variants([w_q])
        # Timed from HBM, as a decode step reads them: in turn over copies exceeding twice the L2.
        bf16_copies, fp8_copies = l2_defeating_copies(weight), l2_defeating_copies(w_q)
        for copy in bf16_copies:  # (batch 1 has a choice of its own: kernels/linear.py ONE_ROW_SUFFIX)
            for mark in ("_use_skinny_gemm", "_use_skinny_gemm" + ONE_ROW_SUFFIX):
                setattr(copy, mark, getattr(weight, mark, False))
        for copy in fp8_copies:
            copy._fp8_skinny_variant = w_q._fp8_skinny_variant
        turn = iter(range(1 << 40))
        for m in rows:
            x = torch.randn(m, k, device="cuda", dtype=dtype)
            bf16_ms = graph_time_ms(lambda: linear(x, bf16_copies[next(turn) % len(bf16_copies)]))
            fp8_ms = graph_time_ms(lambda: fp8_linear(x, fp8_copies[next(turn) % len(fp8_copies)], w_scale))
            out.append({"name": name, "n": n, "k": k, "m": m, "bf16_ms": bf16_ms, "fp8_ms": fp8_ms,
                        "bf16_TBps": n * k * 2 / bf16_ms / 1e9, "fp8_TBps": n * k / fp8_ms / 1e9,
                        "fp8_variant": list(w_q._fp8_skinny_variant)})
        del weight, w_q, bf16_copies, fp8_copies
    results["fp8_gemm"] = out


def bench_gemm(results: dict, model_cfg: ModelConfig, dtype: torch.dtype) -> None:
    """Every decode-step weight shape at 1 and 8 rows: cuBLAS (F.linear) vs the skinny Triton kernel
    variants, device time from graph replays, as TB/s of weight streamed."""
    import torch.nn.functional as F

    from kernels.linear import graph_time_ms, skinny_linear_triton

    c = model_cfg
    shapes = {"qkv_proj": ((c.num_heads + 2 * c.num_kv_heads) * c.head_dim, c.hidden_size),
              "o_proj": (c.hidden_size, c.num_heads * c.head_dim),
              "gate_up_proj": (2 * c.intermediate_size, c.hidden_size),
              "down_proj": (c.hidden_size, c.intermediate_size), "lm_head": (c.vocab_size, c.hidden_size)}
    rows = []
    for name, (n, k) in shapes.items():
        weights = [torch.randn(n, k, dtype=dtype, device="cuda") * 0.02 for _ in range(2)]  # 2: defeat L2 reuse
        for m in (1, 8):
            x = torch.randn(m, k, dtype=dtype, device="cuda")
            flip = iter(range(1 << 30))

            def pick():
                return weights[next(flip) % 2]

            row = {"name": name, "n": n, "k": k, "m": m,
                   "cublas_us": graph_time_ms(lambda: F.linear(x, pick())) * 1e3}
            for variant in GEMM_VARIANTS:
                bn, bk, warps, stages = variant
                row[f"triton_{bn}_{bk}_{warps}_{stages}_us"] = graph_time_ms(
                    lambda: skinny_linear_triton(x, pick(), block_n=bn, block_k=bk, num_warps=warps,
                                                 num_stages=stages)) * 1e3
            best = min((v, key) for key, v in row.items() if key.startswith("triton_"))
            row["best_triton"] = best[1]
            row["weight_TBps_cublas"] = n * k * weights[0].element_size() / row["cublas_us"] / 1e6
            row["weight_TBps_best_triton"] = n * k * weights[0].element_size() / best[0] / 1e6
            rows.append(row)
        del weights
    results["gemm"] = rows


def decode_batch(token: int, position: int, table: list[int], page: int) -> ForwardBatch:
    return ForwardBatch([token], [position], [1], [position + 1], [table[: position // page + 1]], [0])


def decode_synchronous(runner: ModelRunner, token: int, position: int, table: list[int], page: int,
                       steps: int, forward_times: list[float] | None = None) -> tuple[list[int], list[float]]:
    """Greedy batch-1 decode from ``token`` at ``position``, each step's token read on the host before
    the next step starts (the executor's synchronous path): (tokens, seconds a step). The token is the sampler's
    greedy pick (kernels/sampling.greedy_tokens, as the executor's greedy rows), not torch.argmax: one program per
    row, ~26 us for one row of 128k logits on an H100 against 3.4 (kernels/sampling.py), would add its own time;
    where the decode graph's head graph picked it (runner.forward's graph_logits, as the executor asks), its ids
    (pick_greedy). ``forward_times``: gets
    each step's host seconds in runner.forward (inputs packed and copied, graph and LM head launched: the
    host's part of the step before the replay and the launches behind it)."""
    tokens, step_times = [], []
    for i in range(steps):
        started = time.perf_counter()
        logits = runner.forward(decode_batch(token, position + i, table, page), graph_logits=True)
        if forward_times is not None:
            forward_times.append(time.perf_counter() - started)
        token = int(pick_greedy(runner, logits).item())  # the sampler's sync: the next input needs this token
        tokens.append(token)
        step_times.append(time.perf_counter() - started)
    return tokens, step_times


def pick_greedy(runner: ModelRunner, logits: torch.Tensor) -> torch.Tensor:
    """The greedy ids of a step's logits as the executor's sampler takes them: the decode graph's head graph's
    (runner.greedy_of) where it picked them, else greedy_tokens."""
    greedy = runner.greedy_of(logits)
    return greedy_tokens(logits) if greedy is None else greedy


def decode_overlapped(runner: ModelRunner, token: int, position: int, table: list[int], page: int,
                      steps: int) -> tuple[list[int], list[float]]:
    """decode_synchronous as the executor overlaps it (its default, engine/executor/overlap.py): step i + 1
    is launched with its token a placeholder for the one step i sampled on the device (the runner's
    sampled_tokens ring, slot 0), before step i's token reaches the host (a pinned copy and an event),
    so the host's next-step work runs while the device computes. (tokens, seconds between step ends)."""
    pinned = runner.device.type == "cuda"
    host = [torch.empty(1, dtype=torch.int64, pin_memory=pinned) for _ in range(2)]
    ready = [torch.cuda.Event() if pinned else None for _ in range(2)]
    tokens, step_times, started = [], [], time.perf_counter()

    def read(step: int) -> None:
        if pinned:
            ready[step % 2].synchronize()
        tokens.append(int(host[step % 2][0]))

    for i in range(steps):
        batch = decode_batch(token if i == 0 else placeholder(0), position + i, table, page)
        batch = dataclasses.replace(batch, sampled_tokens_slot=0)
        logits = runner.forward(batch, graph_logits=True)
        sampled = pick_greedy(runner, logits)
        runner.store_sampled_tokens(sampled, batch)
        host[i % 2].copy_(sampled, non_blocking=pinned)
        if pinned:
            ready[i % 2].record()
        if i:
            read(i - 1)  # step i - 1's token, while step i runs
            now = time.perf_counter()
            step_times.append(now - started)
            started = now
    read(steps - 1)
    return tokens, step_times


def _decode_loops_ab(runner: ModelRunner, token: int, position: int, table: list[int], page: int, steps: int,
                     rounds: int, graphs, attribute: str, ways: dict[str, bool]) -> dict:
    """decode_synchronous and decode_overlapped with ``graphs.<attribute>`` set to each of ``ways``' values in turn,
    ``rounds`` times (restored after): per way the median step of each loop and the median host time in
    runner.forward (ms; the first 16 steps of each loop left out), and whether every loop gave the same tokens."""
    was, out, tokens = getattr(graphs, attribute), {}, set()
    series = {(way, part): [] for way in ways for part in ("sync", "forward", "overlapped")}
    try:
        for _ in range(rounds):
            for way, value in ways.items():
                setattr(graphs, attribute, value)
                forward: list[float] = []
                ids, times = decode_synchronous(runner, token, position, table, page, steps, forward)
                series[way, "sync"] += times[16:]
                series[way, "forward"] += forward[16:]
                again, times = decode_overlapped(runner, token, position, table, page, steps)
                series[way, "overlapped"] += times[16:]
                tokens.update((tuple(ids), tuple(again)))
    finally:
        setattr(graphs, attribute, was)
    for (way, part), values in series.items():
        out[f"{way}_{part}_ms"] = statistics.median(values) * 1e3
    out["same_tokens"] = len(tokens) == 1
    return out


def decode_input_copies_ab(runner: ModelRunner, token: int, position: int, table: list[int], page: int,
                           steps: int = 128, rounds: int = 2) -> dict | None:
    """The decode graphs' inputs copied one by one (``separate``: DecodeGraphs.separate_copies, as before their
    staging buffer) against in one copy (``one``), by _decode_loops_ab. None without decode graphs."""
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is None or not hasattr(graphs, "separate_copies"):
        return None
    return _decode_loops_ab(runner, token, position, table, page, steps, rounds, graphs, "separate_copies",
                            {"separate": True, "one": False})


def decode_head_graph_ab(runner: ModelRunner, token: int, position: int, table: list[int], page: int,
                         steps: int = 128, rounds: int = 2) -> dict | None:
    """The decode graph's LM head and greedy pick launched eagerly after the replay (``eager``) against replayed
    from its head graph (``graph``, cuda_graphs.py), by _decode_loops_ab. None without a head graph at batch 1."""
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is None or graphs.bucket_for(1) not in getattr(graphs, "head_graphs", {}):
        return None
    return _decode_loops_ab(runner, token, position, table, page, steps, rounds, graphs, "use_head_graphs",
                            {"eager": False, "graph": True})


def decode_host_parts(runner: ModelRunner, token: int, position: int, table: list[int], page: int,
                      steps: int = 128) -> dict | None:
    """Where the host time of a synchronous batch-1 step goes (decode_synchronous's loop, timed part by part; ms,
    medians past the first 16 steps): ``to_replay_ms`` from runner.forward's call to the graph's replay() (the
    inputs packed and copied), ``replay_ms`` the replay() call (cudaGraphLaunch), ``after_replay_ms`` the rest of
    runner.forward (the LM head's launch), ``pick_ms`` the token pick's launches (greedy_tokens), ``wait_ms`` the
    token's .item() (the device's graph, LM head and pick, less what the host spent after the replay), ``step_ms``
    the whole step. The GPU idles from a step's .item() to its next replay reaching the device: ``to_replay_ms``
    plus the loop's own work and the launch's latency. ``to_replay_ms`` in parts: ``enter_ms`` forward's call to
    DecodeGraphs.run's wait for the last copy (inference mode, try_run, fits, the bucket), ``copy_wait_ms`` that wait
    (an event synchronize), ``pack_ms`` fill_decode_inputs, ``copy_ms`` the splits and the staging copy's call,
    ``copy_record_ms`` the copy's event record, ``to_launch_ms`` from it to the replay() call. The LM head and pick
    run eagerly here (no graph_logits). None without decode graphs."""
    import engine.executor.cuda_graphs as cuda_graphs

    graphs = getattr(runner, "decode_graphs", None)
    if graphs is None:
        return None
    graph = graphs.graphs[graphs.bucket_for(1)]
    replay, marks = graph.replay, [0.0] * 8
    fill, event = cuda_graphs.fill_decode_inputs, graphs._copied

    def timed_replay() -> None:
        marks[0] = time.perf_counter()
        replay()
        marks[1] = time.perf_counter()

    def timed_fill(*args) -> None:
        marks[4] = time.perf_counter()
        fill(*args)
        marks[5] = time.perf_counter()

    class TimedEvent:  # DecodeGraphs.run's copy event: its synchronize and record timed
        def synchronize(self) -> None:
            marks[2] = time.perf_counter()
            event.synchronize()
            marks[3] = time.perf_counter()

        def record(self) -> None:
            marks[6] = time.perf_counter()
            event.record()
            marks[7] = time.perf_counter()

    names = ("to_replay", "replay", "after_replay", "pick", "wait", "step", "enter", "copy_wait", "pack", "copy",
             "copy_record", "to_launch")
    series = {name: [] for name in names}
    graph.replay = timed_replay  # (an instance attribute: DecodeGraphs.run calls it)
    graphs._copied, cuda_graphs.fill_decode_inputs = TimedEvent(), timed_fill
    try:
        for i in range(steps):
            began = time.perf_counter()
            batch = decode_batch(token, position + i, table, page)
            called = time.perf_counter()
            logits = runner.forward(batch)
            returned = time.perf_counter()
            picked = greedy_tokens(logits)
            launched = time.perf_counter()
            token = int(picked.item())
            ended = time.perf_counter()
            for name, value in (("to_replay", marks[0] - called), ("replay", marks[1] - marks[0]),
                                ("after_replay", returned - marks[1]), ("pick", launched - returned),
                                ("wait", ended - launched), ("step", ended - began), ("enter", marks[2] - called),
                                ("copy_wait", marks[3] - marks[2]), ("pack", marks[5] - marks[4]),
                                ("copy", marks[6] - marks[5]), ("copy_record", marks[7] - marks[6]),
                                ("to_launch", marks[0] - marks[7])):
                series[name].append(value)
    finally:
        del graph.replay
        graphs._copied, cuda_graphs.fill_decode_inputs = event, fill
    return {f"{name}_ms": statistics.median(values[16:]) * 1e3 for name, values in series.items()}


def host_call_costs(runner: ModelRunner, calls: int = 200) -> dict | None:
    """What each host call of a decode step costs on this machine alone, in a loop of ``calls`` (us a call, median of
    5 loops), the GPU idle: ``pinned_copy`` the decode graphs' staging copy at batch 1 (copy_ of the bucket-1 span,
    non_blocking, from the pinned buffer), ``event_record`` / ``event_sync`` their copy event's record and wait (the
    event done), ``empty`` a torch.empty on the device, ``replay`` the batch-1 graph's replay() call and ``head_replay``
    its head graph's (where captured), ``greedy_launch`` greedy_tokens of one row (3 allocations, 2 Triton launches),
    ``python_pack`` fill_decode_inputs of one row. Says what of decode_host_parts' "to the replay" is CUDA calls and
    what Python. None without decode graphs."""
    from engine.executor.cuda_graphs import fill_decode_inputs

    graphs = getattr(runner, "decode_graphs", None)
    if graphs is None or runner.device.type != "cuda":
        return None
    end = graphs._tables_at + graphs.max_blocks  # (the bucket-1 span, as DecodeGraphs.run copies it)
    dev, host, event = graphs.dev_staging[:end], graphs.host_staging[:end], torch.cuda.Event()
    event.record()
    logits = torch.zeros(1, runner.vocab_size, dtype=torch.float32, device=runner.device)
    np_i64, np_ctx, np_tables = graphs._np_i64.copy(), graphs._np_ctx.copy(), graphs._np_tables.copy()
    page = runner.tokens_per_block
    table = [1, 2]  # (a row at position page + 1: its slot in the table's second block)
    work = {"pinned_copy": lambda: dev.copy_(host, non_blocking=True), "event_record": event.record,
            "event_sync": event.synchronize, "empty": lambda: torch.empty(1, dtype=torch.int64, device=runner.device),
            "greedy_launch": lambda: greedy_tokens(logits),
            "python_pack": lambda: fill_decode_inputs(np_i64, np_ctx, np_tables, [5], [page + 1], [page + 2], [table],
                                                      page, 1)}
    if 1 in graphs.graphs:
        work["replay"] = graphs.graphs[1].replay
    if 1 in getattr(graphs, "head_graphs", {}):
        work["head_replay"] = graphs.head_graphs[1].replay
    out = {}
    for name, call in work.items():
        loops = []
        for _ in range(5):
            torch.cuda.synchronize()
            started = time.perf_counter()
            for _ in range(calls if "replay" not in name else 20):  # (a replay queues a whole graph's work)
                call()
            loops.append((time.perf_counter() - started) / (calls if "replay" not in name else 20) * 1e6)
        out[f"{name}_us"] = statistics.median(loops)
    torch.cuda.synchronize()
    return out


def decode_outside_graph_text(d: dict) -> str:
    """The decode entry's parts outside the graph as one clause: LM head, argmax, host in forward, and the
    A/B of the inputs' copies ("" where they were not measured)."""
    parts, ab, host = d.get("step_parts"), d.get("input_copies_ab"), d.get("host_parts")
    head = d.get("head_graph_ab")
    text = f"host in forward {d['host_forward_ms_median']:.3f} ms" if "host_forward_ms_median" in d else ""
    if host:
        text += (f" (synchronous step's host, head eager: to the replay {host['to_replay_ms']:.3f} = enter "
                 f"{host.get('enter_ms', float('nan')):.3f} + copy wait {host.get('copy_wait_ms', float('nan')):.3f} "
                 f"+ pack {host.get('pack_ms', float('nan')):.3f} + copy {host.get('copy_ms', float('nan')):.3f} + "
                 f"record {host.get('copy_record_ms', float('nan')):.3f} + to launch "
                 f"{host.get('to_launch_ms', float('nan')):.3f}, replay() "
                 f"{host['replay_ms']:.3f}, after it {host['after_replay_ms']:.3f}, pick {host['pick_ms']:.3f}, "
                 f".item() {host['wait_ms']:.3f}, step {host['step_ms']:.3f} ms)")
    if parts:
        text += (f"; alone: graph {parts['graph_ms']:.3f}, LM head {parts['lm_head_ms']:.3f}, argmax "
                 f"{parts['argmax_ms']:.3f} ms (device only: LM head {parts.get('lm_head_device_ms', float('nan')):.3f}, "
                 f"argmax {parts.get('argmax_device_ms', float('nan')):.3f}); graph + LM head + argmax back to back "
                 f"{parts['step_sustained_ms']:.3f} ms")
    if ab:
        text += (f"; inputs copied one by one -> in one copy: step {ab['separate_sync_ms']:.3f} -> "
                 f"{ab['one_sync_ms']:.3f} ms, host in forward {ab['separate_forward_ms']:.3f} -> "
                 f"{ab['one_forward_ms']:.3f}, overlapped {ab['separate_overlapped_ms']:.3f} -> "
                 f"{ab['one_overlapped_ms']:.3f} (same tokens: {ab['same_tokens']})")
    costs = d.get("host_call_costs")
    if costs:
        text += "; host calls alone, us: " + ", ".join(f"{k[:-3]} {v:.1f}" for k, v in costs.items())
    if head:
        text += (f"; LM head + pick launched -> in a head graph: step {head['eager_sync_ms']:.3f} -> "
                 f"{head['graph_sync_ms']:.3f} ms, host in forward {head['eager_forward_ms']:.3f} -> "
                 f"{head['graph_forward_ms']:.3f}, overlapped {head['eager_overlapped_ms']:.3f} -> "
                 f"{head['graph_overlapped_ms']:.3f} (same tokens: {head['same_tokens']})")
    errors = [f"{key}: {d[key]}" for key in ("host_parts_error", "step_parts_error", "input_copies_ab_error",
                                             "head_graph_ab_error", "host_call_costs_error") if key in d]
    return text + "".join(f"; FAILED {error}" for error in errors)


def bench_decode(results: dict, runner: ModelRunner, prompt_len: int = 128, steps: int = 256) -> None:
    """Greedy batch-1 decode through runner.forward, with the host sync a sampler makes per token; and
    overlapped as the executor runs it by default (decode_overlapped), the same tokens."""
    page = runner.tokens_per_block
    table = list(range(1, -(-(prompt_len + steps + 1) // page) + 1))
    prompt = [random.randrange(runner.vocab_size) for _ in range(prompt_len)]
    logits = runner.forward(ForwardBatch(prompt, list(range(prompt_len)), [prompt_len], [prompt_len],
                                         [table[: -(-prompt_len // page)]], [prompt_len - 1]))
    token = int(logits.argmax(-1).item())
    forward_times: list[float] = []
    tokens, step_times = decode_synchronous(runner, token, prompt_len, table, page, steps, forward_times)
    steady = step_times[16:]
    tok_s = len(steady) / sum(steady)
    entry = {"prompt_len": prompt_len, "steps": steps, "tok_s": tok_s,
             "step_ms_median": statistics.median(steady) * 1e3, "step_ms_p99": percentile(steady, 99) * 1e3,
             "host_forward_ms_median": statistics.median(forward_times[16:]) * 1e3}
    overlapped_tokens, overlapped_times = decode_overlapped(runner, token, prompt_len, table, page, steps)
    overlapped = overlapped_times[16:]
    entry.update(overlapped_tok_s=len(overlapped) / sum(overlapped),
                 overlapped_step_ms_median=statistics.median(overlapped) * 1e3,
                 overlapped_same_tokens=overlapped_tokens == tokens)
    graphs = getattr(runner, "decode_graphs", None)
    if graphs is not None and runner.device.type == "cuda":
        graph = graphs.graphs[graphs.bucket_for(1)]
        entry["graph_replay_ms"] = cuda_time_ms(graph.replay, repeat=50)
        # Before the profiler: its window leaves CUPTI attached for good, which slows every launch (session 28's
        # first run had them after it: the graph alone 2.93 ms there against 2.62 before it)
        parts = {"host_parts": lambda: decode_host_parts(runner, token, prompt_len, table, page),
                 "step_parts": lambda: decode_step_parts(runner, 1),  # what a step runs on the device outside its graph
                 "input_copies_ab": lambda: decode_input_copies_ab(runner, token, prompt_len, table, page),
                 "head_graph_ab": lambda: decode_head_graph_ab(runner, token, prompt_len, table, page),
                 "host_call_costs": lambda: host_call_costs(runner)}
        for name, measure in parts.items():
            try:  # (diagnostics, each on its own: a failure must not cost the run the other figures)
                entry[name] = measure()
            except Exception as error:  # noqa: BLE001
                entry[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        try:  # (a profiler failure must not cost the run its figures)
            entry["graph_step_kernels"], entry["graph_step_profile"] = profile_graph_step(graph)
        except Exception as error:  # noqa: BLE001
            entry["graph_step_profile"] = f"failed: {type(error).__name__}: {error}"
    if runner.device.type == "cuda":
        entry["eager_step_profile"] = profile_eager_step(runner, token, prompt_len + steps, table, page)
    roof = results.get("bandwidth")
    if roof:
        context_bytes = (prompt_len + steps / 2) * roof["kv_bytes_per_token"]
        roofline = roof["copy_GBps"] * 1e9 / (roof["bytes_read_per_step_ctx0"] + context_bytes)
        entry["roofline_tok_s"] = roofline
        entry["roofline_fraction"] = tok_s / roofline
        entry["roofline_fraction_all_params"] = tok_s / roof["roofline_tok_s_all_params"]
    entry["launch_choice"] = getattr(runner, "launch_choice", None)  # PDL on or off, as timed at load
    entry["gemm_choices"] = {"x".join(map(str, shape)): {key: str(untimed(v)) for key, v in untimed(choice).items()}
                             for shape, choice in (getattr(runner, "gemm_choices", None) or {}).items()}
    entry["kernel_choice_cache"] = getattr(runner, "choice_cache_counts", None)  # {"hits", "lookups", "families"}
    results["decode"] = entry


def untimed(report):
    """A load-time choice's report as recorded: as timed, or for a choice read from the choice cache
    (kernels/choice_cache.py, "cached": True) without the timings (an earlier load's, not this run's)."""
    if isinstance(report, dict) and report.get("cached"):
        return {k: v for k, v in report.items() if not (k in ("us", "all_us") or k.endswith(("_us", "_ms")))}
    return report


def bench_engine_offline(results: dict, runner: ModelRunner, num_requests: int, in_len: int, out_len: int,
                         batch: int, max_num_tokens: int) -> None:
    """The runner alone, statically batched (no executor): waves of ``batch`` requests, prompts
    prefilled in steps of at most max_num_tokens, then greedy decode through the graphs with one
    host sync per step. The engine's capacity, to set against what the executor delivers."""
    page = runner.tokens_per_block
    blocks_per_seq = -(-(in_len + out_len) // page)
    rng = random.Random(0)
    started, output_tokens = time.perf_counter(), 0
    for wave_start in range(0, num_requests, batch):
        n = min(batch, num_requests - wave_start)
        tables = [list(range(1 + i * blocks_per_seq, 1 + (i + 1) * blocks_per_seq)) for i in range(n)]
        per_step = max(1, max_num_tokens // in_len)
        tokens = []
        for first in range(0, n, per_step):
            rows = range(first, min(n, first + per_step))
            prompt_blocks = -(-in_len // page)
            logits = runner.forward(ForwardBatch(
                [rng.randrange(runner.vocab_size) for _ in rows for _ in range(in_len)],
                [p for _ in rows for p in range(in_len)], [in_len] * len(rows), [in_len] * len(rows),
                [tables[i][:prompt_blocks] for i in rows], [(j + 1) * in_len - 1 for j in range(len(rows))]))
            tokens += logits.argmax(-1).tolist()
        output_tokens += n
        for step in range(out_len - 1):
            position = in_len + step
            width = position // page + 1
            logits = runner.forward(ForwardBatch(tokens, [position] * n, [1] * n, [position + 1] * n,
                                                 [t[:width] for t in tables], list(range(n))))
            tokens = logits.argmax(-1).tolist()
            output_tokens += n
    elapsed = time.perf_counter() - started
    results["engine_offline"] = {"input_len": in_len, "output_len": out_len, "requests": num_requests, "batch": batch,
                                 "seconds": elapsed, "output_tok_s": output_tokens / elapsed}


def profile_eager_step(runner: ModelRunner, token: int, position: int, table: list[int], page: int) -> str:
    """Top GPU kernels of one decode step run eagerly (no graph): where the step's time goes."""
    from torch.profiler import ProfilerActivity, profile

    batch = decode_batch(token, position, table, page)
    for _ in range(2):
        ModelRunner.forward(runner, batch)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        ModelRunner.forward(runner, batch)
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)


def profile_graph_step(graph, replays: int = 20) -> tuple[list[dict], str]:
    """Kernels of a captured decode step over ``replays`` back-to-back replays (torch.profiler; CUPTI
    lists a graph's kernels): step_timeline.critical_path's share of each (kernel, the kernel before
    it) a replay -- its end minus the later of its start and the previous kernel's end -- and its
    mean duration as the profiler reports it. Why both: a kernel launched with PDL starts while the
    one before it runs and waits for it, so its duration holds its predecessor's tail (2026-11-29,
    V2-Lite's eager profile with PDL on: rms_norm 15.6 us a call, 3.6 with PDL off); the shares add
    up to the replay's span less the idle time. Returns (rows, a text table)."""
    from torch.autograd import DeviceType
    from torch.profiler import ProfilerActivity, profile

    from benchmarks.engine.step_timeline import critical_path

    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(replays):
            graph.replay()
        torch.cuda.synchronize()
    kernels = sorted((e.time_range.start, e.time_range.end, e.name) for e in prof.events()
                     if e.device_type == DeviceType.CUDA and e.time_range.end > e.time_range.start)
    if len(kernels) < 2:
        return [], f"no kernels recorded ({len(kernels)})"
    durations: dict[str, list[float]] = {}
    for start, end, name in kernels:
        durations.setdefault(name[:28], []).append(end - start)
    rows = critical_path(kernels, replays, context=1)
    for row in rows:
        row["mean_duration_us"] = statistics.mean(durations[row["kernel"]])
    span = (kernels[-1][1] - kernels[0][0]) / replays
    lines = [f"{'kernel':<28} {'after':<28} {'calls':>5} {'us/step':>8} {'us/call':>8} {'duration':>8}"]
    lines += [f"{r['kernel']:<28} {r['after']:<28} {r['count_per_step']:>5.0f} {r['us_per_step']:>8.1f} "
              f"{r['mean_us']:>8.2f} {r['mean_duration_us']:>8.2f}" for r in rows]
    lines.append(f"shares {sum(r['us_per_step'] for r in rows):.1f} us of a replay's {span:.1f} us "
                 f"(top {len(rows)} rows; 'duration': the kernel's mean start-to-end, PDL waits included)")
    return rows, "\n".join(lines)


def drain_offline(executor, num_requests: int, on_final=None) -> int:
    """Collect responses until `num_requests` requests have finished; returns the output tokens of
    their final responses (non-streaming requests: the final response holds every token).
    An error response is a failed benchmark, not a data point."""
    output_tokens = finished = 0
    while finished < num_requests:
        for response in executor.await_responses(timeout=1.0):
            if response.error:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
            if response.result.is_final:
                finished += 1
                output_tokens += len(response.result.output_token_ids[0])
                if on_final is not None:
                    on_final()
    return output_tokens


def bench_offline(results: dict, executor, vocab: int, shapes: list[tuple[int, int, int]], profile: bool = False) -> None:
    """All requests enqueued at once; output tokens / wall time until the last one finishes."""
    from engine.executor.request import OutputConfig, Request

    rows = []
    for in_len, out_len, num_requests in shapes:
        rng = random.Random(in_len * 7919 + out_len)
        requests = [Request(input_token_ids=[rng.randrange(vocab) for _ in range(in_len)], max_tokens=out_len,
                            output=OutputConfig(exclude_input_from_output=True)) for _ in range(num_requests)]
        history_since_ns = time.time_ns()
        profiler = profile_executor_loop(executor) if profile else None
        started = time.perf_counter()
        executor.enqueue_requests(requests)
        bar = tqdm(total=num_requests, desc=f"offline {in_len}/{out_len}", leave=False)
        output_tokens = drain_offline(executor, num_requests, on_final=lambda: bar.update(1))
        bar.close()
        elapsed = time.perf_counter() - started
        row = {"input_len": in_len, "output_len": out_len, "requests": num_requests, "seconds": elapsed,
               "output_tok_s": output_tokens / elapsed, "total_tok_s": (output_tokens + in_len * num_requests) / elapsed}
        row.update(iteration_breakdown(executor, history_since_ns))
        if profiler is not None:
            row["executor_profile"] = profiler()
        rows.append(row)
    results["offline"] = rows


def bench_executor_decode(executor, vocab: int, batch: int, prompt_len: int = 128, out_len: int = 256,
                          profile_seconds: float = 0.0, temperature: float = 0.0, top_p: float = 1.0) -> dict:
    """``batch`` requests enqueued at once (random prompts of ``prompt_len``, ``out_len`` tokens
    each) through the executor. decode_tok_s: ``batch`` over the median step period of the step
    timeline (else x the median request's decode rate, from its first- and last-token times);
    output_tok_s: all tokens over the wall time. With a timed runner (benchmarks/engine/step_timeline.py) the step timeline is attached,
    and with ``profile_seconds`` a profiler window of the steady decode (exact device idle time), opened once
    half the steps (at most 128) ran: ``timeline`` (and decode_tok_s) are the steps before it,
    ``timeline_after_profile`` those after. The first window of a process leaves CUPTI attached for good (torch
    keeps it with CUDA graphs), so only the batch run first is timed without it (``cupti_attached`` False).
    ``temperature`` > 0: every request samples (seeded per request), with nucleus ``top_p`` (1.0: none)."""
    global _PROFILED
    from engine.executor.request import OutputConfig, Request, SamplingConfig

    rng = random.Random(batch * 7 + prompt_len)
    output = OutputConfig(exclude_input_from_output=True, return_perf_metrics=True)
    requests = [Request(input_token_ids=[rng.randrange(vocab) for _ in range(prompt_len)], max_tokens=out_len,
                        output=output,
                        sampling=SamplingConfig(temperature=temperature, top_p=top_p, seed=i) if temperature > 0
                        else SamplingConfig()) for i in range(batch)]
    started = time.perf_counter()
    executor.enqueue_requests(requests)
    profiled, window, cupti_attached = None, None, _PROFILED
    if profile_seconds and executor.runner.device.type == "cuda":
        # Once every request decodes (prefill done, half the steps at this batch size), profile a window.
        local = getattr(executor.runner, "runner", executor.runner)
        size, wanted = min(batch, local.build_config.max_batch_size), max(16, min(out_len // 2, 128))
        seen, changed = 0, time.perf_counter()
        while True:  # (list(): a copy made under the GIL; the loop thread appends meanwhile)
            steps = sum(1 for step in list(local.__dict__.get("timeline", ())) if step[0] == size)
            if steps >= wanted or (steps and steps == seen and time.perf_counter() - changed > 2.0):
                break  # enough steps, or no new one for 2 s (the requests are done)
            if steps != seen:
                seen, changed = steps, time.perf_counter()
            time.sleep(0.001)
        window = time.perf_counter()
        _PROFILED = True
        profiled = profile_device(executor.runner, profile_seconds)
        window = (window, time.perf_counter())
    rates, tokens = [], 0
    while len(rates) < batch:
        for response in executor.await_responses(timeout=1.0):
            if response.error:
                raise RuntimeError(f"request {response.request_id} failed: {response.error}")
            if response.result.is_final:
                n, perf = len(response.result.output_token_ids[0]), response.result.perf
                tokens += n
                rates.append((n - 1) / max(1e-9, (perf.last_token_time_ns - perf.first_token_time_ns) / 1e9))
    elapsed = time.perf_counter() - started
    row = {"batch": batch, "prompt_len": prompt_len, "output_len": out_len, "temperature": temperature, "top_p": top_p,
           "decode_tok_s": batch * statistics.median(rates), "output_tok_s": tokens / elapsed}
    timeline = summarize(executor.runner, since=started, until=window[0] if window else None)  # this run only
    if batch in timeline:
        row["timeline"] = timeline[batch]
        # The median step period: unlike the requests' own rates, untouched by the profiled window.
        row["decode_tok_s"] = batch * 1e3 / timeline[batch]["period_ms"]
    if window is not None:
        row["cupti_attached"] = cupti_attached
        after = summarize(executor.runner, since=window[1])
        if batch in after:
            row["timeline_after_profile"] = after[batch]
    graphs = getattr(getattr(executor.runner, "runner", executor.runner), "decode_graphs", None)
    if hasattr(graphs, "replays"):
        row["graph_replays"] = {str(bucket): count for bucket, count in sorted(graphs.replays.items())}
    if profiled is not None:
        row["profile"] = profiled
    if executor.runner.device.type == "cuda":  # the step's parts alone, beside its period in the timeline
        try:  # (a diagnostic: a runner it does not know must not cost the run its figures)
            row["step_parts"] = decode_step_parts(executor.runner, min(batch, executor.max_batch_size))
        except Exception as error:
            row["step_parts_error"] = repr(error)[:300]
    return row


_PROFILED = False  # a torch.profiler window ran in this process (CUPTI stays attached: bench_executor_decode)


def executor_decode_line(row: dict) -> str:
    """One line of a bench_executor_decode row as soon as it is measured: the step timeline before and
    after the profiler window, the graph replays and the loop thread's CPU time."""
    def part(t: dict | None) -> str:
        if not t:
            return "no steps"
        return (f"period {t['period_ms']:.3f} ms (p10/p90 {t.get('period_ms_p10_p90')}), host in forward "
                f"{t['host_ms']:.3f} ms (CPU {t.get('cpu_in_forward_ms', float('nan')):.3f}, graph run "
                f"{t.get('graph_host_ms', float('nan')):.3f}), GPU in forward {t['gpu_ms']:.3f} ms, "
                f"{t.get('graph_steps', 0)}/{t['steps']} steps replayed a graph")
    return (f"[executor_decode] batch {row['batch']}: {row['decode_tok_s']:,.1f} decode tok/s; before the profiler "
            f"window{' (CUPTI attached earlier)' if row.get('cupti_attached') else ''}: {part(row.get('timeline'))}; "
            f"after: {part(row.get('timeline_after_profile'))}; graph replays by bucket {row.get('graph_replays')}"
            f"{decode_step_parts_text(row.get('step_parts'))}")


def iteration_breakdown(executor, since_ns: int) -> dict:
    """Where the wall time went, from the executor's own per-iteration stats: prefill-carrying
    iterations vs decode-only ones, and the decode-only step time at the largest batch seen,
    next to the replay time of its CUDA graph (the GPU floor of that step)."""
    # The executor keeps its last iter_stats_max_iterations iterations; long runs see only those.
    history = [h for h in executor.get_iteration_stats_history() if h.timestamp_ns >= since_ns]
    with_context = [h for h in history if h.num_context_requests > 0]
    decode_only = [h for h in history if h.num_context_requests == 0 and h.num_gen_requests > 0]
    out = {"iterations": len(history), "context_iterations": len(with_context),
           "context_seconds": sum(h.iter_latency_ms for h in with_context) / 1e3,
           "decode_iterations": len(decode_only),
           "decode_seconds": sum(h.iter_latency_ms for h in decode_only) / 1e3}
    if decode_only:
        widest = max(h.num_gen_requests for h in decode_only)
        steps = [h.iter_latency_ms for h in decode_only if h.num_gen_requests == widest]
        out.update(decode_batch=widest, decode_step_ms_median=statistics.median(steps))
        # the three slowest decode-only iterations (index among the run's iterations, ms): a stall (a compile, a
        # planner, a pool growing) shows as a sum far above median x count
        out["decode_slowest"] = sorted(((i, h.iter_latency_ms) for i, h in enumerate(history)
                                        if h.num_context_requests == 0 and h.num_gen_requests > 0),
                                       key=lambda pair: -pair[1])[:3]
        graphs = getattr(executor.runner, "decode_graphs", None)
        # (not with tensor-parallel ranks: their graphs hold all-reduces, which a replay on rank 0 alone waits in
        # forever: encdec_bench --tp 2 hung here on the H200s, 2026-11-30; tp_bench.py step_periods skips it too)
        if graphs is not None and widest <= graphs.max_batch_size and executor.runner.build_config.tp_size == 1:
            out["decode_graph_replay_ms"] = cuda_time_ms(graphs.graphs[graphs.bucket_for(widest)].replay, repeat=10)
            if os.environ.get(STEP_PARTS_ENV) == "1":  # (~3 s a run: off unless asked)
                try:  # (a diagnostic: a runner it does not know must not cost the run its figures)
                    out["decode_step_parts"] = decode_step_parts(executor.runner, widest)
                except Exception as error:
                    out["decode_step_parts_error"] = repr(error)[:300]
    return out


# decode_step_parts: back-to-back replays of the graph (and steps), at most this many and ~SUSTAINED_MS of device time
SUSTAINED_REPLAYS, SUSTAINED_MS = 200, 1500.0
# "1": iteration_breakdown (engine_bench's offline rows, vlm_bench's and encdec_bench's runs) adds decode_step_parts
# at the widest decode batch; engine_bench's executor_decode rows always have them
STEP_PARTS_ENV = "TRITONLLM_BENCH_STEP_PARTS"


# decode_step_parts: up to this many rows, the LM head and the pick are also timed on the device alone (CUDA-graph
# replays). Why: timed eagerly with events, a part whose launch takes longer than its kernels runs shows the launch
# (session 28, Qwen3-30B-A3B on the H200: the batch-1 pick at 151,936 logits "0.152 ms"); past it, a graph's
# (rows, vocab) float32 logits would take hundreds of MB beside a KV pool sized to the limit.
DEVICE_ONLY_PARTS_MAX_ROWS = 64


def decode_step_parts(runner, rows: int) -> dict | None:
    """A decode step of ``rows`` sequences on the device, part by part, each timed alone with CUDA events (ms), to
    split the executor's step period (step_timeline, iteration_breakdown) into its graph and what runs outside it:
    ``graph_ms``: its bucket's replay, median of 10 (as decode_graph_replay_ms); ``graph_sustained_ms``: the mean of
    ``sustained_replays`` back to back, ~SUSTAINED_MS in all (a compute-bound batch may run at lower clocks under a
    sustained load);
    ``lm_head_ms``: the float32 logits of the graph's ``rows`` hidden rows (runner._logits, outside the graph);
    ``argmax_ms``: the greedy tokens of those logits (kernels/sampling.greedy_tokens, the sampler's greedy path);
    up to DEVICE_ONLY_PARTS_MAX_ROWS rows ``lm_head_device_ms`` and ``argmax_device_ms``: the same two from CUDA-graph
    replays (device time, no launch overhead: the two above hold it where a launch outlasts its kernels);
    ``step_sustained_ms``: graph, LM head and argmax back to back, as many times as the sustained replays (a step's
    device work without the executor: against the run's period, what the run adds); ``logits_mb``: the logits'
    size; ``sm_clock_mhz``: the SM clock before and after the sustained replays and after the sustained steps (NVML
    through torch, where it is installed). None off CUDA, for tensor-parallel ranks (their graphs all-reduce) and
    where no decode graph holds ``rows``. The graph's inputs are those of its last replay in the run."""
    from kernels.linear import replay_time_ms

    graphs = getattr(runner, "decode_graphs", None)
    if graphs is None or runner.build_config.tp_size != 1 or not 0 < rows <= graphs.max_batch_size:
        return None
    bucket = graphs.bucket_for(rows)
    graph, hidden = graphs.graphs[bucket], graphs.hidden[bucket][:rows]

    def clock() -> int | None:
        try:
            return torch.cuda.clock_rate(runner.device)
        except Exception:  # (no pynvml on the machine)
            return None

    parts = {"rows": rows, "bucket": bucket, "graph_ms": cuda_time_ms(graph.replay, repeat=10)}
    clocks, replays = [clock()], max(10, min(SUSTAINED_REPLAYS, int(SUSTAINED_MS / max(parts["graph_ms"], 1e-3))))
    # (replay_time_ms replays once before timing: the graph is warm from cuda_time_ms already, so no change)
    parts["graph_sustained_ms"], parts["sustained_replays"] = replay_time_ms(graph, replays), replays
    clocks.append(clock())
    with torch.inference_mode():
        logits = runner._logits(hidden)
        parts["lm_head_ms"] = cuda_time_ms(lambda: runner._logits(hidden), repeat=10)
        parts["argmax_ms"] = cuda_time_ms(lambda: greedy_tokens(logits), repeat=10)
        if rows <= DEVICE_ONLY_PARTS_MAX_ROWS:  # the same two on the device alone
            try:
                parts["lm_head_device_ms"] = graph_call_us(runner._logits, [(hidden,)]) / 1e3
                parts["argmax_device_ms"] = graph_call_us(greedy_tokens, [(logits,)]) / 1e3
            except Exception as error:  # noqa: BLE001
                parts["device_only_error"] = repr(error)[:300]

        def step() -> None:  # the device work of a greedy decode step but its input and token copies
            graph.replay()
            greedy_tokens(runner._logits(hidden))

        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(replays):
            step()
        end.record()
        end.synchronize()
        parts["step_sustained_ms"] = start.elapsed_time(end) / replays
        clocks.append(clock())
    parts["logits_mb"] = logits.numel() * logits.element_size() / 1e6
    parts["sm_clock_mhz"] = clocks
    return parts


def decode_step_parts_text(parts: dict | None) -> str:
    """decode_step_parts as one clause of a results line ("" without them)."""
    if not parts:
        return ""
    return (f"; alone at {parts['rows']} rows (bucket {parts['bucket']}): graph {parts['graph_ms']:.3f} ms "
            f"({parts['graph_sustained_ms']:.3f} over {parts['sustained_replays']} back to back, SM clock "
            f"{parts['sm_clock_mhz'][0]} -> {parts['sm_clock_mhz'][1]} MHz), LM head {parts['lm_head_ms']:.3f} ms "
            f"({parts['logits_mb']:.0f} MB of float32 logits), argmax {parts['argmax_ms']:.3f} ms"
            + (f" (device only: LM head {parts['lm_head_device_ms']:.3f}, argmax {parts['argmax_device_ms']:.3f})"
               if "argmax_device_ms" in parts else "")
            + f"; graph + LM head + argmax {parts['step_sustained_ms']:.3f} ms a step back to back (SM clock then "
            f"{parts['sm_clock_mhz'][2]} MHz)")


def profile_executor_loop(executor):
    """cProfile the executor thread's iterations (wraps its ``_step``); call the result for a report."""
    import cProfile
    import io
    import pstats

    profiler = cProfile.Profile()
    original = executor._step

    def profiled_step(*args):
        profiler.enable()
        try:
            return original(*args)
        finally:
            profiler.disable()

    executor._step = profiled_step

    def report() -> str:
        executor._step = original
        stream = io.StringIO()
        pstats.Stats(profiler, stream=stream).sort_stats("cumulative").print_stats(30)
        return stream.getvalue()

    return report


def bench_latency(results: dict, executor, vocab: int, rates: list[float], seconds: float,
                  in_len: int = 128, out_len: int = 128) -> None:
    """Poisson arrivals at each rate; TTFT and inter-token gaps seen by a streaming client."""
    from engine.executor.request import OutputConfig, Request

    rows = []
    for rate in rates:
        num_requests = max(12, int(rate * seconds))
        rng = random.Random(int(rate * 1000))
        sent, first, last, counts, gaps = {}, {}, {}, {}, []
        lock = threading.Lock()

        def producer():
            for _ in range(num_requests):
                request = Request(input_token_ids=[rng.randrange(vocab) for _ in range(in_len)], max_tokens=out_len,
                                  streaming=True, output=OutputConfig(exclude_input_from_output=True))
                with lock:
                    (request_id,) = executor.enqueue_requests([request])
                    sent[request_id] = time.perf_counter()
                time.sleep(rng.expovariate(rate))

        thread = threading.Thread(target=producer)
        thread.start()
        finished = 0
        while finished < num_requests:
            for response in executor.await_responses(timeout=1.0):
                now = time.perf_counter()
                if response.error:
                    raise RuntimeError(response.error)
                rid, new_tokens = response.request_id, len(response.result.output_token_ids[0])
                with lock:
                    if new_tokens and rid not in first:
                        first[rid] = now
                    elif new_tokens:
                        gaps.append((now - last[rid]) / new_tokens)  # coalesced chunks: per-token share
                    if new_tokens:
                        last[rid] = now
                        counts[rid] = counts.get(rid, 0) + new_tokens
                if response.result.is_final:
                    finished += 1
        thread.join()
        ttft = [(first[r] - sent[r]) * 1e3 for r in first]
        tpot = [(last[r] - first[r]) * 1e3 / (counts[r] - 1) for r in first if counts[r] > 1]
        rows.append({"rate": rate, "requests": num_requests, "ttft_ms_median": statistics.median(ttft),
                     "ttft_ms_p99": percentile(ttft, 99), "itl_ms_median": statistics.median(gaps) * 1e3,
                     "itl_ms_p99": percentile(gaps, 99) * 1e3, "tpot_ms_median": statistics.median(tpot)})
    results["latency"] = rows


def bench_hf(results: dict, model: str, batches: list[int], in_len: int = 128, out_len: int = 128,
             device: str = "cuda") -> None:
    """transformers' generate, static batches, random weights of the same shape, bf16, greedy."""
    c = MODELS[model]
    if c.get("num_experts"):
        hf = _hf_qwen3_moe(c, device)
    elif c["architecture"] == "Gemma3ForCausalLM":
        hf = _hf_gemma3(c, device)
    elif c["architecture"] in ("BloomForCausalLM", "FalconForCausalLM"):
        hf = _hf_layernorm_family(c, device)
    else:
        hf = _hf_llama(c, device)
    rows = []
    for batch in batches:
        ids = torch.randint(0, c["vocab_size"], (batch, in_len), device=device)
        kwargs = dict(max_new_tokens=out_len, min_new_tokens=out_len, do_sample=False, pad_token_id=0,
                      attention_mask=torch.ones_like(ids))
        # Warm-up on 16 tokens, with a mask of 16 (BLOOM builds its ALiBi bias from the mask's length).
        hf.generate(ids[:, :16], **{**kwargs, "max_new_tokens": 4, "min_new_tokens": 4,
                                    "attention_mask": kwargs["attention_mask"][:, :16]})
        sync = torch.cuda.synchronize if device != "cpu" else (lambda: None)
        sync()
        started = time.perf_counter()
        out = hf.generate(ids, **kwargs)
        sync()
        elapsed = time.perf_counter() - started
        new_tokens = (out.shape[1] - in_len) * batch
        rows.append({"batch": batch, "seconds": elapsed, "output_tok_s": new_tokens / elapsed})
    results["hf"] = rows
    del hf
    gc.collect()


def _hf_gemma3(c: dict, device: str):
    """transformers' Gemma3ForCausalLM of the shape ``c`` (random weights, sdpa attention; rope scaling
    left out: speed does not depend on it)."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"], head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c["norm_eps"],
        max_position_embeddings=c["max_position_embeddings"], sliding_window=c["sliding_window"],
        layer_types=c["layer_types"], query_pre_attn_scalar=int(c["query_pre_attn_scalar"]),
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": c["rope_theta"]},
                         "sliding_attention": {"rope_type": "default", "rope_theta": c["rope_local_theta"]}},
    )
    config._attn_implementation = "sdpa"
    with torch.device(device):
        return Gemma3ForCausalLM(config).to(torch.bfloat16 if device != "cpu" else torch.float32).eval()


def _hf_layernorm_family(c: dict, device: str):
    """transformers' BloomForCausalLM or FalconForCausalLM of the shape ``c`` (benchmarks/common.py
    bloom7b1, falcon7b), random weights made in the target dtype on the device."""
    from transformers import BloomConfig, BloomForCausalLM, FalconConfig, FalconForCausalLM

    if c["architecture"] == "BloomForCausalLM":
        config, model_class = BloomConfig(vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], n_layer=c["num_layers"],
                                          n_head=c["num_heads"], layer_norm_epsilon=c["norm_eps"]), BloomForCausalLM
    else:
        config, model_class = FalconConfig(
            vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_layers"],
            num_attention_heads=c["num_heads"], multi_query=c["num_kv_heads"] == 1, parallel_attn=True, bias=False,
            layer_norm_epsilon=c["norm_eps"], max_position_embeddings=c["max_position_embeddings"],
            rope_parameters={"rope_theta": c["rope_theta"], "rope_type": "default"},
            ffn_hidden_size=c["intermediate_size"]), FalconForCausalLM
    # Falcon through sdpa; transformers' BLOOM has only its eager attention (ALiBi as a bias tensor).
    config._attn_implementation = "eager" if model_class is BloomForCausalLM else "sdpa"
    return _made_in_place(model_class, config, device)


def _made_in_place(model_class, config, device: str):
    """model_class(config) with its random weights made on ``device`` in the benchmark's dtype (bf16
    on a GPU) directly: a 30B model made in float32 first would not fit the GPU."""
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16 if device != "cpu" else torch.float32)
    try:
        with torch.device(device):
            return model_class(config).eval()
    finally:
        torch.set_default_dtype(default_dtype)


def _hf_qwen3_moe(c: dict, device: str):
    """Qwen3-MoE of the shape of MODELS entry ``c`` (transformers' default experts implementation),
    built in bf16 directly (_made_in_place)."""
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    config = Qwen3MoeConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"], head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c.get("norm_eps", 1e-6),
        max_position_embeddings=c["max_position_embeddings"], num_experts=c["num_experts"],
        num_experts_per_tok=c["num_experts_per_tok"], moe_intermediate_size=c["moe_intermediate_size"],
        norm_topk_prob=c.get("norm_topk_prob", True),
        rope_parameters={"rope_theta": c.get("rope_theta", 10000.0), "rope_type": "default"},
    )
    return _made_in_place(Qwen3MoeForCausalLM, config, device)


def _hf_llama(c: dict, device: str):
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=c["vocab_size"], hidden_size=c["hidden_size"], num_hidden_layers=c["num_layers"],
        num_attention_heads=c["num_heads"], num_key_value_heads=c["num_kv_heads"], head_dim=c["head_dim"],
        intermediate_size=c["intermediate_size"], rms_norm_eps=c.get("norm_eps", 1e-5),
        max_position_embeddings=c["max_position_embeddings"], tie_word_embeddings=c.get("tie_word_embeddings", False),
        # Speed does not depend on the rope variant; transformers 5 takes theta here.
        rope_parameters={"rope_theta": c.get("rope_theta", 10000.0), "rope_type": "default"},
    )
    with torch.device(device):
        return LlamaForCausalLM(config).to(torch.bfloat16 if device != "cpu" else torch.float32).eval()


# ------------------------------------------------------------------------------------------------
# report
# ------------------------------------------------------------------------------------------------


def markdown(results: dict) -> str:
    lines = [f"\n### engine_bench: {results['model']} on {results['gpu']} ({results['date']}, commit {results['commit']})\n",
             f"torch {results['torch']}, triton {results['triton']}, dtype {results['dtype']}, "
             f"command `{results['command']}`, weights {results.get('quantization') or results['dtype']}, overlapped scheduling "
             f"{'on' if results.get('overlap_scheduler', True) else 'off'}\n", "| measure | measured | goal |", "|---|---|---|"]
    bw = results.get("bandwidth")
    if bw:
        lines.append(f"| HBM copy bandwidth | {bw['copy_GBps']:.0f} GB/s | (H100 ref. 3030) |")
        lines.append(f"| decode roofline (weights read per step / bandwidth{', active experts only' if bw.get('moe') else ''}) "
                     f"| {bw['roofline_tok_s']:.1f} tok/s "
                     f"({bw['roofline_tok_s_all_params']:.1f} counting every parameter) | |")
    d = results.get("decode")
    if d:
        frac = f" = {d['roofline_fraction']:.0%} of roofline" if "roofline_fraction" in d else ""
        skinny = [shape for shape, c in d.get("gemm_choices", {}).items() if c.get("variant") not in (None, "False")]
        moe = (results.get("bandwidth") or {}).get("moe")
        goal = (f">= {GOALS['moe_roofline_fraction']:.0%} of the active-parameter roofline" if moe else
                f">= {GOALS['decode_tok_s']:.0f} tok/s, >= {GOALS['roofline_fraction']:.0%}")
        lines.append(f"| batch-1 decode | {d['tok_s']:.1f} tok/s{frac} (step {d['step_ms_median']:.2f} ms, "
                     f"graph alone {d.get('graph_replay_ms', float('nan')):.2f} ms; Triton GEMM for {', '.join(skinny) or 'none'}) "
                     f"| {goal} |")
        if "overlapped_tok_s" in d:
            over = (f" = {d['overlapped_tok_s'] / d['roofline_tok_s']:.0%} of roofline" if "roofline_tok_s" in d else "")
            lines.append(f"| batch-1 decode overlapped as the executor runs it (next step launched before the "
                         f"token reaches the host) | {d['overlapped_tok_s']:.1f} tok/s{over} (step "
                         f"{d['overlapped_step_ms_median']:.2f} ms; same tokens: {d['overlapped_same_tokens']}) | |")
        if decode_outside_graph_text(d):
            lines.append(f"| batch-1 decode step outside its graph | {decode_outside_graph_text(d)} | |")
    hf_best = max((r["output_tok_s"] for r in results.get("hf", [])), default=None)
    e = results.get("engine_offline")
    if e:
        lines.append(f"| runner alone, static batches of {e['batch']}, {e['input_len']}/{e['output_len']} "
                     f"({e['requests']} requests, no executor) | {e['output_tok_s']:,.0f} output tok/s | (capacity) |")
    for row in results.get("offline", []):
        goal = f">= {GOALS['offline_128_128_tok_s']:,.0f}" if (row["input_len"], row["output_len"]) == (128, 128) else ""
        ratio = ""
        if hf_best and (row["input_len"], row["output_len"]) == (128, 128):
            ratio = f", {row['output_tok_s'] / hf_best:.1f}x transformers"
            goal += f", >= {GOALS['vs_hf']:.0f}x transformers"
        lines.append(f"| offline {row['input_len']}/{row['output_len']} ({row['requests']} requests) | "
                     f"{row['output_tok_s']:,.0f} output tok/s{ratio} | {goal} |")
        if "decode_step_ms_median" in row:
            lines.append(f"| ... where the time went | {row['context_seconds']:.2f} s in {row['context_iterations']} "
                         f"prefill-carrying steps, {row['decode_seconds']:.2f} s in {row['decode_iterations']} decode-only; "
                         f"decode step at batch {row['decode_batch']}: {row['decode_step_ms_median']:.1f} ms "
                         f"(graph alone {row.get('decode_graph_replay_ms', float('nan')):.1f} ms)"
                         f"{decode_step_parts_text(row.get('decode_step_parts'))} | |")
    kv = results.get("kv_cache")
    if kv:
        lines.append(f"| executor KV pool ({kv['dtype']}) | {kv['blocks']:,} blocks of {kv['tokens_per_block']} tokens "
                     f"({kv['blocks'] * kv['tokens_per_block']:,} tokens, {kv['bytes'] / 2**30:.1f} GiB) | |")
    for row in results.get("fp8_gemm", []):
        lines.append(f"| {row['name']} {row['n']}x{row['k']}, {row['m']} row(s): bf16 vs FP8 | "
                     f"{row['bf16_ms'] * 1e3:.1f} vs {row['fp8_ms'] * 1e3:.1f} µs ({row['bf16_ms'] / row['fp8_ms']:.2f}x; "
                     f"weights at {row['bf16_TBps']:.2f} vs {row['fp8_TBps']:.2f} TB/s) | |")
    for row in results.get("sampling", []):
        lines.append(f"| next token of {row['rows']} row(s) x {row['vocab']} logits: torch.argmax / greedy_tokens / "
                     f"sampled | {row['torch_argmax_us']:.1f} / {row['greedy_us']:.1f} / {row['sampled_us']:.1f} µs | |")
    for row in results.get("executor_decode", []):
        t = row.get("timeline")
        steps = (f"; step period {t['period_ms']:.3f} ms, GPU busy in forward {t['gpu_ms']:.3f} ms, gap between "
                 f"forwards {t['gap_ms']:.3f} ms (sampling + idle), GPU idle {t.get('idle_ms', float('nan')):.3f} ms, "
                 f"host in forward {t['host_ms']:.3f} ms (graph run {t.get('graph_host_ms', float('nan')):.3f} ms; "
                 f"{t.get('graph_steps', 0)} of {t['steps']} steps replayed a graph), loop thread's CPU "
                 f"{t.get('cpu_in_forward_ms', float('nan')):.3f} ms in forward, "
                 f"{t.get('cpu_period_ms', float('nan')):.3f} ms a step") if t else ""
        if "cupti_attached" in row:
            steps += "; CUPTI attached by an earlier profiler window" if row["cupti_attached"] else \
                "; before any profiler window"
        after = row.get("timeline_after_profile")
        if after:
            steps += (f"; after the profiler window: period {after['period_ms']:.3f} ms, host in forward "
                      f"{after['host_ms']:.3f} ms (CPU {after.get('cpu_in_forward_ms', float('nan')):.3f}), "
                      f"GPU in forward {after['gpu_ms']:.3f} ms, {after.get('graph_steps', 0)} of "
                      f"{after['steps']} steps replayed a graph")
        p = row.get("profile") or {}
        if "idle_ms_per_step" in p:
            steps += (f"; profiler over {p['steps']} steps: GPU idle {p['idle_ms_per_step']:.3f} ms per step "
                      f"(busy {p['busy_ms_per_step']:.3f} ms)")
        steps += decode_step_parts_text(row.get("step_parts"))
        sampled = f", temperature {row['temperature']:g}, top-p {row['top_p']:g}" if row.get("temperature") else ""
        lines.append(f"| executor decode, {row['batch']} request(s) at once, {row['prompt_len']}/{row['output_len']}{sampled} "
                     f"(overlap {'on' if results.get('overlap_scheduler', True) else 'off'}) | "
                     f"{row['decode_tok_s']:,.1f} decode tok/s{steps} | |")
    for row in results.get("latency", []):
        lines.append(f"| Poisson {row['rate']:g} req/s, 128/128 ({row['requests']} req): TTFT median / p99 | "
                     f"{row['ttft_ms_median']:.1f} / {row['ttft_ms_p99']:.1f} ms | median < {GOALS['ttft_ms']:.0f} ms |")
        lines.append(f"| Poisson {row['rate']:g} req/s: ITL median / p99 | {row['itl_ms_median']:.2f} / "
                     f"{row['itl_ms_p99']:.2f} ms | median < {GOALS['itl_ms']:.0f} ms |")
    for row in results.get("hf", []):
        lines.append(f"| transformers generate, static batch {row['batch']}, 128/128 | {row['output_tok_s']:,.0f} output tok/s | baseline |")
    for row in results.get("gemm", []):
        lines.append(f"| {row['name']} {row['n']}x{row['k']}, {row['m']} row(s): cuBLAS vs best Triton "
                     f"({row['best_triton']}) | {row['weight_TBps_cublas']:.2f} vs {row['weight_TBps_best_triton']:.2f} TB/s | |")
    for row in results.get("moe_kernel", []):
        lines.append(f"| fused MoE, {row['tokens']} token(s) x top-k ({row['experts_hit']} experts hit, block_m "
                     f"{row['block_m']}, tiles {row['engine_tiles']}): routing + experts, Triton vs torch reference | "
                     f"{row['triton_us']:.1f} vs {row['torch_ref_us']:.1f} us ({row['torch_ref_us'] / row['triton_us']:.1f}x; "
                     f"experts read at {row['expert_TBps']:.2f} TB/s; routing given {row['triton_routing_given_us']:.1f} us, "
                     f"best tiles {row['best_tiles']}: {row['best_tiles_us']:.1f} us) | |")
    for row in results.get("kernels", []):
        speed = f"{row['GBps']:.0f} GB/s of K/V" if "GBps" in row else f"{row['TFLOPs']:.0f} TFLOP/s"
        lines.append(f"| paged attention {row['kind']}, batch {row['batch']}, context {row['context']} | "
                     f"{row['us']:.1f} us, {speed} | |")
    return "\n".join(lines) + "\n"


RESULTS_MARKER = "<!-- engine_bench:end -->"  # the end of its section in benchmarks/results/engine.md


def plot_latency(results: dict, path: str) -> None:
    rows = results.get("latency") or []
    if len(rows) < 2:
        return
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rates = [r["rate"] for r in rows]
    fig, ax = plt.subplots(1, 2, figsize=(9, 3.5))
    ax[0].plot(rates, [r["ttft_ms_median"] for r in rows], "o-", label="median")
    ax[0].plot(rates, [r["ttft_ms_p99"] for r in rows], "s--", label="p99")
    ax[0].set(xlabel="request rate (req/s)", ylabel="TTFT (ms)", title="time to first token")
    ax[1].plot(rates, [r["itl_ms_median"] for r in rows], "o-", label="median")
    ax[1].plot(rates, [r["itl_ms_p99"] for r in rows], "s--", label="p99")
    ax[1].set(xlabel="request rate (req/s)", ylabel="ITL (ms)", title="inter-token latency")
    for a in ax:
        a.legend()
        a.grid(alpha=0.3)
    fig.suptitle(f"{results['model']} on {results['gpu']}, 128 in / 128 out")
    fig.tight_layout()
    fig.savefig(path, dpi=100)


# ------------------------------------------------------------------------------------------------
# main
# ------------------------------------------------------------------------------------------------


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser, dtype_choices=["bfloat16", "float16", "float32"],
                        device_help="cpu only for smoke tests of decode/offline/latency")
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma-separated subset of {SECTIONS}")
    parser.add_argument("--max-batch-size", type=int, default=512)
    parser.add_argument("--max-num-tokens", type=int, default=8192)
    parser.add_argument("--max-seq-len", type=int, default=4096)
    parser.add_argument("--tokens-per-block", type=int, default=32)
    parser.add_argument("--offline", default="128x128x1024,128x2048x192,2048x128x256",
                        help="input x output x requests, comma-separated")
    parser.add_argument("--executor-decode-batches", default="1,64,512",
                        help="batch sizes of the executor_decode section (comma-separated)")
    parser.add_argument("--executor-decode-profile-seconds", type=float, default=0.5,
                        help="executor_decode: a torch.profiler window this long in each batch's steady decode (0: "
                             "none; the window leaves CUPTI attached to the process, which slows what runs after it)")
    parser.add_argument("--executor-decode-temperature", type=float, default=0.0,
                        help="executor_decode: > 0 makes every request sample at this temperature (0: greedy)")
    parser.add_argument("--executor-decode-top-p", type=float, default=1.0,
                        help="executor_decode: nucleus top-p of the sampled requests (1.0: none)")
    parser.add_argument("--quantization", choices=["fp8", "fp8_block", "int8_wo", "int4_wo", "int8_sq"], default=None,
                        help="fp8: the model's linear weights in FP8 E4M3 (as engine.build --quantization fp8); "
                             "fp8_block: E4M3 with a scale per 128 x 128 block (as block-FP8 checkpoints ship); "
                             "int8_wo / int4_wo: integer weight-only codes (per channel / group 128); int8_sq: "
                             "W8A8 INT8, int8 weights per channel and activations per token (random weights: no "
                             "smoothing to calibrate)")
    parser.add_argument("--group-size", type=int, default=None,
                        help="int8_wo/int4_wo: input columns per scale group (0: per channel); default per scheme")
    parser.add_argument("--kv-cache-dtype", choices=["auto", "fp8"], default="auto",
                        help="the executor's KV pool: auto (the model dtype) or fp8 (E4M3)")
    parser.add_argument("--disable-overlap", action="store_true",
                        help="run the executor with disable_overlap_scheduler (the synchronous loop), for comparison")
    parser.add_argument("--rates", default="1,8", help="Poisson request rates (req/s)")
    parser.add_argument("--latency-seconds", type=float, default=16.0,
                        help="arrivals per rate: max(12, rate x this many seconds) requests")
    parser.add_argument("--profile-executor", action="store_true", help="cProfile the executor loop in offline runs")
    parser.add_argument("--hf-batches", default="64,128,256")
    parser.add_argument("--out", default="engine_bench.json")
    parser.add_argument("--results-md", default=None, help="append the markdown table to this file")
    return parser.parse_args(argv)


class SectionRunner:
    """Runs the sections in order; the executor (offline, latency) is started once and shared,
    and shut down before the transformers baseline needs the GPU memory."""

    def __init__(self, args: argparse.Namespace, results: dict):
        self.args, self.results = args, results
        self.model_cfg = ModelConfig(**MODELS[args.model])
        self.dtype = getattr(torch, args.dtype)
        self.executor = None

    def run(self, section: str) -> None:
        getattr(self, f"section_{section}")()

    def section_bandwidth(self) -> None:
        bench_bandwidth(self.results, self.model_cfg, self.dtype.itemsize, self.args.quantization)

    def section_fp8_gemm(self) -> None:
        bench_fp8_gemm(self.results, self.model_cfg, self.dtype)

    def section_sampling(self) -> None:
        bench_sampling(self.results, self.model_cfg)

    def section_kernels(self) -> None:
        bench_kernels(self.results, self.model_cfg, self.dtype)

    def section_gemm(self) -> None:
        bench_gemm(self.results, self.model_cfg, self.dtype)

    def section_moe_kernel(self) -> None:
        bench_moe_kernel(self.results, self.model_cfg, self.dtype)

    def _runner(self, max_batch_size: int, max_tokens: int) -> ModelRunner:
        a = self.args
        engine_dir = write_config_only_engine(a.model, a.dtype, max_batch_size, a.max_seq_len, a.max_num_tokens,
                                              a.tokens_per_block, a.quantization, a.group_size)
        return make_runner(engine_dir, a.device, max_tokens=max_tokens)

    def section_decode(self) -> None:
        runner = self._runner(8, 64 * self.args.max_seq_len)
        self.results["param_bytes"] = param_bytes(runner.model)[0]
        bench_decode(self.results, runner)

    def section_engine_offline(self) -> None:
        a = self.args
        runner = self._runner(a.max_batch_size, a.max_batch_size * 320)
        bench_engine_offline(self.results, runner, 1024, 128, 128, a.max_batch_size, a.max_num_tokens)

    def _started_executor(self):
        if self.executor is None:
            self.executor = start_executor(self.args)
            runner = self.executor.runner
            self.results["kv_cache"] = {"dtype": str(runner.kv_cache.dtype).replace("torch.", ""),
                                        "blocks": runner.num_kv_blocks, "tokens_per_block": runner.tokens_per_block,
                                        "bytes": runner.kv_cache.numel() * runner.kv_cache.element_size()}
        return self.executor

    def section_offline(self) -> None:
        shapes = [tuple(int(x) for x in s.split("x")) for s in self.args.offline.split(",") if s]
        bench_offline(self.results, self._started_executor(), self.model_cfg.vocab_size, shapes,
                      self.args.profile_executor)

    def section_executor_decode(self) -> None:

        reset(self._started_executor().runner)  # the steps of this section only
        rows = []
        for batch in [int(b) for b in self.args.executor_decode_batches.split(",") if b]:
            rows.append(bench_executor_decode(self._started_executor(), self.model_cfg.vocab_size, batch,
                                              profile_seconds=self.args.executor_decode_profile_seconds,
                                              temperature=self.args.executor_decode_temperature,
                                              top_p=self.args.executor_decode_top_p))
            print(executor_decode_line(rows[-1]), file=sys.stderr, flush=True)  # (a run cut short keeps it)
        self.results["executor_decode"] = rows

    def section_latency(self) -> None:
        rates = [float(r) for r in self.args.rates.split(",") if r]
        bench_latency(self.results, self._started_executor(), self.model_cfg.vocab_size, rates, self.args.latency_seconds)

    def section_hf(self) -> None:
        self.shutdown()
        free_device_memory(self.args.device)
        bench_hf(self.results, self.args.model, [int(b) for b in self.args.hf_batches.split(",") if b],
                 device=self.args.device)

    def shutdown(self) -> None:
        if self.executor is not None:
            self.executor.shutdown()
            self.executor = None


def main(argv=None) -> dict:
    args = parse_args(argv)
    os.environ.setdefault(LOAD_LOG_ENV, "1")  # a timestamped line per phase of each engine's load
    sections = [s for s in args.sections.split(",") if s]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        raise SystemExit(f"unknown sections {unknown}; choose from {SECTIONS}")
    from kernels._triton import triton

    results = {
        "date": utc_now(), "gpu": device_name(args.device), "commit": git_commit(),
        "torch": torch.__version__, "triton": triton.__version__ if triton else "none", "model": args.model,
        "dtype": args.dtype, "command": command_line(__file__, argv),
        "overlap_scheduler": not args.disable_overlap, "quantization": args.quantization,
    }
    runner = SectionRunner(args, results)
    progress = tqdm(sections, desc="engine_bench")
    for section in progress:
        progress.set_postfix_str(section)
        runner.run(section)
        free_device_memory(args.device)
        with open(args.out, "w") as f:  # after every section: a crash later keeps what was measured
            json.dump(results, f, indent=2)
    runner.shutdown()
    table = markdown(results)
    print(table)
    if args.results_md:
        insert_before_marker(args.results_md, table, RESULTS_MARKER)
    plot_latency(results, os.path.splitext(args.out)[0] + "_latency.png")
    return results


def start_executor(args):
    from engine.executor.executor import Executor, ExecutorConfig

    engine_dir = write_config_only_engine(args.model, args.dtype, args.max_batch_size, args.max_seq_len,
                                          args.max_num_tokens, args.tokens_per_block, args.quantization,
                                          args.group_size)
    import engine.executor.executor as executor_module

    # Every decode step of the executor timed with CUDA events (benchmarks/engine/step_timeline.py).
    executor_module.ModelRunner = timed(ModelRunner)
    config = ExecutorConfig(kv_cache_free_gpu_mem_fraction=0.9, enable_kv_cache_reuse=False,
                            disable_overlap_scheduler=args.disable_overlap, kv_cache_dtype=args.kv_cache_dtype)
    executor = Executor(engine_dir, config, device=args.device)
    # Warm-up: compile the kernels for prefill and decode shapes before anything is timed.
    from engine.executor.request import Request

    executor.enqueue_requests([Request(input_token_ids=list(range(1, 200)), max_tokens=8) for _ in range(4)])
    done = 0
    while done < 4:
        done += sum(1 for r in executor.await_responses(timeout=1.0) if r.result is None or r.result.is_final)
    return executor


if __name__ == "__main__":
    main()
