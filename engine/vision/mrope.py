"""M-RoPE (Qwen2-VL's multimodal rotary positions): each prompt token has three positions,
(temporal, height, width), and each of the head's frequency sections rotates by one of them.

``rope_positions(ids, image_rows, grids, merge)``: a prompt's (3, L) positions and its
``mrope_position_delta`` (the position after the prompt minus L). Text tokens count up, all three
equal; an image's rows take (start, start + row, start + column) over its merged (h / merge) x
(w / merge) grid (start + frame for the temporal one; a Qwen2.5-VL video's frame pairs stepped by
tokens_per_second * second_per_grid_t), and the text after it resumes at start + max(h, w) / merge. Generated
token i (0-based, after a prompt of L tokens) is at L + i + delta in all three: a plain rotary
position. That is the whole hook the engine needs: every token whose three positions are equal
(all text, every decode step) rotates as ordinary RoPE at that position, and only image rows need
rows of their own (``mrope_cos_sin``), which the anchor's ``mrope_rotary_cos_sin`` input carries.

``mrope_cos_sin(positions, head_dim, theta, sections, interleaved)``: (L, head_dim) cos and sin, as
transformers' Qwen2VLRotaryEmbedding: frequency block j of ``sections`` (e.g. [16, 24, 24] of
head_dim / 2) takes position row j % 3, then the halves repeat (rotate_half pairing). Qwen3-VL
(``interleaved``, its Qwen3VLTextRotaryEmbedding) deals the frequencies out in turn instead:
frequency i takes the height row when i % 3 == 1 and i < 3 * sections[1], the width row when
i % 3 == 2 and i < 3 * sections[2], the temporal row otherwise (e.g. [24, 20, 20]: t h w t h w ...
then t alone for the last four).
"""
from __future__ import annotations

import torch


def rope_positions(ids: list[int], image_token_id: int, grids: list[list[int]], merge: int,
                   time_intervals: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
    """(positions (3, len(ids)) int64, mrope_position_delta). ``ids`` holds each image's rows as one
    run of ``image_token_id`` (Qwen2-VL's prompts put <|vision_start|> and <|vision_end|> around
    each), the images in ``grids`` order ((t, h, w) patch grids). ``time_intervals``: per grid, None
    for an image, or a video's temporal step (Qwen2.5-VL: tokens_per_second * second_per_grid_t; its
    frame k at start + int(k * step), as transformers' get_vision_position_ids in float32). A run whose
    length is not its grid's rows is a ValueError."""
    pieces, position, index, grids_left = [], 0, 0, iter(grids)
    steps = iter(time_intervals or [])
    while index < len(ids):
        image, end = ids[index] == image_token_id, index
        while end < len(ids) and (ids[end] == image_token_id) == image:
            end += 1
        if image:
            t, h, w = next(grids_left, (0, 0, 0))
            rows, columns = h // merge, w // merge
            if t * rows * columns != end - index:
                raise ValueError(f"an image placeholder run of {end - index} tokens at position {index} does not "
                                 f"match its grid {(t, h, w)} ({t * rows * columns} rows after {merge}x{merge} merging)")
            step = next(steps, None)
            frames = torch.arange(t)
            if step is not None:  # transformers multiplies in float32, then truncates
                frames = (frames * torch.tensor(step, dtype=torch.float32)).long()
            grid = torch.stack(torch.meshgrid(frames, torch.arange(rows), torch.arange(columns),
                                              indexing="ij")).reshape(3, -1)
            pieces.append(grid + position)
            position += max(rows, columns)
        else:
            pieces.append(torch.arange(position, position + end - index).expand(3, -1))
            position += end - index
        index = end
    positions = torch.cat(pieces, dim=1) if pieces else torch.zeros(3, 0, dtype=torch.int64)
    # Generated tokens go on from where the prompt's next token would be, as transformers' generate steps
    # its positions: for images that is the largest position + 1, but a Qwen2.5-VL video's time axis can
    # run past it (transformers 5's get_rope_index still returns max + 1 - len, which its generate does not use)
    return positions, position - len(ids)


def mrope_cos_sin(positions: torch.Tensor, head_dim: int, theta: float, sections: list[int],
                  interleaved: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """positions (3, L) -> cos, sin (L, head_dim) fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
    angles = positions.float()[..., None] * inv_freq  # (3, L, head_dim / 2)
    if interleaved:
        picked = angles[0].clone()
        for axis in (1, 2):
            dealt = slice(axis, 3 * sections[axis], 3)
            picked[:, dealt] = angles[axis][:, dealt]
        angles = picked
    else:
        angles = torch.cat([block[j % 3] for j, block in enumerate(angles.split(list(sections), dim=-1))], dim=-1)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def rotary_rows(positions: torch.Tensor, head_dim: int, theta: float, sections: list[int],
                interleaved: bool = False) -> torch.Tensor:
    """positions (3, L) -> (L, head_dim) fp32 rows in the engine's rotary-table layout
    (kernels/rotary.py build_cos_sin_cache: [cos of the head_dim / 2 frequencies | their sin])."""
    cos, sin = mrope_cos_sin(positions, head_dim, theta, sections, interleaved)
    return torch.cat([cos[:, :head_dim // 2], sin[:, :head_dim // 2]], dim=-1)


def request_mrope(ids: list[int], grids: list[list[int]], config: dict, vocab_size: int | None = None,
                  second_per_grid: list[float | None] | None = None) -> tuple[torch.Tensor, int]:
    """A Qwen2-VL prompt's (rotary rows (len(ids), head_dim), mrope_position_delta), what the executor's
    ``Mrope`` takes (engine/executor/mrope_rotary.py). ``ids``: the prompt with each image's rows as
    runs of the image token (``config["image_token_index"]``), or, given ``vocab_size``, as the fake ids
    (>= vocab_size) of a prompt-embedding table; ``grids``: each image's (t, h, w) patch grid, in
    order; ``config``: the vision encoder directory's config (its ``mrope``; ``interleaved`` for Qwen3-VL);
    ``second_per_grid``: per grid, None for an image or a video's second_per_grid_t (serving/qwen_video.py),
    its time step tokens_per_second times it (Qwen2.5-VL; 1 per grid frame without tokens_per_second, as
    Qwen2-VL). The video token (``mrope["video_token_index"]``) marks rows as the image token does.
    Qwen3-VL (``qwen_video.timestamps``): a video grid (t, h, w) is t runs of grid (1, h, w), its frame
    pairs, each laid out after its timestamp text (serving/qwen3_video.py)."""
    mrope, image = config["mrope"], config["image_token_index"]
    video = mrope.get("video_token_index")
    if (config.get("qwen_video") or {}).get("timestamps") and second_per_grid:
        # Qwen3-VL: a video's frame pairs are runs of their own (timestamps between them), each an image of
        # grid (1, h, w), as its get_rope_index splits video_grid_thw
        grids = [list(grid) if second is None else [1, grid[1], grid[2]]
                 for grid, second in zip(grids, [*second_per_grid, *[None] * (len(grids) - len(second_per_grid))])
                 for _ in range(1 if second is None else grid[0])]
        second_per_grid = None
    marked = [image if (vocab_size is not None and t >= vocab_size) or (video is not None and t == video) else t
              for t in ids]
    per_second = mrope.get("tokens_per_second")
    steps = [None if s is None else 1.0 if per_second is None
             else float(torch.tensor(per_second, dtype=torch.float32) * torch.tensor(s, dtype=torch.float32))
             for s in (second_per_grid or [])]
    positions, delta = rope_positions(marked, image, grids, mrope["merge"], steps)
    return rotary_rows(positions, mrope["head_dim"], mrope["theta"], mrope["sections"],
                       mrope.get("interleaved", False)), delta
