"""OpenAI's harmony format (gpt-oss's output) as both of its readers take it: the markers, and where a
message's body ends.

An output is messages, ``<|start|>ROLE<|channel|>CHANNEL [to=RECIPIENT] [<|constrain|>FORMAT]<|message|>BODY``
and an end marker (the first message's ``<|start|>ROLE`` is the prompt's). The reasoning parser
(reasoning_parsers/gpt_oss.py: no tools) and the tool-call parser (tool_parsers/harmony.py: tools on) read
the headers each their own way and the bodies the same way, ``body_piece``.
"""
from __future__ import annotations

from openai_frontend.tool_parsers.base import marker_prefix_length

START, CHANNEL, MESSAGE, CONSTRAIN = "<|start|>", "<|channel|>", "<|message|>", "<|constrain|>"
END, CALL, RETURN = "<|end|>", "<|call|>", "<|return|>"
BODY_ENDS = (END, CALL, RETURN)
REASONING_CHANNEL = "analysis"


def body_piece(buffer: str, final: bool) -> tuple[str, str, bool]:
    """(the body text ``buffer`` holds now, what stays buffered, whether the body ended): the text before the
    first end marker (the marker consumed), else all of it but a tail that may begin one (none held when
    ``final``: the generation stopped inside the body)."""
    found = [(buffer.find(marker), marker) for marker in BODY_ENDS if marker in buffer]
    if found:
        at, marker = min(found)
        return buffer[:at], buffer[at + len(marker):], True
    keep = 0 if final else marker_prefix_length(buffer, BODY_ENDS)
    return buffer[:len(buffer) - keep], buffer[len(buffer) - keep:], False
