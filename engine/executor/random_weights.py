"""Random weights for benchmark engines: a config-only engine directory runs without a checkpoint.

An engine directory whose ``config.json`` has ``extra.random_weights_seed`` (and no rank files)
gets its weights made on the device at load: the honest way to measure speed at a real shape
(Llama-3.1-8B: 16 GB) on a machine that cannot download it, and faster than reading it from
disk. Norm weights are 1 (for Gemma, whose engines store 1 + w, that is w = 0, its init); every
other weight is N(0, 0.02), which keeps activations O(1) through dozens of layers, so no NaN or
overflow path is timed. Rank r draws from seed + r.

Real shapes for benchmarks (ModelConfig fields; benchmarks/engine/engine_bench.py ``--model``) are below.
"""
from __future__ import annotations

import torch

from kernels.fp8 import FP8_DTYPE, quantize_weight
from kernels.fp8_block import quantize_blocks


# Gemma-3-12B (google/gemma-3-12b-pt text model): five sliding-window layers (1024 tokens, local
# rope base 10k) per global one (rope base 1M, linear scaling 8), head_dim 256, tied embeddings.
GEMMA3_12B_SHAPE = dict(
    architecture="Gemma3ForCausalLM", vocab_size=262208, hidden_size=3840, num_layers=48, num_heads=16,
    num_kv_heads=8, head_dim=256, intermediate_size=15360, norm_eps=1e-6, rope_theta=1_000_000.0,
    rope_scaling={"rope_type": "linear", "factor": 8.0}, max_position_embeddings=131072, tie_word_embeddings=True,
    hidden_act="gelu_pytorch_tanh", sliding_window=1024,
    layer_types=["full_attention" if (i + 1) % 6 == 0 else "sliding_attention" for i in range(48)],
    query_pre_attn_scalar=256, rope_local_theta=10_000.0,
)


def has_random_weights(extra: dict) -> bool:
    return extra.get("random_weights_seed") is not None


@torch.no_grad()
def materialize_random_weights(model: torch.nn.Module, device: torch.device, seed: int) -> torch.nn.Module:
    """A model built on the meta device -> the same model on ``device`` with random weights."""
    # Module.to_empty's empty_like of a meta tensor runs torch's Python reference, whose first call
    # imports torch.fx's symbolic shapes and sympy (~0.35 CPU-s of every engine process start);
    # empty_strided on the device gives the same sizes, strides and dtypes without it.
    model = model._apply(lambda t: torch.empty_strided(t.size(), t.stride(), dtype=t.dtype, device=device))
    generator = torch.Generator(device=device).manual_seed(seed)
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rsplit(".", 1)[0]) if "." in name else model
        if getattr(owner, "weight_only", None) is not None and not name.endswith((".bias", "router.weight")):
            _random_integer_weights(name, param, owner.weight_only.bits, generator)
            continue
        if getattr(owner, "mxfp4", False) and param.dtype == torch.uint8:
            _random_mxfp4_weights(name, param, generator)
            continue
        if name.endswith("_scale") and param.dtype == torch.float32:
            continue  # set with its FP8 / int8 weight (a Linear's weight_scale, an expert block's *_scale)
        if param.dtype == torch.int8:  # int8_sq (kernels/int8_sq.py): uniform codes, std 127 / sqrt(3)
            param.copy_(torch.randint(-127, 128, param.shape, generator=generator, device=param.device,
                                      dtype=torch.int32))
            owner.weight_scale.fill_(0.02 * 3**0.5 / 127)
            continue
        if param.dtype == FP8_DTYPE:
            leaf = name.rsplit(".", 1)[-1]
            _random_fp8_weights(param, getattr(owner, "weight_scale" if leaf == "weight" else leaf + "_scale"),
                                generator)
        elif "norm" in name.rsplit(".", 2)[-2]:
            param.fill_(1.0)
        elif name.endswith(".bias"):
            param.zero_()
        else:
            param.normal_(0.0, 0.02, generator=generator)
    return model


def _random_fp8_weights(param: torch.Tensor, scale: torch.Tensor, generator: torch.Generator) -> None:
    """An FP8 weight (a Linear's (N, K) or an expert block's (E, N, K)): N(0, 0.02) in float32,
    quantized as engine.build quantizes, per output channel (scale (..., N)) or per 128 x 128
    block (scale (..., ceil(N / 128), ceil(K / 128))); one expert at a time, so the float32
    copy stays one expert's size."""
    per_block = scale.dim() == param.dim()
    for index in range(param.shape[0]) if param.dim() == 3 else [None]:
        target = param if index is None else param[index]
        full = torch.empty(target.shape, dtype=torch.float32, device=param.device).normal_(0.0, 0.02, generator=generator)
        quantized, values = quantize_blocks(full) if per_block else quantize_weight(full)
        target.copy_(quantized)
        (scale if index is None else scale[index]).copy_(values)


def _random_mxfp4_weights(name: str, param: torch.Tensor, generator: torch.Generator) -> None:
    """One tensor of gpt-oss's MXFP4 experts (kernels/fused_moe_mxfp4.py): uniform random bytes (two
    E2M1 codes each, whose values have a root mean square of 2.93) and E8M0 scales of 2^-7, so the
    weights have a standard deviation of ~0.023."""
    if name.endswith("_scale"):
        param.fill_(127 - 7)
    else:
        param.copy_(torch.randint(0, 256, param.shape, generator=generator, device=param.device, dtype=torch.int32))


def _random_integer_weights(name: str, param: torch.Tensor, bits: int, generator: torch.Generator) -> None:
    """One tensor of an integer weight-only layer (kernels/wna16.py): uniform random codes (every
    byte uniform is every 4-bit code uniform too), zero points mid-range, and scales that give the
    weights a standard deviation of 0.02 (a uniform code has std 2**bits / sqrt(12) steps)."""
    if name.endswith("_scale"):
        param.fill_(0.02 * 12**0.5 / (1 << bits))
    elif name.endswith("_zero"):
        param.fill_(1 << (bits - 1))
    elif name.endswith("input_perm"):
        param.copy_(torch.arange(param.numel(), device=param.device))
    else:
        param.copy_(torch.randint(0, 256, param.shape, generator=generator, device=param.device, dtype=torch.int32))
