"""``<think>...</think>`` reasoning, the format DeepSeek-R1 and Qwen3 share (deepseek_r1.py and
qwen3.py say where each one's output starts).

The reasoning is the text between the tags, its leading and trailing whitespace left out (R1's and
Qwen3's templates write ``<think>\\n`` and ``\\n</think>\\n\\n``); the content is what follows
``</think>``, its leading whitespace left out. A later ``<think>`` or ``</think>`` is content.
A text cut off (max_tokens) inside the reasoning is all reasoning.
"""
from __future__ import annotations

from openai_frontend.reasoning_parsers.base import WHITESPACE, ReasoningParser, marker_prefix_length

START, END = "<think>", "</think>"


class ThinkTagParser(ReasoningParser):
    """States: ``opening`` (whitespace and maybe ``<think>``: read past it), ``reasoning`` (up to
    ``</think>``), ``after_end`` (whitespace dropped), ``content``. ``starts_inside``: the output
    begins inside the reasoning (the prompt opened it); else it begins with content unless its
    first text is ``<think>``; a guided output (structured output, an enforced tool call) never
    begins inside."""

    special_tokens = (START, END)
    initial_state = "opening"
    starts_inside = False

    def __init__(self, prompt: str = "", guided: bool = False):
        super().__init__(prompt, guided)
        # (a guided output is what the guide allows from its first token: reasoning only where it
        # writes <think> itself)
        self._inside = not guided and (self.starts_inside or prompt.rstrip(WHITESPACE).endswith(START))
        self._leading = ""  # whitespace read before the first text (content when no reasoning follows)
        self._held = ""  # the reasoning's trailing whitespace (dropped if </think> follows)

    def _opening(self, final: bool) -> None:
        stripped = self._buffer.lstrip(WHITESPACE)
        self._leading += self._buffer[:len(self._buffer) - len(stripped)]
        self._buffer = stripped
        if stripped.startswith(START):
            self._buffer = stripped[len(START):]
            self._state = "after_start"
        elif stripped and START.startswith(stripped) and not final:
            return  # ``<think>`` may be arriving
        elif stripped or final:
            if self._inside:
                self._state = "reasoning"
            else:
                self._buffer = self._leading + self._buffer
                self._state = "content"
            self._leading = ""

    def _after_start(self, final: bool) -> None:
        stripped = self._buffer.lstrip(WHITESPACE)
        self._buffer = stripped
        if stripped or final:
            self._state = "reasoning"

    def _reasoning(self, final: bool) -> None:
        buffer = self._buffer
        at = buffer.find(END)
        if at >= 0:
            self._emit_reasoning(buffer[:at])
            self._held = ""
            self._buffer = buffer[at + len(END):]
            self._state = "after_end"
            return
        keep = 0 if final else marker_prefix_length(buffer, (END,))
        self._emit_reasoning(buffer[:len(buffer) - keep])
        self._buffer = buffer[len(buffer) - keep:]

    def _emit_reasoning(self, text: str) -> None:
        text = self._held + text
        kept = text.rstrip(WHITESPACE)
        self._held = text[len(kept):]
        self._out.reasoning += kept

    def _after_end(self, final: bool) -> None:
        stripped = self._buffer.lstrip(WHITESPACE)
        self._buffer = stripped
        if stripped:
            self._state = "content"
