"""Request bodies of /v1/chat/completions and /v1/completions -> validated, typed requests.

Validation happens here, before anything reaches Triton, so a bad field gets a 400 whose
message names the field, says what was wrong and what is allowed (``errors.bad_request``).
Sampling fields follow OpenAI's definitions, plus vLLM's extras (``top_k``, ``min_tokens``,
``repetition_penalty``, and the ``guided_*`` fields of structured output) that clients send
through ``extra_body``. Structured output is read by guides.py, tools by tools.py.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from openai_frontend.errors import bad_request
from openai_frontend.guides import GUIDE_FIELDS, Guide, one_guide, parse_guide
from openai_frontend.tools import ToolRequest, parse_tools, tool_calls_of

MAX_N = 16  # choices per request: each is a request of its own to the engine
MAX_SEED = 2**63 - 1  # the engine keeps seeds as int64

# Fields clients send that change nothing here (OpenAI bookkeeping), accepted and dropped. (Chat's
# reasoning_effort goes to the chat template: gpt-oss's writes it into the system message.)
IGNORED_FIELDS = {"user", "store", "metadata", "service_tier", "prompt_cache_key",
                  "safety_identifier", "reasoning_effort", "verbosity"}
SAMPLING_FIELDS = {"max_tokens", "temperature", "top_p", "top_k", "min_tokens", "presence_penalty",
                   "frequency_penalty", "repetition_penalty", "seed", "stop", "n", "stream",
                   "stream_options", "logprobs"}
MAX_CHAT_TOP_LOGPROBS = 20  # OpenAI's limits (the engine's too: num_top_log_probs 0..20)
MAX_COMPLETION_LOGPROBS = 5
CHAT_FIELDS = SAMPLING_FIELDS | set(GUIDE_FIELDS) | {"model", "messages", "max_completion_tokens", "top_logprobs",
                                                     "tools", "tool_choice", "parallel_tool_calls",
                                                     "chat_template_kwargs", "mm_processor_kwargs"}
# mm_processor_kwargs (vLLM's field: the processor's arguments) this server reads: a video's frame choice
MEDIA_KWARGS = ("fps", "num_frames")
# apply_chat_template's own arguments: chat_template_kwargs may not set these (the frontend does)
RESERVED_TEMPLATE_KWARGS = {"conversation", "messages", "tools", "documents", "chat_template", "add_generation_prompt",
                            "continue_final_message", "tokenize", "padding", "truncation", "max_length",
                            "return_tensors", "return_dict", "return_assistant_tokens_mask", "tokenizer_kwargs"}
COMPLETION_FIELDS = SAMPLING_FIELDS | set(GUIDE_FIELDS) | {"model", "prompt", "echo", "best_of", "suffix"}
# Features this server does not have: refused unless the value is the one that means "off".
UNSUPPORTED_UNLESS = {
    "functions": lambda v: not v, "function_call": lambda v: v in (None, "none"),  # (superseded by tools)
    "logit_bias": lambda v: not v, "audio": lambda v: v is None, "prediction": lambda v: v is None,
    "modalities": lambda v: v is None or v == ["text"], "web_search_options": lambda v: v is None,
    "echo": lambda v: not v, "best_of": lambda v: v in (None, 1), "suffix": lambda v: not v,
}
CHAT_ROLES = ("system", "developer", "user", "assistant", "tool")


@dataclass
class SamplingParams:
    """What one choice is generated with; None means the engine's default."""

    max_tokens: int | None  # None: up to the engine's max_seq_len
    temperature: float = 1.0  # OpenAI's default: sample from the whole distribution
    top_p: float = 1.0
    top_k: int | None = None  # 0: no limit (vLLM's -1 is mapped to 0)
    min_tokens: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    n: int = 1
    # None: no log-probs; k >= 0: each generated token's log-prob and its k most likely alternatives
    logprobs: int | None = None
    guide: Guide | None = None  # structured output (guides.py): what the output must match


@dataclass
class GenerationRequest:
    """A validated chat or completion request. ``prompts`` holds text; for chat it is filled by
    rendering ``messages`` through the chat template (later, in the app)."""

    model: str
    params: SamplingParams
    stream: bool = False
    include_usage: bool = False
    max_tokens_field: str = "max_tokens"  # the field max_tokens came from (errors name it)
    # chat: [{"role", "content"}], content as text (null for an assistant's calls), plus "tool_calls"
    # (assistant) or "tool_call_id" (tool)
    messages: list[dict] | None = None
    prompts: list[str] = field(default_factory=list)  # completions: one choice group per prompt
    tools: ToolRequest | None = None  # chat: function tools (tools.py)
    # chat: variables the chat template reads (vLLM's chat_template_kwargs: Qwen3's enable_thinking)
    template_kwargs: dict = field(default_factory=dict)
    # chat: mm_processor_kwargs' fps / num_frames (a video's frames: serving/videos.py FrameRequest; checked
    # against the server's max_num_frames where the video is read)
    media_kwargs: dict = field(default_factory=dict)


def parse_chat_request(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, CHAT_FIELDS)
    max_tokens = _first_present(body, "max_completion_tokens", "max_tokens")
    request = _common(body, max_tokens)
    request.params.logprobs = _chat_logprobs(body)
    request.messages = _messages(body.get("messages"))
    request.tools = parse_tools(body)
    request.template_kwargs = _template_kwargs(body.get("chat_template_kwargs"))
    request.media_kwargs = _media_kwargs(body.get("mm_processor_kwargs"))
    effort = body.get("reasoning_effort")
    if effort is not None:  # (as vLLM gives it to gpt-oss's template; other templates do not read it)
        if not isinstance(effort, str):
            raise bad_request("reasoning_effort", f"reasoning_effort must be a string (low, medium, high), got "
                                                  f"{effort!r}")
        request.template_kwargs.setdefault("reasoning_effort", effort)
    if request.tools is not None and request.tools.enforced:
        choice = request.tools.function or request.tools.choice
        request.params.guide = one_guide(request.params.guide, request.tools.guide(),
                                         f"tool_choice {choice!r} (which enforces the call)")
    return request


def parse_completion_request(body: Any) -> GenerationRequest:
    body = _object(body)
    _check_fields(body, COMPLETION_FIELDS)
    request = _common(body, "max_tokens")
    request.params.logprobs = _integer(body, "logprobs", low=0, high=MAX_COMPLETION_LOGPROBS)
    request.prompts = _prompts(body.get("prompt"))
    return request


def _template_kwargs(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("chat_template_kwargs", f"chat_template_kwargs must be an object of the variables the chat "
                                                  f"template reads (e.g. {{\"enable_thinking\": false}}), got {value!r}")
    reserved = sorted(set(value) & RESERVED_TEMPLATE_KWARGS)
    if reserved:
        raise bad_request(f"chat_template_kwargs.{reserved[0]}", f"chat_template_kwargs.{reserved[0]} is set by the "
                                                                 "server; leave it out")
    return dict(value)


def _media_kwargs(value: Any) -> dict:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("mm_processor_kwargs", "mm_processor_kwargs must be an object, e.g. {\"fps\": 2} or "
                                                 f"{{\"num_frames\": 16}} (a video's frames), got {value!r}")
    unknown = sorted(set(value) - set(MEDIA_KWARGS))
    if unknown:
        raise bad_request(f"mm_processor_kwargs.{unknown[0]}", f"mm_processor_kwargs.{unknown[0]} is not supported; "
                                                               f"supported: {', '.join(MEDIA_KWARGS)} (a video's "
                                                               "frames)", code="unsupported_parameter")
    return dict(value)


def _chat_logprobs(body: dict) -> int | None:
    """Chat: ``logprobs`` true turns log-probs on, ``top_logprobs`` (only with it) adds alternatives."""
    logprobs = body.get("logprobs")
    if logprobs is not None and not isinstance(logprobs, bool):
        raise bad_request("logprobs", f"logprobs must be true or false, got {logprobs!r}")
    top = _integer(body, "top_logprobs", low=0, high=MAX_CHAT_TOP_LOGPROBS)
    if top is not None and not logprobs:
        raise bad_request("top_logprobs", "top_logprobs needs logprobs: true; send logprobs: true with it "
                                          "or leave top_logprobs out")
    return (top or 0) if logprobs else None


# ----------------------------------------------------------------------------- shared fields

def _object(body: Any) -> dict:
    if not isinstance(body, dict):
        raise bad_request(None, "the request body must be a JSON object", code="invalid_json")
    return body


def _check_fields(body: dict, known: set[str]) -> None:
    for name, value in body.items():
        if name in UNSUPPORTED_UNLESS and not UNSUPPORTED_UNLESS[name](value):
            raise bad_request(name, f"{name} is not supported by this server; leave {name} out",
                              code="unsupported_parameter")
        if name not in known and name not in IGNORED_FIELDS and name not in UNSUPPORTED_UNLESS:
            raise bad_request(name, f"Unrecognized request argument supplied: {name}",
                              code="unrecognized_parameter")


def _first_present(body: dict, *names: str) -> str:
    return next((name for name in names if body.get(name) is not None), names[-1])


def _common(body: dict, max_tokens_field: str) -> GenerationRequest:
    model = body.get("model")
    if not isinstance(model, str) or not model:
        raise bad_request("model", "model is required: a string naming the model (GET /v1/models)")
    params = SamplingParams(
        max_tokens=_integer(body, max_tokens_field, low=1),
        temperature=_number(body, "temperature", 0.0, 2.0, default=1.0),
        top_p=_number(body, "top_p", 0.0, 1.0, default=1.0, low_open=True),
        top_k=_top_k(body),
        min_tokens=_integer(body, "min_tokens", low=0),
        presence_penalty=_number(body, "presence_penalty", -2.0, 2.0),
        frequency_penalty=_number(body, "frequency_penalty", -2.0, 2.0),
        repetition_penalty=_number(body, "repetition_penalty", 0.0, math.inf, low_open=True),
        seed=_integer(body, "seed", low=0, high=MAX_SEED),
        stop=_stop(body.get("stop")),
        n=_integer(body, "n", low=1, high=MAX_N) or 1,
        guide=parse_guide(body),
    )
    if params.min_tokens and params.max_tokens is not None and params.min_tokens > params.max_tokens:
        raise bad_request("min_tokens", f"min_tokens ({params.min_tokens}) must be <= {max_tokens_field} "
                                        f"({params.max_tokens})")
    stream = body.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise bad_request("stream", f"stream must be true or false, got {stream!r}")
    return GenerationRequest(model=model, params=params, stream=bool(stream), max_tokens_field=max_tokens_field,
                             include_usage=_include_usage(body.get("stream_options"), bool(stream)))


def _number(body: dict, name: str, low: float, high: float, default: float | None = None,
            low_open: bool = False) -> float | None:
    value = body.get(name)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise bad_request(name, f"{name} must be a number, got {value!r}")
    too_low = value <= low if low_open else value < low
    if too_low or value > high:
        left = "(" if low_open else "["
        right = "]" if math.isfinite(high) else ")"
        raise bad_request(name, f"{name} must be in {left}{low:g}, {high:g}{right}, got {value!r}")
    return float(value)


def _integer(body: dict, name: str, low: int, high: int | None = None) -> int | None:
    value = body.get(name)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(name, f"{name} must be an integer, got {value!r}")
    if value < low or (high is not None and value > high):
        allowed = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise bad_request(name, f"{name} must be {allowed}, got {value}")
    return value


def _top_k(body: dict) -> int | None:
    top_k = _integer(body, "top_k", low=-1)
    return 0 if top_k == -1 else top_k  # vLLM's -1 and the engine's 0 both mean "no limit"


def _stop(stop: Any) -> list[str]:
    if stop is None:
        return []
    words = [stop] if isinstance(stop, str) else stop
    if not isinstance(words, list) or not all(isinstance(w, str) and w for w in words):
        raise bad_request("stop", f"stop must be a non-empty string or a list of non-empty strings, got {stop!r}")
    return list(words)


def _include_usage(options: Any, stream: bool) -> bool:
    if options is None:
        return False
    if not stream:
        raise bad_request("stream_options", "stream_options is only allowed with stream: true")
    if not isinstance(options, dict) or set(options) - {"include_usage"}:
        raise bad_request("stream_options", f"stream_options must be an object with include_usage, got {options!r}")
    include = options.get("include_usage", False)
    if not isinstance(include, bool):
        raise bad_request("stream_options.include_usage", f"include_usage must be true or false, got {include!r}")
    return include


# ----------------------------------------------------------------------------- chat and prompts

def _messages(messages: Any) -> list[dict]:
    if not isinstance(messages, list) or not messages:
        raise bad_request("messages", "messages must be a non-empty list of {role, content} objects")
    return [_message(message, f"messages[{i}]") for i, message in enumerate(messages)]


# Fields an assistant message sent back as the API returned it may carry; accepted when empty.
EMPTY_MESSAGE_FIELDS = {"refusal", "audio", "function_call", "annotations"}


def _message(message: Any, where: str) -> dict:
    if not isinstance(message, dict):
        raise bad_request(where, f"{where} must be an object with role and content")
    role = message.get("role")
    if role not in CHAT_ROLES:
        raise bad_request(f"{where}.role", f"{where}.role must be one of {', '.join(CHAT_ROLES)}, got {role!r}")
    allowed = {"role", "content", "name"} | {"assistant": {"tool_calls", "reasoning_content"},
                                             "tool": {"tool_call_id"}}.get(role, set())
    extra = {key for key in set(message) - allowed if not (key in EMPTY_MESSAGE_FIELDS and not message[key])}
    if extra:
        name = sorted(extra)[0]
        raise bad_request(f"{where}.{name}", f"{where}.{name} is not supported; messages carry role, content, name "
                                             "(assistant: tool_calls, reasoning_content; tool: tool_call_id)")
    # The template of a model without a developer role takes the instructions as a system message.
    out = {"role": "system" if role == "developer" else role}
    if role == "assistant" and message.get("reasoning_content") is not None:  # a reply sent back as it came
        reasoning = message["reasoning_content"]
        if not isinstance(reasoning, str):
            raise bad_request(f"{where}.reasoning_content", f"{where}.reasoning_content must be a string, got "
                                                            f"{reasoning!r}")
        out["reasoning_content"] = reasoning  # (Qwen3's template reads it; others leave it out)
    if role == "assistant" and message.get("tool_calls") is not None:
        out["tool_calls"] = tool_calls_of(message["tool_calls"], f"{where}.tool_calls")
        content = message.get("content")
        out["content"] = None if content is None else _content(content, f"{where}.content")
        return out
    if role == "tool":
        call_id = message.get("tool_call_id")
        if not isinstance(call_id, str) or not call_id:
            raise bad_request(f"{where}.tool_call_id", f"{where}.tool_call_id must name the call this message "
                                                       f"answers (its id); got {call_id!r}")
        out["tool_call_id"] = call_id
    out["content"] = _content(message.get("content"), f"{where}.content", images=role == "user")
    return out


def _content(content: Any, where: str, images: bool = False) -> str | list[dict]:
    """Text parts joined into one string; with an image or video part (user messages only) the parts
    in order instead: {"type": "text", "text"}, {"type": "image", "url", "field"} and {"type":
    "video", "url", "field"} (``field`` names the part's url for errors; chat_template.py renders
    them, vision.py fetches and encodes them)."""
    if isinstance(content, str):
        return content
    allowed = "text, image_url and video_url parts" if images else "text parts"
    if not isinstance(content, list):
        raise bad_request(where, f"{where} must be a string or a list of {allowed}, got {content!r}")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind == "image_url" and images:
            parts.append(_image_part(part, f"{where}[{j}]"))
        elif kind == "video_url" and images:
            parts.append(_video_part(part, f"{where}[{j}]"))
        elif kind == "text" and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        else:
            shapes = '{"type": "text", "text": "..."}' + (
                ', {"type": "image_url", "image_url": {"url": "..."}} or {"type": "video_url", "video_url": '
                '{"url": "..."}}' if images else "")
            only = ("text, image_url and video_url (user messages)" if images or kind in ("image_url", "video_url")
                    else "text")
            raise bad_request(f"{where}[{j}]", f"{where}[{j}] must be a part {shapes}; got type {kind!r} "
                                               f"(supported: {only})")
    if not any(part["type"] in MEDIA_PARTS for part in parts):
        return "".join(part["text"] for part in parts)
    return parts


MEDIA_PARTS = ("image", "video")


IMAGE_DETAILS = ("auto", "low", "high")  # OpenAI's; the image is encoded the model's one way whatever it says


def _image_part(part: dict, where: str) -> dict:
    """``{"type": "image_url", "image_url": {"url": ..., "detail": ...}}`` (or the url as a string,
    as vLLM accepts) -> {"type": "image", "url", "field"}."""
    image_url = part.get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.image_url", f"{where}.image_url must be an object with url: a data: URL "
                                                "(data:image/png;base64,...) or an http(s) URL")
    detail = image_url.get("detail") if isinstance(image_url, dict) else None
    if detail is not None and detail not in IMAGE_DETAILS:
        raise bad_request(f"{where}.image_url.detail", f"{where}.image_url.detail must be one of "
                                                       f"{', '.join(IMAGE_DETAILS)}, got {detail!r}")
    return {"type": "image", "url": url, "field": f"{where}.image_url.url"}


def _video_part(part: dict, where: str) -> dict:
    """``{"type": "video_url", "video_url": {"url": ...}}`` (or the url as a string), as vLLM accepts
    video -> {"type": "video", "url", "field"}."""
    video_url = part.get("video_url")
    url = video_url.get("url") if isinstance(video_url, dict) else video_url
    if not isinstance(url, str) or not url:
        raise bad_request(f"{where}.video_url", f"{where}.video_url must be an object with url: a data: URL "
                                                "(data:video/mp4;base64,...), a file: or an http(s) URL")
    return {"type": "video", "url": url, "field": f"{where}.video_url.url"}


def image_parts(messages: list[dict] | None) -> list[dict]:
    """The image and video parts of chat messages, in prompt order."""
    return [part for message in messages or [] if isinstance(message.get("content"), list)
            for part in message["content"] if part["type"] in MEDIA_PARTS]


def _prompts(prompt: Any) -> list[str]:
    prompts = [prompt] if isinstance(prompt, str) else prompt
    if not isinstance(prompts, list) or not prompts or not all(isinstance(p, str) for p in prompts):
        raise bad_request("prompt", "prompt must be a string or a non-empty list of strings "
                                    "(token-id prompts are not supported)")
    if any(not p for p in prompts):
        raise bad_request("prompt", "prompt must not be empty")
    return prompts
