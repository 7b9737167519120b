"""Static buffers that let steps with prompt-table rows or M-RoPE rows replay the prefill CUDA graphs
(engine/executor/prefill_graphs.py captures a "table" twin of every bucket with them).

Why: a vision-language request's prompt steps (image rows spliced in, M-RoPE rotary rows) ran
eagerly, ~12 launches per layer from Python and the eager path's host packing, while the text path
replays graphs; at low load that is most of an image request's time to first token (H200, Qwen2.5-VL-7B
shape: executor to first token 29.9 ms against 11.4 for a text prompt of the same length,
benchmarks/results/engine.md).

The twin forward, per bucket of T tokens (all buffers are views of these, fixed at capture):
- ``embeds`` (T, table_width) in the model dtype and ``mask`` (T,) bool: the dense PromptEmbeds
  (engine/models/prompt_embeds.py): token i takes embeds[i] where mask[i], its token embedding elsewhere.
  Per step, outside the graph: mask cleared, the step's rows copied to their tokens, the mask set there.
  Rows of earlier steps stay in ``embeds`` unread (the mask is clear there).
- ``step_table`` (rotary rows R + T, head_dim): the model's rotary table (R = its max positions) with
  room for a step's M-RoPE prompt rows after it; the graph's positions buffer holds each token's
  row of it (mrope_rotary.StepRotary: a position, position + delta, or R + k for the step's k-th
  extra row). Positions feed rotary only: the KV slots were computed from the true positions.
- fake ids (>= vocab_size) are 0 in the ids buffer (their embedding is replaced).
Each gives bitwise the eager step's values (index_copy and torch.where copy the same cast rows;
rotary reads the same table rows), so the graphed step equals the eager one
(tests/engine/test_table_graphs.py: the dense forward on the CPU; the replay on a GPU).
"""
from __future__ import annotations

import numpy as np
import torch

from engine.executor.mrope_rotary import StepRotary
from engine.models.prompt_embeds import PromptEmbeds


class TableStepBuffers:
    """The twin graphs' static inputs for steps of at most ``max_tokens`` tokens."""

    def __init__(self, max_tokens: int, table_width: int, dtype: torch.dtype, vocab_size: int,
                 rotary_table: torch.Tensor | None, device: torch.device):
        self.vocab_size = vocab_size
        self.embeds = torch.zeros(max_tokens, table_width, dtype=dtype, device=device)
        self.mask = torch.zeros(max_tokens, dtype=torch.bool, device=device)
        # (None: the model takes no rotary override, e.g. OPT's learned positions; M-RoPE steps stay eager)
        self.rotary_rows = 0 if rotary_table is None else rotary_table.shape[0]
        self.step_table = None if rotary_table is None else torch.cat(
            [rotary_table, rotary_table.new_zeros(max_tokens, rotary_table.shape[1])])

    def forward(self, model, bucket: int):
        """model's twin forward for ``bucket`` tokens: (ids, positions, kv_cache, meta) -> hidden."""
        embeds = PromptEmbeds(None, self.embeds[:bucket], self.mask[:bucket])
        step_table = self.step_table

        def run(input_ids, positions, kv_cache, meta):
            rotary = {} if step_table is None else {"rotary": (positions, step_table)}
            return model(input_ids, positions, kv_cache, meta, prompt_embeds=embeds, **rotary)
        return run

    def fits(self, rotary: StepRotary | None) -> bool:
        return rotary is None or self.step_table is not None

    def fill_host(self, ids: np.ndarray, positions: np.ndarray, rotary: StepRotary | None) -> None:
        """The step's n tokens' rows of the ids and positions buffers (after the slots were made from the
        true positions): fake ids -> 0, positions -> rows of step_table."""
        ids[ids >= self.vocab_size] = 0
        if rotary is not None:
            index = np.asarray(rotary.indices, dtype=np.int64)
            positions[:] = np.where(index < 0, self.rotary_rows - 1 - index, index)

    def fill_device(self, prompt_embeds: PromptEmbeds | None, rotary: StepRotary | None, bucket: int) -> None:
        """The step's table rows and M-RoPE rows into the device buffers (on the current stream, before the replay).
        On CUDA every copy is asynchronous, from pinned memory: a pageable copy synchronizes the stream, so the
        host would wait for the step in flight before it could launch this one (no overlap of the two)."""
        self.mask[:bucket].zero_()
        if prompt_embeds is not None:
            index = self._to_device(torch.tensor(prompt_embeds.token_indices, dtype=torch.int64))
            self.mask.index_fill_(0, index, True)
            # (copied in the table's dtype, then cast on the device: index_copy_ takes equal dtypes)
            self.embeds.index_copy_(0, index, self._to_device(prompt_embeds.embeddings).to(self.embeds.dtype))
        if rotary is not None and rotary.rows is not None:
            rows = rotary.rows
            self.step_table[self.rotary_rows:self.rotary_rows + len(rows)].copy_(self._to_device(rows))

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """``host`` on the buffers' device; on CUDA without waiting (pinned source, staged if need be: the caching
        host allocator keeps a staged block until its copy is done)."""
        if self.mask.device.type != "cuda" or host.device.type != "cpu":
            return host.to(self.mask.device)
        if not (host.is_contiguous() and host.is_pinned()):  # (a strided pinned source is staged synchronously)
            host = pinned_copy(host)
        return host.to(self.mask.device, non_blocking=True)


def pinned_copy(host: torch.Tensor) -> torch.Tensor:
    """A contiguous copy of a CPU tensor in pinned memory (the caching host allocator's)."""
    staged = torch.empty(host.shape, dtype=host.dtype, pin_memory=True)
    staged.copy_(host)
    return staged


def table_step_buffers(model, engine_config, max_tokens: int, dtype: torch.dtype,
                       device: torch.device) -> TableStepBuffers | None:
    """The buffers of a vision-language engine (engine.build wrote ``extra["vision_encoder"]``) whose model
    splices table rows; None otherwise (a text engine captures no twins: a table request there runs eagerly;
    Gemma 3's image steps attend both ways, span_ahead, and always run eagerly). The rotary override is the
    model's own table when it takes M-RoPE (``supports_mrope``)."""
    if not (engine_config.extra.get("vision_encoder") and getattr(model, "supports_prompt_tables", False)
            and not getattr(model, "bidirectional_prompt_tables", False)):
        return None
    rotary_table = model._rotary_table(device) if getattr(model, "supports_mrope", False) else None
    return TableStepBuffers(max_tokens, engine_config.model.prompt_table_width, dtype, engine_config.model.vocab_size,
                            rotary_table, device)
