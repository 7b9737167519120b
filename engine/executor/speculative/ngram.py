"""N-gram (prompt lookup) drafts: copy what followed the last time the sequence's tail occurred.

For a sequence ending in tokens ``a b c``, find the most recent earlier position where ``a b c``
occurred in its own prompt + output and propose the tokens that followed it there; if no 3-gram
matches, try ``b c``, then ``c`` (n from ``max_matching_ngram_size`` down to 1). Summaries,
code edits and extraction repeat long spans of their prompt, so the drafts are often right, and
they cost no model.

Each sequence gets an index, per n, from every n-gram that has a following token to the latest
position where it starts; it grows with the sequence (n dictionary updates per new token), so a
lookup costs O(max_matching_ngram_size) whatever the length.
"""
from __future__ import annotations

from engine.executor.request import Sequence
from engine.executor.speculative.proposer import draft_room


class _NgramIndex:
    def __init__(self, max_n: int):
        self.max_n = max_n
        self.latest: list[dict[tuple[int, ...], int]] = [{} for _ in range(max_n + 1)]  # [n][ngram] -> start
        self.num_indexed = 0  # token_ids[:num_indexed] have been added

    def extend(self, token_ids: list[int], length: int) -> None:
        """Index the n-grams of token_ids[:length] that have a following token (end <= length - 2)."""
        for end in range(max(self.num_indexed - 1, 0), length - 1):  # end: the n-gram's last position
            for n in range(1, min(self.max_n, end + 1) + 1):
                start = end - n + 1
                self.latest[n][tuple(token_ids[start:end + 1])] = start
        self.num_indexed = max(self.num_indexed, length)

    def lookup(self, token_ids: list[int], length: int, max_len: int) -> list[int]:
        for n in range(min(self.max_n, length - 1), 0, -1):
            start = self.latest[n].get(tuple(token_ids[length - n:length]))
            if start is not None:
                return token_ids[start + n:min(start + n + max_len, length)]
        return []


class NgramProposer:
    def __init__(self, max_matching_ngram_size: int):
        self.max_matching_ngram_size = max_matching_ngram_size
        self._indexes: dict[int, _NgramIndex] = {}  # seq_id -> its index

    def propose(self, seqs: list[Sequence], max_draft_len: int) -> list[list[int]]:
        drafts = []
        for seq in seqs:
            room = draft_room(seq, max_draft_len)
            length = len(seq.token_ids) - seq.num_unresolved_tokens  # placeholders are not tokens yet
            index = self._indexes.get(seq.seq_id)
            if index is None:
                index = self._indexes[seq.seq_id] = _NgramIndex(self.max_matching_ngram_size)
            index.extend(seq.token_ids, length)
            drafts.append(index.lookup(seq.token_ids, length, room) if room and length == len(seq.token_ids) else [])
        return drafts

    def release(self, seq: Sequence) -> None:
        self._indexes.pop(seq.seq_id, None)
