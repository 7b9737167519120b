"""Reasoning on the way out: a reasoning model's text -> ``reasoning_content`` and the content, which
then goes through the tool-call parser when tools are on (tool_calls.py).

The format's parser (openai_frontend/reasoning_parsers/: ``--reasoning_parser``, else the one the
chat template teaches, else none) is made per choice and reads the text first; what it finds to be
content is fed to the tool-call parser (but gpt-oss's harmony tool parser reads the whole output, its
analysis channel included: it takes the reasoning parser's place, ``chat_parsers``). Streamed, each piece's reasoning goes out before its
content; unary, the same parsers read the whole text, so the streamed pieces concatenate to it.
Chat only: /v1/completions returns the text as written.
"""
from __future__ import annotations

from functools import partial
from typing import Callable

from openai_frontend.protocol import GenerationRequest
from openai_frontend.reasoning_parsers import ReasoningParser
from openai_frontend.tool_calls import output_parsers
from openai_frontend.tool_parsers import MessageDelta, ToolParser
from openai_frontend.tools import ToolRequest


class ReasoningThenTools:
    """One choice's reasoning parser, and ``tools`` (a tool-call parser, or None: plain content)
    reading the content it finds."""

    def __init__(self, reasoning: ReasoningParser, tools=None):
        self.reasoning = reasoning
        self.tools = tools

    @property
    def made_calls(self) -> bool:
        return self.tools is not None and self.tools.made_calls

    def _then_tools(self, found, final: bool) -> MessageDelta:
        if self.tools is None:
            return MessageDelta(content=found.content, reasoning=found.reasoning)
        message = self.tools.push(found.content)
        if final:
            message.extend(self.tools.finish())
        message.reasoning = found.reasoning + message.reasoning
        return message

    def push(self, text: str) -> MessageDelta:
        return self._then_tools(self.reasoning.push(text), final=False)

    def finish(self) -> MessageDelta:
        return self._then_tools(self.reasoning.finish(), final=True)

    def parse(self, text: str) -> MessageDelta:
        return self.push(text).extend(self.finish())


def request_reasoning(parsed: GenerationRequest, parser: type[ReasoningParser] | None) -> type[ReasoningParser] | None:
    """The server's reasoning parser for this chat request, or None where the request turns thinking
    off (``chat_template_kwargs: {"enable_thinking": false}`` for Qwen3's format)."""
    if parser is None:
        return None
    if parser.follows_enable_thinking and parsed.template_kwargs.get("enable_thinking") is False:
        return None
    return parser


def with_reasoning(tools: Callable[[], object] | None, reasoning: type[ReasoningParser] | None, prompt: str,
                   guided: bool) -> Callable[[], object] | None:
    """A maker of one choice's output parser: ``tools``'s (None: plain content) behind the reasoning
    parser when there is one. ``prompt``: the rendered prompt; ``guided``: the request has a guide."""
    if reasoning is None:
        return tools
    return lambda: ReasoningThenTools(reasoning(prompt, guided), tools() if tools is not None else None)


def chat_parsers(tools: ToolRequest | None, tool_parser: type[ToolParser], reasoning: type[ReasoningParser] | None,
                 prompt: str, guided: bool) -> tuple[Callable[[], object] | None, tuple[str, ...]]:
    """A maker of one chat choice's output parser (None: plain content) and the markers its decoder must
    keep. ``tool_parser`` reads tool_choice auto's text; ``reasoning``: the request's reasoning parser (None:
    off). A tool parser that ``reads_reasoning`` (harmony's: calls are messages beside the analysis
    channel's) reads the whole output with tool_choice auto, the analysis channel as reasoning when
    reasoning is on (as content when off), and the reasoning parser is not run."""
    auto = tools is not None and tools.choice == "auto"
    if auto and tool_parser.reads_reasoning:
        return output_parsers(tools, partial(tool_parser, reasoning=reasoning is not None)), tool_parser.special_tokens
    parsers = output_parsers(tools, tool_parser)
    markers = tool_parser.special_tokens if auto else ()
    if reasoning is not None:  # the reasoning first, its content then through the tool-call parser
        parsers = with_reasoning(parsers, reasoning, prompt, guided)
        markers += reasoning.special_tokens
    return parsers, markers
