"""Tiny random Llama 4 models made by transformers (no network), the layer pattern of Scout and Maverick at toy
width: 4 layers, rope layers 0 and 2 attending within chunks of 8 positions with the q/k L2 norm, NoPE layers 1
and 3 global with temperature tuning (floor_scale 4, so it bites at these lengths), MoE on layers 1 and 3 (4
experts, top-1 sigmoid, a shared expert) and dense SwiGLU on 0 and 2. Also the Llama4ForConditionalGeneration
around such a text model (the layout Meta and RedHatAI ship checkpoints in) and transformers' logits of a
compressed-tensors checkpoint, decompressed."""
from __future__ import annotations

import torch
import transformers


def random_llama4(seed: int, std: float, *, vocab_size: int, hidden_size: int, intermediate_size: int,
                  intermediate_size_mlp: int, head_dim: int) -> transformers.Llama4ForCausalLM:
    """The layer pattern above at the given widths (4 heads, 2 KV heads; ``intermediate_size`` the experts',
    ``intermediate_size_mlp`` the dense MLPs'), eager attention, float32; weights N(0, std), norms 1 + N(0, std)."""
    config = transformers.Llama4TextConfig(
        vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        intermediate_size_mlp=intermediate_size_mlp, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
        head_dim=head_dim, num_local_experts=4, num_experts_per_tok=1, interleave_moe_layer_step=2,
        attention_chunk_size=8, no_rope_layer_interval=2, floor_scale=4, attn_scale=0.1, max_position_embeddings=256,
        rms_norm_eps=1e-5)
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = transformers.Llama4ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + std * torch.randn_like(p))
    return model


def tiny_llama4(seed: int = 0) -> transformers.Llama4ForCausalLM:
    """Hidden 64 (head_dim 16), experts of width 32, dense MLPs of 96, vocabulary 96; weights N(0, 0.1), wide
    enough apart that float32 routing matches transformers' (tests/engine/test_llama4.py)."""
    return random_llama4(seed, 0.1, vocab_size=96, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96,
                         head_dim=16)


def llama4_of_trained_scale(seed: int = 0) -> transformers.Llama4ForCausalLM:
    """Hidden 128 (head_dim 32), experts of width 128, dense MLPs of 192, vocabulary 128: two 128-row blocks in
    gate_up, a partial one in the dense MLP's. Weights N(0, 0.02), the spread of trained checkpoints
    (test_fp8_engine.llama_of_trained_scale), for the quantized engines' tests."""
    return random_llama4(seed, 0.02, vocab_size=128, hidden_size=128, intermediate_size=128, intermediate_size_mlp=192,
                         head_dim=32)


def with_vision_tower(text: transformers.Llama4ForCausalLM) -> transformers.Llama4ForConditionalGeneration:
    """A Llama4ForConditionalGeneration holding ``text``'s weights as its language model beside a one-layer
    vision tower of width 32 (28-pixel images of 14-pixel patches) and a projector to the text width."""
    vision = transformers.Llama4VisionConfig(hidden_size=32, num_hidden_layers=1, num_attention_heads=2,
                                             intermediate_size=32, image_size=28, patch_size=14, projector_input_dim=32,
                                             projector_output_dim=text.config.hidden_size, vision_output_dim=32)
    model = transformers.Llama4ForConditionalGeneration(
        transformers.Llama4Config(text_config=text.config.to_dict(), vision_config=vision.to_dict()))
    model.language_model.load_state_dict(text.state_dict())
    return model


# The compressed-tensors ``ignore`` of a Llama4ForConditionalGeneration checkpoint as shipped: lm_head, the routers,
# the vision tower and its projector stay unquantized (names under language_model. / vision_model., hence re:.*).
CONDITIONAL_GENERATION_IGNORE = ("re:.*lm_head", "re:.*router", "re:.*vision_model.*", "re:.*multi_modal_projector.*")


def decompressed_logits(checkpoint: str, ids: list[int]) -> torch.Tensor:
    """(len(ids), vocab) float32 logits of a compressed-tensors Llama4ForCausalLM checkpoint as transformers
    loads it through its quantizer, decompressed (codes x scales)."""
    hf = transformers.Llama4ForCausalLM.from_pretrained(
        checkpoint, dtype=torch.float32, quantization_config=transformers.CompressedTensorsConfig(dequantize=True))
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]
