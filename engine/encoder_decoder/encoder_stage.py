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
from dataclasses import replace

import torch

from engine.encoder_decoder.cross_pool_stage import CrossPoolStage
from engine.encoder_decoder.model import Encoder
from engine.encoder_decoder.runner import EncDecRunner
from engine.encoder_decoder.whisper_alignment import attach_token_timestamps
from engine.encoder_decoder.whisper_timestamps import rules_for_prompt

ENCODER_INPUT, ENCODER_FEATURES = "encoder_input_ids", "encoder_input_features"
CROSS_MASK = "cross_attention_mask"  # Llama 3.2 Vision's (engine/encoder_decoder/mllama_stage.py)


def encoder_input_error(request, stage: "EncoderStage | None") -> str | None:
    """A decoder-only engine refuses an encoder input; an encoder-decoder one checks it."""
    if stage is None:
        for name in (ENCODER_INPUT, ENCODER_FEATURES, CROSS_MASK):
            if getattr(request, name) is not None:
                return (f"{name}: this engine is decoder-only and has no encoder; send the prompt as "
                        f"input_token_ids without {name}")
        return None
    return stage.rejection(request)


def encoder_input(request):
    """What the encoder reads: the token ids, or the features as a float32 tensor."""
    if request.encoder_input_features is not None:
        return torch.as_tensor(request.encoder_input_features, dtype=torch.float32)
    return request.encoder_input_ids


class EncoderStage(CrossPoolStage):
    def __init__(self, runner: EncDecRunner):
        super().__init__(runner)
        self.spec = runner.spec

    def encoder_input(self, request):
        return encoder_input(request)

    # ---- arrival -------------------------------------------------------------------------------

    def complete(self, request):
        """``request`` with its decoder prompt ([decoder_start_token_id] when it sent none) and, for
        a Whisper prompt that asks for timestamps, its timestamp rules (whisper_timestamps.py); on
        a Whisper engine whose generation config suppresses tokens, those."""
        if not request.input_token_ids:
            request = replace(request, input_token_ids=[self.spec.decoder_start_token_id])
        spec = self.spec
        rules = rules_for_prompt(request.input_token_ids, spec.decoder_start_token_id, spec.no_timestamps_token_id,
                                 spec.eos_token_id, None if spec.max_initial_timestamp_index < 0
                                 else spec.max_initial_timestamp_index)
        if rules is not None:
            request = replace(request, whisper_timestamps=rules)
        if spec.suppress_tokens or spec.begin_suppress_tokens:
            request = replace(request, whisper_suppress=(tuple(spec.suppress_tokens), tuple(spec.begin_suppress_tokens)))
        return request

    def add_token_timestamps(self, state, responses) -> None:
        """A Whisper request that asked (OutputConfig.return_token_timestamps): its final results get
        their tokens' timestamps (whisper_alignment.py), while its cross K/V is still held."""
        if state.request.output.return_token_timestamps and state.request_id in self.held:
            attach_token_timestamps(self.runner, self.spec, self.held[state.request_id], state, responses)

    def encoder_length(self, request) -> int:
        """Encoder outputs (cross K/V positions) of ``request``'s encoder input."""
        if self.spec.num_mel_bins:
            return Encoder.output_length(len(request.encoder_input_features), self.spec)
        return len(request.encoder_input_ids)

    def rejection(self, request) -> str | None:
        if request.cross_attention_mask is not None:
            return (f"{CROSS_MASK}: {self.spec.architecture} has no image cross-attention (only Llama 3.2 Vision "
                    "engines take it); send the request without it")
        if request.output.return_token_timestamps and self.runner.build_config.tp_size > 1:
            # (the alignment heads' weights come from a pass over rank 0's cross pool: its heads only)
            return (f"return_token_timestamps: not supported on a tensor-parallel engine (tp_size "
                    f"{self.runner.build_config.tp_size}); serve a tp_size 1 engine for token timestamps")
        error = self._features_error(request) if self.spec.num_mel_bins else self._tokens_error(request)
        if error is not None:
            return error
        bad = [t for t in request.input_token_ids if not 0 <= t < self.spec.vocab_size]
        if bad:
            return (f"decoder_input_ids: token ids {bad[:8]} of the decoder prompt (input_token_ids) are outside "
                    f"the vocabulary (0..{self.spec.vocab_size - 1})")
        length = self.encoder_length(request)
        if self.blocks_for(length) > self.num_blocks:
            return (f"{ENCODER_INPUT}: {length} encoder outputs need {self.blocks_for(length)} cross-KV blocks but the "
                    f"cross pool holds {self.num_blocks}; raise cross_kv_cache_fraction or send a shorter input")
        return None

    def _tokens_error(self, request) -> str | None:
        ids = request.encoder_input_ids
        if request.encoder_input_features is not None:
            return (f"{ENCODER_FEATURES}: {self.spec.architecture} takes encoder tokens (Triton: input_ids), not "
                    "features; send encoder_input_ids")
        if ids is None or len(ids) == 0:
            return (f"{ENCODER_INPUT}: an encoder-decoder engine needs the encoder's input tokens (Triton: input_ids; "
                    "the decoder prompt goes in decoder_input_ids); none were sent")
        limit = self.runner.max_encoder_input_len
        if len(ids) > limit:
            return f"{ENCODER_INPUT}: {len(ids)} tokens exceed the engine's max_encoder_input_len ({limit})"
        bad = [t for t in ids if not isinstance(t, int) or not 0 <= t < self.spec.vocab_size]
        if bad:
            return f"{ENCODER_INPUT}: token ids {bad[:8]} are outside the vocabulary (0..{self.spec.vocab_size - 1})"
        return None

    def _features_error(self, request) -> str | None:
        features, mels = request.encoder_input_features, self.spec.num_mel_bins
        if features is None:
            return (f"{ENCODER_FEATURES}: {self.spec.architecture} needs log-mel features (frames, {mels}); none were "
                    "sent")
        shape = tuple(torch.as_tensor(features).shape)
        if len(shape) != 2 or shape[1] != mels or shape[0] == 0:
            return (f"{ENCODER_FEATURES}: shape {shape}; the encoder takes (frames, {mels}) log-mel features, at least "
                    "one frame")
        frames = 2 * self.runner.max_encoder_input_len
        if shape[0] > frames:
            return f"{ENCODER_FEATURES}: {shape[0]} frames exceed the encoder's {frames} (30 s of audio for Whisper)"
        return None

    def take(self, state) -> bool:
        """True: ``state`` waits here for its encoder run (its first call); False: it has run."""
        if state.request_id in self.held:
            return False
        self.pending.append(state)
        return True

    def encode_pending(self, fail) -> list:
        """CrossPoolStage's, then each encoded request's prompt keys (``key_prompt``) while its
        encoder pass runs on the device (encode_into returns without waiting for it)."""
        batch = super().encode_pending(fail)
        for state in batch:
            self.key_prompt(state)
        return batch

    @staticmethod
    def key_prompt(state) -> None:
        """Key the decoder prompt's blocks by the encoder input too (a digest of it; the module
        docstring says why). Hashing 64 clips of features takes ~0.1 s of host time, hence after
        the pass is queued rather than at arrival."""
        source = encoder_input(state.request)
        data = source.numpy().tobytes() if isinstance(source, torch.Tensor) else repr(source).encode()
        digest = hashlib.blake2b(data, digest_size=16).digest()
        for seq in state.sequences:
            seq.prompt_cache_keys = [(digest, t) for t in state.request.input_token_ids]

    # ---- once per step -------------------------------------------------------------------------

    def cross_rows(self, plan) -> tuple[list[list[int]], list[int]]:
        """(cross block tables, encoder lengths) of the plan's scheduled sequences, in order."""
        rows = [self.held[item.seq.state.request_id] for item in plan.scheduled]
        return [blocks for blocks, _ in rows], [length for _, length in rows]

    def fill_cross_rows(self, batch, plan) -> None:
        """The step's ForwardBatch.cross_block_tables / cross_lengths (``cross_rows``)."""
        batch.cross_block_tables, batch.cross_lengths = self.cross_rows(plan)


def make_encoder_stage(runner):
    """The executor's encoder stage for ``runner``: None for a decoder-only one, Llama 3.2 Vision's
    (engine/encoder_decoder/mllama_stage.py) for its runner, else EncoderStage."""
    if not hasattr(runner, "encode_into"):
        return None
    if getattr(runner, "mllama", None) is not None:
        from engine.encoder_decoder.mllama_stage import MllamaStage

        return MllamaStage(runner)
    return EncoderStage(runner)


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
    if architecture == "MllamaForConditionalGeneration":
        from engine.encoder_decoder.mllama_runner import MllamaRunner

        return partial(MllamaRunner, cross_kv_cache_fraction=config.cross_kv_cache_fraction,
                       cross_kv_cache_dtype=config.cross_kv_cache_dtype)
    return partial(EncDecRunner, encoder_engine_dir=config.encoder_engine_dir,
                   cross_kv_cache_fraction=config.cross_kv_cache_fraction,
                   cross_kv_cache_dtype=config.cross_kv_cache_dtype)
