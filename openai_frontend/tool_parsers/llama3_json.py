"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer is a call object (several are separated by
``;``), optionally after the ``<|python_tag|>`` special token,

    <|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}

``arguments`` is read as ``parameters`` too. An answer that starts with ``{`` is a call only if
its first key is ``"name"``; any other answer is content (a ``<|python_tag|>`` later in it opens
calls there).
"""
from __future__ import annotations

import json

from openai_frontend.tool_parsers.base import ToolParser

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = (PYTHON_TAG,)
    special_tokens = (PYTHON_TAG,)
    initial_state = "start"
    first_keys = ("name",)  # a JSON answer that starts otherwise is content
    instructions = ('To call a function, respond with only a JSON object of the form '
                    '{"name": <function-name>, "parameters": <args-json-object>}.')

    @staticmethod
    def format_call(name: str, arguments: str) -> str:
        return f'{{"name": {json.dumps(name, ensure_ascii=False)}, "parameters": {arguments}}}'

    def _start(self, final: bool) -> None:
        """The answer's first characters: a bare call object, or content."""
        self._call_or_content(final)

    _section = _start  # after <|python_tag|>

    def _after_call(self, final: bool) -> None:
        rest = self._rest_after_call(final)
        if rest is None:
            return
        if rest[0] == ";":
            self._buffer = rest[1:]
            self._state = "next"
        else:
            self._buffer = rest
            self._back_to_content()

    def _next(self, final: bool) -> None:
        """After a ``;``: another call, or the end of the calls."""
        if not self._skip_whitespace():
            if final:
                self._buffer = ""
                self._back_to_content()
            return
        if self._buffer[0] == "{":
            self._start_call()
        else:
            self._back_to_content()
