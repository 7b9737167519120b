"""The executor's encoder stage for Llama 3.2 Vision engines: the images' cross K/V in the cross-KV pool.

The same hooks as engine/encoder_decoder/encoder_stage.py's EncoderStage (the executor calls them), for a
decoder-only prompt with images beside it:

- ``rejection`` when a request arrives: ``encoder_input_features`` are the images' vision states
  (images x max_num_tiles x patches rows of the text model's width: the vision encoder's output,
  engine/vision/mllama.py), ``cross_attention_mask`` which of them each position attends to
  ((rows, vision states) bool; required with features); neither: a text-only request, whose tokens skip
  the cross-attention layers;
- ``take``: a request with images waits here for its K/V projection; a text-only one goes straight on;
- ``encode_pending`` once per iteration: the waiting requests whose vision states fit the free cross
  blocks (first come, first served) get every cross layer's K/V written into their blocks;
- ``fill_cross_rows`` when a step is packed: each scheduled sequence's cross blocks, vision-state count and
  mask (engine/encoder_decoder/mllama_cross.py); empty for text-only requests;
- ``release`` when a request ends: its cross blocks go back.

Cross K/V belongs to the request (beams, returned sequences and a preempted sequence keep it). A prompt
with images is keyed in the prefix cache by a digest of the vision states and the mask too, since the
self-attention KV after the first cross layer depends on them.
"""
from __future__ import annotations

import hashlib

import numpy as np
import torch

from engine.encoder_decoder.cross_pool_stage import CrossPoolStage
from engine.encoder_decoder.mllama_cross import CrossMask

FEATURES, MASK = "encoder_input_features", "cross_attention_mask"


class MllamaStage(CrossPoolStage):
    FAILED = "cross-attention K/V of the images failed"

    def __init__(self, runner):
        super().__init__(runner)
        self.hidden = runner.model_config.hidden_size
        self.image_tokens = runner.mllama["max_num_tiles"] * runner.mllama["patches_per_tile"]

    def encoder_length(self, request) -> int:
        return len(request.encoder_input_features)

    def encoder_input(self, request):
        return request.encoder_input_features

    def held_entry(self, state, blocks: list[int], length: int) -> tuple:
        return blocks, length, CrossMask.from_dense(state.request.cross_attention_mask)

    def complete(self, request):
        return request

    def rejection(self, request) -> str | None:
        features, mask = request.encoder_input_features, request.cross_attention_mask
        if request.encoder_input_ids is not None:
            return ("encoder_input_ids: Llama 3.2 Vision engines take the prompt as input_token_ids and the images' "
                    f"vision states as {FEATURES}; send no encoder tokens")
        if request.prompt_table is not None:
            return ("prompt_embedding_table: Llama 3.2 Vision engines read images through cross-attention; send the "
                    f"vision states as {FEATURES} with a {MASK}, not a prompt table")
        if features is None:
            return None if mask is None else f"{MASK}: sent without {FEATURES}; send both, or neither (text only)"
        shape = tuple(torch.as_tensor(features).shape)
        if len(shape) != 2 or shape[1] != self.hidden or shape[0] == 0 or shape[0] % self.image_tokens:
            return (f"{FEATURES}: shape {shape}; Llama 3.2 Vision takes the vision encoder's states (images x "
                    f"{self.image_tokens}, {self.hidden}): {self.image_tokens} rows per image (max_num_tiles x patches)")
        limit = self.runner.max_encoder_input_len
        if shape[0] > limit:
            return (f"{FEATURES}: {shape[0]} vision states ({shape[0] // self.image_tokens} images) exceed the engine's "
                    f"max_encoder_input_len ({limit}); send fewer images or rebuild with a larger "
                    "--max_encoder_input_len")
        if self.blocks_for(shape[0]) > self.num_blocks:
            return (f"{FEATURES}: {shape[0]} vision states need {self.blocks_for(shape[0])} cross-KV blocks but the "
                    f"cross pool holds {self.num_blocks}; raise cross_kv_cache_fraction or send fewer images")
        if mask is None:
            return (f"{MASK}: required with {FEATURES}: (prompt positions, {shape[0]}) bool, which vision states each "
                    "position attends to")
        mask_shape = tuple(np.shape(mask))
        if len(mask_shape) != 2 or mask_shape[1] != shape[0] or mask_shape[0] == 0:
            return (f"{MASK}: shape {mask_shape}; it must be (positions, {shape[0]}): one row per prompt position "
                    f"(output positions may follow) over the {shape[0]} vision states")
        return None

    def take(self, state) -> bool:
        """True: ``state`` waits here for its K/V projection (its first call); False: go on."""
        request = state.request
        if request.encoder_input_features is None or state.request_id in self.held:
            return False
        features = torch.as_tensor(request.encoder_input_features).float().cpu().numpy()
        mask = np.asarray(request.cross_attention_mask).astype(bool)
        digest = hashlib.blake2b(features.tobytes() + np.packbits(mask).tobytes() + repr(mask.shape).encode(),
                                 digest_size=16).digest()
        for seq in state.sequences:
            seq.prompt_cache_keys = [(digest, t) for t in request.input_token_ids]
        self.pending.append(state)
        return True

    def fill_cross_rows(self, batch, plan) -> None:
        """Each scheduled sequence's cross blocks, vision-state count and mask ([], 0, None: no images)."""
        rows = [self.held.get(item.seq.state.request_id, ([], 0, None)) for item in plan.scheduled]
        batch.cross_block_tables = [blocks for blocks, _, _ in rows]
        batch.cross_lengths = [length for _, length, _ in rows]
        batch.cross_masks = [mask for _, _, mask in rows]
