"""The attention viewer's page in headless Chromium, driven through the mouse with the network blocked.

Tiny MHA, GQA (2 key/value heads, local and global layers, sinks) and MLA models, randomly initialised
with their weight matrices spread (noise added) so that their rows differ between layers and heads by far more than the page's byte of
precision, are drawn by `jaxattn.viewer.model_attention_page`; the page, opened from a file in an offline
context (tests/browser.py), must show the weights `jaxattn.attention_weights` gives for the rows and
columns hovered, in the layer and head chosen, and in the matrix cell under the pointer. Every test ends
with no request other than the page's own file:// load and no console error.
"""

from __future__ import annotations

import base64
import dataclasses
import json
import re
from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn.config import LayerKind, MLAConfig, ModelConfig
from jaxattn.model import DecoderLM, attention_weights

pytestmark = pytest.mark.slow  # every test drives a Chromium it launches

VOCAB = 13
TOKENS = list("ROMEO:<b>&'\" so!")  # HTML's special characters must show as text
T = len(TOKENS)
TOL = 0.5 / 255 + 1e-4  # a byte per weight, printed with 4 decimals
APART = 0.02  # two rows compared must differ by this much, so that showing the wrong one fails
SPREAD = 0.3  # std of the normal noise added to every weight matrix: rows far from uniform, heads and layers apart
LOCAL, GLOBAL = LayerKind(local=True), LayerKind()
KINDS = {
    "mha": dict(num_layers=2),
    "gqa": dict(num_layers=3, num_kv_heads=2, sliding_window=4, layer_pattern=(LOCAL, GLOBAL), attn_sinks=True),
    "mla": dict(num_layers=2, mla=MLAConfig(kv_lora_rank=8, qk_nope_head_dim=4, qk_rope_head_dim=4, v_head_dim=4)),
}
VALUE = re.compile(r"^[01]\.\d{4}$")


@dataclasses.dataclass(frozen=True)
class Built:
    kind: str
    config: ModelConfig
    weights: np.ndarray  # [L, N, T, S] float32, from jaxattn.attention_weights
    html: str
    path: Path

    @property
    def shape(self):
        return self.weights.shape


def config_for(kind: str) -> ModelConfig:
    return ModelConfig(vocab_size=VOCAB, d_model=16, num_heads=4, max_seq_len=T, positions="rope",
                       norm="rmsnorm", mlp="gelu", mlp_hidden=32, **KINDS[kind])


@pytest.fixture(scope="module", params=list(KINDS))
def built(request, chromium, tmp_path_factory) -> Built:
    """One tiny model per kind, its reference weights and its page (each compiled once per module, after
    `chromium` has skipped where there is no browser)."""
    from jaxattn import viewer

    kind = request.param
    config = config_for(kind)
    model = DecoderLM(config)
    params = nn.unbox(model.init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))["params"])
    leaves, tree = jax.tree.flatten(params)
    keys = jax.random.split(jax.random.PRNGKey(2), len(leaves))
    params = tree.unflatten([x + SPREAD * jax.random.normal(k, x.shape) if x.ndim >= 2 else x
                             for k, x in zip(keys, leaves)])
    ids = [int(i) for i in jax.random.randint(jax.random.PRNGKey(1), (T,), 0, VOCAB)]
    _, per_layer = jax.jit(lambda p, t: attention_weights(model, {"params": p}, t))(params, jnp.asarray([ids]))
    weights = np.stack([np.asarray(w[0], np.float32) for w in per_layer])
    assert weights.shape == (config.num_layers, config.num_heads, T, T)
    html = viewer.model_attention_page(config, params, ids, TOKENS, title=f"tiny {kind}")
    path = tmp_path_factory.mktemp(f"viewer-{kind}") / "page.html"
    path.write_text(html, encoding="utf-8")
    return Built(kind, config, weights, html, path)


@pytest.fixture()
def page(built, offline_page):
    offline_page.open(built.path)
    return offline_page.page


# ----------------------------------------------------------------------------- reading the page back

READOUT = """() => { const r = document.getElementById('readout'); if (!r) return null; const d = r.dataset;
  return {mode: d.mode ?? null, layer: d.layer ?? null, head: d.head ?? null, index: d.index ?? null,
          sink: d.sink ?? null, spans: Array.from(r.querySelectorAll('span.w'), s => [s.dataset.key ?? null,
          s.dataset.query ?? null, s.dataset.value ?? null])}; }"""
INK = """(c) => { const ctx = c.getContext('2d'); if (!ctx || !c.width || !c.height) return -1;
  const d = ctx.getImageData(0, 0, c.width, c.height).data; let n = 0;
  for (let i = 3; i < d.length; i += 4) n += d[i] > 0; return n; }"""


def readout(page) -> dict:
    return page.evaluate(READOUT)


def wait_readout(page, mode: str, layer: int, head: int, index: int) -> dict:
    """The readout once it shows (mode, layer, head, index); fails with what it shows instead."""
    want = {"mode": mode, "layer": str(layer), "head": str(head), "index": str(index)}
    try:
        page.wait_for_function("""(w) => { const r = document.getElementById('readout');
            return r !== null && Object.entries(w).every(([k, v]) => r.dataset[k] === v); }""", arg=want, timeout=5000)
    except Exception:  # noqa: BLE001  (a Playwright timeout: report what the page shows)
        pass
    shown = readout(page)
    assert shown is not None, "no #readout"
    assert {k: shown[k] for k in want} == want
    return shown


def values_of(shown: dict, attribute: str) -> dict[int, float]:
    """{index: value} of the readout's spans, each keyed by `attribute` ("key" or "query")."""
    column = {"key": 0, "query": 1}[attribute]
    values = {}
    for span in shown["spans"]:
        assert span[column] is not None, f"a span without data-{attribute}: {span}"
        assert span[2] is not None and VALUE.match(span[2]), f"data-value {span[2]!r} is not printed with 4 decimals"
        values[int(span[column])] = float(span[2])
    return values


def assert_shows(shown: dict[int, float], expected: np.ndarray, what: str) -> None:
    assert sorted(shown) == list(range(len(expected))), f"{what}: one span per index, got {sorted(shown)}"
    wrong = {i: (v, round(float(expected[i]), 5)) for i, v in shown.items() if abs(v - expected[i]) > TOL}
    assert wrong == {}, f"{what}: (shown, model) beyond {TOL:.5f}"


def apart(a: np.ndarray, b: np.ndarray) -> None:
    """The two reference rows differ enough that the page showing one for the other would fail."""
    assert np.abs(a - b).max() > APART, "test models too uniform: raise SPREAD"


def hover(page, selector: str) -> None:
    """The pointer leaves for the layer label, then rests on `selector` (so enter/over events fire again)."""
    page.hover("#layer-label")
    page.hover(selector)


def hover_cell(page, q: int, k: int, T_: int, S: int) -> None:
    """The pointer on the centre of cell (q, k) of the T x S matrix canvas (scrolled into view first)."""
    box = page.locator("#matrix-canvas").bounding_box()
    page.hover("#matrix-canvas", position={"x": (k + 0.5) * box["width"] / S, "y": (q + 0.5) * box["height"] / T_})


def select_layer(page, layer: int) -> None:
    page.select_option("#layer-select", str(layer))


def checked_heads(page) -> list[int]:
    return page.evaluate("""() => Array.from(document.querySelectorAll('input.head-toggle'))
        .filter(e => e.checked).map(e => Number(e.dataset.head)).sort((a, b) => a - b)""")


def set_heads(page, heads: set[int]) -> None:
    """Clicks the head toggles until exactly `heads` are on (turning on before turning off)."""
    on = set(checked_heads(page))
    for head in sorted(heads - on) + sorted(on - heads):
        page.click(f"input.head-toggle[data-head='{head}']")
    assert checked_heads(page) == sorted(heads)


def hidden(page, selector: str) -> bool:
    return page.eval_on_selector(selector, "e => e.hidden || e.hasAttribute('hidden')")


def ink(page, selector: str) -> int:
    """Pixels drawn (alpha > 0) on a 2-D canvas; -1 when it has no 2-D context or no size."""
    return page.eval_on_selector(selector, INK)


# ----------------------------------------------------------------------------- the page


def test_the_page_is_one_file_holding_the_model_weights_and_fetching_nothing(built, offline_page):
    html = built.html
    assert re.findall(r"https?://|\bsrc\s*=|<link\b|@import|\bfetch\s*\(|XMLHttpRequest|\bimport\s*\(", html) == []
    match = re.search(r'<script type="application/json" id="jaxattn-data">(.*?)</script>', html, re.S)
    assert match, "no <script type=application/json id=jaxattn-data>"
    data = json.loads(match.group(1))
    L, N, T_, S = built.shape
    assert {k: data[k] for k in ("version", "L", "N", "T", "S", "encoding")} == dict(
        version=1, L=L, N=N, T=T_, S=S, encoding="uint8")
    assert data["tokens"] == TOKENS
    stored = np.frombuffer(base64.b64decode(data["weights"]), np.uint8).reshape(built.shape) / 255
    assert np.abs(stored - built.weights).max() <= TOL  # every row, not only those hovered below
    if built.config.attn_sinks:
        sinks = np.frombuffer(base64.b64decode(data["sink_weights"]), np.uint8).reshape(L, N, T_) / 255
        assert np.abs(sinks - (1 - built.weights.sum(-1))).max() <= TOL
    else:
        assert data["sink_weights"] is None
    page = offline_page.open(built.path)
    assert page.evaluate("() => window.jaxattnViewer") == dict(ready=True, L=L, N=N, T=T_, S=S)
    offline_page.assert_clean()


def test_every_token_and_a_drawn_thumbnail_per_layer_and_head(built, offline_page, page):
    L, N, T_, S = built.shape
    assert page.locator(".token.query").count() == T_ and page.locator(".token.key").count() == S
    for role, count in (("query", T_), ("key", S)):
        assert page.evaluate(f"() => Array.from(document.querySelectorAll('.token.{role}'), e => Number(e.dataset.index))"
                             ) == list(range(count))
    texts = page.locator(".token.query").all_text_contents()
    assert [t.strip() for t, tok in zip(texts, TOKENS) if tok.strip()] == [tok for tok in TOKENS if tok.strip()]
    assert page.locator("#view-head b").count() == 0  # "<b>" is a token, not markup
    assert page.locator("#layer-select option").count() == L and page.locator("#head-select option").count() == N
    assert page.locator("input.head-toggle").count() == N
    assert not hidden(page, "#view-head") and hidden(page, "#view-model") and hidden(page, "#view-matrix")
    page.click("#tab-model")
    assert hidden(page, "#view-head") and not hidden(page, "#view-model") and hidden(page, "#view-matrix")
    thumbs = page.locator("canvas.thumb")
    assert thumbs.count() == L * N
    cells = page.evaluate("() => Array.from(document.querySelectorAll('canvas.thumb'), "
                          "e => [Number(e.dataset.layer), Number(e.dataset.head)])")
    assert sorted(map(tuple, cells)) == [(layer, head) for layer in range(L) for head in range(N)]
    for i in range(L * N):  # drawn lazily: each once it is in view
        thumbs.nth(i).scroll_into_view_if_needed()
        page.wait_for_function(f"(c) => ({INK})(c) > 0", arg=thumbs.nth(i).element_handle(), timeout=5000)
    offline_page.assert_clean()


def test_hovering_a_query_shows_its_row_in_every_layer(built, offline_page, page):
    L, N, T_, S = built.shape
    head = checked_heads(page)[0]
    before = page.eval_on_selector("#head-canvas", "c => c.toDataURL()")
    for layer in range(L):
        select_layer(page, layer)
        assert page.locator("#layer-select").input_value() == str(layer)
        for t in (T_ - 1, T_ // 2):
            hover(page, f".token.query[data-index='{t}']")
            shown = wait_readout(page, "row", layer, head, t)
            assert_shows(values_of(shown, "key"), built.weights[layer, head, t], f"layer {layer} head {head} row {t}")
            if built.config.attn_sinks:
                assert shown["sink"] is not None and VALUE.match(shown["sink"]), "#readout data-sink"
                assert abs(float(shown["sink"]) - (1 - built.weights[layer, head, t].sum())) <= TOL
            if layer:  # what the previous layer showed for this row would be wrong here
                apart(built.weights[layer, head, t], built.weights[layer - 1, head, t])
        assert ink(page, "#head-canvas") > 0  # the lines are drawn
    assert page.eval_on_selector("#head-canvas", "c => c.toDataURL()") != before
    offline_page.assert_clean()


def test_turning_heads_off_and_on_moves_the_readout_to_the_first_selected_head(built, offline_page, page):
    L, N, T_, S = built.shape
    layer, t = L - 1, T_ - 2
    select_layer(page, layer)
    apart(built.weights[layer, 0, t], built.weights[layer, 1, t])
    for heads, first in (({1, N - 1}, 1), ({0, 1}, 0), ({N - 1}, N - 1)):
        set_heads(page, heads)
        hover(page, f".token.query[data-index='{t}']")
        shown = wait_readout(page, "row", layer, first, t)
        assert_shows(values_of(shown, "key"), built.weights[layer, first, t], f"heads {sorted(heads)} row {t}")
    offline_page.assert_clean()


def test_hovering_a_key_shows_its_column(built, offline_page, page):
    L, N, T_, S = built.shape
    head = checked_heads(page)[0]
    for layer, s in ((0, 1), (L - 1, S // 2)):
        select_layer(page, layer)
        hover(page, f".token.key[data-index='{s}']")
        shown = wait_readout(page, "col", layer, head, s)
        assert_shows(values_of(shown, "query"), built.weights[layer, head, :, s], f"layer {layer} column {s}")
    offline_page.assert_clean()


def test_clicking_a_token_pins_it_and_clicking_again_unpins(built, offline_page, page):
    L, N, T_, S = built.shape
    head = checked_heads(page)[0]
    t, other = T_ - 1, 3
    page.click(f".token.query[data-index='{t}']")
    for elsewhere in ("#layer-label", "#tab-head"):  # the pointer leaves: the pinned row stays
        page.hover(elsewhere)
        shown = wait_readout(page, "row", 0, head, t)
    assert_shows(values_of(shown, "key"), built.weights[0, head, t], f"pinned row {t}")
    page.click(f".token.query[data-index='{t}']")  # unpinned: hovering shows another row again
    hover(page, f".token.query[data-index='{other}']")
    assert_shows(values_of(wait_readout(page, "row", 0, head, other), "key"), built.weights[0, head, other], "row")
    offline_page.assert_clean()


def test_a_thumbnail_opens_its_matrix_and_the_pointer_reads_each_cell(built, offline_page, page):
    L, N, T_, S = built.shape
    layer, head = L - 1, N - 1
    page.click("#tab-model")
    page.click(f"canvas.thumb[data-layer='{layer}'][data-head='{head}']")
    assert hidden(page, "#view-head") and hidden(page, "#view-model") and not hidden(page, "#view-matrix")
    assert page.locator("#layer-select").input_value() == str(layer)
    assert page.locator("#head-select").input_value() == str(head)
    assert ink(page, "#matrix-canvas") > 0
    for head in (head, 0):
        page.select_option("#head-select", str(head))
        for q, k in ((T_ - 1, 0), (T_ - 1, S - 1), (T_ // 2, 3), (5, 5)):
            hover_cell(page, q, k, T_, S)
            cell = {"query": str(q), "key": str(k)}
            try:
                page.wait_for_function("""(w) => { const e = document.getElementById('matrix-value');
                    return e !== null && e.dataset.query === w.query && e.dataset.key === w.key; }""", arg=cell,
                                       timeout=5000)
            except Exception:  # noqa: BLE001  (reported below)
                pass
            shown = page.eval_on_selector("#matrix-value", "e => ({query: e.dataset.query, key: e.dataset.key, "
                                          "value: e.dataset.value, text: e.textContent})")
            assert {"query": shown["query"], "key": shown["key"]} == cell, f"cell under the pointer: {shown}"
            expected = built.weights[layer, head, q, k]
            assert VALUE.match(shown["value"]) and abs(float(shown["value"]) - expected) <= TOL, (shown, expected)
            assert shown["value"] in shown["text"] and f"q {q}" in shown["text"] and f"k {k}" in shown["text"]
    offline_page.assert_clean()


def test_each_layer_is_labelled_with_its_kind(built, offline_page, page):
    from jaxattn.viewer import describe_layers

    config, (L, N) = built.config, built.shape[:2]
    layers = describe_layers(config)
    labels = [layer["label"] for layer in layers]
    for i, layer in enumerate(layers):
        assert layer["num_heads"] == N and layer["num_kv_heads"] == config.num_kv_heads
        assert layer["kv_of_head"] == [n // (N // config.num_kv_heads) for n in range(N)]
        assert layer["window"] == config.layer_attention(i).window and layer["sinks"] == config.attn_sinks
        if built.kind == "gqa":
            assert layer["kind"] == "GQA" and "GQA 4q/2kv" in layer["label"]
            assert "q0-1 -> kv0" in layer["label"] and "q2-3 -> kv1" in layer["label"] and "sinks" in layer["label"]
            assert ("window 4" in layer["label"]) == (i % 2 == 0)
        else:
            assert layer["kind"] == built.kind.upper() and built.kind.upper() in layer["label"]
    assert page.locator("#layer-select option").all_text_contents() == [f"layer {i}: {x}" for i, x in enumerate(labels)]
    for i in reversed(range(L)):
        select_layer(page, i)
        assert labels[i] in page.locator("#layer-label").text_content()
    page.click("#tab-model")
    model_view = page.locator("#view-model").text_content()
    assert all(label in model_view for label in labels)
    offline_page.assert_clean()


def test_the_harness_records_every_request_and_error(offline_page, tmp_path):
    """What the checks above rely on: a page that fetches or fails is caught (its own file:// load is not)."""
    (tmp_path / "page.html").write_text("""<!doctype html><html><body>
<img src="https://example.invalid/a.png"><script src="beside.js"></script>
<script>
  fetch("http://127.0.0.1:9/data").catch(() => {});
  try { new WebSocket("ws://127.0.0.1:9/socket"); } catch (e) {}
  console.error("boom");
  setTimeout(() => { document.body.dataset.ready = "1"; throw new Error("uncaught"); }, 0);
</script></body></html>""")
    offline_page.open(tmp_path / "page.html")
    offline_page.page.wait_for_timeout(300)
    urls = " ".join(offline_page.requests)
    page_url = (tmp_path / "page.html").resolve().as_uri()
    for url in ("https://example.invalid/a.png", (tmp_path / "beside.js").resolve().as_uri(),
                "http://127.0.0.1:9/data", "ws://127.0.0.1:9/socket"):
        assert url in urls, offline_page.requests
    assert not any(r.split(" ", 1)[1] == page_url for r in offline_page.requests)
    errors = " ".join(offline_page.errors)
    assert "boom" in errors and "uncaught" in errors
    with pytest.raises(AssertionError):
        offline_page.assert_clean()
