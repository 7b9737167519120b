"""Token trees for tree verification: their shape, their attention mask and greedy acceptance.

A tree verify step scores many candidate continuations in one target forward (Medusa, EAGLE).
Node 0 is the root: the sequence's last known token (its KV not computed yet). Every other node
is a drafted token whose parent is an earlier node (``parents[i] < i``), so the nodes are in
topological order and the root-to-node path of node i reads as one candidate continuation.

    depth:     0        1          2
    nodes:    [r] -> [a] (0) -> [c] (2)          parents = [-1, 0, 0, 1]
                 \\-> [b] (1)                      depths  = [0, 1, 1, 2]

In the forward, node i sits in the KV slot of position ``base + i`` (consecutive slots after the
cached prefix of ``base`` tokens) but is rotated as position ``base + depth[i]`` (where it would
sit were its path accepted), and attends to the prefix plus its ancestors and itself
(``ancestor_mask``; kernels/attention.py ``meta.tree_mask``). Its logits are the target's
next-token law after its path, so greedy acceptance walks from the root taking, at each node, the
child whose token is the target's argmax there; the walk's end gives the bonus token.
"""
from __future__ import annotations

import re
from dataclasses import dataclass

from engine.executor.tree_batch import ancestor_mask  # noqa: F401  (re-exported: the trees' mask)


class TreeChoicesError(ValueError):
    """A malformed ``medusa_choices`` / tree description (the message names the field)."""


@dataclass(frozen=True)
class TreeShape:
    """A tree's shape without its tokens: ``parents[i]`` (-1 for the root), and for Medusa-style
    trees ``ranks[i]``: node i's token is the ranks[i]-th most likely of its depth's head."""

    parents: tuple[int, ...]
    ranks: tuple[int, ...]

    @property
    def num_nodes(self) -> int:
        return len(self.parents)

    @property
    def depths(self) -> list[int]:
        depths = [0] * self.num_nodes
        for i in range(1, self.num_nodes):
            depths[i] = depths[self.parents[i]] + 1
        return depths

    @property
    def max_depth(self) -> int:
        return max(self.depths)


def chain_shape(length: int) -> TreeShape:
    """A chain of ``length`` drafts: what chain speculation verifies, as a tree."""
    return TreeShape(tuple(range(-1, length)), (0,) * (length + 1))


def shape_from_choices(choices: list[list[int]], field: str = "medusa_choices") -> TreeShape:
    """Medusa's tree spelling: each choice is a path of top-k ranks from the root, e.g.
    [[0], [1], [0, 0]]: the top-1 and top-2 tokens of head 0, then head 1's top-1 after the first.
    Every prefix of a path must be a path too. Nodes sorted by (depth, path), as Medusa sorts them."""
    if not choices or not all(isinstance(c, (list, tuple)) and c for c in choices):
        raise TreeChoicesError(f"{field}: expected a non-empty list of non-empty paths of ranks, got {choices!r}")
    paths = sorted({tuple(c) for c in choices}, key=lambda c: (len(c), c))
    for path in paths:
        if not all(isinstance(r, int) and not isinstance(r, bool) and r >= 0 for r in path):
            raise TreeChoicesError(f"{field}: ranks must be integers >= 0, got path {list(path)}")
        if len(path) > 1 and path[:-1] not in paths:
            raise TreeChoicesError(f"{field}: path {list(path)} has no parent path {list(path[:-1])}; "
                                   f"every prefix of a path must be listed too")
    index = {(): 0}
    parents, ranks = [-1], [0]
    for path in paths:
        index[path] = len(parents)
        parents.append(index[path[:-1]])
        ranks.append(path[-1])
    return TreeShape(tuple(parents), tuple(ranks))


def parse_choices(text: str, field: str = "medusa_choices") -> list[list[int]]:
    """The reference's string spelling ``{0}, {0, 0}, {1}`` (or a JSON-like ``[[0], [0, 0]]``) ->
    a list of int lists; anything else raises naming the field."""
    body = text.strip()
    if body.startswith("[") and body.endswith("]"):
        body = body[1:-1]
    body = body.replace("[", "{").replace("]", "}")
    if not re.fullmatch(r"\s*\{[^{}]*\}(\s*,\s*\{[^{}]*\})*\s*", body):
        raise TreeChoicesError(f"Invalid format for {field}: {text!r} (expected paths like {{0}}, {{0, 0}}, {{1}})")
    try:
        return [[int(x) for x in group.split(",")] for group in re.findall(r"\{([^{}]*)\}", body)]
    except ValueError:
        raise TreeChoicesError(f"Invalid format for {field}: {text!r} (ranks must be integers)") from None


def accept_greedy_tree(parents: list[int], token_ids: list[int], target_ids: list[int]) -> tuple[list[int], list[int]]:
    """parents/token_ids of a tree (token_ids[0]: the root's, already known), target_ids: the
    target's argmax at every node -> (path: the accepted node indices from the root, the tokens
    to emit: the accepted drafts then the bonus token). Plain greedy decoding emits the same."""
    children: dict[int, list[int]] = {}
    for i in range(1, len(parents)):
        children.setdefault(parents[i], []).append(i)
    path = [0]
    while True:
        want = target_ids[path[-1]]
        nxt = next((c for c in children.get(path[-1], ()) if token_ids[c] == want), None)
        if nxt is None:
            break
        path.append(nxt)
    return path, [token_ids[i] for i in path[1:]] + [target_ids[path[-1]]]
