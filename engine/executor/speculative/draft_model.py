"""Draft-model drafts: a second, smaller engine with the target's tokenizer proposes k tokens greedily.

The draft runs in the executor's process on the target's device, with its own ModelRunner, its own
paged KV pool and BlockManager, and (on CUDA) its own decode CUDA graphs. Per target sequence it
keeps a ``_DraftSeq``: which positions of its pool hold the target's tokens, and which hold its own
drafts of the last proposal. Each ``propose``:

    target tokens:  [ t0 ... t(L-1) ]                       (L = len(seq.token_ids), all known)
    draft KV:       [ t0 ... t(c-1) | stale drafts ]         c <= L - 1: the prefix still true
    1. roll back:   drafts the target did not keep lose their KV (num_computed_tokens = c, blocks
                    past it freed), exactly as the target rolls back rejected drafts;
    2. catch up:    one batched forward over t(c) ... t(L-1) of every sequence (the prompt the first
                    time; afterwards the tokens accepted/emitted since: 1, or 2 when all k drafts
                    were kept), chunked by the draft's max_num_tokens; the last row's logits give d1;
    3. decode:      k - 1 batched 1-token steps (d1 -> d2 -> ... -> dk), which on CUDA
                    replay the draft's decode graphs (ModelRunner.forward picks them for 1-token
                    batches of at most the draft's max_batch_size rows, so steps are cut to that).

After a proposal the draft KV holds t0 ... t(L-1) d1 ... d(k-1) (dk has none). The last known token
always runs again in step 2 (c <= L - 1): its logits give d1, so a proposal the target never
verified (its drafts cut by the token budget, or the sequence preempted) costs one recomputed
position, never a wrong one.

A greedy request's drafts are the draft model's argmax. A sampled request's are drawn from the draft
model's own law under the request's temperature, top-k and top-p (q: softmax of the draft's logits
over temperature, outside the top-k and the top-p nucleus masked), each with a generator seeded by
the sequence's seed and step, apart from the verify step's; q rides with them (Sequence.draft_probs)
and the verify step keeps draft d with probability min(1, p(d) / q(d)) (acceptance.py), which keeps
the target's law whatever q is and accepts 1 - TV(p, q) of the drafts on average. Argmax drafts,
judged as point masses, are accepted with probability p(d) only: for a draft close to its target at
temperature 1 that is far less (tests/executor/test_speculative_draft_model.py measures both).

The pool (``start``): as many tokens as the target's pool, so every sequence the target holds fits
(the target's pool bounds the running sequences' tokens), plus one proposal's drafts and a partial
block per batch slot. On CUDA the executor sizes both pools from the same free memory: the target
takes ``target_kv_share`` (its per-token KV bytes over both models' per-token bytes) of
kv_cache_free_gpu_mem_fraction, the draft's pool then fits in the rest. Should the draft pool still
run short (prefix sharing differs between the pools), a sequence gets fewer drafts, or none, that
step; its ids are unaffected. Prefix reuse follows the executor's enable_kv_cache_reuse: only full
blocks of true tokens before the last one are registered, so a rollback never rewrites a shared block.
"""
from __future__ import annotations

import hashlib
import json
import os

import torch

from engine.config import EngineConfig, EngineFormatError
from engine.executor.kv_cache import BlockManager, chain_block_hashes
from engine.executor.request import Sequence
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.sampler import draw_settings, sampling_law
from engine.executor.speculative.proposer import ProposerConfigError, draft_room

FIELD = "SpeculativeConfig.draft_engine_dir"
# Added to a sampled sequence's seed stream for its drafts, so the drafts' draws and the verify
# step's (verify.py: seed * 1_000_003 + tokens generated) never share a generator state.
DRAFT_STREAM_OFFSET = 0x5DEECE66D


class _DraftSeq:
    """The draft model's KV of one target sequence (kv_cache.SequenceBlocks).

    Invariant: KV positions [0, num_true) hold ``token_ids[:num_true]`` (the target's tokens) and
    positions [num_true, num_computed_tokens) hold ``drafts``: num_computed_tokens == num_true + len(drafts).
    ``token_ids`` is the target sequence's own list, read only: it names the true tokens and hashes them.
    """

    def __init__(self, token_ids: list[int]):
        self.token_ids = token_ids
        self.num_computed_tokens = 0
        self.num_true = 0
        self.drafts: list[int] = []
        self.block_ids: list[int] = []
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.num_window_freed_blocks = 0  # (never freed by window here: the kernels mask it)
        # The proposal under way, for a sampled request (None: greedy, argmax drafts): its
        # (temperature, top_k, top_p), generator, and the law of each draft drawn so far (vocab,) on the CPU.
        self.law: tuple[float, int, float] | None = None
        self.generator: torch.Generator | None = None
        self.draft_probs: list[torch.Tensor] = []


class DraftModelProposer:
    """DraftProposer over a draft engine; ``start`` must run once the target's pool is sized."""

    def __init__(self, draft_engine_dir: str, *, target_engine_dir: str, target_runner, enable_reuse: bool = True,
                 kv_cache_dtype: str | None = None):
        check_draft_engine(draft_engine_dir, target_engine_dir, target_runner.vocab_size)
        self.engine_dir = draft_engine_dir
        self.runner = ModelRunner(draft_engine_dir, device=target_runner.device)  # same device, by construction
        self.vocab_size = self.runner.vocab_size
        self.max_seq_len = self.runner.build_config.max_seq_len
        self.max_batch_size = self.runner.build_config.max_batch_size  # rows per 1-token step (graph buckets)
        self.max_num_tokens = self.runner.build_config.max_num_tokens  # tokens per catch-up forward
        self.enable_reuse = enable_reuse
        self.kv_cache_dtype = kv_cache_dtype
        # Per-token KV bytes of each model (rank 0's shard for a tensor-parallel target: its device holds the draft).
        target_bytes = target_runner.kv_block_bytes_for(kv_cache_dtype or "auto") / target_runner.tokens_per_block
        draft_bytes = self.runner.kv_block_bytes_for(kv_cache_dtype or "auto") / self.runner.tokens_per_block
        self.target_kv_share = target_bytes / (target_bytes + draft_bytes)
        self.blocks: BlockManager | None = None
        self._seqs: dict[int, _DraftSeq] = {}  # target seq_id -> its draft KV

    def start(self, num_target_kv_tokens: int, max_batch_size: int, max_draft_len: int) -> None:
        """Allocate the draft pool (see the module docstring), then capture its CUDA graphs (CUDA:
        GEMM choice, decode graphs per batch bucket, prefill graphs; CPU: no-op) and warm it up."""
        T = self.runner.tokens_per_block
        slack = max_batch_size * (-(-max_draft_len // T) + 1)  # each slot: its drafts' blocks + a partial one
        num_blocks = -(-num_target_kv_tokens // T) + slack
        self.runner.allocate_kv_cache(num_blocks, kv_cache_dtype=self.kv_cache_dtype)
        self.blocks = BlockManager(num_blocks, T, self.enable_reuse)
        self.runner.capture_cuda_graphs()
        self.runner.warmup()

    # ----- DraftProposer -----
    def propose(self, seqs: list[Sequence], max_draft_len: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        planned = []  # (index in seqs, its _DraftSeq, L, k)
        reclaimed = False
        for i, seq in enumerate(seqs):
            L = len(seq.token_ids)
            room = min(draft_room(seq, max_draft_len), self.max_seq_len - L + 1)  # positions < draft max_seq_len
            if L > self.max_seq_len:
                self.release(seq)  # it only grows: the draft can never follow it again
                continue
            if seq.num_unresolved_tokens or room <= 0:
                continue
            state = self._sync(seq, L)
            k = self._reserve(state, L, room)
            if k < room and not reclaimed:  # the pool is short: take back what idle sequences hold, once
                reclaimed = True
                self._reclaim({s.seq_id for s in seqs})
                k = self._reserve(state, L, room)
            if k:
                self._begin_proposal(state, seq)
                planned.append((i, state, L, k))
        if not planned:
            return drafts
        for (i, _, _, _), first in zip(planned, self._catch_up([(state, L) for _, state, L, _ in planned])):
            drafts[i].append(first)
        self._decode([(drafts[i], state, L, k) for i, state, L, k in planned])
        for i, state, _, _ in planned:
            seqs[i].draft_probs = torch.stack(state.draft_probs) if state.law is not None else None
            state.generator, state.draft_probs = None, []
        return drafts

    def _begin_proposal(self, state: _DraftSeq, seq: Sequence) -> None:
        """How this proposal's drafts are chosen: argmax for a greedy request (or a beam), else drawn
        with the request's settings from a generator of the sequence's own stream."""
        sampling = seq.state.request.sampling
        if sampling.is_greedy or seq.state.is_beam_search:
            state.law = None
            return
        state.law = draw_settings(sampling, self.vocab_size)
        seed = (seq.seed * 1_000_003 + seq.num_generated_tokens + DRAFT_STREAM_OFFSET) % (1 << 63)
        state.generator = torch.Generator().manual_seed(seed)
        state.draft_probs = []

    def _pick(self, states: list[_DraftSeq], logits: torch.Tensor) -> list[int]:
        """Each row's next draft (logits (rows, vocab), row i that of states[i]): the argmax, or for a
        sampled request a draw from q = softmax(top-k/top-p-masked logits / temperature), whose row
        joins the state's draft_probs. The laws of a step's sampled rows are computed in one batch on
        the device and copied to the host once (the draws use the sequences' CPU generators)."""
        tokens = logits.argmax(dim=-1).tolist()
        sampled = [row for row, state in enumerate(states) if state.law is not None]
        if not sampled:
            return tokens
        laws = [states[row].law for row in sampled]
        device = logits.device
        limits = (None, None)  # (no sort over the vocabulary when no row has a top-k or top-p)
        if any(k < self.vocab_size or p < 1.0 for _, k, p in laws):
            limits = (torch.tensor([k for _, k, _ in laws], device=device),
                      torch.tensor([p for _, _, p in laws], device=device, dtype=torch.float32))
        probs = sampling_law(logits[torch.tensor(sampled, device=device), :self.vocab_size].float(),
                             torch.tensor([t for t, _, _ in laws], device=device), *limits).cpu()
        for row, q in zip(sampled, probs):
            state = states[row]
            tokens[row] = int(torch.multinomial(q.double(), 1, generator=state.generator))
            state.draft_probs.append(q)
        return tokens

    def release(self, seq: Sequence) -> None:
        state = self._seqs.pop(seq.seq_id, None)
        if state is not None:
            self.blocks.release(state)

    # ----- per-sequence KV -----
    def _sync(self, seq: Sequence, L: int) -> _DraftSeq:
        """``seq``'s draft KV rolled back to its longest prefix that is still the target's, and never
        past L - 1 (the last token runs again: its logits give the first draft)."""
        state = self._seqs.get(seq.seq_id)
        if state is not None and (state.token_ids is not seq.token_ids or L < state.num_true):
            self.release(seq)  # (not expected: a sequence's tokens only grow) start over
            state = None
        if state is None:
            state = self._seqs[seq.seq_id] = _DraftSeq(seq.token_ids)
            self.blocks.acquire_cached_prefix(state)  # prompt blocks other sequences computed (reuse on)
            state.num_true = state.num_computed_tokens
            return state
        matched = state.num_true
        for token in state.drafts:  # the drafts the target kept are its tokens now: their KV stays
            if matched >= L or seq.token_ids[matched] != token:
                break
            matched += 1
        keep = min(matched, L - 1)
        state.num_true = state.num_computed_tokens = keep
        state.drafts = []
        surplus = state.block_ids[self.blocks.blocks_for_tokens(keep):]
        if surplus:  # blocks past the kept positions (never registered: they hold positions >= L_prev - 1)
            del state.block_ids[-len(surplus):]
            self.blocks.free(surplus)
        return state

    def _reserve(self, state: _DraftSeq, L: int, room: int) -> int:
        """Blocks for positions [0, L + k - 1) (k drafts leave k - 1 with KV); k <= room, fewer when
        the pool is short (0: no drafts this step). Returns k; blocks already held for positions
        past L + k - 1 stay held (a second call after ``_reclaim`` only adds)."""
        T = self.blocks.tokens_per_block
        k = min(room, (len(state.block_ids) + self.blocks.num_free_blocks) * T - L + 1)
        if k <= 0:
            return 0
        needed = self.blocks.blocks_for_tokens(L + k - 1) - len(state.block_ids)
        if needed > 0:
            state.block_ids += self.blocks.allocate(needed)
        return k

    def _reclaim(self, asking: set[int]) -> None:
        """Free the draft KV of every sequence not asking for drafts now (preempted, or waiting for
        room): the pool is sized for the running sequences, and an idle one would otherwise keep its
        blocks until it ends. If it decodes again it starts over (prefix reuse may spare its prompt)."""
        for seq_id in [seq_id for seq_id in self._seqs if seq_id not in asking]:
            self.blocks.release(self._seqs.pop(seq_id))

    def _register(self, state: _DraftSeq, L: int) -> None:
        """Make the full blocks of true tokens before the last one findable (reuse on). The last
        token's block stays private: it is the one a later rollback may rewrite."""
        if not self.blocks.enable_reuse:
            return
        T = self.blocks.tokens_per_block
        num_full = min(L - 1, state.num_true) // T
        if num_full <= state.num_registered_blocks:
            return
        # (hashes of every full block of the target's tokens: all true; only the first num_full get registered)
        state.block_hashes = chain_block_hashes(state.token_ids, T, state.block_hashes)
        for i in range(state.num_registered_blocks, num_full):
            self.blocks.register(state.block_ids[i], state.block_hashes[i], tuple(state.token_ids[i * T:(i + 1) * T]))
        state.num_registered_blocks = num_full

    # ----- forwards -----
    def _catch_up(self, work: list[tuple[_DraftSeq, int]]) -> list[int]:
        """Run each sequence's positions [num_computed_tokens, L) (at least one), batched in forwards
        of at most max_num_tokens tokens and max_batch_size sequences (a long prompt is chunked);
        returns each sequence's first draft, chosen (``_pick``) from the logits after its last true token."""
        T = self.blocks.tokens_per_block
        firsts: list[int] = [-1] * len(work)
        pending = list(range(len(work)))
        while pending:
            token_ids, positions, seq_lens, context_lens, tables, logits_indices, ending = [], [], [], [], [], [], []
            budget = self.max_num_tokens
            for j in pending[:self.max_batch_size]:
                state, L = work[j]
                start = state.num_computed_tokens
                n = min(L - start, budget)
                if n <= 0:
                    break
                token_ids += state.token_ids[start:start + n]
                positions += range(start, start + n)
                seq_lens.append(n)
                context_lens.append(start + n)
                tables.append(state.block_ids[:-(-(start + n) // T)])
                budget -= n
                state.num_computed_tokens = state.num_true = start + n
                if start + n == L:
                    logits_indices.append(len(token_ids) - 1)
                    ending.append(j)
            logits = self.runner.forward(ForwardBatch(token_ids, positions, seq_lens, context_lens, tables,
                                                      logits_indices))
            for j, token in zip(ending, self._pick([work[j][0] for j in ending], logits) if ending else []):
                firsts[j] = token
                self._register(*work[j])
            pending = [j for j in pending if firsts[j] < 0]
        return firsts

    def _decode(self, work: list[tuple[list[int], _DraftSeq, int, int]]) -> None:
        """k - 1 1-token steps: each row feeds its newest draft (its KV joins the pool at
        position L + len(drafts) - 1) and appends the next (``_pick``). Rows whose k is reached drop out;
        steps are cut to max_batch_size rows so each is one decode-graph replay on CUDA."""
        T = self.blocks.tokens_per_block
        step = 1
        while True:
            rows = [(out, state, L) for out, state, L, k in work if k > step]
            if not rows:
                return
            for begin in range(0, len(rows), self.max_batch_size):
                chunk = rows[begin:begin + self.max_batch_size]
                token_ids, positions, context_lens, tables = [], [], [], []
                for out, state, L in chunk:
                    position = L + step - 1  # where out[-1] (draft number ``step``) goes
                    token_ids.append(out[-1])
                    positions.append(position)
                    context_lens.append(position + 1)
                    tables.append(state.block_ids[:-(-(position + 1) // T)])
                n = len(chunk)
                logits = self.runner.forward(ForwardBatch(token_ids, positions, [1] * n, context_lens, tables,
                                                          list(range(n))))
                for (out, state, _), token in zip(chunk, self._pick([state for _, state, _ in chunk], logits)):
                    state.drafts.append(out[-1])
                    state.num_computed_tokens += 1
                    out.append(token)
            step += 1

    # ----- checks -----
    @property
    def num_sequences(self) -> int:
        return len(self._seqs)


def check_draft_engine(draft_engine_dir: str, target_engine_dir: str, target_vocab_size: int) -> None:
    """Refuse, naming the field, a draft engine that cannot draft for this target: missing, tensor
    parallel, another vocabulary size, or (where both directories carry them) another tokenizer
    vocabulary or end token."""
    if not isinstance(draft_engine_dir, str) or not os.path.isdir(draft_engine_dir):
        raise ProposerConfigError(f"{FIELD} {draft_engine_dir!r} is not a directory; it must name the draft "
                                  "model's engine directory (python -m engine.build)")
    try:
        draft = EngineConfig.load(draft_engine_dir)
    except EngineFormatError as err:
        raise ProposerConfigError(f"{FIELD} {draft_engine_dir!r}: {err}") from None
    if draft.build.tp_size != 1:
        raise ProposerConfigError(f"{FIELD}: the draft engine's tp_size is {draft.build.tp_size}; a draft model "
                                  "runs on one device (build it with tp_size 1)")
    if draft.model.vocab_size != target_vocab_size:
        raise ProposerConfigError(f"{FIELD}: the draft engine's vocab_size ({draft.model.vocab_size}) differs from "
                                  f"the target's ({target_vocab_size}); a draft model needs the target's tokenizer")
    draft_vocab, target_vocab = _tokenizer_fingerprint(draft_engine_dir), _tokenizer_fingerprint(target_engine_dir)
    if draft_vocab and target_vocab and draft_vocab != target_vocab:
        raise ProposerConfigError(f"{FIELD}: the draft engine's tokenizer.json vocabulary (token -> id) differs from "
                                  "the target's; a draft model needs the target's tokenizer")
    draft_eos, target_eos = _eos_token(draft_engine_dir), _eos_token(target_engine_dir)
    if draft_eos and target_eos and draft_eos != target_eos:
        raise ProposerConfigError(f"{FIELD}: the draft engine's eos_token ({draft_eos!r}, tokenizer_config.json) "
                                  f"differs from the target's ({target_eos!r})")


def _tokenizer_fingerprint(engine_dir: str) -> str | None:
    """A hash of tokenizer.json's token -> id map (the model's vocab and the added tokens): what
    makes draft ids mean the same tokens. Formatting, merges and normalizers are left out."""
    path = os.path.join(engine_dir, "tokenizer.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    vocab = (data.get("model") or {}).get("vocab")
    added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens") or [])
    canonical = json.dumps([sorted(vocab.items()) if isinstance(vocab, dict) else vocab, added], ensure_ascii=False)
    return hashlib.sha256(canonical.encode()).hexdigest()


def _eos_token(engine_dir: str) -> str | None:
    path = os.path.join(engine_dir, "tokenizer_config.json")
    if not os.path.isfile(path):
        return None
    with open(path, encoding="utf-8") as f:
        eos = json.load(f).get("eos_token")
    return eos.get("content") if isinstance(eos, dict) else eos
