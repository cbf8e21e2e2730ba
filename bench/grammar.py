"""Grammar engines for structured outputs, on the same schemas and one real tokenizer: llguidance and xgrammar.

    PYTHONPATH=$PWD .venv/bin/python bench/grammar.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf [--answers 3]
        [--threads 1] [--out bench/results/grammar]

The tokenizer is SmolLM2-135M's (a 49,152-token byte-level BPE), read from the GGUF file with
`jaxattn.gguf` (the one `python -m train.serve --gguf` builds); both engines read the same
tokenizer.json (xgrammar through a transformers fast tokenizer over it). For each of 10 schemas of
several shapes (flat, nested, arrays of objects, enums, bounded numbers, patterns, anyOf, a recursive
$ref, a wide object and any JSON object):

* compile: the seconds from the schema to a matcher ready to mask its first token, and apart the first
  mask's (llguidance builds its lexer lazily: part of its compile lands there) (llguidance:
  the grammar text, `validate_grammar` as the engine does, `LLMatcher`; xgrammar: `compile_json_schema`
  with no cache (a fresh `GrammarCompiler` per schema), `GrammarMatcher`). The engines' tokenizer set-up,
  once per tokenizer, is reported apart;
* mask: the seconds per step to fill one row's bitmask ([1, ceil(V/32)] int32), then consume the token,
  along --answers valid answers of the schema per engine (hand-written JSON, each tokenized with the
  tokenizer and replayed token by token; every token must be accepted), the first step apart. Median
  and p99 per step.

One row at a time, in the calling thread (--threads: xgrammar's compiler threads): the cost the
engine's host pays per constrained row per step. Writes
bench/results/grammar.json and grammar.md with the CPU named.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import cpu_cores, cpu_model, load_average, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PERSON = {"type": "object", "properties": {"name": {"type": "string"}, "age": {"type": "integer", "minimum": 0,
                                                                              "maximum": 150}},
          "required": ["name", "age"], "additionalProperties": False}
# name -> (schema, answers that validate)
SCHEMAS = {
    "flat": (PERSON, [{"name": "Ada Lovelace", "age": 36}, {"name": "Alan", "age": 41}]),
    "nested": ({"type": "object", "properties": {"user": PERSON, "active": {"type": "boolean"},
                                                 "address": {"type": "object", "properties": {
                                                     "city": {"type": "string"}, "zip": {"type": "string"}},
                                                     "required": ["city", "zip"]}},
                "required": ["user", "active", "address"]},
               [{"user": {"name": "Bo", "age": 7}, "active": True, "address": {"city": "Oslo", "zip": "0150"}}]),
    "array_of_objects": ({"type": "object", "properties": {"items": {"type": "array", "items": PERSON,
                                                                     "minItems": 1, "maxItems": 8}},
                          "required": ["items"]},
                         [{"items": [{"name": "A", "age": 1}, {"name": "B", "age": 2}, {"name": "C", "age": 3}]}]),
    "enum": ({"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]},
                                               "size": {"enum": ["S", "M", "L", "XL"]}},
              "required": ["color", "size"]}, [{"color": "green", "size": "XL"}]),
    "bounded_numbers": ({"type": "object", "properties": {
        "lat": {"type": "number", "minimum": -90, "maximum": 90},
        "lon": {"type": "number", "minimum": -180, "maximum": 180},
        "count": {"type": "integer", "minimum": 1, "maximum": 999}}, "required": ["lat", "lon", "count"]},
        [{"lat": 59.91, "lon": 10.75, "count": 12}]),
    "patterns": ({"type": "object", "properties": {
        "id": {"type": "string", "pattern": "^[A-Z]{2}-[0-9]{4}$"},
        "email": {"type": "string", "pattern": "^[a-z]+@[a-z]+\\.[a-z]{2,3}$"},
        "code": {"type": "string", "minLength": 3, "maxLength": 6}}, "required": ["id", "email", "code"]},
        [{"id": "AB-1234", "email": "ada@example.org", "code": "x7y9"}]),
    "any_of": ({"type": "object", "properties": {"value": {"anyOf": [{"type": "integer"}, {"type": "string"},
                                                                     {"type": "null"}]},
                                                 "tags": {"type": "array", "items": {"type": "string"}}},
                "required": ["value", "tags"]}, [{"value": None, "tags": ["a", "b"]}, {"value": 3, "tags": []}]),
    "recursive": ({"$defs": {"node": {"type": "object", "properties": {
        "label": {"type": "string"}, "children": {"type": "array", "items": {"$ref": "#/$defs/node"}}},
        "required": ["label", "children"]}}, "$ref": "#/$defs/node"},
        [{"label": "root", "children": [{"label": "a", "children": []}, {"label": "b", "children": []}]}]),
    "wide": ({"type": "object", "properties": {f"field_{i}": {"type": ["string", "integer", "boolean"][i % 3]}
                                               for i in range(30)},
              "required": [f"field_{i}" for i in range(30)]},
             [{f"field_{i}": ["text", i, True][i % 3] for i in range(30)}]),
    "json_object": ({"type": "object"}, [{"anything": [1, 2.5, "three", {"four": None}], "ok": False}]),
}


def tokenizer_of(gguf: str):
    """(tokenizer.json text, the model's vocabulary size, the end-of-sequence id) of the GGUF file."""
    from jaxattn.gguf import GGUFModel

    model = GGUFModel.open(gguf)
    tokenizer = model.tokenizer()
    return tokenizer.tokenizer.to_str(), int(model.hf_config()["vocab_size"]), tokenizer.eos_token_id


def answer_tokens(tokenizer_json: str, answers: list[dict]) -> list[list[int]]:
    """Each answer as the compact JSON the engine asks for (", " and ": "), tokenized."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_str(tokenizer_json)
    return [tokenizer.encode(json.dumps(a), add_special_tokens=False).ids for a in answers]


def bench_llguidance(tokenizer_json, vocab, eos, cases) -> dict:
    import llguidance
    import llguidance.numpy
    import numpy as np

    options = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}
    started = time.perf_counter()
    tokenizer = llguidance.LLTokenizer(tokenizer_json, n_vocab=vocab, eos_token=eos)
    setup = time.perf_counter() - started
    out = {}
    for name, (schema, answers) in cases.items():
        started = time.perf_counter()
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema, overrides=options)
        assert not llguidance.LLMatcher.validate_grammar(grammar, tokenizer)
        pristine = llguidance.LLMatcher(tokenizer, grammar, log_level=0)
        compile_s = time.perf_counter() - started
        bitmask = np.full((1, -(-vocab // 32)), -1, np.int32)
        steps = []
        for ids in answers:
            matcher = pristine.deep_copy()
            for token in ids:
                started = time.perf_counter()
                llguidance.numpy.fill_next_token_bitmask(matcher, bitmask, 0)
                accepted = matcher.consume_token(token)
                steps.append(time.perf_counter() - started)
                assert accepted and (bitmask[0, token // 32] >> (token % 32)) & 1, (name, matcher.get_error())
        out[name] = {"compile_s": compile_s, "first_mask_s": steps[0], "mask_steps": steps[1:]}
    return {"setup_s": setup, "schemas": out}


def bench_xgrammar(tokenizer_json, vocab, eos, threads, cases) -> dict:
    import torch
    import transformers
    import xgrammar
    from tokenizers import Tokenizer

    started = time.perf_counter()
    fast = transformers.PreTrainedTokenizerFast(tokenizer_object=Tokenizer.from_str(tokenizer_json))
    info = xgrammar.TokenizerInfo.from_huggingface(fast, vocab_size=vocab, stop_token_ids=[eos])
    setup = time.perf_counter() - started
    out = {}
    for name, (schema, answers) in cases.items():
        started = time.perf_counter()
        compiler = xgrammar.GrammarCompiler(info, max_threads=threads, cache_enabled=False)
        compiled = compiler.compile_json_schema(json.dumps(schema), any_whitespace=False, separators=(", ", ": "))
        pristine = xgrammar.GrammarMatcher(compiled)
        compile_s = time.perf_counter() - started
        bitmask = xgrammar.allocate_token_bitmask(1, vocab)
        steps = []
        for ids in answers:
            matcher = xgrammar.GrammarMatcher(compiled)
            for token in ids:
                started = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                accepted = matcher.accept_token(token)
                steps.append(time.perf_counter() - started)
                assert accepted and (int(bitmask[0, token // 32]) >> (token % 32)) & 1, name
        del pristine
        out[name] = {"compile_s": compile_s, "first_mask_s": steps[0], "mask_steps": steps[1:]}
    del torch
    return {"setup_s": setup, "schemas": out}


def summary(steps: list[float]) -> tuple[float, float]:
    ordered = sorted(steps)
    return statistics.median(ordered), ordered[min(len(ordered) - 1, int(0.99 * len(ordered)))]


def markdown(record: dict) -> str:
    engines = record["engines"]
    lines = [f"# Grammar engines on SmolLM2-135M's tokenizer (V = {record['vocab']})", "",
             f"{record['cpu']}, {record['threads']} compiler thread(s), load {record['load_average']}; "
             f"llguidance {record['versions']['llguidance']}, xgrammar {record['versions']['xgrammar']}. "
             "Compile: schema to a matcher (then the first mask, where lazy work lands). Mask: one row's "
             "bitmask filled and the token consumed, per later step of valid answers (median / p99).", "",
             "| schema | steps | llguidance compile ms (first mask) | xgrammar compile ms (first mask) "
             "| llguidance mask us (p99) | xgrammar mask us (p99) |", "| --- | ---: | ---: | ---: | ---: | ---: |"]
    for name in SCHEMAS:
        ll, xg = engines["llguidance"]["schemas"][name], engines["xgrammar"]["schemas"][name]
        (llm, llp), (xgm, xgp) = summary(ll["mask_steps"]), summary(xg["mask_steps"])
        lines.append(f"| {name} | {len(ll['mask_steps'])} | {ll['compile_s'] * 1e3:.1f} ({ll['first_mask_s'] * 1e3:.1f}) "
                     f"| {xg['compile_s'] * 1e3:.1f} ({xg['first_mask_s'] * 1e3:.1f}) "
                     f"| {llm * 1e6:.0f} ({llp * 1e6:.0f}) | {xgm * 1e6:.0f} ({xgp * 1e6:.0f}) |")
    for engine in ("llguidance", "xgrammar"):
        every = [s for case in engines[engine]["schemas"].values() for s in case["mask_steps"]]
        compiles = [case["compile_s"] for case in engines[engine]["schemas"].values()]
        median, p99 = summary(every)
        lines.append(f"| **{engine}, all** | {len(every)} | {statistics.median(compiles) * 1e3:.1f} (median) | | "
                     f"{median * 1e6:.0f} ({p99 * 1e6:.0f}) | |" if engine == "llguidance" else
                     f"| **{engine}, all** | {len(every)} | | {statistics.median(compiles) * 1e3:.1f} (median) | | "
                     f"{median * 1e6:.0f} ({p99 * 1e6:.0f}) |")
    lines += ["", f"Tokenizer set-up, once per server: llguidance {engines['llguidance']['setup_s']:.2f} s, "
                  f"xgrammar {engines['xgrammar']['setup_s']:.2f} s.", ""]
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", required=True, help="SmolLM2-135M's GGUF file (its tokenizer is read)")
    parser.add_argument("--answers", type=int, default=3, help="valid answers replayed per schema (at most its list)")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--out", default=str(RESULTS / "grammar"))
    args = parser.parse_args()
    from importlib.metadata import version

    tokenizer_json, vocab, eos = tokenizer_of(args.gguf)
    cases = {name: (schema, answer_tokens(tokenizer_json, answers[:args.answers]))
             for name, (schema, answers) in SCHEMAS.items()}
    engines = {"llguidance": bench_llguidance(tokenizer_json, vocab, eos, cases),
               "xgrammar": bench_xgrammar(tokenizer_json, vocab, eos, args.threads, cases)}
    record = {"cpu": cpu_model(), "cores": cpu_cores(), "load_average": load_average(), "threads": args.threads,
              "vocab": vocab, "versions": {"llguidance": version("llguidance"), "xgrammar": version("xgrammar")},
              "engines": engines}
    out = Path(args.out)
    write_results(out.parent, out.name, record, markdown(record))


if __name__ == "__main__":
    main()
