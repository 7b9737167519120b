"""Llama 3.2 Vision (Mllama) in the Triton pipeline and the OpenAI frontend: images reach the text model
through cross-attention (engine/encoder_decoder/mllama_*.py), not as prompt rows.

- preprocessing (``prepare_item``): the checkpoint's MllamaProcessor (its image processor from the
  vision-encoder directory, the engine's tokenizer) on the text and the request's decoded images, as the
  anchor's mllama preprocessing: INPUT_ID (the processor's ids, <|image|> as it is, BOS after leading image
  tokens), PIXEL_VALUES (images x max_num_tiles, 3, H, W), ASPECT_RATIO_IDS (images,), ASPECT_RATIO_MASK
  (images, max_num_tiles), CROSS_ATTENTION_MASK (positions, images, max_num_tiles). No image: the text alone;
- multimodal_encoders (``encoder_outputs``): the vision encoder on an item's tiles -> ENCODER_INPUT_FEATURES
  (vision states, images x tiles x patches, hidden), ENCODER_OUTPUT_LENGTHS (that count), CROSS_ATTENTION_MASK
  (positions + max_tokens, vision states) bool (the last row repeated for output positions) and
  SKIP_CROSS_ATTN_BLOCKS (true for an item without images: one zero state, nothing attended), the anchor's
  outputs;
- tensorrt_llm (serving/requests.py ``vision_inputs``): those four inputs -> the engine request's
  encoder_input_features / cross_attention_mask (mask rows trimmed to the prompt: output positions use the
  last row);
- the OpenAI frontend (``prompt_mask``): the chat template's <|image|> ids stay in the prompt; the mask
  comes from the ids and each image's tile count, by the processor's rule.
"""
from __future__ import annotations

import numpy as np

MODEL_TYPE = "mllama"
VISION_INPUTS = ("encoder_input_features", "encoder_output_lengths", "cross_attention_mask", "skip_cross_attn_blocks")
NO_PIXELS = ("image_input: Llama 3.2 Vision takes images as image_bytes_input or image_url_input (the server "
             "tiles them with the checkpoint's processor); pixel values alone lack each image's aspect ratio")


def processor_for(image_processor, tokenizer):
    from transformers import MllamaProcessor

    return MllamaProcessor(image_processor=image_processor, tokenizer=tokenizer)


def prepare_item(processor, query: str, images: list, add_special_tokens: bool) -> dict:
    """One item's ids and (with images) its pixel values, aspect ratio ids / mask and token mask (module
    docstring). A placeholder count that differs from the images is the request's error naming text_input."""
    found = query.count(processor.image_token)
    if images and not found:  # the anchor's client writes <|image|> first; without it the images go first
        query = processor.image_token * len(images) + query
    elif found != len(images):
        raise ValueError(f"text_input has {found} {processor.image_token} placeholder(s) but {len(images)} image(s) "
                         "were sent; send one image per placeholder (or no placeholder: the images go first)")
    batch = processor(text=[query], images=[images] if images else None, add_special_tokens=add_special_tokens,
                      return_tensors="np")
    item = {"input_ids": [int(t) for t in batch["input_ids"][0]]}
    if images:
        pixels = np.asarray(batch["pixel_values"][0], np.float32)  # (images, tiles, 3, H, W)
        item.update(pixel_values=pixels.reshape(-1, *pixels.shape[2:]),
                    aspect_ratio_ids=np.asarray(batch["aspect_ratio_ids"][0], np.int64),
                    aspect_ratio_mask=np.asarray(batch["aspect_ratio_mask"][0], np.int64),
                    cross_attention_mask=np.asarray(batch["cross_attention_mask"][0], np.int64))
    return item


def stack_items(items: list[dict]) -> dict[str, np.ndarray]:
    """ASPECT_RATIO_IDS (B, n), ASPECT_RATIO_MASK (B, n, T), CROSS_ATTENTION_MASK (B, L, n, T), zero-padded (id 0:
    no image), for the items with images; {} when none has any. (PIXEL_VALUES: serving/multimodal.py.)"""
    with_images = [item for item in items if "aspect_ratio_ids" in item]
    if not with_images:
        return {}
    n = max(len(item["aspect_ratio_ids"]) for item in with_images)
    tiles = with_images[0]["aspect_ratio_mask"].shape[1]
    length = max(len(item["input_ids"]) for item in items)
    ids, masks = np.zeros((len(items), n), np.int64), np.zeros((len(items), n, tiles), np.int64)
    tokens = np.zeros((len(items), length, n, tiles), np.int64)
    for b, item in enumerate(items):
        if "aspect_ratio_ids" in item:
            k, rows = len(item["aspect_ratio_ids"]), len(item["cross_attention_mask"])
            ids[b, :k], masks[b, :k] = item["aspect_ratio_ids"], item["aspect_ratio_mask"]
            tokens[b, :rows, :k] = item["cross_attention_mask"]
    return {"ASPECT_RATIO_IDS": ids, "ASPECT_RATIO_MASK": masks, "CROSS_ATTENTION_MASK": tokens}


def dense_mask(token_mask, patches_per_tile: int) -> np.ndarray:
    """The processor's mask (positions, images, max_num_tiles) int -> (positions, vision states) bool, the
    engine's and the anchor's cross_attention_mask (vision states in image, tile, patch order)."""
    mask = np.asarray(token_mask).astype(bool)
    return np.repeat(mask.reshape(mask.shape[0], -1), patches_per_tile, axis=1)


def vision_states(encoder, device, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
    """One item's images -> (images x tiles x patches, hidden) float32 numpy vision states."""
    import torch

    ids = np.asarray(aspect_ratio_ids, np.int64).reshape(-1)
    tiles = np.asarray(aspect_ratio_mask).reshape(len(ids), -1)
    pixels = np.asarray(pixel_values, np.float32)
    pixels = pixels.reshape(len(ids), tiles.shape[1], *pixels.shape[-3:])
    with torch.inference_mode():
        states = encoder.image_features(torch.from_numpy(pixels).to(device), torch.from_numpy(ids),
                                        torch.from_numpy(np.ascontiguousarray(tiles)))
    return states.flatten(0, 1).float().cpu().numpy()


def encoder_outputs(encoder, device, pixel_values, aspect_ratio_ids, aspect_ratio_mask, cross_attention_mask,
                    max_tokens, dtype=np.float16) -> dict[str, np.ndarray]:
    """One multimodal_encoders request of a Llama 3.2 Vision model (module docstring): pixel_values (B, n x T, 3,
    H, W), aspect_ratio_ids (B, n), aspect_ratio_mask (B, n, T), cross_attention_mask (B, L, n, T), max_tokens
    (B, 1) -> the four outputs, batched (items zero-padded to the longest). Missing inputs with pixels are the
    request's error naming them."""
    if pixel_values is None or not np.asarray(pixel_values).size:
        batch = len(np.asarray(max_tokens).reshape(-1)) if max_tokens is not None else 1
        return _batched([None] * batch, [None] * batch, encoder.projector.out_features, dtype)
    for name, value in (("aspect_ratio_ids", aspect_ratio_ids), ("aspect_ratio_mask", aspect_ratio_mask),
                        ("cross_attention_mask", cross_attention_mask)):
        if value is None or not np.asarray(value).size:
            raise ValueError(f"{name} is required with pixel_values for Llama 3.2 Vision models (preprocessing's "
                             "ASPECT_RATIO_IDS, ASPECT_RATIO_MASK and CROSS_ATTENTION_MASK)")
    pixels, ids = np.asarray(pixel_values), np.asarray(aspect_ratio_ids, np.int64)
    masks, tokens = np.asarray(aspect_ratio_mask), np.asarray(cross_attention_mask)
    extra = np.zeros(len(ids), np.int64) if max_tokens is None else np.asarray(max_tokens, np.int64).reshape(-1)
    states, rows = [], []
    patches = encoder.num_image_tokens // encoder.max_tiles
    for b in range(len(ids)):
        n = int((ids[b] > 0).sum())  # aspect ratio id 0: a padding image
        if not n:
            states.append(None)
            rows.append(None)
            continue
        tiles = masks[b].shape[-1]
        states.append(vision_states(encoder, encoder.projector.weight.device, pixels[b][:n * tiles], ids[b][:n],
                                    masks[b][:n]))
        mask = dense_mask(tokens[b][:, :n], patches)
        rows.append(np.concatenate([mask, np.repeat(mask[-1:], int(extra[b]), axis=0)]))
    return _batched(states, rows, encoder.projector.out_features, dtype)


def _batched(states: list, rows: list, hidden: int, dtype) -> dict[str, np.ndarray]:
    """Per item (vision states or None, mask rows or None) -> the four batched outputs; an item without images
    gets one zero state, a one-row all-false mask and SKIP_CROSS_ATTN_BLOCKS true."""
    length = max([1] + [len(s) for s in states if s is not None])
    height = max([1] + [len(r) for r in rows if r is not None])
    features = np.zeros((len(states), length, hidden), dtype)
    masks = np.zeros((len(states), height, length), bool)
    lengths = np.ones((len(states), 1), np.int32)
    skip = np.ones((len(states), 1), bool)
    for b, (s, r) in enumerate(zip(states, rows)):
        if s is not None:
            features[b, :len(s)] = s
            masks[b, :len(r), :r.shape[1]] = r
            lengths[b, 0], skip[b, 0] = len(s), False
    return {"ENCODER_INPUT_FEATURES": features, "ENCODER_OUTPUT_LENGTHS": lengths, "CROSS_ATTENTION_MASK": masks,
            "SKIP_CROSS_ATTN_BLOCKS": skip}


def prompt_mask(ids: list[int], image_token_id: int, tiles: list[int], max_tiles: int) -> np.ndarray:
    """The processor's (positions, images, max_tiles) mask for prompt ``ids`` whose images have ``tiles`` real
    tiles each (transformers' MllamaProcessor rule: a token sees the image(s) whose <|image|> it follows, up to
    the next image; consecutive images together)."""
    from transformers.models.mllama.processing_mllama import (convert_sparse_cross_attention_mask_to_dense,
                                                              get_cross_attention_token_mask)

    spans = get_cross_attention_token_mask(list(ids), image_token_id)
    return convert_sparse_cross_attention_mask_to_dense([spans], [list(tiles)], max_tiles, len(ids))[0]


def direct_inputs(ids: list[int], states: np.ndarray, tiles: list[int], image_token_id: int, max_tiles: int,
                  patches_per_tile: int) -> dict[str, np.ndarray]:
    """The OpenAI frontend's tensorrt_llm inputs for a prompt's images: its vision states (L, hidden) and the
    processor's mask from its ids, as the anchor's four inputs (batch of one)."""
    mask = dense_mask(prompt_mask(ids, image_token_id, tiles, max_tiles), patches_per_tile)
    return {"encoder_input_features": np.ascontiguousarray(states, np.float16)[None],
            "encoder_output_lengths": np.array([[len(states)]], np.int32),
            "cross_attention_mask": mask[None], "skip_cross_attn_blocks": np.array([[False]])}
