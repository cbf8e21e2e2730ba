"""One self-contained HTML page of attention weights: scripts, styles and data inline.

`attention_page(weights [L, N, T, S], tokens)` returns the page as a string (write it to a file,
or show it in a notebook with `IPython.display.HTML`). Nothing is fetched when it is opened: the
viewer's JavaScript and CSS (viewer.js, viewer.css beside this module) and the weights are all
inside. The weights are stored as one byte each, round(w * 255), base64 encoded in C order, so
every weight the page shows is within 0.5/255 of the model's and a 1024-token page of a
4-layer, 4-head model is about 22 MB. For layers with sinks (docs/theory.md §18) the page also
stores each row's sink weight, 1 minus the row's sum.

`model_attention_page(config, params, token_ids, tokens)` runs `jaxattn.attention_weights` on one
sequence and makes the page with `describe_layers(config)` as the layer labels.
"""

from __future__ import annotations

import base64
import functools
import html
import json
from importlib import resources

import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.viewer.layers import check_layers, describe_layers, visible_token

MAX_TOKENS = 2048  # the most queries or keys a page shows (a [T, S] head at one byte a weight)
DATA_ID = "jaxattn-data"
TOLERANCE = 1e-3  # how far outside [0, 1] a weight (or a row's sum) may stray through rounding


def _asset(name: str) -> str:
    return resources.files("jaxattn.viewer").joinpath(name).read_text(encoding="utf-8")


def _check_tokens(tokens, count: int, argument: str, against: str) -> list[str]:
    """`tokens` as a list of `count` str; `against` says where the count comes from."""
    if isinstance(tokens, str) or not isinstance(tokens, (list, tuple)):
        raise TypeError(f"{argument} must be a list of str (one per token), got {type(tokens).__name__}")
    if len(tokens) != count:
        raise ValueError(f"{argument} has {len(tokens)} entries but {against}")
    bad = [i for i, token in enumerate(tokens) if not isinstance(token, str)]
    if bad:
        raise TypeError(f"{argument}[{bad[0]}] must be a str, got {type(tokens[bad[0]]).__name__}")
    return list(tokens)


def _check_limit(count: int, argument: str, what: str) -> None:
    if count > MAX_TOKENS:
        raise ValueError(f"{argument}: {count} {what}, more than the viewer shows (MAX_TOKENS={MAX_TOKENS}); "
                         f"give at most {MAX_TOKENS} tokens")


def _check_weights(weights) -> np.ndarray:
    """`weights` as float32 `[L, N, T, S]` in [0, 1]; ValueError/TypeError naming `weights` otherwise."""
    try:
        array = np.asarray(weights, dtype=np.float32)
    except (TypeError, ValueError) as err:
        raise TypeError(f"weights must be a float array [L, N, T, S], got {type(weights).__name__}: {err}") from None
    if array.ndim != 4:
        raise ValueError(f"weights must be [L, N, T, S] (4 dims: layers, heads, queries, keys), "
                         f"got shape {array.shape}")
    if 0 in array.shape:
        raise ValueError(f"weights must have no empty dim, got shape {array.shape}")
    _check_limit(array.shape[2], "weights", f"queries (T) in weights {array.shape}")
    _check_limit(array.shape[3], "weights", f"keys (S) in weights {array.shape}")
    finite = np.isfinite(array)
    if not finite.all():
        raise ValueError(f"weights {array.shape} hold {array.size - int(finite.sum())} NaN or infinite value(s)")
    low, high = float(array.min()), float(array.max())
    if low < -TOLERANCE or high > 1 + TOLERANCE:
        raise ValueError(f"weights must be attention weights in [0, 1], got values in [{low:g}, {high:g}]")
    top = float(array.sum(-1, dtype=np.float64).max())
    if top > 1 + TOLERANCE:
        raise ValueError(f"weights: a row sums to {top:g}; each row of attention weights sums to at most 1")
    return np.clip(array, 0.0, 1.0)


def quantise(values: np.ndarray) -> np.ndarray:
    """Values in [0, 1] as bytes round(v * 255): within 0.5/255 of the values."""
    return np.rint(np.clip(values, 0.0, 1.0) * 255.0).astype(np.uint8)


def _base64(values: np.ndarray) -> str:
    return base64.b64encode(np.ascontiguousarray(quantise(values)).tobytes()).decode("ascii")


def page_data(weights, tokens, *, layers=None, title: str = "", key_tokens=None) -> dict:
    """The JSON the page embeds (see `attention_page`), after checking every argument."""
    array = _check_weights(weights)
    L, N, T, S = array.shape
    if isinstance(tokens, (list, tuple)):
        _check_limit(len(tokens), "tokens", "tokens")
    tokens = _check_tokens(tokens, T, "tokens", f"weights {array.shape} have T={T} queries")
    if key_tokens is None:
        if S != T:
            raise ValueError(f"weights {array.shape} have S={S} keys but T={T} queries: give key_tokens "
                             "(S of them) for attention to another sequence")
        keys = tokens
    else:
        keys = _check_tokens(key_tokens, S, "key_tokens", f"weights {array.shape} have S={S} keys")
    if not isinstance(title, str):
        raise TypeError(f"title must be a str, got {type(title).__name__}")
    described = check_layers(layers, L, N)
    with_sinks = [i for i, layer in enumerate(described) if layer["sinks"]]
    sinks = None
    if with_sinks:
        sink = np.zeros((L, N, T), np.float32)
        sink[with_sinks] = 1.0 - array[with_sinks].sum(-1, dtype=np.float64)
        sinks = _base64(sink)
    data = {"version": 1, "L": L, "N": N, "T": T, "S": S, "tokens": tokens,
            "display": [visible_token(t) for t in tokens], "layers": described, "title": title,
            "encoding": "uint8", "weights": _base64(array), "sink_weights": sinks}
    if key_tokens is not None:
        data["key_tokens"] = keys
        data["key_display"] = [visible_token(t) for t in keys]
    return data


def _script_json(data: dict) -> str:
    """JSON safe inside a <script> element: no "<", ">" or "&" (they are \\u escapes in its strings)."""
    text = json.dumps(data, ensure_ascii=True, separators=(",", ":"), allow_nan=False)
    return text.replace("<", "\\u003c").replace(">", "\\u003e").replace("&", "\\u0026")


# The three views, their controls and the error line: the static body that viewer.js fills in.
_VIEWS = """<nav class="tabs" role="tablist">
<button type="button" id="tab-head" role="tab" aria-selected="true" aria-controls="view-head">Head view</button>
<button type="button" id="tab-model" role="tab" aria-selected="false" aria-controls="view-model">Model view</button>
<button type="button" id="tab-matrix" role="tab" aria-selected="false" aria-controls="view-matrix">Matrix view</button>
</nav>
<div class="controls">
<label class="control">Layer <select id="layer-select"></select></label>
<span class="control heads-control">Heads <span id="head-toggles"></span></span>
<label class="control">Matrix head <select id="head-select"></select></label>
</div>
<div id="layer-label" class="layer-label"></div>
<section id="view-head" class="view" role="tabpanel" aria-labelledby="tab-head">
<p class="hint">Hover a query (left) for where it looks, a key (right) for who looks at it; click to pin.</p>
<div id="head-panel" class="head-panel">
<div id="head-scroll" class="head-scroll">
<div id="head-rows" class="head-rows">
<div id="query-column" class="column queries"></div>
<div id="head-gap" class="gap"></div>
<div id="key-column" class="column keys"></div>
</div>
</div>
<canvas id="head-canvas"></canvas>
</div>
<div id="readout" class="readout" data-mode="none"></div>
</section>
<section id="view-model" class="view" role="tabpanel" aria-labelledby="tab-model" hidden>
<p class="hint">Every layer \u00d7 head; click one to open it in the matrix view.</p>
<div id="model-grid" class="model-grid"></div>
</section>
<section id="view-matrix" class="view" role="tabpanel" aria-labelledby="tab-matrix" hidden>
<div id="matrix-title" class="matrix-title"></div>
<div id="matrix-value" class="matrix-value">hover the map for a weight</div>
<div class="matrix-wrap"><canvas id="matrix-canvas"></canvas></div>
</section>
<div id="error" class="error" hidden></div>
"""


def render(data: dict) -> str:
    """The page of `page_data`'s dict."""
    title = data["title"] or "attention weights"
    summary = (f"{data['L']} layer{'s' * (data['L'] != 1)} \u00d7 {data['N']} head{'s' * (data['N'] != 1)}, "
               f"{data['T']} tokens; weights stored as bytes (\u00b10.5/255)")
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{html.escape(title)} \u2014 jaxattn viewer</title>
<style>
{_asset("viewer.css")}
</style>
</head>
<body>
<header>
<h1 id="title">{html.escape(title)}</h1>
<p id="summary">{html.escape(summary)}</p>
</header>
{_VIEWS}<script type="application/json" id="{DATA_ID}">{_script_json(data)}</script>
<script>
{_asset("viewer.js")}
</script>
</body>
</html>
"""


def attention_page(weights, tokens, *, layers=None, title: str = "", key_tokens=None) -> str:
    """One self-contained HTML page (head, model and matrix views) of attention weights.

    Args:
      weights: `[L, N, T, S]` attention weights (numpy or JAX; rows sum to at most 1, to 1 minus the
        sink's weight in a layer with sinks). T and S at most `MAX_TOKENS`.
      tokens: the T tokens as text (a tokenizer's decoded pieces); the page shows spaces,
        newlines and other invisible characters as symbols.
      layers: one dict per layer from `describe_layers(config)` (labels, kinds, GQA groups,
        windows, sinks), or None for unlabelled layers.
      title: shown at the top of the page.
      key_tokens: the S keys' tokens when they differ from the queries' (None: S == T, self-attention).

    Returns:
      The page: all of its JavaScript, CSS and data inline (`<script type="application/json"
      id="jaxattn-data">`), no URL, nothing fetched when opened (a file:// page works offline).

    ValueError or TypeError naming the argument for bad shapes, NaN, tokens that do not match the
    weights, or more than MAX_TOKENS tokens.
    """
    return render(page_data(weights, tokens, layers=layers, title=title, key_tokens=key_tokens))


@functools.lru_cache(maxsize=8)
def _weights_function(config: ModelConfig):
    """`(variables, token_ids [1, T]) -> tuple of [1, N, T, T]`, jitted once per config."""
    import jax

    import jaxattn
    from jaxattn.model import DecoderLM
    model = DecoderLM(config)
    return jax.jit(lambda variables, ids: jaxattn.attention_weights(model, variables, ids)[1])


def model_weights(model_config: ModelConfig, params, token_ids) -> np.ndarray:
    """Every layer's weights `[L, N, T, T]` float32 for one sequence of ids."""
    import jax.numpy as jnp
    weights = _weights_function(model_config)({"params": params}, jnp.asarray(token_ids, jnp.int32)[None])
    return np.stack([np.asarray(w[0], np.float32) for w in weights])


def model_attention_page(model_config: ModelConfig, params, token_ids, tokens, *, title: str = "") -> str:
    """`attention_page` of a model's weights on one sequence, labelled by `describe_layers(model_config)`.

    Args:
      model_config: the model's config (a `jaxattn.ModelConfig`).
      params: its parameters (the "params" collection of `DecoderLM(model_config)`).
      token_ids: `[T]` integer ids, T at most MAX_TOKENS (and the model's max_seq_len for
        learned or sinusoidal positions).
      tokens: the T tokens as text, e.g. `[tokenizer.decode([i]) for i in token_ids]`.
    """
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a jaxattn.ModelConfig, got {type(model_config).__name__}")
    ids = np.asarray(token_ids)
    if ids.ndim != 1 or ids.size == 0 or not np.issubdtype(ids.dtype, np.integer):
        raise ValueError(f"token_ids must be a non-empty 1-D integer array [T], got shape {ids.shape} "
                         f"of {ids.dtype}")
    _check_limit(ids.size, "token_ids", "tokens")
    if ids.min() < 0 or ids.max() >= model_config.vocab_size:
        raise ValueError(f"token_ids must be in [0, vocab_size={model_config.vocab_size}), "
                         f"got {ids.min()}..{ids.max()}")
    _check_tokens(tokens, ids.size, "tokens", f"token_ids has {ids.size} ids")
    weights = model_weights(model_config, params, ids)
    return attention_page(weights, tokens, layers=describe_layers(model_config), title=title)
