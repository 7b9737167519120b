"""SmoothQuant W8A8 INT8 engines (--quantization int8_sq): the engine computes transformers' model
after the build's own smoothing (engine/weight_only/smoothquant.py, same calibration) with every
decoder linear run as kernels/int8_sq.py's reference scheme; the stored tensors follow the format;
what cannot be built is refused by name."""
from __future__ import annotations

import copy

import pytest
import torch
from engine_testing import VOCAB, getter_from_state_dict, random_tokens, tiny_hf
from safetensors.torch import load_file
from test_weight_only_engine import engine_logits, reference_logits

from engine.build import build_from_hf
from engine.config import BuildConfig, ConfigError
from engine.weight_only.smoothquant import smoothquant_transform
from kernels.int8_sq import int8_linear_ref, quantize_weight_int8

CALIBRATION_TOKENS = 64


class ByteTokenizer:
    """Bytes as token ids of the tiny vocabulary, enough to calibrate a tiny random model."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1] + [2 + b % (VOCAB - 2) for b in text.encode()]}

    def save_pretrained(self, _directory):
        pass


def build_int8_sq(hf, out_dir, tokenizer=ByteTokenizer(), family_dtype="float32") -> str:
    build = BuildConfig(dtype=family_dtype, max_batch_size=4, max_input_len=64, max_seq_len=64, max_num_tokens=256,
                        tokens_per_block=16, quantization="int8_sq")
    build_from_hf(hf.config, getter_from_state_dict(hf.state_dict(), "tiny"), tokenizer, str(out_dir), build,
                  progress=False, calibration_tokens=CALIBRATION_TOKENS)
    return str(out_dir)


def w8a8_reference(hf) -> torch.nn.Module:
    """transformers' model smoothed as the build smooths it, its decoder linears as W8A8 INT8."""
    model = copy.deepcopy(hf)
    model.load_state_dict(smoothquant_transform(hf, ByteTokenizer(), max_tokens=CALIBRATION_TOKENS))

    def int8_product(module, args, output):
        return int8_linear_ref(args[0], *quantize_weight_int8(module.weight.data), module.bias)

    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and ".layers." in name:
            module.register_forward_hook(int8_product)
    return model


@pytest.fixture(scope="module")
def llama_engine(tmp_path_factory):
    hf = tiny_hf("llama_groupable")
    return hf, build_int8_sq(hf, tmp_path_factory.mktemp("int8_sq") / "engine")


def test_engine_equals_the_smoothed_w8a8_model(llama_engine):
    hf, engine_dir = llama_engine
    tokens = random_tokens(12, seed=3)
    expected = reference_logits(w8a8_reference(hf), tokens)
    error = (engine_logits(engine_dir, tokens) - expected).abs().max().item()
    # the same integers on both sides (8e-7 measured): float32 rounding, not quantization error
    assert error < 1e-4, f"max |logit error| {error:.3g}"
    assert (reference_logits(hf, tokens) - expected).abs().max().item() > 10 * error  # quantization is real


def test_stored_tensors_follow_the_format(llama_engine):
    _, engine_dir = llama_engine
    weights = load_file(f"{engine_dir}/rank0.safetensors")
    qkv = next(name for name in weights if name.endswith("qkv_proj.weight"))
    assert weights[qkv].dtype == torch.int8 and weights[qkv].abs().max() == 127
    assert weights[qkv + "_scale"].dtype == torch.float32 and weights[qkv + "_scale"].shape == weights[qkv].shape[:1]
    assert not any(name.endswith("_zero") for name in weights)
    assert next(t for n, t in weights.items() if "embed" in n).dtype == torch.float32


def test_refused_without_tokenizer_or_for_other_families(tmp_path):
    with pytest.raises(ConfigError, match="int8_sq calibrates on text"):
        build_int8_sq(tiny_hf("llama_groupable"), tmp_path / "a", tokenizer=None)
    with pytest.raises(ConfigError, match="quantization int8_sq is not supported for GPT2LMHeadModel"):
        build_int8_sq(tiny_hf("gpt2"), tmp_path / "b")
