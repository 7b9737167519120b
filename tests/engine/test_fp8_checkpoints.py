"""Checkpoints that are already FP8 (engine/fp8_checkpoint.py): tiny random Llamas written in the
compressed-tensors layout (per channel, per tensor) and the per-tensor ``quant_method: fp8`` layout,
built with ``python -m engine.build`` and no quantization flag. The engine must hold the checkpoint's
E4M3 values and scales exactly (fused, split across ranks), and its logits must differ from the
dequantized model only by the run-time activation rounding."""
from __future__ import annotations

import json
import os

import pytest
import torch
import transformers
from safetensors import safe_open
from safetensors.torch import save_file

from engine.build import main as build_main
from engine.config import ConfigError, EngineConfig
from kernels.fp8 import FP8_DTYPE
from test_fp8_engine import all_logits, llama_of_trained_scale

LINEARS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj",
           "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
# Scales of max|row| / 400 rather than the engine's own max / 448: values that a fresh quantization
# would move, so an engine that re-rounds the checkpoint instead of keeping it fails the tests.
SOURCE_PEAK = 400.0


def quantize_like_a_checkpoint(weight: torch.Tensor, strategy: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(E4M3 weight, scale) as the checkpoint stores them: scale (out, 1) per channel, (1,) per tensor."""
    amax = weight.abs().amax(dim=1, keepdim=True) if strategy == "channel" else weight.abs().amax().reshape(1)
    scale = amax.float() / SOURCE_PEAK
    return (weight / (scale if strategy == "channel" else scale[0])).to(FP8_DTYPE), scale


def write_fp8_checkpoint(path: str, layout: str) -> dict[str, torch.Tensor]:
    """A tiny Llama saved in ``layout`` ("compressed-tensors/channel", "compressed-tensors/tensor" or
    "fp8"); returns the float32 state dict of the model the checkpoint stands for (dequantized)."""
    model = llama_of_trained_scale(seed=3)
    strategy = "channel" if layout.endswith("channel") else "tensor"
    tensors, dequantized = {}, {}
    for name, param in model.state_dict().items():
        module = name.removesuffix(".weight")
        if name.endswith(".weight") and module.split("layers.")[-1].split(".", 1)[-1] in LINEARS:
            q, scale = quantize_like_a_checkpoint(param, strategy)
            if layout == "fp8":
                scale = scale.reshape(())  # AutoFP8 writes scalars
            tensors[name], tensors[module + ".weight_scale"] = q, scale.to(torch.bfloat16 if layout == "fp8" else torch.float32)
            tensors[module + ".input_scale"] = torch.ones(()) if layout == "fp8" else torch.ones(1)  # static; unused
            dequantized[name] = q.float() * tensors[module + ".weight_scale"].float().reshape(-1, 1)
        else:
            tensors[name] = dequantized[name] = param.detach().clone()
    config = model.config.to_dict()
    if layout == "fp8":
        config["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "static"}
    else:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors", "format": "float-quantized", "ignore": ["lm_head"],
            "config_groups": {"group_0": {
                "targets": ["Linear"],
                "weights": {"num_bits": 8, "type": "float", "strategy": strategy, "symmetric": True, "dynamic": False},
                "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": True}}},
        }
    os.makedirs(path, exist_ok=True)
    json.dump(config, open(os.path.join(path, "config.json"), "w"))
    # Two shards with an index, as the Hub's larger checkpoints come.
    names = sorted(tensors)
    shards = {"model-00001-of-00002.safetensors": names[::2], "model-00002-of-00002.safetensors": names[1::2]}
    for file, part in shards.items():
        save_file({n: tensors[n].contiguous() for n in part}, os.path.join(path, file), metadata={"format": "pt"})
    index = {"metadata": {}, "weight_map": {n: f for f, part in shards.items() for n in part}}
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    return dequantized


def build_cli(checkpoint: str, output: str, tp_size: int = 1) -> EngineConfig:
    assert build_main(["--checkpoint", checkpoint, "--output", output, "--dtype", "float32", "--tp_size", str(tp_size),
                       "--max_batch_size", "4", "--max_input_len", "64", "--max_seq_len", "64",
                       "--max_num_tokens", "64", "--tokens_per_block", "4"]) == 0
    return EngineConfig.load(output)


def engine_tensors(engine_dir: str, rank: int) -> dict[str, torch.Tensor]:
    with safe_open(os.path.join(engine_dir, f"rank{rank}.safetensors"), "pt") as f:
        return {name: f.get_tensor(name) for name in f.keys()}


def expected_rank_weight(dequantized: dict, layer: int, proj: str, rank: int, tp: int) -> torch.Tensor:
    """The fused, split weight the engine's ``layers.{layer}.{proj}`` must dequantize to."""
    def part(name: str, dim: int) -> torch.Tensor:
        return dequantized[f"model.layers.{layer}.{name}.weight"].chunk(tp, dim=dim)[rank]

    if proj == "qkv_proj":
        return torch.cat([part(f"self_attn.{p}_proj", 0) for p in "qkv"])
    if proj == "gate_up_proj":
        return torch.cat([part("mlp.gate_proj", 0), part("mlp.up_proj", 0)])
    return part("self_attn.o_proj" if proj == "o_proj" else "mlp.down_proj", 1)


@pytest.mark.parametrize("layout", ["compressed-tensors/channel", "compressed-tensors/tensor", "fp8"])
@pytest.mark.parametrize("tp_size", [1, 2])
def test_fp8_checkpoint_values_and_scales_reach_the_engine_exactly(tmp_path, layout, tp_size, capsys):
    dequantized = write_fp8_checkpoint(str(tmp_path / "ckpt"), layout)
    config = build_cli(str(tmp_path / "ckpt"), str(tmp_path / "engine"), tp_size)
    assert config.build.quantization == "fp8"  # no flag given: the checkpoint decides
    assert "holds FP8 weights" in capsys.readouterr().err
    assert config.extra["source_quantization"] == f"fp8 per {'channel' if layout.endswith('channel') else 'tensor'}"
    for rank in range(tp_size):
        tensors = engine_tensors(str(tmp_path / "engine"), rank)
        for layer in range(3):
            for proj in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj"):
                weight, scale = tensors[f"layers.{layer}.{proj}.weight"], tensors[f"layers.{layer}.{proj}.weight_scale"]
                assert weight.dtype == FP8_DTYPE
                expected = expected_rank_weight(dequantized, layer, proj, rank, tp_size)
                assert torch.equal(weight.float() * scale[:, None], expected), (rank, layer, proj)
        assert tensors["lm_head.weight"].dtype == torch.float32  # left out of the quantization


def test_fp8_checkpoint_logits_differ_from_its_dequantized_model_by_activation_rounding_only(tmp_path):
    """The weights are the checkpoint's exactly, so only the per-token E4M3 rounding of activations
    remains: one factor of the product rounded (relative RMS ~2.6%, not the ~3.7% of two), measured
    at the logits about 3%; bound 6%."""
    dequantized = write_fp8_checkpoint(str(tmp_path / "ckpt"), "compressed-tensors/channel")
    build_cli(str(tmp_path / "ckpt"), str(tmp_path / "engine"))
    hf = llama_of_trained_scale(seed=3)
    hf.load_state_dict(dequantized)
    ids = [3, 17, 5, 99, 42, 8, 1, 77, 23, 64, 11, 90, 31, 7, 120, 56]
    with torch.no_grad():
        reference = hf(torch.tensor([ids])).logits[0]
    engine = all_logits(str(tmp_path / "engine"), ids)
    relative_rms = ((engine - reference).norm() / reference.norm()).item()
    assert relative_rms < 0.06, relative_rms
    assert (engine.argmax(-1) == reference.argmax(-1)).float().mean().item() >= 0.9


@pytest.mark.parametrize("quantization_config, message", [
    ({"quant_method": "fp8", "weight_block_size": [64, 64]},
     r"block-wise FP8 checkpoints with weight_block_size \[64, 64\] are not supported; supported: \[128, 128\]"),
    ({"quant_method": "hqq"}, r"quant_method 'hqq' is not supported; supported: AWQ GEMM int4; GPTQ int4/int8"),
])
def test_other_checkpoint_quantizations_are_refused_by_name(tmp_path, quantization_config, message):
    """As engine.build reads a checkpoint's scheme: integer formats first (engine/weight_only), then FP8."""
    from engine.fp8_checkpoint import fp8_checkpoint_strategy
    from engine.weight_only.checkpoint_formats import checkpoint_weight_quant

    config = transformers.LlamaConfig(quantization_config=quantization_config)
    with pytest.raises(ConfigError, match=message):
        checkpoint_weight_quant(config) or fp8_checkpoint_strategy(config)


def test_an_fp8_checkpoint_is_not_requantized_to_integers(tmp_path, capsys):
    write_fp8_checkpoint(str(tmp_path / "ckpt"), "compressed-tensors/channel")
    args = ["--checkpoint", str(tmp_path / "ckpt"), "--output", str(tmp_path / "engine"), "--quantization", "int4_wo",
            "--group_size", "32"]
    assert build_main(args) == 2
    assert "holds FP8 weights (per channel); --quantization int4_wo would round them again" in capsys.readouterr().err
