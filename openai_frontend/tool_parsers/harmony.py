"""gpt-oss's tool calls, in OpenAI's harmony format: each call is a message of its own, addressed to
the function in its header, its body the arguments,

    <|channel|>analysis<|message|>Need the weather.<|end|>
    <|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris"}<|call|>

(the prompt ends with ``<|start|>assistant``, so the first message's role is already written; the
recipient may also come before the channel: ``<|start|>assistant to=functions.f<|channel|>commentary
json<|message|>``, as gpt-oss's chat template writes past calls). Several calls come as several such
messages (``<|call|>`` ends the model's turn, though: the frontend stops the generation there,
``turn_ends``, and the model goes on with the call's result in its next prompt). Every assistant
message whose recipient is ``functions.NAME`` is a call to NAME, whatever its channel;
the ``analysis`` channel's bodies are the reasoning (content when reasoning is off: nothing is lost);
the other bodies (``final``, a ``commentary`` preamble, a built-in tool's) are the content. A body ends
at ``<|end|>``, ``<|call|>`` or ``<|return|>`` (or where the generation stopped: a call is then complete,
``{}`` when it has no arguments). A message of another author (a tool's result the model went on to
imagine, ``<|start|>functions.f to=assistant...``) is dropped. Text outside harmony's markers (a decoder
that dropped them) is content.

This parser reads the whole output, the reasoning included: with it, the gpt_oss reasoning parser is
not run (openai_frontend/reasoning.py chat_parsers); vLLM names it ``openai`` (its
``--tool-call-parser openai``), ``harmony`` is the same parser. The markers are special tokens of
the o200k_harmony vocabulary, which the direct path's decoder keeps (``special_tokens``).
"""
from __future__ import annotations

import re

from openai_frontend.harmony_format import (CALL, CHANNEL, CONSTRAIN, END, MESSAGE, REASONING_CHANNEL, RETURN, START,
                                            body_piece)
from openai_frontend.tool_parsers.base import WHITESPACE, ToolCallDelta, ToolParser

FUNCTIONS = "functions."
RECIPIENT = re.compile(r"to=([^\s<]+)")
CHANNEL_NAME = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]*)")
# What may open the first message's header (its role is in the prompt): the channel, or a recipient
HEADER_OPENINGS = (CHANNEL, " to=", "to=")


class HarmonyParser(ToolParser):
    """States: ``between`` (before a message), ``header`` (to ``<|message|>``), ``body`` (to its end)."""

    name = "openai"
    special_tokens = (START, CHANNEL, MESSAGE, CONSTRAIN, END, CALL, RETURN)
    initial_state = "between"
    reads_reasoning = True
    turn_ends = (CALL,)
    instructions = ("To call a function, write a commentary message addressed to it: "
                    f"{CHANNEL}commentary to=functions.<function-name> {CONSTRAIN}json{MESSAGE}"
                    f"<args-json-object>{CALL}")

    def __init__(self, reasoning: bool = True):
        """``reasoning``: the analysis channel is reasoning_content (False: content)."""
        super().__init__()
        self._reasoning = reasoning
        self._kind = "content"  # what the body is: "content", "reasoning" or "call"
        self._started = False  # a call's arguments: non-whitespace text has come
        self._held = ""  # a call's arguments: trailing whitespace (dropped at the body's end)
        self._first = True  # before the first message (its header may open with its recipient)
        self._plain_opening = False  # the header read opened with "to=", no marker

    @staticmethod
    def format_call(name: str, arguments: str) -> str:
        return f"{CHANNEL}commentary to={FUNCTIONS}{name} {CONSTRAIN}json{MESSAGE}{arguments}{CALL}"

    @staticmethod
    def history(messages: list[dict]) -> list[dict]:
        from openai_frontend.tools import one_call_per_message
        return one_call_per_message(messages)

    # --------------------------------------------------------------------- the states

    def _between(self, final: bool) -> None:
        buffer = self._buffer
        openings = HEADER_OPENINGS if self._first else (CHANNEL,)
        if buffer.startswith(START):
            self._buffer, self._state = buffer[len(START):], "header"
        elif buffer.startswith(openings):
            self._plain_opening, self._state = not buffer.startswith(CHANNEL), "header"
        elif not buffer or (not final and any(m.startswith(buffer) for m in (START, *openings))):
            return  # a marker may be arriving
        else:
            self._kind, self._state = "content", "body"
        self._first = False

    def _header(self, final: bool) -> None:
        """The role maybe, a recipient and the channel in either order, a format maybe, to ``<|message|>``."""
        at = self._buffer.find(MESSAGE)
        if at < 0:
            if final and self._plain_opening:  # "to=" with no header after it: text
                self._kind, self._state = "content", "body"
            elif final:  # cut off inside a header: nothing of it is text
                self._buffer = ""
            return
        self._plain_opening = False
        header, self._buffer = self._buffer[:at], self._buffer[at + len(MESSAGE):]
        recipient = RECIPIENT.search(header)
        channel = CHANNEL_NAME.search(header)
        author = header.split(CHANNEL)[0].split("to=")[0].split()
        if author and author[0] != "assistant":  # (the first message's role is in the prompt)
            self._kind = "dropped"
        elif recipient and recipient.group(1).startswith(FUNCTIONS):
            self._kind, self._started, self._held = "call", False, ""
            self._out.tool_calls.append(ToolCallDelta(self._calls, "", self.make_id(),
                                                      recipient.group(1)[len(FUNCTIONS):]))
            self._calls += 1
        elif channel and channel.group(1) == REASONING_CHANNEL and self._reasoning:
            self._kind = "reasoning"
        else:
            self._kind = "content"
        self._state = "body"

    def _body(self, final: bool) -> None:
        text, self._buffer, ended = body_piece(self._buffer, final)
        self._emit(text)
        if ended:
            self._end_body()
            self._state = "between"
        elif final:  # the generation stopped in the body (at a stop string: <|call|>, turn_ends)
            self._end_body()

    def _emit(self, text: str) -> None:
        if self._kind == "reasoning":
            self._out.reasoning += text
        elif self._kind == "content":
            self._out.content += text
        elif self._kind == "call":  # the arguments as written, their surrounding whitespace left out
            text = self._held + (text if self._started else text.lstrip(WHITESPACE))
            kept = text.rstrip(WHITESPACE)
            self._held = text[len(kept):]
            if kept:
                self._started = True
                self._out.tool_calls.append(ToolCallDelta(self._calls - 1, kept))

    def _end_body(self) -> None:
        if self._kind == "call" and not self._started:  # a call without arguments
            self._out.tool_calls.append(ToolCallDelta(self._calls - 1, "{}"))
        self._kind, self._held = "content", ""
