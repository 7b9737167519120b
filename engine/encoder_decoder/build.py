"""Build a T5 / BART checkpoint into two engine directories, the anchor's layout:

    OUTPUT/encoder/  config.json, rank{r}.safetensors (embeddings, encoder layers)
    OUTPUT/decoder/  config.json, rank{r}.safetensors (embeddings, decoder layers with cross-attention,
                     lm_head), and the tokenizer files

one weights file per tensor-parallel rank r < tp_size (``--tp_size``; both config.json files record it
as the decoder-only format does): rank r's shard of each tensor is the slice its module of
model.py (built with ``TensorParallel(tp_size, r)``) holds: its heads' rows of q, k, v and columns of o,
its part of the MLP width, its heads' columns of T5's position table, its slice of the vocabulary of the
LM head (zero-padded); the rest whole (``shard``). tp_size must divide every stack's heads and FFN
width (a ConfigError naming the field otherwise).

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
from engine.encoder_decoder.model import QUANTIZATIONS, Decoder, Encoder, TensorParallel
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


TP_FIELDS = ("encoder_heads", "decoder_heads", "encoder_ffn", "decoder_ffn")  # what tp_size must divide


def check_tp_divides(spec: EncDecSpec, tp_size: int) -> None:
    """ConfigError naming the first field of ``spec`` that ``tp_size`` does not divide."""
    for name in TP_FIELDS:
        value = getattr(spec, name)
        if value % tp_size:
            raise ConfigError(f"tp_size {tp_size} does not divide {name} ({value}) of {spec.architecture}; allowed "
                              f"tp_size values divide " + ", ".join(f"{n} ({getattr(spec, n)})" for n in TP_FIELDS))


def shard(tensor: torch.Tensor, shape: torch.Size, rank: int) -> torch.Tensor:
    """Rank ``rank``'s ``shape`` slice of a whole tensor: along the one dimension where they differ (the
    rank's consecutive block of it, zero-padded past the end: the LM head's vocabulary), else all of it."""
    if tuple(tensor.shape) == tuple(shape):
        return tensor
    [dim] = [d for d, (whole, part) in enumerate(zip(tensor.shape, shape)) if whole != part]
    start, size = rank * shape[dim], shape[dim]
    part = tensor.narrow(dim, start, max(0, min(size, tensor.shape[dim] - start)))
    if part.shape[dim] < size:
        pad = list(tensor.shape)
        pad[dim] = size - part.shape[dim]
        part = torch.cat([part, tensor.new_zeros(pad)], dim=dim)
    return part.contiguous()


def build_encoder_decoder(hf_config, get, tokenizer, output_dir: str, build: BuildConfig, *, source: str = "",
                          max_encoder_input_len: int | None = None) -> EngineConfig:
    """Write OUTPUT/encoder and OUTPUT/decoder; returns the decoder's EngineConfig."""
    spec = whisper_generation_fields(spec_from_hf(hf_config), source)
    if build.pp_size != 1:
        raise ConfigError(f"pp_size {build.pp_size}: {spec.architecture} (encoder-decoder) engines split by tensor "
                          "parallelism only; use pp_size 1 (and --tp_size for several GPUs)")
    check_tp_divides(spec, build.tp_size)
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
        for name in os.listdir(path):  # no stale rank of another tp_size survives (nor the old config)
            if name == "config.json" or (name.startswith("rank") and name.endswith(".safetensors")):
                os.remove(os.path.join(path, name))
        if build.quantization == "fp8":
            names_fp8 = cls(spec, device="meta", quantization=build.quantization).state_dict()
            weights = quantize_linears(convert_stack(get, names, torch.float32), names_fp8, dtype)
        else:
            weights = convert_stack(get, names, dtype)
        for rank in range(build.tp_size):
            module = cls(spec, device="meta", quantization=build.quantization, tp=TensorParallel(build.tp_size, rank))
            check_complete(module, weights, f"{spec.architecture} {directory}")
            shapes = {name: tensor.shape for name, tensor in module.state_dict().items()}
            save_file({name: shard(tensor, shapes[name], rank) for name, tensor in weights.items()},
                      os.path.join(path, f"rank{rank}.safetensors"), metadata={"format": "pt"})
        config = EngineConfig(model=model, build=dataclasses.replace(build), extra={**extra, **more}).validate()
        if tokenizer is not None and directory == DECODER_DIR:
            tokenizer.save_pretrained(path)
        for name in (FEATURE_EXTRACTOR, GENERATION_CONFIG) if spec.num_mel_bins else ():
            found = os.path.join(source, name) if source and os.path.isdir(source) else ""
            if directory == DECODER_DIR and os.path.isfile(found):  # Whisper: log-mels, prompt and timestamp tokens
                shutil.copy(found, path)
        config.save(path)  # last: a directory with config.json is complete
    return config
