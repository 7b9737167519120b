"""Text <-> token tensors for the `preprocessing` and `postprocessing` models (no Triton import).

STRING tensors arrive as numpy object arrays of bytes: QUERY (B, 1), word lists (B, N).
"""
from __future__ import annotations

from typing import Sequence

import numpy as np

from serving.tokenization import decode_tokens
from serving.word_lists import encode_word_lists


def to_str(value) -> str:
    return value.decode("utf-8") if isinstance(value, bytes) else str(value)


def string_rows(array: np.ndarray | None) -> list[list[str]] | None:
    """(B, N) bytes array -> B lists of N strings; None stays None."""
    if array is None:
        return None
    array = np.asarray(array, dtype=object)
    if array.ndim == 1:
        array = array[:, None]
    return [[to_str(v) for v in row.reshape(-1)] for row in array]


def encode_queries(tokenizer, queries: np.ndarray, add_special_tokens: bool, pad_id: int):
    """(B, 1) queries -> input ids (B, Lmax) int32 right-padded with pad_id, lengths (B, 1) int32."""
    rows = [tokenizer.encode(row[0], add_special_tokens=add_special_tokens)
            for row in string_rows(queries)]
    lengths = np.array([[len(ids)] for ids in rows], dtype=np.int32)
    width = max([0] + [len(ids) for ids in rows])
    input_ids = np.full((len(rows), width), pad_id, dtype=np.int32)
    for b, ids in enumerate(rows):
        input_ids[b, : len(ids)] = ids
    return input_ids, lengths


def word_list_tensor(tokenizer, words: np.ndarray | None, batch_size: int) -> np.ndarray:
    """STOP/BAD_WORDS_DICT (B, N) -> (B, 2, L) int32 in the offsets layout."""
    return encode_word_lists(string_rows(words),
                             lambda w: tokenizer.encode(w, add_special_tokens=False), batch_size)


def embedding_bias_tensor(tokenizer, words: np.ndarray | None, weights: np.ndarray | None,
                          batch_size: int) -> np.ndarray:
    """(B, vocab) float32 bias: each word's weight added at each of its token ids; (B, 0) if absent."""
    if words is None or weights is None:
        return np.zeros((batch_size, 0), dtype=np.float32)
    word_rows = string_rows(words)
    weights = np.asarray(weights, dtype=np.float32).reshape(len(word_rows), -1)
    bias = np.zeros((len(word_rows), len(tokenizer)), dtype=np.float32)
    for b, (row_words, row_weights) in enumerate(zip(word_rows, weights)):
        if len(row_words) != len(row_weights):
            raise ValueError("embedding_bias_words and embedding_bias_weights must have the same length")
        for word, weight in zip(row_words, row_weights):
            if word:
                bias[b, tokenizer.encode(word)] += weight
    return bias


def per_item_ids(value: np.ndarray | None, default: int | None, batch_size: int) -> np.ndarray:
    """END_ID / PAD_ID passthrough, else the tokenizer's id, as (B, 1) int32."""
    if value is not None:
        return np.asarray(value, dtype=np.int32).reshape(batch_size, 1)
    return np.full((batch_size, 1), -1 if default is None else default, dtype=np.int32)


def _per_beam(tokens: np.ndarray, lengths: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(B, beams, T) tokens and (B, beams) lengths, also when T is 0 (an empty final chunk)."""
    tokens = np.asarray(tokens)
    lengths = np.asarray(lengths).reshape(tokens.shape[0], -1)
    return tokens.reshape(lengths.shape[0], lengths.shape[1], tokens.shape[-1]), lengths


def decode_batch(tokenizer, tokens: np.ndarray, lengths: np.ndarray,
                 skip_special_tokens: bool) -> np.ndarray:
    """TOKENS_BATCH (B, beams, T) + SEQUENCE_LENGTH (B, beams) -> (B * beams,) UTF-8 bytes."""
    tokens, lengths = _per_beam(tokens, lengths)
    texts = []
    for b in range(tokens.shape[0]):
        for beam in range(tokens.shape[1]):
            ids = tokens[b, beam, : lengths[b, beam]]
            texts.append(decode_tokens(tokenizer, ids[ids >= 0], skip_special_tokens).encode("utf-8"))
    return np.array(texts, dtype=object)


def token_sequences(tokens: np.ndarray, lengths: np.ndarray) -> Sequence[list[int]]:
    """Like decode_batch's slicing, as lists of ids (used by the BLS to accumulate streams)."""
    tokens, lengths = _per_beam(tokens, lengths)
    return [[int(t) for t in tokens[b, k, : lengths[b, k]] if t >= 0]
            for b in range(tokens.shape[0]) for k in range(tokens.shape[1])]
