"""Tool-call parsers on canned model outputs (Hermes/Qwen, Llama 3 JSON, Mistral, and the arrays
``tool_choice: "required"`` enforces): content and calls, unary and streamed with the text cut
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
    return delta.content, [(c["function"]["name"], c["function"]["arguments"], c["type"])
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
]


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


def test_parser_registry_and_template_detection():
    assert sorted(PARSERS) == ["hermes", "llama3_json", "mistral"]
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


@pytest.mark.parametrize("name", sorted(PARSERS) + ["array"])
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
