"""DeepSeek-R1's reasoning: R1's chat template ends the generation prompt with ``<think>\\n``, so the
output starts inside the reasoning and ends it at ``</think>``; an explicit leading ``<think>`` (the
templates before 2025-01 left it to the model) is read past. An output without ``</think>`` is all
reasoning (cut off while thinking), as vLLM's and SGLang's ``deepseek_r1`` parsers read it."""
from __future__ import annotations

from openai_frontend.reasoning_parsers.think_tags import ThinkTagParser


class DeepSeekR1Parser(ThinkTagParser):
    name = "deepseek_r1"
    starts_inside = True
