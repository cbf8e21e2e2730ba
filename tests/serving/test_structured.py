"""Structured outputs in the engine (`jaxattn.serving.structured`): a random model, whose every draw
would break the format, answers in the guide's language, over a BPE tokenizer whose tokens span
several characters (`structured_cases.bpe_tokenizer`).

* 50 schemas drawn from a fixed list of shapes: every answer parses and validates (`jsonschema`),
  ended by the guide ("stop"), with requests preempted and recomputed on the way;
* a regex, a choice, a Lark and a GBNF grammar and any JSON object, each once;
* a guide that does not compile is a RequestError naming "guide" when the request is added;
* a row without a guide draws the same tokens beside guided rows as alone, and no program is compiled.
"""

import json
import re

import jsonschema
import numpy as np
import pytest

from jaxattn.serving import (Engine, EngineConfig, Guide, GuideCompiler, RequestError, RequestLimits,
                             SamplingParams)
from jaxattn.serving.validation import check_request
from structured_cases import bpe_tokenizer, draw_schemas
from tests.serving.compiles import counting_compiles
from tiny_models import drawn_params, tiny_config

VOCAB = 320  # the tokenizer's ids and some padding ids no guide allows
# A small pool (24 pages of 8 tokens for 8 rows): long answers preempt the newest requests.
ENGINE = EngineConfig(max_seqs=8, page_size=8, chunk=16, prefill_rows=1, num_pages=24, decode_buckets=(8,),
                      short_chunk=0)


@pytest.fixture(scope="module")
def tokenizer():
    return bpe_tokenizer(VOCAB)


@pytest.fixture(scope="module")
def engine(tokenizer):
    config = tiny_config("mha", positions="rope", vocab_size=VOCAB, max_seq_len=256)
    compiler = GuideCompiler(tokenizer.to_str(), VOCAB, eos_token_ids=(0,))
    return Engine(drawn_params(config, seed=3, std=0.4), config, ENGINE, detokenize=tokenizer.decode,
                  guide_compiler=compiler)


def guided(guide: Guide, seed: int, max_tokens: int = 120) -> SamplingParams:
    return SamplingParams(temperature=1.0, seed=seed, max_tokens=max_tokens, stop_token_ids=(0,), guide=guide)


def test_fifty_random_schemas_always_validate_through_preemptions(engine, tokenizer):
    ids = tokenizer.encode('{"name": "Ada"}').ids
    assert len(ids) < 15 and max(len(tokenizer.decode([t])) for t in ids) >= 3  # tokens span characters
    schemas = draw_schemas(50, seed=0)
    prompt = tokenizer.encode("Answer in JSON:").ids
    preempted = engine.stats["preemptions"]
    requests = [engine.add_request(prompt, guided(Guide("json_schema", json.dumps(schema)), seed))
                for seed, schema in enumerate(schemas)]
    engine.run()
    for request, schema in zip(requests, schemas):
        text = tokenizer.decode(request.output_ids)
        assert request.finish_reason == "stop", (text, schema)
        jsonschema.validate(json.loads(text), schema)
    assert engine.stats["preemptions"] > preempted
    assert len({tokenizer.decode(r.output_ids) for r in requests}) > 40  # the draws differ: a real test
    engine.allocator.check_all_free()


@pytest.mark.parametrize("kind, spec, matches", [
    ("regex", r"[A-Z]{2}-[0-9]{3}", lambda text: re.fullmatch(r"[A-Z]{2}-[0-9]{3}", text)),
    ("choice", json.dumps(["red", "green", "dark blue"]), lambda text: text in ("red", "green", "dark blue")),
    ("lark", 'start: "(" NUMBER ("," NUMBER)~0..3 ")"\nNUMBER: /[0-9]{1,3}/',
     lambda text: re.fullmatch(r"\([0-9]{1,3}(,[0-9]{1,3}){0,3}\)", text)),
    ("gbnf", 'root ::= "answer: " ("yes" | "no") "."', lambda text: text in ("answer: yes.", "answer: no.")),
    ("json_object", "", lambda text: isinstance(json.loads(text), dict)),
])
def test_each_kind_of_guide_is_matched(engine, tokenizer, kind, spec, matches):
    prompt = tokenizer.encode("the quick brown fox").ids
    requests = [engine.add_request(prompt, guided(Guide(kind, spec), seed, max_tokens=150)) for seed in range(4)]
    engine.run()
    for request in requests:
        text = tokenizer.decode(request.output_ids)
        if kind != "json_object":  # any object may nest without end; it must still parse when it ends
            assert request.finish_reason == "stop", text
        if request.finish_reason == "stop":
            assert matches(text), text


@pytest.mark.parametrize("guide, message", [
    (Guide("json_schema", '{"type": "object", "properties": {"a": {"type": "nonsense"}}}'), "nonsense"),
    (Guide("json_schema", "[1, 2]"), "JSON object"),
    (Guide("json_schema", "{not json"), "json_schema guide cannot be compiled"),
    (Guide("regex", "a(b"), "unclosed group"),
    (Guide("choice", '"red"'), "list of non-empty strings"),
    (Guide("lark", "start: undefined_rule"), "undefined_rule"),
    (Guide("gbnf", "root ::= ("), "gbnf guide cannot be compiled"),
])
def test_a_guide_that_does_not_compile_is_refused_when_added(engine, guide, message):
    with pytest.raises(RequestError, match=message) as err:
        engine.add_request([1, 2, 3], guided(guide, 0))
    assert err.value.param == "guide"
    assert not engine.has_unfinished()


def test_an_engine_without_a_guide_compiler_refuses_guides():
    limits = RequestLimits(VOCAB, 256, num_pages=24, page_size=8, detokenizer=True, guides=False)
    with pytest.raises(RequestError, match="without its tokenizer's vocabulary") as err:
        check_request([1, 2], guided(Guide("regex", "a+"), 0), limits)
    assert err.value.param == "guide"


def test_unguided_rows_draw_as_alone_beside_guided_ones_and_nothing_compiles(engine, tokenizer):
    prompt = tokenizer.encode("ROMEO: But soft").ids
    plain = SamplingParams(temperature=0.0, max_tokens=12)
    alone = engine.generate([prompt], plain)[0]
    with counting_compiles() as compiles:
        schema = json.dumps(draw_schemas(1, seed=5)[0])
        beside = [engine.add_request(prompt, guided(Guide("json_schema", schema), seed)) for seed in range(3)]
        mixed = engine.add_request(prompt, plain)
        engine.run()
    assert mixed.output_ids == alone
    assert all(r.finish_reason == "stop" for r in beside)
    assert compiles == []
    assert engine.model_runner.masked_rows > 0 and np.isfinite(engine.model_runner.mask_seconds)
