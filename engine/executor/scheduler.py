"""In-flight batching scheduler: which sequences run this iteration, and how many tokens each.

NOTE: there is no "prefill phase" and no "decode phase". Every sequence has
``num_computed_tokens`` (tokens with KV in the cache) and a target, ``len(token_ids)`` (every
token it knows). Each iteration hands out tokens so the first catches up with the second,
under two budgets: ``max_num_tokens`` tokens and ``max_batch_size`` sequences. A decoding
sequence needs 1 token; a new one needs its prompt (or, with chunked context, as much of it as
the budget allows); a preempted one needs prompt + output so far. Running sequences are served
first (decodes before prefill chunks, oldest first within each), then waiting ones are admitted in
FIFO order.

Policies:
- ``guaranteed_no_evict``: admit only if the free blocks, minus what running sequences may
  still claim to reach prompt + max_tokens, cover the newcomer's prompt + max_tokens. A running
  sequence then never runs out of blocks.
- ``max_utilization``: admit whenever the first chunk fits with a block per running sequence to
  spare. When a running sequence cannot get
  a block, preempt the newest running sequence (free its blocks, put it back at the head of
  the queue); it recomputes its tokens later, so nothing is lost.

Sliding windows: when every layer of the model has a window (``kv_window``, e.g. Mistral), each
step first returns to the pool the blocks of running sequences that fell out of it
(BlockManager.free_blocks_outside_window), so a long sequence holds about window / block size
blocks instead of its whole length. Not for requests with several sequences (num_return_sequences
> 1, beams: they share block-table prefixes), and never with a global layer (Gemma): that layer
reads every block. Admission under ``guaranteed_no_evict`` still reserves each sequence's full
length (a freed block is only returned early), so the policy's guarantee is unchanged.

Speculative decoding: a sequence may carry draft tokens (``Sequence.draft_token_ids``) to
verify after its known tokens; the chunk that reaches the end of those (a decode, or a prompt's
last chunk) takes them too, as many as the token budget allows (``num_draft_tokens``). Blocks
are allocated for them like any token; the executor hands back what the rejected ones used.

The scheduler never sees a tensor; the executor turns ``SchedulerOutput`` into a ForwardBatch.
"""
from __future__ import annotations

import bisect
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

from engine.executor.kv_cache import BlockManager
from engine.executor.request import Sequence, SequenceStatus

POLICIES = ("guaranteed_no_evict", "max_utilization")


@dataclass(slots=True)  # made once per sequence per step
class ScheduledSequence:
    seq: Sequence
    num_new_tokens: int  # tokens computed this step: positions start ... start + num_new_tokens - 1
    is_prefill: bool  # the chunk covers prompt tokens (context phase) rather than one decode token
    # Speculative decoding: the last num_draft_tokens of the chunk are seq.draft_token_ids[:n], placed
    # after the known tokens; the step verifies them (logits at each, and at the last known token).
    num_draft_tokens: int = 0
    start: int = field(init=False)  # seq.num_computed_tokens when scheduled
    samples: bool = field(init=False)  # the chunk reaches the end of the known tokens: its last logits give the next token

    def __post_init__(self) -> None:
        self.start = self.seq.num_computed_tokens
        self.samples = self.start + self.num_new_tokens - self.num_draft_tokens == len(self.seq.token_ids)


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledSequence] = field(default_factory=list)  # in forward-batch order
    preempted: list[Sequence] = field(default_factory=list)  # lost their blocks this step

    @property
    def is_empty(self) -> bool:
        return not self.scheduled

    @property
    def num_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def num_context_sequences(self) -> int:
        return sum(s.is_prefill for s in self.scheduled)

    @property
    def num_context_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled if s.is_prefill)


@dataclass
class _Budget:
    tokens: int
    seqs: int
    # An image span that waits for budget this step (chunk_limit < 0, engine/executor/image_spans.py):
    # ``image_room`` caps the running sequences after admissions, so the next step's decodes leave the
    # span its tokens; a request behind a *waiting* one starts only with its whole prompt (a partial
    # chunk would run before it next step, as running work is scheduled first).
    image_room: int | None = None
    waiting_image: object = None  # the sequence whose image waits (admission passes over it)

    def take(self, num_tokens: int) -> None:
        self.tokens -= num_tokens
        self.seqs -= 1


class Scheduler:
    """Owns the waiting queue and the running set; decides each iteration's batch."""

    def __init__(self, block_manager: BlockManager, *, max_batch_size: int, max_num_tokens: int,
                 policy: str = "guaranteed_no_evict", enable_chunked_context: bool = False,
                 static_batching: bool = False, kv_window: int | None = None, acquire_adapter=None,
                 state_slots=None):
        if policy not in POLICIES:
            raise ValueError(f"batch_scheduler_policy {policy!r} is not supported; allowed: {', '.join(POLICIES)}")
        self.blocks = block_manager
        self.max_batch_size = max_batch_size  # sequences in one step
        # Sequences running at once: max_batch_size, or more where several steps are in flight, each
        # with its own sequences (engine/pipeline/in_flight.py)
        self.max_running = max_batch_size
        self.max_num_tokens = max_num_tokens
        self.policy = policy
        self.enable_chunked_context = enable_chunked_context
        # (seq, tokens the budget allows) -> tokens of the chunk, or -n: none now, the image span it starts
        # needs n; set by the executor where chunks must not end inside an image span
        # (engine/executor/image_spans.py); None: the budget's
        self.chunk_limit: Callable[[Sequence, int], int] | None = None
        self.static_batching = static_batching  # TRT-LLM "v1": a batch runs to completion before the next forms
        self.kv_window = kv_window  # every layer's attention window (ModelConfig.kv_window); None: keep all blocks
        # LoRA: acquire_adapter(request_state, behind_a_waiter) -> False while the request must wait
        # for an adapter slot (_admit_waiting lets base-model requests pass); None: no adapters.
        self.acquire_adapter = acquire_adapter
        # Models with Mamba layers: a running sequence holds a state slot (engine/executor/state_cache.py
        # StateSlots), taken when it starts running, given back when it finishes or is preempted.
        self.state_slots = state_slots
        self.num_window_freed_blocks = 0  # cumulative blocks returned early by the window
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # sorted by arrival_order: the tail is the newest
        self._arrivals = 0
        self.num_preemptions = 0

    # ----- queue membership -----
    def add(self, seq: Sequence) -> None:
        seq.arrival_order = self._arrivals
        self._arrivals += 1
        seq.status = SequenceStatus.WAITING
        self.waiting.append(seq)

    def finish(self, seq: Sequence) -> None:
        """Remove ``seq`` wherever it is and free its blocks (finish, cancel, error)."""
        if seq.status is SequenceStatus.RUNNING:
            self.running.remove(seq)
        elif seq.status is SequenceStatus.WAITING and seq in self.waiting:
            self.waiting.remove(seq)
        if seq.block_ids:
            self.blocks.free(seq.block_ids)
        if self.state_slots is not None:
            self.state_slots.release(seq)
        seq.block_ids = []
        seq.num_registered_blocks = 0
        seq.num_window_freed_blocks = 0
        seq.status = SequenceStatus.FINISHED

    @property
    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    # ----- one iteration -----
    def schedule(self, max_seqs: int | None = None) -> SchedulerOutput:
        """``max_seqs``: fewer sequences than max_batch_size this step (several steps in flight)."""
        budget = _Budget(tokens=self.max_num_tokens, seqs=min(self.max_batch_size, max_seqs or self.max_batch_size))
        out = SchedulerOutput()
        if self.kv_window is not None:
            self._free_blocks_outside_window()
        self._schedule_running(budget, out)
        if not out.preempted:  # a pool that just forced a preemption has no room for newcomers
            self._admit_waiting(budget, out)
        return out

    def _schedule_running(self, budget: _Budget, out: SchedulerOutput) -> None:
        """Decodes first (oldest first), then running prefill chunks and recomputes."""
        decodes, chunks = [], []
        for seq in self.running:
            uncomputed = len(seq.token_ids) - seq.num_computed_tokens
            if uncomputed == 1 and len(seq.token_ids) < seq.max_total_tokens:
                # (at max_total_tokens its last token is still in flight: it stops there, see overlap.py)
                decodes.append(seq)
            elif uncomputed > 1:
                chunks.append(seq)
        self._schedule_decodes(decodes, budget, out)
        for seq in chunks:
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above to make room for an older sequence
            num_new = self._num_tokens_to_schedule(seq, budget)
            num_drafts = self._num_drafts_to_schedule(seq, num_new, budget)
            if num_new and self._append_or_preempt(seq, num_new + num_drafts, budget, out):
                out.scheduled.append(ScheduledSequence(seq, num_new + num_drafts, self._is_prefill(seq), num_drafts))
                budget.take(num_new + num_drafts)

    def _schedule_decodes(self, decodes: list[Sequence], budget: _Budget, out: SchedulerOutput) -> None:
        """One token each (plus its drafts, if it has any), oldest first: the loop above for
        num_new == 1, inlined because it runs once per sequence per step. A decode whose last block
        has a free slot needs no allocation."""
        T = self.blocks.tokens_per_block
        for seq in decodes:
            if budget.seqs == 0 or budget.tokens == 0:
                return  # the budget only shrinks: nobody after this one fits either
            if seq.status is not SequenceStatus.RUNNING:
                continue  # preempted above to make room for an older sequence
            if seq.draft_token_ids:  # speculative: 1 + k tokens, the drafts cut to the budget
                num_drafts = min(len(seq.draft_token_ids), budget.tokens - 1)
                if not self._append_or_preempt(seq, 1 + num_drafts, budget, out):
                    continue
                out.scheduled.append(ScheduledSequence(seq, 1 + num_drafts, False, num_drafts))
                budget.take(1 + num_drafts)
                continue
            if len(seq.block_ids) * T <= seq.num_computed_tokens and not self._append_or_preempt(seq, 1, budget, out):
                continue
            out.scheduled.append(ScheduledSequence(seq, 1, False))
            budget.tokens -= 1
            budget.seqs -= 1

    def _append_or_preempt(self, seq: Sequence, num_new: int, budget: _Budget, out: SchedulerOutput) -> bool:
        """Give seq its blocks, preempting the newest running sequences if needed; False if seq went.

        A victim may already be in this step's plan (a decode scheduled before an older prefill
        chunk): it is taken out of the plan and its budget given back.
        """
        while (new_blocks := self.blocks.append_slots(seq, num_new)) is None:
            victim = self.running[-1]
            self._preempt(victim)
            out.preempted.append(victim)
            for item in [item for item in out.scheduled if item.seq is victim]:
                out.scheduled.remove(item)
                budget.tokens += item.num_new_tokens
                budget.seqs += 1
            if victim is seq:
                return False
        self._count_allocation(seq, new_blocks, reused=0)
        return True

    def _admit_waiting(self, budget: _Budget, out: SchedulerOutput) -> None:
        if self.static_batching and any(s.num_generated_tokens for s in self.running):
            return  # the current static batch is decoding: nobody joins it
        promised = self._promised_blocks() if self.waiting and self.policy == "guaranteed_no_evict" else 0
        # A request whose adapter finds every slot held waits for one (acquire_adapter); base-model
        # requests behind it go on meanwhile, adapter requests behind it wait in their order (were
        # they to take slots, the first might never get one), and all keep their place at the head.
        passed_over: list[Sequence] = []
        while (self.waiting and budget.seqs > 0 and len(self.running) < self.max_running
               and (budget.image_room is None or len(self.running) < budget.image_room)
               and (self.state_slots is None or self.state_slots.num_free > 0)):
            seq = self.waiting[0]
            if self.policy == "guaranteed_no_evict" and not self._can_reserve(seq, promised):
                break
            if self.acquire_adapter is not None and not self.acquire_adapter(seq.state, bool(passed_over)):
                passed_over.append(self.waiting.popleft())
                continue
            reused = 0 if seq.block_ids else self.blocks.acquire_cached_prefix(seq)  # a fork holds its prefix
            num_new = self._num_tokens_to_schedule(seq, budget)
            if not num_new and budget.waiting_image is seq:  # its image waits for budget: the requests behind go on
                self.blocks.release(seq)
                passed_over.append(self.waiting.popleft())
                continue
            num_drafts = self._num_drafts_to_schedule(seq, num_new, budget)
            num_new += num_drafts
            new_blocks = self.blocks.append_slots(seq, num_new) if num_new and self._leaves_headroom(seq, num_new) else None
            if new_blocks is None:
                self.blocks.release(seq)  # hand back the prefix hits; they stay cached
                break
            self.waiting.popleft()
            self._count_allocation(seq, new_blocks, reused)
            self._start_running(seq)
            promised += self.blocks.blocks_for_tokens(seq.max_total_tokens) - len(seq.block_ids)
            out.scheduled.append(ScheduledSequence(seq, num_new, True, num_drafts))
            budget.take(num_new)
        self.waiting.extendleft(reversed(passed_over))

    # ----- helpers -----
    def _free_blocks_outside_window(self) -> None:
        """Blocks of running single-sequence requests that no future query can see go back to the
        pool. Safe with a step still in flight: its kernels were queued before any kernel of a
        later step can write a reallocated block (one stream, and the same order on every rank)."""
        for seq in self.running:
            if len(seq.state.sequences) == 1:
                self.num_window_freed_blocks += self.blocks.free_blocks_outside_window(seq, self.kv_window)

    def _num_tokens_to_schedule(self, seq: Sequence, budget: _Budget) -> int:
        """How many of seq's uncomputed tokens fit this iteration (0: skip it for now)."""
        remaining = seq.num_uncomputed_tokens
        if remaining == 0 or budget.seqs == 0 or budget.tokens == 0:
            return 0
        if remaining <= budget.tokens:
            return remaining
        if budget.waiting_image is not None and seq.status is SequenceStatus.WAITING:
            return 0  # behind a waiting image: whole prompts only (_Budget)
        # A recomputed stream longer than the whole budget could never run unchunked.
        if self.enable_chunked_context or remaining > self.max_num_tokens:
            if self.chunk_limit is None:
                return budget.tokens
            num_new = self.chunk_limit(seq, budget.tokens)
            if num_new < 0:  # an image span that needs -num_new tokens waits for the next step (_Budget)
                room = self.max_num_tokens + num_new
                budget.image_room = room if budget.image_room is None else min(room, budget.image_room)
                if seq.status is SequenceStatus.WAITING and budget.waiting_image is None:
                    budget.waiting_image = seq
                return 0
            return num_new
        return 0

    @staticmethod
    def _num_drafts_to_schedule(seq: Sequence, num_new: int, budget: _Budget) -> int:
        """Drafts ride with a chunk that reaches the end of the known tokens, as many as the token
        budget leaves room for (speculative decoding; none when the chunk stops short)."""
        if not seq.draft_token_ids or num_new != seq.num_uncomputed_tokens:
            return 0
        return max(0, min(len(seq.draft_token_ids), budget.tokens - num_new))

    def _leaves_headroom(self, seq: Sequence, num_new: int) -> bool:
        """max_utilization admits a newcomer only if a block per running sequence stays free, so the
        next decode steps do not at once preempt it again (admit -> preempt -> recompute churn).

        Only sequences with work count: a beam parked until its sibling beams catch up must not
        keep those siblings out (that would wait forever).
        """
        if self.policy != "max_utilization":
            return True
        left = self.blocks.num_free_blocks - self.blocks.num_new_blocks_needed(seq, num_new)
        return left >= sum(1 for s in self.running if s.num_uncomputed_tokens)

    def _is_prefill(self, seq: Sequence) -> bool:
        return seq.num_computed_tokens < len(seq.token_ids) - 1

    def _promised_blocks(self) -> int:
        """Blocks running sequences may still claim to reach prompt + max_tokens. Computed once per
        step and kept up to date as newcomers start (no running sequence grows while admitting)."""
        return sum(self.blocks.blocks_for_tokens(s.max_total_tokens) - len(s.block_ids) for s in self.running)

    def _can_reserve(self, seq: Sequence, promised: int) -> bool:
        return self.blocks.num_free_blocks - promised >= self.blocks.blocks_for_tokens(seq.max_total_tokens)

    def _start_running(self, seq: Sequence) -> None:
        seq.status = SequenceStatus.RUNNING
        if self.state_slots is not None:
            self.state_slots.acquire(seq)
        keys = [s.arrival_order for s in self.running]
        self.running.insert(bisect.bisect(keys, seq.arrival_order), seq)

    def _preempt(self, seq: Sequence) -> None:
        self.running.remove(seq)
        self.blocks.release(seq)
        if self.state_slots is not None:  # it recomputes from position 0, from a fresh state
            self.state_slots.release(seq)
        seq.status = SequenceStatus.WAITING
        self.waiting.appendleft(seq)
        self.num_preemptions += 1

    def _count_allocation(self, seq: Sequence, new_blocks: int, reused: int) -> None:
        perf = seq.state.perf
        perf.kv_cache_alloc_new_blocks += new_blocks
        perf.kv_cache_reused_blocks += reused
        perf.kv_cache_alloc_total_blocks += new_blocks + reused
