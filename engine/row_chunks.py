"""Build-time quantizers run over a weight's rows a chunk at a time, so their float32 temporaries are a chunk's.

Every quantizer engine.build runs on a weight (kernels/fp8.py per row, kernels/int8_sq.py per row, kernels/
fp8_block.py per 128 x 128 block, kernels/wna16.py per group along a row) makes a few float32 copies of what it
is given: given a whole stack of experts (Llama-4-Scout's gate_up on one rank: 16 x 16,384 x 5,120, 5.4 GB in
float32) it would hold several times that at once. Each row's codes and scale depend on that row alone (a block's
on its 128 rows), so quantizing row chunks (block-aligned for blocks) and concatenating gives the same tensors.
"""
from __future__ import annotations

from typing import Callable

import torch

# Values a quantizer call is given: 64 Mi, 256 MiB in float32, so a call's temporaries stay within ~1 GiB.
VALUES_PER_CALL = 1 << 26


def rows_per_call(columns: int, align: int = 1) -> int:
    """Rows of ``columns`` values a call takes: about VALUES_PER_CALL values, a multiple of ``align``."""
    return max(align, VALUES_PER_CALL // max(columns, 1) // align * align)


def by_rows(quantize: Callable[..., tuple[torch.Tensor, ...]], rows: torch.Tensor, *row_args: torch.Tensor | None,
            align: int = 1, arg_rows_per_row: int = 1) -> tuple[torch.Tensor, ...]:
    """``quantize(rows, *row_args)`` computed on chunks of ``rows`` (R, K) and concatenated along dim 0, for a
    quantizer whose outputs' dim 0 follows the rows. ``row_args``: tensors whose dim 0 follows the rows as well
    (per-row scales), sliced alike, or None. ``align``: rows per chunk a multiple of it (128 for blocks, whose
    scales' dim 0 holds one row per ``arg_rows_per_row`` = 128 rows)."""
    step = rows_per_call(rows.shape[-1], align)
    if rows.shape[0] <= step:
        return quantize(rows, *row_args)
    parts = []
    for start in range(0, rows.shape[0], step):
        args = [None if a is None else a[start // arg_rows_per_row:(start + step) // arg_rows_per_row] for a in row_args]
        parts.append(quantize(rows[start:start + step], *args))
    return tuple(torch.cat(outputs) for outputs in zip(*parts))
