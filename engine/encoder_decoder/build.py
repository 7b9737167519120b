"""Build a T5 / BART checkpoint into two engine directories, the anchor's layout:

    OUTPUT/encoder/  config.json, rank0.safetensors (embeddings, encoder layers)
    OUTPUT/decoder/  config.json, rank0.safetensors (embeddings, decoder layers with cross-attention,
                     lm_head), and the tokenizer files

The Triton fill points ``engine_dir`` at OUTPUT/decoder and ``encoder_engine_dir`` at
OUTPUT/encoder; the decoder's config.json names its encoder as ``../encoder`` so an executor
given only the decoder finds it. Both config.json files are EngineConfigs whose ModelConfig
describes the decoder stack (the paged KV shape), with the family's options in
``extra.encoder_decoder`` (engine/encoder_decoder/spec.py), ``extra.stack`` ("encoder" or
"decoder") and ``extra.max_encoder_input_len`` (encoder outputs: tokens, or Whisper's frames / 2). A Whisper
checkpoint's feature extractor (preprocessor_config.json) and generation config (is_multilingual,
<|notimestamps|>) are copied into OUTPUT/decoder.

``--quantization fp8``: every linear weight of both stacks' layers (self- and cross-attention q, k,
v, o; the MLP's) is stored as E4M3 with a per-output-channel float32 ``<name>_scale`` (kernels/fp8.py
quantize_weight: max|row| / 448), the names model.py's Fp8Linear declares; the embeddings, the LM
head, Whisper's convolutions and the norms stay in --dtype. The other schemes (fp8_block, int8_sq,
the weight-only integer ones) are refused by name.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time

import torch
from safetensors.torch import save_file

from engine.config import BuildConfig, ConfigError, EngineConfig, resolve_build_limits
from engine.encoder_decoder.convert import check_complete, checkpoint_names, convert_stack
from engine.encoder_decoder.model import QUANTIZATIONS, Decoder, Encoder
from engine.encoder_decoder.spec import EncDecSpec, spec_from_hf
from kernels.fp8 import quantize_weight

ENCODER_DIR, DECODER_DIR = "encoder", "decoder"
FEATURE_EXTRACTOR = "preprocessor_config.json"
GENERATION_CONFIG = "generation_config.json"  # Whisper: <|notimestamps|>, is_multilingual (whisper_bls reads it)
TORCH_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def whisper_generation_fields(spec: EncDecSpec, source: str) -> EncDecSpec:
    """A Whisper spec with its generation config's <|notimestamps|> id and first-timestamp limit
    (the timestamp rules, engine/encoder_decoder/whisper_timestamps.py), its suppressed tokens
    (always, and as the first token) and its alignment heads; other specs unchanged."""
    path = os.path.join(source, GENERATION_CONFIG) if source and os.path.isdir(source) else ""
    if not spec.num_mel_bins or not os.path.isfile(path):
        return spec
    with open(path) as f:
        generation = json.load(f)
    initial = generation.get("max_initial_timestamp_index")
    return dataclasses.replace(spec, no_timestamps_token_id=int(generation.get("no_timestamps_token_id", -1)),
                               max_initial_timestamp_index=-1 if initial is None else int(initial),
                               suppress_tokens=tuple(generation.get("suppress_tokens") or ()),
                               begin_suppress_tokens=tuple(generation.get("begin_suppress_tokens") or ()),
                               alignment_heads=tuple(tuple(int(i) for i in pair)
                                                     for pair in generation.get("alignment_heads") or ()))


def quantize_linears(weights: dict[str, torch.Tensor], names, dtype: torch.dtype) -> dict[str, torch.Tensor]:
    """FP8: each weight for which ``names`` (the stack's state-dict names) declares a ``<name>_scale``
    becomes E4M3 with that per-output-channel scale (kernels/fp8.py quantize_weight), quantized from
    ``weights`` as converted (float32: one rounding, not a --dtype one first); the rest cast to ``dtype``."""
    names = set(names)
    out = {}
    for name, tensor in weights.items():
        if name + "_scale" in names:
            out[name], out[name + "_scale"] = quantize_weight(tensor)
        else:
            out[name] = tensor.to(dtype)
    return out


def build_encoder_decoder(hf_config, get, tokenizer, output_dir: str, build: BuildConfig, *, source: str = "",
                          max_encoder_input_len: int | None = None) -> EngineConfig:
    """Write OUTPUT/encoder and OUTPUT/decoder; returns the decoder's EngineConfig."""
    spec = whisper_generation_fields(spec_from_hf(hf_config), source)
    for name, value, allowed in (("tp_size", build.tp_size, 1), ("pp_size", build.pp_size, 1)):
        if value != allowed:
            raise ConfigError(f"{name} {value}: {spec.architecture} (encoder-decoder) builds for one GPU only; "
                              f"use {name} 1")
    if build.quantization not in QUANTIZATIONS:  # (--kv_cache_dtype fp8 is taken too: both KV pools, runner.py)
        raise ConfigError(f"--quantization {build.quantization}: not supported for {spec.architecture} "
                          "(encoder-decoder) engines; allowed: fp8 (E4M3 weights per output channel), or leave it out")
    longest = max_encoder_input_len or spec.encoder_max_positions
    if longest <= 0 or (spec.positions == "learned" and longest > spec.encoder_max_positions):
        raise ConfigError(f"max_encoder_input_len {longest}: allowed 1..{spec.encoder_max_positions} for "
                          f"{spec.architecture} (its encoder's position table)")
    model = spec.decoder_model_config()
    build = resolve_build_limits(build, model)
    dtype = TORCH_DTYPES[build.dtype]
    encoder_names, decoder_names = checkpoint_names(spec)
    extra = {"source": os.path.abspath(source) if source else "",
             "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
             "encoder_decoder": spec.to_dict(), "max_encoder_input_len": longest}
    stacks = ((ENCODER_DIR, Encoder, encoder_names, {"stack": "encoder"}),
              (DECODER_DIR, Decoder, decoder_names, {"stack": "decoder", "encoder_engine_dir": f"../{ENCODER_DIR}"}))
    config = None
    for directory, cls, names, more in stacks:
        path = os.path.join(output_dir, directory)
        os.makedirs(path, exist_ok=True)
        module = cls(spec, device="meta", quantization=build.quantization)
        if build.quantization == "fp8":
            weights = quantize_linears(convert_stack(get, names, torch.float32), module.state_dict(), dtype)
        else:
            weights = convert_stack(get, names, dtype)
        check_complete(module, weights, f"{spec.architecture} {directory}")
        save_file(weights, os.path.join(path, "rank0.safetensors"), metadata={"format": "pt"})
        config = EngineConfig(model=model, build=dataclasses.replace(build), extra={**extra, **more}).validate()
        if tokenizer is not None and directory == DECODER_DIR:
            tokenizer.save_pretrained(path)
        for name in (FEATURE_EXTRACTOR, GENERATION_CONFIG) if spec.num_mel_bins else ():
            found = os.path.join(source, name) if source and os.path.isdir(source) else ""
            if directory == DECODER_DIR and os.path.isfile(found):  # Whisper: log-mels, prompt and timestamp tokens
                shutil.copy(found, path)
        config.save(path)  # last: a directory with config.json is complete
    return config
