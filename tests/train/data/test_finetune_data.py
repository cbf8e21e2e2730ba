"""`train.data.chats`, `documents` and `packing`: chat JSONL, assistant-only weights as transformers masks
them, plain text, packing.

The chat templates below carry `{% generation %}` markers around what an assistant turn trains on,
so transformers' `apply_chat_template(..., return_assistant_tokens_mask=True)` is the peer for the
weights `render_conversation` finds without them (the markers render their body and nothing else).
The tokenizer is a small byte-level BPE with the templates' special tokens, saved as transformers
saves one.
"""

import json
from pathlib import Path

import numpy as np
import pytest

from jaxattn.hf.chat_template import ChatTemplate
from train.data.chats import Conversation, chat_documents, load_chat_files, read_chat_jsonl, render_conversation
from train.data.documents import text_documents
from train.data.errors import DataError
from train.data.packing import pack
from train.data.tokenizer import ByteTokenizer, JSONTokenizer

tokenizers = pytest.importorskip("tokenizers")
transformers = pytest.importorskip("transformers")

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|begin_of_text|>", "<|start_header_id|>",
           "<|end_header_id|>", "<|eot_id|>", "<bos>", "<start_of_turn>", "<end_of_turn>", "</s>"]

CHATML = (  # SmolLM2's template, its default system prompt included
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

LLAMA3 = (
    "{{ bos_token }}{% for message in messages %}"
    "{{ '<|start_header_id|>' + message['role'] + '<|end_header_id|>\n\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}{{ message['content'] | trim + '<|eot_id|>' }}"
    "{% endgeneration %}{% else %}{{ message['content'] | trim + '<|eot_id|>' }}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|start_header_id|>assistant<|end_header_id|>\n\n' }}{% endif %}")

GEMMA = (  # the assistant is "model"; a system message is folded into the first user turn
    "{{ bos_token }}{% set first = messages[0]['content'] + '\n\n' if messages[0]['role'] == 'system' else '' %}"
    "{% for message in messages if message['role'] != 'system' %}"
    "{% set role = 'model' if message['role'] == 'assistant' else message['role'] %}"
    "{{ '<start_of_turn>' + role + '\n' }}{% if message['role'] == 'assistant' %}"
    "{% generation %}{{ message['content'] | trim + '<end_of_turn>' }}{% endgeneration %}"
    "{% else %}{{ (first if loop.first else '') + message['content'] | trim + '<end_of_turn>' }}{% endif %}"
    "{{ '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<start_of_turn>model\n' }}{% endif %}")

QWEN3 = (  # an empty reasoning block only on the turns after the last user message, as Qwen3 writes it
    "{% set ns = namespace(last_user=-1) %}{% for message in messages %}"
    "{% if message['role'] == 'user' %}{% set ns.last_user = loop.index0 %}{% endif %}{% endfor %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' }}"
    "{% if message['role'] == 'assistant' %}{% generation %}"
    "{% if loop.index0 > ns.last_user %}{{ '<think>\n\n</think>\n\n' }}{% endif %}"
    "{{ message['content'] + '<|im_end|>' }}{% endgeneration %}"
    "{% else %}{{ message['content'] + '<|im_end|>' }}{% endif %}{{ '\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}")

TEMPLATES = {"chatml": (CHATML, "<|endoftext|>"), "llama3": (LLAMA3, "<|begin_of_text|>"),
             "gemma": (GEMMA, "<bos>"), "qwen3": (QWEN3, "<|endoftext|>")}

CHATS = [
    [{"role": "user", "content": "Hello there"}, {"role": "assistant", "content": "Hi! How are you?"}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is 2+2?"},
     {"role": "assistant", "content": "4"}, {"role": "user", "content": "And 3+3?"},
     {"role": "assistant", "content": "It is 6.\nAnything else?"}],
    [{"role": "user", "content": "café ☕ <b>&</b>"}, {"role": "assistant", "content": "  spaces around  "},
     {"role": "user", "content": "thanks"}],
    [{"role": "user", "content": "call it"}, {"role": "assistant", "content": "calling"},
     {"role": "tool", "content": "{\"result\": 7}"}, {"role": "assistant", "content": "the answer is 7"}],
]

CORPUS = ["Hello there, how are you? I am fine, thanks.", "What is the answer? It is seven.",
          "café ☕ and the spaces around, calling the tool", "system user assistant model think"]


def _write_tokenizer(directory: Path, template: str, bos: str) -> Path:
    """A byte-level BPE tokenizer.json with the special tokens, and a tokenizer_config.json naming the template."""
    hf = tokenizers.Tokenizer(tokenizers.models.BPE())
    hf.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = tokenizers.decoders.ByteLevel()
    trainer = tokenizers.trainers.BpeTrainer(vocab_size=400, special_tokens=SPECIAL, show_progress=False,
                                             initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
    hf.train_from_iterator(CORPUS * 4, trainer=trainer)
    directory.mkdir(parents=True, exist_ok=True)
    hf.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": bos, "eos_token": "</s>",
              "pad_token": "<|endoftext|>", "chat_template": template}
    (directory / "tokenizer_config.json").write_text(json.dumps(config), encoding="utf-8")
    return directory


@pytest.fixture(scope="module", params=sorted(TEMPLATES))
def chat_files(request, tmp_path_factory):
    """(name, ChatTemplate, JSONTokenizer, transformers tokenizer) of one template's directory."""
    directory = _write_tokenizer(tmp_path_factory.mktemp(request.param), *TEMPLATES[request.param])
    template, tokenizer = load_chat_files(directory)
    return request.param, template, tokenizer, transformers.AutoTokenizer.from_pretrained(directory)


def _runs(ids: np.ndarray, weights: np.ndarray) -> list[np.ndarray]:
    """The ids of each run of weight-1 tokens."""
    edges = np.flatnonzero(np.diff(np.concatenate([[0], weights, [0]])))
    return [ids[start:end] for start, end in zip(edges[::2], edges[1::2])]


# --- Rendering and weights ------------------------------------------------------------------------------


def test_the_weights_are_transformers_assistant_mask_and_the_ids_its_tokens(chat_files):
    name, template, tokenizer, peer = chat_files
    for chat in CHATS:
        ids, weights = render_conversation(template, tokenizer, chat)
        expected = peer.apply_chat_template(chat, tokenize=True, return_assistant_tokens_mask=True, return_dict=True)
        assert ids.dtype == np.int32 and weights.dtype == np.float32 and ids.shape == weights.shape
        assert ids.tolist() == expected["input_ids"], name
        assert weights.astype(int).tolist() == expected["assistant_masks"], (name, chat)
        # one run per assistant message, each ending with the template's end-of-turn token
        runs = _runs(ids, weights)
        assert len(runs) == sum(message["role"] == "assistant" for message in chat)
        end_of_turn = {"chatml": "<|im_end|>", "qwen3": "<|im_end|>", "llama3": "<|eot_id|>",
                       "gemma": "<end_of_turn>"}[name]
        assert all(tokenizer.decode(run).endswith(end_of_turn) for run in runs)


def test_the_spans_cut_the_full_tokenization_and_prefix_tokenization_agrees(chat_files):
    """The ids are the full text's tokens (not pieces'), and the runs the weights mark are the same
    when found by tokenizing prefixes of the text instead of through the tokenizer's offsets."""

    class WithoutOffsets:
        def __init__(self, inner):
            self.encode = inner.encode

    _, template, tokenizer, _ = chat_files
    for chat in CHATS:
        ids, weights = render_conversation(template, tokenizer, chat)
        text = template.render(chat, add_generation_prompt=False)
        assert ids.tolist() == tokenizer.encode(text).tolist()
        pieces = np.split(ids, np.flatnonzero(np.diff(weights)) + 1)  # alternating runs of 0 and 1
        assert np.concatenate(pieces).tolist() == ids.tolist()
        ids_again, weights_again = render_conversation(template, WithoutOffsets(tokenizer), chat)
        assert ids_again.tolist() == ids.tolist() and weights_again.tolist() == weights.tolist()


def test_train_on_all_weighs_every_token(chat_files):
    _, template, tokenizer, _ = chat_files
    ids, weights = render_conversation(template, tokenizer, CHATS[1], train_on="all")
    assert ids.tolist() == render_conversation(template, tokenizer, CHATS[1])[0].tolist()
    assert weights.tolist() == [1.0] * len(ids)
    with pytest.raises(ValueError, match="train_on must be one of"):
        render_conversation(template, tokenizer, CHATS[1], train_on="user")


def test_a_template_that_closes_the_conversation_with_eos_trains_it_after_the_last_turn_only(tmp_path):
    """A turn ends where the next one's header starts, even when the prefix rendering ends with a
    token (`</s>`) that shares its first character with that header."""
    head, _, tail = LLAMA3.rpartition("{% endif %}")
    closing = head + "{% else %}{{ eos_token }}{% endif %}" + tail
    template, tokenizer = load_chat_files(_write_tokenizer(tmp_path, closing, "<|begin_of_text|>"))
    chat = CHATS[1]
    assert template.render(chat, add_generation_prompt=False).endswith("<|eot_id|></s>")
    ids, weights = render_conversation(template, tokenizer, chat)
    assert [tokenizer.decode(run) for run in _runs(ids, weights)] == ["4<|eot_id|>",
                                                                       "It is 6.\nAnything else?<|eot_id|></s>"]


def test_the_byte_tokenizer_finds_the_turns_by_prefixes():
    ids, weights = render_conversation(ChatTemplate(CHATML), ByteTokenizer(), CHATS[3])
    assert [ByteTokenizer().decode(run) for run in _runs(ids, weights)] == ["calling<|im_end|>",
                                                                           "the answer is 7<|im_end|>"]


def test_an_assistant_message_first_is_refused_and_chat_documents_names_its_line(tmp_path):
    template = ChatTemplate(CHATML)
    opening = [{"role": "assistant", "content": "I start"}, {"role": "user", "content": "ok"}]
    with pytest.raises(ValueError, match=r"messages\[0\] is an assistant message"):
        render_conversation(template, ByteTokenizer(), opening)
    path = tmp_path / "chats.jsonl"
    path.write_text(json.dumps({"messages": CHATS[0]}) + "\n\n" + json.dumps({"messages": opening}) + "\n")
    with pytest.raises(DataError, match=rf"^{path}:3: messages\[0\] is an assistant message"):
        chat_documents(path, template, ByteTokenizer())


def test_chat_documents_renders_every_line(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text("".join(json.dumps({"messages": chat, "id": n}) + "\n" for n, chat in enumerate(CHATS)))
    template = ChatTemplate(CHATML)
    documents = chat_documents(path, template, ByteTokenizer(), train_on="all")
    assert len(documents) == len(CHATS)
    for (ids, weights), chat in zip(documents, CHATS):
        assert ByteTokenizer().decode(ids) == template.render(chat, add_generation_prompt=False)
        assert weights.min() == 1.0


def test_load_chat_files_needs_a_template_and_a_tokenizer(tmp_path):
    directory = _write_tokenizer(tmp_path / "tok", CHATML, "<|endoftext|>")
    template, tokenizer = load_chat_files(directory)
    assert isinstance(tokenizer, JSONTokenizer) and template.special_tokens["eos_token"] == "</s>"
    (directory / "tokenizer_config.json").write_text("{}")
    with pytest.raises(DataError, match="has no chat template"):
        load_chat_files(directory)
    (directory / "chat_template.jinja").write_text(CHATML)
    (directory / "tokenizer.json").unlink()
    with pytest.raises(DataError, match=r"tokenizer\.json: cannot be read"):
        load_chat_files(directory)


# --- Reading chat JSONL --------------------------------------------------------------------------------


GOOD = json.dumps({"messages": CHATS[0]})


@pytest.mark.parametrize("line, match", [
    ("{\"messages\": [", r"is not JSON"),
    ("[1, 2]", r"holds a JSON list, expected an object"),
    ("{\"text\": \"hi\"}", r"has no \"messages\" key"),
    ("{\"messages\": []}", r"\"messages\" is an empty list"),
    ("{\"messages\": \"hi\"}", r"\"messages\" is a JSON str"),
    ("{\"messages\": [\"hi\"]}", r"messages\[0\] is a JSON str, expected an object"),
    ("{\"messages\": [{\"content\": \"hi\"}]}", r"messages\[0\] has no \"role\""),
    ("{\"messages\": [{\"role\": \"user\"}]}", r"messages\[0\] has no \"content\""),
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"assistant\", \"content\": 3}]}",
     r"messages\[1\]: \"content\" is a JSON int, expected a string"),
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}, {\"role\": \"bot\", \"content\": \"b\"}]}",
     r"messages\[1\]: unknown role 'bot'"),
    ("{\"messages\": [{\"role\": \"user\", \"content\": \"a\"}]}", r"has no assistant message"),
])
def test_a_bad_line_names_the_file_and_line(tmp_path, line, match):
    path = tmp_path / "chats.jsonl"
    path.write_text(f"{GOOD}\n\n   \n{line}\n{GOOD}\n", encoding="utf-8")
    with pytest.raises(DataError, match=rf"^{path}:4: {match}") as raised:
        read_chat_jsonl(path)
    assert "\n" not in str(raised.value)


def test_blank_lines_are_skipped_and_lines_numbered_from_one(tmp_path):
    path = tmp_path / "chats.jsonl"
    path.write_text(f"\n{GOOD}\n\n{json.dumps({'messages': CHATS[1], 'id': 7})}\n", encoding="utf-8")
    conversations = read_chat_jsonl(path)
    assert conversations == [Conversation(CHATS[0], str(path), 2), Conversation(CHATS[1], str(path), 4)]
    assert conversations[1].where == f"{path}:4"
    path.write_text("\n \n")
    with pytest.raises(DataError, match="holds no conversations"):
        read_chat_jsonl(path)
    path.write_bytes(b"\xff\n")
    with pytest.raises(DataError, match="is not UTF-8"):
        read_chat_jsonl(path)


# --- Plain text -----------------------------------------------------------------------------------------


def test_text_documents_split_at_blank_lines_or_not_at_all(tmp_path):
    path = tmp_path / "texts.txt"
    path.write_text("first line\nsecond line\n\n  \nnext doc\r\n\n\nlast\n", encoding="utf-8")
    byte = ByteTokenizer()
    documents = text_documents(path, byte)
    assert [byte.decode(ids) for ids, _ in documents] == ["first line\nsecond line", "next doc", "last"]
    assert all(weights.tolist() == [1.0] * len(ids) for ids, weights in documents)
    (whole, _), = text_documents(path, byte, split="file")
    assert byte.decode(whole) == "first line\nsecond line\n\n  \nnext doc\n\n\nlast\n"
    path.write_text("\n\n")
    with pytest.raises(DataError, match="holds no text"):
        text_documents(path, byte)


# --- Packing -------------------------------------------------------------------------------------------


def test_a_small_packing_written_out():
    documents = [(np.array([11, 12, 13]), np.array([0, 1, 1.0])), (np.array([21, 22]), np.array([0, 0.5]))]
    packed = pack(documents, row_len=5, pad_id=0)
    # one row of 6 tokens: 11 12 13 21 22 0 (the longer document first)
    assert packed.inputs.tolist() == [[11, 12, 13, 21, 22]]
    assert packed.targets.tolist() == [[12, 13, 21, 22, 0]]
    assert packed.weights.tolist() == [[1, 1, 0, 0.5, 0]]
    assert packed.segment_ids.tolist() == [[1, 1, 1, 2, 2]]
    assert packed.positions.tolist() == [[0, 1, 2, 0, 1]]
    assert packed.placements.tolist() == [[0, 0, 0, 0, 3], [0, 3, 1, 0, 2]]
    assert packed.efficiency == 1.0


def test_packing_makes_every_prediction_once_and_none_across_documents():
    rng = np.random.default_rng(1)
    lengths = [1, 2, 3, 5, 8, 9, 17, 40, 41, 100, 7, 7, 7, 0]  # row_len + 1 = 9; 17, 40, 41, 100 are split
    documents = [(rng.integers(1, 50, n).astype(np.int32), rng.random(n).astype(np.float32)) for n in lengths]
    row_len = 8
    packed = pack(documents, row_len, pad_id=0, seed=3)
    rows = packed.inputs.shape[0]
    assert packed.inputs.shape == packed.targets.shape == packed.weights.shape == (rows, row_len)
    assert packed.skipped == 2 and packed.inputs.dtype == np.int32 and packed.weights.dtype == np.float32
    buffers = np.concatenate([packed.inputs, packed.targets[:, -1:]], axis=1)  # [R, T + 1]
    assert np.array_equal(buffers[:, 1:], packed.targets)

    made = {}  # (document, token index) -> times predicted
    expected_weights = np.zeros_like(packed.weights)
    filled = np.zeros(buffers.shape, bool)
    for row, offset, index, start, length in packed.placements.tolist():
        ids, weights = documents[index]
        assert 2 <= length <= row_len + 1
        assert buffers[row, offset:offset + length].tolist() == ids[start:start + length].tolist()
        assert not filled[row, offset:offset + length].any()
        filled[row, offset:offset + length] = True
        inputs = slice(offset, min(offset + length, row_len))  # the piece's input slots
        assert packed.positions[row, inputs].tolist() == list(range(inputs.stop - inputs.start))
        assert len(set(packed.segment_ids[row, inputs].tolist())) == 1
        for j in range(start + 1, start + length):  # the tokens this piece predicts
            made[index, j] = made.get((index, j), 0) + 1
            expected_weights[row, offset + j - start - 1] = weights[j]
    assert made == {(index, j): 1 for index, (ids, _) in enumerate(documents) if len(ids) >= 2
                    for j in range(1, len(ids))}
    np.testing.assert_array_equal(packed.weights, expected_weights)  # 0 across documents and at padding

    inputs_filled = filled[:, :-1]
    assert np.array_equal(packed.segment_ids > 0, inputs_filled)
    assert (packed.inputs[~inputs_filled] == 0).all() and (packed.positions[~inputs_filled] == 0).all()
    for row in packed.segment_ids:  # 1, 2, ... in order along the row, then padding
        used = row[row > 0]
        assert (np.diff(used) >= 0).all() and used[0] == 1 and set(np.diff(used).tolist()) <= {0, 1}
    assert packed.efficiency == pytest.approx(inputs_filled.mean())
    assert packed.efficiency > 0.8


def test_packing_is_a_function_of_the_seed():
    rng = np.random.default_rng(0)
    documents = [(rng.integers(1, 9, n), np.ones(n)) for n in rng.integers(2, 30, 60)]
    first, again, other = pack(documents, 16, seed=5), pack(documents, 16, seed=5), pack(documents, 16, seed=6)
    for name in ("inputs", "targets", "weights", "segment_ids", "positions", "placements"):
        assert np.array_equal(getattr(first, name), getattr(again, name))
    assert not np.array_equal(first.inputs, other.inputs)
    tokens = [np.sort(np.concatenate([p.inputs, p.targets[:, -1:]], axis=1), axis=None) for p in (first, other)]
    assert tokens[0].tolist() == tokens[1].tolist()  # the same tokens, placed otherwise


def test_packing_refuses_what_it_cannot_pack():
    with pytest.raises(ValueError, match="row_len must be at least 1"):
        pack([(np.arange(3), np.ones(3))], 0)
    with pytest.raises(ValueError, match="document 1: ids and weights must be 1-D and of one length"):
        pack([(np.arange(3), np.ones(3)), (np.arange(3), np.ones(2))], 4)
    with pytest.raises(ValueError, match="no document has two tokens or more"):
        pack([(np.arange(1), np.ones(1))], 4)


def test_conversations_longer_than_a_row_are_split_with_a_warning_dropped_or_refused():
    """They were split into pieces without a word (train.long_chats)."""
    from train.data.corpus import fit_long_chats
    weights = lambda n: np.r_[np.zeros(n // 2), np.ones(n - n // 2)].astype(np.float32)  # the second half counts
    documents = [(np.arange(n), weights(n)) for n in (8, 30, 9, 12)]  # block 8: rows of 9 tokens
    kept, warnings = fit_long_chats(documents, 8, "split", "chats.jsonl")
    assert kept is documents and len(warnings) == 1
    # conversations of 30 and 12 tokens are long; the predictions of their tokens 9 on lose the beginning:
    # 30: tokens 15..29 count and are cut (9 on); 12: tokens 6..11 count, 9..11 cut; 4 + 15 + 5 + 6 count in all.
    assert warnings[0] == ("chats.jsonl: 2 of 4 conversations are longer than train.block_size + 1 = 9 tokens (the "
                           f"longest 30): split into pieces of 9, and {18 / 30:.1%} of the predictions that count toward "
                           "the loss lose the conversation's beginning; raise train.block_size, or set "
                           "train.long_chats = \"drop\" or \"error\"")
    dropped, warnings = fit_long_chats(documents, 8, "drop", "chats.jsonl")
    assert [len(ids) for ids, _ in dropped] == [8, 9] and warnings[0].endswith("left out (train.long_chats = \"drop\")")
    with pytest.raises(DataError, match=r"conversation 2 is the first \(train.long_chats = \"error\"\)"):
        fit_long_chats(documents, 8, "error", "chats.jsonl")
    assert fit_long_chats(documents[:1], 8, "error", "chats.jsonl") == (documents[:1], [])
