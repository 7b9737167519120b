"""Token ids -> text, incrementally, for the frontend's direct path into ``tensorrt_llm``:
``serving.tokenization.DecodeWindow`` with this process's tokenizer as the decoder (it says why
a window, and what the texts returned add up to).
"""
from __future__ import annotations

from typing import Callable, Sequence

from serving.tokenization import DecodeWindow, fast_decoder


def fast_decode(tokenizer) -> Callable[[list[int]], str]:
    """ids -> text as clients read it: special tokens left out, spaces not cleaned up."""
    return fast_decoder(tokenizer, skip_special_tokens=True)


class IncrementalDetokenizer:
    """One sequence's text, chunk by chunk."""

    def __init__(self, decode: Callable[[list[int]], str]):
        self._decode = decode
        self._window = DecodeWindow()

    def push(self, token_ids: Sequence[int]) -> str:
        """The new text these tokens complete (up to a character still being spelled out)."""
        self._window.extend(token_ids)
        return self._advance(final=False)

    def finish(self) -> str:
        """Whatever is held back, an incomplete character included (as U+FFFD)."""
        return self._advance(final=True)

    def _advance(self, final: bool) -> str:
        if not self._window.pending:
            return ""
        head, window = self._window.windows()
        return self._window.advance(self._decode(head), self._decode(window), final)
