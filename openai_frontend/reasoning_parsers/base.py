"""What every reasoning parser shares: the delta it returns and the held-back tail of a marker.

A parser is made per choice and fed the choice's text in pieces of any size (``push``), then
``finish``; each returns a ``ReasoningDelta``: new reasoning text and new content text. The unary
answer is the same parser fed the whole text at once (``parse``), so the streamed pieces
concatenate to it exactly, wherever the chunks were cut. The content goes on to the tool-call
parser when tools are on (openai_frontend/reasoning.py).
"""
from __future__ import annotations

from dataclasses import dataclass

from openai_frontend.tool_parsers.base import WHITESPACE, TextStateMachine, marker_prefix_length

__all__ = ["ReasoningDelta", "ReasoningParser", "WHITESPACE", "marker_prefix_length"]


@dataclass
class ReasoningDelta:
    reasoning: str = ""
    content: str = ""

    def extend(self, other: "ReasoningDelta") -> "ReasoningDelta":
        self.reasoning += other.reasoning
        self.content += other.content
        return self


class ReasoningParser(TextStateMachine):
    """A format's parser: a state machine over ``self._buffer``. Subclasses set ``name``,
    ``special_tokens`` (markers that are special tokens in the format's vocabularies: the detokenizer
    must keep them, openai_frontend/tool_calls.py keep_markers_decoder), ``template_marks`` (text of
    a chat template that teaches the format) and the states. A state method reads the buffer; with
    ``final`` false it may wait for more text, with ``final`` true it must settle everything."""

    name = ""
    special_tokens: tuple[str, ...] = ()
    initial_state = "content"
    # chat_template_kwargs {"enable_thinking": false} turns this format's reasoning off (Qwen3's
    # template then writes an empty think block into the prompt: the output is all content)
    follows_enable_thinking = False

    def __init__(self, prompt: str = "", guided: bool = False):
        """``prompt``: the rendered prompt (whether it opened the reasoning); ``guided``: a guide
        (structured output, an enforced tool call) governs the output from its first token."""
        super().__init__()
        self._out = ReasoningDelta()

    def push(self, text: str) -> ReasoningDelta:
        self._buffer += text
        self._run(final=False)
        out, self._out = self._out, ReasoningDelta()
        return out

    def finish(self) -> ReasoningDelta:
        self._run(final=True)
        out, self._out = self._out, ReasoningDelta()
        return out

    def parse(self, text: str) -> ReasoningDelta:
        """The whole text at once (the unary answer): what streaming it gives, joined."""
        return self.push(text).extend(self.finish())

    def _content(self, final: bool) -> None:
        """Everything from here on is content."""
        self._out.content += self._buffer
        self._buffer = ""
