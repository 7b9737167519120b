"""Server-sent events as the OpenAI API streams them: ``data: <json>`` per chunk, a blank line
after each, and ``data: [DONE]`` at the end."""
from __future__ import annotations

import json

DONE = b"data: [DONE]\n\n"
HEADERS = {"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "Connection": "keep-alive",
           "X-Accel-Buffering": "no"}  # proxies must not buffer a stream


def event(body: dict) -> bytes:
    return b"data: " + json.dumps(body, ensure_ascii=False, separators=(",", ":")).encode("utf-8") + b"\n\n"
