"""Gemma 2 and Gemma 3 (text) shared reading, writing and tensors.

Both: token embeddings times sqrt(hidden_size) (`embed_multiplier`, in the
compute dtype as transformers rounds it to the weights'), RMSNorm scaling by
(1 + w) (`norm_unit_offset`), a norm before and after attention and MLP
(`norm_placement="sandwich"`: input_layernorm, post_attention_layernorm,
pre_feedforward_layernorm, post_feedforward_layernorm; docs/theory.md §20), a
softmax scale of `query_pre_attn_scalar ** -0.5` (`attn_scale`), the optional
final-logit soft-cap (§17), a gated tanh-GELU MLP (`hidden_activation`), and
sliding-window layers where `layer_types` says `sliding_attention` (window
`sliding_window`: the query and the W - 1 tokens before it; §21).
Bidirectional attention (`use_bidirectional_attention`) is refused.
"""

from __future__ import annotations

import math
from typing import Any, Callable

from jaxattn.config import ModelConfig
from jaxattn.hf.families import common
from jaxattn.hf.family import ANY, Need, Problem, features
from jaxattn.hf.fields import Fields
from jaxattn.hf.weights import Entry


def _scalar(scale: float) -> int:
    return round(scale ** -2)


def _scalar_of(c: ModelConfig) -> int:
    """query_pre_attn_scalar s of the softmax scale s ** -0.5 (head_dim for the default 1/sqrt(H))."""
    return c.head_dim if c.attn_scale is None else _scalar(c.attn_scale)


# transformers reads query_pre_attn_scalar as an int: the scale must be one's inverse square root.
QUERY_SCALAR = Need(lambda v, c: v is None or (_scalar(v) > 0 and math.isclose(_scalar(v) ** -0.5, v, rel_tol=1e-9)),
                    "the softmax scale query_pre_attn_scalar ** -0.5 of an integer query_pre_attn_scalar")
SQRT_D = Need(lambda v, c: math.isclose(v, c.d_model ** 0.5, rel_tol=1e-12), "embeddings times sqrt(hidden_size)")


def read(hf: Fields, architecture: str, *, max_positions: int, pattern: int, final_cap: float | None,
         kinds: Callable | None = None, rope: dict[str, Any] | None = None) -> dict[str, Any]:
    """Gemma's ModelConfig fields; the keywords are the class defaults of `max_position_embeddings`,
    `final_logit_softcapping` and the layers (one global layer in every `pattern`).

    `kinds(is_local) -> LayerKind fields` and `rope` (the RoPE fields) replace the
    flat RoPE of Gemma 2 (Gemma 3 has one per layer type).
    """
    if hf.flag("use_bidirectional_attention", False, null=False):
        common.reject(architecture, "use_bidirectional_attention", True, "jaxattn's decoders are causal")
    fields = common.llama_fields(hf, architecture, max_positions=max_positions, head_dim=256, kv_heads=4, tie=True,
                                 act="hidden_activation", act_default="gelu_pytorch_tanh", rope=rope)
    local = [kind == common.SLIDING for kind in common.read_layer_types(
        hf, lambda n: [common.SLIDING if (i + 1) % pattern else common.FULL for i in range(n)], architecture)]
    window = hf.integer("sliding_window", 4096, null=None)
    if window is None and any(local):
        common.reject(architecture, "sliding_window", None, "its sliding_attention layers need a window")
    fields.update(common.layer_fields(local, window, [kinds(is_local) for is_local in local] if kinds else None))
    return dict(fields, norm_unit_offset=True, norm_placement="sandwich", embed_multiplier=fields["d_model"] ** 0.5,
                attn_scale=float(hf.number("query_pre_attn_scalar", 256)) ** -0.5,
                final_logits_soft_cap=hf.number("final_logit_softcapping", final_cap, null=None))


def write(c: ModelConfig) -> dict[str, Any]:
    # Both models build the sliding-window mask whether or not a layer uses it: a model without
    # local layers still needs a window there (any, e.g. its longest sequence).
    return dict(common.llama_config(c, act="hidden_activation"), query_pre_attn_scalar=_scalar_of(c),
                sliding_window=c.sliding_window or c.max_seq_len, layer_types=common.layer_types(c),
                final_logit_softcapping=c.final_logits_soft_cap, use_bidirectional_attention=False)


def refusal(c: ModelConfig, architecture: str, **needs) -> list[Problem]:
    return features(c, architecture, norm_placement="sandwich", norm_unit_offset=True, embed_multiplier=SQRT_D,
                    attn_scale=QUERY_SCALAR, final_logits_soft_cap=ANY, **needs)


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    h, norm = f"model.layers.{i}", common.norm
    return (norm(c, i, "attn_norm", f"{h}.input_layernorm") + common.attention(c, i, b, f"{h}.self_attn")
            + norm(c, i, "post_attn_norm", f"{h}.post_attention_layernorm")
            + norm(c, i, "mlp_norm", f"{h}.pre_feedforward_layernorm")
            + common.w.gated_mlp((f"blocks_{i}", "mlp"), f"{h}.mlp", c, bias=b["mlp"])
            + norm(c, i, "post_mlp_norm", f"{h}.post_feedforward_layernorm"))


def layout(c: ModelConfig, biases) -> list[Entry]:
    return common.decoder_layout(c, biases, block, embed="model.embed_tokens.weight", final="model.norm")

