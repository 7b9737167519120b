"""The state cache: one slot of fixed-size recurrent state per running sequence (Mamba layers).

Beside the paged KV pool (which only the attention layers of a hybrid model use), a model with
Mamba layers keeps, per sequence and per Mamba layer, a conv state (the last d_conv - 1 inputs
of its conv channels) and an SSM state (heads x head_dim x d_state). Unlike KV blocks, their
size does not grow with the sequence: that is the memory advantage of these models
(docs/features/hybrid-models.md has the figures).

- The tensors are the model's (engine/ssm/hybrid.py ``allocate_states``): ``num_slots`` slots,
  allocated by the runner before the KV pool is sized, so the pool takes what the states leave
  (they count in the one memory budget). There are max_batch_size slots, or on a GPU fewer when
  those would take more than STATE_SHARE of the memory the KV pool may use (a long-context
  deployment with a large max_batch_size: the scheduler then runs at most that many sequences).
- ``StateSlots`` (here) hands slots out, pure Python: a sequence takes one when the scheduler
  starts running it (admission) and gives it back when it finishes, is cancelled or fails
  (Scheduler.finish) or is preempted (Scheduler._preempt: it recomputes its whole stream later,
  from a fresh state, as its KV is recomputed). The scheduler admits a sequence only while a slot
  is free, so a running sequence always has one.
- Each step's ForwardBatch carries the slot of each scheduled sequence (``state_slots``); a
  chunk that starts at position 0 starts from zeros, any later chunk from its slot's state, so
  chunked prefill carries the state between chunks. A slot freed while a step that still writes
  it is in flight is safe: the next owner's first chunk is queued after that step and starts
  from zeros without reading the slot.

What a state cannot do, refused by name: prefix caching (a cached KV prefix has no state at its
end: reuse is turned off for these models), several sequences per request (beams and
num_return_sequences > 1 fork a prompt's cache, and a state cannot be shared), speculative
decoding (rejected drafts would need the state rolled back), LoRA (the runner refuses: the
model declares no adapted projections). With tensor parallelism every rank holds the same slots
of its own heads' states; rank 0's StateSlots hands them out for all (the slot ids travel in the
step's ForwardBatch, and LeaderRunner mirrors allocate_state_cache on every rank).
"""
from __future__ import annotations

import sys

from engine.executor.executor_config import ExecutorConfigError

# On a GPU the state slots take at most this share of the memory the KV pool may use
# (kv_cache_free_gpu_mem_fraction of the free memory); the KV pool gets the rest.
STATE_SHARE = 0.5


class StateSlots:
    """Slot ids 0..num_slots-1, owned by at most one sequence each (keyed by seq_id)."""

    def __init__(self, num_slots: int):
        if num_slots <= 0:
            raise ValueError(f"num_slots must be > 0, got {num_slots}")
        self.num_slots = num_slots
        self._free = list(range(num_slots - 1, -1, -1))  # pop() hands out 0 first
        self._owner: dict[int, int] = {}  # seq_id -> slot

    @property
    def num_used(self) -> int:
        return len(self._owner)

    @property
    def num_free(self) -> int:
        return len(self._free)

    def acquire(self, seq) -> int:
        """The slot of ``seq`` (a fresh one when it holds none)."""
        slot = self._owner.get(seq.seq_id)
        if slot is None:
            if not self._free:  # the scheduler runs at most max_batch_size == num_slots sequences
                raise RuntimeError(f"state cache: all {self.num_slots} slots are held; cannot start sequence "
                                   f"{seq.seq_id}")
            slot = self._owner[seq.seq_id] = self._free.pop()
        return slot

    def release(self, seq) -> None:
        slot = self._owner.pop(seq.seq_id, None)
        if slot is not None:
            self._free.append(slot)

    def slots_of(self, scheduled) -> list[int]:
        """The slot of each ScheduledSequence's sequence, in batch order."""
        owner = self._owner
        return [owner[item.seq.seq_id] for item in scheduled]


def uses_state_cache(runner) -> bool:
    return getattr(getattr(runner, "model", None), "uses_state_cache", False)


def start_state_cache(runner, max_batch_size: int, config) -> StateSlots | None:
    """Allocate the model's state slots (before the KV pool is sized) and refuse the executor
    settings a state cannot serve; None for models without recurrent state."""
    if not uses_state_cache(runner):
        return None
    arch = runner.model_config.architecture
    if config.speculative is not None:
        raise ExecutorConfigError(
            f"speculative decoding ({config.speculative.mode}) is not supported for {arch}: rejected draft tokens "
            "would need the Mamba layers' state rolled back; remove the speculative settings")
    num_slots = max_batch_size
    slot_bytes = runner.model.state_slot_bytes()
    if runner.device.type == "cuda":
        from engine.executor.device_memory import free_device_bytes

        budget = int(free_device_bytes(runner.device) * config.kv_cache_free_gpu_mem_fraction * STATE_SHARE)
        num_slots = max(1, min(max_batch_size, budget // slot_bytes))
        print(f"[executor] {num_slots} Mamba state slots of {slot_bytes / 2**20:.1f} MiB "
              f"({num_slots * slot_bytes / 2**30:.2f} GiB): at most {num_slots} sequences run at once",
              file=sys.stderr, flush=True)
    runner.allocate_state_cache(num_slots)
    return StateSlots(num_slots)


def request_error(request, architecture: str) -> str | None:
    """Why a request cannot run on a model with a state cache, or None."""
    sampling = request.sampling
    if (sampling.beam_width or 1) > 1:
        return (f"beam_width {sampling.beam_width}: beam search is not supported for {architecture} (each beam "
                "would need its own copy of the Mamba layers' state); send beam_width 1")
    if (sampling.num_return_sequences or 1) > 1:
        return (f"num_return_sequences {sampling.num_return_sequences}: {architecture} generates one sequence per "
                "request (the sequences would share the prompt's Mamba state); send num_return_sequences 1")
    return None
