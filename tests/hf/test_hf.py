"""Hugging Face interop (jaxattn.hf) against transformers itself: logits, generation, export, errors.

Every architecture and feature is a tiny transformers model with every
parameter redrawn (biases and norm weights too: default init leaves biases
at 0 and norms at 1, which hides mapping errors; std 0.1 so attention is sharp
enough to expose RoPE errors), saved with `save_pretrained`, loaded with
`jaxattn.hf.load_pretrained` and compared in float32 (max |logit difference|
<= 1e-4). A negative control per feature (the feature switched off or set
wrong) must fail that tolerance: the comparison can see the errors it guards
against. Exports are loaded back by `AutoModelForCausalLM`.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
torch = pytest.importorskip("torch")  # the test extra (make test installs it)
transformers = pytest.importorskip("transformers")
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

import jaxattn
from jaxattn import hf
from train.config import load_config

transformers.logging.set_verbosity_error()


VOCAB, D, LAYERS, HEADS, SEQ = 100, 64, 2, 4, 24
TOL = 1e-4  # max abs logit difference in float32
NO_TOKENS = dict(bos_token_id=None, eos_token_id=None, pad_token_id=None)
torch.set_num_threads(1)  # tiny models: threads cost more than they give, and pytest-xdist runs two workers


def llama_like(**changes) -> dict:
    return dict(vocab_size=VOCAB, hidden_size=D, num_hidden_layers=LAYERS, num_attention_heads=HEADS,
                intermediate_size=96, max_position_embeddings=64, rms_norm_eps=1e-6, **NO_TOKENS) | changes


def deepseek(**changes) -> dict:
    return llama_like(num_key_value_heads=HEADS, kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16,
                      qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=4, first_k_dense_replace=LAYERS,
                      num_nextn_predict_layers=0) | changes


YARN_V3 = dict(rope_type="yarn", rope_theta=10000.0, factor=40.0, mscale=1.0, mscale_all_dim=1.0,
               original_max_position_embeddings=16, beta_fast=32, beta_slow=1)
# name: (transformers config class, its arguments). One model per architecture and feature.
CASES = {
    "gpt2": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=HEADS, n_positions=64,
                                **NO_TOKENS)),
    "gpt2_untied_erf": ("GPT2Config", dict(vocab_size=VOCAB, n_embd=D, n_layer=LAYERS, n_head=HEADS,
                                           n_positions=64, n_inner=96, activation_function="gelu",
                                           tie_word_embeddings=False, **NO_TOKENS)),
    "llama_mha": ("LlamaConfig", llama_like()),
    "llama_gqa": ("LlamaConfig", llama_like(num_key_value_heads=2)),
    "llama_mqa": ("LlamaConfig", llama_like(num_key_value_heads=1)),
    "llama_theta_5e5": ("LlamaConfig", llama_like(num_key_value_heads=2, rope_parameters=dict(
        rope_type="default", rope_theta=5e5))),
    "llama_linear": ("LlamaConfig", llama_like(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor=4.0))),
    # Wavelengths 6.3 (between the thresholds 4 and 16: smoothed) and >= 20 (beyond 16: divided by 8).
    "llama3_scaling": ("LlamaConfig", llama_like(num_key_value_heads=2, max_position_embeddings=128,
                                                 rope_parameters=dict(rope_type="llama3", rope_theta=1e4, factor=8.0,
                                                                      low_freq_factor=1.0, high_freq_factor=4.0,
                                                                      original_max_position_embeddings=16))),
    "llama_yarn": ("LlamaConfig", llama_like(rope_parameters=dict(rope_type="yarn", rope_theta=1e4, factor=4.0,
                                                                 original_max_position_embeddings=16))),
    "llama_tied_smollm": ("LlamaConfig", llama_like(num_key_value_heads=2, tie_word_embeddings=True)),
    "llama_head_dim_32": ("LlamaConfig", llama_like(num_key_value_heads=2, head_dim=32)),
    "llama_biases_geglu": ("LlamaConfig", llama_like(attention_bias=True, mlp_bias=True,
                                                     hidden_act="gelu_pytorch_tanh")),
    "mistral_window": ("MistralConfig", llama_like(num_key_value_heads=2, sliding_window=8)),
    "qwen2_qkv_bias": ("Qwen2Config", llama_like(num_key_value_heads=2, tie_word_embeddings=True)),
    "qwen3_qk_norm": ("Qwen3Config", llama_like(num_key_value_heads=2, head_dim=16)),
    "deepseek_v2": ("DeepseekV2Config", deepseek(q_lora_rank=None)),
    "deepseek_v2_qlora_bias": ("DeepseekV2Config", deepseek(attention_bias=True)),
    "deepseek_v3_yarn_mscale": ("DeepseekV3Config", deepseek(max_position_embeddings=640, rope_parameters=YARN_V3)),
    "deepseek_v3_plain_yarn": ("DeepseekV3Config", deepseek(q_lora_rank=None, attention_bias=True, rope_parameters=dict(
        rope_type="yarn", rope_theta=1e4, factor=4.0, original_max_position_embeddings=16))),
    "deepseek_v3_half_split": ("DeepseekV3Config", deepseek(rope_interleave=False)),
    "gpt_neox": ("GPTNeoXConfig", llama_like(use_parallel_residual=False, rotary_pct=1.0, hidden_act="gelu")),
    "gpt_neox_tied": ("GPTNeoXConfig", llama_like(use_parallel_residual=False, rotary_pct=1.0, attention_bias=False,
                                                  hidden_act="gelu_new", tie_word_embeddings=True)),
}


def randomize_(model: torch.nn.Module, std: float = 0.1, norm_center: float = 1.0) -> None:
    """Redraws every parameter: norm weights norm_center + N(0, std), everything else N(0, std).

    `norm_center` 0 for norms that scale by (1 + w) (Gemma), whose weights are initialised to 0.
    """
    generator = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=generator) * std
            is_norm = name.endswith("weight") and p.ndim == 1
            p.copy_((norm_center + noise) if is_norm else noise)


def torch_model(case: str) -> torch.nn.Module:
    """The randomised transformers model of `CASES[case]` (eager attention, float32, eval mode)."""
    kind, kwargs = CASES[case]
    config = getattr(transformers, kind)(**kwargs)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config, attn_implementation="eager")
    randomize_(model)
    return model.eval()


def tokens(batch: int = 2, length: int = SEQ, seed: int = 0, vocab: int = VOCAB) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, vocab, (batch, length))


def torch_logits(model, ids: np.ndarray) -> np.ndarray:
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()


def jax_logits(config: jaxattn.ModelConfig, params, ids: np.ndarray) -> np.ndarray:
    # Not jitted: op by op, the tiny models' ops are compiled once per shape and shared by every
    # architecture and negative control, which is faster here than compiling each model whole.
    logits = jaxattn.DecoderLM(config).apply({"params": params}, jnp.asarray(ids))
    chex.assert_shape(logits, (*ids.shape, config.vocab_size))
    return np.asarray(logits, np.float32)


def max_diff(a: np.ndarray, b: np.ndarray) -> float:
    assert a.shape == b.shape, (a.shape, b.shape)
    return float(np.max(np.abs(a - b)))


def random_params(config: jaxattn.ModelConfig, seed: int = 0, std: float = 0.1):
    """DecoderLM params drawn with numpy (norm scales 1 + N(0, std), the rest N(0, std)).

    With `norm_unit_offset` (norms scale by 1 + w) the norm scales w are N(0, std), around their init.
    The shapes come from `jax.eval_shape`: no initialiser runs, so nothing is compiled.
    """
    init = lambda: jaxattn.DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 2), jnp.int32))  # noqa: E731
    shapes = flatten_dict(nn.unbox(jax.eval_shape(init)["params"]))
    rng, center = np.random.default_rng(seed), 0.0 if config.norm_unit_offset else 1.0
    return unflatten_dict({path: jnp.asarray(center * (path[-1] == "scale") + std * rng.standard_normal(leaf.shape),
                                             leaf.dtype) for path, leaf in shapes.items()})


# ---------------------------------------------------------------- loading: the logits of transformers


@dataclasses.dataclass
class Loaded:
    model: torch.nn.Module  # the transformers model
    path: Path  # its save_pretrained directory
    config: jaxattn.ModelConfig  # what jaxattn.hf made of it
    params: dict
    logits: np.ndarray  # transformers' logits of tokens()


def checkpoints(tmp_path_factory, build):
    """case -> `Loaded`: the transformers model `build(case)`, saved and loaded once per module."""
    cache = {}

    def get(case: str) -> Loaded:
        if case not in cache:
            model = build(case)
            path = tmp_path_factory.mktemp(case)
            model.save_pretrained(path)
            cache[case] = Loaded(model, path, *hf.load_pretrained(path), torch_logits(model, tokens()))
        return cache[case]
    return get


def check_logits(loaded: Loaded, case: str) -> None:
    diff = max_diff(jax_logits(loaded.config, loaded.params, tokens()), loaded.logits)
    print(f"{case}: max |logit difference| {diff:.1e}")
    assert diff <= TOL


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return checkpoints(tmp_path_factory, torch_model)


@pytest.mark.parametrize("case", list(CASES))
def test_logits_equal_transformers(checkpoint, case):
    loaded = checkpoint(case)
    check_logits(loaded, case)
    assert {leaf.dtype for leaf in jax.tree_util.tree_leaves(loaded.params)} == {jnp.dtype("float32")}


EXPECTED_FIELDS = {  # what each checkpoint must become (the features the tests below switch off)
    "gpt2": dict(positions="learned", norm="layernorm", use_bias=True, tie_embeddings=True, fused_qkv=True),
    "gpt2_untied_erf": dict(gelu_approximate=False, tie_embeddings=False, mlp_hidden=96),
    "llama_mqa": dict(num_kv_heads=1, rope_interleaved=False, mlp="swiglu", tie_embeddings=False),
    "llama_theta_5e5": dict(rope_theta=5e5, rope_scaling=None),
    "llama_tied_smollm": dict(tie_embeddings=True),
    "llama_head_dim_32": dict(head_dim=32, num_kv_heads=2),
    "llama_biases_geglu": dict(mlp="geglu", gelu_approximate=True, qkv_bias=True, out_bias=True, mlp_bias=True),
    "mistral_window": dict(sliding_window=8, qkv_bias=False),
    "qwen2_qkv_bias": dict(qkv_bias=True, out_bias=False, mlp_bias=False, sliding_window=None),
    "qwen3_qk_norm": dict(qk_norm="head", qkv_bias=False),
    "deepseek_v2": dict(rope_interleaved=True, qkv_bias=False),
    "deepseek_v3_half_split": dict(rope_interleaved=False),
    "gpt_neox": dict(norm="layernorm", positions="rope", qkv_bias=True, mlp_bias=True, gelu_approximate=False),
    "gpt_neox_tied": dict(tie_embeddings=True, qkv_bias=False, out_bias=False, mlp_bias=True),
}


@pytest.mark.parametrize("case", list(EXPECTED_FIELDS))
def test_loaded_configs_name_the_features(checkpoint, case):
    config = checkpoint(case).config
    assert {name: getattr(config, name) for name in EXPECTED_FIELDS[case]} == EXPECTED_FIELDS[case]


def test_yarn_settings_become_transformers_attention_factor(checkpoint):
    deepseek_v3 = checkpoint("deepseek_v3_yarn_mscale").config
    assert deepseek_v3.mla.q_lora_rank == 24 and deepseek_v3.rope_scaling.factor == 40.0
    assert deepseek_v3.rope_scaling.attention_factor == 1.0  # mscale / mscale_all_dim, both 1
    assert deepseek_v3.rope_scaling.mscale_all_dim == 1.0
    plain = checkpoint("deepseek_v3_plain_yarn").config
    assert plain.mla.q_lora_rank is None
    assert plain.rope_scaling.attention_factor == pytest.approx(0.1 * np.log(4.0) + 1.0)


def _without(params, *parts):
    """params less every leaf whose path (joined with "/") contains one of `parts`, e.g. "query/bias"."""
    flat = flatten_dict(params)
    return unflatten_dict({p: v for p, v in flat.items() if not any(part in "/".join(p) for part in parts)})


def _scaling(**changes):
    return lambda c, p: (c.replace(rope_scaling=dataclasses.replace(c.rope_scaling, **changes)), p)


# Each feature switched off or set wrong must fail the tolerance: the test sees the errors it guards against.
NEGATIVE_CONTROLS = {
    "deepseek_v3 interleaved pairs read half-split": (
        "deepseek_v3_yarn_mscale", lambda c, p: (c.replace(rope_interleaved=False), p)),
    "deepseek_v2 interleaved pairs read half-split": (
        "deepseek_v2", lambda c, p: (c.replace(rope_interleaved=False), p)),
    "deepseek_v3 half-split pairs read interleaved": (
        "deepseek_v3_half_split", lambda c, p: (c.replace(rope_interleaved=True), p)),
    "llama half-split pairs read interleaved": ("llama_gqa", lambda c, p: (c.replace(rope_interleaved=True), p)),
    "qwen3 without qk_norm": ("qwen3_qk_norm", lambda c, p: (
        c.replace(qk_norm="none"), _without(p, "q_norm", "k_norm"))),
    "qwen2 without its qkv biases": ("qwen2_qkv_bias", lambda c, p: (
        c.replace(qkv_bias=False), _without(p, "query/bias", "key/bias", "value/bias"))),
    "mistral without its sliding window": ("mistral_window", lambda c, p: (c.replace(sliding_window=None), p)),
    "deepseek_v3 yarn factor 20 for 40": ("deepseek_v3_yarn_mscale", _scaling(factor=20.0)),
    "deepseek_v3 yarn without the softmax mscale": ("deepseek_v3_yarn_mscale", _scaling(mscale_all_dim=0.0)),
    "deepseek_v3 plain yarn without its attention factor": ("deepseek_v3_plain_yarn", _scaling(attention_factor=1.0)),
    "llama yarn factor 2 for 4": ("llama_yarn", _scaling(factor=2.0)),
    "llama3 scaling ignored": ("llama3_scaling", lambda c, p: (c.replace(rope_scaling=None), p)),
    "linear scaling ignored": ("llama_linear", lambda c, p: (c.replace(rope_scaling=None), p)),
    "theta 1e4 for 5e5": ("llama_theta_5e5", lambda c, p: (c.replace(rope_theta=1e4), p)),
    "gpt2 tanh gelu for erf": ("gpt2_untied_erf", lambda c, p: (c.replace(gelu_approximate=True), p)),
    "gpt_neox half-split pairs read interleaved": ("gpt_neox", lambda c, p: (c.replace(rope_interleaved=True), p)),
}


def spoiled_difference(loaded: Loaded, spoil, name: str) -> float:
    """Max |logit difference| from transformers of the loaded model with `spoil` applied to (config, params)."""
    config, params = spoil(loaded.config, loaded.params)
    diff = max_diff(jax_logits(config, params, tokens()), loaded.logits)
    print(f"{name}: max |logit difference| {diff:.1e}")
    return diff


@pytest.mark.parametrize("name", list(NEGATIVE_CONTROLS))
def test_negative_controls_fail_the_tolerance(checkpoint, name):
    case, spoil = NEGATIVE_CONTROLS[name]
    # The right model is within ~3e-6; tanh vs erf GELU, the closest spoil, is ~6e-4.
    assert spoiled_difference(checkpoint(case), spoil, name) > TOL


# ---------------------------------------------------------------- cached greedy generation


def check_greedy_generation(loaded: Loaded) -> None:
    """20 cached greedy tokens after a 6-token prompt equal transformers' `generate`."""
    prompt, new = tokens(1, 6, seed=3), 20
    with torch.no_grad():
        expected = loaded.model.generate(torch.as_tensor(prompt), do_sample=False, max_new_tokens=new,
                                         min_new_tokens=new, pad_token_id=0)[0, prompt.shape[1]:].numpy()
    out = jaxattn.generate(loaded.params, loaded.config, prompt, np.array([prompt.shape[1]]), max_new_tokens=new,
                           rng=jax.random.PRNGKey(0), temperature=0.0)
    chex.assert_shape(out.tokens, (1, new))
    np.testing.assert_array_equal(np.asarray(out.tokens[0]), expected)


@pytest.mark.parametrize("case", ["gpt2", "llama_gqa", "mistral_window", "deepseek_v3_yarn_mscale"])
def test_cached_greedy_generation_equals_transformers(checkpoint, case):
    check_greedy_generation(checkpoint(case))  # Mistral's 26 tokens run well past its window (8)


# ---------------------------------------------------------------- export: transformers loads the same model


def small(**changes) -> jaxattn.ModelConfig:
    base = dict(vocab_size=VOCAB, d_model=D, num_layers=LAYERS, num_heads=HEADS, mlp_hidden=96, max_seq_len=64,
                positions="rope", norm="rmsnorm", norm_eps=1e-6, mlp="swiglu", tie_embeddings=False)
    return jaxattn.ModelConfig(**(base | changes))


MLA = jaxattn.MLAConfig(kv_lora_rank=16, q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
YARN = jaxattn.RopeScaling("yarn", 40.0, original_max_position=16, mscale=1.0, mscale_all_dim=1.0)
BABY = load_config("shakespeare_char_baby").model
# name: (a jaxattn config, the transformers class it must export to)
EXPORTS = {
    "baby_default": (BABY, "GPTNeoXForCausalLM"),
    "baby_learned_positions": (BABY.replace(positions="learned"), "GPT2LMHeadModel"),
    "gpt2_biases_untied_erf": (small(positions="learned", norm="layernorm", norm_eps=1e-5, mlp="gelu", use_bias=True,
                                     gelu_approximate=False), "GPT2LMHeadModel"),
    "llama_gqa_interleaved_linear": (small(num_kv_heads=2, head_dim=32, rope_interleaved=True,
                                           rope_scaling=jaxattn.RopeScaling("linear", 4.0)), "LlamaForCausalLM"),
    "llama_qkv_bias_geglu_llama3_tied": (small(qkv_bias=True, mlp="geglu", gelu_approximate=False, tie_embeddings=True,
                                               fused_qkv=False, rope_scaling=jaxattn.RopeScaling(
                                                   "llama3", 8.0, original_max_position=16)), "LlamaForCausalLM"),
    "mistral_window": (small(num_kv_heads=2, sliding_window=8, rope_theta=5e5), "MistralForCausalLM"),
    "qwen2_window_qkv_bias": (small(num_kv_heads=1, sliding_window=8, qkv_bias=True), "Qwen2ForCausalLM"),
    "qwen3_qk_norm_yarn_biases": (small(num_kv_heads=2, qk_norm=True, use_bias=True, mlp_bias=False,
                                        rope_interleaved=True, rope_scaling=jaxattn.RopeScaling(
                                            "yarn", 4.0, original_max_position=16)), "Qwen3ForCausalLM"),
    "deepseek_v3_mla_yarn_mscale": (small(mla=MLA, rope_interleaved=True, rope_scaling=YARN, qkv_bias=True,
                                          max_seq_len=640), "DeepseekV3ForCausalLM"),
    "deepseek_v3_half_split_geglu": (small(mla=MLA.replace(q_lora_rank=None), mlp="geglu", tie_embeddings=True),
                                     "DeepseekV3ForCausalLM"),
    "deepseek_v2_mlp_bias": (small(mla=MLA, rope_interleaved=True, mlp_bias=True, out_bias=True),
                             "DeepseekV2ForCausalLM"),
    "gpt_neox_interleaved_biases": (small(norm="layernorm", norm_eps=1e-5, mlp="gelu", use_bias=True,
                                          rope_interleaved=True), "GPTNeoXForCausalLM"),
}


def check_export(tmp_path, name, config, architecture):
    """Export `config` with random parameters; transformers loads it as `architecture`, equal in logits,
    and loading it back gives the same function."""
    params, ids = random_params(config), tokens(vocab=config.vocab_size)
    expected = jax_logits(config, params, ids)
    path = hf.save_pretrained(tmp_path / "out", config, params).directory
    model, info = transformers.AutoModelForCausalLM.from_pretrained(
        path, dtype=torch.float32, attn_implementation="eager", output_loading_info=True)
    assert type(model).__name__ == architecture
    assert not any(info[key] for key in ("missing_keys", "unexpected_keys", "mismatched_keys"))
    diff = max_diff(torch_logits(model.eval(), ids), expected)
    print(f"{name} -> {architecture}: max |logit difference| {diff:.1e}")
    assert diff <= TOL
    again, again_params = hf.load_pretrained(path)  # and back: the same function
    assert max_diff(jax_logits(again, again_params, ids), expected) <= TOL


@pytest.mark.parametrize("name", list(EXPORTS))
def test_export_loads_in_transformers_as_the_same_model(tmp_path, name):
    check_export(tmp_path, name, *EXPORTS[name])


def test_the_default_model_exports_with_tied_embeddings_and_no_biases(tmp_path):
    hf.save_pretrained(tmp_path, BABY, random_params(BABY))
    written = json.loads((tmp_path / "config.json").read_text())
    assert written["tie_word_embeddings"] and not written["attention_bias"] and not written["use_parallel_residual"]
    assert written["rope_parameters"]["partial_rotary_factor"] == 1.0
    tensors = load_file(tmp_path / "model.safetensors")
    assert "lm_head.weight" not in tensors and "embed_out.weight" not in tensors
    zero_biases = [n for n in tensors if n.endswith(".bias")]  # GPT-NeoX's MLP and LayerNorms insist on them
    assert zero_biases and all(not tensors[n].any() for n in zero_biases)


# ---------------------------------------------------------------- dtypes, shards, older formats


def test_a_bfloat16_checkpoint_loads_as_bfloat16_and_as_float32(tmp_path):
    torch_model("llama_gqa").to(torch.bfloat16).save_pretrained(tmp_path)
    # The stored (rounded) numbers computed in float32 (a model read back as float32 recomputes its RoPE
    # frequencies in float32; `.float()` of the bfloat16 model would keep them rounded).
    as_f32 = transformers.AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32,
                                                               attn_implementation="eager")
    expected = torch_logits(as_f32.eval(), tokens())
    f32_config, f32 = hf.load_pretrained(tmp_path, dtype="float32")
    bf16_config, bf16 = hf.load_pretrained(tmp_path, dtype="bfloat16")
    assert (f32_config.dtype, f32_config.param_dtype) == ("float32", "float32")
    assert (bf16_config.dtype, bf16_config.param_dtype) == ("bfloat16", "bfloat16")
    chex.assert_trees_all_equal_dtypes(f32, jax.tree.map(lambda x: x.astype(jnp.float32), f32))
    chex.assert_trees_all_equal_dtypes(bf16, jax.tree.map(lambda x: x.astype(jnp.bfloat16), bf16))
    chex.assert_trees_all_equal(jax.tree.map(lambda x: x.astype(jnp.float32), bf16), f32)  # bfloat16 is exact
    assert max_diff(jax_logits(f32_config, f32, tokens()), expected) <= TOL
    # bfloat16 compute: the same model, to bfloat16's precision.
    assert max_diff(jax_logits(bf16_config, bf16, tokens()), expected) < 0.1 * np.abs(expected).max()
    hf.save_pretrained(tmp_path / "again", bf16_config, bf16)  # and out again, as bfloat16
    assert json.loads((tmp_path / "again" / "config.json").read_text())["dtype"] == "bfloat16"
    with safe_open(tmp_path / "again" / "model.safetensors", framework="numpy") as f:
        assert {f.get_slice(name).get_dtype() for name in f.keys()} == {"BF16"}
    chex.assert_trees_all_equal(hf.load_pretrained(tmp_path / "again", dtype="bfloat16")[1], bf16)


def test_a_sharded_checkpoint_loads(checkpoint, tmp_path):
    loaded = checkpoint("qwen2_qkv_bias")
    loaded.model.save_pretrained(tmp_path, max_shard_size="40KB")
    weight_map = json.loads((tmp_path / "model.safetensors.index.json").read_text())["weight_map"]
    assert len(set(weight_map.values())) > 1 and not (tmp_path / "model.safetensors").exists()
    config, params = hf.load_pretrained(tmp_path)
    assert max_diff(jax_logits(config, params, tokens()), loaded.logits) <= TOL


def _copy_checkpoint(loaded: Loaded, to, *, config_changes=None, tensors=None):
    """A copy of a saved checkpoint, its config.json updated and its tensors replaced by `tensors(dict)`."""
    to.mkdir(parents=True, exist_ok=True)
    written = json.loads((loaded.path / "config.json").read_text()) | (config_changes or {})
    (to / "config.json").write_text(json.dumps(written))
    stored = load_file(loaded.path / "model.safetensors")
    save_file(tensors(stored) if tensors else stored, to / "model.safetensors", metadata={"format": "pt"})
    return to


def test_legacy_rope_scaling_and_rope_theta_are_read(checkpoint, tmp_path):
    loaded = checkpoint("llama_linear")
    legacy = {"rope_parameters": None, "rope_theta": 1e4, "rope_scaling": {"type": "linear", "factor": 4.0}}
    config, params = hf.load_pretrained(_copy_checkpoint(loaded, tmp_path, config_changes=legacy))
    assert config.rope_scaling == jaxattn.RopeScaling("linear", 4.0)
    assert max_diff(jax_logits(config, params, tokens()), loaded.logits) <= TOL


def test_buffers_legacy_names_and_hub_files_without_the_base_prefix_load(checkpoint, tmp_path):
    gpt2 = checkpoint("gpt2")
    unprefixed = lambda t: {n.removeprefix("transformer."): v for n, v in t.items()}  # noqa: E731  (as on the hub)
    masks = lambda t: unprefixed(t) | {"h.0.attn.bias": np.ones((1, 1, 64, 64), np.float32),  # noqa: E731
                                       "h.0.attn.masked_bias": np.float32([-1e4])}
    config, params = hf.load_pretrained(_copy_checkpoint(gpt2, tmp_path / "gpt2", tensors=masks))
    assert max_diff(jax_logits(config, params, tokens()), gpt2.logits) <= TOL
    neox = checkpoint("gpt_neox")
    def renamed(stored):  # the head under its transformers 4 name, and an old rotary buffer
        legacy = {("embed_out.weight" if n == "lm_head.weight" else n): v for n, v in stored.items()}
        return legacy | {"gpt_neox.layers.0.attention.rotary_emb.inv_freq": np.ones(8, np.float32)}
    config, params = hf.load_pretrained(_copy_checkpoint(neox, tmp_path / "neox", tensors=renamed))
    assert max_diff(jax_logits(config, params, tokens()), neox.logits) <= TOL


# ---------------------------------------------------------------- every error path


def _config_only(loaded: Loaded, to, **changes):
    """A directory holding only the changed config.json: an error raised here comes before any tensor is read."""
    to.mkdir(parents=True, exist_ok=True)
    written = json.loads((loaded.path / "config.json").read_text()) | changes
    (to / "config.json").write_text(json.dumps(written))
    return to


ROPE = dict(rope_theta=1e4)
UNSUPPORTED = {  # (case, config.json changes, words the message must hold)
    "another architecture": ("llama_gqa", dict(model_type="bert", architectures=["BertForMaskedLM"]), ["bert"]),
    "a model without its head": ("llama_gqa", dict(architectures=["LlamaForSequenceClassification"]),
                                 ["LlamaForSequenceClassification"]),
    # Mixture-of-experts loads (tests/hf/test_hf_moe.py); what transformers computes otherwise is refused.
    "deepseek_v3 softmax experts": ("deepseek_v3_yarn_mscale", dict(first_k_dense_replace=1, num_experts_per_tok=2,
                                                                    n_group=2, topk_group=1, scoring_func="softmax"),
                                    ["DeepseekV3ForCausalLM", "scoring_func", "'softmax'"]),
    "deepseek_v2 noaux_tc experts": ("deepseek_v2", dict(first_k_dense_replace=0, num_experts_per_tok=2,
                                                         topk_method="noaux_tc"), ["topk_method", "noaux_tc"]),
    "qwen2-moe gelu experts": ("llama_gqa", dict(model_type="qwen2_moe", architectures=["Qwen2MoeForCausalLM"],
                                                 num_experts=8, hidden_act="gelu"),
                               ["hidden_act", "Qwen2MoeForCausalLM"]),
    "qwen3-moe mixed layers": ("qwen3_qk_norm", dict(model_type="qwen3_moe", architectures=["Qwen3MoeForCausalLM"],
                                                     num_experts=8, layer_types=["full_attention", "sliding_attention"]),
                               ["layer_types"]),
    "mixtral mixed layers": ("mistral_window", dict(model_type="mixtral", architectures=["MixtralForCausalLM"],
                                                    num_local_experts=8,
                                                    layer_types=["full_attention", "sliding_attention"]),
                             ["layer_types"]),
    "experts in a dense family": ("llama_gqa", dict(num_local_experts=4), ["mixture-of-experts", "LlamaForCausalLM"]),
    "dynamic rope": ("llama_gqa", dict(rope_parameters=dict(ROPE, rope_type="dynamic", factor=2.0)), ["dynamic"]),
    "longrope": ("llama_gqa", dict(rope_parameters=dict(ROPE, rope_type="longrope", short_factor=[1.0] * 8,
                                                        long_factor=[1.0] * 8)), ["longrope"]),
    "partial rotary in llama": ("llama_gqa", dict(rope_parameters=dict(ROPE, rope_type="default",
                                                                       partial_rotary_factor=0.25)),
                                ["LlamaForCausalLM", "partial_rotary_factor"]),
    "an odd number of rotated dims": ("gpt_neox", dict(rope_parameters=dict(ROPE, rope_type="default",
                                                                             partial_rotary_factor=0.2)),
                                      ["partial_rotary_factor", "= 3 rotated dims"]),
    "mistral mixed sliding layers": ("mistral_window", dict(layer_types=["full_attention", "sliding_attention"]),
                                     ["layer_types"]),
    "an unknown layer type": ("qwen3_qk_norm", dict(use_sliding_window=True, sliding_window=8,
                                                    layer_types=["full_attention", "chunked_attention"]),
                              ["layer_types", "chunked_attention"]),
    "gpt2 inverse layer scaling": ("gpt2", dict(scale_attn_by_inverse_layer_idx=True),
                                   ["scale_attn_by_inverse_layer_idx"]),
    "gpt2 reordered upcast": ("gpt2", dict(reorder_and_upcast_attn=True), ["reorder_and_upcast_attn"]),
    "an unknown activation": ("llama_gqa", dict(hidden_act="relu"), ["hidden_act", "relu"]),
    "deepseek eps": ("deepseek_v2", dict(rms_norm_eps=1e-5), ["rms_norm_eps"]),
}


@pytest.mark.parametrize("name", list(UNSUPPORTED))
def test_unsupported_checkpoints_are_refused_naming_the_field(checkpoint, tmp_path, name):
    case, changes, words = UNSUPPORTED[name]
    with pytest.raises(hf.UnsupportedCheckpoint) as error:
        hf.load_pretrained(_config_only(checkpoint(case), tmp_path, **changes))
    assert isinstance(error.value, ValueError) and all(word in str(error.value) for word in words), str(error.value)


Q = "model.layers.1.self_attn.q_proj.weight"
BAD_TENSORS = {  # (tensor edit, words the message must hold)
    "missing": (lambda t: {n: v for n, v in t.items() if n != Q}, [Q, "expected shape (64, 64)", "found none"]),
    "unexpected": (lambda t: t | {"model.layers.0.self_attn.extra.weight": np.zeros((3, 4), np.float32)},
                   ["model.layers.0.self_attn.extra.weight", "expected none", "(3, 4)"]),
    "wrong shape": (lambda t: t | {Q: np.zeros((63, 64), np.float32)}, [Q, "expected shape (64, 64)", "(63, 64)"]),
}


@pytest.mark.parametrize("name", list(BAD_TENSORS))
def test_tensor_mismatches_name_the_tensor_and_both_shapes(checkpoint, tmp_path, name):
    edit, words = BAD_TENSORS[name]
    with pytest.raises(ValueError) as error:
        hf.load_pretrained(_copy_checkpoint(checkpoint("llama_gqa"), tmp_path, tensors=edit))
    assert not isinstance(error.value, hf.UnsupportedCheckpoint)
    assert all(word in str(error.value) for word in words), str(error.value)


def test_load_refuses_other_dtypes_and_directories_without_a_checkpoint(checkpoint, tmp_path):
    with pytest.raises(ValueError, match="dtype"):
        hf.load_pretrained(checkpoint("llama_gqa").path, dtype="float16")
    with pytest.raises(hf.InvalidCheckpoint, match="config.json: does not exist: not a Hugging Face checkpoint"):
        hf.load_pretrained(tmp_path)
    with pytest.raises(hf.InvalidCheckpoint, match="nowhere: does not exist"):
        hf.load_pretrained(tmp_path / "nowhere")
    with pytest.raises(hf.InvalidCheckpoint, match="no_weights: holds no model.safetensors"):
        hf.load_pretrained(_config_only(checkpoint("llama_gqa"), tmp_path / "no_weights"))


NO_COUNTERPART = {  # a config no transformers architecture computes, and the field the message names
    "sinusoidal positions": (small(positions="sinusoidal", norm="layernorm", mlp="gelu"), "positions"),
    "no positions with layernorm": (small(positions="none", norm="layernorm", mlp="gelu"), "positions"),
    "rmsnorm with a plain gelu mlp": (small(mlp="gelu"), "mlp"),
    "rmsnorm with learned positions": (small(positions="learned", mlp="gelu"), "norm"),
    "layernorm rope with gqa": (small(norm="layernorm", mlp="gelu", num_kv_heads=2), "num_kv_heads"),
    "layernorm rope with a gated mlp": (small(norm="layernorm"), "mlp"),
    "gpt2 with its own head_dim": (small(positions="learned", norm="layernorm", mlp="gelu", head_dim=8), "head_dim"),
    "mla without rope": (small(mla=MLA, positions="learned"), "positions"),
    "mla with another eps": (small(mla=MLA, norm_eps=1e-5), "norm_eps"),
    "static ntk scaling": (small(rope_scaling=jaxattn.RopeScaling("ntk", 2.0)), "ntk"),
    "a window, qk norm and mlp biases": (small(sliding_window=8, qk_norm="head", mlp_bias=True), "mlp_bias"),
    "gpt2 with a window": (small(positions="learned", norm="layernorm", mlp="gelu", sliding_window=8),
                           "sliding_window"),
}


@pytest.mark.parametrize("name", list(NO_COUNTERPART))
def test_export_without_a_transformers_counterpart_names_the_field(tmp_path, name):
    config, field = NO_COUNTERPART[name]
    with pytest.raises(hf.UnsupportedCheckpoint, match=field):
        hf.save_pretrained(tmp_path / "out", config, random_params(config))
    assert not (tmp_path / "out").exists()  # refused before anything is written


def test_save_refuses_a_non_empty_directory_unless_told_to_overwrite(tmp_path):
    config = EXPORTS["mistral_window"][0]
    params = random_params(config)
    (tmp_path / "notes.txt").write_text("mine")
    (tmp_path / "model-00001-of-00002.safetensors").write_bytes(b"no index lists it: the user's")
    with pytest.raises(FileExistsError, match="overwrite=True"):
        hf.save_pretrained(tmp_path, config, params)
    with pytest.raises(TypeError, match="tokenizer"):
        hf.save_pretrained(tmp_path, config, params, tokenizer="not a tokenizer", overwrite=True)
    assert not (tmp_path / "config.json").exists()
    report = hf.save_pretrained(tmp_path, config, params, overwrite=True)
    assert (tmp_path / "notes.txt").read_text() == "mine"  # only the checkpoint's files are written
    assert (tmp_path / "model-00001-of-00002.safetensors").read_bytes() == b"no index lists it: the user's"
    assert [p.name for p in report.written] == ["config.json", "generation_config.json", "model.safetensors"]
    assert report.replaced == () and report.architecture == "MistralForCausalLM"
    again, again_params = hf.load_pretrained(tmp_path)
    assert max_diff(jax_logits(again, again_params, tokens()), jax_logits(config, params, tokens())) <= TOL


def test_save_refuses_params_of_another_config(tmp_path):
    config = EXPORTS["mistral_window"][0]
    with pytest.raises(ValueError, match=r"blocks_0/attn/qkv/kernel: expected shape \(64, 192\), found \(64, 128\)"):
        hf.save_pretrained(tmp_path, config.replace(num_kv_heads=4), random_params(config))


# ---------------------------------------------------------------- damaged files: one InvalidCheckpoint naming file and key

TINY = small(vocab_size=10, d_model=8, num_layers=1, num_heads=2, mlp_hidden=16, max_seq_len=8)
NORM = "model.layers.0.input_layernorm.weight"  # (8,) float32: 32 bytes
POST_NORM = "model.layers.0.post_attention_layernorm.weight"  # the same
EMBED = "model.embed_tokens.weight"


@pytest.fixture
def tiny(tmp_path) -> Path:
    """A tiny Llama checkpoint (config.json, model.safetensors, generation_config.json), written without torch."""
    return hf.save_pretrained(tmp_path / "tiny", TINY, random_params(TINY)).directory


def _edit_config(directory: Path, **changes) -> Path:
    config = json.loads((directory / "config.json").read_text()) | changes
    (directory / "config.json").write_text(json.dumps({k: v for k, v in config.items() if v != "DELETE"}))
    return directory / "config.json"


def _split(file: Path) -> tuple[dict, bytes]:
    """(header, data) of a safetensors file."""
    raw = file.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    return json.loads(raw[8:8 + length]), raw[8 + length:]


def _join(file: Path, header: dict, data: bytes) -> Path:
    text = json.dumps(header).encode()
    file.write_bytes(len(text).to_bytes(8, "little") + text + data)
    return file


def _raises(kind, directory: Path, path: Path, key, *words: str) -> str:
    """Loading `directory` raises `kind` naming `path` (its `path`), `key` (or one of a tuple of keys) and `words`."""
    with pytest.raises(kind) as error:
        hf.load_pretrained(directory)
    message = str(error.value)
    assert str(path) in message and all(word in message for word in words), message
    if kind is hf.InvalidCheckpoint:
        keys = key if isinstance(key, tuple) else (key,)
        assert error.value.path == path and error.value.key in keys, (error.value.path, error.value.key)
        assert error.value.key is None or error.value.key in message
    return message


BAD_CONFIGS = {  # config.json changes: (the key named, words of the message)
    "a required key missing": (dict(hidden_size="DELETE"), "hidden_size", ["is missing"]),
    "null for a required key": (dict(vocab_size=None), "vocab_size", ["is null"]),
    "a string for an int": (dict(num_hidden_layers="1"), "num_hidden_layers", ['"1" (a string)', "positive integer"]),
    "a bool for a number": (dict(rms_norm_eps=True), "rms_norm_eps", ["true (a boolean)", "positive number"]),
    "a string for a bool": (dict(tie_word_embeddings="false"), "tie_word_embeddings", ['"false" (a string)']),
    "a list for an object": (dict(rope_parameters=[1, 2]), "rope_parameters", ["an object", "(an array)"]),
    "a zero size": (dict(intermediate_size=0), "intermediate_size", ["positive integer, got 0"]),
    "a nested key of the wrong type": (dict(rope_parameters=dict(rope_type="linear", rope_theta=1e4, factor="4")),
                                       "rope_parameters.factor", ['"4" (a string)']),
    "no model_type": (dict(model_type="DELETE"), "model_type", ["is missing"]),
    "a string for architectures": (dict(architectures="LlamaForCausalLM"), "architectures", ["array of strings"]),
    "sizes that make no model": (dict(num_attention_heads=3), None, ["describes no model", "num_heads"]),
}


@pytest.mark.parametrize("name", list(BAD_CONFIGS))
def test_a_bad_config_json_names_the_file_and_key(tiny, name):
    changes, key, words = BAD_CONFIGS[name]
    _raises(hf.InvalidCheckpoint, tiny, _edit_config(tiny, **changes), key, *words)


def test_a_config_json_that_is_not_a_json_object_names_the_file(tiny):
    (tiny / "config.json").write_text('{"model_type": "llama",')
    _raises(hf.InvalidCheckpoint, tiny, tiny / "config.json", None, "is not JSON", "line 1")
    (tiny / "config.json").write_text("[1, 2]")
    _raises(hf.InvalidCheckpoint, tiny, tiny / "config.json", None, "an array, expected a JSON object")


def test_a_quantized_checkpoint_is_unsupported(tiny):
    _edit_config(tiny, quantization_config={"quant_method": "fp8"})
    with pytest.raises(hf.UnsupportedCheckpoint, match="quant_method='fp8'"):
        hf.load_pretrained(tiny)


def _truncated(file: Path) -> None:
    file.write_bytes(file.read_bytes()[:-4])


def _header_edit(edit):
    def apply(file: Path) -> None:
        header, data = _split(file)
        edit(header)
        _join(file, header, data)
    return apply


BAD_FILES = {  # damage to model.safetensors: (the tensor named or None, words of the message)
    "empty": (lambda f: f.write_bytes(b""), None, ["is empty"]),
    "shorter than its header length": (lambda f: f.write_bytes(b"\x10\x00\x00"), None, ["truncated to 3 bytes"]),
    "a corrupt header length": (lambda f: f.write_bytes(b"\xff" * 8 + f.read_bytes()[8:]), None,
                                ["first 8 bytes give a", "-byte header"]),
    "a corrupt header": (lambda f: f.write_bytes(f.read_bytes()[:8] + b"[" + f.read_bytes()[9:]), None,
                         ["corrupt header"]),
    "truncated data": (_truncated, "LAST", ["run past the end", "truncated"]),
    "trailing bytes": (lambda f: f.write_bytes(f.read_bytes() + b"\0" * 4), None, ["4 bytes after the last tensor"]),
    "offsets that overlap": (_header_edit(lambda h: h[NORM].update(data_offsets=h[POST_NORM]["data_offsets"])),
                             (NORM, POST_NORM), ["overlap those of model.layers.0."]),
    "a shape that lies": (_header_edit(lambda h: h[NORM].update(shape=[9])), NORM,
                          ["span 32 bytes, but shape (9,) of F32 is 36 bytes"]),
    "an unknown dtype": (_header_edit(lambda h: h[NORM].update(dtype="F128")), NORM, ["not a safetensors dtype"]),
}


@pytest.mark.parametrize("name", list(BAD_FILES))
def test_a_damaged_safetensors_file_names_the_file_and_tensor(tiny, name):
    damage, key, words = BAD_FILES[name]
    if key == "LAST":  # the tensor whose bytes come last
        tensors = {n: v for n, v in _split(tiny / "model.safetensors")[0].items() if n != "__metadata__"}
        key = max(tensors, key=lambda n: tensors[n]["data_offsets"])
    damage(tiny / "model.safetensors")
    _raises(hf.InvalidCheckpoint, tiny, tiny / "model.safetensors", key, *words)


def _replace_tensor(directory: Path, name: str, value: np.ndarray) -> Path:
    tensors = load_file(directory / "model.safetensors") | {name: value}
    save_file(tensors, directory / "model.safetensors", metadata={"format": "pt"})
    return directory / "model.safetensors"


@pytest.mark.parametrize("dtype", [np.int32, np.bool_])
def test_a_tensor_of_a_dtype_that_cannot_hold_weights_is_refused(tiny, dtype):
    file = _replace_tensor(tiny, NORM, np.ones(8, dtype))
    _raises(hf.InvalidCheckpoint, tiny, file, NORM, "cannot hold weights", "F32, F16, BF16, F64",
            "I32" if dtype is np.int32 else "BOOL")


def test_fp8_weights_are_unsupported_naming_the_tensor(tiny):
    import ml_dtypes
    file = _replace_tensor(tiny, NORM, np.ones(8, ml_dtypes.float8_e4m3fn))
    _raises(hf.UnsupportedCheckpoint, tiny, file, None, NORM, "F8_E4M3 weights are not read", "dequantize")


def test_non_finite_weights_are_refused_unless_allowed(tiny):
    stored = load_file(tiny / "model.safetensors")[EMBED]  # (10, 8)
    spoiled = stored.copy()
    spoiled[0, :2], spoiled[3, 4] = np.nan, -np.inf
    file = _replace_tensor(tiny, EMBED, spoiled)
    _raises(hf.InvalidCheckpoint, tiny, file, EMBED, "3 of 80 values are not finite (2 NaN, 1 infinite)",
            "allow_nonfinite=True")
    _, params = hf.load_pretrained(tiny, allow_nonfinite=True)  # the rare checkpoint that means it
    np.testing.assert_array_equal(np.asarray(params["wte"]["embedding"]), spoiled)
    _replace_tensor(tiny, EMBED, stored.astype(np.float64) * 1e300)  # finite in F64, infinite as float32
    _raises(hf.InvalidCheckpoint, tiny, file, EMBED, "once converted to float32")


def _shard(directory: Path) -> dict[str, str]:
    """Moves model.safetensors into two shards listed by an index; returns the weight map."""
    tensors = load_file(directory / "model.safetensors")
    (directory / "model.safetensors").unlink()
    names = sorted(tensors)
    weight_map = {name: f"model-0000{1 + i % 2}-of-00002.safetensors" for i, name in enumerate(names)}
    for shard in set(weight_map.values()):
        save_file({n: tensors[n] for n in names if weight_map[n] == shard}, directory / shard)
    (directory / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    return weight_map


def test_a_bad_index_names_the_index_and_the_tensor(tiny):
    weight_map = _shard(tiny)
    index = tiny / "model.safetensors.index.json"
    hf.load_pretrained(tiny)  # the shards load
    (tiny / "model-00002-of-00002.safetensors").unlink()
    first = min(n for n, shard in weight_map.items() if shard.startswith("model-00002"))
    _raises(hf.InvalidCheckpoint, tiny, index, first, "model-00002-of-00002.safetensors, which does not exist")
    index.write_text(json.dumps({"weight_map": weight_map | {first: "model-00001-of-00002.safetensors"}}))
    _raises(hf.InvalidCheckpoint, tiny, index, first, "whose header has no such tensor")
    index.write_text(json.dumps({"weights": weight_map}))
    _raises(hf.InvalidCheckpoint, tiny, index, "weight_map", "expected an object")


def test_a_mismatched_tensor_names_the_file(tiny):
    file = _replace_tensor(tiny, NORM, np.ones(9, np.float32))
    _raises(hf.InvalidCheckpoint, tiny, file, NORM, "expected shape (8,), found (9,)")


TOKENIZER_FILES = {  # a damaged file beside tokenizer.json: (file, content, key, words)
    "a corrupt tokenizer.json": ("tokenizer.json", '{"model": 3}', None, ["not a tokenizer the tokenizers library"]),
    "tokenizer.json not UTF-8": ("tokenizer.json", b"\xff\xfe", None, ["not UTF-8"]),
    "generation_config.json not an object": ("generation_config.json", "[1]", None, ["expected a JSON object"]),
    "an eos id of the wrong type": ("config.json", '{"eos_token_id": "1"}', "eos_token_id", ["expected a token id"]),
    "an eos token of the wrong type": ("tokenizer_config.json", '{"eos_token": 1}', "eos_token", ["expected a token"]),
}


@pytest.mark.parametrize("name", list(TOKENIZER_FILES))
def test_a_damaged_tokenizer_file_names_the_file_and_key(tmp_path, name):
    file, content, key, words = TOKENIZER_FILES[name]
    tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    (tmp_path / file).write_bytes(content if isinstance(content, bytes) else content.encode())
    with pytest.raises(hf.InvalidCheckpoint) as error:
        hf.load_tokenizer(tmp_path)
    assert (error.value.path, error.value.key) == (tmp_path / file, key)
    assert str(tmp_path / file) in str(error.value) and all(word in str(error.value) for word in words)


def test_overwriting_replaces_only_the_files_of_a_save(tiny, tmp_path):
    """A user's files stay byte for byte; an older sharded save's index and listed shards go; the report says so."""
    (tmp_path / "outside.safetensors").write_bytes(b"not in the directory")
    weight_map = _shard(tiny) | {"x.weight": "../outside.safetensors"}  # an index may name anything
    (tiny / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    hf.save_pretrained(tiny / "sub", TINY, random_params(TINY))  # a folder of the user's
    mine = {"adapter_model.safetensors": b"an adapter", "notes.txt": b"mine", "README.md": b"# a model"}
    for name, content in mine.items():
        (tiny / name).write_bytes(content)
    before = {p: p.read_bytes() for p in tiny.rglob("*") if p.is_file()}
    report = hf.save_pretrained(tiny, TINY, random_params(TINY, seed=1), tokenizer=tiny_tokenizer(),
                                eos_token_id=1, overwrite=True)
    names = ["config.json", "generation_config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json"]
    assert report.written == tuple(tiny / name for name in names)
    shards = sorted(set(weight_map.values()) - {"../outside.safetensors"})
    assert report.replaced == tuple(sorted(tiny / n for n in ["config.json", "generation_config.json",
                                                              "model.safetensors.index.json", *shards]))
    after = {p: p.read_bytes() for p in tiny.rglob("*") if p.is_file()}
    assert set(after) == set(before) - set(report.replaced) | set(report.written)
    assert all(after[p] == before[p] for p in after if p not in report.written)  # the user's, byte for byte
    assert (tmp_path / "outside.safetensors").read_bytes() == b"not in the directory"
    _, params = hf.load_pretrained(tiny)
    np.testing.assert_array_equal(params["wte"]["embedding"], random_params(TINY, seed=1)["wte"]["embedding"])


def test_a_failed_save_leaves_the_older_checkpoint_in_place(tiny, monkeypatch):
    from jaxattn.hf import save as save_module
    before = {p.name: p.read_bytes() for p in tiny.iterdir()}

    def disk_full(path, tensors):
        path.write_bytes(b"half a file")
        raise OSError(28, "No space left on device")
    monkeypatch.setattr(save_module, "write_safetensors", disk_full)
    with pytest.raises(OSError, match="No space left"):
        hf.save_pretrained(tiny, TINY, random_params(TINY, seed=1), overwrite=True)
    assert {p.name: p.read_bytes() for p in tiny.iterdir()} == before  # no temporary file left either
    with pytest.raises(OSError):
        hf.save_pretrained(tiny.parent / "new", TINY, random_params(TINY))
    assert not (tiny.parent / "new").exists()


# ---------------------------------------------------------------- the tokenizer


def tiny_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    words = ["<unk>", "</s>", "to", "be", "or", "not", "that", "is", "the", "question"]
    tokenizer = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer.decoder = decoders.WordPiece(prefix="##")  # joins words with spaces
    tokenizer.add_special_tokens(["</s>"])
    return tokenizer


def test_the_tokenizer_travels_with_the_checkpoint(tmp_path):
    config = EXPORTS["mistral_window"][0]
    hf.save_pretrained(tmp_path, config, random_params(config), tokenizer=tiny_tokenizer(), eos_token_id=1)
    tok = hf.load_tokenizer(tmp_path)
    ids = tok.encode("to be or not to be")
    assert ids == [2, 3, 4, 5, 2, 3] and tok.decode(np.asarray(ids)) == "to be or not to be"
    assert tok.decode([2, 1, 3]) == "to be" and tok.decode([2, 1, 3], skip_special_tokens=False) == "to </s> be"
    assert (tok.eos_token_id, tok.vocab_size) == (1, 10)
    auto = transformers.AutoTokenizer.from_pretrained(tmp_path)  # transformers reads it too
    assert auto("to be or not", add_special_tokens=False)["input_ids"] == [2, 3, 4, 5] and auto.eos_token_id == 1
    assert transformers.GenerationConfig.from_pretrained(tmp_path).eos_token_id == 1


def test_the_end_of_sequence_id_is_found_where_transformers_keeps_it(tmp_path):
    tiny_tokenizer().save(str(tmp_path / "tokenizer.json"))
    assert hf.load_tokenizer(tmp_path / "tokenizer.json").eos_token_id == 1  # a special token named </s>
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"eos_token": {"content": "that"}}))
    assert hf.load_tokenizer(tmp_path).eos_token_id == 6
    (tmp_path / "config.json").write_text(json.dumps({"eos_token_id": 7}))
    assert hf.load_tokenizer(tmp_path).eos_token_id == 7
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": [8, 9]}))
    assert hf.load_tokenizer(tmp_path).eos_token_id == 8  # the first of several
    with pytest.raises(hf.InvalidCheckpoint, match="tokenizer.json: does not exist"):
        hf.load_tokenizer(tmp_path / "elsewhere")


def test_overwriting_replaces_what_an_older_save_said_about_end_of_sequence(tmp_path):
    config = EXPORTS["mistral_window"][0]
    params = random_params(config)
    hf.save_pretrained(tmp_path, config, params, tokenizer=tiny_tokenizer(), eos_token_id=1)
    (tmp_path / "generation_config.json").write_text(json.dumps({"eos_token_id": 8}))  # an older save's
    hf.save_pretrained(tmp_path, config, params, tokenizer=tiny_tokenizer(), eos_token_id=7, overwrite=True)
    assert hf.load_tokenizer(tmp_path).eos_token_id == 7


def test_text_the_tokenizer_cannot_encode_is_a_value_error_naming_the_characters(tmp_path):
    from tokenizers import Tokenizer, models
    Tokenizer(models.WordLevel({"a": 0, "b": 1})).save(str(tmp_path / "tokenizer.json"))  # no [UNK]
    tok = hf.load_tokenizer(tmp_path)
    assert tok.encode("a") == [0]
    with pytest.raises(ValueError, match=r"\['z'\]"):
        tok.encode("z")


def test_text_a_tokenizer_cannot_encode_is_named_by_what_it_lacks():
    """A lone surrogate is named as one (it was refused with a list that also named '\\n': a byte-level
    vocabulary spells a newline "Ċ", so looking characters up in it named every newline), and a character a
    vocabulary lacks is named alone."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    byte_level = Tokenizer(models.BPE())
    byte_level.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    byte_level.decoder = decoders.ByteLevel()
    byte_level.train_from_iterator(["to be or not\nto be"], trainers.BpeTrainer(
        vocab_size=270, show_progress=False, initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    with pytest.raises(ValueError, match=r"^the text holds a lone surrogate, U\+D800 at character 6: ") as caught:
        hf.HFTokenizer(byte_level).encode("to be\n\ud800")
    assert "\\n" not in str(caught.value)
    chars = Tokenizer(models.WordLevel(vocab={"a": 0, "b": 1, "\n": 2}))  # no unknown token: "z" cannot be encoded
    chars.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    with pytest.raises(ValueError, match=r"characters \['z'\] are not in its vocabulary"):
        hf.HFTokenizer(chars).encode("ab\nz")
