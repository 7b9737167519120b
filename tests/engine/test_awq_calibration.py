"""AWQ calibration (engine.weight_only.awq): folding the scales keeps the float model's function on
every supported layout, clipping leaves q/k alone and only shrinks, and experts stay untouched. What
AWQ buys on real weights is measured through the build, on the embedded SmolLM2
(tests/engine/test_smollm2_int4.py)."""
from __future__ import annotations

import copy

import pytest
import torch
import transformers

import engine.weight_only.awq as awq
from engine.config import ConfigError
from engine.weight_only.awq import awq_transform, decoder_layers, fake_quantize

TINY = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
            head_dim=16, initializer_range=0.2)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(num_key_value_heads=4)),  # v -> o is scaled
    "mistral_gqa": ("MistralConfig", "MistralForCausalLM", dict(num_key_value_heads=2)),
    "qwen2_bias_gqa": ("Qwen2Config", "Qwen2ForCausalLM", dict(num_key_value_heads=2)),
    "qwen3_qk_norm": ("Qwen3Config", "Qwen3ForCausalLM", dict(num_key_value_heads=2)),
    "phi3_fused": ("Phi3Config", "Phi3ForCausalLM",
                   dict(num_key_value_heads=4, pad_token_id=0, bos_token_id=1, eos_token_id=2)),
    "gemma_one_plus_w": ("GemmaConfig", "GemmaForCausalLM", dict(num_key_value_heads=4)),
    "gemma2_pre_ffn_norm": ("Gemma2Config", "Gemma2ForCausalLM", dict(num_key_value_heads=2, sliding_window=16)),
    "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM", dict(
        num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
        shared_expert_intermediate_size=64, decoder_sparse_step=1, mlp_only_layers=[])),
}
GROUP = 32


class ByteTokenizer:
    """Bytes as token ids, enough to calibrate a tiny random model."""

    def __call__(self, text: str) -> dict:
        return {"input_ids": [1] + [2 + b % 250 for b in text.encode()]}


def tiny_model(family: str) -> torch.nn.Module:
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**TINY, **extra)
    torch.manual_seed(0)
    model = getattr(transformers, model_name)(config).eval()
    with torch.no_grad():  # norms and biases away from their init, so every fold has work to do
        for name, parameter in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                parameter += torch.empty_like(parameter).uniform_(-0.5, 0.5)
    return model


def logits_with(model: torch.nn.Module, state: dict, ids: torch.Tensor) -> torch.Tensor:
    clone = copy.deepcopy(model)
    clone.load_state_dict(state)
    with torch.no_grad():
        return clone(ids).logits


TEST_IDS = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize("family", sorted(FAMILIES))
def test_folding_the_scales_keeps_the_float_model(family):
    model = tiny_model(family)
    state = awq_transform(model, ByteTokenizer(), group_size=GROUP, clip=False)
    with torch.no_grad():
        reference = model(TEST_IDS).logits
    changed = [name for name, tensor in model.state_dict().items() if not torch.equal(state[name], tensor)]
    assert any("input_layernorm" in name for name in changed)  # the transform did something
    # logits reach ~7; float32 rounding through the folded scales moves them by ~1e-5
    torch.testing.assert_close(logits_with(model, state, TEST_IDS), reference, atol=1e-4, rtol=1e-4)


def test_v_to_o_and_up_to_down_are_scaled_without_gqa():
    model = tiny_model("llama")
    state = awq_transform(model, ByteTokenizer(), group_size=GROUP, clip=False)
    original = model.state_dict()
    for name in ("self_attn.v_proj", "self_attn.o_proj", "mlp.up_proj", "mlp.down_proj"):
        assert not torch.equal(state[f"model.layers.0.{name}.weight"], original[f"model.layers.0.{name}.weight"])


def test_experts_router_and_shared_expert_are_left_alone():
    model = tiny_model("qwen2_moe")
    state = awq_transform(model, ByteTokenizer(), group_size=GROUP)
    for name, tensor in model.state_dict().items():
        if ".mlp." in name or "post_attention_layernorm" in name:
            assert torch.equal(state[name], tensor), name
    assert not torch.equal(state["model.layers.0.self_attn.q_proj.weight"],
                           model.state_dict()["model.layers.0.self_attn.q_proj.weight"])


def test_embeddings_final_norm_and_head_are_untouched():
    model = tiny_model("llama")
    state = awq_transform(model, ByteTokenizer(), group_size=GROUP)
    for name in ("model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"):
        assert torch.equal(state[name], model.state_dict()[name])
    assert all(t.dtype == torch.float32 for t in state.values())


def test_clipping_skips_q_and_k_and_only_shrinks_the_others():
    model = tiny_model("qwen2_bias_gqa")
    folded = awq_transform(model, ByteTokenizer(), group_size=GROUP, clip=False)
    clipped = awq_transform(model, ByteTokenizer(), group_size=GROUP)
    some_clipped = False
    for name, tensor in folded.items():
        if name.endswith(("q_proj.weight", "k_proj.weight")) or not name.endswith("_proj.weight"):
            assert torch.equal(clipped[name], tensor), name
        else:
            assert (clipped[name].abs() <= tensor.abs()).all(), name
            some_clipped |= not torch.equal(clipped[name], tensor)
    assert some_clipped
    with torch.no_grad():
        reference = model(TEST_IDS).logits
    change = (logits_with(model, clipped, TEST_IDS) - reference).abs().max() / reference.abs().max()
    assert change < 0.2


def test_deterministic_and_leaves_the_model_alone():
    model = tiny_model("phi3_fused")
    before = {name: tensor.clone() for name, tensor in model.state_dict().items()}
    first = awq_transform(model, ByteTokenizer(), group_size=GROUP)
    second = awq_transform(model, ByteTokenizer(), group_size=GROUP)
    assert all(torch.equal(first[name], second[name]) for name in first)
    assert all(torch.equal(before[name], tensor) for name, tensor in model.state_dict().items())


def test_a_wrongly_wired_layer_is_refused(monkeypatch):
    real_plan = awq.layer_plan

    def miswired(layer, text_config, architecture):
        plan = real_plan(layer, text_config, architecture)
        plan.groups[0].producer = layer.post_attention_layernorm  # not what q/k/v read
        plan.captured.append(layer.post_attention_layernorm)
        return plan

    monkeypatch.setattr(awq, "layer_plan", miswired)
    with pytest.raises(ConfigError, match="changed the layer's output"):
        awq_transform(tiny_model("llama"), ByteTokenizer(), group_size=GROUP, clip=False)


def test_unsupported_layouts_and_group_sizes_are_refused():
    gpt2 = transformers.GPT2LMHeadModel(transformers.GPT2Config(
        vocab_size=256, n_embd=64, n_layer=1, n_head=4, bos_token_id=0, eos_token_id=0))
    with pytest.raises(ConfigError, match="GPT2LMHeadModel"):
        awq_transform(gpt2, ByteTokenizer(), group_size=GROUP)
    with pytest.raises(ConfigError, match="group size 48"):
        awq_transform(tiny_model("llama"), ByteTokenizer(), group_size=48)


@pytest.mark.parametrize("bits", [4, 8])
def test_fake_quantize_is_exactly_the_stored_weights_dequantized(bits):
    """The searches' fast form (no packing) against the round trip through the stored format."""
    from kernels.wna16 import dequantize, quantize

    torch.manual_seed(bits)
    weight = torch.randn(48, 256) * torch.rand(48, 1) * 3
    weight[0, :64] = 0.0  # an all-zero group: the scale's floor
    weight[1, 64:128] = weight[1, 64:128].abs()  # an all-positive group: its minimum widened to 0
    assert torch.equal(fake_quantize(weight, bits, 64), dequantize(*quantize(weight, bits, 64, symmetric=False), bits))
