"""Tools on `/v1/chat/completions`: the request's `tools`, `tool_choice` and `parallel_tool_calls`
checked, the tools handed to the chat template, and the constraint that makes a forced call parse.

`plan(body, template)` reads the request and returns a `ToolPlan`:

* the keyword arguments the template is rendered with (`tools`, as transformers passes them: the
  request's list of `{"type": "function", "function": {...}}` objects, as given);
* the format the answer's calls are parsed in (`jaxattn.serving.api.tool_calls`, chosen by the
  template's source), or None when the answer is never parsed (`tool_choice: "none"`, or no tools);
* with `tool_choice: "required"` or a named function, a `Guide` that holds the answer to that format
  with each function's JSON schema for its arguments: a Lark grammar (llguidance's dialect, each call's
  object a `%json` schema) for a tagged format, a JSON schema for a bare one, so the calls always parse.
  "required" allows several calls with `parallel_tool_calls` (a tagged format only), a named function
  exactly one. A forced call with a structured output (`response_format`, `guided_*`) is a 400: one
  constraint per answer.

A template whose source never reads `tools` cannot show them to the model: a 400 (param "tools"),
unless `tool_choice` is "none" (the tools are then left out). With "none" the tools are rendered, as
vLLM renders them by default, and the answer is plain content.

`messages(body)` gives the messages as the template receives them: an assistant message's
`tool_calls[].function.arguments`, a JSON string in the OpenAI API, is parsed into the object
templates expect (as vLLM does), and its missing content is "".
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

from jaxattn.hf.chat_template import ChatTemplate
from jaxattn.serving.api.protocol import ChatRequest, bad_request, guide_of
from jaxattn.serving.api.tool_calls import ToolCallFormat, format_of
from jaxattn.serving.guides import Guide
from jaxattn.serving.structured import JSON_OPTIONS


@dataclasses.dataclass(frozen=True)
class ToolPlan:
    """What the tools change in a chat request (see the module docstring)."""

    render: dict[str, Any]
    parse: ToolCallFormat | None = None
    guide: Guide | None = None


def plan(body: ChatRequest, template: ChatTemplate) -> ToolPlan:
    """The request's `ToolPlan`; a 400 naming the field for bad tools or a bad `tool_choice`."""
    tools = checked_tools(body.tools or [])
    choice = checked_choice(body.tool_choice, tools)
    if not tools:
        return ToolPlan({})
    takes_tools = template.reads("tools")
    if not takes_tools:
        if choice == "none":
            return ToolPlan({})
        raise bad_request("this model's chat template does not take tools (its source never reads `tools`): "
                          "it cannot show them to the model", "tools", code="tools_not_supported")
    render = {"tools": tools}
    if choice == "none":
        return ToolPlan(render)
    fmt = format_of(template.source)
    if choice == "auto":
        return ToolPlan(render, fmt)
    field = guide_of(body)[0] if isinstance(body, ChatRequest) else None
    if field is not None:
        raise bad_request(f"tool_choice {choice!r} and {field} both constrain the answer: give one of them",
                          "tool_choice")
    named = [t for t in tools if t["function"]["name"] == choice] if choice != "required" else tools
    several = choice == "required" and body.parallel_tool_calls is not False and fmt.open != ""
    return ToolPlan(render, fmt, call_guide(fmt, [t["function"] for t in named], several=several))


def checked_tools(tools: list) -> list[dict]:
    """The tools, each `{"type": "function", "function": {"name": str, "parameters": object, ...}}`."""
    names = set()
    for i, tool in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function" or not isinstance(tool.get("function"), dict):
            raise bad_request(f'{where} must be {{"type": "function", "function": {{...}}}}', where)
        function = tool["function"]
        if not isinstance(function.get("name"), str) or not function["name"]:
            raise bad_request(f"{where}.function.name must be a non-empty string", f"{where}.function.name")
        if function["name"] in names:
            raise bad_request(f"{where}.function.name {function['name']!r} is given twice", f"{where}.function.name")
        names.add(function["name"])
        if not isinstance(function.get("parameters", {}), dict):
            raise bad_request(f"{where}.function.parameters must be a JSON schema object",
                              f"{where}.function.parameters")
    return tools


def checked_choice(choice: Any, tools: list[dict]) -> str:
    """"none", "auto", "required" or the named function's name; OpenAI's default: "auto" with tools."""
    if choice is None:
        return "auto" if tools else "none"
    if isinstance(choice, str):
        if choice not in ("none", "auto", "required"):
            raise bad_request(f'tool_choice must be "none", "auto", "required" or a function, got {choice!r}',
                              "tool_choice")
        if choice != "none" and not tools:
            raise bad_request(f'tool_choice {choice!r} needs tools', "tool_choice")
        return choice
    function = choice.get("function") if isinstance(choice, dict) else None
    name = function.get("name") if isinstance(function, dict) else None
    if not (isinstance(choice, dict) and choice.get("type") == "function" and isinstance(name, str)):
        raise bad_request('tool_choice must be "none", "auto", "required" or {"type": "function", '
                          '"function": {"name": ...}}', "tool_choice")
    if name not in {t["function"]["name"] for t in tools}:
        raise bad_request(f"tool_choice names the function {name!r}, which is not among the tools", "tool_choice")
    return name


def call_schema(fmt: ToolCallFormat, function: dict) -> dict:
    """The JSON schema of one call of `function` in `fmt`: its name, then its arguments."""
    arguments = function.get("parameters") or {"type": "object", "properties": {}}
    return {"type": "object", "properties": {"name": {"const": function["name"]}, fmt.arguments_key: arguments},
            "required": ["name", fmt.arguments_key], "additionalProperties": False}


def call_guide(fmt: ToolCallFormat, functions: list[dict], *, several: bool) -> Guide:
    """A guide to one call (or, with `several`, one or more) of one of `functions`, written in `fmt`."""
    schemas = [call_schema(fmt, f) for f in functions]
    schema = schemas[0] if len(schemas) == 1 else {"anyOf": schemas}
    schema = {**schema, "x-guidance": JSON_OPTIONS}  # compact, as structured outputs and `tojson` write JSON
    if fmt.open == "":
        return Guide("json_schema", json.dumps(schema))
    call = f"{json.dumps(fmt.open)} %json {json.dumps(schema)} {json.dumps(fmt.close)}"
    start = f"call ({json.dumps(fmt.separator)} call)*" if several else "call"
    return Guide("lark", f"start: {start}\ncall: {call}\n")


def messages(body: ChatRequest) -> list[dict]:
    """The messages as the template receives them (see the module docstring)."""
    out = []
    for i, message in enumerate(body.plain_messages()):
        calls = message.get("tool_calls")
        if calls is not None:
            message = {**message, "content": message.get("content", ""),
                       "tool_calls": [_template_call(call, f"messages[{i}].tool_calls[{j}]")
                                      for j, call in enumerate(calls)]}
        out.append(message)
    return out


def _template_call(call: Any, where: str) -> dict:
    """An assistant's call with its arguments as an object (the API sends them as a JSON string)."""
    function = call.get("function") if isinstance(call, dict) else None
    if not isinstance(function, dict) or not isinstance(function.get("name"), str):
        raise bad_request(f'{where} must be {{"type": "function", "function": {{"name": ..., "arguments": ...}}}}',
                          where)
    arguments = function.get("arguments", {})
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments) if arguments.strip() else {}
        except json.JSONDecodeError:
            raise bad_request(f"{where}.function.arguments is not JSON", f"{where}.function.arguments") from None
    return {**call, "function": {**function, "arguments": arguments}}
