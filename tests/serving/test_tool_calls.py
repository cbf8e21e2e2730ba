"""Tools without a server: the tool-call parsers on texts (`jaxattn.serving.api.tool_calls`), the request's
tools read and their forced-call guides (`jaxattn.serving.api.tools`), and a Hermes/Qwen 2.5 template
with tools rendered as transformers renders it.

A guide is checked by llguidance itself: random walks through its token masks over a character
vocabulary always end in text the parser reads back as calls whose arguments validate against the
function's schema (`jsonschema`).
"""

import json
import random

import jsonschema
import numpy as np
import pytest

from jaxattn.hf.chat_template import ChatTemplate
from jaxattn.serving.api import protocol
from jaxattn.serving.api.protocol import APIError, ChatRequest
from jaxattn.serving.api.tool_calls import (HERMES, JSON, JSON_PARAMETERS, Arguments, CallStart, Content,
                                            ToolCallParser, collect, format_of, parse_whole)
from jaxattn.serving.api.tools import messages, plan

llguidance = pytest.importorskip("llguidance")
transformers_utils = pytest.importorskip("transformers.utils.chat_template_utils")
TokenizerWrapper = pytest.importorskip("llguidance._tokenizer").TokenizerWrapper

# Qwen 2.5's chat template (its tool parts), as the model's tokenizer_config.json has it.
QWEN25 = """{%- if tools %}
    {{- '<|im_start|>system\\n' }}
    {%- if messages[0]['role'] == 'system' %}
        {{- messages[0]['content'] }}
    {%- else %}
        {{- 'You are a helpful assistant.' }}
    {%- endif %}
    {{- "\\n\\n# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>" }}
    {%- for tool in tools %}
        {{- "\\n" }}
        {{- tool | tojson }}
    {%- endfor %}
    {{- "\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\\"name\\": <function-name>, \\"arguments\\": <args-json-object>}\\n</tool_call><|im_end|>\\n" }}
{%- else %}
    {%- if messages[0]['role'] == 'system' %}
        {{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}
    {%- endif %}
{%- endif %}
{%- for message in messages %}
    {%- if (message.role == "user") or (message.role == "system" and not loop.first) or (message.role == "assistant" and not message.tool_calls) %}
        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>' + '\\n' }}
    {%- elif message.role == "assistant" %}
        {{- '<|im_start|>' + message.role }}
        {%- if message.content %}
            {{- '\\n' + message.content }}
        {%- endif %}
        {%- for tool_call in message.tool_calls %}
            {%- if tool_call.function is defined %}
                {%- set tool_call = tool_call.function %}
            {%- endif %}
            {{- '\\n<tool_call>\\n{"name": "' }}
            {{- tool_call.name }}
            {{- '", "arguments": ' }}
            {{- tool_call.arguments | tojson }}
            {{- '}\\n</tool_call>' }}
        {%- endfor %}
        {{- '<|im_end|>\\n' }}
    {%- elif message.role == "tool" %}
        {%- if (loop.index0 == 0) or (messages[loop.index0 - 1].role != "tool") %}
            {{- '<|im_start|>user' }}
        {%- endif %}
        {{- '\\n<tool_response>\\n' }}
        {{- message.content }}
        {{- '\\n</tool_response>' }}
        {%- if loop.last or (messages[loop.index0 + 1].role != "tool") %}
            {{- '<|im_end|>\\n' }}
        {%- endif %}
    {%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
    {{- '<|im_start|>assistant\\n' }}
{%- endif %}
"""
# Llama 3.1's way: a bare JSON object with "parameters" (the template's words, shortened).
LLAMA31_LIKE = ('{% if tools %}Respond in the format {"name": function name, "parameters": dictionary of argument '
                'name and its value}.{% for t in tools %}{{ t | tojson }}{% endfor %}{% endif %}'
                '{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:')
PLAIN = "{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}assistant:"

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "enum": ["Paris", "Rome", "Oslo"]},
                                                   "unit": {"enum": ["c", "f"]}, "days": {"type": "integer",
                                                                                          "minimum": 1, "maximum": 7}},
                   "required": ["city", "days"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {"name": "get_time", "parameters": {
    "type": "object", "properties": {"zone": {"enum": ["utc", "cet"]}, "exact": {"type": "boolean"}},
    "required": ["zone", "exact"], "additionalProperties": False}}}
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}

HISTORY = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Weather in Paris and the time?"},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "get_weather", "arguments": '{"city": "Paris", "days": 1}'}},
        {"id": "call_2", "type": "function", "function": {"name": "get_time", "arguments": '{"zone": "cet"}'}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    {"role": "tool", "tool_call_id": "call_2", "content": "12:00"},
]

TEXTS = {
    "content then two calls": ('I will look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa\\"ris}",'
                               ' "days": [1, {"a": "}"}]}}\n</tool_call>\n<tool_call>\n{"name": "get_time", '
                               '"arguments": {}}\n</tool_call>\n'),
    "name after arguments": '<tool_call>{"arguments": {"x": 1.5e3}, "name": "f"}</tool_call>',
    "no call": "Plain words, no <b>tags</b>, a < sign and <tool_ at the end",
    "an unnamed block": "<tool_call>\nnot JSON\n</tool_call> after",
}


def request(**fields) -> ChatRequest:
    return protocol.parse(ChatRequest, {"model": "m", "messages": HISTORY[:2], **fields})


def pieces(text: str, sizes: list[int]):
    at = 0
    while at < len(text):
        size = sizes[at % len(sizes)]
        yield text[at:at + size]
        at += size


# -- the parsers -----------------------------------------------------------------------------------


def test_hermes_calls_are_read_with_the_content_outside_them():
    content, calls = parse_whole(HERMES, TEXTS["content then two calls"])
    assert content == "I will look."
    assert [c.name for c in calls] == ["get_weather", "get_time"]
    assert json.loads(calls[0].arguments) == {"city": 'Pa"ris}', "days": [1, {"a": "}"}]}
    assert calls[1].arguments == "{}"
    assert parse_whole(HERMES, TEXTS["name after arguments"])[1][0].arguments == '{"x": 1.5e3}'
    assert parse_whole(HERMES, TEXTS["no call"]) == (TEXTS["no call"], [])
    assert parse_whole(HERMES, TEXTS["an unnamed block"]) == ("<tool_call>\nnot JSON\n</tool_call> after", [])


@pytest.mark.parametrize("name", sorted(TEXTS))
def test_any_streaming_of_a_text_gives_the_whole_texts_events(name):
    """Fed in pieces of 1, 2, 3, 5 or 7 characters, the events joined are those of the whole text; the
    arguments come in pieces after their call's start."""
    text = TEXTS[name]
    whole = parse_whole(HERMES, text)
    for sizes in ([1], [2], [3, 5], [7, 1]):
        parser = ToolCallParser(HERMES)
        events = [e for piece in pieces(text, sizes) for e in parser.feed(piece)] + parser.finish()
        assert collect(events) == whole, sizes
        started = set()
        for event in events:
            if isinstance(event, CallStart):
                started.add(event.index)
            elif isinstance(event, Arguments):
                assert event.index in started
    one_by_one = ToolCallParser(HERMES)
    events = [e for c in TEXTS["content then two calls"] for e in one_by_one.feed(c)]
    assert sum(isinstance(e, Arguments) for e in events) > 10  # arguments stream as they come


def test_bare_json_calls_are_read_whole_and_anything_else_is_content():
    assert parse_whole(JSON, ' {"name": "f", "parameters": {"x": 1}}')[1][0].arguments == '{"x": 1}'
    content, calls = parse_whole(JSON, '[{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]')
    assert content == "" and [(c.name, c.arguments) for c in calls] == [("f", '{"x": 1}'), ("g", "{}")]
    for text in ('{"a": 1}', '{"name": "f"}', "Hello {", '{"name": "f", "arguments": {}, "x": 2}'):
        assert parse_whole(JSON, text) == (text, [])
    parser = ToolCallParser(JSON)
    assert parser.feed("Hi") == [Content("Hi")] and parser.feed(" {") == [Content(" {")]


def test_the_format_is_chosen_by_the_templates_source():
    assert format_of(QWEN25) is HERMES
    assert format_of(LLAMA31_LIKE) is JSON_PARAMETERS
    assert format_of("{{ tools | tojson }}") is JSON


# -- the request's tools ---------------------------------------------------------------------------


def test_a_template_with_tools_renders_what_transformers_renders():
    """Tools, an assistant's parallel calls (arguments sent as JSON strings) and two tool results."""
    template = ChatTemplate(QWEN25)
    body = protocol.parse(ChatRequest, {"model": "m", "messages": HISTORY, "tools": [WEATHER, TIME]})
    ours = template.render(messages(body), add_generation_prompt=True, **plan(body, template).render)
    given = [dict(m) for m in HISTORY]
    given[2] = {**given[2], "content": "", "tool_calls": [
        {**c, "function": {**c["function"], "arguments": json.loads(c["function"]["arguments"])}}
        for c in given[2]["tool_calls"]]}
    theirs, _ = transformers_utils.render_jinja_template([given], tools=[WEATHER, TIME], chat_template=QWEN25,
                                                         add_generation_prompt=True)
    assert ours == theirs[0]
    assert '<tool_call>\n{"name": "get_time", "arguments": {"zone": "cet"}}\n</tool_call>' in ours
    assert "<tool_response>\nsunny\n</tool_response>\n<tool_response>\n12:00" in ours


def test_tools_and_tool_choice_are_checked():
    template = ChatTemplate(QWEN25)
    cases = {"tools": dict(tools=[WEATHER], tool_choice=None), "tools[0]": dict(tools=[{"type": "code"}]),
             "tools[1].function.name": dict(tools=[WEATHER, WEATHER]),
             "tools[0].function.parameters": dict(tools=[{"type": "function", "function": {"name": "f",
                                                                                          "parameters": [1]}}]),
             "tool_choice": dict(tools=[WEATHER], tool_choice="sometimes")}
    for param, fields in cases.items():
        with pytest.raises(APIError) as err:
            plan(request(**fields), ChatTemplate(PLAIN) if param == "tools" else template)
        assert err.value.status == 400 and err.value.param == param
    for choice in ({"type": "function", "function": {"name": "nope"}}, "required", {"type": "function"}):
        with pytest.raises(APIError, match="tool_choice"):
            plan(request(tools=[WEATHER] if choice != "required" else None, tool_choice=choice), template)
    assert plan(request(tools=[WEATHER], tool_choice="none"), ChatTemplate(PLAIN)).render == {}
    assert plan(request(tools=[WEATHER], tool_choice="none"), template).parse is None
    auto = plan(request(tools=[WEATHER]), template)
    assert auto.parse is HERMES and auto.guide is None and auto.render == {"tools": [WEATHER]}


# -- forced calls: the guides ----------------------------------------------------------------------

CHARS = "\n" + "".join(chr(c) for c in range(32, 127))


class CharTokenizer:
    """A character vocabulary for llguidance (one token per character, and an end-of-sequence token)."""

    eos_token_id = len(CHARS)
    bos_token_id = None
    tokens = [c.encode() for c in CHARS] + [b"</s>"]
    special_token_ids = [len(CHARS)]

    def __call__(self, text):
        return [CHARS.index(c) for c in (text.decode() if isinstance(text, bytes) else text)]


def walk(guide, seed: int, limit: int = 2000) -> str:
    """A random text the guide allows: each step a random allowed token, until only the end is left."""
    tokenizer = llguidance.LLTokenizer(TokenizerWrapper(CharTokenizer()))
    grammar = {"lark": llguidance.LLMatcher.grammar_from_lark,
               "json_schema": llguidance.LLMatcher.grammar_from_json_schema}[guide.kind](guide.spec)
    matcher = llguidance.LLMatcher(tokenizer, grammar)
    assert not matcher.is_error(), matcher.get_error()
    rng, out = random.Random(seed), []
    for _ in range(limit):
        mask = np.frombuffer(matcher.compute_bitmask(), dtype=np.uint32)
        allowed = [t for t in range(len(CharTokenizer.tokens)) if mask[t // 32] >> (t % 32) & 1]
        choice = rng.choice(allowed[:-1] if len(allowed) > 1 and rng.random() < 0.7 else allowed)
        if choice == CharTokenizer.eos_token_id or matcher.is_stopped():
            break
        assert matcher.consume_token(choice), matcher.get_error()
        out.append(CHARS[choice])
    assert matcher.is_accepting()
    return "".join(out)


@pytest.mark.parametrize("template, fields, several", [
    (QWEN25, dict(tool_choice="required"), True),
    (QWEN25, dict(tool_choice="required", parallel_tool_calls=False), False),
    (QWEN25, dict(tool_choice={"type": "function", "function": {"name": "get_time"}}), False),
    (LLAMA31_LIKE, dict(tool_choice="required"), False),
    (PLAIN.replace("assistant:", "{{ tools }}assistant:"), dict(tool_choice="required"), False)])
def test_a_forced_calls_guide_always_gives_calls_that_parse_and_validate(template, fields, several):
    template = ChatTemplate(template)
    tool_plan = plan(request(tools=[WEATHER, TIME], **fields), template)
    named = fields["tool_choice"]["function"]["name"] if isinstance(fields["tool_choice"], dict) else None
    counts = set()
    for seed in range(12):
        content, calls = parse_whole(tool_plan.parse, walk(tool_plan.guide, seed))
        assert content == "" and calls
        counts.add(len(calls))
        for call in calls:
            assert call.name == named or (named is None and call.name in SCHEMAS)
            jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
    assert (max(counts) > 1) == several
