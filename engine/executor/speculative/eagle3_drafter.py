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
One batched forward per depth, over the nodes of that depth that get children; their k and v go
into the cache's buffer past its rows (scratch, overwritten by the next commit), so attention reads
one contiguous run. The accepted path's rows are committed from the target's real features after
verification (observe_batch), as EAGLE does.

Static trees keep the whole proposal on the device (``StaticPlan``: the index tensors and masks of
a tree shape, made once): the host reads the drafted tokens once at the end, so a proposal costs
the launches of depth + 1 small forwards and no synchronisation between them.

Dynamic tree (Li et al., EAGLE-2): depth 1 is the root's top-K; at each further depth the K nodes
of the last depth with the highest path score (sum of the draft's log-probs along the path) are
expanded with their top-K children; at the end the ``num_nodes`` best-scoring nodes of all depths
are kept. A child's score is at most its parent's, so sorting by (score desc, depth) keeps every
kept node's ancestors ahead of it: the kept set is a tree.
"""
from __future__ import annotations

import itertools

import torch

from engine.executor.tree_batch import ancestor_mask
from kernels.draft_topk import draft_top_ids

MIN_CAPACITY = 64  # rows a cache starts with; it doubles when full
_SERIALS = itertools.count()  # DraftCache.serial: a window (eagle3_graphs.py) knows whose rows it holds


class DraftCache:
    """One sequence's draft-layer rows: k, v (capacity, kv_heads, d) of rows [0, length), row r being
    token start + r's; ``pending`` holds g of rows whose next token was not known yet (the root's)."""

    def __init__(self, start: int, head, device: torch.device):
        self.start, self.length, self.serial = start, 0, next(_SERIALS)
        shape = (MIN_CAPACITY, head.num_kv_heads, head.head_dim)
        self.k = torch.empty(shape, dtype=head.dtype, device=device)
        self.v = torch.empty(shape, dtype=head.dtype, device=device)
        self.pending = torch.empty(0, head.hidden_size, dtype=head.dtype, device=device)
        self.last_q: torch.Tensor | None = None  # (1, heads, d): the last cached row's query
        self.last_g: torch.Tensor | None = None  # (1, H): its input stream

    @property
    def end(self) -> int:
        """First token without features (the root, when the cache is current)."""
        return self.start + self.length + self.pending.shape[0]

    def add_features(self, g: torch.Tensor) -> None:
        g = g.to(self.pending.dtype)
        self.pending = torch.cat([self.pending, g]) if self.pending.shape[0] else g  # (none pending: no copy)

    def reserve(self, rows: int) -> None:
        """Room for ``rows`` rows in all (cached + scratch)."""
        if rows <= self.k.shape[0]:
            return
        capacity = max(2 * self.k.shape[0], rows)
        for name in ("k", "v"):  # every row, the scratch ones too: a proposal may grow mid-tree
            old = getattr(self, name)
            new = old.new_empty((capacity,) + tuple(old.shape[1:]))
            new[:old.shape[0]] = old
            setattr(self, name, new)

    def commit(self, head, tokens: list[int], embed, rows: int | None = None) -> None:
        """Cache the pending rows, or the first ``rows`` of them (their next tokens are
        tokens[start + length + 1 ...], all known)."""
        n = self.pending.shape[0] if rows is None else min(rows, self.pending.shape[0])
        if not n:
            return
        first = self.start + self.length
        ids = torch.tensor(tokens[first + 1:first + 1 + n]).to(self.k.device, non_blocking=True)
        q, k, v = head.qkv(embed(ids), self.pending[:n], first)
        self.add_rows(k, v, q[-1:])

    def add_rows(self, k: torch.Tensor, v: torch.Tensor, last_q: torch.Tensor) -> None:
        """The first len(k) pending rows' k and v (kv_heads, d each) become cached rows; ``last_q``
        (1, heads, d) is the last one's query (computed here by commit, or in a window: eagle3_graphs.py)."""
        n = k.shape[0]
        self.reserve(self.length + n)
        self.k[self.length:self.length + n] = k
        self.v[self.length:self.length + n] = v
        self.length += n
        self.last_q, self.last_g = last_q, self.pending[n - 1:n]
        self.pending = self.pending[n:]

    def root(self, head) -> tuple[torch.Tensor, torch.Tensor]:
        """The last cached row's output: (h (1, H), the draft's log-probs after the root (1, draft_vocab))."""
        h = self.root_hidden(head)
        return h, torch.log_softmax(head.logits(h), dim=-1)

    def root_hidden(self, head) -> torch.Tensor:
        """The last cached row's output h (1, H)."""
        return head.finish(self.last_g, head.attend(self.last_q, self.k[:self.length], self.v[:self.length], None))

    def tree_rows(self, head, embed, ids: torch.Tensor, g: torch.Tensor, depth: int, row: int, seen: torch.Tensor
                  ) -> torch.Tensor:
        """Tree rows row.. of nodes of one ``depth`` (tokens ``ids``, input streams ``g``), seeing the
        cache and the tree rows ``seen`` (len(ids), row + len(ids)) marks -> their outputs h."""
        n = ids.shape[0]
        q, k, v = head.qkv(embed(ids), g, self.start + self.length - 1 + depth, same_position=True)
        end = self.length + row + n
        self.reserve(end)
        self.k[self.length + row:end] = k
        self.v[self.length + row:end] = v
        mask = torch.cat([self._all(n), seen], dim=1)
        return head.finish(g, head.attend(q, self.k[:end], self.v[:end], mask))

    def _all(self, rows: int) -> torch.Tensor:
        return torch.ones(rows, self.length, dtype=torch.bool, device=self.k.device)


class StaticPlan:
    """A static tree's proposal as device-side indexing, made once per shape (tree.TreeShape).

    Expanded nodes (those with children) are numbered e = 0 (the root), 1, ... in depth order; e >= 1
    has tree row e - 1. Per depth: the nodes of that depth (``nodes``), their parents' e
    (``parent_e``) and ranks (``ranks``), the expanded ones among them (``expand``: their positions
    in ``nodes``, their e) and what their rows see among the tree rows (``seen``)."""

    def __init__(self, shape, device: torch.device):
        parents, depths = shape.parents, shape.depths
        has_children = set(parents[1:])
        expanded = [0] + [i for i in range(1, shape.num_nodes) if i in has_children]
        e_of = {node: e for e, node in enumerate(expanded)}
        self.num_expanded = len(expanded)
        self.width = 1 + max(shape.ranks[1:])
        tree_parents = [e_of[parents[node]] - 1 for node in expanded[1:]]  # among tree rows (-1: the root)
        seen_all = ancestor_mask(tree_parents)
        self.levels = []
        for depth in range(1, shape.max_depth + 1):
            nodes = [i for i in range(1, shape.num_nodes) if depths[i] == depth]
            grow = [j for j, i in enumerate(nodes) if i in has_children]
            rows = [e_of[nodes[j]] - 1 for j in grow]
            to = lambda values: torch.tensor(values, dtype=torch.int64, device=device)  # noqa: E731
            parent_e = [e_of[parents[i]] for i in nodes]
            flat = [e * self.width + shape.ranks[i] for e, i in zip(parent_e, nodes)]  # into ranked (E * width,)
            self.levels.append({
                "nodes": to([i - 1 for i in nodes]), "parent_e": to(parent_e),
                "ranks": to([shape.ranks[i] for i in nodes]), "expand": to(grow), "expand_e": to([r + 1 for r in rows]),
                "row": rows[0] if rows else 0,
                "seen": seen_all[rows, :rows[-1] + 1].to(device) if rows else None,
                # the same selections as slices where they are a run (draft_window: a view or a copy
                # instead of an index kernel; a chain-with-siblings tree is runs only)
                "grow_flat_at": index_or_slice([flat[j] for j in grow], device),
                "grow_parent_at": index_or_slice([parent_e[j] for j in grow], device),
                "expand_e_at": index_or_slice([r + 1 for r in rows], device)})
        self.parents = [p - 1 for p in parents[1:]]
        # where each node's token sits in ranked (E * width,): its parent's e, its rank (nodes 1.. in order)
        self.node_flat = index_or_slice([e_of[parents[i]] * self.width + shape.ranks[i]
                                         for i in range(1, shape.num_nodes)], device)


def index_or_slice(values: list[int], device: torch.device) -> slice | torch.Tensor:
    """``values`` as an index of a tensor's dimension: a slice where they are a run a, a+1, .., b
    (indexing with it is a view, assigning through it one copy), else an int64 tensor."""
    if values and values == list(range(values[0], values[0] + len(values))):
        return slice(values[0], values[0] + len(values))
    return torch.tensor(values, dtype=torch.int64, device=device)


def draft_static(head, cache: DraftCache, plan: StaticPlan, embed) -> tuple[list[int], list[int]]:
    """``plan``'s tree (eagle_choices: node i is the ranks[i]-th draft token after its parent's path)
    -> (parents, -1 for the root, and target-vocab tokens of nodes 1..)."""
    dev = cache.k.device
    h_root = cache.root_hidden(head)
    hidden = h_root.new_empty(plan.num_expanded, h_root.shape[-1])
    ranked = torch.empty(plan.num_expanded, plan.width, dtype=torch.int64, device=dev)
    hidden[0] = h_root[0]
    # ranks by the logits themselves (log_softmax keeps their order; draft_tree ranks so too)
    ranked[0] = draft_top_ids(head.logits(h_root), head.d2t, plan.width)[0]
    tokens = torch.empty(len(plan.parents), dtype=torch.int64, device=dev)
    for depth, level in enumerate(plan.levels, start=1):
        level_tokens = ranked[level["parent_e"], level["ranks"]]
        tokens[level["nodes"]] = level_tokens
        if level["seen"] is None:
            continue
        grow_e = level["expand_e"]
        h = cache.tree_rows(head, embed, level_tokens[level["expand"]], hidden[level["parent_e"][level["expand"]]], depth,
                            level["row"], level["seen"])
        hidden[grow_e] = h
        ranked[grow_e] = draft_top_ids(head.logits(h), head.d2t, plan.width)
    return list(plan.parents), tokens.tolist()


def draft_dynamic(head, cache: DraftCache, embed, *, depth: int, top_k: int, num_nodes: int
                  ) -> tuple[list[int], list[int]]:
    """EAGLE-2's dynamic tree of at most ``num_nodes`` drafts, ``depth`` deep, ``top_k`` children per
    expanded node and ``top_k`` nodes expanded per depth -> (parents, tokens) in topological order.
    One host read per depth (the scores that pick the next depth's frontier)."""
    d2t = head.d2t.tolist()
    parents, tokens, depths, scores = [-1], [-1], [0], [0.0]
    row_of: dict[int, int] = {}  # expanded node -> its tree row
    h, logp = cache.root(head)
    hidden = {0: h[0]}
    frontier = [0]
    for level in range(1, depth + 1):
        values, ids = logp.topk(min(top_k, logp.shape[-1]), dim=-1)  # (len(frontier), K)
        new = []
        for parent, vals, draft_ids in zip(frontier, values.tolist(), ids.tolist()):
            for value, draft_id in zip(vals, draft_ids):
                parents.append(parent)
                tokens.append(draft_id + d2t[draft_id])
                depths.append(level)
                scores.append(scores[parent] + value)
                new.append(len(parents) - 1)
        if level == depth:
            break
        frontier = sorted(new, key=lambda n: -scores[n])[:top_k]
        first = len(row_of)
        for j, node in enumerate(frontier):
            row_of[node] = first + j
        rows = sorted(row_of, key=row_of.get)
        seen = ancestor_mask([row_of.get(parents[n], -1) for n in rows])[first:].to(cache.k.device)
        ids_t = torch.tensor([tokens[n] for n in frontier]).to(cache.k.device)
        h = cache.tree_rows(head, embed, ids_t, torch.stack([hidden[parents[n]] for n in frontier]), level, first, seen)
        for j, node in enumerate(frontier):
            hidden[node] = h[j]
        logp = torch.log_softmax(head.logits(h), dim=-1)
    keep = sorted(range(1, len(scores)), key=lambda n: (-scores[n], depths[n], n))[:num_nodes]
    keep.sort(key=lambda n: (depths[n], n))  # topological: parents first
    index = {0: -1, **{n: j for j, n in enumerate(keep)}}
    return [index[parents[n]] for n in keep], [tokens[n] for n in keep]
