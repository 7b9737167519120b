"""Structured output: the request fields that constrain what the model may write, as the one
guide the engine takes (``tensorrt_llm``'s inputs ``guided_decoding_guide_type`` and
``guided_decoding_guide``; the engine compiles it with xgrammar).

    response_format {"type": "json_object"}                      -> json_schema {"type": "object"}
    response_format {"type": "json_schema", "json_schema": {...}} -> json_schema (the schema's JSON)
    guided_json (vLLM; an object or its JSON text)                -> json_schema
    guided_regex (vLLM)                                           -> regex
    guided_grammar (vLLM; xgrammar's EBNF)                        -> ebnf_grammar
    guided_choice (vLLM; a list of strings)                       -> ebnf_grammar: one literal of them
    tool_choice "required" / a named function (tools.py)          -> json_schema built from the tools

``json_object`` is not the engine's ``json`` guide type: that one allows any JSON value (SmolLM2
answered ``"Paris"``, a string), while OpenAI promises an object; ``{"type": "object"}`` is any
object (additional properties stay allowed in the engine's strict mode when the schema names no
properties).

One guide per request: two of these together are a 400 naming them. Whether a schema, regex or
grammar is valid is the engine's to say (the same compiler then runs it): its error names
``guided_decoding_guide`` and comes back as a 400 naming the field the guide came from
(triton_client.triton_error). The text is built here in plain Python.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import bad_request

GUIDE_FIELDS = ("response_format", "guided_json", "guided_regex", "guided_grammar", "guided_choice")
RESPONSE_FORMAT_TYPES = ("text", "json_object", "json_schema")
ANY_OBJECT = '{"type": "object"}'
SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for json_schema.name


@dataclass(frozen=True)
class Guide:
    type: str  # json | json_schema | regex | ebnf_grammar | structural_tag
    text: str | None  # the schema / regex / grammar; None for json
    field: str  # the request field it came from: errors about it name this field


def parse_guide(body: dict) -> Guide | None:
    """The guide of a request body's structured-output fields; 400 naming the field for a bad
    one, or naming both when two are sent."""
    guides = [guide for guide in (_response_format(body.get("response_format")),
                                  _guided_json(body.get("guided_json")),
                                  _text_field(body, "guided_regex", "regex"),
                                  _text_field(body, "guided_grammar", "ebnf_grammar"),
                                  _guided_choice(body.get("guided_choice"))) if guide is not None]
    if len(guides) > 1:
        names = ", ".join(guide.field for guide in guides)
        raise bad_request(guides[1].field, f"{names}: each of these constrains the output and only one may be "
                                           "sent per request; send one of them", code="conflicting_parameters")
    return guides[0] if guides else None


def one_guide(first: Guide | None, second: Guide | None, second_name: str) -> Guide | None:
    """``first`` or ``second``; both is a 400 naming them (``second_name`` says what ``second`` is)."""
    if first is not None and second is not None:
        raise bad_request(first.field, f"{first.field} and {second_name} each constrain the output and only one may "
                                       f"be sent per request; send one of them", code="conflicting_parameters")
    return first or second


def _response_format(value: Any) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, dict) or value.get("type") not in RESPONSE_FORMAT_TYPES:
        kind = value.get("type") if isinstance(value, dict) else value
        raise bad_request("response_format", f"response_format must be an object whose type is one of "
                                             f"{', '.join(RESPONSE_FORMAT_TYPES)}; got {kind!r}")
    kind = value["type"]
    if kind == "text":
        return None
    if kind == "json_object":
        return Guide("json_schema", ANY_OBJECT, "response_format")
    spec = value.get("json_schema")
    where = "response_format.json_schema"
    if not isinstance(spec, dict):
        raise bad_request(where, f"{where} must be an object with name and schema (and optionally strict, "
                                 f"description); got {spec!r}")
    name = spec.get("name")
    if not isinstance(name, str) or not SCHEMA_NAME.match(name):
        raise bad_request(f"{where}.name", f"{where}.name must be 1-64 letters, digits, '_' or '-'; got {name!r}")
    strict = spec.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.strict", f"{where}.strict must be true or false; got {strict!r}")
    schema = spec.get("schema")
    if schema is None:  # OpenAI's schema is optional: then any JSON object
        return Guide("json_schema", ANY_OBJECT, "response_format")
    if not isinstance(schema, dict):
        raise bad_request(f"{where}.schema", f"{where}.schema must be a JSON Schema object; got {schema!r}")
    # Strict or not, the schema is enforced (as vLLM does): the output always validates.
    return Guide("json_schema", json.dumps(schema, ensure_ascii=False), "response_format")


def _guided_json(value: Any) -> Guide | None:
    if value is None:
        return None
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except ValueError as error:
            raise bad_request("guided_json", f"guided_json is not valid JSON: {error}") from None
    if not isinstance(value, dict):
        raise bad_request("guided_json", "guided_json must be a JSON Schema (an object, or its JSON text)")
    return Guide("json_schema", json.dumps(value, ensure_ascii=False), "guided_json")


def _text_field(body: dict, name: str, guide_type: str) -> Guide | None:
    value = body.get(name)
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise bad_request(name, f"{name} must be a non-empty string; got {value!r}")
    return Guide(guide_type, value, name)


def _guided_choice(value: Any) -> Guide | None:
    if value is None:
        return None
    if not isinstance(value, list) or not value or not all(isinstance(choice, str) for choice in value):
        raise bad_request("guided_choice", f"guided_choice must be a non-empty list of strings; got {value!r}")
    return Guide("ebnf_grammar", choice_grammar(value), "guided_choice")


def choice_grammar(choices: list[str]) -> str:
    """An EBNF grammar (xgrammar's) whose root is exactly one of ``choices``: each a string
    literal, escaped as JSON escapes a string (xgrammar's literals read the same escapes)."""
    unique = list(dict.fromkeys(choices))
    return "root ::= " + " | ".join(json.dumps(choice, ensure_ascii=False) for choice in unique)


# ----------------------------------------------------------------------------- tool calls

def named_function_schema(parameters: dict) -> str:
    """``tool_choice`` naming a function: the output is a JSON object of its parameters."""
    return json.dumps(parameters, ensure_ascii=False)


def required_calls_schema(tools: list[dict], parallel: bool) -> str:
    """``tool_choice: "required"``: a JSON array of ``{"name": <const>, "parameters": <schema>}``,
    any of the tools (vLLM's shape), at least one call, at most one unless parallel calls are
    allowed. Each tool's ``$defs``/``definitions`` move to the root (a ``#/$defs/...`` reference
    would otherwise point at the wrong document); names two tools share are prefixed."""
    root_defs: dict[str, Any] = {}
    options = []
    for tool in tools:
        function = tool["function"]
        parameters = _hoist_definitions(function["parameters"], function["name"], root_defs)
        options.append({"type": "object",
                        "properties": {"name": {"const": function["name"]}, "parameters": parameters},
                        "required": ["name", "parameters"]})
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": options[0] if len(options) == 1 else {"anyOf": options}}
    if not parallel:
        schema["maxItems"] = 1
    if root_defs:
        schema["$defs"] = root_defs
    return json.dumps(schema, ensure_ascii=False)


def _hoist_definitions(parameters: dict, tool_name: str, root_defs: dict) -> dict:
    found = {key: parameters[key] for key in ("$defs", "definitions") if isinstance(parameters.get(key), dict)}
    if not found:
        return parameters
    renames: dict[str, str] = {}
    for key, definitions in found.items():
        for name in definitions:
            new = name if name not in root_defs and name not in renames.values() else f"{tool_name}__{name}"
            renames[f"#/{key}/{name}"] = f"#/$defs/{new}"
    parameters = _rewrite_refs({k: v for k, v in parameters.items() if k not in found}, renames)
    for key, definitions in found.items():
        for name, definition in definitions.items():
            root_defs[renames[f"#/{key}/{name}"].rsplit("/", 1)[1]] = _rewrite_refs(definition, renames)
    return parameters


def _rewrite_refs(node: Any, renames: dict[str, str]) -> Any:
    if isinstance(node, dict):
        out = {}
        for key, value in node.items():
            if key == "$ref" and isinstance(value, str):
                prefix = next((old for old in renames if value == old or value.startswith(old + "/")), None)
                out[key] = renames[prefix] + value[len(prefix):] if prefix else value
            else:
                out[key] = _rewrite_refs(value, renames)
        return out
    if isinstance(node, list):
        return [_rewrite_refs(item, renames) for item in node]
    return node
