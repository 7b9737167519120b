"""CUDA graphs of the MTP module's runs (decoding_mode mtp, speculative/mtp.py), as the target's:
one-row-a-sequence runs (each chained draft) replay decode graphs, short multi-row runs (the
catch-up of the tokens a verify step kept) the prefill graphs' buckets; anything else runs eagerly.

Why: eagerly, one run of the module (embedding, eh_proj, one MLA + MoE layer, head norm) is ~40
launches from Python: 2.6 ms a chained draft on DeepSeek-V2-Lite's shape on the H200, more than half
a graphed decode step of the whole 27-layer target, so drafting ate the speed-up (issue 55).

``MtpStep`` puts the module in the graphs' model contract, model(ids, positions, kv_cache, meta) ->
hidden: ``positions`` are the module's slots (they give the KV slots, as the target's positions do),
rotary runs at slot + 1 (the module reads t_{p+1} at slot p), and the previous hidden rows come from
a static buffer that ``run`` fills before each replay (rows past the batch: stale, padding only).

Invariants: captured lazily on the first run on CUDA, after the runner's own capture chose the GEMM
kernels (the executor captures after the proposer starts); the module's pool is never reallocated
after; a replay's output is copied out before the next replay (graphs of a kind share a pool).
$TRITONLLM_MTP_GRAPHS=0 keeps every run eager.
"""
from __future__ import annotations

import os

import torch

from engine.executor.cuda_graphs import DecodeGraphs
from engine.executor.prefill_graphs import PrefillGraphs, model_token_buckets
from kernels.triton_attention import prefill_tokens_per_tile


MTP_GRAPHS_ENV = "TRITONLLM_MTP_GRAPHS"


def mtp_graphs_enabled() -> bool:
    return os.environ.get(MTP_GRAPHS_ENV, "1") != "0"


class MtpStep(torch.nn.Module):
    """The target's DeepseekMtp (``model.mtp``) over its own latent pool, in the graphs' contract."""

    def __init__(self, model: torch.nn.Module, max_rows: int, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.model = model
        self.previous = torch.zeros(max_rows, model.config.hidden_size, dtype=dtype, device=device)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_cache: torch.Tensor, meta) -> torch.Tensor:
        embeds = self.model.embed_tokens(input_ids)
        return self.model.mtp(embeds, self.previous[:input_ids.shape[0]], positions + 1, self.model.cos_sin_cache,
                              kv_cache, meta)


class MtpGraphs:
    """Decode and prefill graphs of ``MtpStep`` over the module's pool ``kv_cache``."""

    def __init__(self, runner, kv_cache: torch.Tensor, *, max_batch_size: int, max_num_tokens: int,
                 max_draft_len: int, multi_row: bool = True):
        build = runner.build_config
        buckets = model_token_buckets(runner.model, max_num_tokens) if multi_row else []
        self.step = MtpStep(runner.model, max(max_batch_size, max(buckets, default=0)), runner.dtype, runner.device)
        # the module's slots run to L + k - 2 of a sequence of at most max_seq_len tokens
        max_seq_len = build.max_seq_len + max_draft_len
        page = runner.tokens_per_block
        self.decode = DecodeGraphs(self.step, kv_cache, tokens_per_block=page, max_seq_len=max_seq_len,
                                   max_batch_size=max_batch_size)
        cfg = runner.model_config
        self.prefill = PrefillGraphs(
            self.step, kv_cache, tokens_per_block=page, max_seq_len=max_seq_len, max_batch_size=max_batch_size,
            max_num_tokens=max_num_tokens, buckets=buckets,
            tokens_per_tile=prefill_tokens_per_tile(cfg.num_heads // cfg.num_kv_heads, cfg.head_dim,
                                                    kv_cache.element_size(), kv_cache.device)) if buckets else None

    @torch.inference_mode()
    def capture(self) -> None:
        self.decode.capture()
        if self.prefill is not None:
            self.prefill.capture()

    @torch.inference_mode()
    def try_run(self, batch, previous: torch.Tensor) -> torch.Tensor | None:
        """A ForwardBatch of the module's rows (logits_indices: every row) and their previous hidden
        states (rows, hidden) -> the module's outputs (rows, hidden), a copy; None: no graph fits."""
        rows = len(batch.token_ids)
        if rows > self.step.previous.shape[0]:
            return None
        self.step.previous[:rows].copy_(previous, non_blocking=True)
        out = self.decode.try_run(batch)
        if out is None and self.prefill is not None:
            out = self.prefill.try_run(batch)
        return None if out is None else out.clone()
