"""Prompts as the engine will see them: chat messages rendered through the tokenizer's own chat
template (from the engine directory), and token counts made the way `preprocessing` makes them,
so ``usage.prompt_tokens`` is exactly the number of ids the engine receives."""
from __future__ import annotations

import json
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from openai_frontend.errors import bad_request
from openai_frontend.tools import for_template, history_as_text, with_tools_system_prompt
from serving.tokenization import load_tokenizer


@dataclass(frozen=True)
class EngineLimits:
    """Token limits of the served engine (``build`` of its config.json); None when unknown."""

    max_input_len: int | None = None  # prompt tokens
    max_seq_len: int | None = None  # prompt + generated tokens

    @classmethod
    def from_engine_dir(cls, engine_dir: str) -> "EngineLimits":
        path = Path(engine_dir) / "config.json"
        try:
            build = json.loads(path.read_text()).get("build", {})
        except (OSError, ValueError):
            return cls()
        return cls(max_input_len=build.get("max_input_len"), max_seq_len=build.get("max_seq_len"))


# Without an engine config to bound it, a request that names no max_tokens gets OpenAI's
# completions default.
FALLBACK_MAX_TOKENS = 16


class PromptBuilder:
    """Renders and counts prompts with the engine's tokenizer; checks them against its limits."""

    def __init__(self, tokenizer_dir: str, add_special_tokens: bool = True):
        self.tokenizer = load_tokenizer(tokenizer_dir)
        self.add_special_tokens = add_special_tokens  # preprocessing's parameter of the same name
        self.limits = EngineLimits.from_engine_dir(tokenizer_dir)

    def render_chat(self, messages: list[dict], tools: list[dict] | None = None, tool_format=None,
                    image_placeholder: str | None = None, video_placeholder: str | None = None,
                    template_kwargs: dict | None = None) -> str:
        """The prompt text to send. A template that writes the BOS token itself (Llama 3's
        ``<|begin_of_text|>``) would get a second one from preprocessing's add_special_tokens, so
        that leading BOS is left to preprocessing: the engine sees exactly one.

        ``tools`` (OpenAI function tools) go to the template; ``tool_format`` is the tool-call
        parser (openai_frontend/tool_parsers/) whose format the model is told, for a template
        that knows nothing of tools: then the tools are described in the system message and past
        calls and their results are written as text (tools.py).

        ``image_placeholder`` (a vision-language model's, e.g. ``<image>``): messages may hold
        image parts (protocol.py), given to the template as it reads them (image_parts_for); video
        parts likewise with ``video_placeholder`` (LLaVA-OneVision's ``<video>``).

        ``template_kwargs``: the request's chat_template_kwargs, variables the template reads (Qwen3's
        ``enable_thinking``)."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("messages", "this model's tokenizer has no chat template; "
                                          "use /v1/completions with a prompt instead")
        if tool_format is not None:  # past calls as the format's templates read them (harmony's: one a message)
            messages = tool_format.history(messages)
        has_calls = any(m.get("tool_calls") or m["role"] == "tool" for m in messages)
        if has_calls and not self.template_renders_calls and tool_format is not None:
            messages = history_as_text(messages, tool_format.format_call)
        else:
            messages = [for_template(m) for m in messages]
        if tools and not self.template_renders_tools and tool_format is not None:
            # The template ignores tools (SmolLM2's ChatML does): describe them in the system
            # message, Hermes-style, with the parser's call format, so the model sees them.
            messages = with_tools_system_prompt(messages, tools, tool_format.instructions)
            tools = None
        if image_placeholder is not None:
            messages = [self.image_parts_for(m, image_placeholder, video_placeholder) for m in messages]
        try:
            text = self.tokenizer.apply_chat_template(messages, tools=tools or None, tokenize=False,
                                                      add_generation_prompt=True, **(template_kwargs or {}))
        except Exception as error:  # the template's own checks (roles in order, ids, ...)
            raise bad_request("messages", f"the model's chat template refused these messages: {error}") from None
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos) and self._encoding_adds_bos():
            text = text[len(bos):]
        return text

    def image_parts_for(self, message: dict, placeholder: str, video_placeholder: str | None = None) -> dict:
        """A message as a vision-language model's template reads it. Templates that iterate over
        content parts (LLaVA's and Qwen2-VL's on the Hub) get parts, an image as ``{"type":
        "image"}`` (the template writes its own image tokens), and plain-string content as one text
        part when they render no strings; other templates get a string with ``placeholder`` and a
        newline where each image was (LLaVA's prompt layout). Videos alike: ``{"type": "video"}``
        (OneVision's templates write ``<video>``), or ``video_placeholder`` and a newline."""
        content = message.get("content")
        if isinstance(content, list):
            marks = {"image": placeholder + "\n", "video": (video_placeholder or "<video>") + "\n"}
            if self.template_renders_parts:
                return {**message, "content": [{"type": part["type"]} if part["type"] in marks else part
                                               for part in content]}
            return {**message, "content": "".join(marks.get(part["type"]) or part["text"] for part in content)}
        if isinstance(content, str) and self.template_renders_parts and not self.template_renders_strings:
            return {**message, "content": [{"type": "text", "text": content}]}
        return message

    @cached_property
    def template_renders_parts(self) -> bool:
        """Whether the chat template writes content given as a list of {"type": "text"} parts (the
        part's text, not the list's repr, which a template that prints content as is would write)."""
        text = self._try_render([{"role": "user", "content": [{"type": "text", "text": "probe_part_zq"}]}])
        return "probe_part_zq" in text and "'type'" not in text and '"type"' not in text

    @cached_property
    def template_renders_strings(self) -> bool:
        """Whether the chat template writes content given as a plain string."""
        return "probe_text_zq" in self._try_render([{"role": "user", "content": "probe_text_zq"}])

    @cached_property
    def template_renders_tools(self) -> bool:
        """Whether the chat template writes the ``tools`` it is given (SmolLM2's does not)."""
        probe = [{"role": "user", "content": "hi"}]
        tool = {"type": "function", "function": {"name": "probe_tool_zq", "description": "probe_tool_zq",
                                                 "parameters": {"type": "object", "properties": {}}}}
        return "probe_tool_zq" in self._try_render(probe, tools=[tool])

    @cached_property
    def template_renders_calls(self) -> bool:
        """Whether the chat template writes an assistant's ``tool_calls`` and the ``tool`` results."""
        probe = [{"role": "user", "content": "hi"},
                 {"role": "assistant", "content": "", "tool_calls": [
                     {"id": "probe0001", "type": "function",
                      "function": {"name": "probe_call_zq", "arguments": {"x": 1}}}]},
                 {"role": "tool", "tool_call_id": "probe0001", "content": "probe_result_zq"}]
        text = self._try_render(probe)
        return "probe_call_zq" in text and "probe_result_zq" in text

    def _try_render(self, messages: list[dict], **kwargs) -> str:
        try:
            return self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True, **kwargs)
        except Exception:
            return ""

    @property
    def template_text(self) -> str:
        template = getattr(self.tokenizer, "chat_template", None) or ""
        return template if isinstance(template, str) else json.dumps(template)

    def _encoding_adds_bos(self) -> bool:
        ids = self.tokenizer.encode("", add_special_tokens=self.add_special_tokens)
        return bool(ids) and ids[0] == self.tokenizer.bos_token_id

    def encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=self.add_special_tokens)

    def max_tokens_for(self, prompt_tokens: int, requested: int | None, prompt_field: str,
                       max_tokens_field: str) -> int:
        """The number of tokens to ask for: ``requested``, or all the engine has room for.
        Raises a 400 naming the field when the prompt or the request does not fit the engine."""
        limits = self.limits
        if limits.max_input_len is not None and prompt_tokens > limits.max_input_len:
            raise bad_request(prompt_field, f"the prompt is {prompt_tokens} tokens long; this model takes at "
                                            f"most {limits.max_input_len} prompt tokens",
                              code="context_length_exceeded")
        if limits.max_seq_len is None:
            return requested or FALLBACK_MAX_TOKENS
        room = limits.max_seq_len - prompt_tokens
        if requested is None:
            if room < 1:
                raise bad_request(prompt_field, f"the prompt ({prompt_tokens} tokens) leaves no room to generate "
                                                f"within the model's {limits.max_seq_len} tokens",
                                  code="context_length_exceeded")
            return room
        if requested > room:
            raise bad_request(max_tokens_field, f"{max_tokens_field} is {requested}, but the prompt has "
                                                f"{prompt_tokens} tokens and this model's context is "
                                                f"{limits.max_seq_len} tokens: at most {max(room, 0)} allowed",
                              code="context_length_exceeded")
        return requested
