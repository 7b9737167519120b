"""Checkpoints that ship integer weights (AWQ, GPTQ, compressed-tensors), built as a user builds
them (``engine.build.build_engine`` on the directory): the engine keeps their codes, and its logits
equal transformers' model holding the checkpoint's dequantized weights.

The writers (tests/engine/quantized_checkpoints.py) pack each format from its definition, and
compressed-tensors through that library's own compressors; ``Written.reference`` is the float
model the checkpoint stands for. The bound is float32 rounding (2e-4 on logits of magnitude ~1):
the engine must run exactly the checkpoint's weights, so quantization error never enters it.
"""
from __future__ import annotations

import pytest
import torch
from safetensors.torch import load_file

from engine.build import build_engine
from engine.config import BuildConfig, ConfigError, EngineConfig
from engine_testing import assert_tp2_engines_match_tp1
from kernels.wna16 import unpack_codes
from quantized_checkpoints import VARIANTS, tiny_llama, tiny_qwen3_moe, transformers_state, write_variant
from test_weight_only_engine import engine_logits, reference_logits

TOKENS = [5, 17, 42, 8, 3, 77, 61, 90, 2, 33, 4, 9]


def build(checkpoint, out_dir, tp_size: int = 1, **options) -> str:
    config = BuildConfig(dtype="float32", max_batch_size=4, max_input_len=128, max_seq_len=128, max_num_tokens=512,
                         tokens_per_block=16, tp_size=tp_size, **options)
    build_engine(str(checkpoint), str(out_dir), config, progress=False)
    return str(out_dir)


def reference_model(family: str, reference: dict) -> torch.nn.Module:
    model = tiny_llama() if family == "llama" else tiny_qwen3_moe()
    reference = transformers_state(reference)
    missing, unexpected = model.load_state_dict(reference, strict=False)
    assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
    return model.eval()


@pytest.mark.parametrize("variant", sorted(VARIANTS))
def test_llama_checkpoint_engine_equals_its_dequantized_weights(variant, tmp_path):
    written = write_variant(str(tmp_path / "ckpt"), variant)
    engine_dir = build(tmp_path / "ckpt", tmp_path / "engine")
    error = (engine_logits(engine_dir, TOKENS) - reference_logits(reference_model("llama", written.reference),
                                                                   TOKENS)).abs().max().item()
    assert error < 2e-4, f"{variant}: max |logit error| {error:.3g}"


@pytest.mark.parametrize("variant", ["gptq_v1_sym", "ct_w4a16_g128_asym", "awq_gemm_asym"])
def test_moe_checkpoint_engine_equals_its_dequantized_weights(variant, tmp_path):
    written = write_variant(str(tmp_path / "ckpt"), variant, family="qwen3_moe")
    engine_dir = build(tmp_path / "ckpt", tmp_path / "engine")
    error = (engine_logits(engine_dir, TOKENS) - reference_logits(reference_model("qwen3_moe", written.reference),
                                                                   TOKENS)).abs().max().item()
    assert error < 2e-4, f"{variant} (experts quantized): max |logit error| {error:.3g}"


def test_codes_are_carried_not_requantized(tmp_path):
    """The engine's q rows hold the checkpoint's codes, sorted into group order by act-order, and
    the build records where they came from."""
    written = write_variant(str(tmp_path / "ckpt"), "gptq_v1_asym_desc_act")
    engine_dir = build(tmp_path / "ckpt", tmp_path / "engine")
    config, weights = EngineConfig.load(engine_dir), load_file(f"{engine_dir}/rank0.safetensors")
    assert (config.build.quantization, config.build.quant_group_size, config.build.quant_act_order) == \
        ("int4_wo", 32, True)
    assert "gptq" in config.extra["source_quantization"]
    q = written.expected["model.layers.0.self_attn.q_proj"]
    perm = weights["layers.0.qkv_proj.input_perm"].long()
    assert torch.equal(perm, torch.argsort(q.g_idx.long(), stable=True))
    rows = q.codes.shape[0]
    assert torch.equal(unpack_codes(weights["layers.0.qkv_proj.weight"][:rows], 4), q.codes[:, perm])
    assert torch.equal(weights["layers.0.qkv_proj.weight_scale"][:rows], q.scale)


def test_act_order_crossing_tensor_parallel_ranks_is_refused_by_name(tmp_path):
    """A desc_act order over all of o_proj's columns would need columns of the other rank: refused
    at tp 2 naming the layer (the same checkpoint builds at tp 1, above)."""
    write_variant(str(tmp_path / "ckpt"), "gptq_int8_sym_desc_act")
    with pytest.raises(ConfigError, match=r"layers\.0\.o_proj\.weight: the act-order \(g_idx\) of a row-parallel "
                                          r"layer crosses tensor-parallel ranks"):
        build(tmp_path / "ckpt", tmp_path / "tp2", tp_size=2)


def test_tp2_carries_groups_split_along_input_columns(tmp_path):
    """A group-32 GPTQ checkpoint at tp 2: two gloo ranks give tp 1's logits."""
    write_variant(str(tmp_path / "ckpt"), "gptq_v1_asym")
    tp1, tp2 = build(tmp_path / "ckpt", tmp_path / "tp1"), build(tmp_path / "ckpt", tmp_path / "tp2", tp_size=2)
    assert_tp2_engines_match_tp1({"gptq": (tp1, tp2)}, tmp_path)


def test_requantizing_a_quantized_checkpoint_is_refused(tmp_path):
    write_variant(str(tmp_path / "ckpt"), "awq_gemm_asym")
    with pytest.raises(ConfigError, match=r"holds awq int4 .* --quantization int8_wo would round them again"):
        build(tmp_path / "ckpt", tmp_path / "engine", quantization="int8_wo")


def test_act_order_experts_are_refused_by_name(tmp_path):
    write_variant(str(tmp_path / "ckpt"), "gptq_v1_sym_desc_act", family="qwen3_moe")
    with pytest.raises(ConfigError, match=r"moe\.(gate_up|down)_proj: act-order \(desc_act\) experts are not supported"):
        build(tmp_path / "ckpt", tmp_path / "engine")


def test_a_layer_the_checkpoint_left_unquantized_is_quantized_at_build(tmp_path, capsys):
    """k_proj of layer 0 stored in float (as a checkpoint's ignore list leaves a module): the fused
    qkv of that layer is quantized afresh with round to nearest (said on stderr), the other layers
    keep the checkpoint's codes."""
    from safetensors.torch import load_file as load, save_file

    written = write_variant(str(tmp_path / "ckpt"), "gptq_v1_asym")
    path = tmp_path / "ckpt" / "model.safetensors"
    tensors = load(str(path))
    module = "model.layers.0.self_attn.k_proj"
    for suffix in ("qweight", "qzeros", "scales", "g_idx"):
        tensors.pop(f"{module}.{suffix}", None)
    tensors[f"{module}.weight"] = written.reference[f"{module}.weight"]
    save_file(tensors, str(path))
    engine_dir = build(tmp_path / "ckpt", tmp_path / "engine")
    assert "layers.0.qkv_proj.weight is not quantized (or only in part)" in capsys.readouterr().err
    weights = load_file(f"{engine_dir}/rank0.safetensors")
    q1 = written.expected["model.layers.1.self_attn.q_proj"]
    assert torch.equal(unpack_codes(weights["layers.1.qkv_proj.weight"][:q1.codes.shape[0]], 4), q1.codes)
    reference = reference_logits(reference_model("llama", written.reference), TOKENS)
    error = ((engine_logits(engine_dir, TOKENS) - reference).norm() / reference.norm()).item()
    # k_proj's float weights lie on the checkpoint's grid, so round to nearest nearly recovers them
    # (1.2e-4 measured): far below what quantizing the float model costs, nowhere near exact.
    assert error < 1e-2, error
