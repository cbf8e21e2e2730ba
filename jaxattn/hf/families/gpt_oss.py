"""GPT-OSS (`GptOssForCausalLM`): GQA with sinks, alternating sliding/full layers, YaRN, experts in every layer.

As transformers 5.23 computes it (`models/gpt_oss`):

* attention: separate q/k/v/o projections, biased on all four when `attention_bias`
  (default true); one learned sink logit per query head (`self_attn.sinks`, always
  there: `ModelConfig.attn_sinks`); softmax scale 1/sqrt(head_dim); half-split RoPE.
* layers: `layer_types` (default: even layers `sliding_attention`, odd ones
  `full_attention`) with one `sliding_window` (default 128); a sliding layer's query
  sees itself and the W - 1 tokens before it.
* RoPE: `rope_parameters` (or a legacy `rope_scaling`); absent, transformers' default
  YaRN (factor 32, beta_fast 32, beta_slow 1, truncate false, original 4096 positions)
  with base `rope_theta` (default 150000).
* every MLP a mixture of experts (`ModelConfig.moe`, `EXPERTS`): a biased router whose top
  `num_experts_per_tok` logits are softmaxed (`softmax_after_topk`), experts
  `gate_up_proj [E, D, 2F]` (gate in even columns, up in odd: `gate_up_interleaved`) and
  `down_proj [E, F, D]` with biases (`expert_bias`), the clamped SwiGLU
  (`activation="clamped_swiglu"`): gate clamped above at `swiglu_limit`, up to
  +-`swiglu_limit`, (up + 1) * gate * sigmoid(`swiglu_alpha` * gate).
  F is `intermediate_size`. `hidden_act` is unused by transformers' GPT-OSS, so ignored.
* pre-norm RMSNorm (`rms_norm_eps`, default 1e-5); untied head by default.

Tensors are stored as transformers holds them (`mlp.router.weight [E, D]`,
`mlp.router.bias`, `mlp.experts.gate_up_proj`, `gate_up_proj_bias`, `down_proj`,
`down_proj_bias`): the layout of save_pretrained and of the hub's bfloat16 copies.
The hub's MXFP4 originals (openai/gpt-oss-20b, -120b: `quantization_config.quant_method`
"mxfp4") load too: each expert projection is then `{name}_blocks` uint8 `[E, out, in / 32, 16]`
and `{name}_scales` uint8 `[E, out, in / 32]` (`gate_up_proj_*` with in = D, out = 2F;
`down_proj_*` with in = F, out = D), the layout's packed alternative (`jaxattn.hf.mxfp4.packed`),
dequantized as transformers does (exactly, to float32, then the model's dtype); every other
tensor, the expert biases included, is a float as above. A layer whose experts the config's
`modules_to_not_convert` leaves unquantized stores the float form, read as above. Only the
experts are ever packed (transformers quantizes nothing else). Export writes the float form
(`gate_up_proj`, `down_proj` in the params' dtype), never MXFP4.

`router_aux_loss_coef` is a training setting transformers applies only with
`output_router_logits`; it becomes `MoEConfig.aux_loss_coef` then, 0 otherwise.
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf import mxfp4
from jaxattn.hf import weights as w
from jaxattn.hf.families import common, moe
from jaxattn.hf.family import ANY, Biases, Family, Problem, Switch, features, layers
from jaxattn.hf.fields import Fields
from jaxattn.hf.rope_params import read_rope, rope_dict
from jaxattn.hf.weights import Entry
from jaxattn.config.moe import MoEConfig

ARCH = "GptOssForCausalLM"
BIASES = Biases(qkv=Switch("attention_bias", True), out=Switch("attention_bias", True), mlp=True)
# transformers' GptOssConfig fills this in when config.json has neither rope_parameters nor rope_scaling.
DEFAULT_ROPE = dict(rope_type="yarn", factor=32.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
                    original_max_position_embeddings=4096)
DEFAULT_THETA = 150000.0
# GPT-OSS's routed experts, in the names of their maths (`MoEConfig`).
EXPERTS = dict(activation="clamped_swiglu", expert_bias=True, gate_up_interleaved=True)


# ---------------------------------------------------------------- config.json


def _rope(hf: Fields, head_dim: int) -> dict[str, Any]:
    params = rope_dict(hf)
    if hf.get("rope_parameters") is None and hf.get("rope_scaling") is None:
        params = Fields(DEFAULT_ROPE, hf.path, "rope_parameters.")
    return common.rope_fields(ARCH, read_rope(hf, params, default_theta=DEFAULT_THETA), head_dim)


def _layers(hf: Fields) -> dict[str, Any]:
    window = hf.integer("sliding_window", 128, null=None)
    kinds = common.read_layer_types(hf, lambda n: [common.SLIDING if i % 2 == 0 else common.FULL
                                                   for i in range(n)], ARCH)
    if window is None and common.SLIDING in kinds:
        common.reject(ARCH, "sliding_window", None, "its sliding_attention layers need a window")
    return common.layer_fields([kind == common.SLIDING for kind in kinds], window)


def _moe(hf: Fields) -> MoEConfig:
    return MoEConfig(num_experts=hf.integer("num_local_experts", 128),
                     experts_per_token=hf.integer("num_experts_per_tok", 4),
                     expert_hidden=hf.integer("intermediate_size", 2880), softmax_after_topk=True, router_bias=True,
                     **EXPERTS, swiglu_limit=hf.number("swiglu_limit", 7.0),
                     swiglu_alpha=hf.number("swiglu_alpha", 1.702),
                     aux_loss_coef=moe.aux_loss_coef(hf))


def read(hf: Fields) -> dict[str, Any]:
    sizes, routed = common.heads(hf, head_dim=64, kv_heads=8), _moe(hf)
    return dict(**common.vocab(hf, max_positions=131072, tie=False), **sizes, **_rope(hf, sizes["head_dim"]),
                **_layers(hf), norm="rmsnorm", norm_eps=hf.number("rms_norm_eps", 1e-5), mlp="swiglu",
                mlp_hidden=routed.expert_hidden, moe=routed, attn_sinks=True, fused_qkv=False)


def write(c: ModelConfig) -> dict[str, Any]:
    """config.json keys; without sliding layers `sliding_window` is still written (transformers builds
    the sliding mask whatever `layer_types` says, and refuses a null window), unused."""
    m = c.moe
    return {**common.gqa_sizes(c), "intermediate_size": m.expert_hidden, "rms_norm_eps": c.norm_eps,
            "rope_parameters": common.rope_parameters(c), "hidden_act": "silu",
            "sliding_window": c.sliding_window or c.max_seq_len, "layer_types": common.layer_types(c),
            "num_local_experts": m.num_experts, "num_experts_per_tok": m.experts_per_token,
            "swiglu_limit": m.swiglu_limit, "swiglu_alpha": m.swiglu_alpha,
            "router_aux_loss_coef": m.aux_loss_coef, "output_router_logits": m.aux_loss_coef > 0}


def refusal(c: ModelConfig) -> list[Problem]:
    # Every layer's MLP is routed experts, so the dense `mlp` kind never computes anything.
    problems = (features(c, ARCH, moe=moe.PRESENT, attn_sinks=True, mlp=ANY) + layers(c, ARCH, windows="any")
                + moe.problems(c, ARCH, softmax_after_topk=True, router_bias=True, **EXPERTS))
    if c.dense_layers:
        problems.append(Problem("dense_layers", c.dense_layers, f"{ARCH} has experts in every layer"))
    return problems

# ---------------------------------------------------------------- tensors


def experts(c: ModelConfig, i: int) -> list[Entry]:
    """Layer i's router and experts, stored as transformers holds them (the router's weight `[E, D]`),
    the expert projections also in MXFP4 (read only)."""
    E, D, F = c.moe.num_experts, c.d_model, c.moe.expert_hidden
    p, h = (f"blocks_{i}", "mlp"), f"model.layers.{i}.mlp"
    gate_up, down = p + ("experts_gate_up",), p + ("experts_down",)
    return [Entry(p + ("router_kernel",), (f"{h}.router.weight",), ((E, D),), w.LINEAR),
            Entry(p + ("router_bias",), (f"{h}.router.bias",), ((E,),)),
            Entry(gate_up, (f"{h}.experts.gate_up_proj",), ((E, D, 2 * F),),
                  alternatives=mxfp4.packed(gate_up, f"{h}.experts.gate_up_proj", E, D, 2 * F)),
            Entry(p + ("experts_gate_up_bias",), (f"{h}.experts.gate_up_proj_bias",), ((E, 2 * F),)),
            Entry(down, (f"{h}.experts.down_proj",), ((E, F, D),),
                  alternatives=mxfp4.packed(down, f"{h}.experts.down_proj", E, F, D)),
            Entry(p + ("experts_down_bias",), (f"{h}.experts.down_proj_bias",), ((E, D),))]


def block(c: ModelConfig, i: int, b: dict[str, bool]) -> list[Entry]:
    h = f"model.layers.{i}"
    sinks = Entry((f"blocks_{i}", "attn", "sinks"), (f"{h}.self_attn.sinks",), ((c.num_heads,),))
    return (common.norm(c, i, "attn_norm", f"{h}.input_layernorm") + common.attention(c, i, b, f"{h}.self_attn")
            + [sinks] + common.norm(c, i, "mlp_norm", f"{h}.post_attention_layernorm") + experts(c, i))


def layout(c: ModelConfig) -> list[Entry]:
    return common.decoder_layout(c, BIASES, block, embed="model.embed_tokens.weight", final="model.norm")


FAMILY = Family("gpt_oss", ARCH, read, write, refusal, layout, BIASES, reads_experts=True, quantized=("mxfp4",))
