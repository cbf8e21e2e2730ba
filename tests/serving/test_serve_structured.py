"""Structured outputs through `python -m train.serve` and the clients people use: one real server process
for the module, a tiny random Llama with a byte-level BPE tokenizer (tokens of several characters), so
every valid answer is the guide's doing.

* `response_format` json_schema (chat and completions, whole and streamed, concurrent) and json_object:
  every answer parses and validates (`jsonschema`);
* vLLM's `guided_regex`, `guided_choice`, `guided_grammar` (GBNF and Lark) through `extra_body`;
* a schema, regex or grammar that does not compile is a 400 naming the field, before any stream;
* instructor in its JSON-schema mode and langchain-openai's `with_structured_output(method="json_schema")`
  extract a pydantic model.
"""

import concurrent.futures
import json
import re

import instructor
import jsonschema
import openai
import pytest
from langchain_openai import ChatOpenAI
from pydantic import BaseModel, ConfigDict, Field

from server_process import MODEL, ServerProcess, tiny_bpe_server_args
from structured_cases import draw_schemas

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_serve_structured")]
KEY = "test-key"
MESSAGES = [{"role": "user", "content": "Give me the answer as JSON."}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    args = tiny_bpe_server_args(tmp_path_factory.mktemp("serve_bpe")) + ["--api-key", KEY, "--max-seqs", "8",
                                                                         "--seed", "0"]
    with ServerProcess(args) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300)


def schema_format(schema: dict) -> dict:
    return {"type": "json_schema", "json_schema": {"name": "answer", "schema": schema, "strict": True}}


def chat(client, seed: int, stream: bool, **fields) -> tuple[str, str]:
    """(the answer's text, its finish reason), streamed or whole."""
    common = dict(model=MODEL, messages=MESSAGES, max_tokens=160, temperature=1.0, seed=seed)
    if not stream:
        choice = client.chat.completions.create(**common, **fields).choices[0]
        return choice.message.content, choice.finish_reason
    chunks = list(client.chat.completions.create(**common, **fields, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    return text, [c.choices[0].finish_reason for c in chunks if c.choices][-1]


def test_json_schema_answers_validate_whole_and_streamed_at_once(client):
    schemas = draw_schemas(12, seed=1)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(lambda i: chat(client, i, stream=i % 2 == 1,
                                               response_format=schema_format(schemas[i])), range(len(schemas))))
    for (text, finish), schema in zip(answers, schemas):
        assert finish == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)


def test_completions_take_response_format_and_chat_json_object(client):
    schema = draw_schemas(1, seed=7)[0]
    completion = client.completions.create(model=MODEL, prompt="JSON:", max_tokens=160, seed=3,
                                           extra_body={"response_format": schema_format(schema)})
    assert completion.choices[0].finish_reason == "stop"
    jsonschema.validate(json.loads(completion.choices[0].text), schema)
    text, finish = chat(client, 4, stream=True, response_format={"type": "json_object"}, max_completion_tokens=300)
    if finish == "stop":  # any object may nest on; when it ends, it is one
        assert isinstance(json.loads(text), dict)


@pytest.mark.parametrize("field, value, matches", [
    ("guided_regex", r"[A-Z]{2}-[0-9]{3}", lambda text: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text)),
    ("guided_choice", ["red", "green", "dark blue"], lambda text: text in ("red", "green", "dark blue")),
    ("guided_grammar", 'root ::= "answer: " ("yes" | "no") "."', lambda text: text in ("answer: yes.", "answer: no.")),
    ("guided_grammar", 'start: "(" NUMBER ("," NUMBER)~0..2 ")"\nNUMBER: /[0-9]{1,3}/',
     lambda text: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,2}\)", text)),
])
def test_vllm_guided_extensions(client, field, value, matches):
    text, finish = chat(client, 5, stream=True, extra_body={field: value})
    assert finish == "stop" and matches(text), text
    completion = client.completions.create(model=MODEL, prompt="the answer", max_tokens=60, seed=6,
                                           extra_body={field: value})
    assert completion.choices[0].finish_reason == "stop" and matches(completion.choices[0].text)


@pytest.mark.parametrize("fields, param", [
    ({"response_format": schema_format({"type": "object", "properties": {"a": {"type": "nonsense"}}})},
     "response_format"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "yaml"}}, "response_format"),
    ({"extra_body": {"guided_regex": "a(b"}}, "guided_regex"),
    ({"extra_body": {"guided_grammar": "start: undefined_rule"}}, "guided_grammar"),
    ({"extra_body": {"guided_regex": "a+", "guided_choice": ["a"]}}, "guided_choice"),
])
def test_a_guide_that_does_not_compile_is_a_400_naming_its_field(client, fields, param):
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as err:
            client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8, stream=stream, **fields)
        assert err.value.body["param"] == param
    assert client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=2).choices  # still up


class Person(BaseModel):
    """What the clients extract: bounded, so a random model's answer ends."""

    model_config = ConfigDict(extra="forbid")
    name: str = Field(min_length=1, max_length=8)
    age: int = Field(ge=0, le=120)
    role: str = Field(pattern=r"^(admin|user|guest)$")


def test_instructor_json_schema_mode_extracts_a_pydantic_model(server):
    patched = instructor.from_openai(openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0),
                                     mode=instructor.Mode.JSON_SCHEMA)
    person = patched.chat.completions.create(model=MODEL, response_model=Person, messages=MESSAGES,
                                             max_tokens=120, seed=2, max_retries=0)
    assert isinstance(person, Person) and person.role in ("admin", "user", "guest") and 0 <= person.age <= 120


def test_langchain_with_structured_output_json_schema_extracts_a_pydantic_model(server):
    model = ChatOpenAI(model=MODEL, base_url=server.url + "/v1", api_key=KEY, max_retries=0, max_tokens=120,
                       seed=3)
    person = model.with_structured_output(Person, method="json_schema").invoke("Who is it?")
    assert isinstance(person, Person) and 1 <= len(person.name) <= 8
