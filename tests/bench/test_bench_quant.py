"""bench/quant.py's pieces in this process, on a tiny Llama: the GGUF files it writes hold the weights
jaxattn reads, the bytes a token reads, the perplexity, the int8 cache's switch, the turns and the report."""

import json

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from bench import quant
from jaxattn import hf
from jaxattn.config import ModelConfig
from jaxattn.decoding import generate
from jaxattn.model import DecoderLM
from jaxattn.quantization import quantize
from jaxattn.serving import EngineConfig


def tiny(tied: bool = True) -> ModelConfig:
    return quant.quick_config().replace(vocab_size=300, d_model=64, num_layers=1, mlp_hidden=64, max_seq_len=16,
                                        tie_embeddings=tied)


def init(config: ModelConfig, seed: int = 0):
    return nn.unbox(jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(seed), jnp.zeros((1, 1), jnp.int32))["params"])


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    config = tiny()
    path = tmp_path_factory.mktemp("quant") / "tiny"
    hf.save_pretrained(path, config, init(config), overwrite=True)
    return path


@pytest.mark.parametrize("qtype,tolerance", [("F32", 1e-5), ("Q8_0", 0.02), ("Q4_0", 0.25)])
def test_the_gguf_files_hold_the_checkpoints_weights(checkpoint, tmp_path, qtype, tolerance):
    from jaxattn.gguf import load_gguf
    config, params = hf.load_pretrained(checkpoint)
    path = quant.write_gguf(checkpoint, tmp_path / f"m-{qtype}.gguf", qtype)
    read_config, read_params, _, _ = load_gguf(path)
    assert (read_config.num_heads, read_config.num_kv_heads, read_config.tie_embeddings) == (4, 2, True)
    ids = jnp.asarray(quant.prompts(2, 12, config.vocab_size), jnp.int32)
    expected = DecoderLM(config).apply({"params": params}, ids)
    got = DecoderLM(read_config).apply({"params": read_params}, ids)
    assert float(jnp.max(jnp.abs(got - expected))) <= tolerance * float(jnp.max(jnp.abs(expected)))
    # a tied file's token table is its head: a token reads every tensor; Q4_0 is 18 bytes a block of 32
    per_token = quant.gguf_bytes_per_token(path)
    floats = sum(np.prod(a.shape) for a in jax.tree.leaves(params))
    assert per_token == {"F32": 4 * floats}.get(qtype, per_token)
    if qtype == "Q4_0":
        assert per_token < floats * 18 / 32 + 4 * 64 * 4


@pytest.mark.parametrize("tied", [True, False])
def test_a_token_reads_every_weight_but_the_rows_of_a_table_it_only_looks_up(tied):
    config = tiny(tied)
    params = init(config)
    table = params["wte"]["embedding"]
    every = sum(x.nbytes for x in jax.tree.leaves(params))
    expected = every if tied else every - table.nbytes + table.nbytes // table.shape[0]
    assert quant.weight_bytes_per_token(params, config) == expected
    q = quantize(params, config, "int8:channel")
    kernels = [x for path, x in jax.tree_util.tree_leaves_with_path(params) if path[-1].key == "kernel"]
    saved = sum(k.nbytes - k.size - 4 * k.shape[1] for k in kernels)  # int8 values and a scale per column
    if tied:  # the head reads its int8 copy [D, V] (a scale per column), the table one row
        saved += table.nbytes - table.nbytes // table.shape[0] - (table.size + 4 * table.shape[0])
    assert quant.weight_bytes_per_token(q, config) == expected - saved


def test_perplexity_is_the_exponent_of_the_mean_cross_entropy_of_each_window():
    config = tiny()
    params = init(config)
    ids = np.random.default_rng(1).integers(0, config.vocab_size, 40)  # windows of 16, 16 and 8 tokens
    got = quant.perplexity(params, config, ids, batch=2)
    nll = []
    for start in range(0, 40, 16):
        window = ids[start:start + 16]
        logp = np.asarray(jax.nn.log_softmax(DecoderLM(config).apply({"params": params}, window[None])[0, :-1]))
        nll += list(-logp[np.arange(len(window) - 1), window[1:]])
    assert got["tokens"] == len(nll) == 15 + 15 + 7
    assert got["perplexity"] == pytest.approx(np.exp(np.mean(nll)), rel=1e-5)
    assert quant.perplexity(quantize(params, config, "int8"), config, ids)["perplexity"] == pytest.approx(
        got["perplexity"], rel=1e-2)


def test_the_perplexity_of_a_gguf_files_model_in_each_format_on_the_held_out_text(checkpoint, tmp_path):
    from jaxattn import with_fused_qkv
    from jaxattn.gguf import load_gguf
    path = quant.write_gguf(checkpoint, tmp_path / "m-Q8_0.gguf", "Q8_0")
    text = tmp_path / "text.txt"
    text.write_text("First Citizen: before we proceed any further, hear me speak. " * 8)
    spec = {"gguf": str(path), "data": str(text), "formats": ["float32", "int8", "int8:channel", "kept"],
            "max_tokens": 40, "window": 8}
    got = quant.run_perplexity(spec)
    assert got["model"]["window"] == 8 and list(got["results"]) == ["float32", "int8", "int8:channel", "kept"]
    config, params, tokenizer, _ = load_gguf(path)  # float32: the file's weights as loaded, q, k and v fused
    params, config = with_fused_qkv(params, config)
    ids = tokenizer.encode(text.read_text())
    val = np.asarray(ids[int(len(ids) * 0.9):][:41])  # the last 10% (the corpus's val split), 40 predicted at most
    expected = quant.perplexity(params, config, val, window=8)
    assert got["val_tokens"] == 41 and got["results"]["float32"]["tokens"] == expected["tokens"] == 5 * 7
    assert got["results"]["float32"]["perplexity"] == pytest.approx(expected["perplexity"], rel=1e-6)
    grouped, per_channel = (got["results"][mode]["perplexity"] for mode in ("int8", "int8:channel"))
    assert grouped != per_channel and grouped == pytest.approx(expected["perplexity"], rel=1e-2)
    # the Q8_0 blocks kept are int8 in groups of 32 with the file's own numbers: the same weights again
    assert got["results"]["kept"]["perplexity"] == pytest.approx(grouped, rel=1e-6)


@pytest.mark.parametrize("target", [generate, EngineConfig])
def test_the_int8_cache_is_asked_for_by_one_keyword(target):
    assert quant.cache_options("float", target) == ({}, None)
    assert quant.cache_options("int8", target) == ({"kv_cache": "int8"}, None)


def test_a_target_without_the_keyword_makes_the_cell_unavailable_naming_it():
    options, reason = quant.cache_options("int8", lambda params: None)
    assert options is None and quant.CACHE_KEYWORD in reason and "int8" in reason


def test_the_cells_run_in_turns_and_a_cell_that_cannot_run_is_not_run_again(monkeypatch):
    specs = [{"runner": "jax", "weights": w, "cache": "float", "batch": 1, "threads": 1} for w in ("a", "b")]
    specs.append({"runner": "jax", "weights": "c", "cache": "int8", "batch": 1, "threads": 1})
    order = []

    def call(function, spec, **_):
        order.append(spec["weights"])
        if spec["weights"] == "c":
            return {"available": False, "reason": "no int8 cache"}
        return {"available": True, "tokens_per_s": 10.0 if spec["weights"] == "a" else 30.0}
    monkeypatch.setattr(quant.fresh, "call", call)
    cells = quant.measure(specs, rounds=3, timeout=1)
    assert order == ["a", "b", "c", "b", "a", "a", "b"]
    assert cells["jax c int8 b1"]["unavailable"] == "no int8 cache"
    rows, _ = quant.summarize(cells, {})
    assert [r.get("tokens_per_s") for r in rows] == [10.0, 30.0, None]


def test_the_report_holds_every_cell_and_the_checks(tmp_path):
    rows = [{"runner": "jax", "weights": w, "cache": "float", "batch": 1, "tokens_per_s": t,
             "weight_bytes_per_token": 1e6} for w, t in (("float32", 10.0), ("int8", 30.0), ("int4", 41.0))]
    rows += [{"runner": "llamacpp", "weights": "Q8_0", "cache": "float16", "batch": 1, "tokens_per_s": 20.0},
             {"runner": "jax", "weights": "int8", "cache": "int8", "batch": 1, "unavailable": "no int8 cache"}]
    ppl = {"available": True, "model": {"d_model": 8, "num_layers": 1, "num_heads": 1, "vocab_size": 65,
                                        "max_seq_len": 16, "tie_embeddings": True},
           "results": {"float32": {"perplexity": 5.0, "tokens": 100}, "int8": {"perplexity": 5.06, "tokens": 100},
                       "int4": {"perplexity": 5.2, "tokens": 100}}}
    checks = {c["what"].split(":")[0]: c for c in quant.checks(rows, ppl)}
    int8 = checks["int8 (groups of 32) weights, batch 1"]
    assert int8["value"] == pytest.approx(3.0) and int8["holds"]
    assert checks["int4 (groups of 32) weights, batch 1"]["holds"]  # 4.1x
    assert [c["value"] for c in quant.checks(rows, ppl) if c["what"].startswith("moonshot")] == [
        pytest.approx(1.5), None, None]  # int8 over Q8_0; no Q4_0 or Q4_1 cell
    assert [c["holds"] for c in quant.checks(rows, ppl) if "perplexity" in c["what"]] == [False, True]
    assert [c["holds"] for c in quant.checks(rows, None) if "Q4_0" in c["what"] or "perplexity" in c["what"]] == [
        None] * 3
    meta = {"machine_line": "a CPU", "model": "m", "prompt_len": 16, "new_tokens": 8, "threads": 2, "calls": 1,
            "rounds": 1, "stream_gb_per_s": 20.0, "perplexity_checkpoint": "run", "command": "python bench/quant.py"}
    text = quant.markdown({"meta": meta, "rows": rows, "perplexity": ppl, "checks": quant.checks(rows, ppl)})
    assert "# Quantized decoding on a CPU" in text and "unavailable: no int8 cache" in text
    assert "| jaxattn generate | int8 (groups of 32) | float | 1 | 30.0 | 3.00x |" in text
    assert "| int8 (groups of 32) | 5.0600 | +1.20% |" in text
    json.dumps(quant.checks(rows, ppl))  # JSON-able


def test_each_cpu_class_keeps_its_own_table_and_the_classes_not_measured_are_named(tmp_path):
    from bench.machine import cpu_class
    assert cpu_class({"avx2", "fma"}) == ("avx2", "AVX2 only (no AVX-512)")
    assert cpu_class({"avx2", "avx_vnni"})[0] == "avx_vnni"
    assert cpu_class({"avx2", "avx512f", "avx512_vnni", "amx_int8"})[0] == "amx"
    assert cpu_class({"asimd", "asimddp"})[0] == "arm_dotprod" and cpu_class(set())[0] == "scalar"
    rows = [{"runner": "jax", "weights": "float32", "cache": "float", "batch": 1, "tokens_per_s": 10.0}]
    for slug, words, speed in (("avx2", "AVX2 only (no AVX-512)", 10.0), ("avx512_vnni", "AVX-512 with VNNI", 20.0)):
        meta = {"machine_line": f"a {slug} CPU", "machine": {"cpu_class": words}, "model": "m", "prompt_len": 16,
                "new_tokens": 8, "threads": 2, "calls": 1, "rounds": 1, "stream_gb_per_s": 20.0,
                "command": "python bench/quant.py"}
        record = {"meta": meta, "rows": [{**rows[0], "tokens_per_s": speed}], "perplexity": None, "checks": []}
        (tmp_path / f"quant_{slug}.json").write_text(json.dumps(record))
    (tmp_path / "quant_matmul.json").write_text("{}")  # another benchmark's file is not a class
    records = quant.class_tables(quant.class_results(tmp_path))
    assert records.index("## AVX-512 with VNNI: a avx512_vnni CPU") < records.index("## AVX2 only (no AVX-512): a avx2")
    assert "| jaxattn generate | float32 | float | 1 | 20.0 |" in records and "### Checks against the targets" in records
    not_measured = records.split("Not measured: ")[1].split("\n")[0]
    assert "ARM NEON with the dot-product extension" in not_measured and "AVX2 only" not in not_measured
