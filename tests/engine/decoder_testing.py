"""Tiny random checkpoints of the configurable-decoder families (engine/models/decoder.py), made by
transformers itself, shared by tests/engine/test_decoder_families.py and the served test.

Each entry covers one form of its family (both residual forms of GPT-NeoX, both Falcon
architectures, OPT with and without projected embeddings, ...). Every weight is random, norms
around 1 and biases too, so no term of the math hides behind an init of 0 or 1. Shapes are small
but not trivial: GQA where the family has it, partial rotary, odd head counts for ALiBi.
"""
from __future__ import annotations

import torch
import transformers

VOCAB = 96
POSITIONS = 256  # room for a 150-token prompt and its generated tokens

DECODER_FAMILIES = {
    # Pythia-like: parallel residual with two norms, rotary on a quarter of each head (4 of 16 dims).
    "gpt_neox_parallel": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=POSITIONS, rotary_pct=0.25, use_parallel_residual=True)),
    # GPT-NeoX with the sequential residual, half of each head rotated.
    "gpt_neox_sequential": lambda: transformers.GPTNeoXForCausalLM(transformers.GPTNeoXConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=96,
        max_position_embeddings=POSITIONS, rotary_pct=0.5, use_parallel_residual=False, rotary_emb_base=500.0)),
    # Falcon-7B's form: multi-query (one KV head), attention and MLP in parallel off one norm, no biases.
    "falcon_7b_multi_query": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, multi_query=True,
        parallel_attn=True, new_decoder_architecture=False, bias=False, max_position_embeddings=POSITIONS)),
    # Falcon-40B/180B's new decoder architecture: KV groups (6 q heads over 2 KV heads), two norms; with biases.
    "falcon_new_grouped_kv": lambda: transformers.FalconForCausalLM(transformers.FalconConfig(
        vocab_size=VOCAB, hidden_size=72, num_hidden_layers=2, num_attention_heads=6, num_kv_heads=2,
        new_decoder_architecture=True, bias=True, ffn_hidden_size=80, max_position_embeddings=POSITIONS,
        rope_theta=20000.0)),
    # GPT-J: interleaved pairs on the first 6 of 16 dims of each head, parallel residual, lm_head bias.
    "gptj": lambda: transformers.GPTJForCausalLM(transformers.GPTJConfig(
        vocab_size=VOCAB, n_embd=64, n_layer=2, n_head=4, rotary_dim=6, n_inner=96, n_positions=POSITIONS)),
    # OPT-125m's form: pre-norm, learned positions at offset 2, ReLU, a final norm.
    "opt_pre_norm": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=64, max_position_embeddings=POSITIONS, do_layer_norm_before=True)),
    # OPT-350m's form: post-norm (no final norm), embeddings of width 32 projected in and out.
    "opt_350m_projected": lambda: transformers.OPTForCausalLM(transformers.OPTConfig(
        vocab_size=VOCAB, hidden_size=64, ffn_dim=96, num_hidden_layers=2, num_attention_heads=4,
        word_embed_proj_dim=32, max_position_embeddings=POSITIONS, do_layer_norm_before=False)),
    # StarCoder2: GQA 4/2, LayerNorm with biases, GELU-tanh MLP with biases, a window of 24 tokens.
    "starcoder2": lambda: transformers.Starcoder2ForCausalLM(transformers.Starcoder2Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, max_position_embeddings=POSITIONS, sliding_window=24, bos_token_id=None,
        eos_token_id=None)),
    # GLM-4: half of each head rotated in interleaved pairs, q/k/v biases, post-sublayer RMSNorms, SwiGLU.
    "glm4": lambda: transformers.Glm4ForCausalLM(transformers.Glm4Config(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=16, max_position_embeddings=POSITIONS, pad_token_id=0,
        eos_token_id=None, bos_token_id=None)),
    # BLOOM: ALiBi over 6 heads (not a power of two: the slopes' second series), embedding LayerNorm,
    # fused q/k/v per head, biases everywhere.
    "bloom": lambda: transformers.BloomForCausalLM(transformers.BloomConfig(
        vocab_size=VOCAB, hidden_size=72, n_layer=2, n_head=6, bos_token_id=None, eos_token_id=None,
        pad_token_id=None)),
    # MPT: ALiBi over 5 heads (MPT's interleaved slopes), no biases, LayerNorm without bias, clip_qkv
    # low enough to bite. (transformers' MPT MLP is 4 x d_model whatever expansion_ratio says: keep 4.)
    "mpt": lambda: transformers.MptForCausalLM(transformers.MptConfig(
        vocab_size=VOCAB, d_model=80, n_heads=5, n_layers=2, expansion_ratio=4, max_seq_len=POSITIONS,
        attn_config={"clip_qkv": 0.3, "alibi_bias_max": 8})),
}


def tiny_decoder(family: str, seed: int = 0) -> torch.nn.Module:
    """The family's transformers model, float32, eager attention, every weight random."""
    torch.manual_seed(seed)
    model = DECODER_FAMILIES[family]()
    model.config._attn_implementation = "eager"
    model.config.eos_token_id = model.config.bos_token_id = model.config.pad_token_id = None
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    with torch.no_grad():
        for name, p in model.named_parameters():
            is_norm_weight = ("norm" in name or "ln_" in name) and name.endswith("weight")
            p.copy_((1.0 if is_norm_weight else 0.0) + 0.1 * torch.randn_like(p))
    return model.eval()


# ---- remote-code checkpoints, written from transformers models of the same math ------------------

def _random_weights(model: torch.nn.Module, seed: int) -> torch.nn.Module:
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_((1.0 if "norm" in name and name.endswith("weight") else 0.0) + 0.1 * torch.randn_like(p))
    model.config._attn_implementation = "eager"
    model.generation_config.eos_token_id = model.generation_config.bos_token_id = None
    model.generation_config.pad_token_id = None
    return model.eval()


def _write(path, config: dict, tensors: dict) -> None:
    import json
    import os

    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    save_file({name: t.contiguous() for name, t in tensors.items()}, os.path.join(path, "model.safetensors"))


BAICHUAN2_VOCAB = 125696  # Baichuan 2's vocabulary: what tells its NormHead checkpoints apart


def write_baichuan2_checkpoint(path, seed: int = 0) -> torch.nn.Module:
    """A Baichuan 2 7B-form checkpoint (remote code: model_type "baichuan", q/k/v fused as W_pack,
    a NormHead lm_head stored unnormalised, rows of different norms); returns transformers' Llama
    with the same weights and the lm_head rows normalised, which is the model the checkpoint means."""
    return _write_baichuan2(path, seed, alibi=False)


def write_baichuan2_13b_checkpoint(path, seed: int = 0) -> torch.nn.Module:
    """The 13B form: ALiBi over 5 heads instead of rope (its config names no max_position_embeddings).
    Returns transformers' Llama of the same weights; run it through ``alibi_llama_logits``."""
    return _write_baichuan2(path, seed, alibi=True)


def alibi_llama_logits(model: torch.nn.Module, token_ids: list[int], last_only: bool = False) -> torch.Tensor:
    """transformers' Llama as Baichuan 2 13B: every position id 0 (rope at angle 0 is the identity)
    and a 4-D additive mask of BLOOM's ALiBi slopes times (k - q), -inf above the diagonal.
    ``last_only``: the last position's logits only (the (T, 125696) lm_head is most of a call)."""
    from kernels.alibi import bloom_alibi_slopes

    n, heads = len(token_ids), model.config.num_attention_heads
    pos = torch.arange(n)
    bias = bloom_alibi_slopes(heads)[:, None, None] * (pos[None, :] - pos[:, None]).float()
    bias = bias.masked_fill(pos[None, :] > pos[:, None], float("-inf"))[None]
    with torch.no_grad():
        return model(torch.tensor([token_ids]), attention_mask=bias, position_ids=torch.zeros(1, n, dtype=torch.long),
                     logits_to_keep=1 if last_only else 0).logits[0].float()


def _write_baichuan2(path, seed: int, alibi: bool) -> torch.nn.Module:
    heads, hidden = (5, 40) if alibi else (4, 32)
    config = transformers.LlamaConfig(vocab_size=BAICHUAN2_VOCAB, hidden_size=hidden, intermediate_size=48,
                                      num_hidden_layers=2, num_attention_heads=heads, max_position_embeddings=POSITIONS,
                                      rms_norm_eps=1e-6, tie_word_embeddings=False)
    reference = _random_weights(transformers.LlamaForCausalLM(config), seed)
    state = {name: t.clone() for name, t in reference.state_dict().items()}
    for i in range(2):
        layer = f"model.layers.{i}.self_attn."
        state[layer + "W_pack.weight"] = torch.cat([state.pop(layer + f"{p}_proj.weight") for p in "qkv"])
    row_norms = torch.linspace(0.5, 3.0, BAICHUAN2_VOCAB)[:, None]
    state["lm_head.weight"] = torch.nn.functional.normalize(state["lm_head.weight"], dim=1) * row_norms
    with torch.no_grad():
        reference.lm_head.weight.copy_(torch.nn.functional.normalize(state["lm_head.weight"], dim=1))
    positions = {} if alibi else {"max_position_embeddings": POSITIONS}
    _write(path, {"architectures": ["BaichuanForCausalLM"], "model_type": "baichuan",
                  "auto_map": {"AutoConfig": "configuration_baichuan.BaichuanConfig",
                               "AutoModelForCausalLM": "modeling_baichuan.BaichuanForCausalLM"},
                  "vocab_size": BAICHUAN2_VOCAB, "hidden_size": hidden, "intermediate_size": 48,
                  "num_hidden_layers": 2, "num_attention_heads": heads, **positions, "model_max_length": POSITIONS,
                  "rms_norm_eps": 1e-6, "hidden_act": "silu", "tie_word_embeddings": False}, state)
    return reference


def write_qwen1_checkpoint(path, seed: int = 0) -> torch.nn.Module:
    """A Qwen (v1) checkpoint (remote code: model_type "qwen", biased c_attn [q | k | v], an MLP of
    w2 (gate) and w1 (up) with intermediate_size twice their width); returns transformers' Qwen2
    (q/k/v biases, MHA) with the same weights."""
    config = transformers.Qwen2Config(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=2,
                                      num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=POSITIONS,
                                      rms_norm_eps=1e-6, rope_theta=10000.0, tie_word_embeddings=False)
    reference = _random_weights(transformers.Qwen2ForCausalLM(config), seed)
    src = reference.state_dict()
    state = {"transformer.wte.weight": src["model.embed_tokens.weight"], "transformer.ln_f.weight": src["model.norm.weight"],
             "lm_head.weight": src["lm_head.weight"]}
    for i in range(2):
        hf, out = f"model.layers.{i}.", f"transformer.h.{i}."
        for kind in ("weight", "bias"):
            state[out + f"attn.c_attn.{kind}"] = torch.cat([src[hf + f"self_attn.{p}_proj.{kind}"] for p in "qkv"])
        state[out + "attn.c_proj.weight"] = src[hf + "self_attn.o_proj.weight"]
        state[out + "ln_1.weight"] = src[hf + "input_layernorm.weight"]
        state[out + "ln_2.weight"] = src[hf + "post_attention_layernorm.weight"]
        state[out + "mlp.w2.weight"] = src[hf + "mlp.gate_proj.weight"]
        state[out + "mlp.w1.weight"] = src[hf + "mlp.up_proj.weight"]
        state[out + "mlp.c_proj.weight"] = src[hf + "mlp.down_proj.weight"]
    _write(path, {"architectures": ["QWenLMHeadModel"], "model_type": "qwen",
                  "auto_map": {"AutoConfig": "configuration_qwen.QWenConfig",
                               "AutoModelForCausalLM": "modeling_qwen.QWenLMHeadModel"},
                  "vocab_size": VOCAB, "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
                  "num_attention_heads": 4, "kv_channels": 16, "max_position_embeddings": POSITIONS,
                  "seq_length": POSITIONS, "layer_norm_epsilon": 1e-6, "rotary_emb_base": 10000, "rotary_pct": 1.0,
                  "use_logn_attn": True, "use_dynamic_ntk": True, "no_bias": True, "tie_word_embeddings": False},
           state)
    return reference
