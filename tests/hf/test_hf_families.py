"""The families of per-layer attention against transformers 5.23: Gemma 2/3, Phi-3, OLMo 2, SmolLM3, Pythia.

The method of tests/hf/test_hf.py (its helpers are imported): a tiny transformers
model per family and feature, every parameter redrawn with std 0.1 (norm
weights and biases too; Gemma's (1 + w) norm weights around 0, as it
initialises them), saved with `save_pretrained`, loaded with
`jaxattn.hf.load_pretrained` and compared in float32 (max |logit difference|
<= 1e-4) on sequences (24 tokens) longer than the local windows (6). A
negative control per feature (switched off or set wrong) must fail that
tolerance; cached greedy generation must give transformers' tokens; exports
load in `AutoModelForCausalLM` as the same model. Attention sinks are also
checked against GPT-OSS's attention function on its own (the whole GPT-OSS
model: tests/hf/test_hf_gpt_oss.py).
"""

from __future__ import annotations

import dataclasses
import json
import math
import re
import types
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the test extra (make test installs it)
transformers = pytest.importorskip("transformers")
from flax.traverse_util import flatten_dict, unflatten_dict
from test_hf import (HEADS, NO_TOKENS, TOL, VOCAB, D, check_export, check_greedy_generation, check_logits, checkpoints, spoiled_difference,
                     max_diff, random_params, randomize_, small)

import jaxattn
from jaxattn import LayerKind, RopeScaling, hf
from jaxattn.hf.export import export_family
from jaxattn.hf.families import FAMILIES, REGISTERED
from jaxattn.hf.family import CONVERTED, FEATURES

transformers.logging.set_verbosity_error()

WINDOW, H = 6, D // HEADS


def base(**changes) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=4, num_attention_heads=HEADS,
                intermediate_size=96, max_position_embeddings=64, **NO_TOKENS) | changes


def _tile_qk_norms(model) -> None:
    """OLMo 2's full-width q/k norm weights made one head's, repeated: only the statistics differ from per-head."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if re.search(r"\.(q|k)_norm\.weight$", name):
                p.copy_(p[:H].repeat(p.shape[0] // H))


GEMMA = dict(num_key_value_heads=2, head_dim=H, sliding_window=WINDOW, query_pre_attn_scalar=24)
GEMMA3_ROPE = {"full_attention": dict(rope_type="linear", factor=2.0, rope_theta=1e6),
               "sliding_attention": dict(rope_type="default", rope_theta=1e4)}
# name: (transformers config class, its arguments[, an edit of the randomised model]).
CASES = {
    # Layers alternate local (even) and global; both soft-caps small enough to bend these logits.
    "gemma2": ("Gemma2Config", base(**GEMMA, attn_logit_softcapping=2.0, final_logit_softcapping=3.0)),
    # Five local layers per global one (layers 0-4 and 6 local), each kind with its own RoPE; an attention
    # soft-cap that transformers' Gemma 3 ignores (and so must jaxattn).
    "gemma3": ("Gemma3TextConfig", base(**GEMMA, num_hidden_layers=7, final_logit_softcapping=3.0,
                                        attn_logit_softcapping=1.0, rope_parameters=GEMMA3_ROPE,
                                        tie_word_embeddings=False)),
    "phi3_partial_window": ("Phi3Config", base(num_key_value_heads=2, sliding_window=WINDOW, rope_parameters=dict(
        rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5))),
    "olmo2": ("Olmo2Config", base(num_key_value_heads=2, attention_bias=True)),
    "olmo2_tiled_qk_norm": ("Olmo2Config", base(num_key_value_heads=2), _tile_qk_norms),
    "smollm3_nope": ("SmolLM3Config", base(num_key_value_heads=2, no_rope_layer_interval=2, attention_bias=True,
                                           mlp_bias=True)),
    # transformers' default: with use_sliding_window, the NoPE layer (every 4th, here layer 3) is local.
    "smollm3_nope_window": ("SmolLM3Config", base(num_key_value_heads=2, use_sliding_window=True,
                                                  sliding_window=WINDOW)),
    "pythia": ("GPTNeoXConfig", base(rotary_pct=0.25, use_parallel_residual=True, hidden_act="gelu")),
    "neox_sequential_half_rotary": ("GPTNeoXConfig", base(rotary_pct=0.5, use_parallel_residual=False,
                                                          hidden_act="gelu", tie_word_embeddings=True)),
    "qwen3_mixed_windows": ("Qwen3Config", base(num_key_value_heads=2, head_dim=H, use_sliding_window=True,
                                                sliding_window=WINDOW, max_window_layers=2)),
}
UNIT_OFFSET = ("Gemma2Config", "Gemma3TextConfig")  # norms scale by (1 + w), w initialised to 0


def torch_model(case: str) -> torch.nn.Module:
    kind, kwargs, *edit = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**kwargs),
                                                          attn_implementation="eager")
    randomize_(model, norm_center=0.0 if kind in UNIT_OFFSET else 1.0)
    for change in edit:
        change(model)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints(tmp_path_factory, torch_model)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(checkpoint, case):
    check_logits(checkpoint(case), case)


LOCAL, GLOBAL = LayerKind(local=True), LayerKind()
GEMMA3_LOCAL = LayerKind(local=True, rope_theta=1e4, rope_scaling="none")
EXPECTED_FIELDS = {  # what each checkpoint must become
    "gemma2": dict(norm_placement="sandwich", norm_unit_offset=True, embed_multiplier=8.0, attn_scale=24 ** -0.5,
                   attn_logits_soft_cap=2.0, final_logits_soft_cap=3.0, sliding_window=WINDOW, mlp="geglu",
                   gelu_approximate=True, layer_pattern=(LOCAL, GLOBAL), tie_embeddings=True, qk_norm="none"),
    "gemma3": dict(qk_norm="head", attn_logits_soft_cap=None, final_logits_soft_cap=3.0, rope_theta=1e6,
                   rope_scaling=RopeScaling("linear", 2.0), layer_pattern=(GEMMA3_LOCAL,) * 5 + (GLOBAL,)),
    "phi3_partial_window": dict(rotary_fraction=0.5, fused_qkv=True, sliding_window=WINDOW, layer_pattern=(),
                                qkv_bias=False, mlp_bias=False, norm_eps=1e-5),
    "olmo2": dict(norm_placement="post", qk_norm="full", qkv_bias=True, out_bias=True, mlp_bias=False),
    "smollm3_nope": dict(layer_pattern=(GLOBAL, LayerKind(rope=False)), sliding_window=None, rope_theta=2e6,
                         mlp_bias=True),
    "smollm3_nope_window": dict(layer_pattern=(GLOBAL,) * 3 + (LayerKind(local=True, rope=False),),
                                sliding_window=WINDOW),
    "pythia": dict(residual="parallel", rotary_fraction=0.25, norm="layernorm"),
    "neox_sequential_half_rotary": dict(residual="sequential", rotary_fraction=0.5, tie_embeddings=True),
    "qwen3_mixed_windows": dict(layer_pattern=(GLOBAL, GLOBAL, LOCAL, LOCAL), sliding_window=WINDOW),
}


@pytest.mark.parametrize("case", list(EXPECTED_FIELDS))
def test_loaded_configs_name_the_features(checkpoint, case):
    config = checkpoint(case).config
    assert {name: getattr(config, name) for name in EXPECTED_FIELDS[case]} == EXPECTED_FIELDS[case]


def _renamed(params, renames: dict[str, str], drop=()):
    """params with block parameters renamed (e.g. post_attn_norm -> attn_norm) and `drop`ped."""
    return unflatten_dict({tuple(renames.get(part, part) for part in path): value
                           for path, value in flatten_dict(params).items() if not set(path) & set(drop)})


def _per_head_qk_norm(c, p):
    flat = flatten_dict(p)
    heads = {path: (value[:H] if path[-2] in ("q_norm", "k_norm") else value) for path, value in flat.items()}
    return c.replace(qk_norm="head"), unflatten_dict(heads)


def _kinds(c, **changes):
    return tuple(dataclasses.replace(kind, **changes) for kind in c.layer_pattern)


# Each feature switched off or set wrong must fail the tolerance.
NEGATIVE_CONTROLS = {
    "gemma2 no attention soft-cap": ("gemma2", lambda c, p: (c.replace(attn_logits_soft_cap=None), p)),
    "gemma2 no final soft-cap": ("gemma2", lambda c, p: (c.replace(final_logits_soft_cap=None), p)),
    "gemma2 all layers global": ("gemma2", lambda c, p: (c.replace(layer_pattern=(), sliding_window=None), p)),
    "gemma2 1/sqrt(head_dim) for query_pre_attn_scalar": ("gemma2", lambda c, p: (c.replace(attn_scale=None), p)),
    "gemma2 embeddings not scaled": ("gemma2", lambda c, p: (c.replace(embed_multiplier=1.0), p)),
    "gemma2 w for (1 + w) norms": ("gemma2", lambda c, p: (c.replace(norm_unit_offset=False), p)),
    "gemma2 pre-norm instead of sandwich": ("gemma2", lambda c, p: (
        c.replace(norm_placement="pre"), _renamed(p, {}, drop=("post_attn_norm", "post_mlp_norm")))),
    "gemma3 all layers global": ("gemma3", lambda c, p: (
        c.replace(layer_pattern=_kinds(c, local=False), sliding_window=None), p)),
    "gemma3 one RoPE base for local and global": ("gemma3", lambda c, p: (
        c.replace(layer_pattern=_kinds(c, rope_theta=None, rope_scaling=None)), p)),
    "gemma3 global RoPE scaling ignored": ("gemma3", lambda c, p: (c.replace(rope_scaling=None), p)),
    "gemma3 attention soft-cap transformers ignores": ("gemma3", lambda c, p: (c.replace(attn_logits_soft_cap=1.0), p)),
    "phi3 full rotary": ("phi3_partial_window", lambda c, p: (c.replace(rotary_fraction=1.0), p)),
    "phi3 without its window": ("phi3_partial_window", lambda c, p: (c.replace(sliding_window=None), p)),
    "phi3 partial pairs read interleaved": ("phi3_partial_window", lambda c, p: (c.replace(rope_interleaved=True), p)),
    "olmo2 pre-norm instead of post-norm": ("olmo2", lambda c, p: (
        c.replace(norm_placement="pre"), _renamed(p, {"post_attn_norm": "attn_norm", "post_mlp_norm": "mlp_norm"}))),
    "olmo2 per-head instead of full-width q/k norm": ("olmo2_tiled_qk_norm", _per_head_qk_norm),
    "smollm3 every layer rotated": ("smollm3_nope", lambda c, p: (c.replace(layer_pattern=()), p)),
    "smollm3 NoPE layer without its window": ("smollm3_nope_window", lambda c, p: (
        c.replace(layer_pattern=_kinds(c, local=False), sliding_window=None), p)),
    "pythia sequential residual": ("pythia", lambda c, p: (c.replace(residual="sequential"), p)),
    "pythia full rotary": ("pythia", lambda c, p: (c.replace(rotary_fraction=1.0), p)),
    "neox parallel residual": ("neox_sequential_half_rotary", lambda c, p: (c.replace(residual="parallel"), p)),
    "neox half rotary as a quarter": ("neox_sequential_half_rotary", lambda c, p: (c.replace(rotary_fraction=0.25), p)),
    "qwen3 mixed windows all global": ("qwen3_mixed_windows", lambda c, p: (
        c.replace(layer_pattern=(), sliding_window=None), p)),
}


@pytest.mark.parametrize("name", list(NEGATIVE_CONTROLS))
def test_negative_controls_fail_the_tolerance(checkpoint, name):
    case, spoil = NEGATIVE_CONTROLS[name]
    assert spoiled_difference(checkpoint(case), spoil, name) > TOL


@pytest.mark.parametrize("case", ["gemma2", "gemma3", "phi3_partial_window", "olmo2", "smollm3_nope_window",
                                  "pythia", "qwen3_mixed_windows"])
def test_cached_greedy_generation_equals_transformers(checkpoint, case):
    check_greedy_generation(checkpoint(case))  # 26 tokens run well past the windows (6)


# ---------------------------------------------------------------- export: transformers loads the same model

GEMMA_BASE = dict(num_layers=4, num_kv_heads=2, head_dim=H, mlp="geglu", norm_placement="sandwich",
                  norm_unit_offset=True, embed_multiplier=D ** 0.5, attn_scale=24 ** -0.5, sliding_window=WINDOW,
                  final_logits_soft_cap=3.0, tie_embeddings=True, rope_interleaved=True)
EXPORTS = {  # name: (a jaxattn config, the transformers class it must export to)
    "gemma2": (small(**GEMMA_BASE, attn_logits_soft_cap=2.0, layer_pattern=(LOCAL, GLOBAL)), "Gemma2ForCausalLM"),
    "gemma3": (small(**GEMMA_BASE | dict(num_layers=7), qk_norm="head", rope_theta=1e6,
                     rope_scaling=RopeScaling("linear", 2.0), layer_pattern=(GEMMA3_LOCAL,) * 5 + (GLOBAL,)),
               "Gemma3ForCausalLM"),
    "gemma3_all_global": (small(**GEMMA_BASE | dict(sliding_window=None), qk_norm="head"), "Gemma3ForCausalLM"),
    "phi3_partial_interleaved_window": (small(num_kv_heads=2, rotary_fraction=0.5, rope_interleaved=True,
                                              sliding_window=WINDOW), "Phi3ForCausalLM"),
    "olmo2_interleaved_biases": (small(num_kv_heads=2, norm_placement="post", qk_norm="full", qkv_bias=True,
                                       rope_interleaved=True, mlp="geglu"), "Olmo2ForCausalLM"),
    "smollm3_nope_windows": (small(num_layers=4, sliding_window=WINDOW, qkv_bias=True, layer_pattern=(
        GLOBAL, LayerKind(rope=False), GLOBAL, LayerKind(local=True, rope=False))), "SmolLM3ForCausalLM"),
    "no positions as smollm3": (small(positions="none"), "SmolLM3ForCausalLM"),
    "pythia_interleaved": (small(norm="layernorm", norm_eps=1e-5, mlp="gelu", residual="parallel",
                                 rotary_fraction=0.25, use_bias=True, rope_interleaved=True), "GPTNeoXForCausalLM"),
    "qwen2_mixed_windows": (small(sliding_window=WINDOW, qkv_bias=True, layer_pattern=(GLOBAL, LOCAL)),
                            "Qwen2ForCausalLM"),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_loads_in_transformers_as_the_same_model(tmp_path, name):
    check_export(tmp_path, name, *EXPORTS[name])


# ---------------------------------------------------------------- refusals


def _config_only(case: str, to: Path, **changes) -> Path:
    """A directory holding only a transformers config.json with `changes`: errors come before any tensor."""
    kind, kwargs, *_ = CASES[case]
    getattr(transformers, kind)(**kwargs).save_pretrained(to)
    written = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps(written | changes))
    return to


UNSUPPORTED = {  # (case, config.json changes, words the message must hold)
    "phi3 longrope": ("phi3_partial_window", dict(rope_parameters=dict(
        rope_type="longrope", rope_theta=1e4, short_factor=[1.0] * 4, long_factor=[1.0] * 4)), ["longrope"]),
    "phi3 yarn, which phi3 reads as longrope": ("phi3_partial_window", dict(rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=2.0)), ["rope_type", "'yarn'", "longrope"]),
    "gemma bidirectional": ("gemma2", dict(use_bidirectional_attention=True), ["use_bidirectional_attention"]),
    "gemma local layers without a window": ("gemma2", dict(sliding_window=None), ["sliding_window"]),
    "gemma3 partial rotary": ("gemma3", dict(rope_parameters={**GEMMA3_ROPE, "sliding_attention": dict(
        rope_type="default", rope_theta=1e4, partial_rotary_factor=0.5)}), ["partial_rotary_factor"]),
    "gemma3 a flat rope_parameters": ("gemma3", dict(rope_parameters=dict(rope_type="default", rope_theta=1e4)),
                                      ["rope_parameters", "per layer type"]),
    "layer_types of the wrong length": ("gemma2", dict(layer_types=["full_attention"]), ["layer_types", "1 entries"]),
    "smollm3 no_rope_layers not 0 or 1": ("smollm3_nope", dict(no_rope_layers=[1, 2, 1, 0]), ["no_rope_layers"]),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_or_invalid_configs_name_the_field(tmp_path, name):
    case, changes, words = UNSUPPORTED[name]
    with pytest.raises(hf.HFCheckpointError) as error:
        hf.load_pretrained(_config_only(case, tmp_path, **changes))
    assert all(word in str(error.value) for word in words), str(error.value)


NO_COUNTERPART = {  # a config no transformers architecture computes, and the field the message names
    "sinks": (small(attn_sinks=True), "attn_sinks"),
    "an odd number of rotated dims": (small(norm="layernorm", mlp="gelu", rotary_fraction=0.2), "rotary_fraction"),
    "a parallel residual with rmsnorm": (small(residual="parallel"), "residual"),
    "two RoPE bases without windows": (small(num_layers=2, layer_pattern=(GLOBAL, LayerKind(rope_theta=5e5))),
                                       "layer_pattern"),
    "gemma, a scale of no integer query_pre_attn_scalar": (small(**GEMMA_BASE | dict(attn_scale=0.3)), "attn_scale"),
}


@pytest.mark.parametrize("name", list(NO_COUNTERPART))
def test_export_without_a_transformers_counterpart_names_the_field(tmp_path, name):
    config, field = NO_COUNTERPART[name]
    with pytest.raises(hf.UnsupportedCheckpoint, match=field):
        hf.save_pretrained(tmp_path / "out", config, random_params(config))
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the registry


def test_each_family_is_one_registered_record():
    assert len(REGISTERED) == len(FAMILIES) and set(hf.ARCHITECTURES) == set(FAMILIES)
    assert {"gemma2", "gemma3_text", "phi3", "olmo2", "smollm3"} <= set(FAMILIES)
    assert len({family.architecture for family in FAMILIES.values()}) == len(FAMILIES)
    assert [family.model_type for family in FAMILIES.values()] == [name.replace("gemma3", "gemma3_text")
                                                                   for name in REGISTERED]


def test_every_model_field_is_a_checked_feature_or_converted_by_every_family():
    # A ModelConfig field in neither list could change the maths while every family exports it unchanged.
    fields = {field.name for field in dataclasses.fields(jaxattn.ModelConfig)}
    assert fields == set(FEATURES) | set(CONVERTED) and not set(FEATURES) & set(CONVERTED)


def test_the_generic_machinery_names_no_family():
    root = Path(jaxattn.__file__).parent / "hf"
    generic = ["architectures.py", "export.py", "layouts.py", "checkpoint.py", "family.py", "fields.py",
               "rope_params.py", "weights.py"]
    quoted = re.compile("|".join(rf"[\"']{re.escape(name)}[\"']" for name in FAMILIES))
    assert {name: quoted.findall((root / name).read_text()) for name in generic} == {name: [] for name in generic}


def test_the_first_family_in_the_registry_order_that_computes_a_config_is_chosen():
    # A Llama config is also a Qwen2 (zero biases), SmolLM3 (no NoPE layer) and Phi-3 (whole heads) one.
    assert export_family(small()).architecture == "LlamaForCausalLM"
    assert export_family(small(sliding_window=WINDOW)).architecture == "MistralForCausalLM"
    assert export_family(small(sliding_window=WINDOW, out_bias=True)).architecture == "SmolLM3ForCausalLM"
    assert export_family(small(rotary_fraction=0.5)).architecture == "Phi3ForCausalLM"


# ---------------------------------------------------------------- attention sinks against GPT-OSS's attention


@pytest.mark.parametrize("window", [None, 5])
def test_sinks_equal_gpt_oss_attention(window):
    from transformers.models.gpt_oss.modeling_gpt_oss import eager_attention_forward
    B, T, N, K, Hd = 2, 12, 4, 2, 8
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal(shape).astype(np.float32) for shape in ((B, T, N, Hd), (B, T, K, Hd), (B, T, K, Hd)))
    sinks = rng.standard_normal(N).astype(np.float32)
    i, j = np.arange(T)[:, None], np.arange(T)[None, :]
    visible = (j <= i) & ((i - j < window) if window else True)
    mask = torch.as_tensor(np.where(visible, 0.0, np.finfo(np.float32).min)[None, None], dtype=torch.float32)
    module = types.SimpleNamespace(num_key_value_groups=N // K, sinks=torch.as_tensor(sinks), training=False)
    as_torch = lambda x: torch.as_tensor(x).transpose(1, 2)  # noqa: E731  [B, T, N, H] -> [B, N, T, H]
    out, weights = eager_attention_forward(module, as_torch(q), as_torch(k), as_torch(v), mask, scaling=Hd ** -0.5)
    window_size = None if window is None else (window - 1, 0)
    ours, our_weights = jaxattn.scaled_dot_product_attention(
        jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), is_causal=True, local_window_size=window_size,
        sinks=jnp.asarray(sinks), return_weights=True)
    assert max_diff(np.asarray(ours), out.numpy()) <= 1e-5
    assert max_diff(np.asarray(our_weights), weights.numpy()) <= 1e-6
    without = jaxattn.scaled_dot_product_attention(jnp.asarray(q), jnp.asarray(k), jnp.asarray(v), is_causal=True,
                                                   local_window_size=window_size)
    assert max_diff(np.asarray(without), out.numpy()) > 1e-2  # the negative control: sinks matter here
    assert math.isclose(float(weights.sum(-1).max()), float(np.asarray(our_weights).sum(-1).max()), rel_tol=1e-5)
