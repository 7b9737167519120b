"""A step's batch as the runner takes it, packed from the scheduler's plan.

``pack_batch``: one ForwardBatch over the plan's chunks (prompt chunks, decode tokens, a drafted
sequence's known tokens plus its drafts, a token tree's depth positions), which logits rows each
scheduled sequence gets, and which rows sample. ``prompt_embeds_of``: the prompt-table rows the
chunks carry (multimodal prompts), in the same packing order. The executor calls both once per step
(engine/executor/executor.py ``_forward_batch`` and ``_launch``); the pipelined steps too
(engine/pipeline/in_flight.py, through ``_forward_batch``).
"""
from __future__ import annotations

from engine.executor.prompt_table import gather_prompt_embeds
from engine.executor.request import Sequence
from engine.executor.runner import ForwardBatch
from engine.executor.scheduler import SchedulerOutput
from engine.executor.tree_batch import chunk_parents, tree_positions
from engine.models.prompt_embeds import PromptEmbeds


def pack_batch(plan: SchedulerOutput, *, tokens_per_block: int, lora: bool, sampled_tokens_slot: int,
               state_slots=None) -> tuple[ForwardBatch, list[tuple[int, int]], list[tuple[Sequence, int]],
                                          list[tuple[Sequence, int, int]]]:
    """Pack the plan. rows[i] = (first, end) logits rows of scheduled sequence i (end - first: 0
    or more); sampling = (sequence, logits row) of each non-beam sequence that samples;
    drafted = (sequence, first logits row, k) of each sequence verifying k drafts: its k + 1
    rows are its last known token's and its drafts' (speculative decoding). ``lora``: the executor has
    adapter slots; ``sampled_tokens_slot``: where in the runner's sampled-token ring this step's tokens
    go (the half of the executor's parity); ``state_slots``: the Mamba state slots (state_cache.py)."""
    token_ids, positions, seq_lens, context_lens, tables, logits_indices, rows = [], [], [], [], [], [], []
    sampling, drafted, trees = [], [], []
    lora_slots = [item.seq.state.lora_slot for item in plan.scheduled] if lora else []
    T = tokens_per_block
    for item in plan.scheduled:  # runs once per sequence per step: kept free of calls in the decode case
        seq, start, n = item.seq, item.start, item.num_new_tokens
        offset, end = len(token_ids), start + n
        if n == 1:
            token_ids.append(seq.token_ids[start])
            positions.append(start)
        else:
            token_ids += seq.token_ids[start:end]
            positions += range(start, end)
        seq_lens.append(n)
        context_lens.append(end)
        tables.append(seq.block_ids[:-(-end // T)])
        first = len(logits_indices)
        if item.num_draft_tokens:  # known tokens, then the drafts; logits from the last known one on
            k = item.num_draft_tokens
            token_ids[offset + n - k:] = seq.draft_token_ids[:k]
            if seq.draft_parents is not None:  # a token tree: rotary positions by depth (tree_batch.py)
                trees.append(chunk_parents(n, seq.draft_parents[:k]))
                positions[offset:] = tree_positions(start, trees[-1])
            else:
                trees.append(None)
            logits_indices += range(offset + n - k - 1, offset + n)
            rows.append((first, len(logits_indices)))
            drafted.append((seq, first, k))
            continue
        trees.append(None)
        if seq.state.request.output.return_context_logits:
            logits_indices += [offset + i for i in logit_positions(item)]
        elif item.samples:  # the chunk reaches the end: its last logits sample
            logits_indices.append(offset + n - 1)
        rows.append((first, len(logits_indices)))
        if item.samples and seq.state.request.sampling.beam_width <= 1:  # not is_beam_search
            sampling.append((seq, len(logits_indices) - 1))
    slot = sampled_tokens_slot if sampling else -1
    batch = ForwardBatch(token_ids, positions, seq_lens, context_lens, tables, logits_indices, slot,
                         lora_slots if any(s >= 0 for s in lora_slots) else None)
    if any(tree is not None for tree in trees):
        batch.tree_parents = trees
    if state_slots is not None:
        batch.state_slots = state_slots.slots_of(plan.scheduled)
    return batch, rows, sampling, drafted


def prompt_embeds_of(plan: SchedulerOutput, vocab_size: int) -> PromptEmbeds | None:
    """The prompt-table rows of this step's chunks (in pack_batch's packing order): every
    scheduled prompt token whose id is vocab_size + row takes that row of its request's table."""
    pieces, offset = [], 0
    for item in plan.scheduled:
        seq, start, n = item.seq, item.start, item.num_new_tokens
        table = seq.state.request.prompt_table
        if table is not None and start < seq.num_prompt_tokens:
            pieces.append((offset, seq.token_ids[start:min(start + n, seq.num_prompt_tokens)], table))
        offset += n
    return gather_prompt_embeds(pieces, vocab_size) if pieces else None


def logit_positions(item) -> list[int]:
    """Chunk-relative tokens whose logits are needed, for a request that returns context logits (pack_batch
    calls it for those alone): new prompt positions, then the last."""
    seq, start, n = item.seq, item.start, item.num_new_tokens
    state = seq.state
    wanted = []
    if seq is state.sequences[0]:
        have = sum(len(part) for part in state.context_logits_parts)
        wanted = [p - start for p in range(max(start, have), min(start + n, seq.num_prompt_tokens))]
    if item.samples and (not wanted or wanted[-1] != n - 1):
        wanted.append(n - 1)
    return wanted
