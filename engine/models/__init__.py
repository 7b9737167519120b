"""Model registry: Hugging Face architecture name -> the engine's model class.

Every model class has the same surface:

- ``__init__(config, *, tp_rank, tp_size, tp_group, dtype, device, max_positions)``: parameters
  for one tensor-parallel rank, named as in the engine directory (build on ``device="meta"``
  and load with ``load_state_dict(..., assign=True)``);
- ``init_buffers(device)``: non-weight tensors (rotary tables), once after loading;
- ``forward(input_ids, positions, kv_cache, attn_meta) -> hidden (num_tokens, hidden)``;
- ``compute_logits(hidden_rows) -> float32 logits (rows, vocab)``, all-gathered over ranks.
"""
from __future__ import annotations

from engine.config import ConfigError

_REGISTRY = {
    "LlamaForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "MistralForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "Qwen2ForCausalLM": ("engine.models.llama", "LlamaForCausalLM"),
    "GPT2LMHeadModel": ("engine.models.gpt2", "GPT2LMHeadModel"),
    "Gemma2ForCausalLM": ("engine.models.gemma", "GemmaForCausalLM"),
    "Gemma3ForCausalLM": ("engine.models.gemma", "GemmaForCausalLM"),
}
SUPPORTED_ARCHITECTURES = tuple(_REGISTRY)


class UnsupportedArchitectureError(ConfigError):
    """The checkpoint's architecture has no engine model."""


def get_model_class(architecture: str):
    """Return the model class for ``architecture`` or raise naming the supported ones."""
    if architecture not in _REGISTRY:
        raise UnsupportedArchitectureError(
            f"unsupported architecture {architecture!r}; supported: {', '.join(SUPPORTED_ARCHITECTURES)}"
        )
    import importlib

    module_name, class_name = _REGISTRY[architecture]
    return getattr(importlib.import_module(module_name), class_name)
