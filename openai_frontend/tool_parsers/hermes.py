"""Hermes / Qwen 2.5+ tool calls: each call a JSON object inside its own tags,

    <tool_call>
    {"name": "get_weather", "arguments": {"city": "Paris"}}
    </tool_call>

with content before, between or after the calls. ``parameters`` is read as ``arguments`` too.
The tags are plain text in Qwen's and SmolLM2's vocabularies (nothing special to keep).
"""
from __future__ import annotations

import json

from openai_frontend.tool_parsers.base import WHITESPACE, ToolParser

START, END = "<tool_call>", "</tool_call>"


class HermesParser(ToolParser):
    name = "hermes"
    markers = (START,)
    instructions = (
        "For each function call, return a json object with function name and arguments within "
        f"{START}{END} XML tags:\n{START}\n"
        '{"name": <function-name>, "arguments": <args-json-object>}\n'
        f"{END}")

    @staticmethod
    def format_call(name: str, arguments: str) -> str:
        return f'{START}\n{{"name": {json.dumps(name, ensure_ascii=False)}, "arguments": {arguments}}}\n{END}'

    def _section(self, final: bool) -> None:
        self._call_or_content(final)

    def _after_call(self, final: bool) -> None:
        """Whitespace, then the closing tag (a missing one is forgiven)."""
        rest = self._buffer.lstrip(WHITESPACE)
        if rest.startswith(END):
            self._buffer = rest[len(END):]
        elif END.startswith(rest):  # the closing tag may still be coming
            if not final:
                return
            self._buffer = ""
        else:
            self._buffer = rest
        self._back_to_content()
