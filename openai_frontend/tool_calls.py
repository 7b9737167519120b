"""Tool calls on the way out: which parser reads a choice's text, the detokenizer it needs, and
the finish reason.

Per ``tool_choice`` (tools.py says what each does):
- ``auto``: the server's format parser (openai_frontend/tool_parsers/: ``--tool_call_parser``,
  else the one the chat template teaches); with ``parallel_tool_calls: false`` only the first
  call is kept.
- ``required``: ``ArrayParser`` reads the enforced ``[{"name", "parameters"}, ...]``.
- a named function: ``NamedCallParser``: the enforced output is the arguments object itself.

Streaming is incremental in every mode: a call's first delta (``index``, ``id``, ``type``,
``function.name``, ``arguments: ""``) goes out as soon as its name is complete (for a named
function, before the first argument text), then ``function.arguments`` pieces as the JSON grows,
the envelope (``[``, ``{"name": ..., "parameters":``, ``}``, ``]``) stripped as it is read. The
unary answer is the same parser fed the whole text, so the streamed pieces concatenate to it.

Markers that are special tokens (Mistral's ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``) reach the
parser on the direct path only (``keep_markers_decoder``); through ``tensorrt_llm_bls`` the text
comes from postprocessing, which drops special tokens (Llama 3's bare JSON calls still parse).
"""
from __future__ import annotations

from typing import Callable

from openai_frontend.tool_parsers import ArrayParser, MessageDelta, ToolCallDelta, ToolParser
from openai_frontend.tool_parsers.base import hex_call_id
from openai_frontend.tools import ToolRequest
from serving.tokenization import fast_decoder


class NamedCallParser:
    """``tool_choice`` naming a function: every character of the output is its arguments."""

    def __init__(self, name: str):
        self.name = name
        self.made_calls = False

    def _header(self) -> list[ToolCallDelta]:
        if self.made_calls:
            return []
        self.made_calls = True
        return [ToolCallDelta(0, "", hex_call_id(), self.name)]

    def push(self, text: str) -> MessageDelta:
        if not text:
            return MessageDelta()
        return MessageDelta(tool_calls=self._header() + [ToolCallDelta(0, text)])

    def finish(self) -> MessageDelta:
        return MessageDelta(tool_calls=self._header())

    def parse(self, text: str) -> MessageDelta:
        return self.push(text).extend(self.finish())


class FirstCallOnly:
    """``parallel_tool_calls: false`` with ``auto``: the calls after the first are dropped."""

    def __init__(self, parser: ToolParser):
        self.parser = parser

    @property
    def made_calls(self) -> bool:
        return self.parser.made_calls

    @staticmethod
    def _first(delta: MessageDelta) -> MessageDelta:
        delta.tool_calls = [call for call in delta.tool_calls if call.index == 0]
        return delta

    def push(self, text: str) -> MessageDelta:
        return self._first(self.parser.push(text))

    def finish(self) -> MessageDelta:
        return self._first(self.parser.finish())

    def parse(self, text: str) -> MessageDelta:
        return self.push(text).extend(self.finish())


def output_parsers(tools: ToolRequest | None, parser: type[ToolParser]) -> Callable[[], object] | None:
    """A maker of one choice's output parser, or None when the output is plain content."""
    if tools is None or tools.choice == "none":
        return None
    if tools.choice == "function":
        return lambda: NamedCallParser(tools.function)
    if tools.choice == "required":
        return ArrayParser
    if not tools.parallel:
        return lambda: FirstCallOnly(parser())
    return parser


def turn_stops(tools: ToolRequest | None, parser: type[ToolParser]) -> list[str]:
    """Stop strings a request gets from its tool-call format: with tool_choice auto, the text that ends
    the model's turn at a call besides its end token (gpt-oss's ``<|call|>``: the model waits for the
    result, which the client sends back; generating on, it would imagine one)."""
    if tools is None or tools.choice != "auto":
        return []
    return list(parser.turn_ends)


def finish_reason(reason: str, parser) -> str:
    """OpenAI's ``tool_calls`` when the model stopped after making calls (a cut stays ``length``)."""
    return "tool_calls" if parser is not None and parser.made_calls and reason == "stop" else reason


def keep_markers_decoder(tokenizer, markers: tuple[str, ...]) -> Callable[[list[int]], str] | None:
    """ids -> text that keeps the parser's markers when they are special tokens (Mistral's
    ``[TOOL_CALLS]``, Llama's ``<|python_tag|>``; decoding them as clients read text would drop
    them) and drops every other special token as usual. None when the usual decoding keeps them."""
    vocab = tokenizer.get_vocab()
    special = set(getattr(tokenizer, "all_special_ids", []) or [])
    special |= {token_id for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
                if getattr(token, "special", False)}
    keep = {vocab[marker] for marker in markers if marker in vocab} & special
    if not keep:
        return None
    drop = frozenset(special - keep)
    decode = fast_decoder(tokenizer, skip_special_tokens=False)
    return lambda ids: decode([i for i in ids if i not in drop])
