"""Tool-call parsers on canned model outputs (Hermes/Qwen, Llama 3 JSON, Mistral, gpt-oss's harmony, and
the arrays ``tool_choice: "required"`` enforces): content and calls, unary and streamed with the text cut
anywhere; the streamed deltas have OpenAI's shape and concatenate to the unary answer."""
import json
import random

import pytest

from openai_frontend.tool_calls import FirstCallOnly, NamedCallParser, finish_reason, keep_markers_decoder
from openai_frontend.tool_parsers import (PARSERS, ArrayParser, MessageDelta, coalesce, get_parser, merge_calls,
                                          parser_for_template)
from openai_frontend.tool_parsers.json_scanner import CallScanner

WEATHER = {"city": "Paris", "unit": "celsius", "days": [1, 2], "note": "a \"quoted\" }] brace\\"}


def calls_of(delta: MessageDelta):
    return [(c["function"]["name"], c["function"]["arguments"]) for c in merge_calls(delta.tool_calls)]


def streamed(parser, text: str, cuts: list[int]) -> list[MessageDelta]:
    pieces = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    return [parser.push(piece) for piece in pieces] + [parser.finish()]


def joined(deltas: list[MessageDelta]) -> MessageDelta:
    out = MessageDelta()
    for delta in deltas:
        out.extend(delta)
    return out


def without_ids(delta: MessageDelta):
    return delta.content, delta.reasoning, [(c["function"]["name"], c["function"]["arguments"], c["type"])
                                            for c in merge_calls(delta.tool_calls)]


# (parser, model text, expected content, expected [(name, arguments)])
CASES = [
    ("hermes", 'Let me check.\n\n<tool_call>\n{"name": "get_weather", "arguments": ' + json.dumps(WEATHER)
     + '}\n</tool_call>', "Let me check.", [("get_weather", json.dumps(WEATHER))]),
    ("hermes", '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n<tool_call>\n'
     '{"arguments": {"y": [2]}, "name": "b"}\n</tool_call>', "", [("a", '{"x": 1}'), ("b", '{"y": [2]}')]),
    ("hermes", '<tool_call>{"name": "a", "parameters": {}}</tool_call> and then some text',
     "and then some text", [("a", "{}")]),
    ("hermes", '<tool_call>\n{"name": "no_args"}\n</tool_call>', "", [("no_args", "{}")]),
    ("hermes", '<tool_call>\n{"name": "s", "arguments": "{\\"q\\": 1}"}\n</tool_call>', "", [("s", '{"q": 1}')]),
    ("hermes", "Just an answer, no call. <tool_ is not a tag\n", "Just an answer, no call. <tool_ is not a tag\n",
     []),
    ("hermes", "<tool_call>\nnot json at all\n</tool_call>", "<tool_call>\nnot json at all\n</tool_call>", []),
    ("hermes", '<tool_call>\n{"arguments": {}}\n</tool_call>', '<tool_call>\n{"arguments": {}}\n</tool_call>', []),
    ("llama3_json", '{"name": "get_weather", "parameters": ' + json.dumps(WEATHER) + "}", "",
     [("get_weather", json.dumps(WEATHER))]),
    ("llama3_json", '<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}', "",
     [("a", '{"x": 1}'), ("b", "{}")]),
    ("llama3_json", '  {"name": "a", "arguments": {"x": true, "y": null}}', "", [("a", '{"x": true, "y": null}')]),
    ("llama3_json", '{"answer": "Paris", "name": "x"}', '{"answer": "Paris", "name": "x"}', []),
    ("llama3_json", "The capital of France is Paris.", "The capital of France is Paris.", []),
    ("llama3_json", 'Sure: <|python_tag|>{"name": "a", "parameters": {}}', "Sure:", [("a", "{}")]),
    ("mistral", '[TOOL_CALLS][{"name": "get_weather", "arguments": ' + json.dumps(WEATHER) + "}]", "",
     [("get_weather", json.dumps(WEATHER))]),
    ("mistral", 'Checking both. [TOOL_CALLS] [{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": '
     '{"y": "]"}}]', "Checking both.", [("a", '{"x": 1}'), ("b", '{"y": "]"}')]),
    ("mistral", '[TOOL_CALLS]{"name": "a", "arguments": {}}', "", [("a", "{}")]),
    ("mistral", "No tools needed [TOOL_CALLS without a bracket", "No tools needed [TOOL_CALLS without a bracket", []),
    # gpt-oss's harmony (the reasoning these carry: HARMONY_REASONING)
    ("openai", "<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.get_weather <|constrain|>json<|message|>" + json.dumps(WEATHER) + "<|call|>", "",
     [("get_weather", json.dumps(WEATHER))]),
    ("openai", ' to=functions.a<|channel|>commentary json<|message|>{"x": 1}<|call|><|start|>assistant<|channel|>'
     "commentary to=functions.b <|constrain|>json<|message|> \n{}\n <|call|>", "", [("a", '{"x": 1}'), ("b", "{}")]),
    ("openai", "<|channel|>commentary<|message|>Checking.<|end|><|start|>assistant<|channel|>commentary "
     "to=functions.f <|constrain|>json<|message|><|call|>", "Checking.", [("f", "{}")]),
    ("openai", "<|channel|>analysis<|message|>Easy.<|end|><|start|>assistant<|channel|>final<|message|>Paris.<|return|>",
     "Paris.", []),
    ("openai", "<|channel|>analysis to=browser.search<|message|>{}<|call|>", "", []),  # a built-in tool: no function
    ("openai", '<|channel|>commentary to=functions.f <|constrain|>json<|message|>{"city": "Pa', "",
     [("f", '{"city": "Pa')]),  # cut off (max_tokens): the call stays as written
    ("openai", "to=, or not: no markers at all", "to=, or not: no markers at all", []),
    ("openai", "<|channel|>commentary to=functions.f json<|message|>{}<|call|><|start|>functions.f to=assistant"
     '<|channel|>commentary<|message|>"18C"<|end|><|start|>assistant<|channel|>final<|message|>18C.', "18C.",
     [("f", "{}")]),  # a tool's message (imagined) is dropped
    ("openai", "<|channel|>commentary to=functions.f json<|message|>", "", [("f", "{}")]),  # stopped at <|call|>
]
HARMONY_REASONING = {0: "Need the weather.", 3: "Easy.", 4: "{}"}  # (index among the "openai" cases)
HARMONY_CASES = [case for case in CASES if case[0] == "openai"]


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_unary_parse(name, text, content, calls):
    delta = get_parser(name)().parse(text)
    assert delta.content == content
    assert calls_of(delta) == calls
    assert all(c["id"] and c["type"] == "function" for c in merge_calls(delta.tool_calls))


@pytest.mark.parametrize("name,text,content,calls", CASES)
def test_streamed_with_cuts_anywhere_equals_unary(name, text, content, calls):
    unary = without_ids(get_parser(name)().parse(text))
    rng = random.Random(len(text))
    cut_sets = [list(range(1, len(text)))]  # one character at a time
    cut_sets += [sorted(rng.sample(range(1, len(text)), k)) for k in (1, 2, 5, 13) if k < len(text)]
    cut_sets += [[i] for i in range(1, len(text))]  # every single cut point
    for cuts in cut_sets:
        deltas = streamed(get_parser(name)(), text, cuts)
        assert without_ids(joined(deltas)) == unary, cuts
        check_openai_delta_shape(deltas)


def check_openai_delta_shape(deltas):
    """A call's first delta: index, id, type, name, arguments ""; later ones: index and arguments."""
    seen = set()
    for delta in coalesce([d for m in deltas for d in m.tool_calls]):
        shaped = delta.to_openai()
        if delta.index not in seen:
            seen.add(delta.index)
            assert set(shaped) == {"index", "id", "type", "function"} and shaped["function"]["arguments"] == ""
            assert shaped["type"] == "function" and shaped["function"]["name"]
        else:
            assert set(shaped) == {"index", "function"} and set(shaped["function"]) == {"arguments"}
    assert sorted(seen) == list(range(len(seen)))


def test_arguments_stream_as_they_grow():
    parser = get_parser("hermes")()
    text = '<tool_call>\n{"name": "f", "arguments": {"city": "Paris", "country": "France"}}\n</tool_call>'
    pieces = [parser.push(c) for c in text]
    with_args = [i for i, p in enumerate(pieces) if any(d.arguments for d in p.tool_calls)]
    assert len(with_args) > 20  # a piece per character once the name is known, not one at the end
    first = next(i for i, p in enumerate(pieces) if p.tool_calls)
    assert pieces[first].tool_calls[0].name == "f" and first < with_args[0]


def test_trailing_whitespace_is_content_only_without_calls():
    assert get_parser("hermes")().parse("Hello!\n\n").content == "Hello!\n\n"
    parser = get_parser("hermes")()
    assert parser.push("Hello!\n\n").content == "Hello!"  # held: a call may follow
    assert parser.finish().content == "\n\n"


def test_mistral_ids_are_nine_alphanumerics_and_hermes_ids_openai_shaped():
    mistral = merge_calls(get_parser("mistral")().parse('[TOOL_CALLS][{"name": "a", "arguments": {}}]').tool_calls)
    assert len(mistral[0]["id"]) == 9 and mistral[0]["id"].isalnum()
    hermes = merge_calls(get_parser("hermes")().parse('<tool_call>{"name": "a", "arguments": {}}</tool_call>')
                         .tool_calls)
    assert hermes[0]["id"].startswith("call_") and len(hermes[0]["id"]) == 29


def test_cut_off_inside_the_arguments_keeps_what_was_written():
    parser = get_parser("hermes")()
    delta = parser.parse('<tool_call>\n{"name": "f", "arguments": {"city": "Pa')
    assert calls_of(delta) == [("f", '{"city": "Pa')] and delta.content == ""
    assert finish_reason("length", parser) == "length" and finish_reason("stop", parser) == "tool_calls"


@pytest.mark.parametrize("parallel", [True, False])
def test_required_array_of_name_and_parameters(parallel):
    text = '[{"name": "a", "parameters": {"x": 1}}, {"name": "b", "parameters": {"y": "z"}}]'
    make = ArrayParser if parallel else (lambda: FirstCallOnly(ArrayParser()))
    unary = make().parse(text)
    expected = [("a", '{"x": 1}'), ("b", '{"y": "z"}')]
    assert calls_of(unary) == (expected if parallel else expected[:1]) and unary.content == ""
    for cuts in ([i] for i in range(1, len(text))):
        assert without_ids(joined(streamed(make(), text, cuts))) == without_ids(unary)


def test_named_function_is_the_whole_output():
    parser = NamedCallParser("get_weather")
    first = parser.push('{"city"')
    assert [d.to_openai() for d in first.tool_calls][0]["function"] == {"name": "get_weather", "arguments": ""}
    rest = [parser.push(': "Paris"}'), parser.finish()]
    assert calls_of(joined([first] + rest)) == [("get_weather", '{"city": "Paris"}')]
    assert parser.made_calls and finish_reason("stop", parser) == "tool_calls"


@pytest.mark.parametrize("reasoning", [True, False])
@pytest.mark.parametrize("case", range(len(HARMONY_CASES)))
def test_harmony_reasoning_is_the_analysis_channel_or_content(case, reasoning):
    """The analysis channel is reasoning_content with reasoning on, content with it off (the calls and the
    other bodies alike either way)."""
    _, text, content, calls = HARMONY_CASES[case]
    delta = get_parser("harmony")(reasoning=reasoning).parse(text)
    analysis = HARMONY_REASONING.get(case, "")
    assert (delta.reasoning, delta.content) == ((analysis, content) if reasoning else ("", analysis + content))
    assert calls_of(delta) == calls


def test_harmony_name_goes_first_then_the_arguments_as_they_grow():
    parser = get_parser("openai")()
    text = ('<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>{"city": "Paris", '
            '"unit": "celsius"}<|call|>')
    pieces = [parser.push(c) for c in text] + [parser.finish()]
    first = next(i for i, p in enumerate(pieces) if p.tool_calls)
    assert pieces[first].tool_calls[0].name == "get_weather" and pieces[first].tool_calls[0].arguments == ""
    assert sum(1 for p in pieces if any(d.arguments for d in p.tool_calls)) > 20  # a piece per character
    assert parser.made_calls and finish_reason("stop", parser) == "tool_calls"


HARMONY_FRAGMENTS = ["<|start|>", "assistant", "<|channel|>", "analysis", "commentary", "final", " to=functions.f",
                     "to=functions.g", " to=browser.x", " <|constrain|>json", " json", "<|message|>", "<|end|>",
                     "<|call|>", "<|return|>", "<|", "<|cha", " to", "{", '"x": 1', "}", " ", "\n", "text"]


@pytest.mark.parametrize("reasoning", [True, False])
def test_any_harmony_text_streams_as_its_unary_parse(reasoning):
    """Fuzz: harmony's pieces in any order, cut anywhere, never fail and stream as they parse."""
    from hypothesis import given, settings, strategies as st

    @settings(max_examples=40, deadline=None, derandomize=True)
    @given(st.lists(st.sampled_from(HARMONY_FRAGMENTS), max_size=20), st.lists(st.integers(0, 200), max_size=6))
    def check(fragments, cut_points):
        text = "".join(fragments)
        cuts = sorted({c for c in cut_points if 0 < c < len(text)})
        unary = get_parser("openai")(reasoning=reasoning).parse(text)
        deltas = streamed(get_parser("openai")(reasoning=reasoning), text, cuts)
        assert without_ids(joined(deltas)) == without_ids(unary)
        check_openai_delta_shape(deltas)
    check()


def test_parser_registry_and_template_detection():
    assert sorted(PARSERS) == ["harmony", "hermes", "llama3_json", "mistral", "openai"]
    assert PARSERS["harmony"] is PARSERS["openai"]  # vLLM's name, and the format's
    assert parser_for_template("{{- '<|start|>assistant<|channel|>final<|message|>' }}") == "openai"
    assert parser_for_template("{{ '<tool_call>' }}") == "hermes"
    assert parser_for_template("{{ '[TOOL_CALLS]' }}") == "mistral"
    assert parser_for_template("{{- '<|python_tag|>' }}") == "llama3_json"
    assert parser_for_template("<|im_start|>{{ m['content'] }}") == "hermes"  # SmolLM2's ChatML: the default
    assert parser_for_template(None) == "hermes"
    with pytest.raises(ValueError, match="unknown tool call parser"):
        get_parser("nope")


def test_scanner_reports_first_key_and_stops_at_the_object_end():
    scanner = CallScanner()
    used, events = scanner.feed('{"name": "f", "arguments": {"a": "}"}} trailing')
    assert scanner.done and used == len('{"name": "f", "arguments": {"a": "}"}}')
    assert events == [("name", "f"), ("args", '{"a": "}"}')] and scanner.first_key == "name"
    bad = CallScanner()
    bad.feed('{"name": 12}')
    assert bad.failed


def test_special_token_markers_survive_decoding(byte_level_tokenizer):
    tokenizer = byte_level_tokenizer
    tokenizer.add_special_tokens({"additional_special_tokens": ["[TOOL_CALLS]"]})
    ids = tokenizer.encode("[TOOL_CALLS]", add_special_tokens=False) + tokenizer.encode("Paris", add_special_tokens=False)
    ids += [tokenizer.eos_token_id]
    decode = keep_markers_decoder(tokenizer, ("[TOOL_CALLS]",))
    assert decode(ids) == "[TOOL_CALLS]Paris"  # the end token still dropped
    assert keep_markers_decoder(tokenizer, ("<tool_call>",)) is None  # not a special token: plain decoding


FRAGMENTS = ["<tool_call>", "</tool_call>", "[TOOL_CALLS]", "<|python_tag|>", "{", "}", "[", "]", '"', "\\", ":", ",",
             ";", " ", "\n", '"name"', '"arguments"', '"parameters"', '"f"', "1", "null", "text", "<tool", "[TOOL"]


@pytest.mark.parametrize("name", ["hermes", "llama3_json", "mistral", "array"])
def test_any_text_streams_as_its_unary_parse(name):
    """Fuzz: text made of the formats' pieces, cut anywhere, never fails and streams as it parses."""
    from hypothesis import given, settings, strategies as st

    make = ArrayParser if name == "array" else get_parser(name)

    @settings(max_examples=150, deadline=None, derandomize=True)
    @given(st.lists(st.sampled_from(FRAGMENTS), max_size=24), st.lists(st.integers(0, 200), max_size=6))
    def check(fragments, cut_points):
        text = "".join(fragments)
        cuts = sorted({c for c in cut_points if 0 < c < len(text)})
        unary = make().parse(text)
        assert without_ids(joined(streamed(make(), text, cuts))) == without_ids(unary)
        if not unary.tool_calls:  # no call: the text is the content, exactly
            assert unary.content == text
    check()
