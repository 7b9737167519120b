"""Tiny random hybrid Mamba checkpoints made by transformers itself (Bamba, Nemotron-H and Granite 4.0
dense and MoE, Falcon-H1, pure Mamba-2; Mamba-1 and Jamba).

Sizes are the smallest the kernels' tiles take whole (head_dim and d_state 16); two groups of B/C
so heads really share them; one attention layer among Mamba layers (Bamba: rope, partial 0.5;
Nemotron-H: no positions) and Nemotron-H's relu^2 MLP block.
"""
from __future__ import annotations

import math

import torch
import transformers

VOCAB = 96


def bamba_config() -> transformers.BambaConfig:
    return transformers.BambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_indices=[1], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=None, bos_token_id=None)


def nemotron_h_config() -> transformers.NemotronHConfig:
    return transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layers_block_type=["linear_attention", "mlp", "full_attention",
                                                              "linear_attention"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        max_position_embeddings=1024, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def nemotron_h_moe_config() -> transformers.NemotronHConfig:
    """Nemotron-H with an MoE layer (Nemotron-3 Nano's form): 8 relu^2 experts in 2 groups, the best
    group only, top 2, renormalised and scaled by 2.5, beside a relu^2 shared MLP of another width."""
    return transformers.NemotronHConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, layers_block_type=["linear_attention", "moe", "full_attention"],
        mamba_num_heads=4, mamba_head_dim=16, n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16,
        n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=24, moe_shared_expert_intermediate_size=40,
        n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=1024,
        pad_token_id=0, eos_token_id=None, bos_token_id=None)


def granite_hybrid_config() -> transformers.GraniteMoeHybridConfig:
    """Granite 4.0's dense hybrid (H-Micro's form): rope attention and muP scalars that bite."""
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, shared_intermediate_size=40, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=0,
        layer_types=["mamba", "attention", "mamba"], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0,
        max_position_embeddings=1024, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def granite_moe_config() -> transformers.GraniteMoeHybridConfig:
    """Granite 4.0's MoE hybrid (H-Tiny / H-Small's form): 4 routed experts (top 2) beside the shared
    MLP in both layers (Mamba-2, then rope attention), the muP scalars as above."""
    return transformers.GraniteMoeHybridConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=24, shared_intermediate_size=40, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2,
        layer_types=["mamba", "attention"], mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_d_conv=4, mamba_expand=2, mamba_chunk_size=16, position_embedding_type="rope",
        embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3, logits_scaling=4.0,
        max_position_embeddings=1024, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def mamba2_config() -> transformers.Mamba2Config:
    """Pure Mamba-2, tied embeddings (as state-spaces/mamba2-130m)."""
    return transformers.Mamba2Config(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=3, num_heads=4, head_dim=16, n_groups=2, state_size=16,
        expand=2, conv_kernel=4, chunk_size=16, tie_word_embeddings=True, pad_token_id=0, eos_token_id=None,
        bos_token_id=None)


def falcon_h1_config() -> transformers.FalconH1Config:
    """Falcon-H1 with every muP multiplier away from 1 (so folding each into the right weight is
    checked) and the gated norm on, normed before the gate."""
    return transformers.FalconH1Config(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=2,
        mamba_d_state=16, mamba_chunk_size=16, mamba_rms_norm=True, mamba_norm_before_gate=True,
        embedding_multiplier=1.5, lm_head_multiplier=0.7, mlp_multipliers=[1.3, 0.8], key_multiplier=0.9,
        attention_in_multiplier=1.2, attention_out_multiplier=0.6, ssm_in_multiplier=1.1, ssm_out_multiplier=0.5,
        ssm_multipliers=[1.2, 0.9, 1.1, 0.8, 1.3], max_position_embeddings=1024, pad_token_id=0, eos_token_id=None,
        bos_token_id=None)


def mamba_config() -> transformers.MambaConfig:
    """Pure Mamba-1; dt_rank 4 of hidden 32. Untied (state-spaces' checkpoints tie, as pure Mamba-2's
    test does): with no MLP and small random mixers a tied model only repeats its last token, which
    would make its greedy ids say little."""
    return transformers.MambaConfig(
        vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2, state_size=16, expand=2, conv_kernel=4,
        time_step_rank=4, tie_word_embeddings=False, pad_token_id=0, eos_token_id=None, bos_token_id=None)


def jamba_config() -> transformers.JambaConfig:
    """Jamba with every kind of block in 2 layers: Mamba-1 + routed experts (4, top 2), attention
    (no positions) + dense MLP."""
    return transformers.JambaConfig(
        vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, attn_layer_period=2, attn_layer_offset=1, expert_layer_period=2,
        expert_layer_offset=0, num_experts=4, num_experts_per_tok=2, mamba_d_state=16, mamba_d_conv=4,
        mamba_expand=2, mamba_dt_rank=4, max_position_embeddings=1024, pad_token_id=0, eos_token_id=None,
        bos_token_id=None)


HYBRIDS = {"bamba": (transformers.BambaForCausalLM, bamba_config),
           "nemotron_h": (transformers.NemotronHForCausalLM, nemotron_h_config),
           "nemotron_h_moe": (transformers.NemotronHForCausalLM, nemotron_h_moe_config),
           "granite_hybrid": (transformers.GraniteMoeHybridForCausalLM, granite_hybrid_config),
           "granite_moe": (transformers.GraniteMoeHybridForCausalLM, granite_moe_config),
           "mamba2": (transformers.Mamba2ForCausalLM, mamba2_config),
           "falcon_h1": (transformers.FalconH1ForCausalLM, falcon_h1_config),
           "mamba": (transformers.MambaForCausalLM, mamba_config),
           "jamba": (transformers.JambaForCausalLM, jamba_config)}


def tiny_hybrid(family: str, seed: int = 0) -> torch.nn.Module:
    model_class, make_config = HYBRIDS[family]
    config = make_config()
    config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = model_class(config).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            base = 1.0 if "norm" in name and name.endswith("weight") else 0.0  # norms near 1, the rest small
            p.copy_(base + 0.1 * torch.randn_like(p))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):  # Nemotron-H's router: a bias that changes the choice
                b.copy_(0.1 * torch.randn_like(b))
    group_gated_norms(model)
    if family == "jamba":
        clear_routing_margins(model)
    return model


def steered(family: str) -> torch.nn.Module:
    """tiny_hybrid(family) with clear routing margins (steer_routing) for the CUDA bf16 comparison, for
    the Mamba-2 MoE hybrids. (Their CPU float32 tests keep the plain random routers, whose near ties
    float32 resolves alike in engine and reference, so that Nemotron-H's score bias and group limit
    still decide some tokens' experts there.)"""
    model = tiny_hybrid(family)
    # (Nemotron-H's sigmoid scores: a smaller gain keeps them off saturation, the other channels'
    # random weights and the score bias scaled down to match)
    steer_routing(model, *((1.0, 1.0) if family == "granite_moe" else (0.5, 0.25)))
    return model


def steer_routing(model: torch.nn.Module, gain: float, rest: float, radius: float = 1.0) -> None:
    """clear_routing_margins for the Mamba-2 MoE hybrids (Granite 4.0, Nemotron-H), whose routers sit
    in every layer, not only after the first mixer: no block writes to hidden channels 0 and 1 (the
    rows of every output projection into the residual zeroed: Mamba out_proj, attention o_proj, the
    experts' and shared MLP's down projections), so the residual keeps the embedding's (cos, sin)
    (theta_v) there at every router, and router[e, 0:2] = gain * (cos, sin)(phi_e) with expert e at
    phi_e = 2 pi e / E. theta_v lies between experts 2k and 2k+1 (k = v % 4 of Nemotron-H's 8; Granite's 4:
    between e and e + 1 around the circle), so a token's top two are those neighbours, both in one of
    Nemotron-H's groups of 4, and the rest well below; the other channels keep their random router
    weights, times ``rest`` (the weights still vary with the context). test_hybrid_models.py holds the
    margins."""
    num_experts = model.config.num_local_experts if hasattr(model.config, "num_local_experts") else 0
    num_experts = getattr(model.config, "n_routed_experts", None) or num_experts
    step = 2 * math.pi / num_experts
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("out_proj.weight", "o_proj.weight", "output_linear.weight",
                              "shared_experts.down_proj.weight")):
                p[:2] = 0
            elif name.endswith("experts.down_proj"):  # (E, H, I)
                p[:, :2] = 0
            elif name.endswith(("block_sparse_moe.router.weight", "mixer.gate.weight")):
                phi = step * torch.arange(num_experts)
                p.mul_(rest)
                p[:, 0], p[:, 1] = gain * phi.cos(), gain * phi.sin()
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.mul_(rest)
        pairs = 4 if num_experts == 8 else num_experts  # neighbour pairs a token may pick
        v = torch.arange(model.config.vocab_size) % pairs
        theta = step / 2 + step / 6 + v * (2 * step if num_experts == 8 else step)
        embedding = model.get_input_embeddings().weight
        embedding[:, 0], embedding[:, 1] = radius * theta.cos(), radius * theta.sin()


def clear_routing_margins(model: transformers.JambaForCausalLM, radius: float = 1.0, gain: float = 0.5) -> None:
    """Make every token's top-2 expert set clear-cut, so that bfloat16 (the CUDA test's engine dtype)
    cannot flip it against the float32 reference.

    With random routers some token's 2nd and 3rd router logits are near-equal (the seed-0 model had
    one token at 0.2844 vs 0.2834, 0.35% apart, under one bf16 step at that size); bf16 rounding
    upstream (~1% relative on the router's input, in transformers' own bf16 forward as in the
    engine's) then legitimately routes it to the other expert, and its logits move ~0.6. Scaling
    the router does not help: its margins and their rounding scale together. So hidden channels
    0 and 1 carry a per-token direction (cos, sin)(theta) that routing reads:

    - embedding[v, 0:2] = radius * (cos, sin)(theta_v), theta_v = pi/4 + pi/12 + (v % 4) * pi/2;
    - layer 0's Mamba mixer (the residual at layer 0's router, the only one, is the embedding plus
      its output) writes nothing to channels 0 and 1 (out_proj rows zeroed), so the router input
      keeps the embedding's direction there whatever the context;
    - router[e, 0:2] = gain * (cos, sin)(e * pi/2): expert e's logit peaks at theta = e * pi/2, so a
      token's top two are the adjacent experts around theta_v ({0,1}, {1,2}, {2,3}, {3,0}, one per
      v % 4), the 3rd well below. The other channels keep random router weights, so the top-2
      weights still vary with the context (2nd weight ~0.29 on average).

    Measured on the test prompts: the smallest 2nd-3rd logit gap is >= 0.4 of the token's largest
    |logit| (test_hybrid_models.py asserts >= 0.1)."""
    layers = model.model.layers
    assert [hasattr(layer.feed_forward, "router") for layer in layers] == [True, False], "jamba_config's layout"
    with torch.no_grad():
        theta = math.pi / 4 + math.pi / 12 + math.pi / 2 * (torch.arange(model.config.vocab_size) % 4)
        phi = math.pi / 2 * torch.arange(model.config.num_experts)
        embedding = model.get_input_embeddings().weight
        embedding[:, 0], embedding[:, 1] = radius * theta.cos(), radius * theta.sin()
        layers[0].mamba.out_proj.weight[:2] = 0  # the residual at the router: embedding + this mixer
        router = layers[0].feed_forward.router.weight
        router[:, 0], router[:, 1] = gain * phi.cos(), gain * phi.sin()


def router_logits(model: transformers.JambaForCausalLM, prompt: list[int]) -> torch.Tensor:
    """The tiny Jamba's router logits (tokens, experts) for ``prompt`` in the model's dtype: the
    router's input is layer 0's pre_ff_layernorm output, read by a hook (so older transformers,
    whose router is a plain Linear, serve the same)."""
    layer = model.model.layers[0]
    inputs = []
    hook = layer.pre_ff_layernorm.register_forward_hook(lambda module, args, out: inputs.append(out[0]))
    try:
        with torch.no_grad():
            model(torch.tensor([prompt]))
    finally:
        hook.remove()
    return inputs[0] @ layer.feed_forward.router.weight.T


def _grouped_gated_norm(self, hidden_states, gate=None):
    """Mamba-2's gated RMSNorm as mamba_ssm computes it (RMSNormGated with group_size = d_ssm //
    n_groups): each group of channels normalized on its own. Same arithmetic as transformers'
    grouped MambaRMSNormGated."""
    input_dtype = hidden_states.dtype
    hidden_states = hidden_states.to(torch.float32)
    if gate is not None:
        hidden_states = hidden_states * torch.nn.functional.silu(gate.to(torch.float32))
    groups = hidden_states.view(*hidden_states.shape[:-1], -1, self.group_size)
    groups = groups * torch.rsqrt(groups.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return self.weight * groups.view(hidden_states.shape).to(input_dtype)


_UNGROUPED_NORMS = {"MambaRMSNormGated", "BambaRMSNormGated", "GraniteMoeHybridRMSNormGated"}


def group_gated_norms(model: torch.nn.Module) -> None:
    """Older transformers (5.17, the GPU machine's) normalize the Mamba/Bamba/Granite-hybrid gated
    norm over all d_ssm channels at once; later ones (5.24) per group of d_ssm // n_groups, as
    mamba_ssm and the checkpoints' training do, and as the engine does. With n_groups = 2 here the
    two differ (logits ~0.6 apart), so on an older transformers the reference's norms are made
    per-group; on a newer one (``group_size`` already set) nothing changes."""
    for module in model.modules():
        mixer_norm = getattr(module, "norm", None)
        if type(mixer_norm).__name__ not in _UNGROUPED_NORMS or hasattr(mixer_norm, "group_size"):
            continue  # Nemotron-H's and Falcon-H1's norms were always per group
        n_groups = module.n_groups
        mixer_norm.group_size = mixer_norm.weight.shape[0] // n_groups
        mixer_norm.forward = _grouped_gated_norm.__get__(mixer_norm)


@torch.no_grad()
def hf_greedy(model, prompt: list[int], max_new_tokens: int) -> list[int]:
    out = model.generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                         min_new_tokens=max_new_tokens, pad_token_id=0)
    return out[0, len(prompt):].tolist()
