"""Server-sent events as the OpenAI API streams them: ``data: <json>`` per chunk, a blank line
after each, and ``data: [DONE]`` at the end."""
from __future__ import annotations

import json

from openai_frontend.responses import ResponseShape

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive",
           "X-Accel-Buffering": "no"}  # proxies must not buffer a stream


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"


class TextChunkEncoder:
    """The bytes of a text chunk, the one event sent per generated token: a prefix and suffix
    fixed for the request around the JSON of the text, so only the text is encoded per token.
    Equal, once parsed, to ``event(shape.chunk(index, text, with_usage_field=...))``."""

    def __init__(self, shape: ResponseShape, with_usage_field: bool):
        marker = "\x00TEXT\x00"
        template = event(shape.chunk(0, marker, with_usage_field=with_usage_field)).decode("utf-8")
        index_field = '"index":0,'
        head, tail = template.split(json.dumps(marker, ensure_ascii=False))
        before_index, after_index = head.split(index_field)
        self._before_index = before_index.encode("utf-8") + b'"index":'
        self._after_index = ("," + after_index).encode("utf-8")
        self._tail = tail.encode("utf-8")

    def text(self, index: int, text: str) -> bytes:
        return b"".join((self._before_index, str(index).encode(), self._after_index,
                         json.dumps(text, ensure_ascii=False).encode("utf-8"), self._tail))
