"""Drafts left on the device: a proposer's drafted ids stay on the GPU until the verify step needs them.

Without this a proposal ends with the host reading the drafted ids (a stream synchronisation), so
the GPU idles while the host schedules, packs and launches the verify step (~1 ms a step at batch 1
on an H200: the drafting's replay and the step's host work ran one after the other). Instead the
ids go to draft slots of the runner's sampled-token ring (ModelRunner.add_draft_slots), and each
sequence's ``draft_token_ids`` names them by placeholder ids, as the overlapped steps name sampled
tokens (engine/executor/overlap.py): the forward resolves them on the device, inside its CUDA graph
too. A copy home into pinned memory is queued right behind the ring's; the executor resolves the
placeholders on the host (``resolve``) once the verify step is launched, before verifying, by which
time the drafting is long done.

Invariant: the host mirror holds what the ring's draft slots hold (every ``place`` writes both over
the same slots, the copy home queued after the ring's), so a placeholder resolves on the host to
the id the device read, whichever proposal wrote it.

$TRITONLLM_DEVICE_DRAFTS=0 turns it off (the drafted ids are read at the proposal's end, as before):
an A/B switch, read when a proposer starts.
"""
from __future__ import annotations

import os

import torch

from engine.executor.overlap import placeholder

DEVICE_DRAFTS_ENV = "TRITONLLM_DEVICE_DRAFTS"


def device_drafts_enabled() -> bool:
    return os.environ.get(DEVICE_DRAFTS_ENV, "1") != "0"


class DeviceDrafts:
    """``rows`` sequences' drafts of up to ``nodes`` ids each, in draft slots of ``runner``'s ring
    (row i's at slots first + i * nodes ...), and their pinned host mirror."""

    def __init__(self, runner, rows: int, nodes: int):
        self.runner, self.rows, self.nodes = runner, rows, nodes
        self.first = runner.add_draft_slots(rows * nodes)
        cuda = runner.device.type == "cuda"
        self.host = torch.zeros(rows * nodes, dtype=torch.int64, pin_memory=cuda)
        self.arrived = torch.cuda.Event() if cuda else None  # the copy home is done
        self._values: list[int] | None = None  # the mirror as a list, read at the first resolve after a place

    def place(self, drafted: torch.Tensor, rooms: list[int]) -> list[list[int]]:
        """drafted (n <= rows, nodes) int64 device ids -> each row's first rooms[i] (at most nodes) as
        placeholder ids.
        Queued on the current stream behind the drafting; nothing waits for it."""
        n = drafted.shape[0]
        assert n <= self.rows and drafted.shape[1] == self.nodes, (tuple(drafted.shape), self.rows, self.nodes)
        slots = self.runner.sampled_tokens[self.first:self.first + n * self.nodes]
        slots.copy_(drafted.reshape(-1))
        self.host[:n * self.nodes].copy_(slots, non_blocking=True)
        if self.arrived is not None:
            self.arrived.record()
        self._values = None
        return [[placeholder(self.first + i * self.nodes + j) for j in range(min(room, self.nodes))]
                for i, room in enumerate(rooms)]

    def resolve(self, ids: list[int]) -> list[int]:
        """Draft ids with placeholders (of ``place``) -> the ids (waits for the copy home, once a proposal)."""
        if not ids or min(ids) >= 0:
            return ids
        if self._values is None:
            if self.arrived is not None:
                self.arrived.synchronize()
            self._values = self.host.tolist()
        values, first = self._values, self.first
        return [values[-1 - t - first] if t < 0 else t for t in ids]
