"""jaxattn.head_loss: the head and the cross entropy a chunk of rows at a time equal the logits' cross
entropy, their gradients too; a frozen head costs no more products than the logits' pair, and the fused
step keeps no [M, V] logits; DecoderLM.token_losses takes it where the head is a float matrix."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest

from jaxattn import quantize
from jaxattn.head_loss import token_losses
from jaxattn.kernels import Kernels, matmul_kernel
from jaxattn.model import DecoderLM
from jaxattn.softmax import soft_cap
from tests.tiny_models import drawn_params, tiny_config

M, D, V = 37, 16, 50  # 37 rows: chunks of 8 leave a part chunk


def drawn(seed=0, m=M, v=V):
    k = jax.random.split(jax.random.PRNGKey(seed), 4)
    return (jax.random.normal(k[0], (m, D)), 0.3 * jax.random.normal(k[1], (D, v)),
            jax.random.randint(k[2], (m,), 0, v), jax.random.uniform(k[3], (m,)))


def reference(x, head, targets, matmul, cap):
    return optax.softmax_cross_entropy_with_integer_labels(soft_cap(matmul(x, head), cap), targets)


@pytest.mark.parametrize("cap", [None, 5.0])
def test_losses_and_both_gradients_equal_the_logits_cross_entropy(cap):
    x, head, targets, g = drawn()
    matmul = matmul_kernel("xla")
    want = jax.value_and_grad(lambda x, w: jnp.sum(g * reference(x, w, targets, matmul, cap)), (0, 1))(x, head)
    got = jax.value_and_grad(lambda x, w: jnp.sum(g * token_losses(x, w, targets, matmul=matmul, cap=cap, chunk=8)),
                             (0, 1))(x, head)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    for a, b in zip(got[1], want[1]):  # dx from the kept rows, dhead from the logits recomputed
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(token_losses(x, head, targets, matmul=matmul, cap=cap, chunk=8),
                               reference(x, head, targets, matmul, cap), rtol=1e-6)  # forward only


def test_bfloat16_operands_give_the_kernels_own_numbers():
    # With a unit cotangent both round the same (softmax - onehot) to bfloat16 before the dx product.
    x, head, targets, _ = drawn(1)
    matmul = matmul_kernel("bfloat16_cpu")
    want = jax.value_and_grad(lambda x: jnp.sum(reference(x, head, targets, matmul, None)))(x)
    got = jax.value_and_grad(lambda x: jnp.sum(token_losses(x, head, targets, matmul=matmul, chunk=8)))(x)
    np.testing.assert_allclose(got[0], want[0], rtol=1e-6)
    np.testing.assert_allclose(got[1], want[1], rtol=1e-5, atol=1e-6)


def test_a_frozen_head_costs_the_logits_pair_of_products_and_keeps_no_logits():
    x, head, targets, _ = drawn(2, m=2048, v=4096)
    matmul = matmul_kernel("xla")
    fused = jax.jit(jax.grad(lambda x, w: jnp.mean(token_losses(x, w, targets, matmul=matmul))))
    plain = jax.jit(jax.grad(lambda x, w: jnp.mean(reference(x, w, targets, matmul, None))))
    fused, plain = (f.lower(x, head).compile() for f in (fused, plain))
    assert fused.as_text().count(" dot(") == plain.as_text().count(" dot(") == 2  # forward logits, dx
    logits_bytes = 2048 * 4096 * 4
    assert plain.memory_analysis().temp_size_in_bytes >= logits_bytes
    assert fused.memory_analysis().temp_size_in_bytes < logits_bytes // 2  # 256 rows at a time: an eighth


def test_bad_shapes_are_refused_naming_them():
    x, head, targets, _ = drawn()
    with pytest.raises(ValueError, match=r"x must be \[M, D\] and head \[D, V\]"):
        token_losses(x, head.T, targets, matmul=matmul_kernel("xla"))
    with pytest.raises(ValueError, match=r"targets must be int \[M\]"):
        token_losses(x, head, targets[:3], matmul=matmul_kernel("xla"))
    with pytest.raises(ValueError, match="chunk must be at least 1"):
        token_losses(x, head, targets, matmul=matmul_kernel("xla"), chunk=0)


@pytest.mark.parametrize("changes", [dict(), dict(tie_embeddings=False, final_logits_soft_cap=4.0)],
                         ids=["tied", "untied_capped"])
def test_model_token_losses_fused_equal_unfused_with_gradients(changes):
    config = tiny_config(positions="rope", **changes)
    model, params = DecoderLM(config, Kernels()), drawn_params(config, seed=3)
    tokens = jax.random.randint(jax.random.PRNGKey(4), (2, 8), 0, config.vocab_size)
    targets = jnp.roll(tokens, -1, axis=1)

    def mean(params, fused):
        return jnp.mean(model.apply({"params": params}, tokens, targets, fused=fused, method=DecoderLM.token_losses))
    (want, want_grads), (got, got_grads) = (jax.value_and_grad(mean)(params, fused) for fused in (False, True))
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got_grads), jax.tree.leaves(want_grads)):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
    logits = model.apply({"params": params}, tokens)
    ce = optax.softmax_cross_entropy_with_integer_labels(logits.reshape(-1, config.vocab_size), targets.reshape(-1))
    np.testing.assert_allclose(want, jnp.mean(ce), rtol=1e-6)  # unfused: __call__'s logits


def test_a_quantized_head_is_read_through_the_logits():
    config = tiny_config(positions="rope")
    params = quantize(drawn_params(config, seed=5), config, "int8:channel")
    model = DecoderLM(config, Kernels())
    assert model.apply({"params": params}, method=DecoderLM.head_matrix) is None
    tokens = jax.random.randint(jax.random.PRNGKey(6), (2, 8), 0, config.vocab_size)
    fused, plain = (model.apply({"params": params}, tokens, tokens, fused=f, method=DecoderLM.token_losses)
                    for f in (True, False))
    np.testing.assert_array_equal(fused, plain)
