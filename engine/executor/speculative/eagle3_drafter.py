"""EAGLE-3 drafting with the draft layer's own KV cache, a static tree (``eagle_choices``) or a
dynamic one (EAGLE-2: expanded by the draft's confidence), for the in-flight executor
(speculative/eagle3.py ``Eagle3DraftProposer``).

Rows of the draft layer (eagle3.py's module docstring): row t reads g_t (the target's features at
token t) and the embedding of x_{t+1}, sits at position t, and its output h_t guesses x_{t+2}. Its k
and v depend on that row alone (one layer), so once x_{t+1} is known they are final: the cache
(``DraftCache``, one per sequence, a growing buffer freed with the sequence) keeps k and v of every
row whose g and next token are known, i.e. every computed token but the root.

Drafting a tree after the root (the sequence's last token, whose own features come with the next
verify step):
- the root's children come from the last cached row (the token before the root, which embeds the root);
- a node's children from a tree row of its own: g = its parent row's h, embedding of its token,
  position = root's + depth; it attends to the cache and to its ancestors' tree rows and itself.
One batched forward per depth, over the nodes of that depth that get children. Tree rows are
dropped after the proposal; the accepted path's rows are committed from the target's real
features after verification (observe_batch), as EAGLE does.

Dynamic tree (Li et al., EAGLE-2): depth 1 is the root's top-K; at each further depth the K nodes
of the last depth with the highest path score (sum of the draft's log-probs along the path) are
expanded with their top-K children; at the end the ``num_nodes`` best-scoring nodes of all depths
are kept. A child's score is at most its parent's, so sorting by (score desc, depth) keeps every
kept node's ancestors ahead of it: the kept set is a tree.
"""
from __future__ import annotations

import torch

from engine.executor.tree_batch import ancestor_mask

MIN_CAPACITY = 64  # rows a cache starts with; it doubles when full


class DraftCache:
    """One sequence's draft-layer rows: k, v (capacity, kv_heads, d) of rows [0, length), row r being
    token start + r's; ``pending`` holds g of rows whose next token was not known yet (the root's)."""

    def __init__(self, start: int, head, device: torch.device):
        self.start, self.length = start, 0
        shape = (MIN_CAPACITY, head.num_kv_heads, head.head_dim)
        self.k = torch.empty(shape, dtype=head.dtype, device=device)
        self.v = torch.empty(shape, dtype=head.dtype, device=device)
        self.pending = torch.empty(0, head.w["fc.weight"].shape[0], dtype=head.dtype, device=device)
        self.last_q: torch.Tensor | None = None  # (1, heads, d): the last cached row's query
        self.last_g: torch.Tensor | None = None  # (1, H): its input stream

    @property
    def end(self) -> int:
        """First token without features (the root, when the cache is current)."""
        return self.start + self.length + self.pending.shape[0]

    def add_features(self, g: torch.Tensor) -> None:
        self.pending = torch.cat([self.pending, g.to(self.pending.dtype)])

    def commit(self, head, tokens: list[int], embed) -> None:
        """Cache the pending rows (their next tokens are tokens[start + length + 1 ...], all known)."""
        n = self.pending.shape[0]
        if not n:
            return
        first = self.start + self.length
        ids = torch.tensor(tokens[first + 1:first + 1 + n], device=self.k.device)
        positions = torch.arange(first, first + n, device=self.k.device)
        q, k, v = head.qkv(embed(ids), self.pending, positions)
        if self.length + n > self.k.shape[0]:
            capacity = max(2 * self.k.shape[0], self.length + n)
            for name in ("k", "v"):
                old = getattr(self, name)
                new = old.new_empty((capacity,) + tuple(old.shape[1:]))
                new[:self.length] = old[:self.length]
                setattr(self, name, new)
        self.k[self.length:self.length + n] = k
        self.v[self.length:self.length + n] = v
        self.length += n
        self.last_q, self.last_g = q[-1:], self.pending[-1:]
        self.pending = self.pending[:0]


class _Tree:
    """Tree rows of one proposal: per expanded node its row's k, v and h, and the nodes' parents."""

    def __init__(self, head, cache: DraftCache, embed):
        self.head, self.cache, self.embed = head, cache, embed
        self.parents: list[int] = [-1]  # node 0: the root
        self.tokens: list[int] = [-1]
        self.depths: list[int] = [0]
        self.row_of: dict[int, int] = {}  # expanded node -> its tree row
        self.k = self.v = None
        self.h: dict[int, torch.Tensor] = {}  # expanded node -> h (H,)

    def root_logits(self) -> torch.Tensor:
        """The draft's log-probs after the root: the last cached row's output. (draft_vocab,)"""
        c, head = self.cache, self.head
        attn = head.attend(c.last_q, c.k[:c.length], c.v[:c.length],
                           torch.ones(1, c.length, dtype=torch.bool, device=c.k.device))
        h = head.finish(c.last_g, attn)
        self.h[0] = h[0]
        return torch.log_softmax(head.logits(h)[0], dim=-1)

    def expand(self, nodes: list[int]) -> torch.Tensor:
        """Tree rows for ``nodes`` (depth >= 1, their parents already expanded) -> their children's
        log-probs (len(nodes), draft_vocab)."""
        head, c = self.head, self.cache
        dev = c.k.device
        ids = torch.tensor([self.tokens[n] for n in nodes], device=dev)
        g = torch.stack([self.h[self.parents[n]] for n in nodes])
        root_position = c.start + c.length  # the root's position: the last cached row's + 1
        positions = torch.tensor([root_position - 1 + self.depths[n] for n in nodes], device=dev)
        q, k, v = head.qkv(self.embed(ids), g, positions)
        base = 0 if self.k is None else self.k.shape[0]
        for j, n in enumerate(nodes):
            self.row_of[n] = base + j
        self.k = k if self.k is None else torch.cat([self.k, k])
        self.v = v if self.v is None else torch.cat([self.v, v])
        # rows see the whole cache and, among tree rows, their expanded ancestors and themselves
        rows = sorted(self.row_of, key=self.row_of.get)
        tree_parents = [self.row_of.get(self.parents[n], -1) for n in rows]
        seen = ancestor_mask(tree_parents)[base:].to(dev)
        mask = torch.cat([torch.ones(len(nodes), c.length, dtype=torch.bool, device=dev), seen], dim=1)
        attn = head.attend(q, torch.cat([c.k[:c.length], self.k]), torch.cat([c.v[:c.length], self.v]), mask)
        h = head.finish(g, attn)
        for j, n in enumerate(nodes):
            self.h[n] = h[j]
        return torch.log_softmax(head.logits(h), dim=-1)

    def add(self, parent: int, token: int) -> int:
        self.parents.append(parent)
        self.tokens.append(token)
        self.depths.append(self.depths[parent] + 1)
        return len(self.parents) - 1


def draft_static(head, cache: DraftCache, shape, embed) -> tuple[list[int], list[int]]:
    """``shape`` (tree.TreeShape of eagle_choices): node i is the ranks[i]-th draft token after its
    parent's path -> (parents, -1 for the root, and target-vocab tokens of nodes 1..)."""
    tree = _Tree(head, cache, embed)
    depths, parents = shape.depths, shape.parents
    width = {p: 1 + max(shape.ranks[i] for i in range(1, shape.num_nodes) if parents[i] == p) for p in set(parents[1:])}

    def ranked(nodes: list[int], logp: torch.Tensor) -> dict[int, list[int]]:  # target ids, best first
        ids = logp.topk(max(width[n] for n in nodes), dim=-1).indices
        return dict(zip(nodes, (ids + head.d2t[ids]).tolist()))

    ranks = ranked([0], tree.root_logits()[None])
    for depth in range(1, shape.max_depth + 1):
        nodes = [i for i in range(1, shape.num_nodes) if depths[i] == depth]
        for i in nodes:
            tree.add(parents[i], ranks[parents[i]][shape.ranks[i]])
        expand = [i for i in nodes if i in width]
        if expand:
            ranks.update(ranked(expand, tree.expand(expand)))
    return [p - 1 for p in tree.parents[1:]], tree.tokens[1:]


def draft_dynamic(head, cache: DraftCache, embed, *, depth: int, top_k: int, num_nodes: int
                  ) -> tuple[list[int], list[int]]:
    """EAGLE-2's dynamic tree of at most ``num_nodes`` drafts, ``depth`` deep, ``top_k`` children per
    expanded node and ``top_k`` nodes expanded per depth -> (parents, tokens) in topological order."""
    tree = _Tree(head, cache, embed)
    d2t = head.d2t.tolist()
    scores = [0.0]
    logp = tree.root_logits()[None]
    frontier = [0]
    for level in range(1, depth + 1):
        values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)  # (len(frontier), K)
        values, ids = values.tolist(), ids.tolist()
        new = []
        for parent, vals, draft_ids in zip(frontier, values, ids):
            for value, draft_id in zip(vals, draft_ids):
                new.append(tree.add(parent, draft_id + d2t[draft_id]))
                scores.append(scores[parent] + value)
        if level == depth:
            break
        frontier = sorted(new, key=lambda n: -scores[n])[:top_k]
        logp = tree.expand(frontier)
    keep = sorted(range(1, len(scores)), key=lambda n: (-scores[n], tree.depths[n], n))[:num_nodes]
    keep.sort(key=lambda n: (tree.depths[n], n))  # topological: parents first
    index = {0: -1, **{n: j for j, n in enumerate(keep)}}
    return [index[tree.parents[n]] for n in keep], [tree.tokens[n] for n in keep]
