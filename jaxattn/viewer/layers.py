"""What the viewer says about each layer, and how it shows a token.

`describe_layers(config)` reads `ModelConfig.layer_attention(i)` (an `AttentionSpec`) and the
model's head counts into one plain dict per layer: the kind (MHA, GQA, MQA or MLA), which query
heads share a key/value head, the local window, RoPE on or off, sinks and the logit soft cap,
with a one-line label such as "GQA 4q/2kv (q0-1 -> kv0, q2-3 -> kv1), local window 16, sinks".

`visible_token(text)` is a token as the page shows it: spaces, newlines, tabs and other
control characters drawn as visible symbols, so an all-whitespace token still has a shape.
"""

from __future__ import annotations

from jaxattn.config import ModelConfig

# How the page draws characters that have no shape of their own.
VISIBLE = {" ": "\u00b7", "\n": "\u23ce", "\t": "\u21e5", "\r": "\u240d", "\u00a0": "\u237d"}
EMPTY_TOKEN = "\u2205"  # a token that decodes to nothing (a piece of a multi-byte character)


def visible_token(text: str) -> str:
    """`text` with whitespace and control characters as visible symbols (space ·, newline ⏎, tab ⇥,
    other controls as their Unicode control pictures); an empty token is "∅"."""
    if not isinstance(text, str):
        raise TypeError(f"a token must be a str, got {type(text).__name__}")
    if not text:
        return EMPTY_TOKEN
    out = []
    for char in text:
        code = ord(char)
        if char in VISIBLE:
            out.append(VISIBLE[char])
        elif code < 0x20:
            out.append(chr(0x2400 + code))  # the control pictures block: U+2400 + code
        elif code == 0x7F:
            out.append("\u2421")
        else:
            out.append(char)
    return "".join(out)


def _runs(heads: list[int]) -> str:
    """[0, 1] -> "q0-1", [2] -> "q2" (a group of consecutive query heads)."""
    return f"q{heads[0]}" if len(heads) == 1 else f"q{heads[0]}-{heads[-1]}"


def _kind(config: ModelConfig) -> str:
    N, K = config.num_heads, config.num_kv_heads
    if config.mla is not None:
        return "MLA"
    if K == N:
        return "MHA"
    return "MQA" if K == 1 else "GQA"


def _heads_label(config: ModelConfig, kind: str) -> str:
    """The head part of a label: "MHA 4 heads", "GQA 4q/2kv (q0-1 -> kv0, q2-3 -> kv1)", ..."""
    N, K = config.num_heads, config.num_kv_heads
    if kind == "MLA":
        mla = config.mla
        return (f"MLA {N} heads (keys and values from one {mla.kv_lora_rank}-dim latent, "
                f"{mla.qk_rope_head_dim} shared rotary dims)")
    if kind == "MHA":
        return f"MHA {N} head{'s' if N != 1 else ''}"
    if kind == "MQA":
        return f"MQA {N}q/1kv (all query heads share kv0)"
    G = N // K
    groups = ", ".join(f"{_runs(list(range(k * G, (k + 1) * G)))} -> kv{k}" for k in range(K))
    return f"GQA {N}q/{K}kv ({groups})"


def describe_layer(config: ModelConfig, layer: int) -> dict:
    """One layer's description (see `describe_layers`)."""
    spec = config.layer_attention(layer)
    kind = _kind(config)
    N = config.num_heads
    K = N if kind == "MLA" else config.num_kv_heads
    parts = [_heads_label(config, kind)]
    if spec.window is not None:
        parts.append(f"local window {spec.window}")
    elif config.sliding_window is not None:
        parts.append("global")
    if config.positions == "rope" and not spec.rope:
        parts.append("no RoPE")
    if spec.sinks:
        parts.append("sinks")
    if spec.logits_soft_cap is not None:
        parts.append(f"soft cap {spec.logits_soft_cap:g}")
    return {
        "label": ", ".join(parts),
        "kind": kind,
        "num_heads": N,
        "num_kv_heads": K,
        "kv_of_head": [n // (N // K) for n in range(N)],
        "window": spec.window,
        "rope": bool(spec.rope),
        "sinks": bool(spec.sinks),
        "soft_cap": None if spec.logits_soft_cap is None else float(spec.logits_soft_cap),
    }


def describe_layers(model_config: ModelConfig) -> list[dict]:
    """Per layer, what the viewer labels it with:

    {"label": str, "kind": "MHA" | "GQA" | "MQA" | "MLA", "num_heads": N, "num_kv_heads": K,
    "kv_of_head": [the kv head of each query head], "window": W or None, "rope": bool,
    "sinks": bool, "soft_cap": float or None}. An MLA layer's heads each decompress their own
    keys and values from the shared latent, so K = N there. TypeError unless given a ModelConfig.
    """
    if not isinstance(model_config, ModelConfig):
        raise TypeError(f"model_config must be a jaxattn.ModelConfig, got {type(model_config).__name__}")
    return [describe_layer(model_config, i) for i in range(model_config.num_layers)]


def default_layers(num_layers: int, num_heads: int) -> list[dict]:
    """What the page knows of layers nobody described: their number only."""
    return [{"label": "", "kind": None, "num_heads": num_heads, "num_kv_heads": None, "kv_of_head": None,
             "window": None, "rope": None, "sinks": False, "soft_cap": None} for _ in range(num_layers)]


def check_layers(layers, num_layers: int, num_heads: int) -> list[dict]:
    """`layers` (None or one dict per layer, as `describe_layers` makes) checked against the weights'
    L and N; ValueError/TypeError naming `layers` otherwise. Returns plain JSON-ready dicts."""
    if layers is None:
        return default_layers(num_layers, num_heads)
    if not isinstance(layers, (list, tuple)):
        raise TypeError(f"layers must be a list of dicts (jaxattn.viewer.describe_layers) or None, "
                        f"got {type(layers).__name__}")
    if len(layers) != num_layers:
        raise ValueError(f"layers has {len(layers)} entries but weights have L={num_layers} layers")
    checked = []
    for i, layer in enumerate(layers):
        if not isinstance(layer, dict) or not isinstance(layer.get("label"), str):
            raise TypeError(f"layers[{i}] must be a dict with a str 'label', got {layer!r}")
        if layer.get("num_heads", num_heads) != num_heads:
            raise ValueError(f"layers[{i}] has num_heads={layer['num_heads']} but weights have N={num_heads} heads")
        kv_of_head = layer.get("kv_of_head")
        if kv_of_head is not None and len(kv_of_head) != num_heads:
            raise ValueError(f"layers[{i}]['kv_of_head'] has {len(kv_of_head)} entries for N={num_heads} heads")
        checked.append({**default_layers(1, num_heads)[0], **layer, "sinks": bool(layer.get("sinks", False))})
    return checked
