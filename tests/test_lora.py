"""LoRA adapters (`jaxattn.lora`): the model with LoraWeights computes what its merged weights compute.

Every case draws non-zero `b` (PEFT's zero init would hide a wrong delta) and compares the logits of
the params with LoraWeights against those of `merge_lora` (plain float params) on the same model:
own fused-qkv GQA, separate q/k/v with a plain MLP, a mixture of experts (experts merged on read), MLA
(wq_b, wkv_b merged on read), a scanned model (stacked params) and an int8 base (QLoRA). Gradients
with respect to the adapters are checked against the chain rule through the merged weights.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax.traverse_util import flatten_dict

import jaxattn
from jaxattn.lora import (LoraConfig, LoraWeight, add_lora, combine_lora, count_lora_params, is_lora, merge_lora,
                          split_lora)
from jaxattn.layers.moe import MoEConfig
from jaxattn.quantization import QuantizedWeight, quantize
from tiny_models import VOCAB, drawn_params, tiny_config, with_random_b

TOL = 2e-5
ALL = ("q", "k", "v", "o", "gate", "up", "down")
MOE = MoEConfig(num_experts=4, experts_per_token=2, expert_hidden=8, num_shared_experts=1, shared_expert_hidden=8)
GATED = dict(positions="rope", mlp="swiglu", norm="rmsnorm")
# name: (config, targets, quantization mode or None)
CASES = {
    "fused_qkv": (tiny_config("gqa", fused_qkv=True, **GATED), ("q", "v", "o", "gate", "down"), None),
    "separate_plain_mlp": (tiny_config("gqa", positions="rope", fused_qkv=False), ("q", "k", "v", "o", "up", "down"),
                           None),
    "moe": (tiny_config("gqa", fused_qkv=True, moe=MOE, **GATED), ("q", "k", "v", "o", "gate", "up", "down", "experts"),
            None),
    "mla": (tiny_config("mla_absorb", **GATED), ALL, None),
    "mla_no_q_lora": (tiny_config("mla_naive", **GATED), ("q", "o", "up"), None),
    "scanned": (tiny_config("gqa", fused_qkv=True, scan_layers=True, num_layers=3, **GATED), ALL, None),
    "int8_base": (tiny_config("gqa", fused_qkv=True, d_model=32, mlp_hidden=64, **GATED), ALL, "int8"),
}


def tokens(seed=0):
    return jnp.asarray(np.random.default_rng(seed).integers(0, VOCAB, (2, 8)))


def logits(config, params, **kwargs):
    return np.asarray(jaxattn.DecoderLM(config).apply({"params": params}, tokens(), **kwargs))


@pytest.fixture(scope="module")
def built():
    cache = {}

    def get(name):
        if name not in cache:
            config, targets, mode = CASES[name]
            base = drawn_params(config, seed=1, std=0.1)
            if mode is not None:
                base = quantize(base, config, mode)
            lora = LoraConfig(rank=2, alpha=4.0, targets=targets)
            cache[name] = config, base, lora, with_random_b(add_lora(base, config, lora, jax.random.PRNGKey(0)))
        return cache[name]
    return get


@pytest.mark.parametrize("name", list(CASES))
def test_lora_logits_equal_the_merged_weights(built, name):
    config, base, _, params = built(name)
    with_lora, merged = logits(config, params), logits(config, merge_lora(params))
    assert np.max(np.abs(with_lora - merged)) < TOL
    assert np.max(np.abs(with_lora - logits(config, base))) > 1e-2  # the adapters change the model
    assert all(not is_lora(leaf) for leaf in flatten_dict(merge_lora(params)).values())


def lora_paths(params):
    return {"/".join(path): leaf for path, leaf in flatten_dict(params).items() if is_lora(leaf)}


def test_targets_map_to_the_modules_and_parts():
    config, targets, _ = CASES["fused_qkv"]
    params = add_lora(drawn_params(config), config, LoraConfig(rank=2, targets=targets), jax.random.PRNGKey(0))
    qkv, gate_up = lora_paths(params)["blocks_0/attn/qkv/kernel"], lora_paths(params)["blocks_0/mlp/gate_up/kernel"]
    N, K, H = config.num_heads, config.num_kv_heads, config.head_dim
    assert qkv.parts == ("q", "k", "v") and qkv.widths == (N * H, K * H, K * H)
    assert [a is None for a in qkv.a] == [False, True, False] and qkv.a[0].shape == (config.d_model, 2)
    assert qkv.b[2].shape == (2, K * H) and gate_up.parts == ("gate", "up") and gate_up.a[1] is None
    assert set(lora_paths(params)) == {f"blocks_{i}/{p}" for i in range(2) for p in
                                       ("attn/qkv/kernel", "attn/out/kernel", "mlp/gate_up/kernel", "mlp/down/kernel")}

    moe_config = CASES["moe"][0]
    paths = lora_paths(add_lora(drawn_params(moe_config), moe_config, LoraConfig(rank=3, targets=("experts", "down")),
                                jax.random.PRNGKey(0)))
    experts = paths["blocks_0/mlp/experts_gate_up"]
    assert set(paths) == {f"blocks_{i}/mlp/{p}" for i in range(2)
                          for p in ("experts_gate_up", "experts_down", "shared_down/kernel")}
    assert experts.a[0].shape == (4, moe_config.d_model, 3) and experts.b[0].shape == (4, 3, 16)  # per expert

    mla_paths = lora_paths(add_lora(drawn_params(CASES["mla"][0]), CASES["mla"][0], LoraConfig(rank=2, targets=ALL),
                                    jax.random.PRNGKey(0)))
    assert {p.split("/", 1)[1] for p in mla_paths} == {"attn/wq_b/kernel", "attn/wkv_b", "attn/wo/kernel",
                                                         "mlp/gate_up/kernel", "mlp/down/kernel"}
    assert mla_paths["blocks_0/attn/wkv_b"].weight_shape == (8, 4, 8)


def test_init_is_peft_s_and_leaves_the_model_unchanged(built):
    config, base, lora, _ = built("scanned")
    params = add_lora(base, config, lora, jax.random.PRNGKey(3))
    for leaf in lora_paths(params).values():
        for a, b in zip(leaf.a, leaf.b):
            bound = 1 / np.sqrt(leaf.in_features)
            assert a.shape[0] == 3 and b.shape[0] == 3  # one adapter per stacked layer
            assert np.abs(np.asarray(a)).max() <= bound and np.abs(np.asarray(a)).max() > bound / 2
            assert not np.asarray(b).any()
    assert np.max(np.abs(logits(config, params) - logits(config, base))) < 1e-6
    assert lora.scale == 2.0 and LoraConfig(rank=4, alpha=8.0, rslora=True).scale == 4.0


def test_the_quantized_base_stays_quantized(built):
    _, _, _, params = built("int8_base")
    leaf = lora_paths(params)["blocks_0/attn/qkv/kernel"]
    assert isinstance(leaf.base, QuantizedWeight) and leaf.a[0].dtype == jnp.float32
    merged = lora_paths(params)["blocks_0/mlp/down/kernel"].merged()
    assert merged.dtype == jnp.float32 and merged.shape == (64, 32)


def test_split_and_combine_keep_only_adapters_and_reuse_the_base(built):
    _, _, _, params = built("moe")
    adapters, frozen = split_lora(params)
    leaves = jax.tree.leaves(adapters)
    assert sum(x.size for x in leaves) == count_lora_params(params) > 0
    assert set(adapters["blocks_0"]["attn"]["qkv"]["kernel"]) == {"q", "k", "v"}
    assert all(a is None for w in lora_paths(frozen).values() for a in (*w.a, *w.b))
    combined = combine_lora(frozen, adapters)
    for path, leaf in lora_paths(combined).items():
        assert leaf.base is lora_paths(params)[path].base  # the same array: nothing copied
        assert all(x is y for x, y in zip(leaf.a, lora_paths(params)[path].a))
    frozen_only = {k: v for k, v in adapters.items() if k != "blocks_1"}
    with pytest.raises(ValueError, match=r"adapters at blocks_1/attn/\w+/kernel: missing"):
        combine_lora(frozen, frozen_only)


def test_adapter_gradients_are_the_chain_rule_through_the_merged_weights(built):
    config, _, _, params = built("fused_qkv")
    ids = tokens(1)
    model = jaxattn.DecoderLM(config)

    def loss_of(p):
        out = model.apply({"params": p}, ids)[:, :-1]
        return -jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(out), ids[:, 1:, None], -1))

    adapters, frozen = split_lora(params)
    grads = jax.grad(lambda ad: loss_of(combine_lora(frozen, ad)))(adapters)
    merged_grads = flatten_dict(jax.grad(loss_of)(merge_lora(params)))  # dL/dW at W = base + s a b
    for path, leaf in flatten_dict(params).items():
        if not is_lora(leaf):
            continue
        g = flatten_dict(grads)
        for part, a, b, offset, width in zip(leaf.parts, leaf.a, leaf.b, leaf.offsets, leaf.widths):
            if a is None:
                assert path + (part, "a") not in g
                continue
            G = merged_grads[path][:, offset:offset + width]  # [in, width]
            np.testing.assert_allclose(g[path + (part, "a")], leaf.scale * G @ b.T, atol=1e-6, rtol=1e-4)
            np.testing.assert_allclose(g[path + (part, "b")], leaf.scale * a.T @ G, atol=1e-6, rtol=1e-4)


def test_adapter_dropout_runs_only_with_a_dropout_rng(built):
    config, base, _, _ = built("fused_qkv")
    params = with_random_b(add_lora(base, config, LoraConfig(rank=2, dropout=0.5, targets=ALL), jax.random.PRNGKey(0)))
    plain = logits(config, params)
    np.testing.assert_allclose(logits(config, params, deterministic=False), plain, atol=1e-6)  # no rng: off
    np.testing.assert_allclose(plain, logits(config, merge_lora(params)), atol=TOL)
    dropped = logits(config, params, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)})
    assert np.max(np.abs(dropped - plain)) > 1e-3
    undropped = with_random_b(add_lora(base, config, LoraConfig(rank=2, targets=ALL), jax.random.PRNGKey(0)))
    np.testing.assert_allclose(logits(config, undropped, deterministic=False, rngs={"dropout": jax.random.PRNGKey(1)}),
                               plain, atol=1e-6)  # rate 0: the same model


@pytest.mark.parametrize("kwargs, match", [
    (dict(rank=0), "rank must be a positive integer"),
    (dict(rank=2.0), "rank must be a positive integer"),
    (dict(dropout=1.0), r"dropout must be in \[0, 1\)"),
    (dict(alpha=float("nan")), "alpha must be a finite number"),
    (dict(targets=("q", "qkv")), "targets must be one or more of"),
    (dict(targets=()), "targets must be one or more of"),
])
def test_bad_configs_name_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        LoraConfig(**kwargs)


def test_targets_the_model_lacks_are_refused_by_name():
    config = CASES["separate_plain_mlp"][0]
    params = drawn_params(config)
    with pytest.raises(ValueError, match=r"\['gate', 'experts'\] name no weight"):
        add_lora(params, config, LoraConfig(targets=("q", "gate", "experts")), jax.random.PRNGKey(0))
    mla = CASES["mla"][0]
    with pytest.raises(ValueError, match="names 'k' without 'v'.*wkv_b"):
        add_lora(drawn_params(mla), mla, LoraConfig(targets=("q", "k")), jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match="ModelConfig"):
        add_lora(params, {"d_model": 16}, LoraConfig(), jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match="LoraConfig"):
        add_lora(params, config, {"rank": 2}, jax.random.PRNGKey(0))
    twice = add_lora(params, config, LoraConfig(targets=("q",)), jax.random.PRNGKey(0))
    with pytest.raises(TypeError, match="already has LoRA adapters"):
        add_lora(twice, config, LoraConfig(targets=("q",)), jax.random.PRNGKey(0))
    assert isinstance(lora_paths(twice)["blocks_0/attn/query/kernel"], LoraWeight)
