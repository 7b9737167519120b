"""MllamaRunner: a ModelRunner for Llama 3.2 Vision's text model (engine/encoder_decoder/mllama_model.py) with
the encoder-decoder engines' cross-KV pool (engine/encoder_decoder/runner.py's sizing).

- ``encode_into``: a request's vision states (images x tiles x patches, hidden), made by the vision encoder
  (engine/vision/mllama.py; the multimodal_encoders model or the OpenAI frontend), are projected once by
  every cross layer into K (k_norm'd) and V and written into the request's blocks of the cross pool
  (cross layers x 2 x blocks x tokens_per_block x kv_heads x head_dim);
- ``forward``: the executor's packed steps; ``ForwardBatch.cross_block_tables`` / ``cross_lengths`` /
  ``cross_masks`` give each scheduled sequence's cross blocks, vision-token count and mask (an empty table,
  length 0 and None for a request without images), from which the step's cross inputs are made
  (engine/encoder_decoder/mllama_cross.py).
- KV memory: ``cross_kv_cache_fraction`` f of it is the cross pool, as for T5/BART; a cross block holds
  cross-layers / self-layers as many bytes as a self block, so the pools' block counts follow from that.

Steps run eagerly (no CUDA graphs: the cross-attention inputs change shape with the step). One rank only.
"""
from __future__ import annotations

import torch

from engine.config import EngineFormatError
from engine.encoder_decoder.mllama_cross import cross_step
from engine.encoder_decoder.mllama_model import MllamaTextModel
from engine.encoder_decoder.runner import EncDecRunner
from engine.executor.overlap import resolve_placeholders
from engine.executor.random_weights import has_random_weights, materialize_random_weights
from engine.executor.runner import ForwardBatch, ModelRunner, keep_or_cast, load_rank_weights
from kernels.attention import KV_FP8_DTYPE, write_kv_cache

MLLAMA_ARCHITECTURE = "MllamaForConditionalGeneration"


class MllamaRunner(EncDecRunner):
    """EncDecRunner's construction (cross_kv_cache_fraction) and warmup; the rest its own (module docstring)."""

    def _load_model(self, engine_dir: str, tp_group) -> torch.nn.Module:
        extra = self.engine_config.extra
        mllama = extra.get("mllama")
        if mllama is None:
            raise EngineFormatError(f"{engine_dir!r} is not a Llama 3.2 Vision engine (config.json extra.mllama missing)")
        self.mllama = mllama
        self.max_encoder_input_len = int(extra["max_encoder_input_len"])
        model = MllamaTextModel(self.model_config, num_layers_total=mllama["num_layers_total"],
                                cross_layers=mllama["cross_attention_layers"],
                                text_vocab_size=mllama["text_vocab_size"], dtype=self.dtype, device="meta",
                                max_positions=max(self.build_config.max_seq_len, 1))
        self.num_cross_layers = len(model.cross_layers)
        if has_random_weights(extra):  # a config-only benchmark engine
            model = materialize_random_weights(model, self.device, extra["random_weights_seed"])
        else:
            weights = load_rank_weights(engine_dir, 0, self.device)
            expected = set(model.state_dict())
            missing, unexpected = sorted(expected - set(weights)), sorted(set(weights) - expected)
            if missing or unexpected:
                raise EngineFormatError(f"rank0.safetensors in {engine_dir!r} does not match the Mllama text model: "
                                        f"missing {missing[:5]}, unexpected {unexpected[:5]}")
            model.load_state_dict({k: keep_or_cast(k, v, self.dtype) for k, v in weights.items()}, assign=True)
        model.init_buffers(self.device)
        return model.eval()

    # ---- KV memory: the self-attention pool and the cross pool ----------------------------------

    def kv_cache_torch_dtype(self, kv_cache_dtype: str | None = None) -> torch.dtype:
        """The model dtype only: the cross-attention (mllama_cross.py) reads its gathered K/V with torch
        SDPA, which takes no FP8 operands, so an FP8 KV cache (either pool) is refused by name at start."""
        dtype = ModelRunner.kv_cache_torch_dtype(self, kv_cache_dtype)
        for name, value in (("kv_cache_dtype", dtype == KV_FP8_DTYPE), ("cross_kv_cache_dtype",
                                                                         self.cross_kv_cache_dtype == "fp8")):
            if value:
                raise ValueError(f"{name} fp8: not supported for MllamaForConditionalGeneration (Llama 3.2 "
                                 "Vision: its cross-attention reads the cross K/V in the model dtype); use auto")
        return dtype

    def num_kv_blocks_for(self, *, free_mem_fraction=None, max_tokens=None, kv_cache_dtype=None,
                          reserve_bytes: int = 0) -> int:
        """Blocks of the self-attention pool; sets ``num_cross_blocks`` (module docstring)."""
        total = ModelRunner.num_kv_blocks_for(self, free_mem_fraction=free_mem_fraction, max_tokens=max_tokens,
                                          kv_cache_dtype=kv_cache_dtype, reserve_bytes=reserve_bytes)
        f, ratio = self.cross_kv_fraction, self.kv_layers / max(1, self.num_cross_layers)
        one_input = -(-self.max_encoder_input_len // self.tokens_per_block)
        if self.device.type == "cuda" and max_tokens is None:
            self.num_cross_blocks = max(one_input, int(total * f * ratio))
            return max(1, int(total * (1 - f)))
        self.num_cross_blocks = max(one_input, int(total * f / (1 - f) * ratio))
        return total

    def allocate_kv_cache(self, num_blocks: int, kv_cache_dtype: str | None = None) -> None:
        ModelRunner.allocate_kv_cache(self, num_blocks, kv_cache_dtype)
        if not self.num_cross_blocks:  # allocated without num_kv_blocks_for: room for two longest inputs
            self.num_cross_blocks = 2 * -(-self.max_encoder_input_len // self.tokens_per_block)
        heads, head_dim = self.model_config.num_kv_heads, self.model_config.head_dim
        self.cross_pool = None
        self.cross_pool = torch.zeros((self.num_cross_layers, 2, self.num_cross_blocks, self.tokens_per_block, heads,
                                       head_dim), dtype=self.kv_cache.dtype, device=self.device)

    def capture_cuda_graphs(self) -> None:  # eager steps (module docstring)
        pass

    # ---- the vision states' K/V -----------------------------------------------------------------

    @torch.inference_mode()
    def encode_into(self, inputs: list, block_tables: list[list[int]]) -> None:
        """Each request's vision states (L_i, hidden) -> every cross layer's K/V in its blocks."""
        T = self.tokens_per_block
        for states, blocks in zip(inputs, block_tables):
            states = torch.as_tensor(states).to(self.device, self.dtype)
            kv = self.model.cross_kv(states)  # (cross layers, 2, L, kv_heads, head_dim)
            positions = torch.arange(states.shape[0])
            slots = (torch.tensor(blocks)[positions // T] * T + positions % T).to(self.device)
            for layer in range(kv.shape[0]):
                write_kv_cache(kv[layer, 0], kv[layer, 1], self.cross_pool[layer, 0], self.cross_pool[layer, 1],
                               slots)

    # ---- a step ---------------------------------------------------------------------------------

    @torch.inference_mode()
    def forward(self, batch: ForwardBatch, *, all_logits: bool = False, prompt_embeds=None) -> torch.Tensor:
        if prompt_embeds is not None:
            raise ValueError("prompt tables are not supported by Llama 3.2 Vision engines (images go through "
                             "cross-attention: encoder_input_features)")
        input_ids, positions, meta = self._prepare(batch)
        masks = batch.cross_masks or [None] * len(batch.seq_lens_q)
        crosses = [None if mask is None or self.cross_pool is None else (table, length, mask)
                   for table, length, mask in zip(batch.cross_block_tables or [[]] * len(masks),
                                                  batch.cross_lengths or [0] * len(masks), masks)]
        step = cross_step(batch.seq_lens_q, batch.positions, crosses, self.tokens_per_block, self.device)
        hidden = self.model(resolve_placeholders(input_ids, self.sampled_tokens), positions, self.kv_cache, meta,
                            cross_pool=self.cross_pool, cross=step)
        if not all_logits:
            hidden = hidden[self._to_device(batch.logits_indices, torch.int64)]
        return self._logits(hidden)
