"""`jaxattn.hf.chat_template`: chat templates render the text transformers' `apply_chat_template` renders.

Each template is saved with a tiny word-level tokenizer in a directory transformers' `AutoTokenizer`
loads; the same chats rendered both ways must give equal strings. Then the lookup of a directory's
template (chat_template.jinja over tokenizer_config.json, the named-list form) and the errors.
"""

import json
import time
from pathlib import Path

import pytest

from jaxattn.hf.chat_template import ChatTemplate, ChatTemplateError, find_chat_template, special_tokens

pytest.importorskip("jinja2")
tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SMOLLM2 = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

# Llama 3's layout, with Llama 2's check that user and assistant alternate; spread over lines so that
# trim_blocks and lstrip_blocks decide the whitespace.
LLAMA3 = r"""{{ bos_token }}{% if messages[0]['role'] == 'system' %}
    {% set loop_messages = messages[1:] %}
    {{- '<|start_header_id|>system<|end_header_id|>\n\n' + messages[0]['content'] | trim + '<|eot_id|>' -}}
{% else %}
    {% set loop_messages = messages %}
{% endif %}
{% for message in loop_messages %}
    {% if (message['role'] == 'user') != (loop.index0 % 2 == 0) %}
        {{- raise_exception('Conversation roles must alternate user/assistant/user/assistant/...') -}}
    {% endif %}
    {{- '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' + message['content'] | trim + '<|eot_id|>' -}}
{% endfor %}
{% if add_generation_prompt %}
    {{- '<|start_header_id|>assistant<|end_header_id|>\n\n' -}}
{% else %}
    {{- eos_token -}}
{% endif %}
"""

# tojson with its options, a namespace, `{% continue %}` and `{% break %}`, `{% generation %}`, a keyword.
JSONISH = """{%- set ns = namespace(count=0) -%}
{%- for message in messages -%}
  {%- if message.role == 'tool' %}{% continue %}{% endif -%}
  {%- if message.content == 'STOP' %}{% break %}{% endif -%}
  {%- set ns.count = ns.count + 1 -%}
  {%- if message.role == 'assistant' %}{% generation %}{{ message | tojson }}{% endgeneration %}
  {%- else %}{{ message | tojson(indent=2, sort_keys=True) }}{% endif %}
{% endfor -%}
count={{ ns.count }} think={{ enable_thinking | default(true) }} tools={{ tools | tojson }}
{%- if add_generation_prompt %}<assistant>{% endif -%}
"""

TEMPLATES = {"smollm2": SMOLLM2, "llama3": LLAMA3, "jsonish": JSONISH}
TOKENS = {"bos_token": "<s>", "eos_token": {"content": "</s>", "__type": "AddedToken", "special": True},
          "pad_token": "<pad>", "unk_token": "<unk>"}

CHATS = {
    "one user turn": [{"role": "user", "content": "Hello there"}],
    "system and turns": [{"role": "system", "content": "  Be brief.  "}, {"role": "user", "content": "Hi "},
                         {"role": "assistant", "content": "Hello!"}, {"role": "user", "content": "Café ☕ <b>&</b>"}],
    "no system, two turns": [{"role": "user", "content": "a\nb"}, {"role": "assistant", "content": " c "},
                             {"role": "user", "content": "d", "name": None}],
}
JSON_CHATS = {
    "tool, reasoning, stop": [
        {"role": "user", "content": "q"}, {"role": "tool", "content": "skipped"},
        {"role": "assistant", "content": "a", "reasoning_content": "because"},
        {"role": "user", "content": "STOP"}, {"role": "user", "content": "never"}],
}


def _write_tokenizer(directory: Path, config: dict) -> Path:
    """A word-level tokenizer.json and the given tokenizer_config.json, as transformers saves them."""
    vocab = {word: i for i, word in enumerate(["<unk>", "<s>", "</s>", "<pad>", "hello"])}
    model = tokenizers.models.WordLevel(vocab, unk_token="<unk>")
    tokenizer = tokenizers.Tokenizer(model)
    tokenizer.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    (directory / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", **TOKENS, **config}), encoding="utf-8")
    return directory


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def saved(request, tmp_path_factory):
    """(ChatTemplate.from_directory, AutoTokenizer.from_pretrained) of one template's directory."""
    directory = _write_tokenizer(tmp_path_factory.mktemp(request.param), {"chat_template": TEMPLATES[request.param]})
    return request.param, ChatTemplate.from_directory(directory), transformers.AutoTokenizer.from_pretrained(directory)


def _transformers(tokenizer, messages, **kwargs) -> str:
    return tokenizer.apply_chat_template(messages, tokenize=False, **kwargs)


@pytest.mark.parametrize("add_generation_prompt", [True, False])
def test_every_template_renders_what_transformers_renders(saved, add_generation_prompt):
    name, template, tokenizer = saved
    chats = {**CHATS, **(JSON_CHATS if name == "jsonish" else {})}
    for chat in chats.values():
        ours = template.render(chat, add_generation_prompt=add_generation_prompt)
        assert ours == _transformers(tokenizer, chat, add_generation_prompt=add_generation_prompt)
    assert ours.endswith("<assistant>" if name == "jsonish" else "\n\n" if name == "llama3" else "assistant\n") \
        == add_generation_prompt


def test_keywords_reach_the_template_as_transformers_passes_them(saved):
    name, template, tokenizer = saved
    chat = CHATS["one user turn"]
    for extra in ({"enable_thinking": False}, {"tools": [{"type": "function", "function": {"name": "f"}}]},
                  {"bos_token": "[BOS]"}):
        assert template.render(chat, **extra) == _transformers(tokenizer, chat, add_generation_prompt=True, **extra)
    if name == "jsonish":
        assert "think=False" in template.render(chat, enable_thinking=False)
        assert 'tools=[{"type": "function"' in template.render(chat, tools=[{"type": "function"}])
        assert '"café ☕"' in template.render([{"role": "user", "content": "café ☕"}])  # tojson keeps non-ASCII


def test_a_list_of_text_parts_renders_as_its_joined_text(saved):
    _, template, tokenizer = saved
    parts = [{"role": "user", "content": [{"type": "text", "text": "first"}, {"type": "text", "text": "second"}]}]
    joined = [{"role": "user", "content": "first\nsecond"}]
    assert template.render(parts) == template.render(joined) == _transformers(tokenizer, joined,
                                                                              add_generation_prompt=True)


def test_the_llama3_template_sees_the_special_tokens_and_raises_on_non_alternating_roles(tmp_path):
    template = ChatTemplate.from_directory(_write_tokenizer(tmp_path, {"chat_template": LLAMA3}))
    rendered = template.render(CHATS["system and turns"], add_generation_prompt=False)
    assert rendered.startswith("<s><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>")
    assert rendered.endswith("Café ☕ <b>&</b><|eot_id|></s>")
    with pytest.raises(ChatTemplateError, match="raised an exception: Conversation roles must alternate"):
        template.render([{"role": "user", "content": "a"}, {"role": "user", "content": "b"}])


def test_chat_template_jinja_wins_over_tokenizer_config(tmp_path):
    directory = _write_tokenizer(tmp_path, {"chat_template": "from the config"})
    (directory / "chat_template.jinja").write_text(SMOLLM2, encoding="utf-8")
    assert find_chat_template(directory) == SMOLLM2
    chat = CHATS["one user turn"]
    assert ChatTemplate.from_directory(directory).render(chat) == _transformers(
        transformers.AutoTokenizer.from_pretrained(directory), chat, add_generation_prompt=True)


def test_the_named_list_form_gives_the_default_template(tmp_path):
    named = [{"name": "tool_use", "template": "tools"}, {"name": "default", "template": SMOLLM2}]
    directory = _write_tokenizer(tmp_path, {"chat_template": named})
    assert find_chat_template(directory) == SMOLLM2
    chat = CHATS["system and turns"]
    assert ChatTemplate.from_directory(directory).render(chat) == _transformers(
        transformers.AutoTokenizer.from_pretrained(directory), chat, add_generation_prompt=True)


def test_a_directory_without_a_template_gives_none(tmp_path):
    assert find_chat_template(tmp_path) is None and ChatTemplate.from_directory(tmp_path) is None
    assert special_tokens(tmp_path) == {}
    directory = _write_tokenizer(tmp_path / "tok", {})
    assert find_chat_template(directory) is None and ChatTemplate.from_directory(directory) is None
    assert special_tokens(directory) == {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "<pad>",
                                         "unk_token": "<unk>"}


@pytest.mark.parametrize("config, match", [
    ("{not json", r"tokenizer_config\.json: is not JSON"),
    ("[1, 2]", r"tokenizer_config\.json: holds list"),
    ('{"chat_template": [{"name": "tool_use", "template": "x"}]}', r"no template is named \"default\""),
    ('{"chat_template": 3}', r"chat_template: expected a string or a list"),
])
def test_a_bad_tokenizer_config_names_the_file(tmp_path, config, match):
    (tmp_path / "tokenizer_config.json").write_text(config, encoding="utf-8")
    with pytest.raises(ChatTemplateError, match=match):
        find_chat_template(tmp_path)


def test_a_syntax_error_gives_the_line_and_jinjas_message():
    with pytest.raises(ChatTemplateError, match=r"does not parse: line 2: .*'endfor'"):
        ChatTemplate("{{ bos_token }}\n{% for m in messages %}{{ m.content }}")


def test_a_template_that_fails_while_rendering_says_so():
    with pytest.raises(ChatTemplateError, match="failed while rendering: TypeError"):
        ChatTemplate("{{ messages[0].content + 1 }}").render([{"role": "user", "content": "x"}])
    with pytest.raises(ChatTemplateError, match="SecurityError"):  # the sandbox holds
        ChatTemplate("{{ messages.__class__.__mro__ }}").render([{"role": "user", "content": "x"}])


@pytest.mark.parametrize("messages, match", [
    ({"role": "user", "content": "x"}, r"messages must be a list of dicts, got dict"),
    ([], r"messages is empty"),
    ([{"role": "user", "content": "x"}, "hello"], r"messages\[1\]: expected a dict"),
    ([{"role": "user", "content": "x"}, {"content": "y"}], r"messages\[1\]: 'role' is missing"),
    ([{"role": 3, "content": "x"}], r"messages\[0\]: 'role' must be a str, got int"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": 7}],
     r"messages\[1\]: 'content' must be a str or a list of text parts, got int"),
    ([{"role": "user"}], r"messages\[0\]: 'content' is missing"),
    ([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}],
     r"messages\[0\]: 'content'\[0\] must be .*got 'image_url'"),
])
def test_bad_messages_name_the_index(messages, match):
    with pytest.raises(ChatTemplateError, match=match):
        ChatTemplate(SMOLLM2).render(messages)


def test_a_render_past_its_bounds_is_refused_in_one_line_without_rendering_it_all():
    """A template that multiplies a client's text (it once rendered 200 MB in 3.7 s) stops at `max_chars`;
    one that takes long between its pieces stops at `max_seconds`; within both, the text is the plain render's."""
    big = ChatTemplate("{% for i in range(100000) %}{{ messages[0]['content'] * 1000 }}{% endfor %}")
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="more than 1,048,576 characters"):
        big.render([{"role": "user", "content": "abcd"}], max_chars=2**20)
    assert time.perf_counter() - started < 2  # 400 MB were never rendered
    slow = ChatTemplate("{% for i in range(200) %}{{ i }}{% for j in range(20000) %}{% endfor %}{% endfor %}")
    with pytest.raises(ChatTemplateError, match="more than 0.05 s to render"):
        slow.render([{"role": "user", "content": "a"}], max_seconds=0.05)
    # A loop that yields nothing (1e10 turns) meets the deadline too, as `range` counts.
    spin = ChatTemplate("{% for i in range(99999) %}{% for j in range(99999) %}{% endfor %}{% endfor %}")
    started = time.perf_counter()
    with pytest.raises(ChatTemplateError, match="more than 0.2 s to render"):
        spin.render([{"role": "user", "content": "a"}], max_seconds=0.2)
    assert time.perf_counter() - started < 2
    counting = ChatTemplate("{% for i in range(3) %}{{ i }}{% endfor %}")
    assert counting.render([{"role": "user", "content": "a"}], max_seconds=5) == "012"
    small = ChatTemplate("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}")
    chat = [{"role": "user", "content": "hi"}]
    assert small.render(chat, max_chars=100, max_seconds=5) == small.render(chat) == "<user>hi"
