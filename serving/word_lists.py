"""Stop/bad word lists in tensorrtllm_backend's "2 x N offsets" layout.

For one batch item the layout is an int32 array of shape (2, L):
    row 0: the token ids of all words, concatenated (padded with 0)
    row 1: the exclusive end offset of each word inside row 0 (padded with -1)
e.g. words [14480] and [326, 262, 1171] -> [[14480, 326, 262, 1171], [1, 4, -1, -1]].
"""
from __future__ import annotations

from typing import Callable, Sequence

import numpy as np

INVALID_WORD_LIST = "Invalid format for word list."


def encode_word_lists(items: Sequence[Sequence[str]] | None, encode: Callable[[str], list[int]],
                      batch_size: int) -> np.ndarray:
    """Encode each item's words into the layout above; returns int32 (B, 2, L).

    `items[b]` are the words of batch item b (a word may be a phrase of several tokens);
    words that encode to no tokens are skipped. Absent input gives shape (B, 2, 0);
    otherwise L = max(1, longest total token count).
    """
    if items is None:
        return np.zeros((batch_size, 2, 0), dtype=np.int32)
    encoded = []
    for words in items:
        ids, offsets = [], []
        for word in words:
            tokens = encode(word) if word else []
            if tokens:
                ids.extend(tokens)
                offsets.append(len(ids))
        encoded.append((ids, offsets))
    width = max([1] + [len(ids) for ids, _ in encoded])
    out = np.zeros((len(encoded), 2, width), dtype=np.int32)
    out[:, 1, :] = -1
    for b, (ids, offsets) in enumerate(encoded):
        out[b, 0, : len(ids)] = ids
        out[b, 1, : len(offsets)] = offsets
    return out


def decode_word_list(array: np.ndarray | None) -> list[list[int]] | None:
    """One item's (1, 2, L) array -> list of token-id sequences; None stays None.

    Offsets of -1 are padding. An array that is not (1, 2, L), or an offset beyond the token
    count, raises ValueError("Invalid format for word list.").
    """
    if array is None:
        return None
    array = np.asarray(array)
    if array.ndim != 3 or array.shape[0] != 1 or array.shape[1] != 2:
        raise ValueError(INVALID_WORD_LIST)
    tokens, offsets = array[0, 0].tolist(), array[0, 1].tolist()
    words, start = [], 0
    for end in offsets:
        if end == -1:
            continue
        if end > len(tokens) or end < start:
            raise ValueError(INVALID_WORD_LIST)
        if end > start:
            words.append([int(t) for t in tokens[start:end]])
        start = end
    return words
