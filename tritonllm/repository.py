"""Filled model repositories of each kind, from the templates in all_models/ (``tritonllm serve``
and tools/assemble_repository.py assemble them here).

all_models/ holds the five text models at its top (a plain copy of them is the text repository) and,
in folders of their own that are not models, the other repositories' parts:
- text: ensemble, preprocessing, tensorrt_llm, postprocessing, tensorrt_llm_bls;
- multimodal: the text models with multimodal/ensemble in place of the text ensemble, plus
  multimodal/multimodal_encoders (a vision-language engine from engine.build, whose
  vision_encoder/ the preprocessing and multimodal_encoders models read);
- llmapi: llmapi/tensorrt_llm (TensorRT-LLM's LLM-API model; its model.yaml is edited, not filled);
- disaggregated: the text models with two copies of tensorrt_llm, context/ and generation/ (one engine
  process each), and disaggregated_serving_bls between them, which the ensemble and tensorrt_llm_bls
  call in tensorrt_llm's place (the anchor's disaggregated setup; docs/features/disaggregated-serving.md);
- whisper: tensorrt_llm (the Whisper engine's decoder/, its encoder/ as encoder_engine_dir) and
  whisper/whisper_bls (WAV in, TRANSCRIPTS out), both non-decoupled (whisper_bls calls tensorrt_llm
  unary; the OpenAI frontend's /v1/audio calls whisper_bls unary).
A T5/BART engine (encoder/ + decoder/) is served by the text repository of its decoder/ with
encoder_decoder_substitutions' tensorrt_llm values.
Every config.pbtxt is filled with the text repository's values (``base``: tritonllm/serve.py
default_substitutions), plus each kind's own, then the caller's overrides.
"""
from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from tritonllm.fill_template import fill_template
from tritonllm.paths import FIVE_MODELS, model_templates_dir

# kind -> (model name in the repository, its template folder under all_models/)
LAYOUTS = {
    "text": [(name, name) for name in FIVE_MODELS],
    "multimodal": [(name, name) for name in FIVE_MODELS if name != "ensemble"]
                  + [("ensemble", "multimodal/ensemble"), ("multimodal_encoders", "multimodal/multimodal_encoders")],
    "llmapi": [("tensorrt_llm", "llmapi/tensorrt_llm")],
    "whisper": [("tensorrt_llm", "tensorrt_llm"), ("whisper_bls", "whisper/whisper_bls")],
    "disaggregated": [(name, name) for name in FIVE_MODELS if name != "tensorrt_llm"]
                     + [("context", "tensorrt_llm"), ("generation", "tensorrt_llm"),
                        ("disaggregated_serving_bls", "disaggregated_serving_bls")],
}
# Models filled with another model's values (then their own): the disaggregated phases are tensorrt_llm's.
FILLED_AS = {"context": "tensorrt_llm", "generation": "tensorrt_llm"}
DISAGGREGATED_BLS = "disaggregated_serving_bls"
POSTPROCESSING_STOPS_GENERATION = """
parameters: {
  key: "tensorrt_llm_model_name"
  value: {
    string_value: "generation"
  }
}
"""
VISION_ENCODER_DIR = "vision_encoder"  # engine/vision/encoder_dir.py: where engine.build writes it
# The models tritonserver's non-zero ranks load, as the reference's launch names them
# (--tensorrt_llm_model_name); the first holds the engine.
ENGINE_MODELS = {"multimodal": "tensorrt_llm,multimodal_encoders", "disaggregated": "context,generation"}


def has_vision_encoder(engine_dir: str) -> bool:
    """Whether engine.build wrote a vision encoder beside the language engine (a vision-language checkpoint)."""
    return os.path.isfile(os.path.join(engine_dir, VISION_ENCODER_DIR, "config.json"))


# engine/encoder_decoder/build.py's layout of an encoder-decoder engine: ENGINE/encoder, ENGINE/decoder
ENCODER_DIR, DECODER_DIR = "encoder", "decoder"
WHISPER_AUDIO_MODEL = "whisper_bls"  # the OpenAI frontend's --audio_model of a whisper repository
WHISPER_MAX_TOKENS = 96  # whisper_bls's request_output_len (a 30-s window's transcript fits)
WHISPER_MAX_AUDIO_SECONDS = "1800"  # longer audio is refused by name (windows are decoded one after another)


def _decoder_config(engine_dir: str) -> dict:
    try:
        return json.loads((Path(engine_dir) / DECODER_DIR / "config.json").read_text())
    except (OSError, ValueError):
        return {}


def encoder_decoder_spec(engine_dir: str) -> dict | None:
    """The family options (engine/encoder_decoder/spec.py, extra.encoder_decoder) of an encoder-decoder
    engine that engine.build wrote to engine_dir/{encoder,decoder}; None for any other engine."""
    config = _decoder_config(engine_dir)
    spec = (config.get("extra") or {}).get("encoder_decoder")
    return spec if isinstance(spec, dict) else None


def encoder_decoder_substitutions(engine_dir: str) -> dict[str, dict[str, str]]:
    """tensorrt_llm's values for an encoder-decoder engine (tensorrtllm_backend's fill keys): the encoder
    beside the decoder, half the KV memory for cross-attention K/V, outputs without the decoder prompt.
    LoRA and guided decoding are not built for these engines."""
    return {"tensorrt_llm": {"encoder_engine_dir": os.path.join(os.path.abspath(engine_dir), ENCODER_DIR),
                             "cross_kv_cache_fraction": "0.5", "exclude_input_in_output": "True",
                             "enable_lora": "false", "guided_decoding_backend": ""}}


def kind_substitutions(kind: str, engine_dir: str, max_batch_size: int) -> dict[str, dict[str, str]]:
    """Per-model values of ``kind`` besides the text repository's (``engine_dir``: for whisper, the
    engine.build output holding encoder/ and decoder/)."""
    if kind == "whisper":
        decoder = os.path.join(engine_dir, DECODER_DIR)
        mels = str((encoder_decoder_spec(engine_dir) or {}).get("num_mel_bins", 80))
        # prompt + max_tokens must fit the decoder's max_seq_len (448 for real Whisper): half of it
        # leaves room for a long TEXT_PREFIX
        max_seq_len = int((_decoder_config(engine_dir).get("build") or {}).get("max_seq_len") or 2 * WHISPER_MAX_TOKENS)
        max_tokens = str(min(WHISPER_MAX_TOKENS, max_seq_len // 2))
        return {"tensorrt_llm": {**encoder_decoder_substitutions(engine_dir)["tensorrt_llm"], "decoupled_mode": "false",
                                 "engine_dir": decoder, "tokenizer_dir": decoder},
                "whisper_bls": {"decoupled_mode": "false", "n_mels": mels, "zero_pad": "false", "engine_dir": decoder,
                                "tensorrt_llm_model_name": "tensorrt_llm", "max_tokens": max_tokens,
                                "max_audio_seconds": WHISPER_MAX_AUDIO_SECONDS, "tensorrt_llm_streaming": "false"}}
    if kind == "disaggregated":
        # Both phases fit one GPU at half the usual KV share each; on two GPUs give each its own
        # (--set context:gpu_device_ids=0 --set generation:gpu_device_ids=1, and 0.9 each).
        phase = {"kv_cache_free_gpu_mem_fraction": "0.45"}
        return {"context": phase, "generation": phase,
                DISAGGREGATED_BLS: {"triton_max_batch_size": str(max_batch_size), "context_model_name": "context",
                                    "generation_model_name": "generation", "disaggregated_serving_bls_count": "2"},
                "tensorrt_llm_bls": {"tensorrt_llm_model_name": DISAGGREGATED_BLS}}
    if kind != "multimodal":
        return {}
    encoder_dir = os.path.join(engine_dir, VISION_ENCODER_DIR)
    return {
        "preprocessing": {"multimodal_model_path": encoder_dir, "max_num_images": "1"},
        # The prompt holds image placeholders (ids past the vocabulary): outputs carry only new tokens.
        "tensorrt_llm": {"exclude_input_in_output": "True"},
        "tensorrt_llm_bls": {"multimodal_encoders_name": "multimodal_encoders"},
        "multimodal_encoders": {"triton_max_batch_size": str(max_batch_size), "multimodal_model_path": encoder_dir,
                                "hf_model_path": engine_dir, "encoder_input_features_data_type": "TYPE_FP16",
                                "max_queue_delay_microseconds": "0"},
    }


def assemble_repository(kind: str, engine_dir: str, output: str, base: dict[str, dict[str, str]], *,
                        max_batch_size: int = 8, overrides: dict[str, dict[str, str]] | None = None) -> str:
    """Copy ``kind``'s templates to ``output`` (replacing it) and fill them with ``base`` (the text
    repository's values), ``kind``'s and ``overrides``; returns ``output``. ValueError for an unknown
    kind or a multimodal repository of an engine without a vision encoder."""
    if kind not in LAYOUTS:
        raise ValueError(f"--kind {kind!r} is not a repository kind; allowed: {', '.join(LAYOUTS)}")
    engine_dir = os.path.abspath(engine_dir)
    if kind == "whisper" and not (encoder_decoder_spec(engine_dir) or {}).get("num_mel_bins"):
        raise ValueError(f"{engine_dir} is not a Whisper engine ({DECODER_DIR}/config.json with num_mel_bins): build "
                         "a WhisperForConditionalGeneration checkpoint with python -m engine.build")
    if kind == "disaggregated" and (has_vision_encoder(engine_dir) or encoder_decoder_spec(engine_dir)):
        raise ValueError(f"{engine_dir}: disaggregated serving takes decoder-only text engines (the executor "
                         "refuses context_only requests with prompt tables or an encoder); serve it aggregated")
    if kind == "multimodal" and not has_vision_encoder(engine_dir):
        raise ValueError(f"{engine_dir} has no {VISION_ENCODER_DIR}/: build a vision-language checkpoint "
                         "(LlavaForConditionalGeneration) with python -m engine.build")
    values = {model: dict(pairs) for model, pairs in base.items()}
    for name, source in FILLED_AS.items():
        values[name] = {**values.get(source, {}), **values.get(name, {})}
    if DISAGGREGATED_BLS in dict(LAYOUTS[kind]):  # it shares tensorrt_llm's decoupled mode and logits type
        values.setdefault(DISAGGREGATED_BLS, {}).update(
            {key: values.get("tensorrt_llm", {}).get(key, default) for key, default in
             (("decoupled_mode", "true"), ("logits_datatype", "TYPE_FP32"),
              ("encoder_input_features_data_type", "TYPE_FP16"))})
    for source in (kind_substitutions(kind, engine_dir, max_batch_size), overrides or {}):
        for model, pairs in source.items():
            values.setdefault(model, {}).update(pairs)
    repo, templates = Path(output), model_templates_dir()
    if repo.exists():
        shutil.rmtree(repo)
    for name, folder in LAYOUTS[kind]:
        shutil.copytree(templates / folder, repo / name, ignore=shutil.ignore_patterns("__pycache__"))
        config = repo / name / "config.pbtxt"
        text = config.read_text()
        # fill_template refuses keys a file lacks: the shared defaults name every model's keys
        pairs = {k: v for k, v in values.get(name, {}).items() if "${" + k + "}" in text}
        text = fill_template(text, ",".join(f"{k}:{escape(v)}" for k, v in pairs.items()), str(config))
        if name in FILLED_AS:  # a copy answers to its own folder's name
            text = text.replace(f'name: "{FILLED_AS[name]}"', f'name: "{name}"', 1)
        if name in ("ensemble", "tensorrt_llm_bls") and kind == "disaggregated":
            text = text.replace('model_name: "tensorrt_llm"', f'model_name: "{DISAGGREGATED_BLS}"')
        if name == "postprocessing" and kind == "disaggregated":  # a gone ensemble client's stop goes to the
            text += POSTPROCESSING_STOPS_GENERATION                  # phase whose request_key it holds
        config.write_text(text)
    return str(repo)


def escape(value: str) -> str:
    """fill_template escaping: `\\,` for a comma; `\\\\:` for a colon (two split levels)."""
    return value.replace("\\", "\\\\\\\\").replace(",", "\\,").replace(":", "\\\\:")
