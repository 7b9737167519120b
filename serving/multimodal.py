"""Images in the Triton pipeline: the multimodal part of `preprocessing` and the `multimodal_encoders` model.

preprocessing (``ImagePrompts``): a request's images (image_bytes_input, image_url_input decoded
here; image_input, already pixel values, counted from its shape) -> the prompt with an image slot
per image, and PIXEL_VALUES for the images decoded here, made by the checkpoint's own image
processor (the vision-encoder directory's preprocessor_config.json). An image slot is
``num_image_tokens`` fake ids, vocab_size + row, counting up per item over its images, so image i
takes table rows [i * n, (i + 1) * n) (the anchor's convention). Layout:
- the text holds the image placeholder (``<image>`` for LLaVA) once per image: each becomes a slot
  and the text is the whole prompt (the client wrote the chat template);
- else the anchor's: pre-prompt, the slots, the text, post-prompt (LLaVA: ``USER:\\n`` and
  `` ASSISTANT:``);
- no image: the text alone (text-only requests pass through a multimodal repository).

multimodal_encoders (``VisionEncoderRunner``): every image of every request in one batch through
the engine's vision encoder (engine/vision/) -> per request OUT_PROMPT_EMBEDDING_TABLE (1, rows,
hidden) FP16 and OUT_PROMPT_VOCAB_SIZE (1, 1) INT32 = rows.

Errors are per request (ValueError/ImageError naming the client's input): too many images, an image
placeholder count that differs from the images sent, images sent to a text-only model, video.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from serving.images import ImageLimits, images_from_bytes, images_from_urls
from serving.text import string_rows

# builder_config.model_type -> (pre-prompt, post-prompt) around the image slots and the text.
PROMPT_WRAPPERS = {"llava": ("USER:\n", " ASSISTANT:")}
DEFAULT_MAX_NUM_IMAGES = 1
TEXT_ONLY = ("images and video were sent to a text-only model (the preprocessing parameter multimodal_model_path "
             "is not set); send {name} only to a vision-language model's repository (all_models/multimodal)")


def _present(array) -> bool:
    return array is not None and np.asarray(array).size > 0


def _urls(array, row: int) -> list[str]:
    if not _present(array):
        return []
    return [url for url in string_rows(array)[row] if url]


def refuse_images_on_text_model(tensors: dict) -> None:
    """preprocessing without multimodal_model_path: any image input is this request's error."""
    for name, client_name in (("IMAGE", "image_input"), ("IMAGE_BYTES", "image_bytes_input"),
                              ("VIDEO_BYTES", "video_bytes_input")):
        if _present(tensors.get(name)):
            raise ValueError(f"{client_name}: " + TEXT_ONLY.format(name=client_name))
    url = tensors.get("IMAGE_URL")
    if _present(url) and any(u for row in string_rows(url) for u in row):
        raise ValueError("image_url_input: " + TEXT_ONLY.format(name="image_url_input"))


@dataclass
class PreparedItem:
    input_ids: list[int]
    pixel_values: np.ndarray | None  # (n, 3, H, W) float32 for images decoded here


class ImagePrompts:
    """The preprocessing side for one vision-encoder directory and the language engine's vocabulary."""

    def __init__(self, encoder_dir: str, tokenizer, vocab_size: int, *, max_num_images: int | None = None,
                 limits: ImageLimits = ImageLimits()):
        with open(os.path.join(encoder_dir, "config.json")) as f:
            config = json.load(f)
        self.model_type = config["builder_config"]["model_type"]
        self.num_image_tokens = config["num_image_tokens"]
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_num_images = max_num_images or DEFAULT_MAX_NUM_IMAGES
        self.limits = limits
        image_token = config.get("image_token_index")
        self.placeholder = (tokenizer.convert_ids_to_tokens(image_token) if image_token is not None
                            and image_token < len(tokenizer) else None) or "<image>"
        # The placeholder's one token id (None when the tokenizer splits it): expand_placeholders
        placeholder_ids = tokenizer.encode(self.placeholder, add_special_tokens=False)
        self.placeholder_id = placeholder_ids[0] if len(placeholder_ids) == 1 else None
        self.wrapper = PROMPT_WRAPPERS.get(self.model_type, ("", ""))
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(encoder_dir)

    def prepare(self, query: str, tensors: dict, row: int, add_special_tokens: bool) -> PreparedItem:
        """Item ``row``: its prompt ids (with image slots) and the pixel values of images decoded here."""
        if _present(tensors.get("VIDEO_BYTES")):
            raise ValueError(f"video_bytes_input: video is not supported for {self.model_type} models; send images")
        images = []
        if _present(tensors.get("IMAGE_BYTES")):
            images += images_from_bytes(tensors["IMAGE_BYTES"][row], self.limits)
        images += images_from_urls(_urls(tensors.get("IMAGE_URL"), row), self.limits)
        sent_pixels = tensors.get("IMAGE")
        num_pixel_images = int(np.asarray(sent_pixels).shape[1]) if _present(sent_pixels) else 0
        if images and num_pixel_images:
            raise ValueError("image_input and image_bytes_input/image_url_input were both sent; send each request's "
                             "images one way")
        num_images = len(images) or num_pixel_images
        if num_images > self.max_num_images:
            raise ValueError(f"{num_images} images were sent; allowed: at most {self.max_num_images} per request "
                             "(max_num_images of the preprocessing model)")
        pixel_values = None
        if images:
            pixel_values = np.asarray(self.image_processor(images, return_tensors="np")["pixel_values"], np.float32)
        return PreparedItem(self.prompt_ids(query, num_images, add_special_tokens), pixel_values)

    def slot(self, i: int) -> list[int]:
        """Image i's fake ids: table rows [i * n, (i + 1) * n)."""
        return list(range(self.vocab_size + i * self.num_image_tokens, self.vocab_size + (i + 1) * self.num_image_tokens))

    def expand_placeholders(self, ids: list[int], num_images: int, where: str = "text_input") -> list[int]:
        """Token ids of a whole prompt (a chat template wrote one placeholder per image) -> each
        placeholder id replaced by its image's slot, in order. A count that differs from
        ``num_images`` is the request's error (ValueError naming ``where``)."""
        positions = [p for p, token in enumerate(ids) if token == self.placeholder_id] if (
            self.placeholder_id is not None) else []
        if len(positions) != num_images:
            raise ValueError(f"{where}: the prompt holds {len(positions)} {self.placeholder} placeholder(s) but "
                             f"{num_images} image(s) were sent; send one image per placeholder")
        out, start = [], 0
        for i, position in enumerate(positions):
            out += ids[start:position] + self.slot(i)
            start = position + 1
        return out + ids[start:]

    def prompt_ids(self, query: str, num_images: int, add_special_tokens: bool) -> list[int]:
        def encode(text: str, special: bool) -> list[int]:  # (an empty first piece keeps the special tokens)
            return self.tokenizer.encode(text, add_special_tokens=special) if text or special else []

        slot = self.slot
        pieces = query.split(self.placeholder)
        if len(pieces) > 1:
            if len(pieces) - 1 != num_images:
                raise ValueError(f"text_input has {len(pieces) - 1} {self.placeholder} placeholder(s) but {num_images} "
                                 "image(s) were sent; send one image per placeholder (or no placeholder: the image "
                                 "goes before the text)")
            ids = encode(pieces[0], add_special_tokens)
            for i, piece in enumerate(pieces[1:]):
                ids += slot(i) + encode(piece, False)
            return ids
        if num_images == 0:
            return encode(query, add_special_tokens)
        pre, post = self.wrapper
        ids = encode(pre, add_special_tokens)
        for i in range(num_images):
            ids += slot(i)
        return ids + encode(query, False) + encode(post, False)


def pad_rows(rows: list[list[int]], pad_id: int) -> tuple[np.ndarray, np.ndarray]:
    """Right-padded (B, Lmax) int32 ids and their (B, 1) int32 lengths."""
    width = max([0] + [len(ids) for ids in rows])
    ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    for b, row in enumerate(rows):
        ids[b, :len(row)] = row
    return ids, np.array([[len(row)] for row in rows], dtype=np.int32)


def stack_pixel_values(items: list[PreparedItem]) -> np.ndarray | None:
    """PIXEL_VALUES (B, n_max, 3, H, W) FP16 for the items' decoded images (zero-padded over images),
    or None when no item decoded any. A batch whose items' images differ in size is one request's error."""
    arrays = [item.pixel_values for item in items if item.pixel_values is not None]
    if not arrays:
        return None
    shapes = {a.shape[1:] for a in arrays}
    if len(shapes) > 1:
        raise ValueError(f"the batch's images were processed to different sizes {sorted(shapes)}; send them in "
                         "separate requests")
    n = max(len(a) for a in arrays)
    out = np.zeros((len(items), n, *arrays[0].shape[1:]), dtype=np.float16)
    for b, item in enumerate(items):
        if item.pixel_values is not None:
            out[b, :len(item.pixel_values)] = item.pixel_values
    return out


def engine_vocab_size(engine_dir: str) -> int:
    """The language engine's vocab_size: fake ids start there (not at the tokenizer's length)."""
    from engine.config import EngineConfig

    return EngineConfig.load(engine_dir).model.vocab_size


# ----------------------------------------------------------------------------- multimodal_encoders

class VisionEncoderRunner:
    """The engine's vision encoder for the `multimodal_encoders` model: requests' pixel values -> tables."""

    def __init__(self, encoder_dir: str, device: str | None = None):
        import torch

        from engine.vision.encoder_dir import load_vision_encoder

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.encoder = load_vision_encoder(encoder_dir, self.device)
        self.num_image_tokens = self.encoder.num_image_tokens

    def tables(self, per_request_pixels: list[np.ndarray | None]) -> list[np.ndarray | None]:
        """Each request's images, (n, 3, H, W) float (None or n == 0: no image), -> its table
        (n * num_image_tokens, hidden) float16, or None. All images run as one batch."""
        import torch

        counts = [0 if p is None else len(p) for p in per_request_pixels]
        if not sum(counts):
            return [None] * len(counts)
        sizes = {tuple(p.shape[1:]) for p in per_request_pixels if p is not None and len(p)}
        if len(sizes) > 1:  # Triton batched requests with images of different sizes: one forward each
            return [self.tables([p])[0] for p in per_request_pixels]
        batch = torch.from_numpy(np.concatenate([p for p in per_request_pixels if p is not None and len(p)]))
        features = self.encoder.encode(batch.to(self.device, torch.float32)).float().cpu()
        tables, start = [], 0
        for count in counts:
            rows = features[start:start + count].reshape(-1, features.shape[-1])
            tables.append(rows.numpy().astype(np.float16) if count else None)
            start += count
        return tables


def rows_pixels(pixel_values: np.ndarray | None, image: np.ndarray | None) -> list[np.ndarray | None]:
    """One multimodal_encoders request's images per batch row, each (n, 3, H, W): pixel_values
    (preprocessing's, preferred, as the anchor) or IMAGE (the client's image_input), (B, n, 3, H, W)
    or (B, 3, H, W) for one image per row. [None] when the request has neither."""
    chosen = pixel_values if _present(pixel_values) else image if _present(image) else None
    if chosen is None:
        return [None]
    chosen = np.asarray(chosen)
    if chosen.ndim == 4:
        chosen = chosen[:, None]
    if chosen.ndim != 5 or chosen.shape[2] != 3:
        raise ValueError(f"image_input has shape {chosen.shape}; send pixel values (batch, images, 3, height, width)")
    return list(chosen)


def prepare_batch(prompts: ImagePrompts, tensors: dict, queries: list[str], add_special_tokens: bool,
                  pad_id: int) -> dict[str, np.ndarray]:
    """preprocessing's INPUT_ID, REQUEST_INPUT_LEN and (for images decoded here) PIXEL_VALUES."""
    items = [prompts.prepare(query, tensors, row, add_special_tokens) for row, query in enumerate(queries)]
    input_ids, lengths = pad_rows([item.input_ids for item in items], pad_id)
    outputs = {"INPUT_ID": input_ids, "REQUEST_INPUT_LEN": lengths}
    pixel_values = stack_pixel_values(items)
    if pixel_values is not None:
        outputs["PIXEL_VALUES"] = pixel_values
    return outputs


def image_limits(max_image_pixels: int | None, allowed_hosts: str | None) -> ImageLimits:
    """preprocessing's max_image_pixels and allowed_image_url_hosts ("*": any host; "a,b": these;
    unset: no http(s) fetches, data: URLs only)."""
    hosts = None if not allowed_hosts else () if allowed_hosts.strip() == "*" else tuple(
        h.strip() for h in allowed_hosts.split(",") if h.strip())
    return ImageLimits(max_pixels=max_image_pixels or ImageLimits.max_pixels, allowed_url_hosts=hosts)
