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
  `` ASSISTANT:``; BLIP-2: the slots, then the text with its special tokens, so OPT's BOS follows
  the image);
- no image: the text alone (text-only requests pass through a multimodal repository).

multimodal_encoders (``VisionEncoderRunner``): every image of every request in one batch through
the engine's vision encoder (engine/vision/) -> per request OUT_PROMPT_EMBEDDING_TABLE (1, rows,
hidden) FP16 and OUT_PROMPT_VOCAB_SIZE (1, 1) INT32 = rows.

LLaVA-OneVision also takes one video per request (video_bytes_input; serving/video_prompts.py):
its frames become PIXEL_VALUES with IS_VIDEO_INPUT, its slot one run of fake ids. So do Qwen2.5-VL and
Qwen2-VL (serving/qwen_video.py): the video's patches and grid go as an image's (PIXEL_VALUES,
IMAGE_GRID_THW, VISION_INPUT_ID) with IS_VIDEO_INPUT and VIDEO_SECOND_PER_GRID (B, 1) FP32, which
multimodal_encoders' M-RoPE time axis reads.

Gemma 3 with do_pan_and_scan on in its preprocessor config: each image is the full image then the image
processor's crops of it (num_crops), each its own mm_tokens_per_image rows and its own image to the tower,
the prompt text as Gemma3Processor writes it for crops (gemma3_image_text).

Errors are per request (ValueError/ImageError/VideoError naming the client's input): too many images,
pan-and-scan crops that leave the prompt no room in the engine's max_seq_len,
an image placeholder count that differs from the images sent, images sent to a text-only model,
video sent to a model without video, too many frames, an undecodable video.
"""
from __future__ import annotations

import json
import os
from dataclasses import dataclass

import numpy as np

from serving import mllama
from serving.images import ImageLimits, images_from_bytes, images_from_urls
from serving.qwen_vl import (CHAT_WRAPPERS, NO_PIXELS, ONE_IMAGE, QWEN_VL_TYPES, grid_rows, image_patches,
                             vision_input_ids)
from serving.text import string_rows
from serving.video_prompts import VIDEO_AND_IMAGES, VideoPrompts, video_frames, video_support_error
from serving.videos import (FrameRequest, VideoError, VideoLimits, frame_request, frames_from_bytes, is_video_file,
                            uniform_sampler, video_from_url)

# builder_config.model_type -> (pre-prompt, after the image slots, post-prompt) around the image
# slots and the text, as the anchor's preprocessing writes them (LLaVA-NeXT has none there: its
# prompt is the chat template of its language model, so send the text with <image> placeholders).
PROMPT_WRAPPERS = {"llava": ("USER:\n", "", " ASSISTANT:"),
                   "llava_onevision": ("<|im_start|>user ", "\n", "<|im_end|><|im_start|>assistant\n"),
                   **CHAT_WRAPPERS}
# builder_config.model_type whose image slots come first and whose text keeps its special tokens
# after them: the anchor's blip2 layout (fake ids, then the encoded text), which is transformers'
# Blip2Processor's too (the query tokens, then the tokenizer's ids with OPT's BOS).
SLOTS_FIRST = ("blip2-opt",)
DEFAULT_MAX_NUM_IMAGES = 1
TEXT_ONLY = ("images and video were sent to a text-only model (the preprocessing parameter multimodal_model_path "
             "is not set); send {name} only to a vision-language model's repository (all_models/multimodal)")


def _present(array) -> bool:
    return array is not None and np.asarray(array).size > 0


def _urls(array, row: int) -> list[str]:
    if not _present(array):
        return []
    return [url for url in string_rows(array)[row] if url]


class QwenVideoPrompts:
    """A Qwen2.5-VL / Qwen2-VL / Qwen3-VL encoder directory's video side: its processor
    (serving/qwen_video.py; Qwen3-VL's serving/qwen3_video.py, whose prompts put a timestamp before each
    frame pair), the <|video_pad|> placeholder and the frame limits."""

    def __init__(self, encoder_dir: str, config: dict, tokenizer, limits: VideoLimits, image_limits: ImageLimits):
        from serving.qwen3_video import Qwen3VideoFrames
        from serving.qwen_video import QwenVideoFrames

        self.timestamps = bool(config["qwen_video"].get("timestamps"))  # Qwen3-VL
        self.processor = Qwen3VideoFrames(encoder_dir) if self.timestamps else QwenVideoFrames(encoder_dir)
        self.limits, self.image_limits = limits, image_limits
        token = config["qwen_video"]["video_token_index"]
        self.placeholder = tokenizer.convert_ids_to_tokens(token) if token < len(tokenizer) else "<|video_pad|>"
        self.placeholder_id = token

    def sampler(self, request: FrameRequest = FrameRequest()):
        """decode_video's choice of an encoded file's frames: Qwen3-VL's processor's, else uniform."""
        return self.processor.sampler(self.limits, request) if self.timestamps else uniform_sampler(self.limits, request)

    def frames(self, item: np.ndarray, request: FrameRequest = FrameRequest()) -> tuple[np.ndarray, dict]:
        """One item of video_bytes_input -> (frames, decode_video's meta: empty for frames sent as pixels)."""
        meta = {}
        return frames_from_bytes(item, self.limits, self.image_limits, meta=meta, sampler=self.sampler(request)), meta

    def from_url(self, url: str, field: str, request: FrameRequest = FrameRequest()) -> tuple[np.ndarray, dict]:
        meta = {}
        return video_from_url(url, field, self.limits, self.image_limits, meta, self.sampler(request)), meta

    def encode(self, frames: np.ndarray, meta: dict) -> tuple[np.ndarray, list[int], float, list[float] | None]:
        """frames -> (patches, grid [t, h, w], second_per_grid_t, Qwen3-VL's per frame pair seconds or None)."""
        patches, grid = self.processor(frames)
        seconds = self.processor.timestamps(len(frames), meta) if self.timestamps else None
        return patches, grid, self.processor.second_per_grid(meta.get("fps")), seconds


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
    # images decoded here: (n, 3, H, W) float32, or for anyres families (engine/vision/anyres.py)
    # every image's tiles one after another, (total tiles, 3, S, S)
    pixel_values: np.ndarray | None
    image_sizes: np.ndarray | None = None  # (n, 2) int64 (height, width) before processing: anyres families
    image_grid_thw: np.ndarray | None = None  # (n, 3) int64 patch grids: Qwen2-VL (pixel_values (1, 1, patches, dim))
    mllama: dict | None = None  # Llama 3.2 Vision: aspect ratio ids / mask and token mask (serving/mllama.py)
    is_video: bool = False  # pixel_values are a video's frames (F, 3, S, S): OneVision; Qwen: its patches
    second_per_grid: float | None = None  # a Qwen video's second_per_grid_t (serving/qwen_video.py)


class ImagePrompts:
    """The preprocessing side for one vision-encoder directory and the language engine's vocabulary."""

    def __init__(self, encoder_dir: str, tokenizer, vocab_size: int, *, max_num_images: int | None = None,
                 limits: ImageLimits = ImageLimits(), video_limits: VideoLimits = VideoLimits(),
                 max_seq_len: int | None = None):
        with open(os.path.join(encoder_dir, "config.json")) as f:
            config = json.load(f)
        self.config = config
        self.model_type = config["builder_config"]["model_type"]
        self.qwen = self.model_type in QWEN_VL_TYPES  # serving/qwen_vl.py
        self.num_image_tokens = config["num_image_tokens"]
        self.anyres = "anyres" in config  # LLaVA-NeXT / OneVision: rows per image depend on its size
        self.tokenizer = tokenizer
        self.vocab_size = vocab_size
        self.max_num_images = max_num_images or DEFAULT_MAX_NUM_IMAGES
        self.limits = limits
        self.max_seq_len = max_seq_len  # the engine's (None: unchecked here); pan-and-scan crops are refused past it
        image_token = config.get("image_token_index")
        self.placeholder = (tokenizer.convert_ids_to_tokens(image_token) if image_token is not None
                            and image_token < len(tokenizer) else None) or "<image>"
        # The placeholder's one token id (None when the tokenizer splits it): expand_placeholders
        placeholder_ids = tokenizer.encode(self.placeholder, add_special_tokens=False)
        self.placeholder_id = placeholder_ids[0] if len(placeholder_ids) == 1 else None
        self.wrapper = PROMPT_WRAPPERS.get(self.model_type, ("", "", ""))
        # ids around each image slot that preprocessing lays out (Qwen2-VL: <|vision_start|>, <|vision_end|>)
        self.slot_ends = ([config["vision_start_token_id"]], [config["vision_end_token_id"]]) if self.qwen else ([], [])
        from transformers import AutoImageProcessor

        self.image_processor = AutoImageProcessor.from_pretrained(encoder_dir)
        self.gemma3 = "gemma3" in config
        self.pan_and_scan = False  # Gemma 3's crops (_init_gemma3)
        if self.gemma3:
            self._init_gemma3(config["gemma3"])
        # Llama 3.2 Vision: its own processor lays out the prompt; images go to cross-attention (serving/mllama.py)
        self.mllama = mllama.processor_for(self.image_processor, tokenizer) if (
            self.model_type == mllama.MODEL_TYPE) else None
        # LLaVA-OneVision's video side (None: the model takes no video)
        self.video = VideoPrompts(encoder_dir, config, tokenizer, video_limits, limits) if "video" in config else None
        # Qwen2.5-VL / Qwen2-VL video (serving/qwen_video.py): None for other models and engines built without it
        self.qwen_video = QwenVideoPrompts(encoder_dir, config, tokenizer, video_limits, limits) if (
            self.qwen and "qwen_video" in config) else None

    def _init_gemma3(self, gemma3: dict) -> None:
        """Gemma 3: the placeholder is <start_of_image>, which the processor expands in the text to
        "\n\n<start_of_image>" + <image_soft_token> per row + "<end_of_image>\n\n" (gemma3_image_text),
        with do_pan_and_scan the full image's and each crop's so, between Gemma3Processor's words."""
        self.pan_and_scan = bool(getattr(self.image_processor, "do_pan_and_scan", False))
        convert = self.tokenizer.convert_ids_to_tokens
        self.boi, self.eoi = convert(gemma3["boi_token_index"]), convert(gemma3["eoi_token_index"])
        self.image_token, self.image_token_id = convert(self.config["image_token_index"]), self.config["image_token_index"]
        self.placeholder, self.placeholder_id = self.boi, gemma3["boi_token_index"]

    def gemma3_image_text(self, rows: int) -> str:
        """What Gemma3Processor writes for one image of ``rows`` rows: the full image alone, or (pan-and-scan,
        rows a multiple of mm_tokens_per_image for the full image and each crop) its replace_image_token's
        text around the full image's and the crops' sequences."""
        views = [f"\n\n{self.boi}{self.image_token * self.num_image_tokens}{self.eoi}\n\n"] * (
            rows // self.num_image_tokens)
        if len(views) == 1:
            return views[0]
        return (f"Here is the original image {views[0]} and here are some crops to help you see better "
                + " ".join(views[1:]))

    def prepare(self, query: str, tensors: dict, row: int, add_special_tokens: bool) -> PreparedItem:
        """Item ``row``: its prompt ids (with image slots) and the pixel values of images decoded here."""
        if _present(tensors.get("VIDEO_BYTES")):
            return self._prepare_video(query, tensors, row, add_special_tokens)
        images = []
        if _present(tensors.get("IMAGE_BYTES")):
            images += images_from_bytes(tensors["IMAGE_BYTES"][row], self.limits)
        images += images_from_urls(_urls(tensors.get("IMAGE_URL"), row), self.limits)
        sent_pixels, sent_sizes = tensors.get("IMAGE"), None
        num_pixel_images = int(np.asarray(sent_pixels).shape[1]) if _present(sent_pixels) else 0
        if num_pixel_images and self.anyres:  # image_input holds tiles; image_sizes_input counts the images
            sent_sizes = _sizes_row(tensors.get("IMAGE_SIZES"), row, self.model_type)
            num_pixel_images = len(sent_sizes)
        if images and num_pixel_images:
            raise ValueError("image_input and image_bytes_input/image_url_input were both sent; send each request's "
                             "images one way")
        if self.qwen:
            return self._prepare_qwen(query, images, num_pixel_images, add_special_tokens)
        num_images = len(images) or num_pixel_images
        if num_images > self.max_num_images:
            raise ValueError(f"{num_images} images were sent; allowed: at most {self.max_num_images} per request "
                             "(max_num_images of the preprocessing model)")
        if self.mllama is not None:
            if num_pixel_images:
                raise ValueError(mllama.NO_PIXELS)
            item = mllama.prepare_item(self.mllama, query, images, add_special_tokens)
            return PreparedItem(item["input_ids"], item.get("pixel_values"), mllama=item)
        pixel_values = image_sizes = None
        if images:
            pixel_values, image_sizes, counts = self.pixels_and_rows(images)
        else:  # image_input: each entry one image of its own rows (pixels at the processor's size: no crops)
            image_sizes = sent_sizes
            counts = self.token_counts(image_sizes, num_images)
        ids = self.prompt_ids(query, counts, add_special_tokens)
        self.check_crops_room(len(ids), counts, "image_bytes_input/image_url_input")
        return PreparedItem(ids, pixel_values, image_sizes)

    def _prepare_video(self, query: str, tensors: dict, row: int, add_special_tokens: bool) -> PreparedItem:
        """OneVision or Qwen: one video (its frames or an encoded file), no images (serving/video_prompts.py)."""
        if self.video is None and self.qwen_video is None:
            raise ValueError(video_support_error(self.config))
        if any(_present(tensors.get(name)) for name in ("IMAGE", "IMAGE_BYTES")) or _urls(tensors.get("IMAGE_URL"), row):
            raise ValueError(VIDEO_AND_IMAGES)
        item = tensors["VIDEO_BYTES"][row]
        request = _frame_request(tensors, row, item, (self.video or self.qwen_video).limits)
        if self.qwen_video is not None:
            frames, meta = self.qwen_video.frames(item, request)
            return self.qwen_video_item(query, frames, meta, add_special_tokens)
        pixel_values = self.video.from_bytes(item, request)
        ids = self.prompt_ids(query, [self.video.rows(pixel_values)], add_special_tokens, self.video.placeholder)
        self.check_video_room(len(ids), len(pixel_values), "video_bytes_input")
        return PreparedItem(ids, pixel_values, is_video=True)

    def qwen_video_item(self, query: str, frames: np.ndarray, meta: dict, add_special_tokens: bool) -> PreparedItem:
        """A Qwen video's item: its patches and grid as an image's, its slot where the text holds the video
        placeholder (else the chat wrapper's <|vision_start|> slot <|vision_end|>; Qwen3-VL: each frame pair
        after its timestamp, video_slot_ids), second_per_grid_t from ``meta``'s fps (decode_video's)."""
        try:
            patches, grid, second, seconds = self.qwen_video.encode(frames, meta)
        except ValueError as error:  # too few frames (Qwen3-VL), an aspect ratio over 200
            raise VideoError(f"video_bytes_input: {error}") from None
        rows = grid_rows(np.array([grid]), self.config["mrope"]["merge"])
        ids = self.prompt_ids(query, rows, add_special_tokens, self.qwen_video.placeholder, seconds)
        self.check_video_room(len(ids), len(frames), "video_bytes_input")
        return PreparedItem(ids, patches[None, None], image_grid_thw=np.array([grid], np.int64), is_video=True,
                            second_per_grid=second)

    def video_slot_ids(self, slot: list[int], seconds: list[float] | None) -> list[int]:
        """A video's fake ids as its prompt holds them: as they are, or (Qwen3-VL, ``seconds`` per frame pair)
        split into one run per frame pair, each ``<{s:.1f} seconds><|vision_start|>`` run ``<|vision_end|>``."""
        if not seconds:
            return slot
        from serving.qwen3_video import timestamp_text

        per_pair, start, end = len(slot) // len(seconds), self.config["vision_start_token_id"], self.config[
            "vision_end_token_id"]
        ids = []
        for k, second in enumerate(seconds):
            ids += (self.tokenizer.encode(timestamp_text(second), add_special_tokens=False) + [start]
                    + slot[k * per_pair:(k + 1) * per_pair] + [end])
        return ids

    def _prepare_qwen(self, query: str, images: list, num_pixel_images: int, add_special_tokens: bool) -> PreparedItem:
        """Qwen2-VL: the processor's patches and grid (serving/qwen_vl.py); one image per request."""
        if num_pixel_images:
            raise ValueError(NO_PIXELS)
        if len(images) > 1:
            raise ValueError(ONE_IMAGE.format(n=len(images)))
        if not images:
            return PreparedItem(self.prompt_ids(query, [], add_special_tokens), None)
        pixel_values, grids = image_patches(self.image_processor, images)
        counts = grid_rows(grids, self.config["mrope"]["merge"])
        return PreparedItem(self.prompt_ids(query, counts, add_special_tokens), pixel_values, image_grid_thw=grids)

    def pixels_and_rows(self, images: list) -> tuple[np.ndarray, np.ndarray | None, list[int]]:
        """Decoded images -> (pixel values, sizes or None, each image's rows). Gemma 3 with pan-and-scan:
        the processor's images in its order (each image, then its crops), an image's rows counting its crops'."""
        if not self.pan_and_scan:
            pixel_values, sizes = self.pixels(images)
            return pixel_values, sizes, self.token_counts(sizes, len(images))
        batch = self.image_processor(images, return_tensors="np")
        crops = np.asarray(batch["num_crops"], np.int64).reshape(-1).tolist()
        return (np.asarray(batch["pixel_values"], np.float32), None,
                [(1 + c) * self.num_image_tokens for c in crops])

    def check_video_room(self, prompt_len: int, frames: int, where: str) -> None:
        """A video whose rows make the prompt too long for the engine is the request's error naming it, before
        the tower encodes it (tensorrt_llm would refuse the prompt after)."""
        if self.max_seq_len is not None and prompt_len >= self.max_seq_len:
            raise VideoError(f"{where}: the video's {frames} frames make the prompt {prompt_len} tokens; the engine's "
                             f"max_seq_len is {self.max_seq_len} (prompt and output): send fewer frames "
                             "(video_num_frames / video_fps with a file, or fewer frames as pixels), smaller frames, "
                             "or a shorter video")

    def check_crops_room(self, prompt_len: int, counts: list[int], where: str) -> None:
        """A prompt that pan-and-scan crops make too long for the engine is the request's error naming them."""
        crop_rows = sum(counts) - self.num_image_tokens * len(counts) if self.pan_and_scan else 0
        if crop_rows and self.max_seq_len is not None and prompt_len >= self.max_seq_len:
            raise ValueError(f"{where}: Gemma 3's pan-and-scan crops of the images ({crop_rows} rows beside the "
                             f"images' own {self.num_image_tokens * len(counts)}) make the prompt {prompt_len} "
                             f"tokens; the engine's max_seq_len is {self.max_seq_len} (prompt and output); send "
                             "fewer or less elongated images, or turn do_pan_and_scan off in the checkpoint's "
                             "preprocessor config")

    def pixels(self, images: list) -> tuple[np.ndarray, np.ndarray | None]:
        """Decoded images -> (pixel values, (n, 2) sizes or None) by the checkpoint's processor; an
        anyres family's tiles without the processor's padding to the longest image's tile count."""
        if not self.anyres:
            return np.asarray(self.image_processor(images, return_tensors="np")["pixel_values"], np.float32), None
        from engine.vision.anyres import is_tiled, num_tiles

        tiled = is_tiled(self.model_type, len(images))
        batch = self.image_processor([images] if not tiled else images, return_tensors="np")
        sizes = np.asarray(batch["image_sizes"], np.int64).reshape(len(images), 2)
        padded = np.asarray(batch["pixel_values"], np.float32).reshape(len(images), -1, *batch["pixel_values"].shape[-3:])
        anyres = self.config["anyres"]
        counts = [num_tiles(tuple(size), anyres["pinpoints"], anyres["tile"]) if tiled else 1 for size in sizes.tolist()]
        return np.concatenate([tiles[:count] for tiles, count in zip(padded, counts)]), sizes

    def token_counts(self, image_sizes, num_images: int) -> list[int]:
        """Rows of each image (engine/vision/anyres.py, torch-free); a missing size is the request's error."""
        from engine.vision.anyres import image_token_counts

        return image_token_counts(self.config, None if image_sizes is None else np.asarray(image_sizes).tolist(),
                                  num_images)

    def slots(self, counts: list[int]) -> list[list[int]]:
        """Each image's fake ids: image i takes the table rows after the images before it."""
        starts = np.cumsum([0, *counts]).tolist()
        return [list(range(self.vocab_size + start, self.vocab_size + start + count))
                for start, count in zip(starts, counts)]

    def expand_placeholders(self, ids: list[int], counts: list[int], where: str = "text_input",
                            kinds: list[str] | None = None, seconds: list[float] | None = None) -> list[int]:
        """Token ids of a whole prompt (a chat template wrote one placeholder per image) -> each
        placeholder id replaced by its image's slot (``counts``: each image's rows), in order.
        ``kinds``: "image" or "video" per entry of ``counts`` (default: images), whose placeholders
        (OneVision's <video>) must come in that order. A placeholder count that differs from the
        images' is the request's error (ValueError naming ``where``). ``seconds``: a Qwen3-VL video's frame pairs'
        timestamps (video_slot_ids)."""
        kinds = kinds or ["image"] * len(counts)
        video = self.video or self.qwen_video  # OneVision's <video>, Qwen's <|video_pad|>
        video_id = video.placeholder_id if video is not None else None
        ids_of = {"image": self.placeholder_id, "video": video_id}
        found = [(p, kind) for p, token in enumerate(ids) for kind, wanted in ids_of.items()
                 if wanted is not None and token == wanted]
        if [kind for _, kind in found] != list(kinds):
            if video is None:
                raise ValueError(f"{where}: the prompt holds {len(found)} {self.placeholder} placeholder(s) but "
                                 f"{len(counts)} image(s) were sent; send one image per placeholder")
            held = [kind for _, kind in found]
            raise ValueError(f"{where}: the prompt holds {held.count('image')} {self.placeholder} and "
                             f"{held.count('video')} {video.placeholder} placeholder(s), in the order {held}, but "
                             f"{list(kinds)} were sent; send one image or video per placeholder, in order")
        if self.mllama is not None:  # its images are read through cross-attention: the ids stay
            return list(ids)
        out, start = [], 0
        for slot, (position, kind) in zip(self.slots(counts), found):
            out += ids[start:position] + (self._gemma3_slot_ids(slot) if self.gemma3 and kind == "image"
                                          else self.video_slot_ids(slot, seconds) if kind == "video" else slot)
            start = position + 1
        return out + ids[start:]

    def _gemma3_slot_ids(self, slot: list[int]) -> list[int]:
        """One Gemma 3 image's ids in a tokenized prompt: gemma3_image_text tokenized alone, its row tokens
        made the image's fake ids (the text around a placeholder is tokenized apart from the template's)."""
        rows = iter(slot)
        return [next(rows) if t == self.image_token_id else t
                for t in self.tokenizer.encode(self.gemma3_image_text(len(slot)), add_special_tokens=False)]

    def prompt_ids(self, query: str, counts: list[int], add_special_tokens: bool,
                   placeholder: str | None = None, seconds: list[float] | None = None) -> list[int]:
        """``counts``: each image's rows (token_counts), or a video's (``placeholder``: the video's; ``seconds``:
        a Qwen3-VL video's frame pairs' timestamps, video_slot_ids)."""
        def encode(text: str, special: bool) -> list[int]:  # (an empty first piece keeps the special tokens)
            return self.tokenizer.encode(text, add_special_tokens=special) if text or special else []

        if self.gemma3:
            return self._gemma3_ids(query, counts, add_special_tokens)
        kind = "image" if placeholder is None else "video"
        slots = self.slots(counts) if kind == "image" else [self.video_slot_ids(s, seconds) for s in self.slots(counts)]
        num_images, slot = len(counts), slots.__getitem__
        placeholder = placeholder or self.placeholder
        pieces = query.split(placeholder)
        if len(pieces) > 1:
            if len(pieces) - 1 != num_images:
                raise ValueError(f"text_input has {len(pieces) - 1} {placeholder} placeholder(s) but {num_images} "
                                 f"{kind}(s) were sent; send one {kind} per placeholder (or no placeholder: the {kind} "
                                 "goes before the text)")
            ids = encode(pieces[0], add_special_tokens)
            for i, piece in enumerate(pieces[1:]):
                ids += slot(i) + encode(piece, False)
            return ids
        if num_images == 0:
            return encode(query, add_special_tokens)
        if self.model_type in SLOTS_FIRST:
            return [t for i in range(num_images) for t in slot(i)] + encode(query, add_special_tokens)
        pre, after_images, post = self.wrapper
        ids = encode(pre, add_special_tokens)
        for i in range(num_images):
            ids += self.slot_ends[0] + slot(i) + self.slot_ends[1]
        return ids + encode(after_images, False) + encode(query, False) + encode(post, False)


    def _gemma3_ids(self, query: str, counts: list[int], add_special_tokens: bool) -> list[int]:
        """Gemma 3's prompt as its processor makes it: each <start_of_image> of the text (without one,
        one per image first) expanded to its image's gemma3_image_text, the whole text tokenized, then the
        row tokens made fake ids."""
        found = query.count(self.boi)
        if not found and counts:
            query = " ".join([self.boi] * len(counts)) + " " + query
        elif found != len(counts):
            raise ValueError(f"text_input has {found} {self.boi} placeholder(s) but {len(counts)} image(s) were sent; "
                             "send one image per placeholder (or no placeholder: the images go before the text)")
        pieces = query.split(self.boi)
        text = pieces[0] + "".join(self.gemma3_image_text(n) + piece for n, piece in zip(counts, pieces[1:]))
        rows = iter(range(self.vocab_size, self.vocab_size + sum(counts)))
        return [next(rows) if t == self.image_token_id else t
                for t in self.tokenizer.encode(text, add_special_tokens=add_special_tokens)]


def _frame_request(tensors: dict, row: int, item: np.ndarray, limits: VideoLimits) -> FrameRequest:
    """Item ``row``'s video_fps / video_num_frames (absent: the model's default choice of frames); given with
    frames sent as pixels (which are taken as they are) is the request's error naming them."""
    values = {}
    for name, field in (("VIDEO_FPS", "video_fps"), ("VIDEO_NUM_FRAMES", "video_num_frames")):
        if _present(tensors.get(name)):
            value = np.asarray(tensors[name]).reshape(len(tensors[name]), -1)[row]
            values[field] = value[0].item() if value.size else None
    request = frame_request(values.get("video_fps"), values.get("video_num_frames"),
                            ("video_fps", "video_num_frames"), limits)
    if request and not is_video_file(item):
        raise VideoError("video_fps / video_num_frames choose an encoded file's frames; this video_bytes_input holds "
                         "frames as pixels, which are taken as they are: sample them before sending, or send the file "
                         "as (1, 1, 1, num_bytes)")
    return request


def _sizes_row(sizes, row: int, model_type: str) -> np.ndarray:
    """image_sizes_input of item ``row``: its image_input images' (height, width), (n, 2) (rows of
    zeros: padding). Missing or malformed is the request's error."""
    if not _present(sizes):
        raise ValueError(f"image_sizes_input is required with image_input for {model_type} models: each image's "
                         "(height, width) before processing, (batch, images, 2)")
    sizes = np.asarray(sizes, np.int64)
    if sizes.ndim != 3 or sizes.shape[-1] != 2 or row >= len(sizes):
        raise ValueError(f"image_sizes_input must be (batch, images, 2): each image's (height, width) before "
                         f"processing; got shape {sizes.shape}")
    return np.array([size for size in sizes[row] if size.any()], np.int64).reshape(-1, 2)


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


def stack_image_sizes(items: list[PreparedItem]) -> np.ndarray | None:
    """IMAGE_SIZES (B, n_max, 2) INT64 of the items' images (zero rows where an item has fewer), or None."""
    arrays = [item.image_sizes for item in items if item.image_sizes is not None]
    if not arrays:
        return None
    out = np.zeros((len(items), max(len(a) for a in arrays), 2), dtype=np.int64)
    for b, item in enumerate(items):
        if item.image_sizes is not None:
            out[b, :len(item.image_sizes)] = item.image_sizes
    return out


def engine_vocab_size(engine_dir: str) -> int:
    """The language engine's vocab_size: fake ids start there (not at the tokenizer's length)."""
    from engine.config import EngineConfig

    return EngineConfig.load(engine_dir).model.vocab_size


def engine_max_seq_len(engine_dir: str) -> int | None:
    """The language engine's max_seq_len (prompt and output): ImagePrompts' room for pan-and-scan crops."""
    from engine.config import EngineConfig

    return EngineConfig.load(engine_dir).build.max_seq_len


# ----------------------------------------------------------------------------- multimodal_encoders

class VisionEncoderRunner:
    """The engine's vision encoder for the `multimodal_encoders` model and the OpenAI frontend:
    requests' pixel values -> tables."""

    def __init__(self, encoder_dir: str, device: str | None = None):
        import torch

        from engine.vision.encoder_dir import load_vision_encoder, read_encoder_config

        self.device = device or ("cuda" if torch.cuda.is_available() else "cpu")
        self.encoder = load_vision_encoder(encoder_dir, self.device)
        self.config = read_encoder_config(encoder_dir)
        self.num_image_tokens = self.encoder.num_image_tokens
        self.anyres = hasattr(self.encoder, "anyres")
        self.qwen = self.encoder.model_type in QWEN_VL_TYPES
        self.mllama = self.encoder.model_type == mllama.MODEL_TYPE  # serving/mllama.py encoder_outputs

    def encode_queue(self):
        """A Qwen tower's ImageEncodeQueue (engine/vision/encode_queue.py): callers' images encoded together,
        on a CUDA stream of its own."""
        from engine.vision.encode_queue import ImageEncodeQueue

        return ImageEncodeQueue(self.encoder, self.device)

    def qwen_outputs(self, pixel_values, grids, ids, second_per_grid=None) -> dict[str, np.ndarray]:
        """One multimodal_encoders request of a Qwen2-VL model (serving/qwen_vl.py): pixel_values
        (B, 1, 1, patches, dim), image_grid_thw (B, 3), vision_input_id (B, L) -> OUT_PROMPT_EMBEDDING_TABLE
        (B, rows, hidden) FP16 (zero-padded), OUT_PROMPT_VOCAB_SIZE (B, 1) and the two MROPE tensors.
        ``second_per_grid`` (B, 1): a video item's second_per_grid_t (0: an image), its M-RoPE time axis
        (serving/qwen_video.py); a video's patches and grid come as an image's. No image: no outputs.
        Missing or mismatched inputs are the request's error naming them."""
        import torch

        from serving.qwen_vl import mrope_outputs

        if not _present(pixel_values) and not _present(grids):  # text-only: tensorrt_llm gets neither
            return {}
        for name, value in (("pixel_values", pixel_values), ("image_grid_thw", grids), ("vision_input_id", ids)):
            if not _present(value):
                raise ValueError(f"{name} is required for {self.encoder.model_type} models (preprocessing's "
                                 "PIXEL_VALUES, IMAGE_GRID_THW and VISION_INPUT_ID)")
        pixels = np.asarray(pixel_values, np.float32)
        grids = np.asarray(grids, np.int64).reshape(-1, 3)
        if pixels.ndim != 5 or len(pixels) != len(grids):
            raise ValueError(f"pixel_values has shape {pixels.shape}; send (batch, 1, 1, patches, dim) with one "
                             f"image_grid_thw row per item ({len(grids)})")
        items = []  # (batch index, its patches, its grid) of the items with an image (a zero grid: none)
        for b, (item, grid) in enumerate(zip(pixels, grids.tolist())):
            patches = int(np.prod(grid))
            if patches > item.shape[2]:
                raise ValueError(f"image_grid_thw {grid} needs {patches} patches; pixel_values holds {item.shape[2]}")
            if patches:
                items.append((b, item[0, 0, :patches], grid))
        tables = [None] * len(pixels)
        if items:  # every item's image in one encoder forward (the tower attends within each image)
            patches = torch.from_numpy(np.concatenate([p for _, p, _ in items])).to(self.device)
            with torch.inference_mode():
                rows = self.encoder.image_features(patches, [grid for _, _, grid in items])
            for (b, _, _), item_rows in zip(items, rows):
                tables[b] = item_rows.float().cpu().numpy().astype(np.float16)
        hidden = next(t.shape[1] for t in tables if t is not None)
        tables = [np.zeros((0, hidden), np.float16) if t is None else t for t in tables]
        table = np.zeros((len(tables), max(len(t) for t in tables), hidden), np.float16)
        for b, rows in enumerate(tables):
            table[b, :len(rows)] = rows
        return {"OUT_PROMPT_EMBEDDING_TABLE": table,
                "OUT_PROMPT_VOCAB_SIZE": np.array([[len(t)] for t in tables], np.int32),
                **mrope_outputs(ids, grids, self.config, second_per_grid)}

    def tables(self, per_request_pixels: list[np.ndarray | None],
               per_request_sizes: list[np.ndarray | None] | None = None,
               per_request_video: list[bool] | None = None) -> list[np.ndarray | None]:
        """Each request's images, (n, 3, H, W) float, or an anyres family's tiles (T, 3, S, S) with
        the images' (n, 2) sizes (rows of zeros: no image; tiles past the images': padding), or
        (``per_request_video``) a OneVision video's frames (F, 3, S, S) -> its table (rows of every
        image, or of the video, hidden) float16; None for a request without images. All images of
        all requests run as one batch, all videos' frames as another."""
        import torch

        if per_request_video and any(per_request_video):
            return self._with_videos(per_request_pixels, per_request_sizes, per_request_video)
        sizes = per_request_sizes or [None] * len(per_request_pixels)
        pixels, image_sizes, tiled, per_request_images = [], [], [], []
        for p, s in zip(per_request_pixels, sizes):
            p, s, t = self._request_images(p, s)
            pixels.append(p)
            image_sizes += s
            tiled += t
            per_request_images.append(len(s) if self.anyres else 0 if p is None else len(p))
        if not sum(per_request_images):
            return [None] * len(per_request_pixels)
        shapes = {tuple(p.shape[1:]) for p in pixels if p is not None}
        if len(shapes) > 1:  # Triton batched requests with images of different sizes: one forward each
            return [self.tables([p], [s])[0] for p, s in zip(per_request_pixels, sizes)]
        batch = torch.from_numpy(np.concatenate([p for p in pixels if p is not None])).to(self.device, torch.float32)
        with torch.inference_mode():
            rows = self.encoder.image_features(batch, image_sizes, tiled)  # one (rows, hidden) per image
        tables, start = [], 0
        for count in per_request_images:
            tables.append(torch.cat(rows[start:start + count]).float().cpu().numpy().astype(np.float16)
                          if count else None)
            start += count
        return tables

    def _with_videos(self, pixels: list, sizes: list | None, videos: list[bool]) -> list[np.ndarray | None]:
        """``tables`` for requests some of which hold a video: the images' requests, then the videos'."""
        import torch

        if video_support_error(self.config):
            raise ValueError(video_support_error(self.config))
        sizes = sizes or [None] * len(pixels)
        out = [None] * len(pixels)
        images = [i for i, video in enumerate(videos) if not video]
        for i, table in zip(images, self.tables([pixels[i] for i in images], [sizes[i] for i in images])):
            out[i] = table
        clips = [(i, video_frames(pixels[i])) for i, video in enumerate(videos) if video and pixels[i] is not None]
        clips = [(i, frames) for i, frames in clips if len(frames)]
        if clips:
            batch = torch.from_numpy(np.concatenate([f for _, f in clips]).astype(np.float32)).to(self.device)
            rows = self.encoder.video_features(batch, [len(f) for _, f in clips])
            for (i, _), table in zip(clips, rows):
                out[i] = table.float().cpu().numpy().astype(np.float16)
        return out

    def _request_images(self, pixels, sizes) -> tuple[np.ndarray | None, list, list]:
        """(its pixels, its images' sizes, whether each is tiled); an anyres family's padding
        tiles and images cut off. A tile count that does not match the sizes is the request's error."""
        if pixels is None or not len(pixels):
            return None, [], []
        if not self.anyres:
            return pixels, [], []
        from engine.vision.anyres import is_tiled

        sizes = [] if sizes is None else [tuple(size) for size in np.asarray(sizes, np.int64).tolist() if any(size)]
        if not sizes:
            raise ValueError(f"{self.encoder.model_type} images need their sizes: send image_sizes_input "
                             "(batch, images, 2), each image's (height, width) before processing")
        tiled = [is_tiled(self.encoder.model_type, len(sizes))] * len(sizes)
        needed = sum(self.encoder.tiles(size, t) for size, t in zip(sizes, tiled))
        if needed > len(pixels):
            raise ValueError(f"images of sizes {sizes} make {needed} tiles, but the pixel values hold {len(pixels)}; "
                             "send each image's tiles as the checkpoint's image processor makes them")
        return pixels[:needed], sizes, tiled


def rows_pixels(pixel_values: np.ndarray | None, image: np.ndarray | None,
                image_sizes: np.ndarray | None = None) -> list[tuple[np.ndarray | None, np.ndarray | None]]:
    """One multimodal_encoders request's (images, their sizes) per batch row: pixel_values
    (preprocessing's, preferred, as the anchor) or IMAGE (the client's image_input), (B, n, 3, H,
    W) or (B, 3, H, W) for one image per row (an anyres family: (B, tiles, 3, S, S)), and
    image_sizes (B, n, 2) or None. [(None, None)] when the request has no pixels."""
    chosen = pixel_values if _present(pixel_values) else image if _present(image) else None
    if chosen is None:
        return [(None, None)]
    chosen = np.asarray(chosen)
    if chosen.ndim == 4:
        chosen = chosen[:, None]
    if chosen.ndim != 5 or chosen.shape[2] != 3:
        raise ValueError(f"image_input has shape {chosen.shape}; send pixel values (batch, images, 3, height, width)")
    sizes = np.asarray(image_sizes, np.int64).reshape(len(chosen), -1, 2) if _present(image_sizes) else None
    return [(row, None if sizes is None else sizes[b]) for b, row in enumerate(chosen)]


def prepare_batch(prompts: ImagePrompts, tensors: dict, queries: list[str], add_special_tokens: bool,
                  pad_id: int) -> dict[str, np.ndarray]:
    """preprocessing's INPUT_ID, REQUEST_INPUT_LEN and (for images decoded here) PIXEL_VALUES, plus
    IMAGE_SIZES for an anyres family (the images' own, or image_sizes_input's for image_input)."""
    items = [prompts.prepare(query, tensors, row, add_special_tokens) for row, query in enumerate(queries)]
    input_ids, lengths = pad_rows([item.input_ids for item in items], pad_id)
    outputs = {"INPUT_ID": input_ids, "REQUEST_INPUT_LEN": lengths}
    pixel_values = stack_pixel_values(items)
    if pixel_values is not None:
        outputs["PIXEL_VALUES"] = pixel_values
    image_sizes = stack_image_sizes(items)
    if image_sizes is not None:
        outputs["IMAGE_SIZES"] = image_sizes
    outputs.update(mllama.stack_items([item.mllama or {"input_ids": item.input_ids} for item in items]))
    if any(item.is_video for item in items):  # OneVision video (serving/video_prompts.py)
        outputs["IS_VIDEO_INPUT"] = np.array([[item.is_video] for item in items], np.bool_)
    if any(item.second_per_grid is not None for item in items):  # Qwen video (serving/qwen_video.py)
        outputs["VIDEO_SECOND_PER_GRID"] = np.array([[item.second_per_grid or 0.0] for item in items], np.float32)
    if any(item.image_grid_thw is not None for item in items):  # Qwen2-VL (serving/qwen_vl.py)
        outputs["IMAGE_GRID_THW"] = np.array([item.image_grid_thw[0] if item.image_grid_thw is not None
                                              else np.zeros(3, np.int64) for item in items], np.int64)
        outputs["VISION_INPUT_ID"] = vision_input_ids(input_ids, prompts.vocab_size, prompts.config["image_token_index"])
    return outputs


def image_limits(max_image_pixels: int | None, allowed_hosts: str | None,
                 local_media_dir: str | None = None) -> ImageLimits:
    """preprocessing's max_image_pixels and allowed_image_url_hosts ("*": any host; "a,b": these;
    unset: no http(s) fetches, data: URLs only); the OpenAI frontend's --allowed_local_media_path."""
    hosts = None if not allowed_hosts else () if allowed_hosts.strip() == "*" else tuple(
        h.strip() for h in allowed_hosts.split(",") if h.strip())
    return ImageLimits(max_pixels=max_image_pixels or ImageLimits.max_pixels, allowed_url_hosts=hosts,
                       local_media_dir=local_media_dir or None)
