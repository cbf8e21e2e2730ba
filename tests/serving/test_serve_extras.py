"""`python -m train.serve`'s tools, `/tokenize`, `/detokenize` and `/v1/embeddings` on a real server
process (one for the module), through the official `openai` client where it has the endpoint, and
through the OpenAI Agents SDK and instructor (tools mode).

The tiny random model reads a Hermes-style chat template that takes tools (`TOOLS_TEMPLATE`); its
embeddings are checked against `DecoderLM.apply` on the same ids, with the same parameters (the
server's `--random-init` and `--seed`, loaded again here).
"""

import base64
import json
from typing import Literal

import jax.numpy as jnp
import jsonschema
import numpy as np
import openai
import pytest

from server_process import MODEL, TINY_TOML, ServerProcess, tiny_server_args
from test_serve import http

from jaxattn.hf.chat_template import ChatTemplate
from jaxattn.kernels import prepare_weights
from jaxattn.model import DecoderLM
from jaxattn.serving.embedding import final_hidden
from train import serve
from train.models.load import load_model
from train.models.source import ModelSource

pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("train_serve_extras")]
MAX_LEN = 1024
# Hermes' layout in the tiny vocabulary's characters: the tools as JSON, calls in <tool_call> tags,
# results in <tool_response> tags.
TOOLS_TEMPLATE = (
    "{% if tools %}<tools>{% for t in tools %}{{ t.function | tojson }}{% endfor %}</tools>\n{% endif %}"
    "{% for m in messages %}<{{ m.role }}>{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{{ {'name': c.function.name, 'arguments': c.function.arguments}"
    " | tojson }}\n</tool_call>{% endfor %}"
    "{% if m.role == 'tool' %}<tool_response>{{ m.tool_call_id }}</tool_response>{% endif %}</>\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}")
PICK = {"type": "function", "function": {"name": "pick", "description": "Pick a colour.", "parameters": {
    "type": "object", "properties": {"colour": {"enum": ["red", "blue"]}, "bright": {"type": "boolean"}},
    "required": ["colour", "bright"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "Pick one."}]


@pytest.fixture(scope="module")
def served_dir(tmp_path_factory):
    directory = tmp_path_factory.mktemp("serve_extras")
    args = tiny_server_args(directory)
    (directory / f"{MODEL}.toml").write_text(TINY_TOML.replace("max_seq_len = 256", f"max_seq_len = {MAX_LEN}"))
    (directory / "chat.jinja").write_text(TOOLS_TEMPLATE)
    return directory, args


@pytest.fixture(scope="module")
def server(served_dir):
    _, args = served_dir
    with ServerProcess(args + ["--max-seqs", "4", "--seed", "3"]) as process:
        yield process


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0, timeout=120)


def post(server, path, body):
    return http(server, path, method="POST", body=json.dumps(body).encode(), key=None)


# -- /tokenize and /detokenize -------------------------------------------------------------------

def test_tokenize_counts_a_prompt_and_a_chat_as_the_server_does(server, client):
    status, answer = post(server, "/tokenize", {"prompt": "abc é"})
    assert status == 200 and answer["count"] == 5 and answer["max_model_len"] == MAX_LEN
    assert answer["token_strs"] is None
    assert post(server, "/detokenize", {"tokens": answer["tokens"], "model": MODEL}) == (200, {"prompt": "abc é"})
    _, strs = post(server, "/tokenize", {"prompt": "ab", "return_token_strs": True})
    assert strs["token_strs"] == ["a", "b"]
    chat = {"messages": USER, "tools": [PICK]}
    _, rendered = post(server, "/tokenize", chat)
    text = ChatTemplate(TOOLS_TEMPLATE).render(USER, tools=[PICK])
    assert rendered["count"] == len(text) and post(server, "/detokenize", {"tokens": rendered["tokens"]})[1] == \
        {"prompt": text}
    answer = client.chat.completions.create(model=MODEL, messages=USER, tools=[PICK], tool_choice="none",
                                            max_tokens=1)
    assert answer.usage.prompt_tokens == rendered["count"]


@pytest.mark.parametrize("path, body, param", [
    ("/detokenize", {"tokens": [1, 10**6]}, "tokens"),
    ("/detokenize", {"tokens": [-1]}, "tokens"),
    ("/detokenize", {"tokens": "abc"}, "tokens"),
    ("/tokenize", {"prompt": "snow ☃"}, "prompt"),
    ("/tokenize", {"messages": USER, "tools": [{"type": "code"}]}, "tools[0]"),
])
def test_bad_tokenize_and_detokenize_requests_are_400s(server, path, body, param):
    status, answer = post(server, path, body)
    assert status == 400 and answer["error"]["param"] == param, answer
    assert post(server, "/tokenize", {"prompt": "a", "model": "other"})[0] == 404


# -- /v1/embeddings ------------------------------------------------------------------------------

@pytest.fixture(scope="module")
def reference(served_dir):
    """The server's model, loaded again and run by the kernels the server picks on this machine
    (`serve.serving_kernels`): `ids -> [T, D]` final states from `DecoderLM.apply`."""
    directory, _ = served_dir
    loaded = load_model(ModelSource(random_init=str(directory / f"{MODEL}.toml"), data=str(directory / "corpus.txt"),
                                    seed=3))
    kernels, _ = serve.serving_kernels(loaded.config.dtype)
    model, params = DecoderLM(loaded.config, kernels), prepare_weights(loaded.params, kernels)

    def states(ids):
        out = model.apply({"params": params}, jnp.asarray([ids], jnp.int32), method=final_hidden)
        return np.asarray(out[0], np.float32)
    return states, loaded.tokenizer


def test_embeddings_are_the_last_tokens_final_state_normalised(client, reference):
    states, tokenizer = reference
    texts = ["The king", "a longer line of text, past the first bucket of sixty-four characters long..."]
    answer = client.embeddings.create(model=MODEL, input=texts)  # the client asks for base64
    assert [d.index for d in answer.data] == [0, 1] and answer.model == MODEL
    assert answer.usage.prompt_tokens == answer.usage.total_tokens == sum(len(t) for t in texts)
    for text, datum in zip(texts, answer.data):
        expected = states([int(t) for t in tokenizer.encode(text)])[-1]
        np.testing.assert_allclose(datum.embedding, expected / np.linalg.norm(expected), atol=1e-5)
        assert abs(np.linalg.norm(datum.embedding) - 1) < 1e-5
    raw = client.embeddings.create(model=MODEL, input=[5, 6, 7], encoding_format="float",
                                   extra_body={"normalize": False})
    np.testing.assert_allclose(raw.data[0].embedding, states([5, 6, 7])[-1], atol=1e-5)
    ids = client.embeddings.create(model=MODEL, input=[[int(t) for t in tokenizer.encode("The king")]])
    np.testing.assert_allclose(ids.data[0].embedding, answer.data[0].embedding, atol=1e-6)


def test_embeddings_in_base64_are_the_float32_bytes_of_the_floats(server):
    _, floats = post(server, "/v1/embeddings", {"model": MODEL, "input": "abc", "encoding_format": "float"})
    _, packed = post(server, "/v1/embeddings", {"model": MODEL, "input": "abc", "encoding_format": "base64"})
    decoded = np.frombuffer(base64.b64decode(packed["data"][0]["embedding"]), "<f4")
    assert decoded.tolist() == np.asarray(floats["data"][0]["embedding"], np.float32).tolist()
    assert floats["object"] == "list" and floats["data"][0]["object"] == "embedding"


@pytest.mark.parametrize("body, param", [
    ({"input": []}, "input"), ({"input": ""}, "input"), ({"input": "x" * (MAX_LEN + 1)}, "input"),
    ({"input": [10**6]}, "input"), ({"input": "a", "dimensions": 7}, "dimensions"),
    ({"input": "a", "encoding_format": "hex"}, "encoding_format"),
])
def test_bad_embedding_requests_are_400s(client, body, param):
    with pytest.raises(openai.BadRequestError) as caught:
        client.embeddings.create(model=MODEL, **body)
    assert caught.value.body["param"] == param, caught.value.body


# -- tools ---------------------------------------------------------------------------------------

def test_tool_history_renders_as_transformers_renders_it(client):
    """An assistant's call (arguments as a JSON string) and the tool's answer go back through the template:
    the prompt's tokens are those of the template rendered with the arguments as an object."""
    history = USER + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_7", "type": "function", "function": {
            "name": "pick", "arguments": '{"colour": "red", "bright": true}'}}]},
        {"role": "tool", "tool_call_id": "call_7", "content": "done"}]
    transformers_utils = pytest.importorskip("transformers.utils.chat_template_utils")
    given = [USER[0], {**history[1], "content": "", "tool_calls": [{**history[1]["tool_calls"][0], "function": {
        "name": "pick", "arguments": {"colour": "red", "bright": True}}}]}, history[2]]
    text, _ = transformers_utils.render_jinja_template([given], tools=[PICK], chat_template=TOOLS_TEMPLATE,
                                                       add_generation_prompt=True)
    assert '<tool_call>\n{"name": "pick", "arguments": {"colour": "red", "bright": true}}\n</tool_call>' in text[0]
    answer = client.chat.completions.create(model=MODEL, messages=history, tools=[PICK], max_tokens=2)
    assert answer.usage.prompt_tokens == len(text[0])


def test_auto_answers_parse_alike_whole_and_streamed(client):
    """With "auto" the random model writes text, not calls: the content is its text and the stream's
    deltas join to the whole answer."""
    knobs = dict(model=MODEL, messages=USER, tools=[PICK], max_tokens=40, temperature=0)
    whole = client.chat.completions.create(**knobs)
    chunks = list(client.chat.completions.create(**knobs, stream=True))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    plain = client.chat.completions.create(**{**knobs, "tool_choice": "none"})
    assert whole.choices[0].message.tool_calls is None and whole.choices[0].finish_reason == "length"
    assert streamed == whole.choices[0].message.content == plain.choices[0].message.content


# -- forced calls: constrained by the engine's guide ---------------------------------------------

def test_a_named_function_is_always_called_with_arguments_that_validate(client):
    """The call is constrained to Hermes' format with the function's schema: whole and streamed alike."""
    knobs = dict(model=MODEL, messages=USER, tools=[PICK], max_tokens=120, temperature=0,
                 tool_choice={"type": "function", "function": {"name": "pick"}})
    whole = client.chat.completions.create(**knobs)
    choice = whole.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    [call] = choice.message.tool_calls
    assert call.function.name == "pick" and call.id.startswith("call_")
    jsonschema.validate(json.loads(call.function.arguments), PICK["function"]["parameters"])
    chunks = list(client.chat.completions.create(**knobs, stream=True))
    deltas = [t for c in chunks if c.choices for t in c.choices[0].delta.tool_calls or []]
    assert deltas[0].function.name == "pick" and deltas[0].id.startswith("call_")
    assert "".join(d.function.arguments for d in deltas) == call.function.arguments
    assert chunks[-1].choices[0].finish_reason == "tool_calls"


def test_required_calls_one_of_the_tools_with_seeded_draws(client):
    other = {"type": "function", "function": {"name": "wait", "parameters": {
        "type": "object", "properties": {"seconds": {"enum": [1, 2, 3]}}, "required": ["seconds"],
        "additionalProperties": False}}}
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (PICK, other)}
    for seed in range(4):
        answer = client.chat.completions.create(model=MODEL, messages=USER, tools=[PICK, other], max_tokens=120,
                                                tool_choice="required", parallel_tool_calls=False, seed=seed)
        [call] = answer.choices[0].message.tool_calls
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])


def test_a_forced_call_with_a_response_format_is_a_400(client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=MODEL, messages=USER, tools=[PICK], tool_choice="required",
                                       response_format={"type": "json_object"})
    assert caught.value.body["param"] == "tool_choice"


# -- real clients ----------------------------------------------------------------------------------

def test_the_agents_sdk_calls_a_function_tool(server):
    """The OpenAI Agents SDK through `OpenAIChatCompletionsModel`: the tool is required on the first turn
    (a random model would not call it otherwise), the SDK runs it and asks again with its result."""
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)
    picked = []

    @agents.function_tool
    def pick(colour: Literal["red", "blue"], bright: bool) -> str:
        """Pick a colour."""
        picked.append((colour, bright))
        return "ok"

    model = agents.OpenAIChatCompletionsModel(model=MODEL, openai_client=openai.AsyncOpenAI(
        base_url=server.url + "/v1", api_key="none", max_retries=0))
    agent = agents.Agent(name="picker", instructions="Pick.", tools=[pick], model=model,
                         model_settings=agents.ModelSettings(tool_choice="required", max_tokens=100, temperature=0))
    result = agents.Runner.run_sync(agent, "Pick one.", max_turns=3)
    assert len(picked) == 1 and picked[0][0] in ("red", "blue") and isinstance(picked[0][1], bool)
    assert isinstance(result.final_output, str)
    calls = [item for item in result.new_items if item.type == "tool_call_item"]
    outputs = [item for item in result.new_items if item.type == "tool_call_output_item"]
    assert len(calls) == 1 and outputs[0].output == "ok"


def test_instructor_extracts_a_model_in_tools_mode(client):
    instructor = pytest.importorskip("instructor")
    pydantic = pytest.importorskip("pydantic")

    class Colour(pydantic.BaseModel):
        """A colour."""

        # No further keys (a random model, free to add keys, would write them until max_tokens).
        model_config = pydantic.ConfigDict(extra="forbid")
        colour: Literal["red", "blue"]
        bright: bool

    patched = instructor.from_openai(client, mode=instructor.Mode.TOOLS)
    colour = patched.chat.completions.create(model=MODEL, response_model=Colour, messages=USER, max_tokens=120,
                                             max_retries=0)
    assert isinstance(colour, Colour) and colour.colour in ("red", "blue")
