"""GPT-OSS (`GptOssForCausalLM`) against transformers 5.23: logits, generation, export, refusals.

The method of tests/hf/test_hf.py (its helpers are imported): one tiny GPT-OSS
(4 layers alternating sliding (window 6) and full attention over 24 tokens,
GQA, YaRN as GPT-OSS configures it, 8 experts, 2 per token) with every
parameter redrawn: std 0.1 by default, the routers' weights and biases and
the sinks at std 1 (decisive routing, sinks that matter), the experts'
gate_up at std 0.45 (some gate and up units past the clamp at 7) and down at
0.01 (logits O(1)). Saved with `save_pretrained`, loaded with
`jaxattn.hf.load_pretrained`, compared in float32 (max |logit difference|
<= 1e-4); each GPT-OSS feature switched off must miss that tolerance. The MXFP4 form of the
hub's files: the same model (F = 32) in bfloat16, its experts quantized here and stored as
`*_blocks`/`*_scales` with the hub's quantization_config, against transformers dequantizing it.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the test extra (make test installs it)
transformers = pytest.importorskip("transformers")
from safetensors.numpy import load_file, save_file
from test_hf import (NO_TOKENS, TOL, check_export, check_greedy_generation, check_logits, checkpoints, jax_logits,
                     max_diff, small, spoiled_difference, tokens, torch_logits)

from jaxattn import LayerKind, MoEConfig, RopeScaling, hf
from jaxattn.hf.architectures import config_from_hf
from jaxattn.hf.mxfp4 import dequantize

transformers.logging.set_verbosity_error()

WINDOW = 6
YARN = dict(rope_type="yarn", rope_theta=150000.0, factor=4.0, beta_fast=32.0, beta_slow=1.0, truncate=False,
            original_max_position_embeddings=16)
CONFIG = dict(vocab_size=100, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, intermediate_size=16, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
              max_position_embeddings=64, rope_parameters=YARN, **NO_TOKENS)
# (std of the redrawn parameter, by the end of its name); the rest N(0, 0.1), norm weights 1 + N(0, 0.1).
SCALES = {"router.weight": 1.0, "router.bias": 1.0, "sinks": 1.0, "gate_up_proj": 0.45, "down_proj": 0.01}


def torch_model(case: str) -> torch.nn.Module:
    sizes = dict(intermediate_size=32) if case == "mxfp4" else {}  # MXFP4 packs 32 inputs a group: F = 32
    config = transformers.GptOssConfig(**CONFIG | sizes, experts_implementation="eager")
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            std = next((s for end, s in SCALES.items() if name.endswith(end)), 0.1)
            center = 1.0 if name.endswith("norm.weight") else 0.0
            p.copy_(center + std * torch.randn(p.shape, generator=generator))
    return model.eval()


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints(tmp_path_factory, torch_model)


def test_logits_equal_transformers(checkpoint):
    loaded = checkpoint("gpt_oss")
    check_logits(loaded, "gpt_oss")
    c = loaded.config
    assert c.moe == MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16, softmax_after_topk=True,
                              router_bias=True, activation="clamped_swiglu", expert_bias=True,
                              gate_up_interleaved=True, swiglu_limit=7.0, swiglu_alpha=1.702)
    assert (c.attn_sinks, c.sliding_window, c.layer_pattern) == (True, WINDOW, (LayerKind(local=True), LayerKind()))
    assert (c.qkv_bias, c.out_bias, c.tie_embeddings, c.num_kv_heads, c.head_dim) == (True, True, False, 2, 16)
    assert c.rope_scaling.kind == "yarn" and not c.rope_scaling.truncate and c.rope_theta == 150000.0


def test_the_experts_pass_the_clamp(checkpoint):
    """Some gate_up units exceed the clamp at 7 (what the no-clamp control needs to see)."""
    model = checkpoint("gpt_oss").model
    seen = []
    hooks = [layer.mlp.experts.register_forward_hook(lambda m, args, out: seen.append(
        torch.einsum("md,edf->emf", args[0], m.gate_up_proj) + m.gate_up_proj_bias[:, None]))
        for layer in model.model.layers]
    with torch.no_grad():
        model(torch.as_tensor(np.random.default_rng(0).integers(0, 100, (2, 24))))
    for hook in hooks:
        hook.remove()
    gate_up = torch.cat([x.flatten(0, 1) for x in seen])
    assert (gate_up[..., ::2] > 7).float().mean() > 0.01 and (gate_up[..., 1::2].abs() > 7).float().mean() > 0.01


def _moe(**changes):
    return lambda c, p: (c.replace(moe=c.moe.replace(**changes)), p)


def _without(*names):
    """Params with every leaf called one of `names` removed."""
    def drop(tree):
        return {k: drop(v) for k, v in tree.items() if k not in names} if isinstance(tree, dict) else tree
    return drop


NEGATIVE_CONTROLS = {  # each must miss the tolerance
    "softmax over all E, then top-k": _moe(softmax_after_topk=False),
    "no clamp": _moe(swiglu_limit=1e6),
    "gate and up as halves": _moe(gate_up_interleaved=False),
    "no router bias": lambda c, p: (c.replace(moe=c.moe.replace(router_bias=False)), _without("router_bias")(p)),
    "no sinks": lambda c, p: (c.replace(attn_sinks=False), _without("sinks")(p)),
    "no sliding windows": lambda c, p: (c.replace(layer_pattern=(), sliding_window=None), p),
}


@pytest.mark.parametrize("name", list(NEGATIVE_CONTROLS))
def test_negative_controls_fail_the_tolerance(checkpoint, name):
    assert spoiled_difference(checkpoint("gpt_oss"), NEGATIVE_CONTROLS[name], name) > TOL


def test_cached_greedy_generation_equals_transformers(checkpoint):
    check_greedy_generation(checkpoint("gpt_oss"))  # 26 tokens, well past the window (6)


# ---------------------------------------------------------------- export


def test_export_round_trip_writes_the_checkpoint_back_exactly(checkpoint, tmp_path):
    loaded = checkpoint("gpt_oss")
    out = hf.save_pretrained(tmp_path / "out", loaded.config, loaded.params).directory
    ours, theirs = load_file(Path(out) / "model.safetensors"), load_file(loaded.path / "model.safetensors")
    assert set(ours) == set(theirs)
    assert all(np.array_equal(ours[name], theirs[name]) for name in theirs)
    assert hf.load_pretrained(out)[0] == loaded.config


GPT_OSS = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16, softmax_after_topk=True, router_bias=True,
                    activation="clamped_swiglu", expert_bias=True, gate_up_interleaved=True)
BASE = dict(num_layers=4, num_kv_heads=2, head_dim=16, moe=GPT_OSS, attn_sinks=True, qkv_bias=True, out_bias=True)
EXPORTS = {
    "alternating windows, yarn, interleaved pairs": small(**BASE, sliding_window=WINDOW, layer_pattern=(
        LayerKind(local=True), LayerKind()), rope_interleaved=True, rope_theta=150000.0, max_seq_len=64,
        rope_scaling=RopeScaling("yarn", 4.0, original_max_position=16, truncate=False)),
    "no windows, no attention biases, tied": small(**BASE | dict(qkv_bias=False, out_bias=False),
                                                   tie_embeddings=True),
}


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_loads_in_transformers_as_the_same_model(tmp_path, name):
    check_export(tmp_path, name, EXPORTS[name], "GptOssForCausalLM")


NO_COUNTERPART = {  # a config close to GPT-OSS that no transformers architecture computes, and the field named
    "experts without sinks": (dict(attn_sinks=False), "attn_sinks"),
    "a dense first layer": (dict(dense_layers=(0,)), "dense_layers"),
    "softmax before top-k": (dict(moe=GPT_OSS.replace(softmax_after_topk=False)), "softmax_after_topk"),
}


@pytest.mark.parametrize("name", list(NO_COUNTERPART))
def test_export_without_a_transformers_counterpart_names_the_field(tmp_path, name):
    changes, field = NO_COUNTERPART[name]
    with pytest.raises(hf.UnsupportedCheckpoint, match=field):
        hf.save_pretrained(tmp_path / "out", small(**BASE | changes), {})
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- refusals of config.json


def _config_only(to: Path, **changes) -> Path:
    transformers.GptOssConfig(**CONFIG).save_pretrained(to)
    written = json.loads((to / "config.json").read_text())
    (to / "config.json").write_text(json.dumps({k: v for k, v in (written | changes).items() if v != "DROP"}))
    return to


UNSUPPORTED = {  # (config.json changes, words the message must hold)
    "sliding layers without a window": (dict(sliding_window=None), ["sliding_window", "sliding_attention"]),
    "chunked attention layers": (dict(layer_types=["chunked_attention"] * 4), ["layer_types", "chunked_attention"]),
    "dynamic rope": (dict(rope_parameters=dict(rope_type="dynamic", rope_theta=1e4, factor=2.0)), ["rope_type"]),
    "fp8 weights": (dict(quantization_config=dict(quant_method="fp8")),  # mxfp4 is read (below), nothing else
                    ["a quantized checkpoint (quantization_config.quant_method='fp8') is not read",
                     "dequantize it first"]),
    "more experts per token than experts": (dict(num_experts_per_tok=9), ["experts_per_token"]),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_or_invalid_configs_name_the_key(tmp_path, name):
    changes, words = UNSUPPORTED[name]
    with pytest.raises(hf.HFCheckpointError) as error:
        hf.load_pretrained(_config_only(tmp_path, **changes))
    assert all(word in str(error.value) for word in words), str(error.value)


def test_transformers_defaults_apply_to_keys_config_json_leaves_out():
    """GPT-OSS's class defaults: YaRN x32 from 4096 positions (base 150000), alternating layers of window 128,
    8 key/value heads of 64 dims, 128 experts, 4 per token, attention biases, eps 1e-5, an untied head."""
    c = config_from_hf(dict(model_type="gpt_oss", architectures=["GptOssForCausalLM"], vocab_size=100,
                            hidden_size=64, num_hidden_layers=4, num_attention_heads=16, intermediate_size=16))[1]
    assert (c.rope_theta, c.rope_scaling.factor, c.rope_scaling.original_max_position) == (150000.0, 32.0, 4096)
    assert not c.rope_scaling.truncate and (c.sliding_window, c.layer_pattern[0]) == (128, LayerKind(local=True))
    assert (c.num_kv_heads, c.head_dim, c.moe.num_experts, c.moe.experts_per_token) == (8, 64, 128, 4)
    assert (c.qkv_bias, c.out_bias, c.norm_eps, c.tie_embeddings, c.max_seq_len) == (True, True, 1e-5, False, 131072)


# ---------------------------------------------------------------- MXFP4 experts (the hub's originals)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_mxfp4_dequantization_equals_transformers(dtype):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors
    rng = np.random.default_rng(0)
    blocks = rng.integers(0, 256, (3, 10, 2, 16), dtype=np.uint8)  # [E, rows, G, 16]: every FP4 code
    scales = rng.integers(0, 255, (3, 10, 2), dtype=np.uint8)  # every scale transformers reads as a number
    scales[0, 0] = 0, 254
    theirs = convert_moe_packed_tensors(torch.as_tensor(blocks), torch.as_tensor(scales), dtype=dtype)
    ours = dequantize(blocks, scales)
    assert ours.shape == (3, 64, 10) and ours.dtype == np.float32
    assert torch.equal(torch.as_tensor(ours).to(dtype), theirs)
    with pytest.raises(ValueError, match="uint8"):
        dequantize(blocks.astype(np.int8), scales)


# The hub's openai/gpt-oss-20b quantization_config, as its config.json has it.
HUB_QUANTIZATION = {"modules_to_not_convert": ["model.layers.*.self_attn", "model.layers.*.mlp.router",
                                               "model.embed_tokens", "lm_head"], "quant_method": "mxfp4"}
FP4 = np.array([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0])


def quantize(w: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """float `[E, in, out]` -> MXFP4 `blocks [E, out, in / 32, 16]`, `scales [E, out, in / 32]` (uint8): per group
    of 32 inputs the smallest power-of-two scale that fits its largest |value| in 6, each value the nearest code."""
    E, d_in, d_out = w.shape
    groups = w.transpose(0, 2, 1).reshape(E, d_out, d_in // 32, 32).astype(np.float64)
    top = np.abs(groups).max(-1, keepdims=True)
    exponent = np.ceil(np.log2(np.maximum(top, 1e-30) / 6.0)).clip(-127, 127)
    scaled = groups / 2.0 ** exponent
    magnitude = np.abs(np.abs(scaled)[..., None] - FP4).argmin(-1)
    codes = (magnitude + 8 * (scaled < 0)).astype(np.uint8)  # sign bit 3
    blocks = codes[..., 0::2] | (codes[..., 1::2] << 4)  # low nibble first
    return blocks, (exponent[..., 0] + 127).astype(np.uint8)


@pytest.fixture(scope="module")
def mxfp4_checkpoint(tmp_path_factory):
    """The tiny GPT-OSS (F = 32) saved in bfloat16 with its experts in MXFP4, as the hub's files are."""
    path = tmp_path_factory.mktemp("mxfp4")
    torch_model("mxfp4").to(torch.bfloat16).save_pretrained(path)
    tensors = load_file(path / "model.safetensors")
    for name in [n for n in tensors if n.endswith(("gate_up_proj", "down_proj"))]:
        tensors[f"{name}_blocks"], tensors[f"{name}_scales"] = quantize(tensors.pop(name).astype(np.float32))
    save_file(tensors, path / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((path / "config.json").read_text())
    (path / "config.json").write_text(json.dumps(config | {"quantization_config": HUB_QUANTIZATION}))
    return path


def test_mxfp4_checkpoint_loads_as_transformers_loads_it(mxfp4_checkpoint):
    """transformers dequantizing the experts itself (`Mxfp4Config(dequantize=True)`, its CPU path without
    triton kernels or accelerate): the same weights, equal logits."""
    model = transformers.AutoModelForCausalLM.from_pretrained(
        mxfp4_checkpoint, dtype=torch.float32, attn_implementation="eager",
        quantization_config=transformers.Mxfp4Config(dequantize=True)).eval()
    config, params = hf.load_pretrained(mxfp4_checkpoint)
    stored = load_file(mxfp4_checkpoint / "model.safetensors")
    h = "model.layers.1.mlp.experts"
    experts = params["blocks_1"]["mlp"]
    for ours, proj in ((experts["experts_gate_up"], "gate_up_proj"), (experts["experts_down"], "down_proj")):
        expected = dequantize(stored[f"{h}.{proj}_blocks"], stored[f"{h}.{proj}_scales"])
        assert np.array_equal(np.asarray(ours), expected)
        assert np.array_equal(getattr(model.model.layers[1].mlp.experts, proj).detach().numpy(), expected)
    assert np.count_nonzero(expected) > expected.size // 2  # the quantized weights are not mostly zeros
    diff = max_diff(jax_logits(config, params, tokens()), torch_logits(model, tokens()))
    print(f"mxfp4: max |logit difference| {diff:.1e}")
    assert diff <= TOL
    assert config.moe.expert_hidden == 32 and config.dtype == "float32"


def test_mxfp4_checkpoint_loads_in_bfloat16_and_exports_floats(mxfp4_checkpoint, tmp_path):
    config, params = hf.load_pretrained(mxfp4_checkpoint, dtype="bfloat16")
    assert params["blocks_0"]["mlp"]["experts_down"].dtype == np.dtype("bfloat16")
    hf.save_pretrained(tmp_path / "out", config, params)
    names = set(load_file(tmp_path / "out" / "model.safetensors"))
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and not any(n.endswith("_blocks") for n in names)


def _spoiled(source: Path, to: Path, name: str, value: np.ndarray) -> Path:
    shutil.copytree(source, to)
    save_file(load_file(source / "model.safetensors") | {name: value}, to / "model.safetensors",
              metadata={"format": "pt"})
    return to


def test_a_wrong_mxfp4_scales_shape_or_dtype_names_the_tensor(mxfp4_checkpoint, tmp_path):
    name = "model.layers.2.mlp.experts.down_proj_scales"  # [E, D, F / 32] = (8, 64, 1)
    with pytest.raises(hf.InvalidCheckpoint) as error:
        hf.load_pretrained(_spoiled(mxfp4_checkpoint, tmp_path / "shape", name, np.zeros((8, 64, 2), np.uint8)))
    assert all(word in str(error.value) for word in (name, "(8, 64, 1)", "(8, 64, 2)")), str(error.value)
    with pytest.raises(hf.InvalidCheckpoint) as error:
        hf.load_pretrained(_spoiled(mxfp4_checkpoint, tmp_path / "dtype", name, np.zeros((8, 64, 1), np.int8)))
    assert all(word in str(error.value) for word in (name, "I8", "U8")), str(error.value)
