"""Structured output and tool calls through the OpenAI-compatible frontend in front of the
session's tritonserver (SmolLM2, guides compiled by the engine with xgrammar), with the official
`openai` client: response_format (json_schema strict, json_object), vLLM's guided_regex and
guided_choice, tool_choice required and named (arguments valid against the function's schema;
streamed calls concatenate to the unary ones), sampling that still conforms, and bad guides or
tools that get a 400 naming the field while the server keeps serving. A reasoning block the guide makes
SmolLM2 write (``<think>...</think>``) comes back as ``reasoning_content`` apart from the content,
unary and streamed, through a frontend started with ``--reasoning_parser qwen3``.

Every schema is finite (short strings, enums, bounded integers), so no answer runs into
max_tokens. The OpenAI frontend is the session's (conftest.py), shared with test_openai_frontend.py.
"""
import json
import re
from concurrent.futures import ThreadPoolExecutor
from functools import partial

import jsonschema
import openai
import pytest
import requests

from triton_helpers import in_process_frontends, wait_for


pytestmark = pytest.mark.integration

MODEL = "smollm2"
CITY = {"type": "object",
        "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 12},
                       "country": {"enum": ["France", "Japan", "Brazil", "Kenya"]},
                       "population_millions": {"type": "integer", "minimum": 0, "maximum": 40}},
        "required": ["name", "country", "population_millions"], "additionalProperties": False}
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Get the current weather in a city",
    "parameters": {"type": "object",
                   "properties": {"city": {"type": "string", "minLength": 1, "maxLength": 12},
                                  "unit": {"enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "Get the local time in a time zone",
    "parameters": {"type": "object",
                   "properties": {"zone": {"enum": ["UTC", "CET", "JST"]}},
                   "required": ["zone"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
ASK_WEATHER = [{"role": "user", "content": "What is the weather like in Paris today?"}]
ASK_CITY = [{"role": "user", "content": "Give facts about Paris as JSON."}]
LIMIT = {"max_tokens": 96}
# What a Qwen3 thinking model writes, forced on SmolLM2: a short reasoning block, then a one-word answer.
THINKING = r"<think>[a-z]{1,12}( [a-z]{1,12}){0,5}</think>[A-Z][a-z]{1,12}\."
ASK_CAPITAL = [{"role": "user", "content": "What is the capital of France? Think first."}]


@pytest.fixture
def client(frontend):
    with openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=120) as client:
        yield client


def schema_of(tool):
    return tool["function"]["parameters"]


def check_calls(calls, tools_by_name):
    for call in calls:
        assert call.type == "function" and call.id.startswith("call_")
        jsonschema.validate(json.loads(call.function.arguments), schema_of(tools_by_name[call.function.name]))


# Greedy and sampled take different paths through the guide (argmax of the masked logits, a draw from
# them); a second seed (12 was one) took the sampled path again, for ~30 more guided steps.
CITY_SAMPLINGS = ({"temperature": 0}, {"temperature": 1.0, "seed": 11})
CHOICES = ["positive", "negative", "neutral"]
TOOL_REQUEST = dict(model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required", temperature=0, **LIMIT)


@pytest.fixture(scope="module")
def reasoning_frontend(triton_server, smollm2_engine_dir):
    """A frontend in this process with ``--reasoning_parser qwen3`` (SmolLM2's template teaches none), made
    from its command line's flags as `python -m openai_frontend` makes it; its base URL."""
    from openai_frontend.__main__ import config_from_arguments, parse_arguments

    flags = [f"--grpc_url={triton_server.grpc_url}", f"--tokenizer_dir={smollm2_engine_dir}",
             f"--served_model_name={MODEL}", "--reasoning_parser=qwen3"]
    with in_process_frontends({"reasoning": config_from_arguments(parse_arguments(flags))}) as urls:
        assert wait_for(lambda: requests.get(f"{urls['reasoning']}/health", timeout=2).status_code == 200, timeout=30)
        yield urls["reasoning"]


@pytest.fixture(scope="module")
def replies(frontend, reasoning_frontend):
    """Every request of the tests below but the bad inputs' (each waits on no other's), sent at once when
    the first test asks: {test: [Future of each request's answer]}. The engine batches 8 and keeps its
    slots full from the queue; the tool call's unary and streamed requests at once too (greedy: the
    same ids either way, as test_openai_frontend.py's streamed-against-unary tests send them). One test
    after another (each test's own requests at once, the tool call's two one after the other), the file's
    tests took 31.5 s of CI's make test (2026-11-30)."""
    with openai.OpenAI(base_url=f"{frontend}/v1", api_key="unused", max_retries=0, timeout=120) as client, \
            openai.OpenAI(base_url=f"{reasoning_frontend}/v1", api_key="unused", max_retries=0, timeout=120) as thinker:
        chat, completion = client.chat.completions.create, client.completions.create
        thinking = dict(model=MODEL, messages=ASK_CAPITAL, temperature=0, extra_body={"guided_regex": THINKING},
                        **LIMIT)
        json_schema = {"type": "json_schema", "json_schema": {"name": "city", "schema": CITY, "strict": True}}
        sends = {
            "json_schema": [partial(chat, model=MODEL, messages=ASK_CITY, response_format=json_schema, **sampling,
                                    **LIMIT) for sampling in CITY_SAMPLINGS],
            "json_object": [partial(
                chat, model=MODEL, response_format={"type": "json_object"}, temperature=0, max_tokens=160,
                messages=[{"role": "user", "content": 'Reply with a tiny JSON object like {"answer": "Paris"}: '
                                                      "what is the capital of France?"}])],
            "regex_and_choice": [
                partial(chat, model=MODEL, temperature=1.0, seed=3, **LIMIT,
                        messages=[{"role": "user", "content": "Give a phone number."}],
                        extra_body={"guided_regex": r"\d{3}-\d{4}"}),
                partial(chat, model=MODEL, temperature=0, extra_body={"guided_choice": CHOICES},
                        messages=[{"role": "user", "content": "I love this phone! Sentiment?"}]),
                partial(completion, model=MODEL, prompt="The best season is", extra_body={"guided_choice": CHOICES},
                        temperature=1.0, seed=5, max_tokens=8)],
            "tool_required": [partial(chat, **TOOL_REQUEST), lambda: list(chat(**TOOL_REQUEST, stream=True))],
            "named_and_single": [
                partial(chat, model=MODEL, messages=ASK_WEATHER, tools=TOOLS, temperature=1.0, seed=7,
                        tool_choice={"type": "function", "function": {"name": "get_time"}}, **LIMIT),
                partial(chat, model=MODEL, messages=ASK_WEATHER, tools=TOOLS, tool_choice="required",
                        parallel_tool_calls=False, temperature=1.0, seed=8, **LIMIT)],
            "reasoning": [partial(thinker.chat.completions.create, **thinking),
                          lambda: list(thinker.chat.completions.create(**thinking, stream=True,
                                                                       stream_options={"include_usage": True}))],
        }
        with ThreadPoolExecutor(max_workers=sum(map(len, sends.values()))) as pool:
            yield {test: [pool.submit(send) for send in test_sends] for test, test_sends in sends.items()}


def answers(replies, test):
    return [future.result() for future in replies[test]]


def test_json_schema_strict_validates_greedy_and_sampled(replies):
    for reply in answers(replies, "json_schema"):  # (greedy, sampled): each is checked on its own
        jsonschema.validate(json.loads(reply.choices[0].message.content), CITY)
        assert reply.choices[0].finish_reason == "stop"


def test_json_object_parses(replies):
    reply, = answers(replies, "json_object")
    assert isinstance(json.loads(reply.choices[0].message.content), dict)


def test_guided_regex_and_choice_conform(replies):
    regex, chat, text = answers(replies, "regex_and_choice")
    assert re.fullmatch(r"\d{3}-\d{4}", regex.choices[0].message.content)
    assert chat.choices[0].message.content in CHOICES
    assert text.choices[0].text in CHOICES


def test_tool_choice_required_calls_validate_and_stream_as_unary(replies):
    unary, chunks = answers(replies, "tool_required")
    choice = unary.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None and choice.message.tool_calls
    check_calls(choice.message.tool_calls, {t["function"]["name"]: t for t in TOOLS})

    calls: dict[int, dict] = {}
    finish = None
    for chunk in chunks:
        delta = chunk.choices[0].delta
        finish = chunk.choices[0].finish_reason or finish
        assert not delta.content
        for piece in delta.tool_calls or []:
            if piece.index not in calls:
                assert piece.id and piece.type == "function" and piece.function.arguments == ""
                calls[piece.index] = {"name": piece.function.name, "arguments": ""}
            else:
                calls[piece.index]["arguments"] += piece.function.arguments
    assert finish == "tool_calls"
    assert list(calls.values()) == [{"name": c.function.name, "arguments": c.function.arguments}
                                    for c in choice.message.tool_calls]


def test_named_function_and_single_call_at_temperature_one(replies):
    named, single = answers(replies, "named_and_single")
    calls = named.choices[0].message.tool_calls
    assert [c.function.name for c in calls] == ["get_time"] and named.choices[0].finish_reason == "tool_calls"
    check_calls(calls, {"get_time": TIME})
    assert len(single.choices[0].message.tool_calls) == 1
    check_calls(single.choices[0].message.tool_calls, {t["function"]["name"]: t for t in TOOLS})


@pytest.mark.parametrize("kwargs,param,words", [
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}},
     "response_format", "nope"),
    ({"extra_body": {"guided_regex": "[0-9"}}, "guided_regex", "regex"),
    ({"extra_body": {"guided_grammar": "root ::= [0-9"}}, "guided_grammar", "ebnf"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_stock_price"}}}, "tool_choice",
     "get_stock_price"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
     "tools[0].function.parameters", "object"),
    ({"tool_choice": "required"}, "tool_choice", "tools"),
    ({"response_format": {"type": "json_object"}, "extra_body": {"guided_regex": "a"}}, "guided_regex",
     "response_format, guided_regex"),
])
def test_bad_input_gets_a_400_naming_it_and_the_server_keeps_serving(client, kwargs, param, words):
    with pytest.raises(openai.BadRequestError) as raised:
        client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=8, **kwargs)
    error = raised.value
    assert error.status_code == 400 and error.body["param"] == param and error.body["type"] == "invalid_request_error"
    assert words.lower() in error.message.lower(), error.message
    ok = client.chat.completions.create(model=MODEL, messages=ASK_WEATHER, max_tokens=2, temperature=0)
    assert ok.choices[0].finish_reason == "length"


def test_reasoning_block_is_reasoning_content_unary_and_streamed(replies):
    """SmolLM2, guided to write a reasoning block, read with --reasoning_parser qwen3: the block's text is
    reasoning_content, the rest content; streamed, the role first, then reasoning deltas, then content,
    adding up to the unary answer (greedy: the same ids), every token counted in usage."""
    unary, chunks = answers(replies, "reasoning")
    message, choice = unary.choices[0].message, unary.choices[0]
    assert choice.finish_reason == "stop" and message.reasoning_content and message.content
    assert re.fullmatch(THINKING, f"<think>{message.reasoning_content}</think>{message.content}"), message
    deltas = [chunk.choices[0].delta for chunk in chunks if chunk.choices]
    assert deltas[0].role == "assistant" and not getattr(deltas[0], "reasoning_content", None)
    reasoning = [getattr(delta, "reasoning_content", None) or "" for delta in deltas]
    content = [delta.content or "" for delta in deltas]
    assert "".join(reasoning) == message.reasoning_content and "".join(content) == message.content
    first_content = next(i for i, piece in enumerate(content) if piece)
    assert not any(reasoning[first_content:]) and sum(1 for piece in reasoning if piece) > 1
    finishes = [chunk.choices[0].finish_reason for chunk in chunks if chunk.choices and chunk.choices[0].finish_reason]
    assert finishes == ["stop"] and chunks[-1].usage.completion_tokens == unary.usage.completion_tokens
