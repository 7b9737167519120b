"""Structured output and tool calls through the whole frontend (aiohttp app, official `openai`
client) in front of a fake Triton that answers canned text: the guide each request sends, the
tool_calls it answers (unary and streamed alike), the prompt the model sees, and 400s naming
the field."""
import asyncio
import json

import openai
import pytest
from aiohttp.test_utils import TestServer

from openai_frontend.app import FRONTEND, FrontendConfig, create_app
from openai_frontend.errors import APIError
from openai_frontend.guides import Guide, choice_grammar, parse_guide, required_calls_schema
from openai_frontend.protocol import parse_chat_request, parse_completion_request
from openai_frontend.triton_client import Chunk, triton_error

CHATML = ("{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
          "{{ '<|im_start|>system\nYou are a helpful AI assistant<|im_end|>\n' }}{% endif %}"
          "{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}}
TIME_TOOL = {"type": "function", "function": {"name": "get_time", "parameters": {"type": "object", "properties": {}}}}
USER = [{"role": "user", "content": "What is the weather in Paris?"}]
MODEL = "m"


class FakeTriton:
    """Answers every choice with ``reply`` in pieces of three characters (as the BLS path: text)."""

    direct = False

    def __init__(self):
        self.reply = "Hello there."
        self.error: str | None = None
        self.calls: list[tuple[str, object]] = []  # (prompt, params) of each choice

    async def ensure_ready(self):
        pass

    async def close(self):
        pass

    async def generate(self, prompt, prompt_ids, params, max_tokens, seed, request_id, lora=None, prompt_table=None,
                       mrope=None, vision=None):
        self.calls.append((prompt, params))
        if self.error:
            raise triton_error(self.error, params.guide.field if params.guide else None)
        for start in range(0, len(self.reply), 3):
            yield Chunk(self.reply[start:start + 3], 1)

    @property
    def last(self):
        return self.calls[-1]


@pytest.fixture(scope="module")
def engine_dir(tmp_path_factory, byte_level_tokenizer):
    path = tmp_path_factory.mktemp("chatml_engine")
    tokenizer = byte_level_tokenizer
    tokenizer.chat_template = CHATML
    tokenizer.save_pretrained(str(path))
    (path / "config.json").write_text(json.dumps({"build": {"max_input_len": 4096, "max_seq_len": 8192}}))
    return str(path)


def serve(engine_dir, body, parser=None):
    """Runs ``body(client, fake)`` against a fresh app on a local port."""
    async def main():
        app = create_app(FrontendConfig(grpc_url="127.0.0.1:1", tokenizer_dir=engine_dir, served_model_name=MODEL,
                                        tool_call_parser=parser))
        fake = FakeTriton()
        server = TestServer(app)
        await server.start_server()
        real = app[FRONTEND].client
        app[FRONTEND].client = fake
        try:
            async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
                return await body(c, fake)
        finally:
            app[FRONTEND].client = real
            await server.close()
    return asyncio.run(main())


# ----------------------------------------------------------------------------- guides

@pytest.mark.parametrize("fields,guide", [
    ({"response_format": {"type": "json_object"}}, ("json_schema", '{"type": "object"}', "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "any"}}},
     ("json_schema", '{"type": "object"}', "response_format")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "w", "schema": {"type": "object"},
                                                                  "strict": True}}},
     ("json_schema", '{"type": "object"}', "response_format")),
    ({"response_format": {"type": "text"}}, None),
    ({"guided_json": {"type": "integer"}}, ("json_schema", '{"type": "integer"}', "guided_json")),
    ({"guided_json": '{"type": "integer"}'}, ("json_schema", '{"type": "integer"}', "guided_json")),
    ({"guided_regex": "[0-9]{3}"}, ("regex", "[0-9]{3}", "guided_regex")),
    ({"guided_grammar": 'root ::= "a"'}, ("ebnf_grammar", 'root ::= "a"', "guided_grammar")),
    ({"guided_choice": ["yes", "no"]}, ("ebnf_grammar", 'root ::= "yes" | "no"', "guided_choice")),
])
def test_guides_of_chat_and_completions(fields, guide):
    for parsed in (parse_chat_request({"model": MODEL, "messages": USER, **fields}),
                   parse_completion_request({"model": MODEL, "prompt": "a", **fields})):
        got = parsed.params.guide
        assert (got if got is None else (got.type, got.text, got.field)) == guide


@pytest.mark.parametrize("fields,param,words", [
    ({"response_format": {"type": "json_object"}, "guided_regex": "a"}, "guided_regex",
     "response_format, guided_regex"),
    ({"guided_choice": ["a"], "guided_json": {}}, "guided_choice", "guided_json, guided_choice"),
    ({"response_format": {"type": "yaml"}}, "response_format", "one of text, json_object, json_schema"),
    ({"response_format": {"type": "json_schema"}}, "response_format.json_schema", "name and schema"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a b", "schema": {}}}},
     "response_format.json_schema.name", "letters"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": [1]}}},
     "response_format.json_schema.schema", "JSON Schema"),
    ({"guided_json": "{not json"}, "guided_json", "not valid JSON"),
    ({"guided_regex": ""}, "guided_regex", "non-empty string"),
    ({"guided_choice": []}, "guided_choice", "non-empty list"),
    ({"guided_choice": ["a", 1]}, "guided_choice", "list of strings"),
])
def test_bad_guides_are_named(fields, param, words):
    with pytest.raises(APIError) as raised:
        parse_chat_request({"model": MODEL, "messages": USER, **fields})
    assert raised.value.status == 400 and raised.value.param == param and words in raised.value.message


def test_choice_grammar_is_exactly_one_choice():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    choices = ["yes", "no way", 'say "hi"', "back\\slash", "tab\tnew\nline", "é 日本", "(a|b)*", "\x01"]
    grammar = xgr.Grammar.from_ebnf(choice_grammar(choices))
    assert all(accepts(grammar, choice) for choice in choices)
    assert not any(accepts(grammar, other) for other in ("ye", "yes ", "nope", "a", ""))


def test_required_schema_accepts_only_calls_of_the_tools():
    import xgrammar as xgr
    from xgrammar.testing import _is_grammar_accept_string as accepts

    schema = required_calls_schema([WEATHER_TOOL, TIME_TOOL], parallel=True)
    grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False, strict_mode=True)
    assert accepts(grammar, '[{"name": "get_weather", "parameters": {"city": "Paris"}}, '
                            '{"name": "get_time", "parameters": {}}]')
    assert not accepts(grammar, "[]")
    assert not accepts(grammar, '[{"name": "get_weather", "parameters": {}}]')  # city is required
    assert not accepts(grammar, '[{"name": "other", "parameters": {}}]')
    single = xgr.Grammar.from_json_schema(required_calls_schema([WEATHER_TOOL, TIME_TOOL], parallel=False),
                                          any_whitespace=False, strict_mode=True)
    assert accepts(single, '[{"name": "get_time", "parameters": {}}]')
    assert not accepts(single, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')


def test_required_schema_moves_definitions_to_the_root():
    def tool(name, ref_name):
        return {"type": "function", "function": {"name": name, "parameters": {
            "type": "object", "properties": {"p": {"$ref": f"#/$defs/{ref_name}"}}, "required": ["p"],
            "$defs": {ref_name: {"type": "integer" if name == "a" else "string"}}}}}
    schema = json.loads(required_calls_schema([tool("a", "X"), tool("b", "X")], parallel=True))
    assert set(schema["$defs"]) == {"X", "b__X"}
    refs = [option["properties"]["parameters"]["properties"]["p"]["$ref"] for option in schema["items"]["anyOf"]]
    assert refs == ["#/$defs/X", "#/$defs/b__X"]
    import jsonschema
    jsonschema.validate([{"name": "a", "parameters": {"p": 1}}, {"name": "b", "parameters": {"p": "s"}}], schema)


def test_the_guide_goes_to_triton_as_its_two_inputs():
    from openai_frontend.triton_client import direct_inputs, generation_inputs

    params = parse_chat_request({"model": MODEL, "messages": USER, "guided_regex": "[a-z]+"}).params
    for inputs in (direct_inputs([1, 2], params, 8, None, 0, 0), generation_inputs("p", params, 8, None)):
        assert inputs["guided_decoding_guide_type"].tolist() == [[b"regex"]]
        assert inputs["guided_decoding_guide"].tolist() == [[b"[a-z]+"]]
    json_mode = parse_chat_request({"model": MODEL, "messages": USER}).params
    json_mode.guide = Guide("json", None, "guided_json")
    inputs = direct_inputs([1], json_mode, 8, None, 0, 0)
    assert inputs["guided_decoding_guide_type"].tolist() == [[b"json"]] and "guided_decoding_guide" not in inputs
    assert "guided_decoding_guide_type" not in direct_inputs([1], parse_guide_free(), 8, None, 0, 0)


def parse_guide_free():
    return parse_chat_request({"model": MODEL, "messages": USER}).params


def test_engine_errors_about_the_guide_name_the_field():
    error = triton_error("guided_decoding_guide: invalid JSON schema: Unsupported type \"nope\"", "response_format")
    assert error.status == 400 and error.param == "response_format" and "Unsupported type" in error.message
    assert error.error_type == "invalid_request_error"
    assert triton_error("the engine died", "response_format").status == 500  # not about the guide
    assert parse_guide({}) is None


# ----------------------------------------------------------------------------- tools: the request

@pytest.mark.parametrize("fields,param,words", [
    ({"tool_choice": "auto"}, "tool_choice", "only allowed when tools are given"),
    ({"tools": [WEATHER_TOOL], "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice",
     "'nope'"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "sometimes"}, "tool_choice", '"required"'),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]},
     "tools[0].function.parameters", "object"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "x"}}]},
     "tools[0].function.parameters", "object"),
    ({"tools": [{"type": "code_interpreter"}]}, "tools[0]", "function tools"),
    ({"tools": [WEATHER_TOOL, WEATHER_TOOL]}, "tools[1].function.name", "twice"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools[0].function.name", "letters"),
    ({"tools": [WEATHER_TOOL], "parallel_tool_calls": "no"}, "parallel_tool_calls", "true or false"),
    ({"tools": [WEATHER_TOOL], "tool_choice": "required", "response_format": {"type": "json_object"}},
     "response_format", "tool_choice 'required'"),
])
def test_bad_tools_are_named(fields, param, words):
    with pytest.raises(APIError) as raised:
        parse_chat_request({"model": MODEL, "messages": USER, **fields})
    assert raised.value.status == 400 and raised.value.param == param and words in raised.value.message


def test_tool_history_messages_are_accepted():
    messages = USER + [
        {"role": "assistant", "content": None, "refusal": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]
    parsed = parse_chat_request({"model": MODEL, "messages": messages, "tools": [WEATHER_TOOL]})
    assert parsed.messages[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Paris"}'
    assert parsed.messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}
    for bad, param in (({"role": "tool", "content": "x"}, "messages[1].tool_call_id"),
                       ({"role": "assistant", "tool_calls": [{"id": "c"}]}, "messages[1].tool_calls[0]"),
                       ({"role": "user", "content": "x", "tool_calls": []}, "messages[1].tool_calls")):
        with pytest.raises(APIError) as raised:
            parse_chat_request({"model": MODEL, "messages": USER + [bad]})
        assert raised.value.param == param


# ----------------------------------------------------------------------------- through the app

def test_auto_tool_calls_unary_and_streamed(engine_dir):
    reply = ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>')

    async def body(client, fake):
        fake.reply = reply
        unary = await client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL])
        prompt, params = fake.last
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL], stream=True)]
        return unary, prompt, params, chunks
    unary, prompt, params, chunks = serve(engine_dir, body)
    choice = unary.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "I will look."
    calls = [(c.function.name, c.function.arguments, c.type) for c in choice.message.tool_calls]
    assert calls == [("get_weather", '{"city": "Paris"}', "function"), ("get_time", "{}", "function")]
    assert all(c.id.startswith("call_") for c in choice.message.tool_calls)
    # The ChatML template ignores tools: they are described in the system message, Hermes-style.
    assert prompt.startswith("<|im_start|>system\n# Tools") and '"name": "get_weather"' in prompt
    assert "<tool_call>" in prompt and params.guide is None
    streamed_calls: dict[int, dict] = {}
    content = ""
    for chunk in chunks:
        delta = chunk.choices[0].delta
        content += delta.content or ""
        for call in delta.tool_calls or []:
            if call.index not in streamed_calls:
                assert call.id and call.type == "function" and call.function.name and call.function.arguments == ""
                streamed_calls[call.index] = {"name": call.function.name, "arguments": ""}
            else:
                assert call.id is None and call.function.name is None
                streamed_calls[call.index]["arguments"] += call.function.arguments
    assert content == "I will look."
    assert [(c["name"], c["arguments"], "function") for c in streamed_calls.values()] == calls
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_auto_without_calls_is_plain_content(engine_dir):
    async def body(client, fake):
        fake.reply = "It is sunny.\n"
        return await client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL])
    reply = serve(engine_dir, body)
    assert reply.choices[0].message.content == "It is sunny.\n" and reply.choices[0].message.tool_calls is None
    assert reply.choices[0].finish_reason == "stop"


def test_parallel_false_keeps_the_first_call_and_none_shows_no_tools(engine_dir):
    reply = ('<tool_call>{"name": "get_time", "arguments": {}}</tool_call>'
             '<tool_call>{"name": "get_time", "arguments": {}}</tool_call>')

    async def body(client, fake):
        fake.reply = reply
        single = await client.chat.completions.create(model=MODEL, messages=USER, tools=[TIME_TOOL],
                                                      parallel_tool_calls=False)
        none = await client.chat.completions.create(model=MODEL, messages=USER, tools=[TIME_TOOL], tool_choice="none")
        return single, none, fake.last[0]
    single, none, prompt = serve(engine_dir, body)
    assert len(single.choices[0].message.tool_calls) == 1
    assert none.choices[0].message.content == reply and none.choices[0].message.tool_calls is None
    assert "# Tools" not in prompt


@pytest.mark.parametrize("choice", ["required", "named"])
def test_enforced_tool_choice_sends_the_guide_and_builds_the_calls(engine_dir, choice):
    if choice == "required":
        tool_choice, reply = "required", '[{"name": "get_weather", "parameters": {"city": "Paris"}}]'
    else:
        tool_choice, reply = {"type": "function", "function": {"name": "get_weather"}}, '{"city": "Paris"}'

    async def body(client, fake):
        fake.reply = reply
        unary = await client.chat.completions.create(model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL],
                                                     tool_choice=tool_choice, parallel_tool_calls=False)
        guide = fake.last[1].guide
        chunks = [c async for c in await client.chat.completions.create(
            model=MODEL, messages=USER, tools=[WEATHER_TOOL, TIME_TOOL], tool_choice=tool_choice,
            parallel_tool_calls=False, stream=True)]
        return unary, guide, chunks
    unary, guide, chunks = serve(engine_dir, body)
    assert guide.type == "json_schema" and guide.field == "tools"
    schema = json.loads(guide.text)
    if choice == "named":
        assert schema == WEATHER_TOOL["function"]["parameters"]
    else:
        assert schema["type"] == "array" and schema["minItems"] == 1 and schema["maxItems"] == 1
    message = unary.choices[0].message
    assert message.content is None and unary.choices[0].finish_reason == "tool_calls"
    assert [(c.function.name, c.function.arguments) for c in message.tool_calls] == [("get_weather", '{"city": "Paris"}')]
    deltas = [call for chunk in chunks for call in (chunk.choices[0].delta.tool_calls or [])]
    assert deltas[0].function.name == "get_weather" and deltas[0].function.arguments == ""
    assert "".join(d.function.arguments for d in deltas[1:]) == '{"city": "Paris"}' and len(deltas) > 2


def test_history_with_calls_is_rendered_hermes_style_for_a_template_without_tools(engine_dir):
    messages = USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C, sunny"}]

    async def body(client, fake):
        await client.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER_TOOL])
        return fake.last[0]
    prompt = serve(engine_dir, body)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>') in prompt
    assert "<|im_start|>user\n<tool_response>\n22 C, sunny\n</tool_response><|im_end|>" in prompt


def test_a_guide_the_engine_refuses_is_a_400_naming_the_field(engine_dir):
    async def body(client, fake):
        fake.error = "guided_decoding_guide: regex parsing error at position 3: the parenthesis is not closed"
        with pytest.raises(openai.BadRequestError) as unary:
            await client.chat.completions.create(model=MODEL, messages=USER, extra_body={"guided_regex": "(a"})
        with pytest.raises(openai.BadRequestError) as streamed:
            await client.completions.create(model=MODEL, prompt="a", stream=True, extra_body={"guided_regex": "(a"})
        fake.error = None
        fine = await client.chat.completions.create(model=MODEL, messages=USER)
        return unary.value, streamed.value, fine
    unary, streamed, fine = serve(engine_dir, body)
    for error in (unary, streamed):
        assert error.status_code == 400 and error.body["param"] == "guided_regex" and "parenthesis" in error.message
    assert fine.choices[0].message.content == "Hello there."


def test_response_format_on_both_endpoints(engine_dir):
    async def body(client, fake):
        fake.reply = '{"a": 1}'
        chat = await client.chat.completions.create(model=MODEL, messages=USER,
                                                    response_format={"type": "json_object"})
        chat_guide = fake.last[1].guide
        text = await client.completions.create(model=MODEL, prompt="a", extra_body={"guided_choice": ["x", "y"]})
        return chat, chat_guide, text, fake.last[1].guide
    chat, chat_guide, text, text_guide = serve(engine_dir, body)
    assert json.loads(chat.choices[0].message.content) == {"a": 1} and chat_guide.text == '{"type": "object"}'
    assert text.choices[0].text == '{"a": 1}' and text_guide.text == 'root ::= "x" | "y"'


def test_the_parser_flag_overrides_the_template(engine_dir):
    async def body(client, fake):
        fake.reply = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
        reply = await client.chat.completions.create(model=MODEL, messages=USER, tools=[TIME_TOOL])
        return reply, fake.last[0]
    reply, prompt = serve(engine_dir, body, parser="mistral")
    assert reply.choices[0].message.tool_calls[0].function.name == "get_time"
    assert "[TOOL_CALLS]" in prompt  # the system message teaches the parser's format


TOOLS_TEMPLATE = ("{% if tools %}TOOLS:{% for t in tools %}{{ t.function.name }};{% endfor %}\n{% endif %}"
                  "{% for m in messages %}{% if m.tool_calls %}CALLS:{% for c in m.tool_calls %}{{ c.function.name }}"
                  "({{ c.function.arguments | tojson }}){% endfor %}{% elif m.role == 'tool' %}RESULT:{{ m.content }}"
                  "{% else %}<{{ m.role }}>{{ m.content }}{% endif %}\n{% endfor %}<assistant>")


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_objects(tmp_path, byte_level_tokenizer):
    from openai_frontend.chat_template import PromptBuilder
    from openai_frontend.tool_parsers import get_parser

    byte_level_tokenizer.chat_template = TOOLS_TEMPLATE
    byte_level_tokenizer.save_pretrained(str(tmp_path))
    builder = PromptBuilder(str(tmp_path))
    assert builder.template_renders_tools and builder.template_renders_calls
    parsed = parse_chat_request({"model": MODEL, "tools": [WEATHER_TOOL], "messages": USER + [
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "22 C"}]})
    prompt = builder.render_chat(parsed.messages, parsed.tools.shown, get_parser("hermes"))
    # (transformers renders with trim_blocks: no newline after a block tag)
    assert prompt == ('TOOLS:get_weather;<user>What is the weather in Paris?CALLS:get_weather({"city": "Paris"})'
                      "RESULT:22 C<assistant>")
