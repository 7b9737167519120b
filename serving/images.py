"""Images as clients send them -> RGB PIL images, with per-request errors that name the input.

The ways in (the anchor's ensemble inputs):
- ``image_bytes_input`` (UINT8 (B, n, d1, d2, d3)): per image either raw pixels, (H, W, C) or
  (C, H, W) with C in 1, 3, 4 (what NVIDIA's clients send), or an encoded file (PNG, JPEG, ...) as
  one run of bytes, shaped (1, 1, num_bytes) (trailing zero padding allowed);
- ``image_url_input`` (STRING (B, k)): ``data:image/<type>;base64,...`` URLs, and http(s) URLs
  fetched with a timeout when the preprocessing model allows them (``allowed_image_url_hosts``).

Every image is checked against the pixel limit before it is decoded in full (Pillow reads the
size from the header), and files against the byte limit. Failures are ImageError (a ValueError).
"""
from __future__ import annotations

import base64
import binascii
import io
import urllib.parse
import urllib.request
from dataclasses import dataclass

import numpy as np

# Pillow formats accepted in encoded files and data: URLs (what the major VLM APIs take).
SUPPORTED_FORMATS = ("PNG", "JPEG", "WEBP", "GIF", "BMP")
SUPPORTED_MEDIA_TYPES = tuple(f"image/{name.lower()}" for name in SUPPORTED_FORMATS) + ("image/jpg",)


class ImageError(ValueError):
    """A request's image cannot be used; the message names the input and what is allowed."""


@dataclass(frozen=True)
class ImageLimits:
    max_pixels: int = 4096 * 4096  # width x height of one image
    max_bytes: int = 20 * 1024 * 1024  # one encoded file (or URL download)
    url_timeout_s: float = 10.0
    # http(s) URLs: None refuses them all; () allows any host; else only these hosts.
    allowed_url_hosts: tuple[str, ...] | None = None
    # file: URLs (the OpenAI frontend's --allowed_local_media_path): only files under this directory
    # (symbolic links resolved first); None refuses them.
    local_media_dir: str | None = None


def _check_pixels(name: str, width: int, height: int, limits: ImageLimits) -> None:
    if width * height > limits.max_pixels:
        raise ImageError(f"{name} is {width}x{height} = {width * height} pixels; allowed: at most "
                         f"{limits.max_pixels} pixels (max_image_pixels of the preprocessing model)")


def decode_file(data: bytes, name: str, limits: ImageLimits):
    """An encoded image file -> RGB PIL image."""
    from PIL import Image, UnidentifiedImageError

    if len(data) > limits.max_bytes:
        raise ImageError(f"{name} is {len(data)} bytes; allowed: at most {limits.max_bytes}")
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{name} cannot be decoded as an image; supported formats: "
                         f"{', '.join(SUPPORTED_FORMATS)}") from None
    if image.format not in SUPPORTED_FORMATS:
        raise ImageError(f"{name} is a {image.format} image, which is not supported; supported formats: "
                         f"{', '.join(SUPPORTED_FORMATS)}")
    _check_pixels(name, *image.size, limits)
    try:
        image.load()
    except (OSError, SyntaxError, ValueError) as error:  # a truncated or corrupt file
        raise ImageError(f"{name} cannot be decoded as an image ({error})") from None
    return image.convert("RGB")


def from_pixels(pixels: np.ndarray, name: str, limits: ImageLimits):
    """Raw uint8 pixels (H, W, C) or (C, H, W), C in 1, 3, 4 -> RGB PIL image."""
    from PIL import Image

    if pixels.ndim != 3:
        raise ImageError(f"{name} has shape {pixels.shape}; send (H, W, C) or (C, H, W) pixels, or an encoded file "
                         "as (1, 1, num_bytes)")
    if pixels.shape[-1] not in (1, 3, 4) and pixels.shape[0] in (1, 3, 4):
        pixels = np.moveaxis(pixels, 0, -1)
    if pixels.shape[-1] not in (1, 3, 4):
        raise ImageError(f"{name} has shape {pixels.shape}: no channel dimension of 1, 3 or 4; send (H, W, C) or "
                         "(C, H, W) pixels")
    _check_pixels(name, pixels.shape[1], pixels.shape[0], limits)
    mode = {1: "L", 3: "RGB", 4: "RGBA"}[pixels.shape[-1]]
    return Image.fromarray(np.ascontiguousarray(pixels.squeeze(-1) if mode == "L" else pixels), mode).convert("RGB")


def images_from_bytes(row: np.ndarray, limits: ImageLimits) -> list:
    """One item of image_bytes_input, (n, d1, d2, d3) -> n RGB images."""
    images = []
    for index, item in enumerate(np.asarray(row, dtype=np.uint8)):
        name = f"image_bytes_input image {index}"
        if item.ndim == 3 and item.shape[0] == item.shape[1] == 1:  # an encoded file
            images.append(decode_file(item.reshape(-1).tobytes(), name, limits))
        else:
            images.append(from_pixels(item, name, limits))
    return images


def url_bytes(url: str, name: str, limits: ImageLimits, media_types: tuple[str, ...] = SUPPORTED_MEDIA_TYPES) -> bytes:
    """The file behind a data:, http(s) or (with ``limits.local_media_dir``) file: URL (``media_types``:
    a data: URL's allowed ones; serving/videos.py passes video types)."""
    scheme = urllib.parse.urlsplit(url).scheme.lower()
    if scheme == "data":
        return _data_url_bytes(url, name, media_types)
    if scheme == "file":
        return _local_file_bytes(url, name, limits)
    if scheme not in ("http", "https"):
        raise ImageError(f"{name}: URL scheme {scheme or '(none)'!r} is not allowed; send a data: URL "
                         "(data:image/png;base64,...) or an http(s) URL")
    host = urllib.parse.urlsplit(url).hostname or ""
    if limits.allowed_url_hosts is None or (limits.allowed_url_hosts and host not in limits.allowed_url_hosts):
        allowed = ("none: this server fetches no http(s) URLs (preprocessing parameter allowed_image_url_hosts)"
                   if not limits.allowed_url_hosts else ", ".join(limits.allowed_url_hosts))
        raise ImageError(f"{name}: fetching images from host {host!r} is not allowed; allowed hosts: {allowed}; "
                         "or send the image itself (a data: URL or image_bytes_input)")
    try:
        with urllib.request.urlopen(url, timeout=limits.url_timeout_s) as response:
            data = response.read(limits.max_bytes + 1)
    except (OSError, ValueError) as error:  # urllib's URLError/HTTPError are OSErrors; timeouts too
        raise ImageError(f"{name}: fetching {url} failed ({error})") from None
    return data


def _local_file_bytes(url: str, name: str, limits: ImageLimits) -> bytes:
    """A file: URL's file, when it lies under ``limits.local_media_dir``."""
    import os

    if limits.local_media_dir is None:
        raise ImageError(f"{name}: URL scheme 'file' is not allowed on this server (start the OpenAI frontend "
                         "with --allowed_local_media_path DIR to read images under DIR); send a data: URL")
    parts = urllib.parse.urlsplit(url)
    if parts.netloc not in ("", "localhost"):
        raise ImageError(f"{name}: a file: URL names a file on this machine (file:///path); got host {parts.netloc!r}")
    path = os.path.realpath(urllib.parse.unquote(parts.path))
    root = os.path.realpath(limits.local_media_dir)
    if os.path.commonpath([path, root]) != root:
        raise ImageError(f"{name}: {path} is outside the directory images may be read from ({root}, "
                         "--allowed_local_media_path)")
    try:
        with open(path, "rb") as f:
            return f.read(limits.max_bytes + 1)
    except OSError as error:
        raise ImageError(f"{name}: reading {path} failed ({error.strerror})") from None


def _data_url_bytes(url: str, name: str, media_types: tuple[str, ...] = SUPPORTED_MEDIA_TYPES) -> bytes:
    header, comma, payload = url.partition(",")
    if not comma:
        raise ImageError(f"{name}: a data: URL needs a comma before its data (data:image/png;base64,...)")
    media_type, *params = header[len("data:"):].split(";")
    media_type = media_type.strip().lower() or "text/plain"
    if media_type not in media_types:
        raise ImageError(f"{name}: data URL media type {media_type!r} is not supported; supported: "
                         f"{', '.join(media_types)}")
    if "base64" in (p.strip().lower() for p in params):
        try:
            return base64.b64decode(payload, validate=True)
        except (binascii.Error, ValueError):
            raise ImageError(f"{name}: the data URL's base64 payload is not valid base64") from None
    return urllib.parse.unquote_to_bytes(payload)


def images_from_urls(urls: list[str], limits: ImageLimits) -> list:
    return [decode_file(url_bytes(url, f"image_url_input {index}", limits), f"image_url_input {index}", limits)
            for index, url in enumerate(urls)]
