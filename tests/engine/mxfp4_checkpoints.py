"""gpt-oss checkpoints with MXFP4 experts, written the way OpenAI ships them, from a transformers model.

``write_mxfp4_checkpoint(hf_model, path)`` quantizes the model's experts (transformers' (E, in, out)
``gate_up_proj`` and ``down_proj``) to MXFP4 rows of the output features: ``<name>_blocks`` uint8
(E, out, in / 32, 16), two FP4 E2M1 codes a byte with the low nibble first, and ``<name>_scales``
uint8 (E, out, in / 32) E8M0 exponents; every other tensor is saved as it is, beside a config.json
with ``quantization_config = {"quant_method": "mxfp4", ...}`` (transformers/integrations/mxfp4.py
reads this layout). ``transformers_mxfp4_model(path)`` loads it back through transformers with
``Mxfp4Config(dequantize=True)``: the reference the engine is compared with.
"""
from __future__ import annotations

import torch
import transformers
from safetensors.torch import save_file

from engine.mxfp4 import FP4_E2M1_VALUES

EXPERT_TENSORS = ("mlp.experts.gate_up_proj", "mlp.experts.down_proj")
MODULES_NOT_CONVERTED = ["model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]


def quantize_mxfp4(rows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """rows (..., n), n a multiple of 32 -> (blocks uint8 (..., n / 32, 16), scales uint8 (..., n / 32)):
    each group of 32 scaled by the power of two that brings its largest magnitude within 6 (FP4's
    largest), then rounded to the nearest FP4 value."""
    groups = rows.float().unflatten(-1, (-1, 32))
    amax = groups.abs().amax(-1).clamp_min(2.0**-126)
    exponent = torch.ceil(torch.log2(amax / 6.0)).clamp(-127, 127)
    scaled = groups / torch.exp2(exponent)[..., None]
    table = torch.tensor(FP4_E2M1_VALUES[:8])
    magnitude = (scaled.abs()[..., None] - table).abs().argmin(-1)
    codes = (magnitude | ((scaled < 0) & (magnitude > 0)).to(torch.int64) << 3).to(torch.uint8)
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)
    return blocks.contiguous(), (exponent + 127).to(torch.uint8)


def write_mxfp4_checkpoint(hf_model, path) -> str:
    """``hf_model`` (a GptOssForCausalLM) saved with MXFP4 experts in ``path`` (module docstring)."""
    tensors = {}
    for name, tensor in hf_model.state_dict().items():
        if name.endswith(EXPERT_TENSORS):
            blocks, scales = quantize_mxfp4(tensor.transpose(1, 2))  # rows = the output features
            tensors[name + "_blocks"], tensors[name + "_scales"] = blocks, scales
        else:
            tensors[name] = tensor.detach().clone().contiguous()
    config = hf_model.config.to_dict()
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": MODULES_NOT_CONVERTED}
    config = type(hf_model.config).from_dict(config)
    config.save_pretrained(path)
    save_file(tensors, f"{path}/model.safetensors", metadata={"format": "pt"})
    return str(path)


def transformers_mxfp4_model(path, dtype: torch.dtype = torch.float32):
    """transformers' model of an MXFP4 checkpoint, experts dequantized to ``dtype`` (eager attention).
    The final ``.to(dtype)``: some transformers releases (5.17) leave the dequantized experts in bf16
    whatever ``dtype`` says, and their float32 forward then fails on the mixed operands."""
    return transformers.AutoModelForCausalLM.from_pretrained(
        path, quantization_config=transformers.Mxfp4Config(dequantize=True), dtype=dtype,
        attn_implementation="eager", experts_implementation="eager").to(dtype).eval()
