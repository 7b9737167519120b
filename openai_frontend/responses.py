"""OpenAI response objects (plain dicts) for chat and text completions, whole and streamed.

Ids: ``chatcmpl-<hex>`` / ``cmpl-<hex>``, one per request, shared by every chunk of a stream;
``created``: Unix seconds when the request arrived; ``usage`` counts the prompt once per prompt
(not once per choice) and every choice's generated tokens.
"""
from __future__ import annotations

import time
import uuid
from dataclasses import dataclass, field

from openai_frontend.logprobs import TokenLogprob, chat_logprobs, completion_logprobs


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


@dataclass
class ResponseShape:
    """The fields every object of one request shares."""

    chat: bool
    model: str
    id: str = ""
    created: int = field(default_factory=lambda: int(time.time()))

    def __post_init__(self):
        self.id = self.id or ("chatcmpl-" if self.chat else "cmpl-") + uuid.uuid4().hex

    def _head(self, object_name: str) -> dict:
        return {"id": self.id, "object": object_name, "created": self.created, "model": self.model,
                "system_fingerprint": None}

    # ------------------------------------------------------------------------- whole responses

    def logprobs(self, entries: list[TokenLogprob] | None) -> dict | None:
        """A choice's ``logprobs`` field: null unless log-probs were asked for."""
        if entries is None:
            return None
        return chat_logprobs(entries) if self.chat else completion_logprobs(entries)

    def completion(self, texts: list[str], finish_reasons: list[str], prompt_tokens: int,
                   completion_tokens: int, logprobs: list[list[TokenLogprob] | None] | None = None,
                   tool_calls: list[list[dict] | None] | None = None,
                   reasoning: list[str | None] | None = None) -> dict:
        """``tool_calls`` (chat): per choice its calls, or None; a choice with calls and no text
        has ``content: null``, as OpenAI's. ``reasoning`` (chat, a reasoning parser on): per choice
        its ``reasoning_content`` or None; a choice with reasoning and no text has ``content: null``,
        as vLLM's."""
        logprobs = logprobs or [None] * len(texts)
        tool_calls = tool_calls or [None] * len(texts)
        if self.chat:
            choices = []
            for i, (text, reason, entries, calls) in enumerate(zip(texts, finish_reasons, logprobs, tool_calls)):
                message = {"role": "assistant", "content": text}
                if reasoning is not None:
                    message["reasoning_content"] = reasoning[i]
                    if reasoning[i]:
                        message["content"] = text or None
                if calls:
                    message.update(content=text or None, tool_calls=calls)
                choices.append({"index": i, "message": message, "logprobs": self.logprobs(entries),
                                "finish_reason": reason})
            body = self._head("chat.completion")
        else:
            choices = [{"index": i, "text": text, "logprobs": self.logprobs(entries), "finish_reason": reason}
                       for i, (text, reason, entries) in enumerate(zip(texts, finish_reasons, logprobs))]
            body = self._head("text_completion")
        body["choices"] = choices
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body

    # ------------------------------------------------------------------------- stream chunks

    def chunk(self, index: int, text: str | None, finish_reason: str | None = None,
              role: bool = False, with_usage_field: bool = False,
              logprobs: list[TokenLogprob] | None = None, tool_calls: list[dict] | None = None,
              reasoning: str | None = None) -> dict:
        """One choice's chunk: new text (with its tokens' log-probs when asked for), or (chat) the
        role announcement, new ``reasoning_content``, tool-call deltas, or its finish."""
        if self.chat:
            delta = {"role": "assistant", "content": ""} if role else ({"content": text} if text else {})
            if reasoning:
                delta["reasoning_content"] = reasoning
            if tool_calls:
                delta["tool_calls"] = tool_calls
            choice = {"index": index, "delta": delta, "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._head("chat.completion.chunk")
        else:
            choice = {"index": index, "text": text or "", "logprobs": self.logprobs(logprobs),
                      "finish_reason": finish_reason}
            body = self._head("text_completion")
        body["choices"] = [choice]
        if with_usage_field:
            body["usage"] = None  # OpenAI: null on every chunk but the last when usage is asked for
        return body

    def usage_chunk(self, prompt_tokens: int, completion_tokens: int) -> dict:
        body = self._head("chat.completion.chunk" if self.chat else "text_completion")
        body["choices"] = []
        body["usage"] = usage(prompt_tokens, completion_tokens)
        return body
