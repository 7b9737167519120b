"""gpt-oss's harmony format: the output is messages, each a header and a body,

    <|channel|>analysis<|message|>The user asks ...<|end|><|start|>assistant<|channel|>final<|message|>Paris.

(the prompt ends with ``<|start|>assistant``, so the first message's role is already written). The
``analysis`` channel's bodies are the reasoning; every other channel's (``final``, ``commentary``)
the content. A header's recipient and format (`` to=functions.f <|constrain|>json``) are read past: with
tools (``tool_choice: "auto"``) the harmony tool parser (tool_parsers/harmony.py) reads the output in this
parser's place and makes such messages tool calls.
A body ends at ``<|end|>``, ``<|call|>`` or ``<|return|>``; the next message's ``<|start|>`` and role
are dropped. Text before any header (a decoder that dropped the markers) is content.

The markers are special tokens of the o200k_harmony vocabulary: the frontend's detokenizer keeps them
on the direct path (``special_tokens``); through ``tensorrt_llm_bls`` postprocessing drops them, and
the text is all content.
"""
from __future__ import annotations

from openai_frontend.harmony_format import CHANNEL, MESSAGE, REASONING_CHANNEL, START, body_piece
from openai_frontend.reasoning_parsers.base import ReasoningParser


class GptOssParser(ReasoningParser):
    """States: ``between`` (before a message), ``role`` (after ``<|start|>``), ``header`` (after
    ``<|channel|>``), ``body`` (after ``<|message|>``, to the body's end)."""

    name = "gpt_oss"
    special_tokens = (START, CHANNEL, MESSAGE, "<|constrain|>", "<|end|>", "<|call|>")
    initial_state = "between"

    def __init__(self, prompt: str = "", guided: bool = False):
        super().__init__(prompt, guided)
        self._channel: str | None = None  # the body's channel (None: text outside harmony's markers)

    def _between(self, final: bool) -> None:
        buffer = self._buffer
        for marker, state in ((CHANNEL, "header"), (START, "role")):
            if buffer.startswith(marker):
                self._buffer, self._state = buffer[len(marker):], state
                return
        if not buffer or (not final and any(m.startswith(buffer) for m in (CHANNEL, START))):
            return  # a marker may be arriving
        self._channel, self._state = None, "body"

    def _role(self, final: bool) -> None:
        """``assistant`` (dropped) up to the header's channel, or straight to the body."""
        found = [(self._buffer.find(m), m) for m in (CHANNEL, MESSAGE) if m in self._buffer]
        if found:
            at, marker = min(found)
            self._buffer = self._buffer[at + len(marker):]
            self._channel = None
            self._state = "header" if marker == CHANNEL else "body"
        elif final:
            self._buffer = ""

    def _header(self, final: bool) -> None:
        """The channel's name, then a recipient or format maybe, up to ``<|message|>``."""
        at = self._buffer.find(MESSAGE)
        if at >= 0:
            header = self._buffer[:at].split("<|")[0].split()
            self._channel = header[0] if header else ""
            self._buffer, self._state = self._buffer[at + len(MESSAGE):], "body"
        elif final:  # cut off inside a header: nothing of it is text
            self._buffer = ""

    def _body(self, final: bool) -> None:
        text, self._buffer, ended = body_piece(self._buffer, final)
        self._emit(text)
        if ended:
            self._state = "between"

    def _emit(self, text: str) -> None:
        if self._channel == REASONING_CHANNEL:
            self._out.reasoning += text
        else:
            self._out.content += text
