"""Vision-language families, keyed by the checkpoint's HF architecture.

A family says how its checkpoint splits into a language model (built as any text engine) and an
image encoder (``engine/vision/<family>.py``): the text config, where the language tensors live,
the encoder's config and weights, and the encoder module. A new family adds one entry.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from engine.hf_checkpoint import CheckpointError, TensorGetter
from engine.vision import blip2, gemma3, llava, llava_next, mllama, qwen2_5_vl, qwen2_vl, qwen3_vl
from engine.vision.anyres import ONEVISION_MODEL_TYPE


@dataclass(frozen=True)
class VisionFamily:
    architecture: str  # the checkpoint's config.architectures[0]
    model_type: str  # builder_config.model_type of the encoder directory (the anchor's names)
    encoder_config: Callable[[object], dict]  # hf_config -> the encoder directory's config
    encoder_weights: Callable[[TensorGetter, dict], dict]  # (getter, encoder config) -> engine weights
    encoder_class: type  # (config, dtype, device) -> nn.Module with encode() and num_image_tokens
    language_prefixes: tuple[tuple[str, str], ...]  # (text-model name prefix, checkpoint prefixes to try)
    text_config_of: Callable[[object], object] | None = None  # None: hf_config.text_config as it is
    # getter -> getter reading the language tensors as the text model's modules hold them (Qwen3-VL-MoE's
    # transposed experts); None: as the checkpoint holds them
    language_tensors: Callable[[TensorGetter], TensorGetter] | None = None

    def text_config(self, hf_config):
        return hf_config.text_config if self.text_config_of is None else self.text_config_of(hf_config)

    def language_getter(self, get: TensorGetter) -> TensorGetter:
        """A getter that finds the language model's tensors under text-model names."""
        def get_text(name: str):
            for prefix, candidates in self.language_prefixes:
                if name.startswith(prefix):
                    rest = name[len(prefix):]
                    names = [candidate + rest for candidate in candidates]
                    for candidate in names[:-1]:
                        try:
                            return get(candidate)
                        except CheckpointError:
                            continue
                    return get(names[-1])
            return get(name)
        return get_text if self.language_tensors is None else self.language_tensors(get_text)


# transformers 4 (and 5's saved files) keep LLaVA's text model under language_model.model.* and
# language_model.lm_head.*; transformers 5 in memory under model.language_model.* and lm_head.*.
# Qwen2-VL and Qwen2.5-VL save their language model as model.* (transformers 4 and 5's files), transformers 5 holds it
# in memory as model.language_model.*; the tower is visual.* / model.visual.*.
_QWEN2_VL_LANGUAGE = (("model.", ("model.language_model.", "model.")), ("lm_head.", ("lm_head.",)))
_LLAVA_LANGUAGE = (("model.", ("language_model.model.", "model.language_model.")),
                   ("lm_head.", ("language_model.lm_head.", "lm_head.")))

# BLIP-2 keeps its language model (OPT) as language_model.model.decoder.* and language_model.lm_head.*
# (tied to the embeddings in OPT, so usually absent), in memory and on disk.
_BLIP2_LANGUAGE = (("model.", ("language_model.model.",)), ("lm_head.", ("language_model.lm_head.",)))

VISION_FAMILIES = {
    "LlavaForConditionalGeneration": VisionFamily(
        "LlavaForConditionalGeneration", llava.MODEL_TYPE, llava.encoder_config, llava.encoder_weights,
        llava.LlavaVisionEncoder, _LLAVA_LANGUAGE),
    "LlavaNextForConditionalGeneration": VisionFamily(
        "LlavaNextForConditionalGeneration", llava_next.NEXT_MODEL_TYPE, llava_next.encoder_config,
        llava_next.encoder_weights, llava_next.LlavaNextVisionEncoder, _LLAVA_LANGUAGE),
    "LlavaOnevisionForConditionalGeneration": VisionFamily(
        "LlavaOnevisionForConditionalGeneration", ONEVISION_MODEL_TYPE, llava_next.onevision_encoder_config,
        llava_next.encoder_weights, llava_next.LlavaNextVisionEncoder, _LLAVA_LANGUAGE),
    "Qwen2VLForConditionalGeneration": VisionFamily(
        "Qwen2VLForConditionalGeneration", qwen2_vl.MODEL_TYPE, qwen2_vl.encoder_config, qwen2_vl.encoder_weights,
        qwen2_vl.Qwen2VisionEncoder, _QWEN2_VL_LANGUAGE, qwen2_vl.text_config),
    "Qwen2_5_VLForConditionalGeneration": VisionFamily(
        "Qwen2_5_VLForConditionalGeneration", qwen2_5_vl.MODEL_TYPE, qwen2_5_vl.encoder_config,
        qwen2_5_vl.encoder_weights, qwen2_5_vl.Qwen25VisionEncoder, _QWEN2_VL_LANGUAGE, qwen2_vl.text_config),
    # Qwen3-VL saves its language model as model.language_model.* (transformers 5's files)
    "Qwen3VLForConditionalGeneration": VisionFamily(
        "Qwen3VLForConditionalGeneration", qwen3_vl.MODEL_TYPE, qwen3_vl.encoder_config, qwen3_vl.encoder_weights,
        qwen3_vl.Qwen3VisionEncoder, _QWEN2_VL_LANGUAGE, qwen3_vl.text_config),
    "Qwen3VLMoeForConditionalGeneration": VisionFamily(
        "Qwen3VLMoeForConditionalGeneration", qwen3_vl.MODEL_TYPE, qwen3_vl.encoder_config, qwen3_vl.encoder_weights,
        qwen3_vl.Qwen3VisionEncoder, _QWEN2_VL_LANGUAGE, qwen3_vl.text_config, qwen3_vl.moe_language_tensors),
    "Blip2ForConditionalGeneration": VisionFamily(
        "Blip2ForConditionalGeneration", blip2.MODEL_TYPE, blip2.encoder_config, blip2.encoder_weights,
        blip2.Blip2VisionEncoder, _BLIP2_LANGUAGE, blip2.text_config),
    # Gemma 3 keeps its text model as LLaVA does (model.language_model.* in transformers 5, language_model.model.* in 4)
    "Gemma3ForConditionalGeneration": VisionFamily(
        "Gemma3ForConditionalGeneration", gemma3.MODEL_TYPE, gemma3.encoder_config, gemma3.encoder_weights,
        gemma3.Gemma3VisionEncoder, _LLAVA_LANGUAGE),
    # Llama 3.2 Vision: its text model has cross-attention layers, so engine.build builds it through
    # engine/encoder_decoder/mllama_build.py, which reads the text model's tensors itself
    "MllamaForConditionalGeneration": VisionFamily(
        "MllamaForConditionalGeneration", mllama.MODEL_TYPE, mllama.encoder_config, mllama.encoder_weights,
        mllama.MllamaVisionEncoder, _LLAVA_LANGUAGE),
}
# Qwen3-VL and Qwen3-VL-MoE share "qwen3_vl": the same tower, so either entry loads its encoder
FAMILIES_BY_MODEL_TYPE = {family.model_type: family for family in VISION_FAMILIES.values()}


def vision_family(hf_config) -> VisionFamily | None:
    """The family of a vision-language checkpoint's config, or None for a text model."""
    architectures = getattr(hf_config, "architectures", None) or []
    return VISION_FAMILIES.get(architectures[0]) if architectures else None
