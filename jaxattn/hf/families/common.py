"""What several families share: config.json readers and writers, per-layer attention, Llama-style tensors.

Readers take `Fields` (typed getters raising InvalidCheckpoint naming the key)
and raise UnsupportedCheckpoint through `reject`, naming the architecture and
the key. Writers return config.json keys transformers 5.23 reads back as the
same model. Layout helpers build `jaxattn.hf.weights.Entry` lists.
"""

from __future__ import annotations

from typing import Any, Callable, NoReturn, Sequence

from jaxattn.config import LayerKind, ModelConfig
from jaxattn.hf import weights as w
from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.family import Biases, Need, Problem, specs
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import Rope, read_rope, write_rope
from jaxattn.hf.weights import Entry
from jaxattn.rope import rotary_dims

TANH_GELU = ("gelu_new", "gelu_pytorch_tanh", "gelu_fast")
ERF_GELU = ("gelu",)
SILU = ("silu", "swish")
FULL, SLIDING = "full_attention", "sliding_attention"  # transformers' layer_types

# ---------------------------------------------------------------- reading config.json


def reject(architecture: str, field: str, value: Any, why: str) -> NoReturn:
    raise UnsupportedCheckpoint(f"{architecture}: {field}={value!r} is not supported ({why})")


def gelu_approximate(hf: Fields, architecture: str, field: str, default: str) -> bool:
    """A plain GELU MLP's activation: True for the tanh form, False for erf."""
    act = hf.text(field, default)
    if act not in TANH_GELU + ERF_GELU:
        reject(architecture, field, act, f"GELU MLPs take {TANH_GELU + ERF_GELU}")
    return act in TANH_GELU


def gated_mlp(hf: Fields, architecture: str, field: str = "hidden_act", default: str = "silu") -> dict[str, Any]:
    """`mlp` and `gelu_approximate` of a gated (gate/up/down) MLP from its activation key."""
    act = hf.text(field, default)
    if act in SILU:
        return dict(mlp="swiglu")
    if act in TANH_GELU + ERF_GELU:
        return dict(mlp="geglu", gelu_approximate=act in TANH_GELU)
    reject(architecture, field, act, f"gated MLPs take {SILU + TANH_GELU + ERF_GELU}")


def vocab(hf: Fields, *, max_positions: int, tie: bool) -> dict[str, Any]:
    return dict(vocab_size=hf.integer("vocab_size"), max_seq_len=hf.integer("max_position_embeddings", max_positions),
                tie_embeddings=hf.flag("tie_word_embeddings", tie))


def heads(hf: Fields, head_dim: int | None = None, kv_heads: int | None = None) -> dict[str, Any]:
    """Sizes of standard attention: d_model, num_layers, num_heads, num_kv_heads, head_dim (class defaults given)."""
    d, n = hf.integer("hidden_size"), hf.integer("num_attention_heads")
    return dict(d_model=d, num_layers=hf.integer("num_hidden_layers"), num_heads=n,
                num_kv_heads=hf.integer("num_key_value_heads", kv_heads or n),
                head_dim=hf.integer("head_dim", head_dim or d // n))


def rope_fields(architecture: str, rope: Rope, head_dim: int, *, partial: bool = False) -> dict[str, Any]:
    """RoPE's ModelConfig fields (half-split pairs); a partial rotary fraction only where `partial`."""
    fields = dict(positions="rope", rope_theta=rope.theta, rope_scaling=rope.scaling, rope_interleaved=False)
    if rope.fraction == 1.0:
        return fields
    if not partial:
        reject(architecture, "partial_rotary_factor", rope.fraction, "it rotates whole heads (1.0)")
    dims = int(head_dim * rope.fraction)
    if dims % 2 or not 0 < rope.fraction <= 1:  # transformers would rotate an odd number of dims
        reject(architecture, "partial_rotary_factor", rope.fraction,
               f"int(head_dim {head_dim} * factor) = {dims} rotated dims; jaxattn rotates pairs, up to the whole head")
    return dict(fields, rotary_fraction=rope.fraction)


def read_layer_types(hf: Fields, default: Callable[[int], list[str]], architecture: str) -> list[str]:
    """config.json's `layer_types` (else `default(num_hidden_layers)`), each full or sliding attention."""
    layers = hf.integer("num_hidden_layers")
    kinds = hf.texts("layer_types", None) or default(layers)
    unknown = sorted(set(kinds) - {FULL, SLIDING})
    if unknown:
        reject(architecture, "layer_types", unknown, f"only {FULL} and {SLIDING} layers exist here")
    if len(kinds) != layers:
        raise hf.invalid("layer_types", f"has {len(kinds)} entries for num_hidden_layers={layers}")
    return kinds


def one_layer_type(hf: Fields, architecture: str) -> None:
    """Refuses a `layer_types` mixing full and sliding layers in a family that ignores the key (one window for all)."""
    kinds = hf.texts("layer_types", None)
    if kinds and len(set(kinds)) > 1:
        reject(architecture, "layer_types", kinds, f"a mix of full and sliding-window layers, which transformers' "
               f"{architecture} ignores")


def periodic(kinds: Sequence[LayerKind]) -> tuple[LayerKind, ...]:
    """The shortest `layer_pattern` reproducing `kinds` (layer i is `pattern[i % len(pattern)]`)."""
    for period in range(1, len(kinds) + 1):
        if all(kind == kinds[i % period] for i, kind in enumerate(kinds)):
            return tuple(kinds[:period])
    return tuple(kinds)


def layer_fields(local: Sequence[bool], window: int | None, kinds: Sequence[dict] | None = None) -> dict[str, Any]:
    """`sliding_window` and `layer_pattern` of layers that are local (when a window is set) and otherwise
    differ by `kinds[i]` (LayerKind fields); an empty pattern when every layer is the default one."""
    local = [bool(is_local) and window is not None for is_local in local]
    window = window if any(local) else None
    pattern = periodic([LayerKind(local=is_local, **(kinds[i] if kinds else {})) for i, is_local in enumerate(local)])
    return dict(sliding_window=window, layer_pattern=() if pattern == (LayerKind(local=window is not None),)
                else pattern)


# ---------------------------------------------------------------- writing config.json and refusing


def sizes(c: ModelConfig) -> dict[str, Any]:
    return dict(hidden_size=c.d_model, num_hidden_layers=c.num_layers, num_attention_heads=c.num_heads,
                intermediate_size=c.mlp_hidden, max_position_embeddings=c.max_seq_len, attention_dropout=0.0)


def gqa_sizes(c: ModelConfig) -> dict[str, Any]:
    return dict(sizes(c), num_key_value_heads=c.num_kv_heads, head_dim=c.head_dim)


def gelu_name(c: ModelConfig) -> str:
    return "gelu_pytorch_tanh" if c.gelu_approximate else "gelu"


def gated_act(c: ModelConfig) -> str:
    return "silu" if c.mlp == "swiglu" else gelu_name(c)


def layer_types(c: ModelConfig) -> list[str]:
    return [FULL if spec.window is None else SLIDING for spec in specs(c)]


def rope_parameters(c: ModelConfig, *, partial: bool = False) -> dict[str, Any]:
    return write_rope(c.rope_theta, c.rope_scaling, c.rotary_fraction if partial else None)


# A fraction transformers rotates the same dims of: int(head_dim * f) even (jaxattn rounds down to even).
EVEN_ROTARY = Need(lambda f, c: int(c.head_dim * f) % 2 == 0, "an even number int(head_dim * f) of rotated dims")


def mha(c: ModelConfig, architecture: str) -> list[Problem]:
    """Problems of a config that is not multi-head attention with head_dim = d_model / num_heads."""
    problems = []
    if c.num_kv_heads != c.num_heads:
        problems.append(Problem("num_kv_heads", c.num_kv_heads, f"{architecture} has as many key/value heads as "
                                "query heads"))
    if c.head_dim * c.num_heads != c.d_model:
        problems.append(Problem("head_dim", c.head_dim, f"{architecture} has head_dim = d_model / num_heads"))
    return problems


# ---------------------------------------------------------------- tensors


def rope_columns(c: ModelConfig, heads: int):
    """Interleaved RoPE exports to half-split architectures by renaming head dims (None: nothing to rename)."""
    if c.positions != "rope" or not c.rope_interleaved:
        return None
    return w.half_split_columns(heads, c.head_dim, rotary_dims(c.head_dim, c.rotary_fraction))


def decoder_layout(c: ModelConfig, biases: Biases, block: Callable[[ModelConfig, int, dict], list[Entry]], *,
                   embed: str, final: str, learned: str | None = None) -> list[Entry]:
    """Embeddings (+ `learned` positions), every block, the final norm and the untied head, in model order."""
    flags = biases.flags(c)
    first, last = w.embeddings(c, embed)
    if learned is not None:
        first += [Entry(("wpe", "embedding"), (learned,), ((c.max_seq_len, c.d_model),))]
    blocks = [entry for i in range(c.num_layers) for entry in block(c, i, flags)]
    return first + blocks + w.norm(("final_norm",), final, c.d_model, bias=flags["norm"]) + last


def qk_norms(c: ModelConfig, i: int, name: str) -> list[Entry]:
    """`q_norm`, `k_norm` of a per-head ("head": scale [H]) or full-width ("full": [N*H], [K*H]) q/k norm."""
    p, H = (f"blocks_{i}", "attn"), c.head_dim
    if c.qk_norm == "head":
        return (w.norm(p + ("q_norm",), f"{name}.q_norm", H, columns=rope_columns(c, 1))
                + w.norm(p + ("k_norm",), f"{name}.k_norm", H, columns=rope_columns(c, 1)))
    if c.qk_norm == "full":
        return (w.norm(p + ("q_norm",), f"{name}.q_norm", c.num_heads * H, columns=rope_columns(c, c.num_heads))
                + w.norm(p + ("k_norm",), f"{name}.k_norm", c.num_kv_heads * H,
                         columns=rope_columns(c, c.num_kv_heads)))
    return []


def attention(c: ModelConfig, i: int, b: dict[str, bool], name: str) -> list[Entry]:
    """Separate q_proj, k_proj, v_proj, o_proj (and q/k norms) of attention module `name`."""
    D, N, K, H, p = c.d_model, c.num_heads, c.num_kv_heads, c.head_dim, (f"blocks_{i}", "attn")
    return (w.linear(p + ("query",), f"{name}.q_proj", D, N * H, bias=b["qkv"], columns=rope_columns(c, N))
            + w.linear(p + ("key",), f"{name}.k_proj", D, K * H, bias=b["qkv"], columns=rope_columns(c, K))
            + w.linear(p + ("value",), f"{name}.v_proj", D, K * H, bias=b["qkv"])
            + w.linear(p + ("out",), f"{name}.o_proj", N * H, D, bias=b["out"]) + qk_norms(c, i, name))


def norm(c: ModelConfig, i: int, param: str, name: str) -> list[Entry]:
    """Block i's RMSNorm `param` (attn_norm, mlp_norm, post_attn_norm, post_mlp_norm) stored as `name`."""
    return w.norm((f"blocks_{i}", param), name, c.d_model)


def llama_block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    """A pre-norm Llama block: input_layernorm, attention, post_attention_layernorm (the MLP's), gated MLP."""
    h = f"model.layers.{i}"
    return (norm(c, i, "attn_norm", f"{h}.input_layernorm") + attention(c, i, b, f"{h}.self_attn")
            + norm(c, i, "mlp_norm", f"{h}.post_attention_layernorm")
            + w.gated_mlp((f"blocks_{i}", "mlp"), f"{h}.mlp", c, bias=b["mlp"]))


def llama_fields(hf: Fields, architecture: str, *, max_positions: int, head_dim: int | None = None,
                 kv_heads: int | None = None, theta: float = 10000.0, eps: float = 1e-6, tie: bool = False,
                 partial: bool = False, act: str = "hidden_act", act_default: str = "silu",
                 rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """The fields every Llama-like family reads alike: sizes, RoPE, RMSNorm, gated MLP, separate q/k/v.

    The keywords are the family's class defaults for keys a config.json leaves out;
    `rope`: RoPE fields the family read itself (else the flat `rope_parameters`).
    """
    sizes = heads(hf, head_dim, kv_heads)
    if rope is None:
        rope = rope_fields(architecture, read_rope(hf, default_theta=theta), sizes["head_dim"], partial=partial)
    return dict(**vocab(hf, max_positions=max_positions, tie=tie), **sizes, **rope,
                **gated_mlp(hf, architecture, act, act_default), norm="rmsnorm",
                norm_eps=hf.number("rms_norm_eps", eps), mlp_hidden=hf.integer("intermediate_size"), fused_qkv=False)


def llama_config(c: ModelConfig, act: str = "hidden_act") -> dict[str, Any]:
    """The config.json keys every Llama-like family writes alike."""
    return {**gqa_sizes(c), act: gated_act(c), "rms_norm_eps": c.norm_eps, "rope_parameters": rope_parameters(c)}


def qwen_layers(hf: Fields, architecture: str) -> dict[str, Any]:
    """Qwen2/Qwen3 windows: `sliding_window` (when `use_sliding_window`) on the layers `layer_types` names
    sliding (by default those from `max_window_layers` on)."""
    window = hf.integer("sliding_window", 4096, null=None) if hf.flag("use_sliding_window", False) else None
    first = hf.integer("max_window_layers", 28, minimum=0)
    kinds = read_layer_types(hf, lambda n: [SLIDING if window is not None and i >= first else FULL
                                            for i in range(n)], architecture)
    return layer_fields([kind == SLIDING for kind in kinds], window)


def qwen_layers_config(c: ModelConfig) -> dict[str, Any]:
    """The keys `qwen_layers` reads back as the windows of `c`."""
    return dict(use_sliding_window=c.sliding_window is not None, sliding_window=c.sliding_window,
                max_window_layers=0, layer_types=layer_types(c))
