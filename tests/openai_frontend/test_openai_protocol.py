"""Request validation of the OpenAI frontend: what is accepted, and 400s that name the field."""
import pytest

from openai_frontend.errors import APIError
from openai_frontend.generation import choice_specs
from openai_frontend.protocol import image_parts, parse_chat_request, parse_completion_request

CHAT = {"model": "m", "messages": [{"role": "user", "content": "Hi"}]}


def rejected(parse, body) -> APIError:
    with pytest.raises(APIError) as raised:
        parse(body)
    assert raised.value.status == 400 and raised.value.error_type == "invalid_request_error"
    return raised.value


def test_defaults_sample_like_openai():
    request = parse_chat_request(CHAT)
    params = request.params
    assert (params.temperature, params.top_p, params.n, params.stop, params.max_tokens) == (1.0, 1.0, 1, [], None)
    assert not request.stream and not request.include_usage


def test_every_listed_field_is_read():
    body = {**CHAT, "max_completion_tokens": 7, "max_tokens": 99, "temperature": 0.5, "top_p": 0.9, "top_k": -1,
            "min_tokens": 2, "presence_penalty": 0.1, "frequency_penalty": -0.2, "repetition_penalty": 1.1,
            "seed": 3, "stop": "x", "n": 2, "stream": True, "stream_options": {"include_usage": True},
            "user": "ignored", "logprobs": False}
    request = parse_chat_request(body)
    p = request.params
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.min_tokens) == (7, 0.5, 0.9, 0, 2)
    assert (p.presence_penalty, p.frequency_penalty, p.repetition_penalty, p.seed, p.stop, p.n) == \
        (0.1, -0.2, 1.1, 3, ["x"], 2)
    assert request.stream and request.include_usage and request.max_tokens_field == "max_completion_tokens"


def test_messages_with_text_parts_and_developer_role():
    request = parse_chat_request({**CHAT, "messages": [
        {"role": "developer", "content": "Be brief."},
        {"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}], "name": "u"}]})
    assert request.messages == [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "ab"}]


@pytest.mark.parametrize("field,value,words", [
    ("temperature", 2.5, "[0, 2]"), ("top_p", 0, "(0, 1]"), ("n", 17, "[1, 16]"), ("max_tokens", 0, ">= 1"),
    ("seed", -1, "[0, 9223372036854775807]"), ("top_k", 1.5, "integer"), ("stop", 5, "string"), ("stream", "yes", "true or false"),
    ("repetition_penalty", 0, "(0, inf)"), ("presence_penalty", float("nan"), "number"),
    ("tools", {"type": "function"}, "list of function tools"), ("response_format", {"type": "json"}, "json_object"),
    ("functions", [{"name": "f"}], "not supported"), ("logit_bias", {"1": 5}, "not supported"),
    ("logprobs", 1, "true or false"), ("top_logprobs", 2, "logprobs: true"), ("frobnicate", 1, "Unrecognized"),
    ("chat_template_kwargs", ["enable_thinking"], "an object"), ("mm_processor_kwargs", 2, "an object"),
])
def test_bad_fields_are_named(field, value, words):
    error = rejected(parse_chat_request, {**CHAT, field: value})
    assert error.param == field and field in error.message and words in error.message


@pytest.mark.parametrize("messages,param", [
    ([], "messages"), ("hi", "messages"), ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "tool", "content": "x"}], "messages[0].tool_call_id"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}], "messages[0].content[0].image_url"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "data:,", "detail": "max"}}]}],
     "messages[0].content[0].image_url.detail"),
    ([{"role": "system", "content": [{"type": "image_url", "image_url": {"url": "data:,"}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}], "messages[0].content[0]"),
    ([{"role": "user", "content": "x", "tool_calls": []}], "messages[0].tool_calls"),
    ([{"role": "assistant", "content": "x", "reasoning_content": 1}], "messages[0].reasoning_content"),
])
def test_bad_messages_are_named(messages, param):
    assert rejected(parse_chat_request, {**CHAT, "messages": messages}).param == param


def test_image_parts_are_kept_in_order_with_the_field_that_names_them():
    request = parse_chat_request({**CHAT, "messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image_url", "image_url": {"url": "data:x", "detail": "low"}},
        {"type": "image_url", "image_url": "https://h/i.png"}]}]})
    assert request.messages[0]["content"] == [
        {"type": "text", "text": "a"},
        {"type": "image", "url": "data:x", "field": "messages[0].content[1].image_url.url"},
        {"type": "image", "url": "https://h/i.png", "field": "messages[0].content[2].image_url.url"}]
    assert [part["url"] for part in image_parts(request.messages)] == ["data:x", "https://h/i.png"]


def test_mm_processor_kwargs_take_a_videos_frame_choice_and_name_other_keys():
    """vLLM's mm_processor_kwargs: fps / num_frames kept for the video's reader (checked there against the
    server's max_num_frames: tests/serving/test_video_frame_choice.py); any other key is named."""
    assert parse_chat_request({**CHAT, "mm_processor_kwargs": {"fps": 2}}).media_kwargs == {"fps": 2}
    error = rejected(parse_chat_request, {**CHAT, "mm_processor_kwargs": {"num_frames": 4, "max_pixels": 9}})
    assert error.param == "mm_processor_kwargs.max_pixels" and "supported: fps, num_frames" in error.message


def test_stream_options_need_stream_and_min_tokens_fit():
    assert rejected(parse_chat_request, {**CHAT, "stream_options": {"include_usage": True}}).param == "stream_options"
    assert rejected(parse_chat_request, {**CHAT, "max_tokens": 2, "min_tokens": 3}).param == "min_tokens"


def test_completion_prompts():
    assert parse_completion_request({"model": "m", "prompt": "a"}).prompts == ["a"]
    assert parse_completion_request({"model": "m", "prompt": ["a", "b"]}).prompts == ["a", "b"]
    assert rejected(parse_completion_request, {"model": "m", "prompt": [[1, 2]]}).param == "prompt"
    assert rejected(parse_completion_request, {"model": "m", "prompt": "a", "echo": True}).param == "echo"
    assert rejected(parse_completion_request, {"model": "m", "prompt": "a", "logprobs": 6}).param == "logprobs"
    assert rejected(parse_completion_request, {"prompt": "a"}).param == "model"


def test_choices_are_prompt_major_with_distinct_seeds():
    params = parse_completion_request({"model": "m", "prompt": ["a", "b"], "n": 2, "seed": 10}).params
    specs = choice_specs([("a", [1], 5), ("b", [2, 3], 6)], params)
    assert [(s.index, s.prompt, s.seed, s.max_tokens) for s in specs] == \
        [(0, "a", 10, 5), (1, "a", 11, 5), (2, "b", 10, 6), (3, "b", 11, 6)]
    unseeded = parse_completion_request({"model": "m", "prompt": "a", "n": 2}).params
    assert [s.seed for s in choice_specs([("a", [1], 5)], unseeded)] == [None, None]


def test_logprobs_fields_as_openai_defines_them():
    """None: off; otherwise the number of alternatives per token (chat: top_logprobs, 0..20, only
    with logprobs true; completions: logprobs itself, 0..5)."""
    chat = lambda **fields: parse_chat_request({**CHAT, **fields}).params.logprobs  # noqa: E731
    assert (chat(), chat(logprobs=False), chat(logprobs=True), chat(logprobs=True, top_logprobs=20)) == \
        (None, None, 0, 20)
    assert rejected(parse_chat_request, {**CHAT, "logprobs": True, "top_logprobs": 21}).message == \
        "top_logprobs must be in [0, 20], got 21"
    assert rejected(parse_chat_request, {**CHAT, "logprobs": False, "top_logprobs": 0}).param == "top_logprobs"
    completion = lambda **fields: parse_completion_request(  # noqa: E731
        {"model": "m", "prompt": "a", **fields}).params.logprobs
    assert (completion(), completion(logprobs=None), completion(logprobs=0), completion(logprobs=5)) == \
        (None, None, 0, 5)
    assert rejected(parse_completion_request, {"model": "m", "prompt": "a", "logprobs": True}).message == \
        "logprobs must be an integer, got True"
