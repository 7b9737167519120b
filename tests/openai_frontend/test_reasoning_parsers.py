"""Reasoning parsers (DeepSeek-R1, Qwen3, gpt-oss's harmony) on canned model outputs: reasoning and
content, unary and streamed with the text cut anywhere (the streamed pieces concatenate to the unary
answer); then through the whole frontend (aiohttp app, official `openai` client) in front of a fake
Triton: ``reasoning_content`` unary and streamed, the content through the tool-call parser, harmony's
special-token markers kept by the direct path's decoder, ``chat_template_kwargs`` reaching the
template and ``enable_thinking: false`` turning reasoning off."""
import asyncio
import copy
import json

import openai
import pytest
from aiohttp.test_utils import TestServer

from openai_frontend.app import FRONTEND, FrontendConfig, create_app
from openai_frontend.reasoning import ReasoningThenTools, with_reasoning
from openai_frontend.reasoning_parsers import PARSERS, ReasoningDelta, get_parser, parser_for_template
from openai_frontend.tool_parsers import get_parser as get_tool_parser
from openai_frontend.tool_parsers import merge_calls
from openai_frontend.triton_client import Chunk

HARMONY = ("<|channel|>analysis<|message|>User asks the capital. Easy.<|end|><|start|>assistant<|channel|>final"
           "<|message|>Paris.")
# (parser, prompt, model text, expected reasoning, expected content)
CASES = [
    ("deepseek_r1", "<｜Assistant｜><think>\n", "Okay, the capital.\nParis.\n</think>\n\nThe capital is Paris.",
     "Okay, the capital.\nParis.", "The capital is Paris."),
    ("deepseek_r1", "", "<think>\nHmm.</think>Paris", "Hmm.", "Paris"),  # an explicit leading <think>
    ("deepseek_r1", "", "Still thinking when max_tokens cut it", "Still thinking when max_tokens cut it", ""),
    ("deepseek_r1", "", "a</think>b</think><think>c", "a", "b</think><think>c"),  # later tags are content
    ("qwen3", "<|im_start|>assistant\n", "<think>\nLet me see.\n</think>\n\nParis.", "Let me see.", "Paris."),
    ("qwen3", "", "\n<think></think>\n\nParis.", "", "Paris."),  # an empty think block
    ("qwen3", "", "  Paris, no thinking. <think>x</think>", "", "  Paris, no thinking. <think>x</think>"),
    ("qwen3", "", "<thin", "", "<thin"),
    ("qwen3", "<|im_start|>assistant\n<think>\n", "Inside already.\n</think>\n\nParis.", "Inside already.", "Paris."),
    ("gpt_oss", "<|start|>assistant", HARMONY, "User asks the capital. Easy.", "Paris."),
    ("gpt_oss", "", "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|>"
     "<|start|>assistant<|channel|>commentary to=functions.f <|constrain|>json<|message|>{}<|call|>", "ab", "{}"),
    ("gpt_oss", "", "<|channel|>analysis<|message|>cut off insi", "cut off insi", ""),
    ("gpt_oss", "", "analysisNo markers: all content", "", "analysisNo markers: all content"),
]


def streamed(parser, text: str, cuts: list[int]) -> list[ReasoningDelta]:
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    return [parser.push(piece) for piece in pieces] + [parser.finish()]


def joined(deltas) -> tuple[str, str]:
    return "".join(d.reasoning for d in deltas), "".join(d.content for d in deltas)


@pytest.mark.parametrize("name,prompt,text,reasoning,content", CASES)
def test_unary_parse_and_every_cut_streams_to_it(name, prompt, text, reasoning, content):
    unary = get_parser(name)(prompt).parse(text)
    assert (unary.reasoning, unary.content) == (reasoning, content)
    cut_sets = [list(range(1, len(text)))] + [[i] for i in range(1, len(text))]  # char by char; each one cut
    for cuts in cut_sets:
        assert joined(streamed(get_parser(name)(prompt), text, cuts)) == (reasoning, content), cuts


def test_reasoning_streams_as_it_is_written():
    parser = get_parser("deepseek_r1")()
    pieces = [parser.push(c) for c in "I think it is Paris.</think>Paris."]
    assert sum(1 for p in pieces if p.reasoning) > 10 and pieces[-1].content == "."


def test_a_guided_output_starts_outside_the_reasoning():
    """A guide (structured output, an enforced tool call) governs the output from its first token: the
    JSON is content even where the prompt opened <think>; a <think> the guide writes is still read."""
    assert get_parser("deepseek_r1")("<think>\n", guided=True).parse('{"a": 1}') == ReasoningDelta("", '{"a": 1}')
    assert get_parser("deepseek_r1")("", guided=True).parse("<think>x</think>y") == ReasoningDelta("x", "y")


FRAGMENTS = ["<think>", "</think>", "<|channel|>", "<|message|>", "<|end|>", "<|start|>", "<|call|>", "analysis",
             "final", " to=functions.f ", "<|", "</th", "<thi", " ", "\n", "text", "Paris."]


@pytest.mark.parametrize("name", sorted(PARSERS))
def test_any_text_streams_as_its_unary_parse(name):
    """Fuzz: text made of the formats' pieces, cut anywhere, never fails and streams as it parses."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.lists(st.sampled_from(FRAGMENTS), max_size=20), st.lists(st.integers(0, 120), max_size=6),
           st.sampled_from(["", "<think>\n"]))
    def check(fragments, cut_points, prompt):
        text = "".join(fragments)
        cuts = sorted({c for c in cut_points if 0 < c < len(text)})
        unary = get_parser(name)(prompt).parse(text)
        assert joined(streamed(get_parser(name)(prompt), text, cuts)) == (unary.reasoning, unary.content)
    check()


def test_registry_and_template_detection():
    assert sorted(PARSERS) == ["deepseek_r1", "gpt_oss", "qwen3"]
    assert parser_for_template("{{'<｜Assistant｜><think>\\n'}}") == "deepseek_r1"
    assert parser_for_template("{%- if enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}") == "qwen3"
    assert parser_for_template("{{- '<|channel|>analysis<|message|>' }}") == "gpt_oss"
    assert parser_for_template("<|im_start|>{{ m['content'] }}") == "none"  # SmolLM2's ChatML: off
    assert get_parser("none") is None and get_parser(None) is None
    with pytest.raises(ValueError, match="unknown reasoning parser"):
        get_parser("nope")


def test_content_after_the_reasoning_goes_through_the_tool_parser():
    text = '<think>\nThe user wants weather.\n</think>\n\n<tool_call>\n{"name": "w", "arguments": {"c": 1}}\n</tool_call>'
    make = with_reasoning(get_tool_parser("hermes"), get_parser("qwen3"), "", guided=False)
    unary = make().parse(text)
    assert unary.reasoning == "The user wants weather." and unary.content == ""
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in merge_calls(unary.tool_calls)] == [
        ("w", '{"c": 1}')]
    for cuts in ([i] for i in range(1, len(text))):
        parser = make()
        deltas = [parser.push(text[:cuts[0]]), parser.push(text[cuts[0]:]), parser.finish()]
        assert "".join(d.reasoning for d in deltas) == unary.reasoning
        assert merge_calls([c for d in deltas for c in d.tool_calls])[0]["function"] == {"name": "w",
                                                                                      "arguments": '{"c": 1}'}
        assert parser.made_calls
    plain = ReasoningThenTools(get_parser("qwen3")())
    message = plain.parse("<think>a</think>b")
    assert (message.reasoning, message.content, plain.made_calls) == ("a", "b", False)


# ----------------------------------------------------------------------------- through the frontend

QWEN3_LIKE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
              "{% if add_generation_prompt %}<|im_start|>assistant\n{% if enable_thinking is defined and "
              "enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}{% endif %}")
# gpt-oss's template in little: tools listed in a developer message; a past call (the first of its message)
# written as the model writes it, with the analysis before it ("thinking"); a tool result named after the
# last call written
HARMONY_TEMPLATE = (
    "{% if reasoning_effort is defined %}Reasoning: {{ reasoning_effort }}{% endif %}"
    "{% if tools %}<|start|>developer<|message|># Tools{% for t in tools %} {{ t['function']['name'] }}{% endfor %}"
    "<|end|>{% endif %}{% set last = namespace(name=none) %}"
    "{% for m in messages %}{% if m['role'] == 'assistant' and m['tool_calls'] is defined and m['tool_calls'] %}"
    "{% set call = m['tool_calls'][0]['function'] %}{% if m['thinking'] is defined %}<|start|>assistant<|channel|>"
    "analysis<|message|>{{ m['thinking'] }}<|end|>{% endif %}<|start|>assistant to=functions.{{ call['name'] }}"
    "<|channel|>commentary json<|message|>{{ call['arguments']|tojson }}<|call|>{% set last.name = call['name'] %}"
    "{% elif m['role'] == 'tool' %}<|start|>functions.{{ last.name }} to=assistant<|channel|>commentary<|message|>"
    "{{ m['content']|tojson }}<|end|>"
    "{% else %}<|start|>{{ m['role'] }}<|message|>{{ m['content'] }}<|end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|start|>assistant{% endif %}")
HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|call|>", "<|constrain|>"]
USER = [{"role": "user", "content": "What is the capital of France?"}]


class FakeTriton:
    """The direct path (ids out, decoded by the frontend): every choice answers ``reply``'s token ids,
    two per chunk."""

    direct = True

    def __init__(self, tokenizer, reply: str):
        self.ids = tokenizer.encode(reply, add_special_tokens=False)
        self.prompts: list[str] = []

    async def ensure_ready(self):
        pass

    async def close(self):
        pass

    async def generate(self, prompt, prompt_ids, params, max_tokens, seed, request_id, *args):
        self.prompts.append(prompt)
        for start in range(0, len(self.ids), 2):
            yield Chunk("", len(self.ids[start:start + 2]), token_ids=self.ids[start:start + 2])


@pytest.fixture(scope="module")
def engine_dirs(tmp_path_factory, byte_level_tokenizer):
    """A Qwen3-like engine directory (thinking template, <think> plain text) and a gpt-oss-like one
    (harmony template, its markers special tokens): {name: (dir, tokenizer)}."""
    out = {}
    for name, template, special in (("qwen3", QWEN3_LIKE, []), ("gpt_oss", HARMONY_TEMPLATE, HARMONY_TOKENS)):
        tokenizer = copy.deepcopy(byte_level_tokenizer)
        if special:
            tokenizer.add_special_tokens({"additional_special_tokens": special})
        tokenizer.chat_template = template
        path = tmp_path_factory.mktemp(name)
        tokenizer.save_pretrained(str(path))
        (path / "config.json").write_text(json.dumps({"build": {"max_input_len": 512, "max_seq_len": 1024}}))
        out[name] = (str(path), tokenizer)
    return out


def serve(engine_dirs, name, reply, body, flag=None, tool_flag=None):
    """Runs ``body(client, fake)`` against a fresh app (``--reasoning_parser flag``, ``--tool_call_parser
    tool_flag``; None: the template's)."""
    path, tokenizer = engine_dirs[name]

    async def main():
        app = create_app(FrontendConfig(grpc_url="127.0.0.1:1", tokenizer_dir=path, served_model_name="m",
                                        reasoning_parser=flag, tool_call_parser=tool_flag))
        fake = FakeTriton(tokenizer, reply)
        server = TestServer(app)
        await server.start_server()
        real, app[FRONTEND].client = app[FRONTEND].client, fake
        try:
            async with openai.AsyncOpenAI(base_url=str(server.make_url("/v1")), api_key="x", max_retries=0) as c:
                return await body(c, fake)
        finally:
            app[FRONTEND].client = real
            await server.close()
    return asyncio.run(main())


async def unary_and_streamed(client, **extra):
    unary = await client.chat.completions.create(model="m", messages=USER, **extra)
    chunks = [c async for c in await client.chat.completions.create(model="m", messages=USER, stream=True,
                                                                     stream_options={"include_usage": True},
                                                                     **extra)]
    return unary, chunks


def stream_fields(chunks):
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = [getattr(d, "reasoning_content", None) or "" for d in deltas]
    return deltas, "".join(reasoning), "".join(d.content or "" for d in deltas)


@pytest.mark.parametrize("name,reply", [("qwen3", "<think>\nThe capital.\n</think>\n\nParis."), ("gpt_oss", HARMONY)])
def test_reasoning_content_unary_and_streamed(engine_dirs, name, reply):
    """Parsers picked from the chat template; the harmony markers survive the direct path's decoding;
    reasoning_effort reaches the template (gpt-oss's writes it)."""
    async def body(client, fake):
        return await unary_and_streamed(client, reasoning_effort="high"), fake.prompts
    (unary, chunks), prompts = serve(engine_dirs, name, reply, body)
    assert prompts[0].startswith("Reasoning: high") == (name == "gpt_oss")  # (the Qwen3-like one reads none)
    message = unary.choices[0].message
    reasoning = "The capital." if name == "qwen3" else "User asks the capital. Easy."
    assert (message.reasoning_content, message.content) == (reasoning, "Paris.")
    assert unary.choices[0].finish_reason == "stop"
    deltas, streamed_reasoning, streamed_content = stream_fields(chunks)
    assert (streamed_reasoning, streamed_content) == (reasoning, "Paris.")
    assert deltas[0].role == "assistant" and not getattr(deltas[0], "reasoning_content", None)  # the role first
    first_content = next(i for i, d in enumerate(deltas) if d.content)
    assert all(not d.content for d in deltas[:first_content]) and any(
        getattr(d, "reasoning_content", None) for d in deltas[:first_content])  # reasoning before content
    assert chunks[-1].usage.completion_tokens == unary.usage.completion_tokens == len(
        engine_dirs[name][1].encode(reply, add_special_tokens=False))  # every token counted


def test_enable_thinking_false_reaches_the_template_and_turns_reasoning_off(engine_dirs):
    async def body(client, fake):
        off = await client.chat.completions.create(model="m", messages=USER,
                                                   extra_body={"chat_template_kwargs": {"enable_thinking": False}})
        with pytest.raises(openai.BadRequestError, match="chat_template_kwargs.tokenize"):
            await client.chat.completions.create(model="m", messages=USER,
                                                 extra_body={"chat_template_kwargs": {"tokenize": True}})
        history = USER + [{"role": "assistant", "content": "Paris.", "reasoning_content": "Easy."}, USER[0]]
        await client.chat.completions.create(model="m", messages=history)  # a reply sent back as it came
        return off, fake.prompts
    off, prompts = serve(engine_dirs, "qwen3", "<think>x</think>Paris.", body)
    assert prompts[0].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert off.choices[0].message.content == "<think>x</think>Paris."  # no parsing: the text as written
    assert getattr(off.choices[0].message, "reasoning_content", None) is None


def test_the_flag_turns_reasoning_off_or_picks_the_parser(engine_dirs):
    off, _ = serve(engine_dirs, "qwen3", "<think>x</think>Paris.", lambda c, f: unary_and_streamed(c), flag="none")
    assert off.choices[0].message.content == "<think>x</think>Paris."
    assert "reasoning_content" not in off.choices[0].message.model_dump(exclude_none=False)  # the old shape
    r1, _ = serve(engine_dirs, "qwen3", "Cut off while thinking", lambda c, f: unary_and_streamed(c),
                  flag="deepseek_r1")
    assert (r1.choices[0].message.reasoning_content, r1.choices[0].message.content) == ("Cut off while thinking",
                                                                                        None)


# ----------------------------------------------------------------------------- gpt-oss's tool calls

WEATHER_TOOLS = [{"type": "function", "function": {"name": name, "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}} for name in ("get_weather", "get_time")]
# (the model goes on past its <|call|> here, imagining the result: the frontend stops it at the <|call|>)
HARMONY_CALL = ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Café"}<|call|><|start|>functions.'
                'get_weather to=assistant<|channel|>commentary<|message|>"18C"<|end|><|start|>assistant<|channel|>final'
                '<|message|>It is 18C.<|return|>')


@pytest.mark.parametrize("tool_flag", [None, "harmony"])
def test_harmony_tool_calls_unary_and_streamed(engine_dirs, tool_flag):
    """gpt-oss's commentary message to=functions.X is a tool call (the parser the template's <|channel|> picks,
    or --tool_call_parser harmony), the analysis channel reasoning_content; the turn ends at the call's
    <|call|> (a stop string: what the model imagines after it is not the answer); streamed, the call's name
    comes first, its argument pieces then concatenate to the unary answer; finish_reason tool_calls."""
    async def body(client, fake):
        return await unary_and_streamed(client, tools=WEATHER_TOOLS), fake.prompts
    (unary, chunks), prompts = serve(engine_dirs, "gpt_oss", HARMONY_CALL, body, tool_flag=tool_flag)
    assert "# Tools get_weather get_time" in prompts[0]  # the template was given the tools
    message = unary.choices[0].message
    assert [(c.function.name, c.function.arguments, c.type) for c in message.tool_calls] == [
        ("get_weather", '{"city": "Café"}', "function")] and message.tool_calls[0].id.startswith("call_")
    assert (message.reasoning_content, message.content, unary.choices[0].finish_reason) == (
        "Need the weather.", None, "tool_calls")
    deltas, streamed_reasoning, streamed_content = stream_fields(chunks)
    assert (streamed_reasoning, streamed_content) == ("Need the weather.", "")
    calls = [call for d in deltas for call in d.tool_calls or []]
    assert (calls[0].id, calls[0].function.name, calls[0].function.arguments) == (calls[0].id, "get_weather", "")
    assert calls[0].id.startswith("call_") and all(c.id is None and c.function.name is None for c in calls[1:])
    assert len(calls) > 2 and "".join(c.function.arguments for c in calls) == '{"city": "Café"}'  # in pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "tool_calls"


def test_harmony_tool_results_render_after_their_calls(engine_dirs):
    """Two calls of one assistant message and their results sent back: gpt-oss's template writes one call a
    message and names a result after the last call written, so each call goes with its own result; the
    reasoning sent back with the calls is the analysis written before them."""
    history = USER + [
        {"role": "assistant", "content": None, "reasoning_content": "Need both.", "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "call_2", "content": "noon"},
        {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]

    async def body(client, fake):
        answer = await client.chat.completions.create(model="m", messages=history, tools=WEATHER_TOOLS)
        return answer, fake.prompts
    answer, prompts = serve(engine_dirs, "gpt_oss", HARMONY, body)
    assert answer.choices[0].message.content == "Paris." and answer.choices[0].finish_reason == "stop"
    assert ('<|start|>assistant<|channel|>analysis<|message|>Need both.<|end|>'
            '<|start|>assistant to=functions.get_weather<|channel|>commentary json<|message|>{"city": "Paris"}<|call|>'
            '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"18C"<|end|>'
            '<|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>{}<|call|>'
            '<|start|>functions.get_time to=assistant<|channel|>commentary<|message|>"noon"<|end|>'
            '<|start|>assistant') in prompts[0]


def test_the_harmony_tool_parser_takes_the_reasoning_parsers_place_with_tool_choice_auto():
    """With tools (auto) it reads the whole output, the analysis channel as reasoning when reasoning is on and
    as content when off; without tools, or with an enforced choice, the gpt_oss reasoning parser reads it."""
    from openai_frontend.reasoning import chat_parsers
    from openai_frontend.tool_calls import turn_stops
    from openai_frontend.tools import parse_tools
    harmony, gpt_oss = get_tool_parser("harmony"), get_parser("gpt_oss")
    auto = parse_tools({"tools": WEATHER_TOOLS})
    text = "<|channel|>analysis<|message|>Hm.<|end|><|start|>assistant<|channel|>final<|message|>Paris."
    make, markers = chat_parsers(auto, harmony, gpt_oss, "", guided=False)
    assert (make().parse(text).reasoning, markers) == ("Hm.", harmony.special_tokens)
    make, markers = chat_parsers(auto, harmony, None, "", guided=False)
    assert (make().parse(text).content, markers) == ("Hm.Paris.", harmony.special_tokens)
    make, markers = chat_parsers(None, harmony, gpt_oss, "", guided=False)
    assert isinstance(make(), ReasoningThenTools) and markers == gpt_oss.special_tokens
    required = parse_tools({"tools": WEATHER_TOOLS, "tool_choice": "required"})
    make, _ = chat_parsers(required, harmony, gpt_oss, "", guided=True)
    assert isinstance(make(), ReasoningThenTools)
    # the turn ends at a call's <|call|> with tool_choice auto only
    assert turn_stops(auto, harmony) == ["<|call|>"] and turn_stops(required, harmony) == turn_stops(None, harmony) == []
    assert turn_stops(auto, get_tool_parser("hermes")) == []
