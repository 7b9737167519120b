"""Lookahead decoding (Fu et al. 2024): drafts from the target's own Jacobi iterations, no extra weights.

Per sequence, three sizes (TensorRT-LLM's LookaheadDecodingConfig names): window size W, n-gram size
N, verification set size G. Each greedy step is ONE target forward over one token tree
(tree verification: speculative/tree.py, tree_batch.py) holding two branches below the root (the
sequence's last known token, at position t):

- the verification branch: up to G n-grams from the sequence's n-gram pool whose first token is the
  root's token, each an (N-1)-token chain below the root (shared prefixes merged into a trie);
- the lookahead branch: the 2-D Jacobi window of N-1 levels x W columns. Level k, column c holds a
  guess for position t + 1 + c + k. Level 0 is a chain under the root (column c's parent is column
  c-1); level k >= 1, column c hangs below level k-1, column c. So every node sees the prefix, level 0
  up to its diagonal's start, and the diagonal itself: the paper's lookahead attention mask, which is
  a tree, rotated at root position + depth = t + 1 + c + k as the paper places it.

      root ── a0 ── a1 ── a2        level 0 (W = 3)             parents: a0 <- root, a_c <- a_{c-1}
               └ b0   └ b1   └ b2   level 1 (N = 3)             b_c <- a_c

The target's argmax at every node comes back with the verification (``Verified.node_argmax``):
- acceptance is tree verification's greedy longest path over the whole tree (a window path that
  happens to match the target is accepted too), so greedy ids equal plain decoding's;
- the lookahead branch advances one Jacobi iteration: for each column c, the n-gram
  (level_0[c], level_1[c], ..., level_{N-2}[c], argmax at level_{N-2}[c]) enters the pool keyed by
  its first token, and the window shifts up a level (level k <- level k+1; the last level <- the
  argmaxes at the old last level), i.e. one column left, as the decoded sequence moves on.

The pool also takes the n-grams of the sequence's own tokens (prompt and accepted output, as the
reference implementation's pool-from-prompt option). It holds at most G n-grams per first token,
the most recently made first. Window guesses start as tokens drawn from the prompt (seeded by the
sequence id). A tree has (N-1) * (W + G) drafts at most (TensorRT-LLM's budget), truncated in
topological order (verification first) where the sequence has less room.

Sampled requests verify the same tree by multi-draft rejection sampling (acceptance.py
``accept_tree_by_rejection``, the paper's sampling verification): the target's law is kept. Their
window advances with the argmax of the target's processed logits (the Jacobi step is greedy).
"""
from __future__ import annotations

import random
from collections import OrderedDict
from dataclasses import dataclass

from engine.executor.lookahead_sizes import LookaheadConfigError, LookaheadSizes, sizes_of_config
from engine.executor.speculative.proposer import ProposerConfigError, draft_room, refuse_unless_one_rank_without_state


class NgramPool:
    """first token -> up to ``capacity`` continuations of N - 1 tokens, most recent first."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self._by_key: dict[int, OrderedDict[tuple[int, ...], None]] = {}

    def add(self, ngram: tuple[int, ...]) -> None:
        if self.capacity <= 0:
            return
        entries = self._by_key.setdefault(ngram[0], OrderedDict())
        entries[ngram[1:]] = None
        entries.move_to_end(ngram[1:], last=False)  # most recent first
        while len(entries) > self.capacity:
            entries.popitem(last=True)

    def candidates(self, key: int) -> list[tuple[int, ...]]:
        return list(self._by_key.get(key, ()))


class _LookaheadState:
    """One sequence's pool, Jacobi window and where the last tree put the window's nodes."""

    def __init__(self, sizes: LookaheadSizes, prompt: list[int], seed: int):
        W, N = sizes.window_size, sizes.ngram_size
        self.sizes, self.pool = sizes, NgramPool(sizes.verification_set_size)
        draw = random.Random(seed)
        self.levels = [[draw.choice(prompt) for _ in range(W)] for _ in range(N - 1)]  # (N-1, W) guesses
        self.num_indexed = 0  # the sequence's tokens whose n-grams are in the pool
        self.window_nodes: list[list[int]] | None = None  # [level][column] -> node index (1-based) in the last tree

    def index_text(self, token_ids: list[int], length: int) -> None:
        """Pool the n-grams of token_ids[:length] not pooled yet (each once, when its last token arrives)."""
        n = self.sizes.ngram_size
        for end in range(max(self.num_indexed + 1, n), length + 1):  # the one ending at num_indexed is in
            self.pool.add(tuple(token_ids[end - n:end]))
        self.num_indexed = max(self.num_indexed, length)


def build_tree(sizes: LookaheadSizes, candidates: list[tuple[int, ...]], levels: list[list[int]],
               room: int) -> tuple[list[int], list[int], list[list[int]] | None]:
    """(parents, tokens, window_nodes) of one step's drafts, at most ``room`` of them; parents index
    the drafts (-1: the root). Candidates become a trie below the root, then the window (see the
    module docstring); window_nodes[k][c] is level k column c's node (1-based: node 0 is the root),
    None when the window did not fit."""
    parents, tokens, trie = [], [], {}
    for ngram in candidates[:sizes.verification_set_size]:
        parent = -1
        for token in ngram:
            node = trie.get((parent, token))
            if node is None:
                node = trie[(parent, token)] = len(tokens)
                parents.append(parent)
                tokens.append(token)
            parent = node
    W, levels_n = sizes.window_size, len(levels)
    if len(tokens) + W * levels_n > room:
        return parents[:room], tokens[:room], None
    window = [[0] * W for _ in range(levels_n)]
    for k in range(levels_n):
        for c in range(W):
            parent = (window[0][c - 1] if c else -1) if k == 0 else window[k - 1][c]
            window[k][c] = len(tokens)
            parents.append(parent)
            tokens.append(levels[k][c])
    return parents, tokens, [[node + 1 for node in row] for row in window]


class LookaheadProposer:
    """The executor's DraftProposer for ``decoding_mode lookahead`` (proposer.py's interface), plus
    ``observe_verified``: the target's argmax at each node, after verification."""

    drafts_trees = True  # verify steps replay the tree graphs (runner.tree_graph_width)

    def __init__(self, sizes: LookaheadSizes):
        self.sizes = sizes.check()
        self._states: dict[int, _LookaheadState] = {}

    def sizes_of(self, seq) -> LookaheadSizes:
        """The request's own sizes (each within the executor's) or the executor's."""
        return getattr(seq.state.request, "lookahead_config", None) or self.sizes

    def propose(self, seqs: list, max_draft_len: int) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            seq.draft_parents = None
            length = len(seq.token_ids) - seq.num_unresolved_tokens  # placeholders are not tokens yet
            state = self._states.get(seq.seq_id)
            if state is None:
                sizes = self.sizes_of(seq)
                state = self._states[seq.seq_id] = _LookaheadState(sizes, seq.token_ids[:seq.num_prompt_tokens],
                                                                   seed=seq.seq_id)
            state.index_text(seq.token_ids, length)
            state.window_nodes = None
            room = draft_room(seq, min(max_draft_len, state.sizes.num_draft_tokens))
            if not room or length != len(seq.token_ids):
                drafts.append([])
                continue
            candidates = state.pool.candidates(seq.token_ids[-1])
            parents, tokens, state.window_nodes = build_tree(state.sizes, candidates, state.levels, room)
            seq.draft_parents = parents
            seq.draft_tree_keeps_law = True  # sampled rows: multi-draft rejection sampling (verify.py)
            drafts.append(tokens)
        return drafts

    def observe_verified(self, drafted: list, verified: dict) -> None:
        """After a verify step: drafted (sequence, first row, k) and seq_id -> Verified, whose
        node_argmax[i] is the target's choice after node i's path (node 0: the root). Each greedy
        tree's window takes one Jacobi iteration; its n-grams join the pool."""
        for seq, _, _ in drafted:
            state, v = self._states.get(seq.seq_id), verified.get(seq.seq_id)
            if state is None or state.window_nodes is None or v is None or v.node_argmax is None:
                continue
            nodes, levels = state.window_nodes, state.levels
            last = [v.node_argmax[node] for node in nodes[-1]]
            for c in range(state.sizes.window_size):
                state.pool.add(tuple(level[c] for level in levels) + (last[c],))
            state.levels = levels[1:] + [last]
            state.window_nodes = None

    def release(self, seq) -> None:
        self._states.pop(seq.seq_id, None)


def start_lookahead(runner, spec, *, has_state: bool) -> LookaheadProposer:
    """The proposer of ``decoding_mode lookahead`` for ``spec`` (a checked SpeculativeConfig), or
    ProposerConfigError saying why the target cannot verify its trees."""
    refuse_unless_one_rank_without_state(runner, "lookahead", has_state)
    return LookaheadProposer(sizes_of_config(spec))


def lookahead_request_error(request, spec) -> str | None:
    """A request's own lookahead sizes: allowed when the executor runs lookahead and each size is
    within the executor's (TensorRT-LLM's rule); the message names the field."""
    sizes = request.lookahead_config
    if spec is None or spec.mode != "lookahead":
        return ("lookahead_window_size: lookahead decoding is not configured on this model; set the tensorrt_llm "
                "parameter decoding_mode to lookahead with lookahead_window_size, lookahead_ngram_size and "
                "lookahead_verification_set_size, or send the request without lookahead_*")
    if not isinstance(sizes, LookaheadSizes):
        return f"lookahead_config must be a LookaheadSizes, got {type(sizes).__name__}"
    try:
        sizes.check()
    except LookaheadConfigError as err:
        return str(err)
    limit = sizes_of_config(spec)
    if not sizes.fits_within(limit):
        return (f"lookahead_window_size {sizes.window_size}, lookahead_ngram_size {sizes.ngram_size}, "
                f"lookahead_verification_set_size {sizes.verification_set_size}: each must be at most the model's "
                f"({limit.window_size}, {limit.ngram_size}, {limit.verification_set_size})")
    return None
