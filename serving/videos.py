"""Videos as clients send them -> RGB frames, and frames -> a video's pixel values, with
per-request errors that name the input (VideoError, a ValueError).

The ways in:
- ``video_bytes_input`` (UINT8 (B, F, H, W, C)), the anchor's: per item the frames themselves,
  decoded and sampled by the client (its tools/multimodal/client.py reads the file with PyAV); or,
  beyond the anchor, an encoded file (MP4, WebM, ...) as one run of bytes shaped (1, 1, 1,
  num_bytes), trailing zero padding allowed, decoded here;
- OpenAI chat ``video_url`` parts: ``data:video/<type>;base64,...``, file: URLs under
  ``--allowed_local_media_path`` and http(s) from the allowed hosts (serving/images.py's rules).

An encoded file is decoded with PyAV (FFmpeg) and its frames sampled: by default ``max_frames``
uniformly (the anchor client's indices: ``arange(0, total, total / n)``; Qwen3-VL's processor has its
own rule, serving/qwen3_video.py); a request may ask for ``fps`` frames per second of video or
``num_frames`` frames instead (``FrameRequest``: vLLM's ``mm_processor_kwargs``, transformers' video
processor arguments), never more than ``max_frames``. Frames sent as pixels are taken as they are,
and more than ``max_frames`` of them is the request's error. Every frame is checked against the
image pixel limit (from the stream header, before decoding).

Decoding is bounded (the CPU time one request may cost): a file holding more than ``max_decoded_frames``
frames is the request's error before any frame is decoded. The count is the stream header's where it has
one (MP4, AVI), else the count of the stream's packets (WebM, MKV, MPEG-TS, MPEG-PS: one demux pass that
decodes nothing, stopped past the limit; one packet is one frame for the codecs these carry, and the
container's duration x rate is not: an MPEG-PS file of 11 frames at 8 fps says 1 s). The frames are then
decoded once, up to the last one chosen; a file whose header understates its packets stops at the limit.
Frames chosen sparsely (far apart next to the keyframe spacing) are reached by seeking instead: to the
keyframe at or before each run of nearby chosen frames, then forward to the exact frame, identified by its
pts (frame i's pts is the i-th smallest of the packets' pts, where every packet has a distinct one and they
count the frames); a seek that lands anywhere but that keyframe (MPEG-PS lands earlier), or a frame not
found there, falls back to the sequential decode, so the frames are the same either way.

``VideoFrames``: frames (F, H, W, 3) uint8 -> pixel values (F, 3, h, w) float32 exactly as
transformers' LlavaOnevisionVideoProcessor makes them (its torchvision path: bicubic resize with
antialias on the uint8 frames, then (x - mean / r) / (std / r) with r the rescale factor), from the
settings engine.build writes (engine/vision/onevision_video.py). Done here in torch because
transformers' video processors need torchvision, which these machines may lack.
"""
from __future__ import annotations

import bisect
import io
import math
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from serving.images import ImageLimits, url_bytes

VIDEO_MEDIA_TYPES = ("video/mp4", "video/webm", "video/quicktime", "video/x-matroska", "video/mpeg",
                     "video/x-msvideo", "video/avi", "image/gif")
DEFAULT_MAX_NUM_FRAMES = 32  # per video (vLLM's default frame count for video inputs)
DEFAULT_MAX_VIDEO_BYTES = 64 * 1024 * 1024  # one encoded video file (or URL download)
DEFAULT_MAX_DECODED_FRAMES = 7200  # frames of one encoded video file: 4 minutes at 30 fps, 5 at 24
RESAMPLE_MODES = {2: "bilinear", 3: "bicubic"}  # PIL's resample numbers a video processor config names


class VideoError(ValueError):
    """A request's video cannot be used; the message names the input and what is allowed (``field``: the
    request field at fault, where one is)."""

    def __init__(self, message: str, field: str | None = None):
        super().__init__(message)
        self.field = field


@dataclass(frozen=True)
class VideoLimits:
    max_frames: int = DEFAULT_MAX_NUM_FRAMES  # frames of one video (sampled down to it from a file)
    max_bytes: int = DEFAULT_MAX_VIDEO_BYTES
    max_decoded_frames: int = DEFAULT_MAX_DECODED_FRAMES  # frames an encoded file may hold (decoding work)


def video_limits(max_num_frames: int | None, max_decoded_frames: int | None = None) -> VideoLimits:
    """preprocessing's max_num_frames and max_decoded_frames (unset: the defaults)."""
    return VideoLimits(max_frames=max_num_frames or DEFAULT_MAX_NUM_FRAMES,
                       max_decoded_frames=max_decoded_frames or DEFAULT_MAX_DECODED_FRAMES)


def _check_frames(name: str, count: int, limits: VideoLimits) -> None:
    if count > limits.max_frames:
        raise VideoError(f"{name} holds {count} frames; allowed: at most {limits.max_frames} per video "
                         "(max_num_frames of the preprocessing model; `tritonllm serve --max_num_frames`); "
                         "sample fewer frames, or send the encoded file to have them sampled")


ASSUMED_FPS = 24.0  # a video's rate when it does not say (transformers' VideoMetadata default)
MAX_REQUEST_FPS = 240.0  # the highest frame rate a request may ask to sample at


@dataclass(frozen=True)
class FrameRequest:
    """A request's own choice of an encoded video's frames: ``fps`` frames per second of video, or
    ``num_frames`` frames over the whole video (at most one of them); neither: the model's default."""
    fps: float | None = None
    num_frames: int | None = None

    def __bool__(self) -> bool:
        return self.fps is not None or self.num_frames is not None


def frame_request(fps, num_frames, fields: tuple[str, str], limits: VideoLimits) -> FrameRequest:
    """A request's ``fps`` / ``num_frames`` (None: not given), ``fields`` their names in the request
    (mm_processor_kwargs.fps / .num_frames on the OpenAI path, video_fps / video_num_frames on the Triton
    models), checked; a bad value is a VideoError naming its field, what was wrong and what is allowed."""
    fps_field, count_field = fields
    if fps is not None and num_frames is not None:
        raise VideoError(f"{fps_field} and {count_field} were both given; give one of them ({fps_field}: frames per "
                         f"second of video to sample; {count_field}: how many frames to sample over the whole video)",
                         fps_field)
    if fps is not None and (isinstance(fps, bool) or not isinstance(fps, (int, float)) or not math.isfinite(fps)
                            or not 0 < fps <= MAX_REQUEST_FPS):
        raise VideoError(f"{fps_field} is {fps!r}; allowed: a number of frames per second above 0 and at most "
                         f"{MAX_REQUEST_FPS:g}", fps_field)
    if num_frames is not None and (isinstance(num_frames, bool) or not isinstance(num_frames, int)
                                   or not 1 <= num_frames <= limits.max_frames):
        raise VideoError(f"{count_field} is {num_frames!r}; allowed: an integer from 1 to {limits.max_frames} "
                         "(max_num_frames of the preprocessing model; `tritonllm serve --max_num_frames`)",
                         count_field)
    return FrameRequest(None if fps is None else float(fps), num_frames)


def requested_count(total: int, source_fps: float | None, request: FrameRequest, default: int) -> int:
    """How many of ``total`` frames to sample: the request's num_frames, or its fps times the video's
    length (``int(total / source_fps * fps)``, as transformers' sample_frames, the rate ASSUMED_FPS when
    the video does not say), else ``default``; at least 1."""
    if request.num_frames is not None:
        return request.num_frames
    if request.fps is not None:
        return max(1, int(total / (source_fps or ASSUMED_FPS) * request.fps))
    return default


def sample_indices(total: int, count: int) -> list[int]:
    """``count`` frame indices spread uniformly over ``total`` frames (all of them when fewer)."""
    if total <= count:
        return list(range(total))
    return np.arange(0, total, total / count).astype(int)[:count].tolist()


def uniform_sampler(limits: VideoLimits, request: FrameRequest = FrameRequest()) -> Callable:
    """The default choice of frames: (total, source fps) -> indices, ``max_frames`` of them (or what the
    request asks, never more) spread uniformly (the anchor client's indices)."""
    def choose(total: int, source_fps: float | None) -> list[int]:
        return sample_indices(total, min(requested_count(total, source_fps, request, limits.max_frames),
                                         limits.max_frames))
    return choose


def decode_video(data: bytes, name: str, limits: VideoLimits, image_limits: ImageLimits,
                 meta: dict | None = None, sampler: Callable | None = None) -> np.ndarray:
    """An encoded video file -> (F, H, W, 3) uint8 RGB frames, chosen by ``sampler`` ((total frames, the
    stream's fps or None) -> sorted indices; default ``uniform_sampler(limits)``). ``meta``, when given,
    gets "fps": the sampled frames' rate, F / total * the stream's, as transformers'
    VideoMetadata.sampled_fps (None when the stream does not say), "source_fps" (the stream's, or None)
    "indices" (the frames taken) and "decoded_frames" (how many frames were decoded to take them). Decoded
    once up to the last frame taken, or by seeking where the frames taken are sparse; a file of more than
    ``limits.max_decoded_frames`` frames is a VideoError before decoding (the module's docstring)."""
    import av

    sampler = sampler or uniform_sampler(limits)

    if len(data) > limits.max_bytes:
        raise VideoError(f"{name} is {len(data)} bytes; allowed: at most {limits.max_bytes}")
    try:
        with av.open(io.BytesIO(data)) as container:
            if not container.streams.video:
                raise VideoError(f"{name} holds no video stream")
            stream = container.streams.video[0]
            width, height = stream.codec_context.width, stream.codec_context.height
            if width * height > image_limits.max_pixels:
                raise VideoError(f"{name}'s frames are {width}x{height} = {width * height} pixels; allowed: at most "
                                 f"{image_limits.max_pixels} pixels (max_image_pixels of the preprocessing model)")
            packets = None if stream.frames else _index_packets(container, stream, limits.max_decoded_frames)
            if packets is not None and packets.count > limits.max_decoded_frames:
                raise VideoError(_too_many_frames(name, f"holds more than {limits.max_decoded_frames} frames", limits))
            total = stream.frames or packets.count  # the header's count, else the packets'
            if total > limits.max_decoded_frames:
                raise VideoError(_too_many_frames(name, f"holds {total} frames", limits))
            rate = stream.average_rate or stream.guessed_rate
            source_fps = float(rate) if rate else None
            indices = sampler(total, source_fps) if total else []
            wanted = set(indices)
            if meta is not None:
                meta["fps"] = len(wanted) / total * source_fps if source_fps and total else None
                meta["source_fps"], meta["indices"] = source_fps, sorted(wanted)
            frames, decoded = None, 0
            if wanted and max(wanted) + 1 > 2 * len(wanted):  # seeking may pay: see what the keyframes say
                if packets is None:
                    packets = _index_packets(container, stream, limits.max_decoded_frames)
                plan, cost = _seek_plan(packets, total, sorted(wanted))
                if plan:
                    frames, decoded = _seek_frames(container, stream, plan, cost)
            if frames is None:  # not sparse, not told by pts, or a seek that missed: from the start
                container.seek(0)
                frames, sequential = _decode_frames(container, stream, wanted, name, limits)
                decoded += sequential
            if meta is not None:
                meta["decoded_frames"] = decoded
    except av.FFmpegError as error:
        raise VideoError(f"{name} cannot be decoded as a video ({error}); send an MP4, WebM or other file "
                         "FFmpeg reads, or the frames as (frames, height, width, 3) uint8 pixels") from None
    if not frames:
        raise VideoError(f"{name} holds no frames")
    return np.stack(frames)


def _too_many_frames(name: str, what: str, limits: VideoLimits) -> str:
    return (f"{name} {what}; allowed: at most {limits.max_decoded_frames} frames in a video file "
            "(max_decoded_frames of the preprocessing model; `tritonllm serve --max_decoded_frames`); "
            "send a shorter video, one at a lower frame rate, or frames sampled from it")


@dataclass(frozen=True)
class _PacketIndex:
    """A video stream's packets from one demux pass (nothing decoded; the size-0 packet at the end only
    flushes the decoder and is left out)."""
    count: int  # packets with data: the stream's frames for the codecs these containers carry
    pts: list  # each packet's pts in demux order, None where it has none
    keyframe_pts: list  # the keyframes' pts


def _index_packets(container, stream, limit: int) -> _PacketIndex:
    """The stream's packets, demuxed without decoding; the pass stops past ``limit`` (its count then
    limit + 1)."""
    count, pts, keyframe_pts = 0, [], []
    for packet in container.demux(stream):
        if packet.size == 0:
            continue
        count += 1
        if count > limit:
            break
        pts.append(packet.pts)
        if packet.is_keyframe:
            keyframe_pts.append(packet.pts)
    return _PacketIndex(count, pts, keyframe_pts)


def _seek_plan(packets: _PacketIndex, total: int, indices: list[int]) -> tuple[list[tuple[int, int | None]], int]:
    """How to reach frames ``indices`` (sorted) by seeking: per frame (its pts, the keyframe pts to seek
    to first, or None to decode on from the frame before), and how many frames that decodes. The plan is
    empty where the frames cannot be told by pts (a packet without one, two alike, packets not counting
    the ``total`` frames) or where seeking would decode more than half the frames the sequential decode
    would (up to the last index)."""
    if packets.count != total or None in packets.pts or len(set(packets.pts)) != total:
        return [], 0
    ordered = sorted(packets.pts)  # frame i (presentation order) has the i-th smallest pts
    keyframes = sorted(bisect.bisect_left(ordered, pts) for pts in packets.keyframe_pts)  # their frame indices
    plan, position, cost = [], -1, 0  # position: the last frame decoded
    for index in indices:
        at = bisect.bisect_right(keyframes, index) - 1
        if at < 0:
            return [], 0  # no keyframe before it: only decoding from the start reaches it
        keyframe = keyframes[at]
        if keyframe > position:  # a keyframe past where decoding stands: seek to it
            plan.append((ordered[index], ordered[keyframe]))
            cost += index - keyframe + 1
        else:
            plan.append((ordered[index], None))
            cost += index - position
        position = index
    return (plan, cost) if 2 * cost <= indices[-1] + 1 else ([], 0)


def _frames_after_seek(container, stream, keyframe_pts: int):
    """The stream's frames decoded from a seek to the keyframe at ``keyframe_pts``; none when the seek lands
    on any other packet (MPEG-PS lands earlier, mid-GOP)."""
    container.seek(keyframe_pts, stream=stream, backward=True, any_frame=False)
    first = True
    for packet in container.demux(stream):
        if first and packet.size:
            if packet.pts != keyframe_pts or not packet.is_keyframe:
                return
            first = False
        yield from packet.decode()


def _seek_frames(container, stream, plan, cost: int) -> tuple[list[np.ndarray] | None, int]:
    """The frames of ``plan`` (_seek_plan's) as (H, W, 3) uint8 RGB, by seeking, and how many frames were
    decoded; the frames are None (fall back to the sequential decode) when a seek lands elsewhere, the
    decoder does not take the frame landed on for a keyframe (a container that flags frames as keyframes
    that are not: decoding on from one gives broken frames), a frame's pts is not found where it should
    be, or more than the plan's ``cost`` frames would be decoded (so this way decodes at most half what
    the sequential decode would)."""
    frames, decoding, decoded = [], None, 0
    try:
        for pts, keyframe_pts in plan:
            if keyframe_pts is not None:
                if decoding is not None:
                    decoding.close()
                decoding = _frames_after_seek(container, stream, keyframe_pts)
            for frame in decoding:
                decoded += 1
                if decoded > cost:
                    return None, decoded
                if keyframe_pts is not None:  # the first frame after this seek
                    if frame.pts != keyframe_pts or not frame.key_frame:
                        return None, decoded
                    keyframe_pts = None
                if frame.pts is None or frame.pts >= pts:
                    break
            else:
                return None, decoded
            if frame.pts != pts:
                return None, decoded
            frames.append(frame.to_ndarray(format="rgb24"))
        return frames, decoded
    finally:
        if decoding is not None:
            decoding.close()


def _decode_frames(container, stream, wanted: set[int], name: str,
                   limits: VideoLimits) -> tuple[list[np.ndarray], int]:
    """The frames at ``wanted`` indices as (H, W, 3) uint8 RGB, decoding from the start up to the last of
    them, and how many frames were decoded. At most ``max_decoded_frames`` packets are decoded: more is a
    VideoError (a header that understated its frames; an honest count is at most the limit, checked before)."""
    frames, index, packets = [], 0, 0
    if not wanted:
        return frames, 0
    for packet in container.demux(stream):
        packets += packet.size > 0
        if packets > limits.max_decoded_frames:
            raise VideoError(_too_many_frames(name, f"decodes to more than {limits.max_decoded_frames} frames "
                                              f"(its header says {stream.frames})", limits))
        for frame in packet.decode():
            if index in wanted:
                frames.append(frame.to_ndarray(format="rgb24"))
                if len(frames) == len(wanted):
                    return frames, index + 1
            index += 1
    return frames, index


def is_video_file(item: np.ndarray) -> bool:
    """Whether one item of video_bytes_input is an encoded file, (1, 1, 1, num_bytes), rather than frames."""
    return item.ndim == 4 and item.shape[:3] == (1, 1, 1) and item.shape[3] > 4


def frames_from_bytes(item: np.ndarray, limits: VideoLimits, image_limits: ImageLimits,
                      name: str = "video_bytes_input", meta: dict | None = None,
                      sampler: Callable | None = None) -> np.ndarray:
    """One item of video_bytes_input -> (F, H, W, 3) uint8 frames: (F, H, W, 3) (or (F, 3, H, W))
    pixels, or an encoded file as (1, 1, 1, num_bytes) (``sampler`` and ``meta``: decode_video's)."""
    item = np.asarray(item, dtype=np.uint8)
    if is_video_file(item):
        return decode_video(item.reshape(-1).tobytes(), name, limits, image_limits, meta, sampler)
    if item.ndim != 4:
        raise VideoError(f"{name} has shape {item.shape}; send (frames, height, width, 3) uint8 pixels, or an "
                         "encoded file as (1, 1, 1, num_bytes)")
    if item.shape[-1] != 3 and item.shape[1] == 3:
        item = np.moveaxis(item, 1, -1)
    if item.shape[-1] != 3:
        raise VideoError(f"{name} has shape {item.shape}: no channel dimension of 3; send (frames, height, width, 3) "
                         "RGB pixels")
    _check_frames(name, len(item), limits)
    frames, height, width = item.shape[:3]
    if width * height > image_limits.max_pixels:
        raise VideoError(f"{name}'s frames are {width}x{height} = {width * height} pixels; allowed: at most "
                         f"{image_limits.max_pixels} pixels (max_image_pixels of the preprocessing model)")
    if not frames:
        raise VideoError(f"{name} holds no frames")
    return item


def video_from_url(url: str, name: str, limits: VideoLimits, image_limits: ImageLimits,
                   meta: dict | None = None, sampler: Callable | None = None) -> np.ndarray:
    """A data:, file: or http(s) URL of an encoded video (serving/images.py's URL rules) -> frames."""
    data = url_bytes(url, name, replace(image_limits, max_bytes=limits.max_bytes), media_types=VIDEO_MEDIA_TYPES)
    return decode_video(data, name, limits, image_limits, meta, sampler)


class VideoFrames:
    """A video processor's settings (onevision_video.video_processor_settings) -> pixel values."""

    def __init__(self, settings: dict):
        size = settings["size"]
        if settings.get("do_center_crop") or (settings["do_resize"] and not {"height", "width"} <= set(size)):
            raise ValueError(f"video processor settings {settings} are not supported: resize to "
                             "size {height, width} without center crop is")
        if settings["do_resize"] and settings["resample"] not in RESAMPLE_MODES:
            raise ValueError(f"video processor resample {settings['resample']} is not supported; supported: "
                             f"{', '.join(f'{k} ({v})' for k, v in RESAMPLE_MODES.items())}")
        self.settings = settings
        self.size = (size["height"], size["width"]) if settings["do_resize"] else None

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """(F, H, W, 3) uint8 -> (F, 3, h, w) float32."""
        import torch
        import torch.nn.functional as F

        s = self.settings
        video = torch.from_numpy(np.ascontiguousarray(frames)).permute(0, 3, 1, 2).contiguous()  # (F, 3, H, W)
        if self.size is not None and tuple(video.shape[-2:]) != self.size:
            mode = RESAMPLE_MODES[s["resample"]]
            # torchvision's resize on the CPU: bicubic (and bilinear with AVX2) interpolate the uint8
            # frames themselves; else through float32, rounded (and for bicubic clamped) back to uint8
            if mode == "bicubic" or "AVX2" in torch.backends.cpu.get_cpu_capability():
                video = F.interpolate(video, size=list(self.size), mode=mode, align_corners=False, antialias=True)
            else:
                video = F.interpolate(video.float(), size=list(self.size), mode=mode, align_corners=False,
                                      antialias=True).round_().to(torch.uint8)
        video = video.to(torch.float32)
        if s["do_rescale"] and s["do_normalize"]:  # transformers fuses them: mean and std scaled by 1 / r
            mean = torch.tensor(s["image_mean"]) * (1.0 / s["rescale_factor"])
            std = torch.tensor(s["image_std"]) * (1.0 / s["rescale_factor"])
            video = (video - mean[:, None, None]) / std[:, None, None]
        elif s["do_normalize"]:
            video = (video - torch.tensor(s["image_mean"])[:, None, None]) / torch.tensor(s["image_std"])[:, None, None]
        elif s["do_rescale"]:
            video = video * s["rescale_factor"]
        return video.numpy()
