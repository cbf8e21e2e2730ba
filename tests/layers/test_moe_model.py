"""Mixture-of-experts layers inside the model (ModelConfig.moe, dense_layers, Kernels.moe).

* which layers are MoE, the config's checks and its round trip through plain values;
* cached greedy decoding equals the whole-sequence argmax for MoE models (standard and MLA
  attention), whichever implementation runs the experts;
* the losses the MoE layers sow, averaged over the layers; the active parameter count.
"""

import chex
import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import DecoderLM, Kernels, MLAConfig, ModelConfig, MoEConfig, generate, layer_losses
from jaxattn.model import abstract_params, active_params, count_params
from jaxattn.layers.moe import ROUTING, MoE, load_balancing_loss

EXPERTS = MoEConfig(num_experts=8, experts_per_token=2, expert_hidden=16, num_shared_experts=1,
                    shared_expert_hidden=16, aux_loss_coef=0.01, z_loss_coef=0.001)


def config(**changes) -> ModelConfig:
    base = dict(vocab_size=40, d_model=32, num_layers=3, num_heads=4, positions="rope", norm="rmsnorm",
                mlp="swiglu", max_seq_len=32, moe=EXPERTS, dense_layers=(0,))
    return ModelConfig(**{**base, **changes})


def params_for(c: ModelConfig, seed=0):
    """Parameters at a scale where routing is decisive (std 0.3 instead of 0.02), drawn with numpy from
    the shapes (nothing compiled)."""
    leaves, tree = jax.tree.flatten(nn.unbox(abstract_params(c)))
    rng = np.random.default_rng(seed)
    return jax.tree.unflatten(tree, [jnp.asarray(0.3 * rng.standard_normal(s.shape), s.dtype) if len(s.shape) > 1
                                     else jnp.ones(s.shape, s.dtype) for s in leaves])


def test_which_layers_are_moe_and_the_checks():
    c = config(num_layers=4, dense_layers=[0, 2])
    assert c.dense_layers == (0, 2) and [c.layer_is_moe(i) for i in range(4)] == [False, True, False, True]
    assert c.moe_layers == (1, 3) and ModelConfig().moe_layers == ()
    assert ModelConfig.from_dict(c.to_dict()) == c
    assert not any(ModelConfig().layer_is_moe(i) for i in range(4))
    for bad in [(4,), (1, 0), (0, 0), (True,)]:
        with pytest.raises(ValueError, match=r"ModelConfig.dense_layers must be increasing distinct layers"):
            config(num_layers=4, dense_layers=bad)
    with pytest.raises(ValueError, match=r"and empty without moe, got \(0,\)"):
        config(moe=None, dense_layers=(0,))
    with pytest.raises(TypeError, match=r"ModelConfig.moe must be a jaxattn.MoEConfig or None, got dict"):
        ModelConfig(moe={"num_experts": 4})


def test_dense_layers_keep_the_mlp_and_moe_layers_hold_experts():
    c = config()
    params = params_for(c)
    assert set(params["blocks_0"]["mlp"]) == {"gate_up", "down"}
    assert {"router_kernel", "experts_gate_up", "experts_down", "shared_gate_up"} <= set(params["blocks_1"]["mlp"])
    chex.assert_shape(params["blocks_2"]["mlp"]["experts_gate_up"], (8, 32, 32))


@pytest.mark.parametrize("attention", ["standard", "mla"])
def test_cached_greedy_decoding_equals_the_whole_sequence_argmax(attention):
    c = config(mla=MLAConfig(kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8)
               if attention == "mla" else None)
    params = params_for(c)
    prompt = jax.random.randint(jax.random.PRNGKey(1), (2, 5), 0, c.vocab_size)
    runs = {}
    for impl in ("dense", "grouped_cpu", "grouped"):
        out = generate(params, c, prompt, jnp.array([5, 5]), max_new_tokens=6, rng=jax.random.PRNGKey(0),
                       temperature=0.0, kernels=Kernels(moe=impl))
        runs[impl] = np.asarray(out.tokens)
        whole = jax.jit(DecoderLM(c, Kernels(moe=impl)).apply)({"params": params},
                                                              jnp.concatenate([prompt, out.tokens], 1))
        np.testing.assert_array_equal(np.argmax(whole[:, 4:-1], -1), runs[impl])
    assert len({r.tobytes() for r in runs.values()}) == 1
    assert len(np.unique(runs["dense"])) > 2  # not a degenerate constant continuation


def test_sown_losses_are_the_mean_over_moe_layers():
    c = config(num_layers=3, dense_layers=(1,))
    params = params_for(c)
    tokens = jax.random.randint(jax.random.PRNGKey(2), (2, 7), 0, c.vocab_size)
    padding = jnp.arange(7)[None, :] < jnp.array([[7], [4]])
    model = DecoderLM(c)
    mutable = [layer_losses.COLLECTION]
    _, state = jax.jit(lambda p, t: model.apply({"params": p}, t, padding_mask=padding, mutable=mutable))(params,
                                                                                                          tokens)
    losses = layer_losses.mean_over_layers(state)
    per_layer = state[layer_losses.COLLECTION]
    assert set(per_layer) == {"blocks_0", "blocks_2"}  # the dense layer sows nothing
    balance = [per_layer[b]["mlp"]["load_balancing_loss"][0] for b in ("blocks_0", "blocks_2")]
    np.testing.assert_allclose(losses["load_balancing_loss"], np.mean(balance), rtol=1e-6)
    np.testing.assert_allclose(losses["aux_loss"], 0.01 * losses["load_balancing_loss"]
                               + 0.001 * losses["router_z_loss"], rtol=1e-6)
    _, sown = MoE(c, c.moe).apply({"params": params["blocks_0"]["mlp"]}, jnp.ones((2, 7, 32)), padding_mask=padding,
                                  mutable=[layer_losses.COLLECTION, ROUTING[0]])
    routing = sown[ROUTING[0]][ROUTING[1]][0]
    np.testing.assert_allclose(sown[layer_losses.COLLECTION]["load_balancing_loss"][0],
                               load_balancing_loss(routing["router_logits"], 2, padding), rtol=1e-6)
    dense = config(moe=None, dense_layers=())  # sows nothing, so a training step adds nothing
    _, state = DecoderLM(dense).apply({"params": params_for(dense)}, tokens, mutable=mutable)
    assert layer_losses.mean_over_layers(state) == {}
    loss = jnp.float32(2.5)
    assert layer_losses.add_objective(loss, {}) is loss


def test_active_parameters_leave_out_the_experts_a_token_skips():
    c = config(num_layers=3, dense_layers=(0,))
    total = count_params(params_for(c))
    per_expert = 3 * c.d_model * EXPERTS.expert_hidden
    assert active_params(c) == total - 2 * (8 - 2) * per_expert  # two MoE layers, six experts idle each
    assert c.idle_expert_params == 2 * (8 - 2) * per_expert
    dense = config(moe=None, dense_layers=())
    assert active_params(dense) == count_params(params_for(dense))
