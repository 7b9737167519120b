"""A JSON scanner that reads one tool-call object ``{"name": ..., "arguments": {...}}`` character
by character as the model's text arrives, so a call's name and argument pieces can be streamed
before the object is complete."""
from __future__ import annotations

import json

ARGUMENT_KEYS = ("arguments", "parameters")  # Hermes/Mistral write "arguments", Llama 3 "parameters"
WHITESPACE = " \t\r\n"


class CallScanner:
    """Reads one JSON object holding a call, a character at a time.

    ``feed(text)`` returns how many characters it used (all of them unless the object ended
    inside ``text``) and the events: ("name", str) once the name string is complete, ("args",
    raw text) as the arguments value grows (an object or array streams as written; a string that
    holds JSON is decoded and given whole). Other keys are skipped. After the object's closing
    brace ``done`` is set; on text that is not such an object, ``failed`` (``raw`` keeps what was
    read, for the caller to give back as content).
    """

    def __init__(self, first_keys: tuple[str, ...] | None = None):
        self.first_keys = first_keys  # when given: an object whose first key is another is no call
        self.state = "open"
        self.raw = ""  # every character read
        self.done = self.failed = False
        self.first_key: str | None = None
        self.name: str | None = None
        self.saw_arguments = False
        self._token = ""  # the key or the string/primitive value being read
        self._key: str | None = None
        self._stack: list[str] = []  # open brackets of an object/array value
        self._in_string = self._escape = False

    def feed(self, text: str) -> tuple[int, list[tuple[str, str]]]:
        events: list[tuple[str, str]] = []
        args_from = None  # where this feed's piece of a streamed arguments value starts
        i = 0
        while i < len(text) and not (self.done or self.failed):
            char = text[i]
            state = self.state
            if state == "nested":  # inside an object/array value
                if args_from is None and self._key in ARGUMENT_KEYS:
                    args_from = i
                self._nested(char)
                if not self._stack:  # the value closed with this character
                    if self._key in ARGUMENT_KEYS:
                        events.append(("args", text[args_from:i + 1]))
                        args_from = None
                    self.state = "after_value"
            elif state in ("key", "string"):
                self._token += char
                if self._escape:
                    self._escape = False
                elif char == "\\":
                    self._escape = True
                elif char == '"':
                    self._string_done(events)
            elif state == "primitive":
                if char in WHITESPACE + ",}":
                    self._primitive_done(events)
                    continue  # the delimiter belongs to the object: read it again
                self._token += char
            elif char in WHITESPACE:
                pass
            elif state == "open":
                self._expect(char == "{", "key_or_end")
            elif state == "key_or_end":
                if char == "}":
                    self._close()
                else:
                    self._expect(char == '"', "key")
                    self._token = char
            elif state == "colon":
                self._expect(char == ":", "value")
            elif state == "value":
                self._start_value(char)
                if self.state == "nested" and self._key in ARGUMENT_KEYS:
                    args_from = i
            elif state == "after_value":
                if char == ",":
                    self.state = "key_or_end"
                else:
                    self._expect(char == "}", "")
                    if not self.failed:
                        self._close()
            if not self.failed:
                self.raw += char
                i += 1
        if args_from is not None and self.state == "nested":
            events.append(("args", text[args_from:i]))
        return i, events

    # --------------------------------------------------------------------- pieces

    def _expect(self, ok: bool, next_state: str) -> None:
        if ok:
            self.state = next_state
        else:
            self.failed = True

    def _close(self) -> None:
        self.done = True
        self.state = "closed"

    def _start_value(self, char: str) -> None:
        if self._key in ARGUMENT_KEYS:
            self.saw_arguments = True
        if char in "{[":
            self._stack = [char]
            self._in_string = self._escape = False
            self.state = "nested"
        elif char == '"':
            self._token = char
            self.state = "string"
        elif char in "-0123456789tfn":
            self._token = char
            self.state = "primitive"
        else:
            self.failed = True

    def _nested(self, char: str) -> None:
        if self._in_string:
            if self._escape:
                self._escape = False
            elif char == "\\":
                self._escape = True
            elif char == '"':
                self._in_string = False
        elif char == '"':
            self._in_string = True
        elif char in "{[":
            self._stack.append(char)
        elif char in "}]":
            if {"{": "}", "[": "]"}[self._stack[-1]] != char:
                self.failed = True
            else:
                self._stack.pop()

    def _string_done(self, events: list) -> None:
        try:
            value = json.loads(self._token)
        except ValueError:
            self.failed = True
            return
        if not isinstance(value, str):
            self.failed = True
        elif self.state == "key":
            self._key = value
            if self.first_key is None:
                self.first_key = value
                if self.first_keys is not None and value not in self.first_keys:
                    self.failed = True
                    return
            self.state = "colon"
        else:
            self._value_done(value, events, decoded=True)
            self.state = "after_value"

    def _primitive_done(self, events: list) -> None:
        try:
            json.loads(self._token)
        except ValueError:
            self.failed = True
            return
        self._value_done(self._token, events, decoded=False)
        self.state = "after_value"

    def _value_done(self, value: str, events: list, decoded: bool) -> None:
        """A string (``decoded``) or primitive value is complete."""
        if self._key == "name":
            if decoded:
                self.name = value
                events.append(("name", value))
            else:
                self.failed = True
        elif self._key in ARGUMENT_KEYS:
            # A string holding the arguments' JSON (some models write it so) gives that text;
            # a primitive (null, a number) its own text.
            events.append(("args", value))
