"""Mistral tool calls: a ``[TOOL_CALLS]`` marker, then a JSON array of call objects,

    [TOOL_CALLS][{"name": "get_weather", "arguments": {"city": "Paris"}}]

with content before it. ``[TOOL_CALLS]`` is a special token in Mistral's v3 tokenizers, which
the frontend's detokenizer then keeps for this parser (openai_frontend/tool_calls.py). Call ids
are 9 alphanumeric characters: Mistral's chat templates refuse any other id when the calls come
back in the history. ``ArrayParser`` (the array alone, no marker) also reads the output of
``tool_choice: "required"``, whose calls are ``{"name", "parameters"}`` objects.
"""
from __future__ import annotations

import json

from openai_frontend.tool_parsers.base import ToolParser, alphanumeric_call_id, hex_call_id

MARKER = "[TOOL_CALLS]"


class MistralParser(ToolParser):
    name = "mistral"
    markers = (MARKER,)
    special_tokens = (MARKER,)
    make_id = staticmethod(alphanumeric_call_id)
    instructions = (f"To call functions, answer with {MARKER} followed by a JSON list of calls: "
                    f'{MARKER}[{{"name": <function-name>, "arguments": <args-json-object>}}]')

    def __init__(self):
        super().__init__()
        self._single = False  # a lone object after the marker instead of an array

    @staticmethod
    def format_call(name: str, arguments: str) -> str:
        return f'{MARKER}[{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}]'

    def _section(self, final: bool) -> None:
        first = self._first_char(final)
        if first is None:
            return
        if first == "[":
            self._opening += first
            self._buffer = self._buffer[1:]
            self._state = "item"
        elif first == "{":
            self._single = True
            self._start_call()
        else:
            self._back_to_content(self._opening)

    def _item(self, final: bool) -> None:
        """Inside the array, before a call (or its end)."""
        if not self._skip_whitespace():
            if final:
                self._back_to_content("" if self._calls else self._opening)
            return
        first = self._buffer[0]
        if first == "{":
            self._start_call()
        elif first == "]":  # (an empty list is no call)
            self._buffer = self._buffer[1:]
            self._back_to_content()
        else:
            self._back_to_content("" if self._calls else self._opening)

    def _after_call(self, final: bool) -> None:
        if self._single:
            self._single = False
            self._back_to_content()
            return
        rest = self._rest_after_call(final)
        if rest is None:
            return
        if rest[0] == ",":
            self._buffer = rest[1:]
            self._state = "item"
        else:
            self._buffer = rest[1:] if rest[0] == "]" else rest
            self._back_to_content()


class ArrayParser(MistralParser):
    """A bare JSON array of calls (the enforced output of ``tool_choice: "required"``), with
    OpenAI-shaped ids."""

    name = "array"
    markers = ()
    special_tokens = ()
    initial_state = "section"
    make_id = staticmethod(hex_call_id)
