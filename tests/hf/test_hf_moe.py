"""Mixture-of-experts checkpoints against transformers 5.23: DeepSeek-V2/V3, Qwen2/Qwen3-MoE, Mixtral.

The method of tests/hf/test_hf.py (its helpers are imported): per family a tiny transformers model
(3 layers, one of them dense where the family allows, 8-16 experts, top 2-4), every parameter
redrawn with std 0.1 and the routers' at std 3/sqrt(D) (logits of std ~3: decisive choices, not
uniform gates), DeepSeek-V3's `e_score_correction_bias` drawn large enough to change choices;
saved with `save_pretrained`, loaded with `jaxattn.hf.load_pretrained`, compared in float32
(max |logit difference| <= 1e-4). Each routing feature has a negative control: the loaded config
with that feature switched off must miss that tolerance. Cached greedy generation must give
transformers' tokens, and exports load in `AutoModelForCausalLM` as the same model.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the test extra (make test installs it)
transformers = pytest.importorskip("transformers")
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors.numpy import load_file, save_file
from test_hf import (HEADS, MLA, NO_TOKENS, TOL, VOCAB, D, check_export, check_greedy_generation, check_logits,
                     checkpoints, jax_logits, max_diff, random_params, randomize_, small, tokens, torch_logits)

import jaxattn
from jaxattn import hf
from jaxattn.hf.checkpoint import flat_abstract_params

transformers.logging.set_verbosity_error()

WINDOW = 8


def base(**changes) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=3, num_attention_heads=HEADS,
                num_key_value_heads=2, intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6,
                experts_implementation="eager", **NO_TOKENS) | changes


DEEPSEEK = dict(num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8,
                v_head_dim=16, n_routed_experts=16, num_experts_per_tok=4, n_group=4, topk_group=2,
                moe_intermediate_size=16, n_shared_experts=2, first_k_dense_replace=1)
# name: (transformers config class, its arguments, the transformers class)
CASES = {
    "deepseek_v3": ("DeepseekV3Config", base(**DEEPSEEK, routed_scaling_factor=2.5, norm_topk_prob=True,
                                             num_nextn_predict_layers=0), "DeepseekV3ForCausalLM"),
    "deepseek_v2": ("DeepseekV2Config", base(**DEEPSEEK, topk_method="group_limited_greedy",
                                             routed_scaling_factor=2.0), "DeepseekV2ForCausalLM"),
    # Layers 0 and 2 local (Qwen2-MoE's default: even layers below max_window_layers), layer 1 dense.
    "qwen2_moe": ("Qwen2MoeConfig", base(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         shared_expert_intermediate_size=24, mlp_only_layers=[1], norm_topk_prob=False,
                                         use_sliding_window=True, sliding_window=WINDOW, max_window_layers=3),
                  "Qwen2MoeForCausalLM"),
    "qwen3_moe": ("Qwen3MoeConfig", base(head_dim=16, num_experts=8, num_experts_per_tok=2, moe_intermediate_size=16,
                                         decoder_sparse_step=1, mlp_only_layers=[0], norm_topk_prob=True,
                                         use_sliding_window=True, sliding_window=WINDOW), "Qwen3MoeForCausalLM"),
    "mixtral": ("MixtralConfig", base(num_hidden_layers=2, num_local_experts=8, num_experts_per_tok=2,
                                      intermediate_size=32, sliding_window=WINDOW), "MixtralForCausalLM"),
}
EXPECTED = {  # what each loaded config must be (MoEConfig fields, dense layers, windows)
    "deepseek_v3": (dict(num_experts=16, experts_per_token=4, expert_hidden=16, scoring="sigmoid", n_group=4,
                         topk_group=2, group_score="top2_sum", correction_bias=True, norm_topk_prob=True,
                         routed_scaling_factor=2.5, num_shared_experts=2, shared_expert_hidden=16), (0,), None),
    "deepseek_v2": (dict(num_experts=16, experts_per_token=4, scoring="softmax", n_group=4, topk_group=2,
                         group_score="max", norm_topk_prob=False, routed_scaling_factor=2.0, num_shared_experts=2),
                    (0,), None),
    "qwen2_moe": (dict(num_experts=8, experts_per_token=2, expert_hidden=16, num_shared_experts=1,
                       shared_expert_hidden=24, shared_gate=True, norm_topk_prob=False), (1,), WINDOW),
    "qwen3_moe": (dict(num_experts=8, experts_per_token=2, norm_topk_prob=True, num_shared_experts=0), (0,), WINDOW),
    "mixtral": (dict(num_experts=8, experts_per_token=2, expert_hidden=32, norm_topk_prob=True), (), WINDOW),
}


def torch_model(case: str) -> torch.nn.Module:
    """The randomised transformers model of `CASES[case]`: routers decisive, V3's correction bias large."""
    kind, kwargs, _ = CASES[case]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(getattr(transformers, kind)(**kwargs),
                                                          attn_implementation="eager")
    randomize_(model)
    generator = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.copy_(torch.randn(p.shape, generator=generator) * 3 / math.sqrt(D))
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=generator) * 0.3)
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints(tmp_path_factory, torch_model)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(checkpoint, case):
    loaded = checkpoint(case)
    check_logits(loaded, case)
    fields, dense, window = EXPECTED[case]
    assert {k: getattr(loaded.config.moe, k) for k in fields} == fields
    assert loaded.config.dense_layers == dense and loaded.config.sliding_window == window
    names = load_file(loaded.path / "model.safetensors")
    assert any(".experts.0." in name for name in names)  # save_pretrained wrote one tensor per expert


def switched(loaded, **changes) -> float:
    """Max |logit difference| to transformers of the loaded config with `changes` to its MoEConfig
    (parameters the changed config has no place for left out)."""
    config = loaded.config.replace(moe=loaded.config.moe.replace(**changes))
    flat = flatten_dict(loaded.params)
    params = unflatten_dict({path: flat[path] for path in flat_abstract_params(config)})
    return max_diff(jax_logits(config, params, tokens()), loaded.logits)


NO_SHARED = dict(num_shared_experts=0, shared_expert_hidden=0)
CONTROLS = {  # family: {what is switched off: the MoEConfig changes}
    "deepseek_v3": {"softmax, not sigmoid": dict(scoring="softmax"), "no group limit": dict(n_group=1, topk_group=1),
                    "no correction bias": dict(correction_bias=False), "unnormalised top-k": dict(norm_topk_prob=False),
                    "no shared expert": NO_SHARED, "no scaling factor": dict(routed_scaling_factor=1.0)},
    "deepseek_v2": {"no group limit": dict(n_group=1, topk_group=1), "no shared expert": NO_SHARED,
                    "no scaling factor": dict(routed_scaling_factor=1.0)},
    "qwen2_moe": {"no shared expert": dict(NO_SHARED, shared_gate=False),
                  "no shared-expert gate": dict(shared_gate=False)},
    "qwen3_moe": {"unnormalised top-k": dict(norm_topk_prob=False)},
    "mixtral": {"unnormalised top-k": dict(norm_topk_prob=False)},
}


@pytest.mark.parametrize("case, control", [(case, control) for case, controls in CONTROLS.items()
                                           for control in controls])
def test_each_routing_feature_switched_off_misses_the_tolerance(checkpoint, case, control):
    miss = switched(checkpoint(case), **CONTROLS[case][control])
    print(f"{case} {control}: max |logit difference| {miss:.1e}")
    assert miss > TOL


@pytest.mark.parametrize("case", list(CASES))
def test_cached_greedy_generation_equals_transformers(checkpoint, case):
    check_greedy_generation(checkpoint(case))  # 26 tokens, past the windows (8)


@pytest.mark.parametrize("case", list(CASES))
def test_export_loads_in_transformers_as_the_same_model(checkpoint, tmp_path, case):
    check_export(tmp_path, case, checkpoint(case).config, CASES[case][2])


MOE = jaxattn.MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16)


def test_a_sigmoid_router_without_correction_bias_exports_to_deepseek_v3_with_zeros(tmp_path):
    config = small(num_layers=2, mla=MLA, rope_interleaved=True, dense_layers=(0,), moe=MOE.replace(
        scoring="sigmoid", n_group=2, topk_group=1, num_shared_experts=1, shared_expert_hidden=16))
    check_export(tmp_path, "v3 without correction bias", config, "DeepseekV3ForCausalLM")


def _fused(stored: dict) -> dict:
    """Per-expert tensors fused as transformers 5's modules hold them (`experts.gate_up_proj`, `down_proj`)."""
    out, layers = {}, {}
    for name, value in stored.items():
        if ".experts." in name:
            head, rest = name.split(".experts.")
            e, projection, _ = rest.split(".")
            layers.setdefault(head, {}).setdefault(projection, {})[int(e)] = value
        else:
            out[name] = value
    for head, p in layers.items():
        stack = lambda name: np.stack([p[name][e] for e in sorted(p[name])])  # noqa: E731
        out[f"{head}.experts.gate_up_proj"] = np.concatenate([stack("gate_proj"), stack("up_proj")], axis=1)
        out[f"{head}.experts.down_proj"] = stack("down_proj")
    return out


def test_experts_fused_as_transformers_modules_hold_them_load(checkpoint, tmp_path):
    loaded = checkpoint("qwen2_moe")
    (tmp_path / "config.json").write_text((loaded.path / "config.json").read_text())
    save_file(_fused(load_file(loaded.path / "model.safetensors")), tmp_path / "model.safetensors",
              metadata={"format": "pt"})
    theirs = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                               attn_implementation="eager")
    assert max_diff(torch_logits(theirs.eval(), tokens()), loaded.logits) <= TOL  # transformers reads it too
    config, params = hf.load_pretrained(tmp_path)
    assert max_diff(jax_logits(config, params, tokens()), loaded.logits) <= TOL


def _config_only(case: str, to: Path, **changes) -> Path:
    kind, kwargs, _ = CASES[case]
    getattr(transformers, kind)(**kwargs).save_pretrained(to)
    (to / "config.json").write_text(json.dumps(json.loads((to / "config.json").read_text()) | changes))
    return to


UNSUPPORTED = {  # (case, config.json changes, words the message must hold)
    "deepseek_v2 noaux_tc": ("deepseek_v2", dict(topk_method="noaux_tc"), ["topk_method", "noaux_tc"]),
    "deepseek_v2 renormalised": ("deepseek_v2", dict(norm_topk_prob=True), ["norm_topk_prob", "ignores"]),
    "deepseek_v2 sigmoid": ("deepseek_v2", dict(scoring_func="sigmoid"), ["scoring_func"]),
    "deepseek_v2 shared expert biases": ("deepseek_v2", dict(mlp_bias=True), ["mlp_bias"]),
    "deepseek_v3 softmax": ("deepseek_v3", dict(scoring_func="softmax"), ["scoring_func", "sigmoid"]),
    "deepseek_v3 other topk_method": ("deepseek_v3", dict(topk_method="greedy"), ["topk_method"]),
    "deepseek moe_layer_freq": ("deepseek_v3", dict(moe_layer_freq=2), ["moe_layer_freq"]),
    "gelu experts": ("qwen3_moe", dict(hidden_act="gelu"), ["hidden_act", "Qwen3MoeForCausalLM"]),
    "qwen2_moe window of 0": ("qwen2_moe", dict(use_sliding_window=False), ["use_sliding_window"]),
    "qwen3_moe mixed layer types": ("qwen3_moe", dict(layer_types=["full_attention", "sliding_attention",
                                                                   "full_attention"]), ["layer_types"]),
    "mixtral mixed layer types": ("mixtral", dict(layer_types=["full_attention", "sliding_attention"]),
                                  ["layer_types"]),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_moe_settings_jaxattn_cannot_compute_are_refused_naming_the_key(tmp_path, name):
    case, changes, words = UNSUPPORTED[name]
    with pytest.raises(hf.UnsupportedCheckpoint) as error:
        hf.load_pretrained(_config_only(case, tmp_path, **changes))
    assert all(word in str(error.value) for word in words), str(error.value)


NO_COUNTERPART = {  # a MoE config no transformers architecture computes, and the field the message names
    "sigmoid router without MLA": (small(num_kv_heads=2, moe=MOE.replace(scoring="sigmoid")), "moe.scoring"),
    "unnormalised, no shared expert, no qk norm": (small(moe=MOE), "moe.norm_topk_prob"),
    "a shared expert without its gate": (small(moe=MOE.replace(num_shared_experts=1, shared_expert_hidden=8)),
                                         "moe.shared_gate"),
    "dense layers in mixtral": (small(num_layers=2, moe=MOE.replace(norm_topk_prob=True), dense_layers=(1,)),
                                "dense_layers"),
    "deepseek dense layers not first": (small(mla=MLA, rope_interleaved=True, moe=MOE.replace(
        num_shared_experts=1, shared_expert_hidden=16), dense_layers=(1,)), "dense_layers"),
    "geglu experts": (small(mlp="geglu", qk_norm="head", moe=MOE), "mlp"),
}


@pytest.mark.parametrize("name", list(NO_COUNTERPART))
def test_export_of_moe_without_a_transformers_counterpart_names_the_field(tmp_path, name):
    config, field = NO_COUNTERPART[name]
    with pytest.raises(hf.UnsupportedCheckpoint, match=field.replace(".", r"\.")):
        hf.save_pretrained(tmp_path / "out", config, random_params(config))
    assert not (tmp_path / "out").exists()
