"""Prompts as the engine will see them: chat messages rendered through the tokenizer's own chat
template (from the engine directory), and token counts made the way `preprocessing` makes them,
so ``usage.prompt_tokens`` is exactly the number of ids the engine receives."""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from openai_frontend.errors import bad_request
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

    def render_chat(self, messages: list[dict[str, str]]) -> str:
        """The prompt text to send. A template that writes the BOS token itself (Llama 3's
        ``<|begin_of_text|>``) would get a second one from preprocessing's add_special_tokens, so
        that leading BOS is left to preprocessing: the engine sees exactly one."""
        if not getattr(self.tokenizer, "chat_template", None):
            raise bad_request("messages", "this model's tokenizer has no chat template; "
                                          "use /v1/completions with a prompt instead")
        text = self.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        bos = self.tokenizer.bos_token
        if bos and text.startswith(bos) and self._encoding_adds_bos():
            text = text[len(bos):]
        return text

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
