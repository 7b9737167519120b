"""Reasoning parsers: a reasoning model's text -> ``reasoning_content`` and ``content``, streamed.

One module per format: deepseek_r1.py (the output starts inside ``<think>``, ends it at
``</think>``), qwen3.py (``<think>...</think>`` written by the model; off with
``enable_thinking: false``), gpt_oss.py (harmony's ``analysis`` channel). think_tags.py holds what
the first two share, base.py what all do. The frontend picks one from its ``--reasoning_parser``
flag, else from the chat template's text (``parser_for_template``), else none.
"""
from __future__ import annotations

from openai_frontend.reasoning_parsers.base import ReasoningDelta, ReasoningParser
from openai_frontend.reasoning_parsers.deepseek_r1 import DeepSeekR1Parser
from openai_frontend.reasoning_parsers.gpt_oss import GptOssParser
from openai_frontend.reasoning_parsers.qwen3 import Qwen3Parser

PARSERS: dict[str, type[ReasoningParser]] = {parser.name: parser for parser in (DeepSeekR1Parser, Qwen3Parser,
                                                                                GptOssParser)}
NONE = "none"  # the flag's value that turns reasoning parsing off

__all__ = ["PARSERS", "NONE", "ReasoningDelta", "ReasoningParser", "get_parser", "parser_for_template"]

# DeepSeek's own tokens in its chat templates (R1, V3, the R1 distills): "<｜Assistant｜>"
DEEPSEEK_MARKS = ("<｜Assistant｜>", "<｜end▁of▁sentence｜>")


def get_parser(name: str | None) -> type[ReasoningParser] | None:
    if name is None or name == NONE:
        return None
    try:
        return PARSERS[name]
    except KeyError:
        raise ValueError(f"unknown reasoning parser {name!r}; choose one of "
                         f"{', '.join(sorted(PARSERS) + [NONE])}") from None


def parser_for_template(template) -> str:
    """The reasoning format a chat template teaches its model: ``<think>`` in a DeepSeek template
    -> deepseek_r1, ``<think>`` elsewhere (Qwen3) -> qwen3, ``<|channel|>`` (harmony) -> gpt_oss;
    otherwise none."""
    text = template if isinstance(template, str) else str(template or "")
    if "<think>" in text:
        return DeepSeekR1Parser.name if any(mark in text for mark in DEEPSEEK_MARKS) else Qwen3Parser.name
    if "<|channel|>" in text:
        return GptOssParser.name
    return NONE
