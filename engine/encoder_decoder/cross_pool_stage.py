"""CrossPoolStage: what the executor's encoder stages share (engine/encoder_decoder/encoder_stage.py for
T5/BART/Whisper, mllama_stage.py for Llama 3.2 Vision): the cross-KV pool's free blocks, the requests
waiting for their encoder run (first come, first served), the blocks each request holds until it ends.

A subclass says how long a request's cross K/V is (``encoder_length``), what the runner's ``encode_into``
reads for it (``encoder_input``), and what it keeps beside its blocks (``held_entry``: a tuple whose first
item is the blocks).
"""
from __future__ import annotations

from collections import deque


class CrossPoolStage:
    FAILED = "encoder failed"  # the message of a request whose encoder run raised, before the error

    def __init__(self, runner):
        self.runner = runner
        self.tokens_per_block = runner.tokens_per_block
        self.free_blocks = list(range(runner.num_cross_blocks))
        self.num_blocks = runner.num_cross_blocks
        self.pending: deque = deque()  # RequestStates waiting for their encoder run, in arrival order
        self.held: dict[int, tuple] = {}  # request_id -> held_entry(...): (cross blocks, encoder length, ...)

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.tokens_per_block)

    def encoder_length(self, request) -> int:
        raise NotImplementedError

    def encoder_input(self, request):
        raise NotImplementedError

    def held_entry(self, state, blocks: list[int], length: int) -> tuple:
        return blocks, length

    def encode_pending(self, fail) -> list:
        """Encode the waiting requests that fit the free cross blocks; returns them, ready to queue.
        ``fail(state, message)`` ends a request whose encoder run failed."""
        batch = []
        while self.pending:
            state = self.pending[0]
            if state.is_cancelled or all(seq.is_finished for seq in state.sequences):
                self.pending.popleft()
                continue
            length = self.encoder_length(state.request)
            if self.blocks_for(length) > len(self.free_blocks):
                break  # first come, first served: later requests wait behind it
            self.pending.popleft()
            blocks = [self.free_blocks.pop() for _ in range(self.blocks_for(length))]
            self.held[state.request_id] = self.held_entry(state, blocks, length)
            batch.append(state)
        if not batch:
            return []
        try:
            self.runner.encode_into([self.encoder_input(s.request) for s in batch],
                                    [self.held[s.request_id][0] for s in batch])
        except Exception as err:  # noqa: BLE001 - the requests fail, the loop goes on
            for state in batch:
                fail(state, f"{self.FAILED}: {err!r}")
            return []
        return batch

    def add_token_timestamps(self, state, responses) -> None:
        """Extra per-token outputs of a finished request (encoder_stage.py: Whisper's timestamps)."""

    def cross_kv_counts(self) -> dict[str, int]:
        """The pool's blocks now (engine/executor/stats.py KvCacheStats fields)."""
        free = len(self.free_blocks)
        return {"max_num_blocks": self.num_blocks, "free_num_blocks": free, "used_num_blocks": self.num_blocks - free,
                "tokens_per_block": self.tokens_per_block}

    def release(self, state) -> None:
        held = self.held.pop(state.request_id, None)
        if held is not None:
            self.free_blocks.extend(held[0])
