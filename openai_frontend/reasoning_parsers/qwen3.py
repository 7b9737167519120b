"""Qwen3's thinking: the output writes ``<think>...</think>`` before the answer; an output that does
not start with ``<think>`` is all content. Where the prompt itself ends with ``<think>`` (the
thinking-only Qwen3-2507 templates write it into the generation prompt), the output starts inside the
reasoning. ``chat_template_kwargs: {"enable_thinking": false}`` (the template then writes an empty
think block into the prompt) turns reasoning off for the request: everything is content."""
from __future__ import annotations

from openai_frontend.reasoning_parsers.think_tags import ThinkTagParser


class Qwen3Parser(ThinkTagParser):
    name = "qwen3"
    follows_enable_thinking = True
