"""Images in chat requests (OpenAI ``image_url`` content parts) for a vision-language engine, its
vision encoder run in this process: the direct path needs no ``multimodal_encoders`` model.

Per request: every image part's URL (``data:`` always; http(s) only for the hosts the repository's
``preprocessing`` allows, ``allowed_image_url_hosts``; file: URLs under ``--allowed_local_media_path``)
-> RGB image (serving/images.py, with the
same pixel and byte limits) -> the checkpoint's own image processor -> the encoder
(engine/vision/) -> the prompt-embedding table, (images x image tokens, hidden) FP16, sent to
``tensorrt_llm`` as ``prompt_embedding_table`` beside ids in which each image placeholder the chat
template wrote is replaced by its image's slot of fake ids (vocab_size + row), as the
preprocessing model lays them out (serving/multimodal.py). Fetching, decoding and encoding run on
one worker thread, off the event loop; a bad image is a 400 naming its content part.

LLaVA-OneVision also takes ``video_url`` parts (as vLLM): one video per request, not beside images
(as the Triton path), decoded with PyAV and sampled to ``max_num_frames`` frames (serving/videos.py),
its slot where the chat template wrote ``<video>``. So do Qwen2.5-VL and Qwen2-VL (serving/qwen_video.py):
the video's patches through the tower as an image's, its slot where the template wrote <|video_pad|>, its
M-RoPE time axis from the file's sampled frame rate; and Qwen3-VL (serving/qwen3_video.py), its frame pairs
each after a timestamp. A request's ``mm_processor_kwargs`` (vLLM's field) may choose the frames:
``fps`` or ``num_frames`` (serving/videos.py FrameRequest).
"""
from __future__ import annotations

import asyncio
import os
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from openai_frontend.errors import bad_request
from serving import mllama
from serving.images import decode_file, url_bytes
from serving.mrope import to_wire
from serving.qwen_vl import grid_rows, image_patches
from serving.multimodal import (DEFAULT_MAX_NUM_IMAGES, ImagePrompts, VisionEncoderRunner, engine_max_seq_len,
                               engine_vocab_size, image_limits)
from serving.video_prompts import VIDEO_AND_IMAGES, video_support_error
from serving.videos import FrameRequest, VideoError, frame_request, video_limits

QWEN_IMAGE_WORKERS = 4  # requests fetched, decoded and processed at once; their towers batch in the queue


@dataclass(frozen=True)
class VideoGrid:
    """A Qwen video's (1, 3) grid and its second_per_grid_t (serving/qwen_video.py), ``encode``'s third value;
    Qwen3-VL's frame pairs' timestamps (serving/qwen3_video.py), which ``expand`` writes into the prompt."""

    grids: np.ndarray
    second_per_grid: float
    seconds: list[float] | None = None


@dataclass(frozen=True)
class VisionSettings:
    """Where the encoder is and the image limits (the preprocessing model's parameters of the same names)."""

    encoder_dir: str  # <engine>/vision_encoder, written by engine.build
    max_num_images: int = DEFAULT_MAX_NUM_IMAGES  # per request
    max_image_pixels: int | None = None  # None: serving/images.py's default
    allowed_image_url_hosts: str | None = None  # "*", "a,b", or None: data: URLs only
    allowed_local_media_path: str | None = None  # file: URLs of files under it (vLLM's flag); None: none
    max_num_frames: int | None = None  # frames of one video (OneVision); None: serving/videos.py's default
    max_decoded_frames: int | None = None  # frames one encoded video file may hold; None: the same


class ChatImages:
    """The vision side of one served vision-language engine."""

    def __init__(self, settings: VisionSettings, tokenizer, device: str | None = None):
        engine_dir = os.path.dirname(os.path.normpath(settings.encoder_dir))
        self.limits = image_limits(settings.max_image_pixels, settings.allowed_image_url_hosts,
                                   settings.allowed_local_media_path)
        self.prompts = ImagePrompts(settings.encoder_dir, tokenizer, engine_vocab_size(engine_dir),
                                    max_num_images=settings.max_num_images, limits=self.limits,
                                    video_limits=video_limits(settings.max_num_frames, settings.max_decoded_frames),
                                    max_seq_len=engine_max_seq_len(engine_dir))
        self.runner = VisionEncoderRunner(settings.encoder_dir, device)
        self.cross_attention = self.runner.mllama  # Llama 3.2 Vision: vision states, not a table (cross_inputs)
        # Qwen towers: requests' images go to one queue that encodes whatever is pending in one forward, on a
        # CUDA stream of its own (engine/vision/encode_queue.py); fetching, decoding and the image processor
        # run on several workers, so requests that arrive together share a tower forward.
        self.tower = self.runner.encode_queue() if self.prompts.qwen else None
        self._worker = ThreadPoolExecutor(max_workers=1 if self.tower is None else QWEN_IMAGE_WORKERS,
                                          thread_name_prefix="vision_encoder")

    @property
    def placeholder(self) -> str:
        """The image placeholder of the model's prompts (``<image>`` for LLaVA)."""
        return self.prompts.placeholder

    @property
    def video_placeholder(self) -> str | None:
        """LLaVA-OneVision's ``<video>``, Qwen's ``<|video_pad|>``; None for models without video."""
        video = self.prompts.video or self.prompts.qwen_video
        return video.placeholder if video is not None else None

    def frame_request(self, media_kwargs: dict) -> FrameRequest:
        """A chat request's mm_processor_kwargs (fps / num_frames) -> its choice of a video's frames; a bad
        value is a 400 naming the field."""
        video = self.prompts.video or self.prompts.qwen_video
        limits = video.limits if video is not None else video_limits(None)
        try:
            return frame_request(media_kwargs.get("fps"), media_kwargs.get("num_frames"),
                                 ("mm_processor_kwargs.fps", "mm_processor_kwargs.num_frames"), limits)
        except VideoError as error:
            raise bad_request(error.field, str(error), code="invalid_video") from None

    def check_count(self, parts: list[dict]) -> None:
        videos = [part for part in parts if part.get("type") == "video"]
        if videos:
            if self.prompts.video is None and self.prompts.qwen_video is None:
                raise bad_request(videos[0]["field"], video_support_error(self.prompts.config).replace(
                    "video_bytes_input: ", ""), code="invalid_video")
            if len(videos) > 1 or len(videos) != len(parts):
                extra = videos[1] if len(videos) > 1 else next(p for p in parts if p.get("type") != "video")
                raise bad_request(extra["field"], "one video per request, and no images beside it"
                                  if len(videos) > 1 else VIDEO_AND_IMAGES.replace("video_bytes_input: ", ""),
                                  code="invalid_video")
            return
        if len(parts) > self.prompts.max_num_images:
            raise bad_request(parts[self.prompts.max_num_images]["field"],
                              f"{len(parts)} images were sent; allowed: at most {self.prompts.max_num_images} per "
                              "request (max_num_images of the preprocessing model; `tritonllm serve "
                              "--max_num_images`)")

    def expand(self, ids: list[int], counts: list[int], kinds: list[str] | None = None, grids=None) -> list[int]:
        """``counts``: each image's (or the video's) rows (``encode``); ``kinds``: the parts' types; ``grids``:
        ``encode``'s third value (a Qwen3-VL video's timestamps go into the prompt)."""
        seconds = grids.seconds if isinstance(grids, VideoGrid) else None
        try:
            ids = self.prompts.expand_placeholders(ids, counts, where="messages", kinds=kinds, seconds=seconds)
            self.prompts.check_crops_room(len(ids), counts, "messages")  # Gemma 3's pan-and-scan crops
            return ids
        except ValueError as error:
            raise bad_request("messages", str(error)) from None

    async def encode(self, parts: list[dict], frames: FrameRequest = FrameRequest()
                     ) -> tuple[np.ndarray, list[int], np.ndarray | None]:
        """The request's prompt-embedding table, (rows of every image, hidden) float16, each
        image's rows (their number depends on the image's size for LLaVA-NeXT/OneVision and
        Qwen2-VL) and, for Qwen2-VL, the images' (n, 3) patch grids (else None; a video's: VideoGrid).
        ``frames``: the request's choice of a video's frames (mm_processor_kwargs' fps / num_frames)."""
        loop = asyncio.get_running_loop()
        if self.tower is not None and not (parts and parts[0].get("type") == "video"):
            # Qwen: a worker fetches, decodes and processes, submits to the queue and is free again; the
            # table is awaited here, so a burst's requests are all pending in the queue at once (a worker
            # waiting for its table capped the queue's forwards at QWEN_IMAGE_WORKERS images)
            future, counts, grids = await loop.run_in_executor(self._worker, self._submit_qwen, parts)
            return (await asyncio.wrap_future(future)).numpy(), counts, grids
        return await loop.run_in_executor(self._worker, self._encode, parts, frames)

    def _encode(self, parts: list[dict], frames: FrameRequest = FrameRequest()
                ) -> tuple[np.ndarray, list[int], np.ndarray | None]:
        if parts and parts[0].get("type") == "video" and self.prompts.qwen_video is not None:
            return self._encode_qwen_video(parts[0], frames)
        if parts and parts[0].get("type") == "video":  # the request's one video (check_count)
            try:
                pixels = self.prompts.video.from_url(parts[0]["url"], parts[0]["field"], frames)
            except ValueError as error:  # VideoError/ImageError: names the part, says what is allowed
                raise bad_request(parts[0]["field"], str(error), code="invalid_video") from None
            return self.runner.tables([pixels], None, [True])[0], [self.prompts.video.rows(pixels)], None
        if self.prompts.qwen:
            future, counts, grids = self._submit_qwen(parts)
            return future.result().numpy(), counts, grids
        images = self._images(parts)
        if self.cross_attention:  # Llama 3.2 Vision: the images' vision states and their real tiles
            batch = self.prompts.image_processor(images=[images], return_tensors="np")
            states = mllama.vision_states(self.runner.encoder, self.runner.device, batch["pixel_values"][0],
                                          batch["aspect_ratio_ids"][0], batch["aspect_ratio_mask"][0])
            return states, [int(t) for t in np.asarray(batch["aspect_ratio_mask"][0]).sum(1)], None
        pixels, sizes, counts = self.prompts.pixels_and_rows(images)  # Gemma 3's crops: images of their own
        return self.runner.tables([pixels], [sizes])[0], counts, None

    def _encode_qwen_video(self, part: dict, request: FrameRequest) -> tuple[np.ndarray, list[int], "VideoGrid"]:
        """Qwen: the video's patches and grid (serving/qwen_video.py) through the tower as an image's; its
        second_per_grid_t from the file's sampled frame rate (and Qwen3-VL's frame pair timestamps) ride
        with the grid to ``expand`` and ``mrope``."""
        try:
            frames, meta = self.prompts.qwen_video.from_url(part["url"], part["field"], request)
            patches, grid, second, seconds = self.prompts.qwen_video.encode(frames, meta)
        except ValueError as error:  # VideoError/ImageError: names the part, says what is allowed
            raise bad_request(part["field"], str(error), code="invalid_video") from None
        table = self.tower.submit(patches, [grid]).result().numpy()
        return table, grid_rows(np.array([grid]), self.prompts.config["mrope"]["merge"]), VideoGrid(
            np.array([grid], np.int64), second, seconds)

    def _images(self, parts: list[dict]) -> list:
        """The parts' images, fetched and decoded; a bad one is a 400 naming its part."""
        images = []
        for part in parts:
            try:
                images.append(decode_file(url_bytes(part["url"], part["field"], self.limits), part["field"],
                                          self.limits))
            except ValueError as error:  # ImageError: names the part, says what is allowed
                raise bad_request(part["field"], str(error), code="invalid_image") from None
        return images

    def _submit_qwen(self, parts: list[dict]) -> tuple[Future, list[int], np.ndarray]:
        """Qwen: every image's patches (serving/qwen_vl.py) submitted to the queue's next forward -> (Future of
        the table, each image's rows, the grids)."""
        pixels, grids = image_patches(self.prompts.image_processor, self._images(parts))
        return self.tower.submit(pixels[0, 0], grids), grid_rows(grids, self.prompts.config["mrope"]["merge"]), grids

    def cross_inputs(self, ids: list[int], states: np.ndarray, tiles: list[int]) -> dict[str, np.ndarray]:
        """Llama 3.2 Vision: a prompt's tensorrt_llm inputs for its images (``encode``'s states and tiles), the
        mask by the processor's rule from the prompt's <|image|> ids."""
        config = self.prompts.config
        return mllama.direct_inputs(ids, states, tiles, config["image_token_index"], config["vision"]["max_num_tiles"],
                                    config["patches_per_tile"])

    def mrope(self, ids: list[int], grids: np.ndarray) -> tuple[np.ndarray, int]:
        """Qwen2-VL: a prompt's (mrope_rotary_cos_sin in the anchor's flat layout, mrope_position_delta)
        from its ids (each image's fake ids, ``expand``) and the images' grids. Images whose runs touch
        (no <|vision_start|>/<|vision_end|> between them) are a 400 naming messages."""
        from engine.vision.mrope import request_mrope

        seconds = [grids.second_per_grid] if isinstance(grids, VideoGrid) else None  # a video's time axis
        grids = grids.grids if isinstance(grids, VideoGrid) else grids
        try:
            rows, delta = request_mrope(ids, np.asarray(grids).tolist(), self.prompts.config, self.prompts.vocab_size,
                                        second_per_grid=seconds)
        except ValueError as error:
            raise bad_request("messages", str(error)) from None
        return to_wire(rows.numpy()), delta

    def close(self) -> None:
        self._worker.shutdown(wait=False, cancel_futures=True)
        if self.tower is not None:
            self.tower.close()


def text_only_error(parts: list[dict]):
    """Images sent to a model without a vision encoder."""
    return bad_request(parts[0]["field"], "this model takes no images or video (its engine has no vision encoder); send "
                                          "text only, or serve a vision-language checkpoint (LLaVA)",
                       code="invalid_image")
