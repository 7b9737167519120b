"""HF T5 / BART tensors -> the engine's encoder and decoder weights (names of engine/encoder_decoder/model.py).

Each engine name maps to the checkpoint names that may hold it, first present wins: tied
embeddings are stored once (``shared``), and a saved model may leave out the copies.
"""
from __future__ import annotations

import torch

from engine.encoder_decoder.spec import EncDecSpec
from engine.hf_checkpoint import CheckpointError, TensorGetter, first_present

_ATTN = ("q", "k", "v", "o")


def _t5_names(spec: EncDecSpec) -> tuple[dict, dict]:
    def mlp(engine: str, hf: str) -> dict:
        names = {f"{engine}.up.weight": [f"{hf}.wi_1.weight" if spec.gated_mlp else f"{hf}.wi.weight"],
                 f"{engine}.down.weight": [f"{hf}.wo.weight"]}
        if spec.gated_mlp:
            names[f"{engine}.gate.weight"] = [f"{hf}.wi_0.weight"]
        return names

    embed = ["shared.weight", "encoder.embed_tokens.weight", "decoder.embed_tokens.weight"]
    encoder = {"embed_tokens.weight": embed, "final_norm.weight": ["encoder.final_layer_norm.weight"],
               "position_bias.weight": ["encoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"]}
    for i in range(spec.encoder_layers):
        block = f"encoder.block.{i}.layer"
        encoder.update({f"layers.{i}.attn.{p}.weight": [f"{block}.0.SelfAttention.{p}.weight"] for p in _ATTN})
        encoder[f"layers.{i}.attn_norm.weight"] = [f"{block}.0.layer_norm.weight"]
        encoder[f"layers.{i}.mlp_norm.weight"] = [f"{block}.1.layer_norm.weight"]
        encoder.update(mlp(f"layers.{i}.mlp", f"{block}.1.DenseReluDense"))
    decoder = {"embed_tokens.weight": embed, "final_norm.weight": ["decoder.final_layer_norm.weight"],
               "position_bias.weight": ["decoder.block.0.layer.0.SelfAttention.relative_attention_bias.weight"],
               "lm_head.weight": ["lm_head.weight"] + embed}
    for i in range(spec.decoder_layers):
        block = f"decoder.block.{i}.layer"
        decoder.update({f"layers.{i}.self_attn.{p}.weight": [f"{block}.0.SelfAttention.{p}.weight"] for p in _ATTN})
        decoder.update({f"layers.{i}.cross_attn.{p}.weight": [f"{block}.1.EncDecAttention.{p}.weight"] for p in _ATTN})
        for norm, index in (("self_norm", 0), ("cross_norm", 1), ("mlp_norm", 2)):
            decoder[f"layers.{i}.{norm}.weight"] = [f"{block}.{index}.layer_norm.weight"]
        decoder.update(mlp(f"layers.{i}.mlp", f"{block}.2.DenseReluDense"))
    return encoder, decoder


def _bart_names(spec: EncDecSpec) -> tuple[dict, dict]:
    """BART and mBART; Whisper's are the same but for its encoder's convolutions (no token
    embeddings), no embedding norm, no key bias and its head (proj_out)."""
    projections = {"q": "q_proj", "k": "k_proj", "v": "v_proj", "o": "out_proj"}
    whisper = spec.family == "whisper"

    def linear(engine: str, hf: str) -> dict:
        kinds = ("weight",) if whisper and engine.endswith(".k") else ("weight", "bias")
        return {f"{engine}.{kind}": [f"{hf}.{kind}"] for kind in kinds}

    def stack(side: str) -> dict:
        hf = f"model.{side}"
        names = {"embed_positions.weight": [f"{hf}.embed_positions.weight"]}
        if whisper and side == "encoder":
            names.update({**linear("conv1", f"{hf}.conv1"), **linear("conv2", f"{hf}.conv2")})
        else:
            names["embed_tokens.weight"] = ["model.shared.weight", f"{hf}.embed_tokens.weight"]
        if spec.embedding_norm:
            names.update(linear("embedding_norm", f"{hf}.layernorm_embedding"))
        if spec.final_norm:
            names.update(linear("final_norm", f"{hf}.layer_norm"))
        layers = spec.encoder_layers if side == "encoder" else spec.decoder_layers
        for i in range(layers):
            layer = f"{hf}.layers.{i}"
            attn, norm = ("attn", "attn_norm") if side == "encoder" else ("self_attn", "self_norm")
            for p, q in projections.items():
                names.update(linear(f"layers.{i}.{attn}.{p}", f"{layer}.self_attn.{q}"))
            names.update(linear(f"layers.{i}.{norm}", f"{layer}.self_attn_layer_norm"))
            names.update(linear(f"layers.{i}.mlp.up", f"{layer}.fc1"))
            names.update(linear(f"layers.{i}.mlp.down", f"{layer}.fc2"))
            names.update(linear(f"layers.{i}.mlp_norm", f"{layer}.final_layer_norm"))
            if side == "decoder":
                for p, q in projections.items():
                    names.update(linear(f"layers.{i}.cross_attn.{p}", f"{layer}.encoder_attn.{q}"))
                names.update(linear(f"layers.{i}.cross_norm", f"{layer}.encoder_attn_layer_norm"))
        return names

    decoder = stack("decoder")
    if whisper:
        decoder["lm_head.weight"] = ["proj_out.weight", "model.decoder.embed_tokens.weight"]
    else:
        decoder["lm_head.weight"] = ["lm_head.weight", "model.shared.weight"]
        decoder["final_logits_bias"] = ["final_logits_bias"]
    return stack("encoder"), decoder


def checkpoint_names(spec: EncDecSpec) -> tuple[dict[str, list[str]], dict[str, list[str]]]:
    """(encoder, decoder): engine name -> checkpoint names to try, in order."""
    return _t5_names(spec) if spec.family == "t5" else _bart_names(spec)


def convert_stack(get: TensorGetter, names: dict[str, list[str]], dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """Every engine tensor of one stack, cast to ``dtype``; CheckpointError naming a missing one."""
    out = {}
    for name, candidates in names.items():
        tensor = first_present(get, *candidates)
        if name == "final_logits_bias":
            tensor = tensor.reshape(-1)  # transformers keeps it as (1, vocab)
        out[name] = tensor.to(dtype).clone()  # (tied tensors: a copy each, as safetensors stores them)
    return out


def check_complete(module: torch.nn.Module, weights: dict[str, torch.Tensor], what: str) -> None:
    expected = set(module.state_dict())
    missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
    if missing or unexpected:  # a converter bug, or a checkpoint of an unexpected layout
        raise CheckpointError(f"{what}: missing {missing[:5]}, unexpected {unexpected[:5]}")
