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
        # Host staging of a step's token index, table rows and M-RoPE rows, made here and reused by every step
        # (pinned on CUDA). Nothing pinned is allocated per step: an allocation the caching host allocator cannot
        # serve from its cache is a cudaHostAlloc, ordered by CUDA against every stream (the executor's step would
        # wait for the vision tower's queued forward: engine/vision/encode_queue.py). Reuse is safe: the prefill
        # graphs record their ``_copied`` event after fill_device's copies and wait on it before the next fill.
        self._pinned = device.type == "cuda"
        self.host_index = _host_buffer((max_tokens,), torch.int64, self._pinned)
        # Rows by dtype: float16 (the tables' wire dtype: the encode queue's, multimodal_encoders') made now,
        # another on its first step
        self.host_rows = {torch.float16: _host_buffer((max_tokens, table_width), torch.float16, self._pinned)}
        self.host_rotary = None if self.step_table is None else _host_buffer(
            (max_tokens, self.step_table.shape[1]), self.step_table.dtype, self._pinned)

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
        On CUDA every copy is asynchronous, from this object's pinned staging: a pageable copy synchronizes the
        stream, so the host would wait for the step in flight before it could launch this one (no overlap of the two)."""
        self.mask[:bucket].zero_()
        if prompt_embeds is not None:
            n = len(prompt_embeds.token_indices)
            self.host_index.numpy()[:n] = prompt_embeds.token_indices
            index = self._to_device(self.host_index[:n])
            self.mask.index_fill_(0, index, True)
            # (copied in the table's dtype, then cast on the device: index_copy_ takes equal dtypes)
            rows = self._staged_rows(prompt_embeds.embeddings)
            self.embeds.index_copy_(0, index, self._to_device(rows).to(self.embeds.dtype))
        if rotary is not None and rotary.rows is not None:
            k = len(rotary.rows)
            staged = rotary.rows
            if staged.device.type == "cpu":
                staged = self.host_rotary[:k]
                staged.copy_(rotary.rows)
            self.step_table[self.rotary_rows:self.rotary_rows + k].copy_(staged, non_blocking=self._pinned)

    def _staged_rows(self, embeddings: torch.Tensor) -> torch.Tensor:
        """``embeddings`` (n, width) copied into the staging of its dtype (made on first use); rows already
        on the device as they are."""
        if embeddings.device.type != "cpu":
            return embeddings
        host = self.host_rows.get(embeddings.dtype)
        if host is None:
            host = self.host_rows[embeddings.dtype] = _host_buffer(
                (len(self.mask), self.embeds.shape[1]), embeddings.dtype, self._pinned)
        staged = host[:len(embeddings)]
        staged.copy_(embeddings)
        return staged

    def _to_device(self, host: torch.Tensor) -> torch.Tensor:
        """A staged (contiguous, pinned on CUDA) host tensor on the buffers' device, without waiting."""
        return host.to(self.mask.device, non_blocking=self._pinned)


def _host_buffer(shape: tuple, dtype: torch.dtype, pinned: bool) -> torch.Tensor:
    return torch.zeros(shape, dtype=dtype, pin_memory=pinned)


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
