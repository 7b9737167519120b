"""Overlapped scheduling: step N+1 is scheduled, packed and launched before step N's tokens reach the host.

Without overlap every step ends with the host waiting for the sampled tokens, and the GPU then
waits while the host appends them, checks stops, sends responses and packs the next step. With
it the executor keeps one step in flight:

    host:  schedule N+1 | pack | launch N+1 | wait N's tokens | append, stop checks, emit | schedule N+2 ...
    GPU:   ...... step N ......| step N+1 ..........................................| step N+2 ...

Step N+1 needs the tokens step N samples as its decode inputs. They stay on the device: step N
writes them into the runner's ``sampled_tokens`` ring, and step N+1's ForwardBatch names them
by *placeholder* ids (``-1 - slot``), which ``resolve_placeholders`` swaps for the real ids on
the device (inside the decode CUDA graph). The host learns the tokens one step later, puts
them in place of the placeholders in ``Sequence.token_ids``, and only then checks stop
conditions. Consequences, all handled by the executor:

- A sequence that stops on a token only the host can judge (end_id, a stop word) has already
  been scheduled for one more step; that step's token is dropped, never emitted, and the
  sequence's blocks are freed as soon as the stop is known (the GPU writes into them only
  within the step already launched, which stream order puts before any later owner's writes).
- A sequence whose length stop is known in advance (max_tokens) is not scheduled past it.
- Whatever needs a token's value on the host before the next step is built takes the
  synchronous path: while any such request is active, each step's tokens are read before the
  next step is scheduled (``needs_tokens_on_host``).

Ring layout: ``sampled_tokens`` has 2 * max_batch_size slots; step k writes its i-th sampled
row to slot (k % 2) * max_batch_size + i, so the step being read (k - 1) and the one being
written (k) never share a slot. A proposer may add draft slots past the two halves
(ModelRunner.add_draft_slots, engine/executor/speculative/device_drafts.py): drafts named by
placeholders too, resolved the same way.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from engine.executor.top_log_probs import MAX_TOP_LOG_PROBS


def placeholder(slot: int) -> int:
    """The token id that stands for ``sampled_tokens[slot]`` in a ForwardBatch (always < 0)."""
    return -1 - slot


def is_placeholder(token_id: int) -> bool:
    return token_id < 0


def resolve_placeholders(token_ids: torch.Tensor, sampled_tokens: torch.Tensor) -> torch.Tensor:
    """token_ids (n,) int64 with placeholders -> real ids: id >= 0 stays, -1 - i becomes
    sampled_tokens[i]. Pure device work, no host sync (safe inside a CUDA graph)."""
    slots = (-1 - token_ids).clamp_(min=0)
    return torch.where(token_ids >= 0, token_ids, sampled_tokens[slots])


def needs_tokens_on_host(request) -> bool:
    """A request whose next step depends on its last token's value, known only on the host:
    penalties and bad words (computed from the token history), beam search, and logits
    returned per step (read from the step's logits). These take the synchronous path."""
    sampling, output = request.sampling, request.output
    return bool(
        sampling.beam_width > 1
        or (sampling.repetition_penalty is not None and sampling.repetition_penalty != 1.0)
        or sampling.presence_penalty or sampling.frequency_penalty
        or request.bad_words or request.whisper_timestamps is not None
        or output.return_context_logits or output.return_generation_logits
    )


@dataclass
class InFlightStep:
    """A launched step whose tokens the host has not read yet."""

    plan: Any  # the SchedulerOutput it ran
    rows: list[tuple[int, int]]  # (first, end) logits rows of each scheduled sequence
    logits: torch.Tensor | None  # kept only while some request reads logits on the host
    placeholders: list[tuple[Any, int, int]]  # (sequence, index in its token_ids, logits row) per sampled row
    transfer: "TokenTransfer | None"  # None: nothing sampled (prefill chunks only)
    started: float  # perf_counter() when its iteration began
    num_active: int  # requests in flight when it was launched
    # Guided decoding: (logits, sampling rows, batch) of a forward whose sampling waits for the
    # previous step's tokens (Executor._sample_guided); None once sampled, or when nothing waits.
    pending_sample: tuple | None = None
    failed: bool = False  # its requests failed (guided sampling raised); it is not in flight
    # Speculative decoding: seq_id -> Verified (engine/executor/speculative/verify.py) of each drafted
    # sequence; decided at launch, applied when the step finishes, which is before the next schedule.
    verified: dict | None = None


class TokenTransfer:
    """One step's sampled tokens (and log-probs, top log-probs) on their way to the host, without
    blocking it.

    On CUDA the copies go into pinned buffers (reused every other step: step k+2 starts only
    after step k's transfer was waited on) and an event marks their arrival; on the CPU the
    tensors are already there. Top log-probs (R, K) belong to the sampled rows ``top_rows``.
    """

    def __init__(self, token_ids: torch.Tensor, log_probs: torch.Tensor | None,
                 pinned: "PinnedTokenBuffers | None", top_log_probs: torch.Tensor | None = None,
                 top_log_prob_ids: torch.Tensor | None = None, top_rows: tuple[int, ...] = ()):
        self._ready = None
        self._top_rows = top_rows
        tensors = [token_ids, log_probs, top_log_prob_ids, top_log_probs]
        if token_ids.device.type != "cuda" or pinned is None:
            # (the ids copied: they may be a decode graph's head-graph output, which the next step, launched
            # before this transfer is read, overwrites; on CUDA the copy home below is ordered before that step)
            self._ids, self._log_probs, self._top_ids, self._top_values = [token_ids.clone()] + tensors[1:]
            return
        self._ids, self._log_probs, self._top_ids, self._top_values = (
            None if t is None else _copy_home(t, buffer) for t, buffer in zip(tensors, pinned))
        self._ready = torch.cuda.Event()
        self._ready.record()

    def wait(self) -> tuple[list[int], list[float] | None, list | None]:
        """Block until the tokens are on the host: (token ids, log-probs or None, top or None);
        top[i] is None or (ids, log-probs) of sampled row i, K entries each, most likely first."""
        if self._ready is not None:
            self._ready.synchronize()
        log_probs = None if self._log_probs is None else self._log_probs.tolist()
        top = None
        if self._top_ids is not None:
            top = [None] * self._ids.shape[0]
            for row, ids, values in zip(self._top_rows, self._top_ids.tolist(), self._top_values.tolist()):
                top[row] = (ids, values)
        return self._ids.tolist(), log_probs, top


def _copy_home(tensor: torch.Tensor, buffer: torch.Tensor) -> torch.Tensor:
    """An async copy of a device tensor into the front of a flat pinned buffer, as its shape."""
    home = buffer[:tensor.numel()].view(tensor.shape)
    home.copy_(tensor, non_blocking=True)
    return home


# Per step parity, pinned host buffers of max_rows: (ids int64, log-probs float32,
# top ids int64 and top log-probs float32 of max_rows * MAX_TOP_LOG_PROBS each).
PinnedTokenBuffers = tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]


def pinned_token_buffers(max_rows: int, device: torch.device) -> list[PinnedTokenBuffers | None]:
    """One set of pinned buffers per step parity (CUDA only)."""
    if device.type != "cuda":
        return [None, None]
    top = max_rows * MAX_TOP_LOG_PROBS
    return [(torch.empty(max_rows, dtype=torch.int64).pin_memory(),
             torch.empty(max_rows, dtype=torch.float32).pin_memory(),
             torch.empty(top, dtype=torch.int64).pin_memory(),
             torch.empty(top, dtype=torch.float32).pin_memory()) for _ in range(2)]
