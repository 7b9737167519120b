"""SequenceChunks: which sequences a Mamba prefill step packs, for kernels/causal_conv1d.py and kernels/ssd_scan.py.

Sequence i's new tokens are rows ``cu_seqlens[i]:cu_seqlens[i+1]`` of the packed batch; its state
lives in slot ``slots[i]``; ``has_state[i]``: the chunk continues that state (False: it starts
from zeros, a prompt's first chunk). The host lists serve the references; the Triton kernels read
the device copies, made once per forward on first use and shared by every layer.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class SequenceChunks:
    slots: list[int]
    cu_seqlens: list[int]
    has_state: list[bool]
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))

    @property
    def num_seqs(self) -> int:
        return len(self.slots)

    def _copy(self, values: list[int]) -> torch.Tensor:
        host = torch.tensor(values, dtype=torch.int32)
        return host.pin_memory().to(self.device, non_blocking=True) if self.device.type == "cuda" else host

    @cached_property
    def sequence_tensors(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(cu_seqlens, slots, has_state) as int32 device tensors."""
        return (self._copy(self.cu_seqlens), self._copy(self.slots), self._copy([int(h) for h in self.has_state]))

    @cached_property
    def token_tensors(self) -> tuple[torch.Tensor, torch.Tensor]:
        """Per packed row: the row where its sequence starts, and the slot to read the left context
        from (-1 where the sequence starts from zeros); int32 device tensors."""
        starts, slots = [], []
        for i, slot in enumerate(self.slots):
            n = self.cu_seqlens[i + 1] - self.cu_seqlens[i]
            starts += [self.cu_seqlens[i]] * n
            slots += [slot if self.has_state[i] else -1] * n
        return self._copy(starts), self._copy(slots)
