"""LLaVA-NeXT's "anyres" layout of one image's features (LLaVA-OneVision's too, plus its size cap).

The image processor resizes an image of (height, width) to the best of the checkpoint's
``image_grid_pinpoints`` (``best_resolution``), pads it, and cuts it into a grid of tiles of the
tower's resolution S; the image resized to S x S comes first (the base tile). The tower and the
projector turn each tile into p x p feature rows (p = S / patch size). The image's features are
then, in order:

- the base tile's p * p rows;
- the grid's rows laid out as one (grid_h * p) x (grid_w * p) feature map, the padding rows or
  columns cut off again (``unpadded_shape``), shrunk bilinearly when OneVision's ``anyres_max_N``
  cap is exceeded by more than 10%, with the ``image_newline`` vector after each row.

An image without a grid (one tile: OneVision's images in a multi-image request) is its p * p rows
and one newline. ``token_count`` gives the length without running anything (the preprocessing
lays out the prompt with it); ``pack`` builds the rows (the encoder). Both follow transformers'
LlavaNextModel/LlavaOnevisionModel.pack_image_features and their processors' feature counts.
The counting half imports no torch: the preprocessing model's stub uses it (serving/multimodal.py).
"""
from __future__ import annotations

import math
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

ONEVISION_MODEL_TYPE = "llava_onevision"  # builder_config.model_type, as the anchor names it


def best_resolution(image_size: tuple[int, int], pinpoints: list[list[int]]) -> tuple[int, int]:
    """The (height, width) of ``pinpoints`` the image is resized into: the most of its pixels kept
    (the image scaled to fit), then the least padding."""
    height, width = image_size
    best, best_kept, best_waste = None, 0, math.inf
    for h, w in pinpoints:
        scale = min(w / width, h / height)
        kept = min(int(width * scale) * int(height * scale), width * height)
        waste = h * w - kept
        if kept > best_kept or (kept == best_kept and waste < best_waste):
            best, best_kept, best_waste = (h, w), kept, waste
    return best


def grid_shape(image_size: tuple[int, int], pinpoints: list[list[int]], tile: int) -> tuple[int, int]:
    """(rows, columns) of tiles of side ``tile`` the image is cut into (base tile not counted)."""
    h, w = best_resolution(image_size, pinpoints)
    return h // tile, w // tile


def num_tiles(image_size: tuple[int, int], pinpoints: list[list[int]], tile: int) -> int:
    """Tiles the processor makes of the image: the grid's and the base tile."""
    rows, columns = grid_shape(image_size, pinpoints, tile)
    return rows * columns + 1


def unpadded_shape(image_size: tuple[int, int], height: int, width: int) -> tuple[int, int]:
    """A (height, width) feature map of the padded image -> the map of the image itself: the
    padding the processor added on the long side's two ends cut off (in feature rows/columns)."""
    original_height, original_width = image_size
    if original_width / original_height > width / height:
        new_height = int(round(original_height * (width / original_width), 7))
        return height - 2 * ((height - new_height) // 2), width
    new_width = int(round(original_width * (height / original_height), 7))
    return height, width - 2 * ((width - new_width) // 2)


def capped_shape(height: int, width: int, side: int, max_tiles: int | None) -> tuple[int, int]:
    """OneVision's ``anyres_max_N``: a map of more than N tiles' rows (by over 10%) is shrunk to about N."""
    if max_tiles is None:
        return height, width
    ratio = math.sqrt(height * width / (max_tiles * side ** 2))
    return (int(height // ratio), int(width // ratio)) if ratio > 1.1 else (height, width)


def token_count(image_size: tuple[int, int], pinpoints: list[list[int]], tile: int, side: int,
                max_tiles: int | None = None, tiled: bool = True) -> int:
    """Feature rows of one image of (height, width) = ``image_size``: ``side`` x ``side`` per tile."""
    if not tiled:
        return side * side + 1
    rows, columns = grid_shape(image_size, pinpoints, tile)
    height, width = capped_shape(*unpadded_shape(image_size, rows * side, columns * side), side, max_tiles)
    return side * side + height * width + height  # base tile, the map, a newline per map row


def is_tiled(model_type: str, images_in_request: int) -> bool:
    """Whether an image is cut into tiles: always for LLaVA-NeXT; for OneVision only when it is the
    request's only image (several images get one tile each, as its processor and model do)."""
    return model_type != ONEVISION_MODEL_TYPE or images_in_request == 1


def image_token_counts(config: dict, image_sizes, num_images: int) -> list[int]:
    """Rows of each of a request's ``num_images`` images (``config``: the vision-encoder directory's
    config.json; ``image_sizes``: each image's (height, width) before processing, which the anyres
    families need). A missing size is the request's error (ValueError naming image_sizes_input)."""
    if "anyres" not in config or not num_images:  # (a text-only request needs no sizes)
        return [config["num_image_tokens"]] * num_images
    model_type = config["builder_config"]["model_type"]
    if image_sizes is None or len(image_sizes) != num_images:
        raise ValueError(f"{model_type} images need their sizes (image_sizes_input: (height, width) per image "
                         f"before processing); got {0 if image_sizes is None else len(image_sizes)} for "
                         f"{num_images} image(s)")
    layout, tiled = config["anyres"], is_tiled(model_type, num_images)
    return [token_count(tuple(int(v) for v in size), layout["pinpoints"], layout["tile"], layout["side"],
                        layout["max_tiles"], tiled) for size in image_sizes]


def pack(tiles: torch.Tensor, image_size: tuple[int, int], pinpoints: list[list[int]], tile: int,
         newline: torch.Tensor, max_tiles: int | None = None) -> torch.Tensor:
    """One image's projected tile features (num_tiles, side * side, hidden), base tile first ->
    its rows (token_count, hidden)."""
    import torch
    import torch.nn.functional as F

    side = math.isqrt(tiles.shape[1])
    if tiles.shape[0] == 1:
        return torch.cat([tiles[0], newline[None].to(tiles.dtype)])
    rows, columns = grid_shape(image_size, pinpoints, tile)
    # (rows * columns, side, side, hidden) -> one (hidden, rows * side, columns * side) map
    grid = tiles[1:].view(rows, columns, side, side, -1).permute(4, 0, 2, 1, 3).flatten(1, 2).flatten(2, 3)
    height, width = unpadded_shape(image_size, grid.shape[1], grid.shape[2])
    top, left = (grid.shape[1] - height) // 2, (grid.shape[2] - width) // 2
    grid = grid[:, top:top + height, left:left + width]
    capped = capped_shape(height, width, side, max_tiles)
    if capped != (height, width):
        grid = F.interpolate(grid[None], list(capped), mode="bilinear")[0]
    grid = torch.cat([grid, newline[:, None, None].to(grid.dtype).expand(-1, grid.shape[1], 1)], dim=2)
    return torch.cat([tiles[0], grid.flatten(1, 2).transpose(0, 1)])
