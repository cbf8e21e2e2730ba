"""jaxattn.viewer and `python -m train.attention_maps --html` on the Python side (no browser).

The page is one file that fetches nothing; the weights it embeds, decoded, are the model's
(`jaxattn.attention_weights`) within the byte's 0.5/255 for MHA, GQA and MLA models, with each
row's sink weight for a model with sinks; layers are labelled with their kind; bad input is one
error naming the argument. tests/viewer/test_viewer_browser.py drives the same pages in Chromium.
"""

from __future__ import annotations

import base64
import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import viewer
from jaxattn.config import LayerKind, MLAConfig, ModelConfig
from jaxattn.model import DecoderLM, attention_weights
from train import attention_maps
from train.models.fresh import fresh_params
from train.models.load import load_model

VOCAB = 11
TOKENS = ["a", " ", "<c>", "\n", "&", "\t", "'", '"', "</script>", "<!--", "b", "c"]  # HTML's specials as text
T = len(TOKENS)
TOL = 0.5 / 255 + 1e-6
FORBIDDEN = ("http://", "https://", "src=", "<link", "import(", "fetch(", "XMLHttpRequest", "@import")
LOCAL, GLOBAL, NOPE = LayerKind(local=True), LayerKind(), LayerKind(rope=False)
MLA = MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)
KINDS = {
    "mha": dict(),
    "gqa": dict(num_kv_heads=2, sliding_window=3, layer_pattern=(LOCAL, GLOBAL), attn_sinks=True),
    "mla": dict(mla=MLA),
}


def tiny(**changes) -> ModelConfig:
    return ModelConfig(**{**dict(vocab_size=VOCAB, d_model=16, num_layers=2, num_heads=4, max_seq_len=16,
                                 positions="rope", mlp_hidden=32), **changes})


def data_of(page: str) -> dict:
    """The JSON the page embeds."""
    found = re.findall(r'<script type="application/json" id="jaxattn-data">(.*?)</script>', page, re.S)
    assert len(found) == 1
    return json.loads(found[0])


def decoded(data: dict, key: str = "weights") -> np.ndarray:
    shape = (data["L"], data["N"], data["T"], data["S"])[: 4 if key == "weights" else 3]
    return np.frombuffer(base64.b64decode(data[key]), np.uint8).reshape(shape) / 255.0


@pytest.fixture(scope="module", params=list(KINDS))
def model(request):
    """(kind, config, params, ids, reference weights [L, N, T, T], page), compiled once per kind."""
    config = tiny(**KINDS[request.param])
    params = nn.unbox(DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"])
    params = jax.tree.map(lambda x: 3.0 * x if x.ndim >= 2 else x, params)  # sharper rows
    ids = np.asarray(jax.random.randint(jax.random.PRNGKey(1), (T,), 0, VOCAB))
    _, per_layer = attention_weights(DecoderLM(config), {"params": params}, jnp.asarray(ids)[None])
    reference = np.stack([np.asarray(w[0], np.float32) for w in per_layer])
    page = viewer.model_attention_page(config, params, ids, TOKENS, title="tiny <b>&</b>")
    return request.param, config, params, ids, reference, page


def test_the_page_is_self_contained_and_holds_the_models_weights(model):
    kind, config, _, _, reference, page = model
    assert [word for word in FORBIDDEN if word in page] == []
    assert page.count("</script>") == 2 and page.count("<script") == 2  # the tokens closed nothing
    assert "<b>&</b>" not in page and "tiny &lt;b&gt;&amp;&lt;/b&gt;" in page
    data = data_of(page)
    assert {k: data[k] for k in ("version", "L", "N", "T", "S", "encoding")} == dict(
        version=1, L=2, N=4, T=T, S=T, encoding="uint8")
    assert data["tokens"] == TOKENS and data["title"] == "tiny <b>&</b>"
    assert data["layers"] == viewer.describe_layers(config)
    assert reference.shape == (2, 4, T, T)
    assert np.abs(decoded(data) - reference).max() <= TOL
    assert np.all(np.triu(decoded(data), k=1) == 0)  # causal
    assert "viewer.js" not in page and "function drawHead" in page and "#head-canvas" in page  # inlined


def test_a_model_with_sinks_stores_each_rows_sink_weight(model):
    kind, config, _, _, reference, page = model
    data = data_of(page)
    if not config.attn_sinks:
        assert data["sink_weights"] is None
        np.testing.assert_allclose(reference.sum(-1), 1.0, rtol=1e-5)
        return
    sinks = decoded(data, "sink_weights")
    assert np.abs(sinks - (1.0 - reference.sum(-1))).max() <= TOL
    assert (1.0 - reference.sum(-1)).min() > 0.01  # the sinks take a visible share
    window = decoded(data)[0]  # layer 0 is local, window 3: each query sees itself and 2 before
    assert np.all(np.tril(window, k=-3) == 0) and np.any(np.tril(decoded(data)[1], k=-3) > 0)


def test_layers_are_described_by_kind():
    def labels(**changes):
        return [layer["label"] for layer in viewer.describe_layers(tiny(**changes))]

    mha = viewer.describe_layers(tiny())[0]
    assert mha == {"label": "MHA 4 heads", "kind": "MHA", "num_heads": 4, "num_kv_heads": 4,
                   "kv_of_head": [0, 1, 2, 3], "window": None, "rope": True, "sinks": False, "soft_cap": None}
    gqa = viewer.describe_layers(tiny(num_kv_heads=2))[1]
    assert gqa["label"] == "GQA 4q/2kv (q0-1 -> kv0, q2-3 -> kv1)"
    assert (gqa["kind"], gqa["num_kv_heads"], gqa["kv_of_head"]) == ("GQA", 2, [0, 0, 1, 1])
    mqa = viewer.describe_layers(tiny(num_kv_heads=1))[0]
    assert (mqa["kind"], mqa["kv_of_head"], mqa["label"]) == ("MQA", [0, 0, 0, 0], "MQA 4q/1kv (all query heads share kv0)")
    mla = viewer.describe_layers(tiny(mla=MLA))[0]
    assert mla["kind"] == "MLA" and mla["label"].startswith("MLA 4 heads") and "8-dim latent" in mla["label"]
    assert labels(sliding_window=5, layer_pattern=(LOCAL, GLOBAL)) == ["MHA 4 heads, local window 5",
                                                                       "MHA 4 heads, global"]
    assert labels(sliding_window=5) == ["MHA 4 heads, local window 5"] * 2  # every layer local
    assert labels(layer_pattern=(NOPE, GLOBAL)) == ["MHA 4 heads, no RoPE", "MHA 4 heads"]
    assert labels(positions="learned") == ["MHA 4 heads"] * 2  # no RoPE anywhere: nothing to point out
    assert labels(attn_sinks=True, attn_logits_soft_cap=30.0) == ["MHA 4 heads, sinks, soft cap 30"] * 2
    nope = viewer.describe_layers(tiny(layer_pattern=(NOPE, GLOBAL)))
    assert [layer["rope"] for layer in nope] == [False, True]
    with pytest.raises(TypeError, match="model_config must be a jaxattn.ModelConfig"):
        viewer.describe_layers({"num_heads": 4})


def test_tokens_are_shown_visibly():
    assert [viewer.visible_token(t) for t in (" ", "\n", "\t", "\r", "\x00", "", "a b", "<&>")] == [
        "\u00b7", "\u23ce", "\u21e5", "\u240d", "\u2400", "\u2205", "a\u00b7b", "<&>"]
    data = data_of(viewer.attention_page(np.eye(3, dtype=np.float32)[None, None], ["a", " ", "\n"]))
    assert data["tokens"] == ["a", " ", "\n"] and data["display"] == ["a", "\u00b7", "\u23ce"]
    assert data["layers"][0]["label"] == "" and data["sink_weights"] is None and data["title"] == ""


def test_quantisation_is_within_half_a_byte():
    rng = np.random.default_rng(0)
    w = rng.random((2, 3, 5, 5)).astype(np.float32)
    w /= w.sum(-1, keepdims=True)
    back = decoded(data_of(viewer.attention_page(w, list("abcde"))))
    assert np.abs(back - w).max() <= TOL
    assert np.array_equal(viewer.page.quantise(np.array([0.0, 0.5 / 255 - 1e-7, 1.0])), [0, 0, 255])


def test_cross_attention_pages_need_the_keys_tokens():
    w = np.full((1, 1, 2, 3), 1 / 3, np.float32)
    with pytest.raises(ValueError, match=r"S=3 keys but T=2 queries: give key_tokens"):
        viewer.attention_page(w, ["a", "b"])
    data = data_of(viewer.attention_page(w, ["a", "b"], key_tokens=["x", " ", "z"]))
    assert data["key_tokens"] == ["x", " ", "z"] and data["key_display"][1] == "\u00b7"


@pytest.mark.parametrize("weights,tokens,kwargs,error,words", [
    (np.zeros((2, 3, 3)), list("abc"), {}, ValueError, r"weights must be \[L, N, T, S\].*got shape \(2, 3, 3\)"),
    (np.zeros((1, 1, 3, 3)), list("ab"), {}, ValueError, r"tokens has 2 entries but weights \(1, 1, 3, 3\) have T=3"),
    (np.full((1, 1, 2, 2), np.nan), list("ab"), {}, ValueError, r"weights \(1, 1, 2, 2\) hold 4 NaN or infinite"),
    (np.full((1, 1, 2, 2), 2.0), list("ab"), {}, ValueError, r"weights must be attention weights in \[0, 1\]"),
    (np.full((1, 1, 2, 2), 0.9), list("ab"), {}, ValueError, "a row sums to 1.8"),
    (np.zeros((1, 1, 2, 2)), "ab", {}, TypeError, "tokens must be a list of str"),
    (np.zeros((1, 1, 2, 2)), ["a", 2], {}, TypeError, r"tokens\[1\] must be a str"),
    (np.zeros((1, 1, 2, 2)), list("ab"), {"layers": [{"label": "x"}] * 2}, ValueError,
     "layers has 2 entries but weights have L=1"),
    (np.zeros((1, 2, 2, 2)), list("ab"), {"layers": [{"label": "x", "num_heads": 4}]}, ValueError,
     r"layers\[0\] has num_heads=4 but weights have N=2"),
    (np.zeros((1, 1, 2, 2)), list("ab"), {"title": 3}, TypeError, "title must be a str"),
    ("weights", list("ab"), {}, TypeError, "weights must be a float array"),
])
def test_bad_input_is_one_error_naming_the_argument(weights, tokens, kwargs, error, words):
    with pytest.raises(error, match=words):
        viewer.attention_page(weights, tokens, **kwargs)


def test_more_tokens_than_the_viewer_shows_is_refused():
    n = viewer.MAX_TOKENS + 1
    with pytest.raises(ValueError, match=rf"weights: {n} queries \(T\) in weights \(1, 1, {n}, {n}\), more than the "
                                         rf"viewer shows \(MAX_TOKENS=2048\)"):
        viewer.attention_page(np.zeros((1, 1, n, n), np.float32), ["a"] * n)
    with pytest.raises(ValueError, match=rf"token_ids: {n} tokens, more than the viewer shows"):
        viewer.model_attention_page(tiny(), {}, np.zeros(n, np.int32), ["a"] * n)
    with pytest.raises(ValueError, match=r"token_ids must be in \[0, vocab_size=11\), got 0..11"):
        viewer.model_attention_page(tiny(), {}, np.array([0, 11]), ["a", "b"])
    with pytest.raises(ValueError, match=r"token_ids must be a non-empty 1-D integer array \[T\], got shape \(1, 2\)"):
        viewer.model_attention_page(tiny(), {}, np.array([[0, 1]]), ["a", "b"])
    with pytest.raises(ValueError, match="tokens has 1 entries but token_ids has 2 ids"):
        viewer.model_attention_page(tiny(), {}, np.array([0, 1]), ["a"])


def test_the_assets_are_plain_and_offline():
    from importlib import resources
    folder = resources.files("jaxattn.viewer")
    for name in ("viewer.js", "viewer.css"):
        text = folder.joinpath(name).read_text(encoding="utf-8")
        assert [word for word in FORBIDDEN if word in text] == [] and "</script" not in text.lower()
    script = folder.joinpath("viewer.js").read_text(encoding="utf-8")
    for name in ("layer-select", "head-select", "head-toggles", "readout",
                 "head-canvas", "matrix-canvas", "matrix-value", "layer-label", "jaxattnViewer", "dataset.ready"):
        assert name in script, name


# ----------------------------------------------------------------------------- the CLI

TEXT = "ROMEO:\nBut soft, what light through yonder window breaks?\n"
TINY_TOML = """base = "shakespeare_char_baby_gqa"

[model]
d_model = 16
num_layers = 2
num_heads = 4
num_kv_heads = 2
mlp_hidden = 32
max_seq_len = 16
sliding_window = 4
layer_pattern = [{local = true}, {}]
attn_sinks = true

[train]
block_size = 16
"""


def call(capsys, *argv):
    """(exit code or returned path, stdout, stderr) of `python -m train.attention_maps` in this process."""
    try:
        code = attention_maps.main(list(argv))
    except SystemExit as stop:
        code = stop.code
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return code, out, err


@pytest.fixture(scope="module")
def corpus(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("corpus") / "text.txt"
    path.write_text(TEXT * 4, encoding="utf-8")
    return path


@pytest.fixture(scope="module")
def tiny_toml(tmp_path_factory) -> Path:
    path = tmp_path_factory.mktemp("config") / "tiny_gqa.toml"
    path.write_text(TINY_TOML)
    return path


def test_random_init_writes_the_page_of_its_fresh_parameters(corpus, tiny_toml, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    text = TEXT[:24]  # longer than max_seq_len=16: fresh parameters take the text's length
    argv = ["--random-init", str(tiny_toml), "--data", str(corpus), "--seed", "3", "--text", text]
    code, out, err = call(capsys, *argv, "--html", "maps.html")
    assert code == Path("maps.html"), err
    assert not (tmp_path / "maps.png").exists()  # --html alone writes no PNG
    assert re.search(r"wrote maps\.html \([\d,]+ bytes\)", out)
    page = (tmp_path / "maps.html").read_text(encoding="utf-8")
    data = data_of(page)
    assert (data["L"], data["N"], data["T"]) == (2, 4, 24) and data["tokens"] == list(text)
    assert [layer["window"] for layer in data["layers"]] == [4, None] and data["layers"][0]["kind"] == "GQA"
    assert "random init, seed 3" in data["title"] and data["sink_weights"] is not None
    loaded = load_model(attention_maps.parse_args(argv).model_source)  # the program's loader, as it loads
    model_config, tokenizer = loaded.config, loaded.tokenizer
    assert model_config.vocab_size == len(set(corpus.read_text())) and tokenizer.decode(tokenizer.encode("ab")) == "ab"
    params = fresh_params(model_config.replace(max_seq_len=24), 3)
    reference = attention_maps.attention_weights(params, model_config.replace(max_seq_len=24), tokenizer.encode(text))
    assert np.abs(decoded(data) - reference).max() <= TOL


def test_random_init_with_a_named_config_and_both_outputs(corpus, tmp_path, capsys):
    png, html = tmp_path / "maps.png", tmp_path / "sub" / "maps.html"
    text_file = tmp_path / "text.txt"
    text_file.write_text("But soft\n", encoding="utf-8")
    code, out, err = call(capsys, "--random-init", "shakespeare_char_baby_mqa", "--data", str(corpus),
                          "--text-file", str(text_file), "--max-tokens", "5", "--html", str(html), "--out", str(png))
    assert code == png, err
    assert png.stat().st_size > 1000 and "--text-file has 9 tokens; keeping the first 5 (--max-tokens)" in out
    data = data_of(html.read_text(encoding="utf-8"))
    assert data["tokens"] == list("But s") and data["layers"][0]["kind"] == "MQA" and data["L"] == 4


def save_checkpoint(run_dir: Path, corpus: Path):
    """A checkpoint of a tiny model with random weights, saved as training saves it (nothing trains)."""
    from train.checkpoints.store import Checkpointer
    from train.config import load_config
    from train.data.tokenizer import CharTokenizer
    tokenizer = CharTokenizer.from_text(corpus.read_text())
    config = load_config(overrides=["model.d_model=16", "model.num_layers=2", "model.num_heads=2",
                                    "model.max_seq_len=16", "train.block_size=16",
                                    f"model.vocab_size={tokenizer.vocab_size}"])
    shapes = jax.eval_shape(lambda: DecoderLM(config.model).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32)))
    rng = np.random.default_rng(0)
    params = jax.tree.map(lambda x: rng.normal(0.0, 0.3, x.shape).astype(np.float32), nn.unbox(shapes["params"]))
    checkpointer = Checkpointer(run_dir)
    checkpointer.save("best", 1, {"params": params, "step": jnp.int32(1)}, config=config, tokenizer=tokenizer,
                      val_loss=2.0, best_val_loss=2.0)
    checkpointer.close()
    return config.model, params, tokenizer


def test_checkpoints_and_transformers_directories_give_pages_too(corpus, tmp_path, capsys):
    from train import export
    run_dir, hf = tmp_path / "run", tmp_path / "hf"
    config, params, tokenizer = save_checkpoint(run_dir, corpus)
    text = TEXT[:20]  # cut to max_seq_len=16, as the PNG is
    code, out, err = call(capsys, "--checkpoint", str(run_dir), "--text", text, "--html", str(tmp_path / "c.html"))
    assert code == tmp_path / "c.html", err
    assert "--text has 20 tokens; keeping the first 16 (max_seq_len)" in out
    data = data_of((tmp_path / "c.html").read_text(encoding="utf-8"))
    reference = attention_maps.attention_weights(params, config, tokenizer.encode(text[:16]))
    assert data["tokens"] == list(text[:16]) and np.abs(decoded(data) - reference).max() <= TOL
    assert export.main(["--checkpoint", str(run_dir), "--out", str(hf)]) == 0
    capsys.readouterr()
    code, out, err = call(capsys, "--hf", str(hf), "--text", text[:10], "--html", str(tmp_path / "h.html"))
    assert code == tmp_path / "h.html", err
    data = data_of((tmp_path / "h.html").read_text(encoding="utf-8"))
    assert data["tokens"] == list(text[:10]) and data["display"][6] == "\u23ce"  # the tokenizer's decoded pieces
    assert np.abs(decoded(data) - reference[:, :, :10, :10]).max() <= TOL  # the same model, exported


def test_cli_errors_are_one_line(corpus, tiny_toml, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)  # the outputs' checks probe the folder they would write in
    long = tmp_path / "long.txt"
    long.write_text("a" * 2100, encoding="utf-8")
    init = ["--random-init", str(tiny_toml), "--data", str(corpus)]
    for argv, code, words in [
        ([*init, "--text-file", str(long), "--html", "m.html"], 2,
         "--text-file has 2100 tokens; the HTML viewer shows at most 2048"),
        ([*init, "--html", "m.png"], 2, "--html m.png: the page's name must end in .html or .htm"),
        (["--checkpoint", "x", "--seed", "1"], 2, "--seed goes with --random-init"),
        (["--checkpoint", "x", "--data", "y"], 2, "--data goes with --random-init"),
        ([*init, "--text", "a", "--text-file", "b"], 2, "not allowed with argument"),
        ([*init, "--max-tokens", "0"], 2, "--max-tokens must be positive"),
        (["--random-init", "no_such_config"], 2, "--random-init: config 'no_such_config' not found"),
        ([*init, "--text", "a\u00e9", "--html", "m.html"], 2, "--text cannot be encoded"),
        ([*init, "--text-file", str(tmp_path / "missing.txt")], 1, "missing.txt: No such file or directory"),
        (["--random-init", str(tiny_toml), "--data", str(tmp_path / "none.txt")], 1, "none.txt' (from --data"),
        ([*init, "--html", str(long / "m.html")], 1, "--html"),
    ]:
        got, out, err = call(capsys, *argv)
        assert got == code and words in err, (argv, got, err)
        assert len(err.splitlines()) == 1 and err.startswith("error: "), err
