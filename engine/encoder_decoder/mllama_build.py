"""Build a Llama 3.2 Vision (MllamaForConditionalGeneration) checkpoint:

    OUTPUT/                 config.json, rank0.safetensors (the text model: engine/encoder_decoder/mllama_model.py),
                            the tokenizer (and the checkpoint's processor_config.json / chat template)
    OUTPUT/vision_encoder/  the tiled ViT + projector (engine/vision/mllama.py), builder_config.model_type
                            "mllama", the checkpoint's image processor

config.json's ModelConfig is the self-attention stack as a Llama one (num_layers = the layers without
cross-attention: the paged KV pool's; vocab_size = the embedding's rows, text vocabulary + 8, so the
<|image|> id is a valid prompt id), architecture MllamaForConditionalGeneration; ``extra.mllama`` holds
the full layer count, the cross-attention layers, the text vocabulary, the image token and the vision
token counts, ``extra.max_encoder_input_len`` the most vision tokens a request may bring (default: one
image, max_num_tiles x patches; --max_encoder_input_len N for more images). One GPU, no quantization:
other settings are refused by name.
"""
from __future__ import annotations

import dataclasses
import os
import shutil
import time

import torch
from safetensors.torch import save_file

from engine.config import BuildConfig, ConfigError, EngineConfig, resolve_build_limits
from engine.convert import model_config_from_hf
from engine.encoder_decoder.mllama_model import EXTRA_EMBEDDING_ROWS, MllamaTextModel
from engine.encoder_decoder.mllama_runner import MLLAMA_ARCHITECTURE
from engine.vision.clip import first_found
from engine.vision.encoder_dir import write_vision_encoder
from engine.vision.encoder_path import VISION_ENCODER_DIR
from engine.vision.registry import VISION_FAMILIES

TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
# Where checkpoints keep the text model: transformers 4 and the saved files, transformers 5 in memory
TEXT_PREFIXES = ("language_model.model.", "model.language_model.")
HEAD_NAMES = ("language_model.lm_head.weight", "lm_head.weight")
PROCESSOR_FILES = ("processor_config.json", "preprocessor_config.json", "chat_template.jinja", "chat_template.json")


def is_mllama_config(hf_config) -> bool:
    return (getattr(hf_config, "architectures", None) or [""])[0] == MLLAMA_ARCHITECTURE


def text_model_config(hf_config):
    """(ModelConfig of the self-attention stack, extra.mllama) of a MllamaConfig."""
    import transformers

    text = hf_config.text_config
    cross = sorted(int(i) for i in text.cross_attention_layers)
    if any(not 0 <= i < text.num_hidden_layers for i in cross) or len(set(cross)) != len(cross):
        raise ConfigError(f"cross_attention_layers {cross} must be distinct indexes of the {text.num_hidden_layers} "
                          "text layers")
    llama = transformers.LlamaConfig(
        vocab_size=text.vocab_size + EXTRA_EMBEDDING_ROWS, hidden_size=text.hidden_size,
        intermediate_size=text.intermediate_size, num_hidden_layers=text.num_hidden_layers - len(cross),
        num_attention_heads=text.num_attention_heads, num_key_value_heads=text.num_key_value_heads,
        head_dim=text.hidden_size // text.num_attention_heads, rms_norm_eps=text.rms_norm_eps,
        max_position_embeddings=text.max_position_embeddings, rope_parameters=dict(text.rope_parameters),
        hidden_act=text.hidden_act, tie_word_embeddings=False, architectures=["LlamaForCausalLM"])
    model = dataclasses.replace(model_config_from_hf(llama), architecture=MLLAMA_ARCHITECTURE).validate()
    vision = hf_config.vision_config
    patches = (vision.image_size // vision.patch_size) ** 2 + 1
    mllama = {"num_layers_total": text.num_hidden_layers, "cross_attention_layers": cross,
              "text_vocab_size": text.vocab_size, "image_token_id": int(hf_config.image_token_index),
              "patches_per_tile": patches, "max_num_tiles": vision.max_num_tiles}
    return model, mllama


def text_weights(get, model: MllamaTextModel, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """The text model's engine tensors (names of mllama_model.py) from the checkpoint's."""
    def hf(name: str) -> torch.Tensor:
        return first_found(get, [prefix + name for prefix in TEXT_PREFIXES])

    weights = {"embed_tokens.weight": hf("embed_tokens.weight"), "norm.weight": hf("norm.weight"),
               "lm_head.weight": first_found(get, list(HEAD_NAMES))}
    cross = set(model.cross_layer_indexes)
    for i in range(len(model.layers)):
        layer, ours = f"layers.{i}.", f"layers.{i}."
        weights[ours + "input_norm.weight"] = hf(layer + "input_layernorm.weight")
        weights[ours + "post_attn_norm.weight"] = hf(layer + "post_attention_layernorm.weight")
        weights[ours + "gate_up_proj.weight"] = torch.cat([hf(layer + f"mlp.{p}_proj.weight") for p in ("gate", "up")])
        weights[ours + "down_proj.weight"] = hf(layer + "mlp.down_proj.weight")
        if i in cross:
            attn = layer + "cross_attn."
            weights[ours + "q_proj.weight"] = hf(attn + "q_proj.weight")
            weights[ours + "kv_proj.weight"] = torch.cat([hf(attn + "k_proj.weight"), hf(attn + "v_proj.weight")])
            weights[ours + "o_proj.weight"] = hf(attn + "o_proj.weight")
            weights[ours + "q_norm.weight"] = hf(attn + "q_norm.weight")
            weights[ours + "k_norm.weight"] = hf(attn + "k_norm.weight")
            weights[ours + "attn_gate"] = hf(layer + "cross_attn_attn_gate").reshape(1)
            weights[ours + "mlp_gate"] = hf(layer + "cross_attn_mlp_gate").reshape(1)
        else:
            weights[ours + "qkv_proj.weight"] = torch.cat([hf(layer + f"self_attn.{p}_proj.weight") for p in "qkv"])
            weights[ours + "o_proj.weight"] = hf(layer + "self_attn.o_proj.weight")
    return {name: tensor.to(dtype).contiguous().clone() for name, tensor in weights.items()}


def build_mllama(hf_config, get, tokenizer, output_dir: str, build: BuildConfig, *, source: str = "",
                 max_encoder_input_len: int | None = None) -> EngineConfig:
    """Write OUTPUT (the text model) and OUTPUT/vision_encoder; returns the text model's EngineConfig."""
    for name, value in (("tp_size", build.tp_size), ("pp_size", build.pp_size)):
        if value != 1:
            raise ConfigError(f"{name} {value}: {MLLAMA_ARCHITECTURE} (Llama 3.2 Vision) builds for one GPU only; "
                              f"use {name} 1")
    if build.quantization is not None or build.kv_cache_dtype is not None:
        raise ConfigError(f"--quantization / --kv_cache_dtype: not supported for {MLLAMA_ARCHITECTURE} (Llama 3.2 "
                          "Vision) engines yet; leave them out")
    model, mllama = text_model_config(hf_config)
    one_image = mllama["max_num_tiles"] * mllama["patches_per_tile"]
    longest = max_encoder_input_len or one_image
    if longest < one_image:
        raise ConfigError(f"max_encoder_input_len {longest}: a Llama 3.2 Vision image brings {one_image} vision "
                          f"tokens (max_num_tiles x patches); use a multiple of it (one per image a request may hold)")
    build = resolve_build_limits(build, model)
    extra = {"source": os.path.abspath(source) if source else "",
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "mllama": mllama,
             "max_encoder_input_len": longest, "vision_encoder": VISION_ENCODER_DIR}
    config = EngineConfig(model=model, build=build, extra=extra).validate()
    skeleton = MllamaTextModel(model, num_layers_total=mllama["num_layers_total"],
                               cross_layers=mllama["cross_attention_layers"], text_vocab_size=mllama["text_vocab_size"],
                               device="meta")
    weights = text_weights(get, skeleton, TORCH_DTYPES[build.dtype])
    expected = set(skeleton.state_dict())
    if set(weights) != expected:  # a converter bug
        raise AssertionError(f"Mllama converter produced {sorted(set(weights) ^ expected)[:5]} mismatching the model")
    os.makedirs(output_dir, exist_ok=True)
    if os.path.isfile(os.path.join(output_dir, "config.json")):
        os.remove(os.path.join(output_dir, "config.json"))
    save_file(weights, os.path.join(output_dir, "rank0.safetensors"), metadata={"format": "pt"})
    if tokenizer is not None:
        tokenizer.save_pretrained(output_dir)
    for name in PROCESSOR_FILES:  # the processor (its chat template too) for preprocessing and the OpenAI path
        found = os.path.join(source, name) if source and os.path.isdir(source) else ""
        if os.path.isfile(found):
            shutil.copy(found, output_dir)
    family = VISION_FAMILIES[MLLAMA_ARCHITECTURE]
    write_vision_encoder(family, hf_config, get, os.path.join(output_dir, VISION_ENCODER_DIR), build.dtype, source)
    config.save(output_dir)  # last: a directory with config.json is complete
    return config
