"""Function tools on the request side: ``tools``, ``tool_choice`` and ``parallel_tool_calls``
validated (400 naming the field), the guide that enforces ``required`` and a named function,
the history messages that carry calls and their results, and what a chat template that knows
nothing of tools is given instead (Hermes-style text).

    tool_choice "none"      the model is not shown the tools; plain content
    tool_choice "auto"      (the default with tools) the model is shown them and writes freely;
                            its text is parsed for calls (openai_frontend/tool_parsers/)
    tool_choice "required"  enforced: the output is a JSON array of {"name", "parameters"}
                            calls (guides.required_calls_schema), read by ArrayParser
    {"type": "function", "function": {"name": N}}
                            enforced: the output is N's arguments object (its parameters schema)
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from openai_frontend.errors import bad_request
from openai_frontend.guides import Guide, named_function_schema, required_calls_schema

FUNCTION_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names
TOOL_CHOICES = ("none", "auto", "required")
EMPTY_PARAMETERS = {"type": "object", "properties": {}}


@dataclass
class ToolRequest:
    tools: list[dict]  # [{"type": "function", "function": {"name", "description"?, "parameters"}}]
    choice: str  # "none" | "auto" | "required" | "function" (the one named in ``function``)
    function: str | None = None
    parallel: bool = True  # parallel_tool_calls

    @property
    def shown(self) -> list[dict] | None:
        """The tools the chat template gets (none for ``tool_choice: "none"``)."""
        return None if self.choice == "none" else self.tools

    @property
    def enforced(self) -> bool:
        return self.choice in ("required", "function")

    def guide(self) -> Guide | None:
        """The guide that enforces ``required`` or a named function (errors name ``tools``: it
        is built from their parameters schemas)."""
        if self.choice == "function":
            tool = next(t for t in self.tools if t["function"]["name"] == self.function)
            return Guide("json_schema", named_function_schema(tool["function"]["parameters"]), "tools")
        if self.choice == "required":
            return Guide("json_schema", required_calls_schema(self.tools, self.parallel), "tools")
        return None


def parse_tools(body: dict) -> ToolRequest | None:
    """``tools``, ``tool_choice`` and ``parallel_tool_calls`` of a chat request; None without tools."""
    tools, choice, parallel = body.get("tools"), body.get("tool_choice"), body.get("parallel_tool_calls")
    if parallel is not None and not isinstance(parallel, bool):
        raise bad_request("parallel_tool_calls", f"parallel_tool_calls must be true or false; got {parallel!r}")
    if tools is not None and not isinstance(tools, list):
        raise bad_request("tools", f"tools must be a list of function tools; got {tools!r}")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice", "tool_choice is only allowed when tools are given; send tools with it "
                                             "or leave tool_choice out")
        return None
    normalized = [_tool(tool, f"tools[{i}]") for i, tool in enumerate(tools)]
    names = [tool["function"]["name"] for tool in normalized]
    for i, name in enumerate(names):
        if name in names[:i]:
            raise bad_request(f"tools[{i}].function.name", f"tools[{i}].function.name: {name!r} is given twice; "
                                                           "function names must be unique")
    request = ToolRequest(normalized, "auto", parallel=True if parallel is None else parallel)
    if choice is None or choice in TOOL_CHOICES:
        request.choice = choice or "auto"
    elif (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("function"), dict)
          and isinstance(choice["function"].get("name"), str)):
        name = choice["function"]["name"]
        if name not in names:
            raise bad_request("tool_choice", f"tool_choice names the function {name!r}, which is not among the tools "
                                             f"({', '.join(names)})")
        request.choice, request.function = "function", name
    else:
        raise bad_request("tool_choice", 'tool_choice must be "none", "auto", "required" or {"type": "function", '
                                         f'"function": {{"name": ...}}}}; got {choice!r}')
    return request


def _tool(tool: Any, where: str) -> dict:
    if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
        raise bad_request(where, f'{where} must be {{"type": "function", "function": {{"name", "description", '
                                 f'"parameters"}}}} (only function tools are supported); got {tool!r}')
    function = tool["function"]
    name = function.get("name")
    if not isinstance(name, str) or not FUNCTION_NAME.match(name):
        raise bad_request(f"{where}.function.name", f"{where}.function.name must be 1-64 letters, digits, '_' or '-'; "
                                                    f"got {name!r}")
    description = function.get("description")
    if description is not None and not isinstance(description, str):
        raise bad_request(f"{where}.function.description", f"{where}.function.description must be a string")
    parameters = function.get("parameters")
    if parameters is None:
        parameters = dict(EMPTY_PARAMETERS)  # OpenAI: no parameters is an empty parameter list
    if not isinstance(parameters, dict) or parameters.get("type", "object") != "object":
        raise bad_request(f"{where}.function.parameters", f"{where}.function.parameters must be a JSON Schema of an "
                                                          f'object ({{"type": "object", "properties": ...}}); got '
                                                          f"{parameters!r}")
    strict = function.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise bad_request(f"{where}.function.strict", f"{where}.function.strict must be true or false")
    out = {"name": name, "parameters": parameters}
    if description is not None:
        out["description"] = description
    return {"type": "function", "function": out}


# ----------------------------------------------------------------------------- history messages

def tool_calls_of(value: Any, where: str) -> list[dict]:
    """An assistant message's ``tool_calls``: [{id, type: "function", function: {name, arguments}}]."""
    if not isinstance(value, list) or not value:
        raise bad_request(where, f"{where} must be a non-empty list of "
                                 '{"id", "type": "function", "function": {"name", "arguments"}} objects')
    calls = []
    for j, call in enumerate(value):
        at = f"{where}[{j}]"
        function = call.get("function") if isinstance(call, dict) else None
        if (not isinstance(function, dict) or call.get("type", "function") != "function"
                or not isinstance(function.get("name"), str) or not isinstance(call.get("id"), str)):
            raise bad_request(at, f'{at} must be {{"id": str, "type": "function", "function": {{"name": str, '
                                  f'"arguments": str}}}}; got {call!r}')
        arguments = function.get("arguments", "{}")
        if not isinstance(arguments, str):
            raise bad_request(f"{at}.function.arguments", f"{at}.function.arguments must be a JSON string")
        calls.append({"id": call["id"], "type": "function",
                      "function": {"name": function["name"], "arguments": arguments}})
    return calls


def for_template(message: dict) -> dict:
    """A message as chat templates read calls: ``arguments`` as an object (Qwen's and Llama's
    templates write it with ``tojson``; a JSON string would come out quoted), content "" rather
    than null."""
    if "tool_calls" not in message:
        return message
    calls = []
    for call in message["tool_calls"]:
        try:
            arguments = json.loads(call["function"]["arguments"])
        except ValueError:
            arguments = call["function"]["arguments"]
        calls.append({**call, "function": {"name": call["function"]["name"], "arguments": arguments}})
    return {**message, "content": message.get("content") or "", "tool_calls": calls}


# ----------------------------------------------------------------------------- templates without tools

TOOLS_PROMPT = ("# Tools\n\nYou may call one or more functions to assist with the user query.\n\n"
                "You are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{tools}\n"
                "</tools>\n\n{instructions}")


def tools_system_prompt(tools: list[dict], instructions: str) -> str:
    """The Hermes (Qwen 2.5) tools section of the system prompt, with the parser's format."""
    listed = "\n".join(json.dumps(tool, ensure_ascii=False) for tool in tools)
    return TOOLS_PROMPT.format(tools=listed, instructions=instructions)


def with_tools_system_prompt(messages: list[dict], tools: list[dict], instructions: str) -> list[dict]:
    """For a template that ignores ``tools`` (SmolLM2's ChatML template does): the tools go into
    the system message, Hermes-style, so the model sees them (after the caller's own system
    message when there is one)."""
    prompt = tools_system_prompt(tools, instructions)
    if messages and messages[0]["role"] == "system":
        return [{**messages[0], "content": f"{messages[0]['content']}\n\n{prompt}"}] + messages[1:]
    return [{"role": "system", "content": prompt}] + messages


def history_as_text(messages: list[dict], format_call) -> list[dict]:
    """For a template that knows nothing of calls: an assistant message's calls become its text,
    as the model writes them (``format_call(name, arguments)``), and tool results become a user
    message of ``<tool_response>`` blocks (consecutive results in one message, as Qwen's
    template writes them)."""
    out: list[dict] = []
    for message in messages:
        if message["role"] == "assistant" and message.get("tool_calls"):
            calls = "\n".join(format_call(c["function"]["name"], c["function"]["arguments"] or "{}")
                              for c in message["tool_calls"])
            content = message.get("content") or ""
            out.append({"role": "assistant", "content": f"{content}\n{calls}" if content else calls})
        elif message["role"] == "tool":
            block = f"<tool_response>\n{message['content']}\n</tool_response>"
            if out and out[-1].get("tool_results"):
                out[-1] = {**out[-1], "content": out[-1]["content"] + "\n" + block}
            else:
                out.append({"role": "user", "content": block, "tool_results": True})
        else:
            out.append({k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")})
    return [{k: v for k, v in message.items() if k != "tool_results"} for message in out]


def one_call_per_message(messages: list[dict]) -> list[dict]:
    """History for harmony's chat templates: gpt-oss's writes one call per assistant message (its first)
    and names each tool result after the last call it wrote. So an assistant message with several calls
    becomes one message per call, each followed by its result (the tool message with the call's id; a
    result with no such call stays where it was), and a call message's ``reasoning_content`` without
    content becomes ``thinking``, the analysis that template writes before the call."""
    results = {m["tool_call_id"]: m for m in messages if m["role"] == "tool" and m.get("tool_call_id")}
    placed: set[int] = set()  # the tool messages written (by id())
    out: list[dict] = []
    for message in messages:
        calls = message.get("tool_calls") if message["role"] == "assistant" else None
        if message["role"] == "tool":
            if id(message) not in placed:
                placed.add(id(message))
                out.append(message)
            continue
        if not calls:
            out.append(message)
            continue
        for i, call in enumerate(calls):
            part = {**message, "tool_calls": [call]}
            if i:  # the message's text goes with its first call
                part["content"] = ""
                part.pop("reasoning_content", None)
            elif part.get("reasoning_content") and not part.get("content"):
                part["thinking"] = part["reasoning_content"]
            out.append(part)
            result = results.get(call["id"])
            if result is not None and id(result) not in placed:
                placed.add(id(result))
                out.append(result)
    return out
