"""AttentionMetadata: the per-forward inputs of paged attention, shared by every layer.

Its own module so that kernels/attention.py (the dispatching entry points) and
kernels/triton_attention.py (the GPU kernels it dispatches to) both import it downward.
Shapes and invariants: kernels/attention.py's module docstring.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Iterator

import numpy as np
import torch

if TYPE_CHECKING:
    from kernels.lora import LoraBatch


@dataclass
class AttentionMetadata:
    """Per-forward attention inputs, built once by the runner and shared by every layer."""

    slot_mapping: torch.Tensor  # (num_tokens,) int64: flat cache slot of each new token
    block_tables: torch.Tensor  # (num_seqs, max_blocks_per_seq) int32, padded with 0
    cu_seqlens_q: torch.Tensor  # (num_seqs + 1,) int32: new tokens of seq i are rows cu[i]:cu[i+1]
    context_lens: torch.Tensor  # (num_seqs,) int32: cached + new tokens of seq i after this step
    max_seqlen_q: int
    max_context_len: int
    is_decode_only: bool  # every sequence has exactly one new token
    # Host copies of cu_seqlens_q / context_lens, so the torch reference never syncs the device.
    cu_seqlens_q_host: list[int] | None = None
    context_lens_host: list[int] | None = None
    # Prefill tile map (CUDA graphs of mixed steps): attention program p runs query tile
    # tile_m[p] of sequence tile_seq[p], or nothing where tile_seq[p] < 0; both (max_tiles,)
    # int32. The grid is then max_tiles programs per KV head, whatever the batch holds.
    tile_seq: torch.Tensor | None = None
    tile_m: torch.Tensor | None = None
    # The new tokens a tile of that map covers, as its builder counted them (kernels/triton_attention.py
    # prefill_tokens_per_tile on the launches' device); the kernel wrapper checks its tiles hold as many. None: unstated.
    tile_tokens: int | None = None
    # LoRA (kernels/lora.py): which adapter slot each token uses, grouped by slot; None when no
    # token of the forward uses an adapter (the projections then skip LoRA entirely). It rides
    # here because every layer already receives this object.
    lora: "LoraBatch | None" = None
    # Decode CUDA graphs (engine/executor/cuda_graphs.py): a (1,) int32 device buffer the host writes
    # before each replay, how many of the key splits captured in the grid the replay's decode
    # attention uses (kernels/triton_attention.py decode_active_splits); None: the grid's all.
    decode_splits: torch.Tensor | None = None
    # Set by the decode attention launch that captures with ``decode_splits``: (KV heads, programs
    # the GPU holds at once, SMs), what decode_active_splits needs; None until then.
    decode_split_plan: tuple[int, int, int] | None = None
    # Models with Mamba layers (engine/ssm/): each sequence's state slot (engine/executor/state_cache.py),
    # (num_seqs,) int32 on the device and as a host list; None for models without recurrent state.
    state_slots: torch.Tensor | None = None
    state_slots_host: list[int] | None = None
    # Tree verification (engine/executor/speculative/tree.py): (num_tokens, W) bool, W at least the most new
    # tokens of a sequence (max_seqlen_q eagerly; a tree CUDA graph's tree width, whose max_seqlen_q is its
    # bucket), row t (a new token of sequence i) says which of sequence i's new tokens it sees (its tree
    # ancestors and itself); every cached key stays visible. None: plain causal attention.
    tree_mask: torch.Tensor | None = None
    # tree_mask as bits (pack_tree_mask), what the Triton kernel reads where it is set: (num_tokens, words)
    # int32, words >= ceil(W / 32), bit k of word w of row t = tree_mask[t, 32 w + k] for every key of row
    # t's own sequence (columns past it, and rows past the step's tokens, are never read: a graph's buffer
    # keeps an earlier step's there). Whoever sets tree_mask packs it once a forward (a tree CUDA graph's is
    # a buffer its host fills), and again if it changes the mask; None: the kernel reads tree_mask's bytes
    # (slower: kernels/triton_attention.py).
    tree_bits: torch.Tensor | None = None
    # Image spans (Gemma 3, engine/executor/image_spans.py): (num_tokens,) int32, how many of its own
    # sequence's later new tokens each new token also sees (the rest of its image's run in this step;
    # 0 outside images, never past its chunk): the row at position p sees keys up to p + span_ahead.
    # A sliding window still hides keys older than p - W + 1. None: plain causal attention.
    span_ahead: torch.Tensor | None = None
    # token_sequences(num_tokens) made once for a forward's layers (engine/models/deepseek.py sets it on
    # its own copy each forward, inside whatever graph is being captured); None: made per call.
    token_seq: torch.Tensor | None = None

    @property
    def num_seqs(self) -> int:
        return self.context_lens.shape[0]

    def token_sequences(self, num_tokens: int) -> torch.Tensor:
        """(num_tokens,) int32 on the device: the sequence each new token belongs to, from
        cu_seqlens_q without a host sync (CUDA-graph safe)."""
        if self.token_seq is not None and self.token_seq.shape[0] == num_tokens:
            return self.token_seq
        token_ids = torch.arange(num_tokens, device=self.cu_seqlens_q.device, dtype=self.cu_seqlens_q.dtype)
        return torch.searchsorted(self.cu_seqlens_q[1:].contiguous(), token_ids, right=True).to(torch.int32)

    def host_sequences(self) -> Iterator[tuple[int, int, int, int]]:
        """(index, first row, end row, context_len) of every sequence with new tokens, from the host
        copies when the runner made them (the torch references then never sync the device)."""
        cu = self.cu_seqlens_q_host if self.cu_seqlens_q_host is not None else self.cu_seqlens_q.tolist()
        ctx = self.context_lens_host if self.context_lens_host is not None else self.context_lens.tolist()
        for i, context_len in enumerate(ctx):
            if cu[i + 1] > cu[i]:
                yield i, cu[i], cu[i + 1], context_len


def pack_tree_mask(mask: torch.Tensor) -> torch.Tensor:
    """AttentionMetadata.tree_bits of a (num_tokens, width) bool / int8 ``mask``, on its device:
    (num_tokens, ceil(width / 32)) int32, bit k of word w of row t set where mask[t, 32 w + k] is nonzero.

    Why bits: the attention kernel's masked key tiles read each (row, key) of a byte mask with its own
    load; a row's bits are one word per 32 keys, a few row-vector loads a tile."""
    if mask.device.type == "cpu":  # a host-built mask
        return torch.from_numpy(pack_tree_mask_numpy(mask.numpy()))
    return pack_tree_mask_torch(mask)


def pack_tree_mask_numpy(mask: np.ndarray) -> np.ndarray:
    """pack_tree_mask of a host array (numpy's bit packing into little-endian words): what a tree CUDA
    graph's host writes into its pinned bits buffer, without torch's per-call overhead."""
    tokens, width = mask.shape
    packed = np.zeros((tokens, -(-width // 32) * 4), dtype=np.uint8)
    packed[:, :-(-width // 8)] = np.packbits(mask != 0, axis=1, bitorder="little")
    return packed.view("<i4").astype(np.int32, copy=False)


def pack_tree_mask_torch(mask: torch.Tensor) -> torch.Tensor:
    """pack_tree_mask by torch operations on ``mask``'s device (a device-side mask: no host sync)."""
    tokens, width = mask.shape
    words = -(-width // 32)
    padded = torch.zeros(tokens, words * 32, dtype=torch.int64, device=mask.device)
    padded[:, :width] = mask != 0
    shifts = torch.arange(32, dtype=torch.int64, device=mask.device)
    packed = (padded.view(tokens, words, 32) << shifts).sum(-1)  # 0 .. 2**32 - 1
    return (packed - ((packed >> 31) << 32)).to(torch.int32)  # the same 32 bits as a signed int32
