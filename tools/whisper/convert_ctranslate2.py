#!/usr/bin/env python3
"""Convert a CTranslate2 Whisper model directory (faster-whisper's format: model.bin, config.json,
tokenizer.json) into a transformers WhisperForConditionalGeneration checkpoint that
`python -m engine.build --checkpoint` and `tritonllm serve` take:

    python3 tools/whisper/convert_ctranslate2.py CT2_DIR OUT_DIR

model.bin (format version 6; CTranslate2's python/ctranslate2/specs/model_spec.py writes it):
u32 version, string spec name, u32 revision, u32 variable count, then per variable a string name,
u8 rank, u32 dims[rank], u8 dtype (0 float32, 1 int8, 2 int16, 3 int32, 4 float16, 5 bfloat16),
u32 byte count and the bytes; then u32 alias count and (alias, target) string pairs. A string is a
u16 length (with its NUL) and the bytes. Whisper's variables: encoder/{conv1,conv2,
position_encodings,layer_N/{self_attention,ffn},layer_norm}, decoder/{embeddings,position_encodings,
layer_N/{self_attention,attention,ffn},layer_norm}; self-attention's q, k, v are fused (linear_0,
k's bias zero: Whisper's k has none), cross-attention's k, v too (attention/linear_1).
config.json gives suppress_ids, suppress_ids_begin, lang_ids and alignment_heads for the
generation config. The feature extractor is Whisper's default for the model's mel bins.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import struct
import sys

import numpy as np

DTYPES = {0: np.float32, 1: np.int8, 2: np.int16, 3: np.int32, 4: np.float16}
BFLOAT16 = 5


def read_model_bin(path: str) -> dict[str, np.ndarray]:
    """Every variable of a CTranslate2 model.bin by name (aliases resolved); bfloat16 as float32."""
    with open(path, "rb") as f:
        data = f.read()
    offset = 0

    def take(fmt: str):
        nonlocal offset
        values = struct.unpack_from("<" + fmt, data, offset)
        offset += struct.calcsize("<" + fmt)
        return values

    def string() -> str:
        nonlocal offset
        (length,) = take("H")
        text = data[offset:offset + length].rstrip(b"\0").decode("utf-8")
        offset += length
        return text

    (version,) = take("I")
    if version != 6:
        raise ValueError(f"{path}: CTranslate2 model format {version}; this converter reads format 6")
    spec = string()
    if spec != "WhisperSpec":
        raise ValueError(f"{path}: a {spec} model, not Whisper")
    take("I")  # the spec's revision
    (count,) = take("I")
    variables = {}
    for _ in range(count):
        name = string()
        (rank,) = take("B")
        dims = take(f"{rank}I") if rank else ()
        dtype, size = take("BI")
        raw = data[offset:offset + size]
        offset += size
        if dtype == BFLOAT16:
            array = (np.frombuffer(raw, np.uint16).astype(np.uint32) << 16).view(np.float32)
        else:
            array = np.frombuffer(raw, DTYPES[dtype])
        variables[name] = array.reshape(dims)
    (aliases,) = take("I")
    for _ in range(aliases):
        alias, target = string(), string()
        variables[alias] = variables[target]
    return variables


def _linear(out: dict, name: str, weight: np.ndarray, bias: np.ndarray | None) -> None:
    out[f"{name}.weight"] = weight
    if bias is not None:
        out[f"{name}.bias"] = bias


def _split(out: dict, names: list[str | None], prefix: str, v: dict) -> None:
    """A fused linear (rows stacked in ``names`` order) into its parts; None: a part without bias."""
    weight, bias = v[f"{prefix}/weight"], v.get(f"{prefix}/bias")
    rows = weight.shape[0] // len(names)
    for i, name in enumerate(names):
        part = slice(i * rows, (i + 1) * rows)
        keeps_bias = bias is not None and not name.endswith("k_proj")  # Whisper's k has no bias
        _linear(out, name, weight[part], bias[part] if keeps_bias else None)


def _norm(out: dict, name: str, prefix: str, v: dict) -> None:
    out[f"{name}.weight"], out[f"{name}.bias"] = v[f"{prefix}/gamma"], v[f"{prefix}/beta"]


def _layers(v: dict, stack: str) -> int:
    return len({key.split("/")[1] for key in v if re.fullmatch(r"layer_\d+", key.split("/")[1])
                and key.startswith(f"{stack}/")})


def state_dict(v: dict) -> dict[str, np.ndarray]:
    """transformers' WhisperForConditionalGeneration names for the CTranslate2 variables ``v``."""
    out: dict[str, np.ndarray] = {}
    for conv in ("conv1", "conv2"):
        _linear(out, f"model.encoder.{conv}", v[f"encoder/{conv}/weight"], v[f"encoder/{conv}/bias"])
    out["model.encoder.embed_positions.weight"] = v["encoder/position_encodings/encodings"]
    out["model.decoder.embed_tokens.weight"] = v["decoder/embeddings/weight"]
    out["model.decoder.embed_positions.weight"] = v["decoder/position_encodings/encodings"]
    for stack in ("encoder", "decoder"):
        _norm(out, f"model.{stack}.layer_norm", f"{stack}/layer_norm", v)
        for i in range(_layers(v, stack)):
            src, dst = f"{stack}/layer_{i}", f"model.{stack}.layers.{i}"
            _norm(out, f"{dst}.self_attn_layer_norm", f"{src}/self_attention/layer_norm", v)
            _split(out, [f"{dst}.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj")],
                   f"{src}/self_attention/linear_0", v)
            _linear(out, f"{dst}.self_attn.out_proj", v[f"{src}/self_attention/linear_1/weight"],
                    v[f"{src}/self_attention/linear_1/bias"])
            if stack == "decoder":
                _norm(out, f"{dst}.encoder_attn_layer_norm", f"{src}/attention/layer_norm", v)
                _linear(out, f"{dst}.encoder_attn.q_proj", v[f"{src}/attention/linear_0/weight"],
                        v[f"{src}/attention/linear_0/bias"])
                _split(out, [f"{dst}.encoder_attn.k_proj", f"{dst}.encoder_attn.v_proj"], f"{src}/attention/linear_1", v)
                _linear(out, f"{dst}.encoder_attn.out_proj", v[f"{src}/attention/linear_2/weight"],
                        v[f"{src}/attention/linear_2/bias"])
            _norm(out, f"{dst}.final_layer_norm", f"{src}/ffn/layer_norm", v)
            _linear(out, f"{dst}.fc1", v[f"{src}/ffn/linear_0/weight"], v[f"{src}/ffn/linear_0/bias"])
            _linear(out, f"{dst}.fc2", v[f"{src}/ffn/linear_1/weight"], v[f"{src}/ffn/linear_1/bias"])
    return out


def convert(ct2_dir: str, out_dir: str, dtype=np.float32) -> None:
    """Write ``out_dir``: config.json, generation_config.json, model.safetensors, the tokenizer and
    preprocessor_config.json of the CTranslate2 Whisper model in ``ct2_dir``."""
    import torch
    from safetensors.torch import save_file
    from transformers import GenerationConfig, PreTrainedTokenizerFast, WhisperConfig, WhisperFeatureExtractor

    v = read_model_bin(os.path.join(ct2_dir, "model.bin"))
    extra = json.load(open(os.path.join(ct2_dir, "config.json")))
    tokenizer = PreTrainedTokenizerFast(tokenizer_file=os.path.join(ct2_dir, "tokenizer.json"),
                                        eos_token="<|endoftext|>", bos_token="<|endoftext|>",
                                        pad_token="<|endoftext|>", unk_token="<|endoftext|>")
    ids = tokenizer.convert_tokens_to_ids
    vocab, d_model = v["decoder/embeddings/weight"].shape
    n_mels = v["encoder/conv1/weight"].shape[1]
    heads = {stack: int(np.asarray(v[f"{stack}/num_heads"]).reshape(-1)[0]) for stack in ("encoder", "decoder")}
    eos, sot = ids("<|endoftext|>"), ids("<|startoftranscript|>")
    config = WhisperConfig(
        vocab_size=vocab, num_mel_bins=n_mels, d_model=d_model, encoder_layers=_layers(v, "encoder"),
        decoder_layers=_layers(v, "decoder"), encoder_attention_heads=heads["encoder"],
        decoder_attention_heads=heads["decoder"], encoder_ffn_dim=v["encoder/layer_0/ffn/linear_0/weight"].shape[0],
        decoder_ffn_dim=v["decoder/layer_0/ffn/linear_0/weight"].shape[0],
        max_source_positions=v["encoder/position_encodings/encodings"].shape[0],
        max_target_positions=v["decoder/position_encodings/encodings"].shape[0], pad_token_id=eos, bos_token_id=eos,
        eos_token_id=eos, decoder_start_token_id=sot, scale_embedding=False, tie_word_embeddings=True,
        architectures=["WhisperForConditionalGeneration"])
    os.makedirs(out_dir, exist_ok=True)
    config.save_pretrained(out_dir)
    weights = {name: torch.from_numpy(np.ascontiguousarray(array, dtype=dtype)) for name, array in state_dict(v).items()}
    save_file(weights, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    multilingual = vocab >= 51865
    languages = {tokenizer.convert_ids_to_tokens(i): i for i in extra.get("lang_ids", [])}
    generation = GenerationConfig(
        decoder_start_token_id=sot, eos_token_id=eos, pad_token_id=eos, bos_token_id=eos,
        no_timestamps_token_id=ids("<|notimestamps|>"), suppress_tokens=extra.get("suppress_ids"),
        begin_suppress_tokens=extra.get("suppress_ids_begin"), max_initial_timestamp_index=50,
        alignment_heads=extra.get("alignment_heads"), is_multilingual=multilingual,
        prev_sot_token_id=ids("<|startofprev|>"), max_length=config.max_target_positions,
        # (an English-only model has no language or task: transformers would detect a language
        # from any lang_to_id it finds, even an empty one)
        **({"lang_to_id": languages, "task_to_id": {"transcribe": ids("<|transcribe|>"),
                                                     "translate": ids("<|translate|>")}} if multilingual else {}))
    generation.save_pretrained(out_dir)
    tokenizer.save_pretrained(out_dir)
    WhisperFeatureExtractor(feature_size=n_mels).save_pretrained(out_dir)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("ct2_dir")
    p.add_argument("out_dir")
    args = p.parse_args(argv)
    convert(args.ct2_dir, args.out_dir)
    print(f"wrote {args.out_dir}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
