"""Stop strings as OpenAI defines them: the returned text ends right before the first stop
string, which is not included.

The entry model stops generation at a stop string too, but returns the text up to and including
it; this cuts it off. While streaming, a tail that could still become a stop string is held back
until the next delta settles it (so a stop string split across chunks never leaks).
"""
from __future__ import annotations


class StopTrimmer:
    """push(delta) -> the text that is safe to send now; flush() -> the rest at the end.

    Invariant: everything returned, concatenated, is the generated text up to (excluding) the
    first stop string, or all of it when none occurs.
    """

    def __init__(self, stops: list[str]):
        self._stops = [s for s in stops if s]
        self._longest = max((len(s) for s in self._stops), default=0)
        self._text = ""
        self._sent = 0  # characters of _text already returned
        self.stopped = False

    def push(self, delta: str) -> str:
        if self.stopped or not delta:
            return ""
        if not self._stops:
            self._text += delta
            self._sent = len(self._text)
            return delta
        search_from = max(0, len(self._text) - self._longest + 1)  # a new match ends in `delta`
        self._text += delta
        cut = self._first_stop(search_from)
        if cut is not None:
            self.stopped = True
            return self._release(cut)
        return self._release(len(self._text) - self._possible_stop_prefix())

    def flush(self) -> str:
        return "" if self.stopped else self._release(len(self._text))

    def _first_stop(self, search_from: int) -> int | None:
        starts = [i for i in (self._text.find(s, search_from) for s in self._stops) if i >= 0]
        return min(starts) if starts else None

    def _possible_stop_prefix(self) -> int:
        """Length of the longest tail of the text that is a proper prefix of some stop string."""
        for length in range(min(self._longest - 1, len(self._text)), 0, -1):
            tail = self._text[-length:]
            if any(s.startswith(tail) for s in self._stops):
                return length
        return 0

    def _release(self, end: int) -> str:
        end = max(end, self._sent)
        out, self._sent = self._text[self._sent:end], end
        return out
