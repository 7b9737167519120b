"""The executor's encoder stage for encoder-decoder engines: encoder runs and the cross-KV pool.

The executor (engine/executor/executor.py) calls it at a few points, each a line there:

- ``complete`` / ``rejection`` when a request arrives: a missing decoder prompt becomes
  ``[decoder_start_token_id]``; the encoder input is checked (present, ids in the vocabulary,
  no longer than the engine's max_encoder_input_len, fits the cross pool);
- ``take`` instead of queueing a request's sequences: the request waits here for its encoder run;
- ``encode_pending`` once per iteration: the waiting requests whose cross K/V fit the free cross
  blocks (first come, first served) run through the encoder together, one padded pass, and their
  K/V are written into their blocks; they then join the scheduler's queue;
- ``cross_rows`` when a step is packed: each scheduled sequence's cross blocks and encoder length;
- ``release`` when a request ends (finished, cancelled, failed): its cross blocks go back.

Cross K/V belongs to the request, not to its sequences: beams and returned sequences share it,
and a preempted sequence keeps it (only its self-attention KV is recomputed). The decoder prompt's
blocks are keyed in the prefix cache by the encoder input too (``prompt_cache_keys``), since the
decoder's KV depends on it.
"""
from __future__ import annotations

import hashlib
from collections import deque
from dataclasses import replace

from engine.encoder_decoder.runner import EncDecRunner

ENCODER_INPUT = "encoder_input_ids"


def encoder_input_error(request, stage: "EncoderStage | None") -> str | None:
    """A decoder-only engine refuses an encoder input; an encoder-decoder one checks it."""
    if stage is None:
        if request.encoder_input_ids is not None:
            return (f"{ENCODER_INPUT}: this engine is decoder-only and has no encoder; send the prompt as "
                    "input_token_ids without encoder_input_ids")
        return None
    return stage.rejection(request)


class EncoderStage:
    def __init__(self, runner: EncDecRunner):
        self.runner = runner
        self.spec = runner.spec
        self.tokens_per_block = runner.tokens_per_block
        self.free_blocks = list(range(runner.num_cross_blocks))
        self.num_blocks = runner.num_cross_blocks
        self.pending: deque = deque()  # RequestStates waiting for their encoder run, in arrival order
        self.held: dict[int, tuple[list[int], int]] = {}  # request_id -> (cross blocks, encoder length)

    @property
    def has_pending(self) -> bool:
        return bool(self.pending)

    def blocks_for(self, length: int) -> int:
        return -(-length // self.tokens_per_block)

    # ---- arrival -------------------------------------------------------------------------------

    def complete(self, request):
        """``request`` with its decoder prompt: [decoder_start_token_id] when it sent none."""
        if request.input_token_ids:
            return request
        return replace(request, input_token_ids=[self.spec.decoder_start_token_id])

    def rejection(self, request) -> str | None:
        ids = request.encoder_input_ids
        if ids is None or len(ids) == 0:
            return (f"{ENCODER_INPUT}: an encoder-decoder engine needs the encoder's input tokens (Triton: input_ids; "
                    "the decoder prompt goes in decoder_input_ids); none were sent")
        limit = self.runner.max_encoder_input_len
        if len(ids) > limit:
            return f"{ENCODER_INPUT}: {len(ids)} tokens exceed the engine's max_encoder_input_len ({limit})"
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if bad:
            return f"{ENCODER_INPUT}: token ids {bad[:8]} are outside the vocabulary (0..{self.spec.vocab_size - 1})"
        bad = [t for t in request.input_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            return (f"decoder_input_ids: token ids {bad[:8]} of the decoder prompt (input_token_ids) are outside "
                    f"the vocabulary (0..{self.spec.vocab_size - 1})")
        if self.blocks_for(len(ids)) > self.num_blocks:
            return (f"{ENCODER_INPUT}: {len(ids)} tokens need {self.blocks_for(len(ids))} cross-KV blocks but the cross "
                    f"pool holds {self.num_blocks}; raise cross_kv_cache_fraction or send a shorter input")
        return None

    def take(self, state) -> bool:
        """True: ``state`` waits here for its encoder run (its first call); False: it has run."""
        if state.request_id in self.held:
            return False
        digest = hashlib.blake2b(repr(state.request.encoder_input_ids).encode(), digest_size=16).digest()
        for seq in state.sequences:
            seq.prompt_cache_keys = [(digest, t) for t in state.request.input_token_ids]
        self.pending.append(state)
        return True

    # ---- once per iteration --------------------------------------------------------------------

    def encode_pending(self, fail) -> list:
        """Encode the waiting requests that fit the free cross blocks; returns them, ready to queue.
        ``fail(state, message)`` ends a request whose encoder run failed."""
        batch = []
        while self.pending:
            state = self.pending[0]
            if state.is_cancelled or all(seq.is_finished for seq in state.sequences):
                self.pending.popleft()
                continue
            length = len(state.request.encoder_input_ids)
            if self.blocks_for(length) > len(self.free_blocks):
                break  # first come, first served: later requests wait behind it
            self.pending.popleft()
            blocks = [self.free_blocks.pop() for _ in range(self.blocks_for(length))]
            self.held[state.request_id] = (blocks, length)
            batch.append(state)
        if not batch:
            return []
        try:
            self.runner.encode_into([s.request.encoder_input_ids for s in batch],
                                    [self.held[s.request_id][0] for s in batch])
        except Exception as err:  # noqa: BLE001 - the requests fail, the loop goes on
            for state in batch:
                fail(state, f"encoder failed: {err!r}")
            return []
        return batch

    def cross_rows(self, plan) -> tuple[list[list[int]], list[int]]:
        """(cross block tables, encoder lengths) of the plan's scheduled sequences, in order."""
        rows = [self.held[item.seq.state.request_id] for item in plan.scheduled]
        return [blocks for blocks, _ in rows], [length for _, length in rows]

    def release(self, state) -> None:
        held = self.held.pop(state.request_id, None)
        if held is not None:
            self.free_blocks.extend(held[0])


def encoder_decoder_runner(engine_dir: str, config):
    """The runner class for ``engine_dir`` when it is an encoder-decoder's decoder (EncDecRunner with
    the executor's encoder settings), else None."""
    from functools import partial

    from engine.config import ENCODER_DECODER_ARCHITECTURES, EngineConfig

    try:
        architecture = EngineConfig.load(engine_dir).model.architecture
    except (OSError, ValueError):  # the runner's own load reports it
        return None
    if architecture not in ENCODER_DECODER_ARCHITECTURES:
        return None
    return partial(EncDecRunner, encoder_engine_dir=config.encoder_engine_dir,
                   cross_kv_cache_fraction=config.cross_kv_cache_fraction)
