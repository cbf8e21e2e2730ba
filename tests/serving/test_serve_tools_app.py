"""Tool calls through the HTTP app in-process, over a stand-in engine that writes a scripted answer: the
`openai` client reads `message.tool_calls` from a whole answer and `delta.tool_calls` from a stream,
the two agree, and a template that cannot take tools is a 400 naming `tools`."""

import json

import openai
import pytest

from test_serve_app import MODEL, InProcessServer, StandInEngine, served

from jaxattn.hf.chat_template import ChatTemplate
from jaxattn.serving import Request, Status

TOOL_TEMPLATE = ChatTemplate("{% if tools %}{{ tools | tojson }}{% endif %}<tool_call>{% for m in messages %}"
                             "{{ m.content }}{% endfor %}")
PLAIN_TEMPLATE = ChatTemplate("{% for m in messages %}{{ m.content }}{% endfor %}")
PICK = {"type": "function", "function": {"name": "pick", "parameters": {"type": "object"}}}
SCRIPT = ('Checking.\n<tool_call>\n{"name": "pick", "arguments": {"colour": "red", "n": [1, 2]}}\n</tool_call>\n'
          '<tool_call>\n{"name": "pick", "arguments": {}}\n</tool_call>')


class ScriptedEngine(StandInEngine):
    """Each request writes `script`, a character a step, and stops at its end ("stop")."""

    def __init__(self, script: str):
        super().__init__()
        self.script = script

    def add_request(self, prompt_ids, sampling):
        request = Request(tuple(prompt_ids), sampling, 0, lambda ids: self.script[:len(ids)])
        self.waiting.append(request)
        return request

    def step(self):
        ended = super().step()
        for request in ended:
            if request.finish_reason == "length" or len(request.output_ids) == len(self.script):
                request.status, request.finish_reason = Status.FINISHED, "stop"
                request.text.finish()
                if request in self.running:
                    self.running.remove(request)
        return ended


def ask(client, **knobs):
    return client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "go"}],
                                          tools=[PICK], max_tokens=len(SCRIPT) + 5, **knobs)


def test_auto_calls_come_back_as_tool_calls_whole_and_streamed():
    with InProcessServer(ScriptedEngine(SCRIPT), served(chat_template=TOOL_TEMPLATE)) as server:
        whole = ask(server.client)
        chunks = list(ask(server.client, stream=True))
        none = ask(server.client, tool_choice="none")
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == "Checking."
    calls = choice.message.tool_calls
    assert [(c.type, c.function.name) for c in calls] == [("function", "pick")] * 2
    assert json.loads(calls[0].function.arguments) == {"colour": "red", "n": [1, 2]}
    assert calls[1].function.arguments == "{}" and calls[0].id.startswith("call_") and calls[0].id != calls[1].id
    # The stream: content, then each call's id, type and name first, then its arguments in pieces.
    streamed, by_index, pieces = "", {}, 0
    for chunk in chunks:
        delta = chunk.choices[0].delta
        streamed += delta.content or ""
        for call in delta.tool_calls or []:
            if call.id is not None:
                assert call.index not in by_index and call.type == "function" and call.function.arguments == ""
                by_index[call.index] = [call.function.name, ""]
            else:
                assert call.function.name is None
                by_index[call.index][1] += call.function.arguments
                pieces += 1
    assert streamed == "Checking." and chunks[-1].choices[0].finish_reason == "tool_calls"
    assert [tuple(v) for _, v in sorted(by_index.items())] == [(c.function.name, c.function.arguments) for c in calls]
    assert pieces > 2  # the arguments stream as they come
    assert none.choices[0].message.content == SCRIPT and none.choices[0].message.tool_calls is None
    assert none.choices[0].finish_reason == "stop"


def test_a_template_that_cannot_take_tools_is_a_400_naming_tools():
    with InProcessServer(ScriptedEngine("hi"), served(chat_template=PLAIN_TEMPLATE)) as server:
        with pytest.raises(openai.BadRequestError) as caught:
            ask(server.client)
        assert caught.value.body["param"] == "tools" and caught.value.code == "tools_not_supported"
        with pytest.raises(openai.BadRequestError) as caught:
            ask(server.client, tool_choice={"type": "function", "function": {"name": "other"}})
        assert caught.value.body["param"] == "tool_choice"
        answer = ask(server.client, tool_choice="none")  # "none": the tools are left out, the answer is text
        assert answer.choices[0].message.content == "hi"
