"""Multi-token prediction drafts (``decoding_mode mtp``): DeepSeek-V3's MTP module (the checkpoint's
layer num_layers; engine/models/deepseek.py ``DeepseekMtp``) drafts k tokens a step from the target's
own hidden states, chained as TensorRT-LLM's and SGLang's single-layer MTP do: the one module runs k
times, each run reading the hidden state and draft of the run before.

Slots. The module's row at slot p pairs the target's final-normed hidden state h_p (of token t_p)
with the embedding of t_{p+1}, at rotary position p + 1 (transformers' MtpModel: the MTP inputs are
the target's, shifted by one token), and guesses t_{p+2}. Its KV (one latent row per slot, in a pool
of its own) is kept per sequence::

    target tokens:   t_0 ... t_{L-1}                    (L = len(seq.token_ids), all known)
    target hiddens:  h_0 ... h_{L-2}                    (t_{L-1} has not run through the target yet)
    MTP slots:       0 ... c-1 true | c ... L-2 to run | L-1 ... L+k-3 chained drafts (rolled back)

Each ``propose`` rolls the chained slots back, runs slots c .. L-2 (the last one again when nothing is
new: its output gives d_1), then k - 1 chained 1-row steps: slot L-2+j reads (g_j, d_j) and gives
d_{j+1}, where g_j is the module's head-normed output at the slot before (what transformers' MtpLayer
hands the next layer). Drafts are the module's argmax (greedy or sampled requests alike: the verify
step judges them as point masses, which keeps the target's law).

Hidden states. The target's last layer is tapped (engine/executor/layer_taps.py: its residual
stream after every forward, CUDA graph replays included, decode and prefill graphs alike); after a
forward ``observe_batch`` final-norms those rows (the model's own last step, so they are the hidden
states the target's head reads) and files each scheduled chunk's rows (its known tokens, then the
drafts the step accepted) by position. A position whose hidden state never came (its KV reused from
the prefix cache) runs with a zero hidden state: the drafts get worse there, the output stays the
target's.

The pool holds as many slots as the target's pool holds tokens, plus each batch slot's drafts. A
sequence's slots are freed when it ends (finished, cancelled or failed: ``release``), or when the
pool runs short and it is not asking for drafts (preempted); then it starts over. With reuse on
(the executor's enable_kv_cache_reuse), full blocks of true rows made from the target's own hidden
states, before slot L-2's block, are registered under the chain hash of [(t_0, t_1), t_2, ...]
(slot p's row depends on t_0 .. t_{p+1}), and a sequence's first use acquires its cached prefix, so a
prefix-cache hit of the target mostly finds the module's rows too; rows made from zeros are never shared.
"""
from __future__ import annotations

import torch

from engine.executor.kv_cache import BlockManager
from engine.executor.request import Sequence
from engine.executor.runner import ForwardBatch, ModelRunner
from engine.executor.speculative.mtp_graphs import MtpGraphs, mtp_graphs_enabled
from engine.executor.speculative.proposer import ProposerConfigError, draft_room
from kernels.rmsnorm import rms_norm


class _MtpSeq:
    """One sequence's MTP slots and the target hidden states not yet run through the module.

    Invariants: slots [0, num_true) hold true rows (h_p, t_{p+1}); ``hidden`` holds h_p for
    p in [hidden_start, hidden_start + len(hidden)), p >= num_true - 1 once a proposal ran."""

    def __init__(self, hidden_size: int, dtype: torch.dtype, device: torch.device):
        self.block_ids: list[int] = []
        self.num_true = 0
        self.num_clean = 0  # slots [0, num_clean) ran on the target's own hidden states (none zeroed)
        self.hidden_start = 0
        self.hidden = torch.zeros(0, hidden_size, dtype=dtype, device=device)
        # The prefix cache (kv_cache.SequenceBlocks): slot p's row depends on t_0 .. t_{p+1}, so the
        # blocks are keyed by [(t_0, t_1), t_2, t_3, ...]: item p is what slot p adds to its prefix.
        self.token_ids: list = []
        self.num_computed_tokens = 0
        self.block_hashes: list[int] = []
        self.num_registered_blocks = 0
        self.num_window_freed_blocks = 0

    def follow_tokens(self, token_ids: list[int]) -> None:
        """Extend the cache keys with the target's tokens known so far (placeholders end them)."""
        if not self.token_ids and len(token_ids) >= 2 and min(token_ids[:2]) >= 0:
            self.token_ids.append((token_ids[0], token_ids[1]))
        for token in token_ids[len(self.token_ids) + 1:] if self.token_ids else []:
            if token < 0:
                break
            self.token_ids.append(token)

    def file_hidden(self, start: int, rows: torch.Tensor) -> None:
        """Rows (n, H) are the target's hidden states at positions start .. start + n - 1; they
        replace what was filed there and after (a recompute), a gap before them is zeros."""
        end = self.hidden_end
        rows = rows.to(self.hidden.dtype)
        if not self.hidden.shape[0] or start < self.hidden_start:
            self.hidden_start, self.hidden = start, rows.clone()
            return
        kept = self.hidden[:start - self.hidden_start]
        gap = self.hidden.new_zeros(max(0, start - end), self.hidden.shape[1])
        self.hidden = torch.cat([kept, gap, rows])

    def hidden_rows(self, first: int, end: int) -> torch.Tensor:
        """h_p for p in [first, end): filed rows, zeros where none came (then num_clean stops at
        ``first`` for good: those slots' rows are not offered to other sequences)."""
        out = self.hidden.new_zeros(end - first, self.hidden.shape[1])
        lo, hi = max(first, self.hidden_start), min(end, self.hidden_end)
        if lo < hi:
            out[lo - first:hi - first] = self.hidden[lo - self.hidden_start:hi - self.hidden_start]
        if self.num_clean == first and lo == first and hi == end:
            self.num_clean = end
        return out

    @property
    def hidden_end(self) -> int:
        return self.hidden_start + self.hidden.shape[0]

    def forget_hidden_before(self, position: int) -> None:
        if position > self.hidden_start:
            self.hidden = self.hidden[position - self.hidden_start:]
            self.hidden_start = position


class MtpProposer:
    """The DraftProposer of decoding_mode mtp (proposer.py's interface, plus ``observe_batch`` and
    ``start``, which the executor calls where a proposer has them)."""

    def __init__(self, runner: ModelRunner, *, kv_cache_dtype: str | None = None, enable_reuse: bool = True):
        self.runner, self.model = runner, runner.model
        self.enable_reuse = enable_reuse
        self.mtp = runner.model.mtp
        self.tokens_per_block = runner.tokens_per_block
        self.max_num_tokens = runner.build_config.max_num_tokens
        self.kv_cache_dtype = kv_cache_dtype
        self.hidden_size = runner.model_config.hidden_size
        self.target_kv_share = runner.kv_layers / (runner.kv_layers + 1)  # the MTP pool: one layer's rows
        self.kv_cache: torch.Tensor | None = None
        self.blocks: BlockManager | None = None
        self.graphs: MtpGraphs | None = None  # CUDA: captured at the first run (mtp_graphs.py)
        self._graph_shape: tuple[int, int] | None = None  # (max_batch_size, max_draft_len), set by start
        self._seqs: dict[int, _MtpSeq] = {}
        # Before the runner captures its graphs (the executor makes proposers first), so that every
        # graph keeps the last layer's stream as a static output too.
        self.taps = runner.tap_layers([len(runner.model.layers) - 1])

    def _last_hidden(self) -> torch.Tensor | None:
        """The last target forward's final-normed hidden states (tokens, hidden), read once (None: no
        forward since the last read)."""
        streams = self.taps.take()
        if streams is None:
            return None
        with torch.inference_mode():
            return rms_norm(streams[0], self.model.norm.weight, self.model.config.norm_eps)[0]

    def close(self) -> None:
        self.taps.close()

    def start(self, num_target_kv_tokens: int, max_batch_size: int, max_draft_len: int) -> None:
        """The MTP pool: a slot per target pool token, plus each batch slot's drafts and a partial block."""
        T = self.tokens_per_block
        num_blocks = -(-num_target_kv_tokens // T) + max_batch_size * (-(-max_draft_len // T) + 1)
        planes, heads, width = self.model.kv_pool_dims
        dtype = self.runner.kv_cache_torch_dtype(self.kv_cache_dtype)
        self.kv_cache = torch.zeros((1, planes, num_blocks, heads, T, width), dtype=dtype,
                                    device=self.runner.device).transpose(3, 4)  # the runner's pool layout
        self.blocks = BlockManager(num_blocks, T, enable_reuse=self.enable_reuse)
        self._graph_shape = (max_batch_size, max_draft_len)

    # ----- hidden states -----
    def observe_batch(self, scheduled: list, verified: dict | None) -> None:
        """File each scheduled chunk's target hidden states: its known tokens' rows, then those of
        the drafts the step accepted (a chain: the first num_accepted). A sequence holding more than
        max_num_tokens rows not yet run (a long prompt, or one that never drafts) runs them now, as
        far as its tokens are known, so the rows kept stay bounded."""
        rows = self._last_hidden()
        if rows is None or rows.shape[0] != sum(item.num_new_tokens for item in scheduled):
            return  # no target forward of these tokens: those positions run with zeros
        offset, advance = 0, []
        for item in scheduled:
            seq, n, k = item.seq, item.num_new_tokens, item.num_draft_tokens
            chunk = rows[offset:offset + n]
            offset += n
            if seq.grammar is not None or seq.state.is_beam_search:
                continue  # never drafts
            v = verified.get(seq.seq_id) if verified and k else None
            keep = n - k + (v.num_accepted if v is not None else 0)
            state = self._state(seq)
            state.file_hidden(item.start, chunk[:keep])
            upto = min(state.hidden_end, len(seq.token_ids) - 1)  # slots whose next token is known
            if state.hidden_end - state.num_true > self.max_num_tokens and upto > state.num_true \
                    and self._reserve_slots(state, upto):
                advance.append((state, seq.token_ids, upto + 1))
        if advance:
            self._catch_up(advance)

    # ----- DraftProposer -----
    def propose(self, seqs: list[Sequence], max_draft_len: int) -> list[list[int]]:
        drafts: list[list[int]] = [[] for _ in seqs]
        planned = []  # (index in seqs, state, L, k)
        reclaimed = False
        for i, seq in enumerate(seqs):
            L = len(seq.token_ids)
            room = draft_room(seq, max_draft_len)
            if seq.num_unresolved_tokens or room <= 0 or L < 2:
                continue
            state = self._state(seq)
            state.num_true = min(state.num_true, L - 2)  # drafts rolled back; slot L-2 runs (again)
            k = self._reserve(state, L, room)
            if k < room and not reclaimed:  # short: take back what sequences not decoding now hold, once
                reclaimed = True
                self._reclaim({s.seq_id for s in seqs})
                k = self._reserve(state, L, room)
            if k:
                planned.append((i, state, L, k))
        if not planned:
            return drafts
        tokens = {i: seqs[i].token_ids for i, _, _, _ in planned}
        outputs = self._catch_up([(state, tokens[i], L) for i, state, L, _ in planned])
        chains = [(drafts[i], state, L, k, g) for (i, state, L, k), g in zip(planned, outputs)]
        for out, _, _, _, g in chains:
            out.append(self._argmax(g[None])[0])
        self._chain(chains)
        return drafts

    def _state(self, seq: Sequence) -> _MtpSeq:
        """``seq``'s slots; a new one starts with the cached blocks of its prefix (reuse on)."""
        state = self._seqs.get(seq.seq_id)
        if state is None:
            state = self._seqs[seq.seq_id] = _MtpSeq(self.hidden_size, self.runner.dtype, self.runner.device)
            state.follow_tokens(seq.token_ids)
            if state.token_ids:
                self.blocks.acquire_cached_prefix(state)  # leaves slot L-2's block private
                state.num_true = state.num_clean = state.num_computed_tokens
        return state

    def _register(self, state: _MtpSeq, token_ids: list[int]) -> None:
        """Make findable the full blocks of true rows made from the target's own hidden states,
        before slot L-2's block (which the next proposal writes again)."""
        state.follow_tokens(token_ids)
        state.num_computed_tokens = min(state.num_clean, state.num_true, len(state.token_ids))  # what may be shared
        self.blocks.register_computed_blocks(state)

    def release(self, seq: Sequence) -> None:
        state = self._seqs.pop(seq.seq_id, None)
        if state is not None and self.blocks is not None:
            self.blocks.free(state.block_ids)
            state.block_ids = []

    @property
    def num_sequences(self) -> int:
        return len(self._seqs)

    # ----- slots -----
    def _reserve(self, state: _MtpSeq, L: int, room: int) -> int:
        """Blocks for slots [0, L + k - 2) (slot L-2 and k - 1 chained ones); k <= room, fewer when the
        pool is short (0: no drafts). Blocks past what the k needs stay with the sequence."""
        T = self.blocks.tokens_per_block
        k = min(room, (len(state.block_ids) + self.blocks.num_free_blocks) * T - L + 2)
        return k if k > 0 and self._reserve_slots(state, L + k - 2) else 0

    def _reserve_slots(self, state: _MtpSeq, num_slots: int) -> bool:
        """Blocks for slots [0, num_slots); False (nothing taken) when the pool is short."""
        needed = self.blocks.blocks_for_tokens(num_slots) - len(state.block_ids)
        if needed > self.blocks.num_free_blocks:
            return False
        if needed > 0:
            state.block_ids += self.blocks.allocate(needed)
        return True

    def _reclaim(self, asking: set[int]) -> None:
        for seq_id in [seq_id for seq_id in self._seqs if seq_id not in asking]:
            state = self._seqs.pop(seq_id)
            self.blocks.free(state.block_ids)

    # ----- forwards -----
    def _run(self, rows: list[tuple[_MtpSeq, list[int], list[int], torch.Tensor]]) -> torch.Tensor:
        """One forward of the module: per sequence (state, slots (consecutive), input tokens, previous
        hidden (n, H)) -> head-normed outputs (sum n, H), rows in order."""
        T = self.tokens_per_block
        token_ids, slots, seq_lens, context_lens, tables = [], [], [], [], []
        for state, seq_slots, inputs, _ in rows:
            token_ids += inputs
            slots += seq_slots
            seq_lens.append(len(seq_slots))
            context_lens.append(seq_slots[-1] + 1)
            tables.append(state.block_ids[:-(-(seq_slots[-1] + 1) // T)])
        batch = ForwardBatch(token_ids, slots, seq_lens, context_lens, tables, list(range(len(token_ids))))
        previous = torch.cat([hidden for _, _, _, hidden in rows]).to(self.runner.device)
        graphs = self._graphs()
        if graphs is not None:
            out = graphs.try_run(batch, previous)
            if out is not None:
                return out
        ids, slot_positions, meta = self.runner.attention_inputs(batch)
        with torch.inference_mode():
            embeds = self.model.embed_tokens(ids)
            return self.mtp(embeds, previous, slot_positions + 1, self.model.cos_sin_cache, self.kv_cache, meta)

    def _graphs(self) -> MtpGraphs | None:
        """The module's CUDA graphs, captured at the first run after the runner captured its own (its
        kernel choices made); multi-row graphs only where the runner has prefill graphs. None: eager."""
        if (self.graphs is None and self.runner.decode_graphs is not None and self._graph_shape is not None
                and mtp_graphs_enabled()):
            max_batch_size, max_draft_len = self._graph_shape
            self.graphs = MtpGraphs(self.runner, self.kv_cache, max_batch_size=max_batch_size,
                                    max_num_tokens=self.max_num_tokens, max_draft_len=max_draft_len,
                                    multi_row=self.runner.prefill_graphs is not None)
            self.graphs.capture()
        return self.graphs

    def _argmax(self, g: torch.Tensor) -> list[int]:
        with torch.inference_mode():
            logits = self.model.compute_logits(g)
        return logits[:, :self.runner.vocab_size].argmax(dim=-1).tolist()

    def _catch_up(self, work: list[tuple[_MtpSeq, list[int], int]]) -> list[torch.Tensor]:
        """Run each sequence's slots [num_true, L-1) with the target's hidden states, in forwards of
        at most max_num_tokens rows (a long prompt in chunks); returns each one's output at slot L-2."""
        last: list[torch.Tensor | None] = [None] * len(work)
        pending = list(range(len(work)))
        while pending:
            rows, ending, budget = [], [], self.max_num_tokens
            for j in pending:
                state, token_ids, L = work[j]
                first = state.num_true
                n = min(L - 1 - first, budget)
                if n <= 0:
                    break
                slots = list(range(first, first + n))
                rows.append((state, slots, token_ids[first + 1:first + n + 1], state.hidden_rows(first, first + n)))
                budget -= n
                state.num_true = first + n
                if state.num_true == L - 1:
                    ending.append((j, sum(len(r[1]) for r in rows) - 1))
            g = self._run(rows)
            for j, row in ending:
                last[j] = g[row]
                state, token_ids, L = work[j]
                state.forget_hidden_before(L - 2)  # kept: slot L-2 may run again
                state.num_true -= 1  # (slot L-2's block stays private while _register looks)
                self._register(state, token_ids)
                state.num_true += 1
            pending = [j for j in pending if last[j] is None]
        return last

    def _chain(self, chains: list[tuple[list[int], _MtpSeq, int, int, torch.Tensor]]) -> None:
        """k - 1 batched 1-row steps: slot L-2+j reads (g_j, d_j) and gives d_{j+1}; chained slots
        are never true (the next propose starts again at slot L'-2 <= their first)."""
        current = [[out, state, L, k, g] for out, state, L, k, g in chains]
        step = 1
        while True:
            active = [c for c in current if c[3] > step]
            if not active:
                return
            g = self._run([(state, [L - 2 + step], [out[-1]], g[None]) for out, state, L, _, g in active])
            for c, token, row in zip(active, self._argmax(g), g):
                c[0].append(token)
                c[4] = row
            step += 1


def start_mtp(runner, *, has_state: bool, kv_cache_dtype: str | None = None, enable_reuse: bool = True
              ) -> MtpProposer:
    """The proposer of ``decoding_mode mtp``, or ProposerConfigError naming what is missing."""
    if not isinstance(runner, ModelRunner) or runner.build_config.tp_size > 1 or runner.build_config.pp_size > 1:
        raise ProposerConfigError("decoding_mode mtp runs on one rank (tp_size 1, pp_size 1) in this release")
    if has_state or not hasattr(runner.model, "mtp"):
        raise ProposerConfigError(
            f"decoding_mode mtp needs an engine with a multi-token prediction module: "
            f"{runner.model_config.architecture} engine has none (num_nextn_predict_layers 0; DeepSeek-V3/R1 "
            f"checkpoints as shipped hold one at layer num_hidden_layers, which transformers drops when it saves)")
    return MtpProposer(runner, kv_cache_dtype=kv_cache_dtype, enable_reuse=enable_reuse)
