"""What every tool-call parser shares: the deltas it returns, the emitter that turns a call
object's scan (json_scanner.CallScanner) into deltas, and the content stream around the calls.

A parser is made per choice and fed the choice's text in pieces of any size (``push``), then
``finish``; each returns a ``MessageDelta``: new content text and new tool-call deltas. The
unary answer is the same parser fed the whole text at once, so the streamed deltas concatenate
to it exactly, wherever the chunks were cut. ``function.arguments`` is the model's own text of
the arguments value (not re-serialized), streamed as it grows once the call's name is complete.
"""
from __future__ import annotations

import secrets
import string
from dataclasses import dataclass, field

from openai_frontend.tool_parsers.json_scanner import WHITESPACE, CallScanner  # noqa: F401 (WHITESPACE: the parsers take it from here)


def hex_call_id() -> str:
    """OpenAI's shape: ``call_`` and 24 random characters."""
    return "call_" + secrets.token_hex(12)


def alphanumeric_call_id(length: int = 9) -> str:
    """Mistral's templates accept only 9 alphanumeric characters as a tool call id."""
    alphabet = string.ascii_letters + string.digits
    return "".join(secrets.choice(alphabet) for _ in range(length))


@dataclass
class ToolCallDelta:
    """A piece of call ``index``. The call's first delta has ``id`` and ``name`` (and arguments
    ""), the later ones only argument text."""

    index: int
    arguments: str = ""
    id: str | None = None
    name: str | None = None

    def to_openai(self) -> dict:
        if self.id is not None:
            return {"index": self.index, "id": self.id, "type": "function",
                    "function": {"name": self.name, "arguments": self.arguments}}
        return {"index": self.index, "function": {"arguments": self.arguments}}


@dataclass
class MessageDelta:
    content: str = ""
    tool_calls: list[ToolCallDelta] = field(default_factory=list)
    reasoning: str = ""  # a reasoning model's reasoning_content (openai_frontend/reasoning.py)

    def __bool__(self) -> bool:
        return bool(self.content or self.tool_calls or self.reasoning)

    def extend(self, other: "MessageDelta") -> "MessageDelta":
        self.content += other.content
        self.tool_calls += other.tool_calls
        self.reasoning += other.reasoning
        return self


def merge_calls(deltas: list[ToolCallDelta]) -> list[dict]:
    """Deltas -> whole calls, as ``message.tool_calls`` lists them."""
    calls: dict[int, dict] = {}
    for delta in deltas:
        call = calls.setdefault(delta.index, {"id": None, "type": "function",
                                              "function": {"name": None, "arguments": ""}})
        if delta.id is not None:
            call["id"], call["function"]["name"] = delta.id, delta.name
        call["function"]["arguments"] += delta.arguments
    return [calls[index] for index in sorted(calls)]


def coalesce(deltas: list[ToolCallDelta]) -> list[ToolCallDelta]:
    """Consecutive argument pieces of one call joined (a call's first delta stays on its own,
    with arguments "", as OpenAI streams it)."""
    out: list[ToolCallDelta] = []
    for delta in deltas:
        last = out[-1] if out else None
        if last is not None and last.id is None and delta.id is None and last.index == delta.index:
            last.arguments += delta.arguments
        else:
            out.append(ToolCallDelta(delta.index, delta.arguments, delta.id, delta.name))
    return out


class CallEmitter:
    """Turns a scanner's events into ``ToolCallDelta``s for call ``index``: nothing before the
    name is complete (argument text read before it waits), then the first delta, then pieces."""

    def __init__(self, index: int, make_id):
        self.index = index
        self._make_id = make_id
        self.emitted = False
        self._waiting = ""

    def events(self, events: list[tuple[str, str]]) -> list[ToolCallDelta]:
        out = []
        for kind, value in events:
            if kind == "name":
                if not self.emitted:
                    self.emitted = True
                    out.append(ToolCallDelta(self.index, "", self._make_id(), value))
                    if self._waiting:
                        out.append(ToolCallDelta(self.index, self._waiting))
                        self._waiting = ""
            elif self.emitted:
                if value:
                    out.append(ToolCallDelta(self.index, value))
            else:
                self._waiting += value
        return out

    def close(self, saw_arguments: bool) -> list[ToolCallDelta]:
        """At the end of the call's object: a call without arguments gets ``{}``."""
        if self.emitted and not saw_arguments:
            return [ToolCallDelta(self.index, "{}")]
        return []


# ----------------------------------------------------------------------------- the content around calls

class ContentStream:
    """Content text around tool calls. Whitespace next to a call is not content: a trailing run
    of whitespace is held until more text shows it is inside the content (dropped if a call
    starts instead), and whitespace right after a call is dropped. With no call made, the
    content is the text exactly."""

    def __init__(self):
        self._held = ""
        self._after_call = False

    def add(self, text: str) -> str:
        if self._after_call:
            text = text.lstrip(WHITESPACE)
            if not text:
                return ""
            self._after_call = False
        text = self._held + text
        kept = text.rstrip(WHITESPACE)
        self._held = text[len(kept):]
        return kept

    def call_starts(self) -> None:
        self._held = ""

    def call_ends(self) -> None:
        self._after_call = True

    def finish(self, made_calls: bool) -> str:
        out, self._held = ("" if made_calls else self._held), ""
        return out


def marker_prefix_length(text: str, markers: tuple[str, ...]) -> int:
    """Length of the longest tail of ``text`` that is a proper prefix of a marker (held back: the
    next piece may complete the marker)."""
    longest = max((len(m) for m in markers), default=0)
    for length in range(min(longest - 1, len(text)), 0, -1):
        tail = text[-length:]
        if any(marker.startswith(tail) for marker in markers):
            return length
    return 0


# ----------------------------------------------------------------------------- parsers

class TextStateMachine:
    """The driver the output parsers share (these tool-call parsers, openai_frontend/reasoning_parsers/): text
    fed in pieces gathers in ``_buffer``; ``_state`` names the method ``_<state>(final)`` that reads it next,
    and ``_run`` calls state methods until one leaves state and buffer as they were (waiting for more text, or
    with ``final`` everything settled)."""

    initial_state = ""

    def __init__(self):
        self._buffer = ""
        self._state = self.initial_state

    def _run(self, final: bool) -> None:
        while True:
            before = (self._state, self._buffer)
            getattr(self, "_" + self._state)(final)
            if (self._state, self._buffer) == before:
                return


class ToolParser(TextStateMachine):
    """A format's parser: content until one of ``markers``, then the format's run of calls.

    Subclasses set ``name``, ``markers`` (text that opens calls inside the content),
    ``special_tokens`` (those markers that are special tokens, which the detokenizer must then
    keep; openai_frontend/tool_calls.py), ``instructions`` (how to call, for templates that know
    nothing of tools), ``format_call`` (a past call as the model writes it), ``history`` (past
    calls arranged for the format's templates), and the states
    after a marker: ``_section`` (what follows the marker) and ``_after_call``. A state method
    reads ``self._buffer``; with ``final`` false it may wait for more text, with ``final`` true
    it must settle everything.
    """

    name = ""
    markers: tuple[str, ...] = ()
    special_tokens: tuple[str, ...] = ()
    initial_state = "content"
    first_keys: tuple[str, ...] | None = None  # a call object's first key must be one of these
    make_id = staticmethod(hex_call_id)
    instructions = ""
    # reads the whole output, reasoning included (harmony's), in the reasoning parser's place (made with
    # ``reasoning=``: whether the reasoning is reasoning_content); openai_frontend/reasoning.py chat_parsers
    reads_reasoning = False
    # text that ends the model's turn besides its end token (harmony's <|call|>): with tool_choice auto,
    # the request's stop strings get them (tool_calls.turn_stops)
    turn_ends: tuple[str, ...] = ()

    def __init__(self):
        super().__init__()
        self._text = ContentStream()
        self._scanner: CallScanner | None = None
        self._emitter: CallEmitter | None = None
        self._opening = ""  # the marker and whitespace read before the current call's object
        self._calls = 0  # calls emitted so far
        self._out = MessageDelta()

    @staticmethod
    def format_call(name: str, arguments: str) -> str:
        raise NotImplementedError

    @staticmethod
    def history(messages: list[dict]) -> list[dict]:
        """The request's messages as the format's chat templates read past calls (as they are,
        unless a format says otherwise)."""
        return messages

    # --------------------------------------------------------------------- the interface

    def push(self, text: str) -> MessageDelta:
        self._buffer += text
        self._run(final=False)
        out, self._out = self._out, MessageDelta()
        return out

    def finish(self) -> MessageDelta:
        self._run(final=True)
        self._out.content += self._text.finish(self._calls > 0)
        out, self._out = self._out, MessageDelta()
        return out

    def parse(self, text: str) -> MessageDelta:
        """The whole text at once (the unary answer): what streaming it gives, joined."""
        return self.push(text).extend(self.finish())

    @property
    def made_calls(self) -> bool:
        return self._calls > 0

    # --------------------------------------------------------------------- the machine (TextStateMachine._run)

    def _emit_content(self, text: str) -> None:
        if text:
            self._out.content += self._text.add(text)

    def _content(self, final: bool) -> None:
        """Send the content up to the first marker (holding a tail that may start one)."""
        buffer = self._buffer
        found = [(buffer.find(m), m) for m in self.markers if m in buffer]
        if found:
            at, marker = min(found)
            self._emit_content(buffer[:at])
            self._buffer = buffer[at + len(marker):]
            self._opening = marker
            self._state = "section"
            return
        keep = 0 if final else marker_prefix_length(buffer, self.markers)
        self._emit_content(buffer[:len(buffer) - keep])
        self._buffer = buffer[len(buffer) - keep:]

    def _skip_whitespace(self) -> bool:
        """Drops leading whitespace (kept in ``_opening``); True when text follows it."""
        stripped = self._buffer.lstrip(WHITESPACE)
        self._opening += self._buffer[:len(self._buffer) - len(stripped)]
        self._buffer = stripped
        return bool(stripped)

    def _first_char(self, final: bool) -> str | None:
        """The first character after an opening and its whitespace; None while only whitespace has
        come (at the end of the text, the opening then goes back to content)."""
        if self._skip_whitespace():
            return self._buffer[0]
        if final:
            self._back_to_content(self._opening)
        return None

    def _rest_after_call(self, final: bool) -> str | None:
        """What follows a call's object, whitespace dropped; None while nothing more has come (at
        the end of the text, the calls are then over)."""
        rest = self._buffer.lstrip(WHITESPACE)
        if not rest and final:
            self._buffer = ""
            self._back_to_content()
        return rest or None

    def _call_or_content(self, final: bool) -> None:
        """After an opening: a call object starts here, or the opening was content after all."""
        first = self._first_char(final)
        if first == "{":
            self._start_call()
        elif first is not None:
            self._back_to_content(self._opening)

    def _back_to_content(self, text: str = "") -> None:
        """Calls are over; ``text`` (what looked like a call but is not) is content."""
        self._emit_content(text)
        self._opening = ""
        if self._calls:
            self._text.call_ends()
        self._state = "content"

    def _start_call(self) -> None:
        self._scanner = CallScanner(self.first_keys)
        self._emitter = CallEmitter(self._calls, self.make_id)
        self._state = "call"

    def _call(self, final: bool) -> None:
        scanner, emitter = self._scanner, self._emitter
        used, events = scanner.feed(self._buffer)
        self._buffer = self._buffer[used:]
        for delta in emitter.events(events):
            if delta.id is not None:
                self._calls += 1
                self._text.call_starts()  # whitespace before a call is not content
            self._out.tool_calls.append(delta)
        if not emitter.emitted and (scanner.failed or scanner.done or (final and not self._buffer)):
            self._not_a_call()
        elif scanner.done:
            self._out.tool_calls += emitter.close(scanner.saw_arguments)
            self._scanner, self._opening = None, ""
            self._state = "after_call"
        elif scanner.failed:  # a call under way ends here; the rest is content
            self._out.tool_calls += emitter.close(scanner.saw_arguments)
            self._scanner = None
            self._back_to_content()
        elif final:  # cut off (max_tokens) inside the arguments: the call stays as written
            self._scanner = None
            self._state = "content"

    def _not_a_call(self) -> None:
        """What looked like a call is not one: the marker and the text read are content."""
        raw = self._opening + self._scanner.raw
        self._scanner = None
        self._back_to_content(raw)

    def _section(self, final: bool) -> None:
        raise NotImplementedError

    def _after_call(self, final: bool) -> None:
        raise NotImplementedError
