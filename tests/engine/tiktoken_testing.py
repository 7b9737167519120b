"""A tiny tiktoken vocabulary made here (no network), and tiktoken's encoding written out in plain
Python as the oracle: Qwen (v1)'s tokenizer files for tests, without the tiktoken package.

``train_ranks`` learns byte-pair merges the way a tiktoken vocabulary is made: the 256 bytes first
(in a shuffled order, so ranks are not byte values), then the most frequent adjacent pair within the
pattern's pieces of a corpus, merged, repeatedly; a token's rank is when it was made.
``tiktoken_encode`` is tiktoken's algorithm: special tokens anywhere in the (NFC) text, the pattern's
pieces, each a whole token if it is one, else its adjacent pair of lowest merged rank merged
(leftmost first) until none is a token.
"""
from __future__ import annotations

import base64
import random
import unicodedata
from collections import Counter

import regex

from engine.tiktoken_vocab import QWEN_PATTERN, QWEN_SPECIAL_TOKENS

CORPUS = ("The quick brown fox jumps over the lazy dog. The dog sleeps; the fox thinks it's there.\n"
          "Tokenizers split text into pieces: numbers 12345 and 2026, punctuation!!! and    spaces.\n"
          "混合文本：你好，世界。 Emoji 🙂🙂 and café naïve résumé.\n") * 3


def train_ranks(merges: int = 120, seed: int = 0) -> dict[bytes, int]:
    order = list(range(256))
    random.Random(seed).shuffle(order)
    ranks = {bytes([b]): i for i, b in enumerate(order)}
    words = Counter(tuple(bytes([b]) for b in piece.encode()) for piece in regex.findall(QWEN_PATTERN, CORPUS))
    for _ in range(merges):
        pairs = Counter()
        for word, count in words.items():
            for a, b in zip(word, word[1:]):
                pairs[a, b] += count
        if not pairs:
            break
        (a, b), _ = max(pairs.items(), key=lambda item: (item[1], -ranks[item[0][0]], -ranks[item[0][1]]))
        ranks.setdefault(a + b, len(ranks))
        merged = Counter()
        for word, count in words.items():
            out, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and word[i] == a and word[i + 1] == b:
                    out.append(a + b)
                    i += 2
                else:
                    out.append(word[i])
                    i += 1
            merged[tuple(out)] += count
        words = merged
    return ranks


def write_tiktoken(path, ranks: dict[bytes, int]) -> None:
    with open(path, "wb") as f:
        for token, rank in sorted(ranks.items(), key=lambda item: item[1]):
            f.write(base64.b64encode(token) + b" " + str(rank).encode() + b"\n")


def _byte_pair_ids(piece: bytes, ranks: dict[bytes, int]) -> list[int]:
    if piece in ranks:
        return [ranks[piece]]
    parts = [bytes([b]) for b in piece]
    while len(parts) > 1:
        candidates = [(ranks[parts[i] + parts[i + 1]], i) for i in range(len(parts) - 1)
                      if parts[i] + parts[i + 1] in ranks]
        if not candidates:
            break
        _, i = min(candidates)
        parts[i:i + 2] = [parts[i] + parts[i + 1]]
    return [ranks[p] for p in parts]


def tiktoken_encode(text: str, ranks: dict[bytes, int]) -> list[int]:
    special = {token: len(ranks) + i for i, token in enumerate(QWEN_SPECIAL_TOKENS)}
    ids = []
    for chunk in regex.split("(" + "|".join(map(regex.escape, special)) + ")", unicodedata.normalize("NFC", text)):
        if chunk in special:
            ids.append(special[chunk])
            continue
        for piece in regex.findall(QWEN_PATTERN, chunk):
            ids += _byte_pair_ids(piece.encode(), ranks)
    return ids
