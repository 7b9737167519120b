"""Token ids -> text, incrementally, for the frontend's direct path into ``tensorrt_llm``.

Decoding each chunk's ids on their own goes wrong in two ways: a character split over two tokens
(a byte-level BPE piece holding half of a multi-byte character) decodes as U+FFFD, and a
tokenizer's decoder may treat the first token of a sequence differently (SentencePiece drops a
leading space). So every step decodes a short window that starts a few tokens back and keeps only
the text past what that same window's head already gave. Cost: two decodes of a few tokens per
chunk, whatever the length of the sequence so far (the BLS re-decodes the whole sequence).

Invariant: the texts returned, concatenated, equal the decode of every id pushed, once ``finish``
has been called (a trailing incomplete character is held until it completes, or until then).
"""
from __future__ import annotations

from typing import Callable, Sequence

from serving.tokenization import fast_decoder

REPLACEMENT_CHAR = "\ufffd"


def fast_decode(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as clients read it: special tokens left out, spaces not cleaned up."""
    return fast_decoder(tokenizer, skip_special_tokens=True)


class IncrementalDetokenizer:
    """One sequence's text, chunk by chunk. ``ids[head:read]`` is the window's head (its text was
    emitted before), ``ids[read:]`` the tokens since; ``self._sent`` characters of their text
    went out already (the complete part of a chunk that ended inside a character)."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._ids: list[int] = []
        self._head = 0
        self._read = 0
        self._sent = 0

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text these tokens complete (up to a character still being spelled out)."""
        self._ids.extend(int(t) for t in token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever is held back, an incomplete character included (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if self._read == len(self._ids):
            return ""
        head_text = self._decode(self._ids[self._head:self._read])
        text = self._decode(self._ids[self._head:])
        start = len(head_text) + self._sent
        if not final and text.endswith(REPLACEMENT_CHAR):
            # The last character is not complete yet: send what precedes it and wait for the rest.
            ready = text[start:].rstrip(REPLACEMENT_CHAR)
            self._sent += len(ready)
            return ready
        new = text[start:]
        # The next window starts where this one's unseen part began: one token of context is
        # enough for the decoders here (a leading-space rule or a split character).
        self._head, self._read, self._sent = self._read, len(self._ids), 0
        return new
