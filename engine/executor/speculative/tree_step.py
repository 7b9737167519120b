"""One target forward over token trees, the accepted path's KV compacted into place, and a greedy
decode loop driven by it (engine/executor/speculative/tree.py says what a tree is).

``tree_forward`` runs a batch of trees through the runner's model with the tree attention mask
(kernels/attention.py ``meta.tree_mask``) and returns hidden states and logits at every node.
``compact_path_kv`` then moves the KV of the accepted path's nodes to consecutive positions after
the prefix (node path[j] -> position base + j), so the cache reads as if the path had been decoded
token by token; the rejected nodes' positions lie past the new length and are dropped with the
blocks that hold nothing else (``TreeDecoder``), or overwritten by the next step.

``TreeDecoder`` is the loop for one sequence (greedy): prefill, then per step a proposer's tree
(a chain, a Medusa tree, random candidates...) verified in one forward. It is what the tests and
Medusa use; the in-flight executor still verifies chains (docs/features/speculative-decoding.md).
Models with recurrent state (Mamba layers) cannot verify trees: their state has no per-node copy.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import accumulate
from typing import Callable

import torch

from engine.executor.kv_cache import BlockManager
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.speculative.tree import accept_greedy_tree, ancestor_mask
from kernels.attention import KV_FP8_DTYPE
from kernels.attention_metadata import AttentionMetadata, pack_tree_mask


@dataclass
class TreeRow:
    """One sequence's tree in a tree forward."""

    num_cached: int  # tokens whose KV is in the cache; the root (token_ids[0]) is not among them
    block_table: list[int]  # covers num_cached + len(token_ids) positions
    parents: list[int]  # parents[0] = -1, parents[i] < i
    token_ids: list[int]  # the root (the last known token), then the drafted nodes


@torch.inference_mode()
def tree_forward(runner: ModelRunner, rows: list[TreeRow]) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (hidden (total nodes, hidden), float32 logits (total nodes, vocab)); sequence i's nodes are
    rows cu[i]:cu[i+1] in node order. Node j is written at position num_cached + j's slot and
    rotated as position num_cached + depth(j)."""
    size = runner.tokens_per_block
    token_ids, positions, slots, lens = [], [], [], []
    for row in rows:
        n = len(row.token_ids)
        if len(row.block_table) * size < row.num_cached + n:
            raise ValueError(f"block table covers {len(row.block_table) * size} positions; the tree needs "
                             f"{row.num_cached + n}")
        depths = [0] * n
        for j in range(1, n):
            depths[j] = depths[row.parents[j]] + 1
        token_ids += row.token_ids
        positions += [row.num_cached + d for d in depths]
        slots += [row.block_table[p // size] * size + p % size for p in range(row.num_cached, row.num_cached + n)]
        lens.append(n)
    cu = [0, *accumulate(lens)]
    width = max(lens)
    mask = torch.zeros(cu[-1], width, dtype=torch.bool)
    for i, row in enumerate(rows):
        mask[cu[i]:cu[i + 1], :lens[i]] = ancestor_mask(row.parents)
    table_width = max(len(row.block_table) for row in rows)
    device = runner.device
    context_lens = [row.num_cached + n for row, n in zip(rows, lens)]
    meta = AttentionMetadata(
        slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
        block_tables=torch.tensor([r.block_table + [0] * (table_width - len(r.block_table)) for r in rows],
                                  dtype=torch.int32, device=device),
        cu_seqlens_q=torch.tensor(cu, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        max_seqlen_q=width, max_context_len=max(context_lens), is_decode_only=False,
        cu_seqlens_q_host=cu, context_lens_host=context_lens, tree_mask=mask.to(device),
        tree_bits=pack_tree_mask(mask).to(device))
    hidden = runner.model(torch.tensor(token_ids, dtype=torch.int64, device=device),
                          torch.tensor(positions, dtype=torch.int64, device=device), runner.kv_cache, meta)
    return hidden, runner.model.compute_logits(hidden)


def compact_path_kv(runner: ModelRunner, block_table: list[int], num_cached: int, path: list[int]) -> None:
    """Move every layer's K and V of node path[j] (position num_cached + path[j]) to position
    num_cached + j. path[j] >= j, and all sources are read before any destination is written."""
    move_kv(runner, path_kv_moves(block_table, num_cached, path, runner.tokens_per_block))


def path_kv_moves(block_table: list[int], num_cached: int, path: list[int], tokens_per_block: int
                  ) -> list[tuple[int, int, int, int]]:
    """compact_path_kv's moves, host-side only: (source block, offset, destination block, offset) of
    each accepted node not in place. A step's sequences' moves go to ``move_kv`` together."""
    size, moves = tokens_per_block, []
    for j, node in enumerate(path):
        if node != j:
            src, dst = num_cached + node, num_cached + j
            moves.append((block_table[src // size], src % size, block_table[dst // size], dst % size))
    return moves


def move_kv(runner: ModelRunner, moves: list[tuple[int, int, int, int]]) -> None:
    """Every layer's K and V from each move's source slot to its destination (path_kv_moves), all
    sources read before any destination is written: one copy of the slots to the device, not waited
    for (a tensor made on the device from a list waits for the stream: four such a sequence were
    four host syncs a tree step), and one gather and scatter for the whole step."""
    if not moves:
        return
    cache = runner.kv_cache.view(torch.uint8) if runner.kv_cache.dtype == KV_FP8_DTYPE else runner.kv_cache
    at = torch.tensor(moves, dtype=torch.int64).T.contiguous().to(cache.device, non_blocking=True)  # (4, moves)
    cache[:, :, at[2], at[3]] = cache[:, :, at[0], at[1]]  # (layers, 2, moves, kv heads, head dim)


# A proposer: (the sequence's tokens, the target's final hidden state after its last token) ->
# (parents, drafted token ids) of the next tree below the last token (empty lists: no drafts).
TreeProposer = Callable[[list[int], torch.Tensor], tuple[list[int], list[int]]]


@dataclass
class TreeStats:
    steps: int = 0
    accepted: list[int] = field(default_factory=list)  # drafts accepted per tree step
    tree_sizes: list[int] = field(default_factory=list)  # drafted nodes per tree step

    @property
    def mean_acceptance_length(self) -> float:
        """Tokens emitted per target forward (accepted drafts + 1), over the decode steps."""
        return sum(a + 1 for a in self.accepted) / max(1, len(self.accepted))


class TreeDecoder:
    """Greedy decoding of one sequence with tree verification, on a runner whose KV pool it owns.
    Blocks come from a BlockManager: a step allocates what its tree needs and frees the blocks
    past the accepted length afterwards, so rejected nodes never hold blocks between steps."""

    def __init__(self, runner: ModelRunner, num_blocks: int):
        if runner.kv_cache is None:
            runner.allocate_kv_cache(num_blocks)
        self.runner = runner
        self.blocks = BlockManager(runner.num_kv_blocks, runner.tokens_per_block, enable_reuse=False)

    @torch.inference_mode()
    def generate(self, prompt: list[int], max_new_tokens: int, propose: TreeProposer | None = None
                 ) -> tuple[list[int], TreeStats]:
        runner, stats = self.runner, TreeStats()
        table = self.blocks.allocate(self.blocks.blocks_for_tokens(len(prompt)))
        try:
            n = len(prompt)
            hidden_rows = runner.model(*self._prefill_inputs(prompt, table))  # the whole prompt: last row -> token 1
            last_hidden = hidden_rows[-1]
            tokens = list(prompt) + [int(runner.model.compute_logits(last_hidden[None]).argmax(-1))]
            num_cached = n
            while len(tokens) - n < max_new_tokens:
                parents, drafts = propose(tokens, last_hidden) if propose is not None else ([], [])
                room = max_new_tokens - (len(tokens) - n) - 1  # a step emits at most drafts + 1 tokens
                parents, drafts = _trim_to_depth(parents, drafts, room)
                tree_parents = [-1] + [p + 1 for p in parents]  # proposer's parents: -1 = the root
                tree_tokens = [tokens[-1]] + drafts
                need = self.blocks.blocks_for_tokens(num_cached + len(tree_tokens)) - len(table)
                if need > 0:
                    table += self.blocks.allocate(need)
                hidden, logits = tree_forward(runner, [TreeRow(num_cached, table, tree_parents, tree_tokens)])
                path, emitted = accept_greedy_tree(tree_parents, tree_tokens, logits.argmax(-1).tolist())
                compact_path_kv(runner, table, num_cached, path)
                num_cached += len(path)
                tokens += emitted  # the accepted drafts, then the bonus token
                last_hidden = hidden[path[-1]]
                keep = self.blocks.blocks_for_tokens(num_cached + 1)  # the next root's slot included
                if len(table) > keep:
                    self.blocks.free(table[keep:])
                    del table[keep:]
                stats.steps += 1
                if drafts:
                    stats.accepted.append(len(path) - 1)
                    stats.tree_sizes.append(len(drafts))
            return tokens[n:n + max_new_tokens], stats
        finally:
            self.blocks.free(table)

    def _prefill_inputs(self, prompt: list[int], table: list[int]):
        runner = self.runner
        batch = ForwardBatch(token_ids=list(prompt), positions=list(range(len(prompt))), seq_lens_q=[len(prompt)],
                             context_lens=[len(prompt)], block_tables=[table], logits_indices=[len(prompt) - 1])
        input_ids, positions, meta = runner._prepare(batch)
        return input_ids, positions, runner.kv_cache, meta


def _trim_to_depth(parents: list[int], drafts: list[int], max_depth: int) -> tuple[list[int], list[int]]:
    """Drop the nodes deeper than max_depth (a step must not emit past max_new_tokens); parents
    index the kept nodes afterwards. parents: the proposer's (-1: under the root)."""
    depth, keep, new_index = [], [], {}
    for i, p in enumerate(parents):
        d = 1 if p < 0 else depth[p] + 1
        depth.append(d)
        if d <= max_depth and (p < 0 or p in new_index):
            new_index[i] = len(keep)
            keep.append(i)
    return [parents[i] if parents[i] < 0 else new_index[parents[i]] for i in keep], [drafts[i] for i in keep]
