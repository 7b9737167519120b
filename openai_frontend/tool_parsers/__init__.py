"""Tool-call parsers: the model's text -> content and OpenAI ``tool_calls``, streamed.

One module per format: hermes.py (``<tool_call>{...}</tool_call>``: Hermes, Qwen 2.5+, and the
default), llama3_json.py (``{"name", "parameters"}``, optionally after ``<|python_tag|>``),
mistral.py (``[TOOL_CALLS][{...}]``; also the bare array that ``tool_choice: "required"``
enforces), harmony.py (gpt-oss's harmony messages addressed ``to=functions.NAME``; vLLM's name for it,
``openai``, and ``harmony``). base.py holds what they share (the streaming JSON call scanner). The
frontend picks one from its ``--tool_call_parser`` flag, else from the chat template's text.
"""
from __future__ import annotations

from openai_frontend.tool_parsers.base import MessageDelta, ToolCallDelta, ToolParser, coalesce, merge_calls
from openai_frontend.tool_parsers.harmony import HarmonyParser
from openai_frontend.tool_parsers.hermes import HermesParser
from openai_frontend.tool_parsers.llama3_json import Llama3JsonParser
from openai_frontend.tool_parsers.mistral import ArrayParser, MistralParser

PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in (HermesParser, Llama3JsonParser,
                                                                           MistralParser, HarmonyParser)}
PARSERS["harmony"] = HarmonyParser  # (vLLM names it "openai"; "harmony" is what its format is called)
DEFAULT = HermesParser.name

__all__ = ["PARSERS", "DEFAULT", "ArrayParser", "HarmonyParser", "MessageDelta", "ToolCallDelta", "ToolParser", "coalesce",
           "merge_calls", "get_parser", "parser_for_template"]


def get_parser(name: str) -> type[ToolParser]:
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown tool call parser {name!r}; choose one of {', '.join(sorted(PARSERS))}") from None


def parser_for_template(template) -> str:
    """The format a chat template teaches its model: ``<|channel|>`` (gpt-oss's harmony) -> openai,
    ``<tool_call>`` -> hermes, ``[TOOL_CALLS]`` -> mistral, ``<|python_tag|>`` (Llama 3.1+) ->
    llama3_json; otherwise hermes."""
    text = template if isinstance(template, str) else str(template or "")
    if "<|channel|>" in text:
        return HarmonyParser.name
    if "<tool_call>" in text:
        return HermesParser.name
    if "[TOOL_CALLS]" in text:
        return MistralParser.name
    if "<|python_tag|>" in text or ("<|start_header_id|>" in text and "tools" in text):
        return Llama3JsonParser.name
    return DEFAULT
