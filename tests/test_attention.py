"""scaled_dot_product_attention, reference_attention and repeat_kv.

Oracles: `jax.nn.dot_product_attention(implementation='xla')`, our textbook
`reference_attention`, and the properties derived in docs/theory.md (rows sum
to 1, masked keys get 0, permutation equivariance, Var(q.k) = d_k).
Every implementation behind `implementation=` is compared with the reference
in tests/kernels/test_kernels.py.
"""

import functools

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from absl.testing import parameterized
from jax.test_util import check_grads

from jaxattn import (
    causal_mask,
    combine_masks,
    padding_mask,
    reference_attention,
    repeat_kv,
    scaled_dot_product_attention,
    sliding_window_mask,
)
from jaxattn.masks import local_window_mask

# Jitted once per shape: eager mode would compile every primitive separately,
# which is several times slower on this small CPU. Error-path tests and the
# chex variants call the plain functions.
_STATIC = ("is_causal", "dropout_rate", "return_weights", "return_residual", "local_window_size",
           "logits_soft_cap", "implementation")
sdpa = jax.jit(scaled_dot_product_attention, static_argnames=_STATIC)
reference = jax.jit(reference_attention, static_argnames=tuple(n for n in _STATIC if n in (
    "is_causal", "return_weights", "return_residual", "local_window_size", "logits_soft_cap")))
jax_attention = jax.jit(jax.nn.dot_product_attention,
                        static_argnames=("is_causal", "local_window_size", "implementation"))


@pytest.fixture(autouse=True)
def no_rank_promotion():
    """Everything here runs under JAX's strictest broadcasting, as JAX's own tests do."""
    with jax.numpy_rank_promotion("raise"):
        yield


def qkv(B=2, T=5, S=5, N=4, K=4, H=8, Hv=None, dtype=np.float32, seed=0):
    """Random query [B,T,N,H], key [B,S,K,H], value [B,S,K,Hv] (numpy, no XLA compile)."""
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(shape, np.float32).astype(dtype))
                 for shape in ((B, T, N, H), (B, S, K, H), (B, S, K, Hv or H)))


# --------------------------------------------------------------------------
# Shapes and dtypes, with and without jit.


class ShapeTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    @parameterized.named_parameters(
        ("mha", 4, 4), ("gqa", 4, 2), ("mqa", 4, 1))
    def test_sdpa_shapes(self, N, K):
        q, k, v = qkv(B=2, T=3, S=6, N=N, K=K, H=8, Hv=5)
        mask = padding_mask(jnp.array([6, 4]), 6)
        fn = self.variant(lambda q, k, v, m: scaled_dot_product_attention(
            q, k, v, mask=m, is_causal=True, return_weights=True))
        out, w = fn(q, k, v, mask)
        chex.assert_shape(out, (2, 3, N, 5))
        chex.assert_shape(w, (2, N, 3, 6))
        chex.assert_type(out, jnp.float32)
        chex.assert_type(w, jnp.float32)
        out_only = self.variant(lambda q, k, v: scaled_dot_product_attention(q, k, v))(q, k, v)
        chex.assert_shape(out_only, (2, 3, N, 5))

    @chex.variants(with_jit=True, without_jit=True)
    def test_sdpa_bf16_in_bf16_out(self):
        q, k, v = qkv(N=4, K=2, dtype=jnp.bfloat16)
        out, w = self.variant(lambda q, k, v: scaled_dot_product_attention(
            q, k, v, return_weights=True))(q, k, v)
        chex.assert_type(out, jnp.bfloat16)
        chex.assert_type(w, jnp.float32)  # softmax stays float32
        chex.assert_shape(out, q.shape)

    @chex.variants(with_jit=True, without_jit=True)
    def test_reference_shapes(self):
        q, k, v = qkv(B=1, T=2, S=4, N=6, K=3, H=4, Hv=3)
        out, w = self.variant(lambda q, k, v: reference_attention(
            q, k, v, return_weights=True))(q, k, v)
        chex.assert_shape(out, (1, 2, 6, 3))
        chex.assert_shape(w, (1, 6, 2, 4))
        chex.assert_type([out, w], jnp.float32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_repeat_kv(self):
        x = np.arange(2 * 3 * 2 * 4, dtype=np.float32).reshape(2, 3, 2, 4)
        y = self.variant(repeat_kv, static_argnums=1)(x, 3)
        chex.assert_shape(y, (2, 3, 6, 4))
        chex.assert_type(y, jnp.float32)
        y = np.asarray(y)
        for j in range(6):  # output head j is input head j // n_rep (docs/theory.md §5)
            np.testing.assert_array_equal(y[:, :, j], x[:, :, j // 3])


def test_dimension_walk_of_a_llama_layer():
    """[1,50,512] -> [1,50,8,64] -> [1,8,50,50] weights -> [1,50,512]."""
    x = jnp.asarray(np.random.default_rng(0).standard_normal((1, 50, 512), np.float32))
    heads = x.reshape(1, 50, 8, 64)
    out, w = sdpa(heads, heads, heads, is_causal=True, return_weights=True)
    chex.assert_shape(w, (1, 8, 50, 50))
    chex.assert_shape(out.reshape(1, 50, 512), (1, 50, 512))


# --------------------------------------------------------------------------
# Agreement with jax.nn.dot_product_attention.

HEADS = {"mha": (4, 4), "gqa": (4, 2), "mqa": (4, 1)}
LENGTHS = {"square": (6, 6), "t_lt_s": (3, 7)}
MASKS = ("none", "causal", "padding", "window", "two_sided_window", "causal_window", "query_lengths")


def _ours_and_jax_kwargs(kind, T, S, lengths):
    """Our kwargs and jax's kwargs that must describe the same mask."""
    if kind == "none":
        return {}, {}
    if kind == "causal":
        if T == S:
            return {"is_causal": True}, {"is_causal": True}
        # jax's is_causal is tril(ones(T, S)): aligned to the *start* of the
        # keys; ours is aligned to the end. Give jax our mask explicitly.
        return {"is_causal": True}, {"mask": causal_mask(T, S)[None, None]}
    if kind == "padding":
        return ({"mask": padding_mask(lengths, S)},
                {"key_value_seq_lengths": lengths.astype(jnp.int32)})
    if kind == "query_lengths":  # rows past each query length are zeros in both; keys hidden alike
        q_lengths = jnp.array([T, T - 1], jnp.int32)
        return ({"query_seq_lengths": q_lengths, "key_value_seq_lengths": lengths},
                {"query_seq_lengths": q_lengths, "key_value_seq_lengths": lengths.astype(jnp.int32)})
    if kind in ("two_sided_window", "causal_window"):  # the same arguments: jax.nn's meaning
        ours = {"local_window_size": (2, 1), "is_causal": kind == "causal_window"}
        if T == S:
            return ours, dict(ours)
        # jax.nn aligns the window (and causal mask) to the start of the keys: give it ours explicitly.
        mask = local_window_mask(T, S, (2, 1)) & (causal_mask(T, S) if ours["is_causal"] else True)
        return ours, {"mask": mask[None, None]}
    window = 3
    if T == S:  # jax's window (left, right) = (window - 1, 0) plus causal
        return ({"mask": sliding_window_mask(T, S, window)},
                {"is_causal": True, "local_window_size": (window - 1, 0)})
    return ({"mask": sliding_window_mask(T, S, window)},
            {"mask": sliding_window_mask(T, S, window)[None, None]})


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("lengths_name", LENGTHS)
@pytest.mark.parametrize("kind", MASKS)
def test_matches_jax_dot_product_attention(heads, lengths_name, kind):
    (N, K), (T, S) = HEADS[heads], LENGTHS[lengths_name]
    q, k, v = qkv(B=2, T=T, S=S, N=N, K=K, H=8)
    lengths = jnp.array([S, S - 2])  # no row is fully masked
    ours_kw, jax_kw = _ours_and_jax_kwargs(kind, T, S, lengths)
    ours = sdpa(q, k, v, **ours_kw)
    theirs = jax_attention(q, k, v, implementation="xla", **jax_kw)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_jax_is_causal_is_aligned_to_the_start_of_the_keys():
    """Documents why we pass jax an explicit mask when T < S."""
    T, S = 2, 5
    q, k, v = qkv(B=1, T=T, S=S, N=2, K=2)
    start_aligned = jnp.tril(jnp.ones((T, S), bool))
    jax_causal = jax_attention(q, k, v, is_causal=True, implementation="xla")
    jax_start = jax_attention(q, k, v, mask=start_aligned[None, None], implementation="xla")
    np.testing.assert_allclose(jax_causal, jax_start, rtol=1e-6, atol=1e-6)
    ours = sdpa(q, k, v, is_causal=True)
    assert not np.allclose(ours, jax_causal, atol=1e-3)
    np.testing.assert_allclose(ours, sdpa(q, k, v, mask=causal_mask(T, S)), rtol=1e-6)


# --------------------------------------------------------------------------
# Agreement with the textbook reference.


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("use_bias,scale", [(False, None), (True, 0.3)])
def test_matches_reference(heads, use_bias, scale):
    N, K = HEADS[heads]
    T, S = 3, 6
    q, k, v = qkv(B=2, T=T, S=S, N=N, K=K, H=8, Hv=4)
    bias = jnp.asarray(np.random.default_rng(7).standard_normal((1, N, T, S), np.float32)
                       ) if use_bias else None
    mask = combine_masks(padding_mask(jnp.array([6, 4]), S), causal_mask(T, S))
    kw = dict(mask=mask, bias=bias, scale=scale, return_weights=True)
    out, w = sdpa(q, k, v, **kw)
    ref_out, ref_w = reference(q, k, v, **kw)
    np.testing.assert_allclose(out, ref_out, rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(w, ref_w, rtol=1e-5, atol=1e-6)
    # is_causal=True is the same as passing causal_mask(T, S).
    out_c = sdpa(q, k, v, mask=padding_mask(jnp.array([6, 4]), S), bias=bias, scale=scale,
                 is_causal=True)
    np.testing.assert_allclose(out_c, out, rtol=1e-6, atol=1e-6)


def test_per_head_mask_matches_reference_for_gqa():
    """A mask with N distinct heads must be grouped as heads j -> kv head j // G."""
    N, K, T, S = 4, 2, 4, 4
    q, k, v = qkv(B=1, T=T, S=S, N=N, K=K)
    mask = np.random.default_rng(3).random((1, N, T, S)) < 0.6
    mask[..., 0] = True
    np.testing.assert_allclose(sdpa(q, k, v, mask=mask), reference(q, k, v, mask=mask),
                               rtol=1e-5, atol=1e-5)


def test_scale_multiplies_logits():
    q, k, v = qkv()
    np.testing.assert_allclose(sdpa(q, k, v, scale=0.5), sdpa(q * 0.5 * np.sqrt(8), k, v),
                               rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# Properties derived in docs/theory.md.


def test_weight_rows_sum_to_one_and_masked_keys_get_exactly_zero():
    T, S = 4, 7
    q, k, v = qkv(B=2, T=T, S=S, N=4, K=2)
    mask = combine_masks(padding_mask(jnp.array([7, 5]), S), sliding_window_mask(T, S, 3))
    _, w = sdpa(q, k, v, mask=mask, return_weights=True)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=1e-6)
    full = np.broadcast_to(mask, w.shape)
    assert np.all(np.asarray(w)[~full] == 0.0)
    assert np.all(np.asarray(w)[full] > 0.0)


def test_permutation_equivariance():
    """Attn(PQ, PK, PV) = P Attn(Q, K, V) without a mask (docs/theory.md §11)."""
    q, k, v = qkv(B=2, T=7, S=7, N=4, K=2)
    perm = np.random.default_rng(0).permutation(7)
    out = sdpa(q, k, v)
    out_perm = sdpa(q[:, perm], k[:, perm], v[:, perm])
    np.testing.assert_allclose(out_perm, out[:, perm], rtol=1e-5, atol=1e-6)
    # Permuting only the keys and values together leaves the output unchanged.
    np.testing.assert_allclose(sdpa(q, k[:, perm], v[:, perm]), out, rtol=1e-5, atol=1e-6)


def _centered_logit_variance(q, k, scale):
    """Var of the logits our function used, read back from log(weights).

    log w_ij = l_ij - logsumexp_j(l_ij): subtracting the row mean removes the
    logsumexp, and the centred variance is Var(l) * (S - 1) / S.
    """
    S = k.shape[1]
    _, w = sdpa(q, k, k, scale=scale, return_weights=True)
    logw = np.log(np.asarray(w, np.float64))
    centred = logw - logw.mean(-1, keepdims=True)
    return centred.var() * S / (S - 1)


def test_variance_of_logits_is_d_k_before_scaling_and_one_after():
    """q, k with unit-variance entries give Var(q.k) = d_k; 1/sqrt(d_k) makes it 1 (docs/theory.md §2).

    64 x 64 = 4096 logits per head; the estimate's relative standard error is
    about sqrt(2 / 4096) = 2.2%, so a +-15% band is ~7 sigma wide while the
    wrong scales (1/d_k -> 1/64, none -> 64) are orders of magnitude outside.
    """
    d_k = 64
    q, k, _ = qkv(B=1, T=64, S=64, N=2, K=2, H=d_k, seed=1)
    raw = np.einsum("btnh,bsnh->bnts", np.asarray(q, np.float64), np.asarray(k, np.float64))
    assert 0.85 * d_k < raw.var() < 1.15 * d_k
    band = (0.85, 1.15)
    default = _centered_logit_variance(q, k, None)  # 1/sqrt(d_k)
    assert band[0] < default < band[1]
    for wrong_scale in (1.0 / d_k, 1.0):
        assert not band[0] < _centered_logit_variance(q, k, wrong_scale) < band[1]


@pytest.mark.parametrize("K", [1, 2])
def test_gqa_equals_mha_on_repeated_kv(K):
    N = 4
    q, k, v = qkv(B=2, T=5, S=6, N=N, K=K)
    mask = padding_mask(jnp.array([6, 3]), 6)
    grouped = sdpa(q, k, v, mask=mask, is_causal=True)
    mha = sdpa(q, repeat_kv(k, N // K), repeat_kv(v, N // K), mask=mask, is_causal=True)
    np.testing.assert_allclose(grouped, mha, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("fn", [sdpa, reference], ids=["fast", "reference"])
def test_fully_masked_rows_are_zero_with_finite_gradients(fn):
    T, S = 4, 3  # causal with T > S: the first T - S queries see no key
    q, k, v = qkv(B=2, T=T, S=S, N=2, K=1)
    mask = padding_mask(jnp.array([3, 0]), S)  # row 1 has no keys at all
    out, w = fn(q, k, v, mask=mask, is_causal=True, return_weights=True)
    assert np.all(np.isfinite(out))
    np.testing.assert_array_equal(out[0, :T - S], 0.0)
    np.testing.assert_array_equal(out[1], 0.0)
    np.testing.assert_array_equal(w[1], 0.0)
    assert np.all(np.asarray(out[0, T - S:]) != 0.0)
    grads = jax.jit(jax.grad(lambda q, k, v: fn(q, k, v, mask=mask, is_causal=True).sum(),
                             argnums=(0, 1, 2)))(q, k, v)
    for g in grads:
        assert np.all(np.isfinite(g))


@pytest.mark.parametrize("fn,order,modes", [
    # Second order forward-over-forward on "xla" (the implementation for forward mode: the
    # default "auto" may pick a hand-written backward); reverse-over-reverse would add ~10 s of
    # compilation for little extra evidence, so reverse mode (what training uses) is checked at
    # first order on the default and the reference.
    (jax.jit(functools.partial(scaled_dot_product_attention, implementation="xla"), static_argnames=_STATIC),
     2, ("fwd",)), (sdpa, 1, ("rev",)),
    (reference, 1, ("fwd", "rev"))],
    ids=["xla-fwd2", "default-rev1", "reference"])
def test_gradients_match_finite_differences(fn, order, modes):
    """Float64 inputs (softmax stays float64 for them), so the default tolerances apply."""
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in qkv(B=1, T=3, S=4, N=2, K=1, H=4))
        bias = jnp.asarray(np.random.default_rng(0).normal(size=(1, 2, 3, 4)))
        mask = padding_mask(jnp.array([3]), 4)
        f = functools.partial(fn, mask=mask, is_causal=True)
        # bias is differentiable too (e.g. ALiBi or relative-position biases)
        check_grads(lambda q, k, v, b: f(q, k, v, bias=b), (q, k, v, bias),
                    order=order, modes=modes)


def test_bf16_agrees_with_float32():
    q16, k16, v16 = qkv(B=2, T=6, S=6, N=4, K=2, H=16, dtype=jnp.bfloat16)
    out16 = sdpa(q16, k16, v16, is_causal=True)
    assert out16.dtype == jnp.bfloat16
    out32 = sdpa(*(x.astype(jnp.float32) for x in (q16, k16, v16)), is_causal=True)
    # bf16 has an 8-bit mantissa (eps 2^-8 ~ 0.4%); outputs are O(1) averages
    # and the weights are cast to bf16 before the value product.
    np.testing.assert_allclose(out16.astype(jnp.float32), out32, rtol=2e-2, atol=2e-2)


# --------------------------------------------------------------------------
# implementation="custom_vjp": the hand-written backward equals autodiff.

sdpa_custom = jax.jit(functools.partial(scaled_dot_product_attention, implementation="custom_vjp"),
                      static_argnames=_STATIC)


def _loss_and_grads(fns, q, k, v, bias, **kw):
    """For each of `fns`: value and gradients (q, k, v, bias) of a weighted sum of the output; one
    compiled program for all."""
    weights = jnp.asarray(np.random.default_rng(5).standard_normal(
        q.shape[:3] + v.shape[-1:], np.float32))

    def value_and_grad(fn):
        return jax.value_and_grad(lambda q, k, v, bias: jnp.vdot(fn(q, k, v, bias=bias, **kw), weights),
                                  argnums=(0, 1, 2, 3))
    return jax.jit(lambda *args: [value_and_grad(fn)(*args) for fn in fns])(q, k, v, bias)


@pytest.mark.parametrize("heads", HEADS)
@pytest.mark.parametrize("case", ["none", "causal", "padding_bias", "empty_rows"])
def test_custom_vjp_gradients_equal_autodiff(heads, case):
    N, K = HEADS[heads]
    T, S = (5, 3) if case == "empty_rows" else (4, 6)
    q, k, v = qkv(B=2, T=T, S=S, N=N, K=K, H=8, Hv=4)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((1, N, T, S), np.float32))
    kw = {"none": lambda: {}, "causal": lambda: {"is_causal": True},
          "padding_bias": lambda: {"mask": padding_mask(jnp.array([6, 2]), S)},
          # causal with T > S leaves the first queries no key; row 1 has no keys at all
          "empty_rows": lambda: {"mask": padding_mask(jnp.array([3, 0]), S), "is_causal": True}}[case]()
    bias = bias if case in ("padding_bias", "empty_rows") else jnp.zeros_like(bias)
    (loss, grads), (loss_c, grads_c) = _loss_and_grads(
        (scaled_dot_product_attention, functools.partial(scaled_dot_product_attention, implementation="custom_vjp")),
        q, k, v, bias, **kw)
    np.testing.assert_allclose(loss_c, loss, rtol=1e-5)  # heads-major vs grouped sums: float32 order
    for name, g, g_c in zip("qkvb", grads, grads_c):
        assert np.all(np.isfinite(g_c)), name
        np.testing.assert_allclose(g_c, g, rtol=1e-4, atol=1e-5, err_msg=name)


def test_custom_vjp_gradients_match_finite_differences():
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in qkv(B=1, T=3, S=4, N=4, K=2, H=4))
        bias = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 3, 4)))
        f = functools.partial(scaled_dot_product_attention, implementation="custom_vjp",
                              mask=padding_mask(jnp.array([3]), 4), is_causal=True)
        check_grads(jax.jit(lambda q, k, v, b: f(q, k, v, bias=b)), (q, k, v, bias), order=1, modes=("rev",))


def test_custom_vjp_forward_equals_xla_and_falls_back_for_weights_and_dropout():
    q, k, v = qkv(B=2, T=4, S=4, N=4, K=2)
    # Equal to float32 summation order: the custom path contracts heads-major, the reference grouped.
    np.testing.assert_allclose(sdpa_custom(q, k, v, is_causal=True), sdpa(q, k, v, is_causal=True),
                               rtol=1e-6, atol=1e-6)
    out, w = sdpa_custom(q, k, v, is_causal=True, return_weights=True)  # weights: the reference itself
    ref_out, ref_w = sdpa(q, k, v, is_causal=True, return_weights=True)
    np.testing.assert_array_equal(w, ref_w)
    np.testing.assert_array_equal(out, ref_out)
    key = jax.random.PRNGKey(3)
    np.testing.assert_array_equal(
        sdpa_custom(q, k, v, dropout_rate=0.5, dropout_rng=key),
        sdpa(q, k, v, dropout_rate=0.5, dropout_rng=key))


def test_custom_vjp_is_reverse_mode_only_and_the_name_is_checked():
    q, k, v = qkv(B=1, T=2, S=2, N=2, K=2)
    f = functools.partial(scaled_dot_product_attention, implementation="custom_vjp")
    with pytest.raises(TypeError, match="custom_vjp"):
        jax.jvp(lambda q: f(q, k, v), (q,), (q,))
    with pytest.raises(ValueError, match=r"attention implementation must be one of \('xla', 'custom_vjp', 'causal_blocks', 'chunked', 'cudnn', 'splash', 'auto_cpu', 'auto_gpu', 'auto_tpu'\), got 'flash'"):
        scaled_dot_product_attention(q, k, v, implementation="flash")


# --------------------------------------------------------------------------
# Dropout on the weights (docs/theory.md §12).


# One shape and one rate for every dropout test, so that the random-bits
# program compiles once, and "rbg" keys: XLA compiles the default threefry
# bit generator for this shape in seconds on this CPU, RngBitGenerator in
# well under one. The dropout logic under test is the same for every key type.
DROPOUT_SHAPE = dict(B=4, T=16, S=16, N=4, K=2, H=8)
P = 0.5


def raw_key(i):
    return jax.random.key(i, impl="rbg")


def test_dropout_off_is_identity():
    q, k, v = qkv(**DROPOUT_SHAPE)
    base = sdpa(q, k, v, return_weights=True)
    for kw in ({"dropout_rate": 0.0, "dropout_rng": raw_key(1)}, {"dropout_rate": P}):
        out = sdpa(q, k, v, return_weights=True, **kw)
        np.testing.assert_array_equal(out[0], base[0])
        np.testing.assert_array_equal(out[1], base[1])


def test_dropout_zeroes_or_rescales_weights_and_is_deterministic():
    q, k, v = qkv(**DROPOUT_SHAPE)
    _, clean = sdpa(q, k, v, return_weights=True)
    out, dropped = sdpa(q, k, v, dropout_rate=P, dropout_rng=raw_key(3), return_weights=True)
    dropped, clean = np.asarray(dropped), np.asarray(clean)
    zero = dropped == 0.0
    assert 0 < zero.sum() < zero.size
    np.testing.assert_allclose(dropped[~zero], clean[~zero] / (1 - P), rtol=1e-6)
    # The output uses the dropped weights.
    np.testing.assert_allclose(out, reference_out(dropped, v), rtol=1e-5, atol=1e-5)
    again = sdpa(q, k, v, dropout_rate=P, dropout_rng=raw_key(3), return_weights=True)
    np.testing.assert_array_equal(again[1], dropped)
    other = sdpa(q, k, v, dropout_rate=P, dropout_rng=raw_key(4), return_weights=True)
    assert not np.array_equal(other[1], dropped)


def reference_out(weights, v):
    """out[b,t,n] = sum_s weights[b,n,t,s] v[b,s,n // G]."""
    N, K = weights.shape[1], v.shape[2]
    v_rep = np.repeat(np.asarray(v), N // K, axis=2)
    return np.einsum("bnts,bsnh->btnh", weights, v_rep)


def test_dropout_preserves_the_mean_statistically():
    """E[dropped weight] = weight: the mean of dropped / clean over many draws is 1."""
    q, k, v = qkv(**DROPOUT_SHAPE)
    _, clean = sdpa(q, k, v, return_weights=True)
    ratios = np.stack([
        np.asarray(sdpa(q, k, v, dropout_rate=P, dropout_rng=raw_key(i),
                        return_weights=True)[1]) / np.asarray(clean)
        for i in range(10, 14)])  # each entry is 0 or 1/(1-P) = 2: mean 1, std 1
    # 16384 Bernoulli draws: standard error 1/128 ~ 0.008; 0.05 is > 6 sigma,
    # while a missing 1/(1-P) rescale would give a mean of 0.5.
    assert abs(ratios.mean() - 1.0) < 0.05
    assert abs(np.mean(ratios == 0.0) - P) < 0.05


# --------------------------------------------------------------------------
# Error paths: ValueError/TypeError naming the argument, before tracing.


@pytest.mark.parametrize("fn", [scaled_dot_product_attention, reference_attention],
                         ids=["fast", "reference"])
def test_errors(fn):
    q, k, v = qkv(B=1, T=2, S=3, N=4, K=2, H=8)
    with pytest.raises(ValueError,
                       match=r"query must have rank 4 \[B, T, N, H\] or 3 \[T, N, H\] \(unbatched\), got shape \(8,\)"):
        fn(q[0, 0, 0], k, v)
    with pytest.raises(ValueError, match=r"key must have rank 3 \[S, K, H\] like query \(2, 4, 8\), got shape "
                                         r"\(1, 3, 2, 8\)"):
        fn(q[0], k, v)  # an unbatched query needs unbatched keys and values
    with pytest.raises(ValueError, match=r"key must have rank 4 \[B, S, K, H\] like query"):
        fn(q, k[0], v)
    with pytest.raises(ValueError, match=r"value must have rank 4"):
        fn(q, k, v[..., None])
    with pytest.raises(ValueError, match=r"head dims differ: query has H=8, key H=4: query \(1, 2, 4, 8\), key "):
        fn(q, k[..., :4], v)
    with pytest.raises(ValueError, match=r"query heads N=4 .* multiple of key/value heads K=3"):
        q3, k3, v3 = qkv(B=1, T=2, S=3, N=4, K=3)
        fn(q3, k3, v3)
    with pytest.raises(ValueError, match=r"batch sizes differ"):
        fn(q, jnp.concatenate([k, k]), v)
    with pytest.raises(ValueError, match=r"value must match key in length S and heads K: .* value \(1, 2, 2, 8\)"):
        fn(q, k, v[:, :2])
    with pytest.raises(ValueError,
                       match=r"mask of shape \(2, 2\) is not broadcastable to \[B, N, T, S\]"):
        fn(q, k, v, mask=jnp.ones((2, 2), bool))
    with pytest.raises(ValueError, match=r"mask of shape \(1, 2, 2, 3\) is not broadcastable"):
        fn(q, k, v, mask=jnp.ones((1, 2, 2, 3), bool))  # 2 heads, neither 1 nor N=4
    with pytest.raises(TypeError, match=r"mask must be a boolean array"):
        fn(q, k, v, mask=jnp.ones((2, 3)))
    with pytest.raises(ValueError, match=r"bias of shape \(3, 2\) is not broadcastable"):
        fn(q, k, v, bias=jnp.zeros((3, 2)))


def test_dropout_rate_errors():
    q, k, v = qkv()
    for rate in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match=r"dropout_rate must be in \[0, 1\)"):
            scaled_dot_product_attention(q, k, v, dropout_rate=rate,
                                         dropout_rng=jax.random.PRNGKey(0))


def test_errors_are_raised_under_jit_before_tracing_fails():
    q, k, v = qkv(B=1, T=2, S=3, N=4, K=3)
    with pytest.raises(ValueError, match=r"N=4 .* K=3"):
        jax.jit(scaled_dot_product_attention)(q, k, v)


def test_repeat_kv_errors():
    x = jnp.zeros((1, 2, 2, 4))
    with pytest.raises(ValueError, match=r"x must have rank 4"):
        repeat_kv(x[0], 2)
    for bad in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match=r"n_rep must be a positive integer"):
            repeat_kv(x, bad)


@pytest.mark.parametrize("num_heads,num_kv_heads", [(4, 4), (4, 2), (4, 1)])
@pytest.mark.parametrize("num_queries", [1, 3])
def test_cached_attention_equals_masked_attention_on_the_same_cache(num_heads, num_kv_heads, num_queries):
    """Attention on the heads-major cache = the general path on the transposed cache with
    the visibility rule as its mask (docs/theory.md §9)."""
    from jaxattn.attention import cached_attention
    from jaxattn.masks import visible_cache_slots

    B, L, H = 2, 9, 8
    keys = jax.random.split(jax.random.PRNGKey(3), 3)
    query = jax.random.normal(keys[0], (B, num_queries, num_heads, H))
    key_cache = jax.random.normal(keys[1], (B, num_kv_heads, L, H))
    value_cache = jax.random.normal(keys[2], (B, num_kv_heads, L, H))
    positions = jnp.array([[2], [6]]) + jnp.arange(num_queries)[None]  # rows at different lengths
    out = cached_attention(query, key_cache, value_cache, positions, scale=0.3)
    expected = scaled_dot_product_attention(
        query, key_cache.transpose(0, 2, 1, 3), value_cache.transpose(0, 2, 1, 3),
        mask=visible_cache_slots(positions, L), scale=0.3)
    chex.assert_shape(out, (B, num_queries, num_heads, H))
    np.testing.assert_allclose(out, expected, atol=1e-6, rtol=1e-6)


def test_cached_attention_errors():
    from jaxattn.attention import cached_attention

    q, cache = jnp.zeros((2, 1, 4, 8)), jnp.zeros((2, 3, 5, 8))
    with pytest.raises(ValueError, match=r"query heads N=4 must be a multiple of key/value heads K=3: "
                                         r"query \(2, 1, 4, 8\) \[B, T, N, H\], key_cache \(2, 3, 5, 8\)"):
        cached_attention(q, cache, cache, jnp.zeros((2, 1), jnp.int32))
    positions = jnp.zeros((2, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"batch sizes differ: query \(2, 1, 4, 8\) \[B, T, N, H\], key_cache "):
        cached_attention(q, cache[:1, :2], cache[:1, :2], positions)
    with pytest.raises(ValueError, match=r"value_cache must match key_cache in length L and heads K: .* "
                                         r"value_cache \(2, 2, 4, 8\) \[B, K, L, Hv\]"):
        cached_attention(q, cache[:, :2], cache[:, :2, :4], positions)
    with pytest.raises(ValueError, match=r"head dims differ: query has H=8, key_cache H=4: "):
        cached_attention(q, cache[:, :2, :, :4], cache[:, :2], positions)
    with pytest.raises(ValueError, match=r"key_cache must have rank 4 \[B, K, L, H\], got shape \(2, 5, 8\)"):
        cached_attention(q, cache[0, :2], cache[:, :2], positions)
    with pytest.raises(TypeError, match=r"query must be a floating-point array, got dtype int32"):
        cached_attention(q.astype(jnp.int32), cache[:, :2], cache[:, :2], positions)
    with pytest.raises(ValueError, match="query_positions"):
        cached_attention(q, cache[:, :2], cache[:, :2], jnp.zeros((2,), jnp.int32))
    with pytest.raises(TypeError, match="query_positions must be an integer array"):
        cached_attention(q, cache[:, :2], cache[:, :2], jnp.zeros((2, 1)))
    with pytest.raises(ValueError, match=r"decode implementation must be one of \('xla', 'xla_cpu', 'blocked', 'auto_cpu'\)"):
        cached_attention(q, cache[:, :2], cache[:, :2], jnp.zeros((2, 1), jnp.int32), implementation="cuda")


# --------------------------------------------------------------------------
# Inputs that could give silently wrong results if unchecked.


@pytest.mark.parametrize("fn", ["xla", "custom_vjp", "reference"])
def test_a_row_biased_to_minus_infinity_everywhere_gives_zeros_with_finite_gradients(fn):
    """A bias of -inf hides a key like a mask does: a row with nothing left gives zeros, not NaN."""
    q, k, v = qkv(B=1, T=3, S=4, N=2, K=1)
    bias = np.zeros((1, 2, 3, 4), np.float32)
    bias[0, 1, 2, :] = -np.inf  # head 1, query 2: every key at -inf
    bias[0, 0, 0, 1:] = -np.inf  # head 0, query 0: only key 0 left
    bias = jnp.asarray(bias)
    attend = (functools.partial(reference_attention) if fn == "reference" else
              functools.partial(scaled_dot_product_attention, implementation=fn))
    out, grads = jax.jit(lambda q, k, v: (attend(q, k, v, bias=bias), jax.grad(
        lambda q, k, v: attend(q, k, v, bias=bias).sum(), argnums=(0, 1, 2))(q, k, v)))(q, k, v)
    np.testing.assert_array_equal(out[0, 2, 1], 0.0)
    np.testing.assert_allclose(out[0, 0, 0], v[0, 0, 0], rtol=1e-6)  # all weight on key 0
    assert np.all(np.isfinite(out))
    assert all(np.all(np.isfinite(g)) for g in grads)


def test_integer_inputs_are_refused():
    q, k, v = qkv(B=1, T=2, S=2, N=2, K=2)
    for name, args in (("query", (q.astype(jnp.int32), k, v)), ("value", (q, k, v.astype(jnp.int32)))):
        with pytest.raises(TypeError, match=f"{name} must be a floating-point array, got dtype int32"):
            scaled_dot_product_attention(*args)


# --------------------------------------------------------------------------------------------
# The rest of jax.nn.dot_product_attention's contract, soft caps and sinks (docs/theory.md §17, §18).
# JAX's own attention tests run against this function in tests/test_jax_attention_contract.py.

IMPLEMENTATIONS = ("xla", "custom_vjp", "chunked")


def _sinks(N, seed=4):
    return jnp.asarray(np.random.default_rng(seed).standard_normal(N).astype(np.float32))


def test_bias_and_mask_are_positional_in_jax_nn_order():
    q, k, v = qkv(B=2, T=3, S=4, N=2, K=2)
    bias = jnp.asarray(np.random.default_rng(1).standard_normal((1, 2, 3, 4)), jnp.float32)
    mask = padding_mask(jnp.array([4, 2]), 4)
    for fn in (scaled_dot_product_attention, reference_attention):
        np.testing.assert_array_equal(fn(q, k, v, bias, mask), fn(q, k, v, mask=mask, bias=bias))
    theirs = jax.nn.dot_product_attention(q, k, v, bias, mask)
    np.testing.assert_allclose(scaled_dot_product_attention(q, k, v, bias, mask), theirs, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_unbatched_inputs_give_unbatched_results(implementation):
    """`[T, N, H]` inputs: the batched call's row 0, with `[N, T, S]` biases, `[T, S]` masks and every output."""
    q, k, v = qkv(B=1, T=4, S=6, N=4, K=2, Hv=3)
    bias = jnp.asarray(np.random.default_rng(2).standard_normal((4, 4, 6)), jnp.float32)  # [N, T, S]
    kw = dict(is_causal=True, sinks=_sinks(4), logits_soft_cap=3.0, return_residual=True, implementation=implementation,
              key_value_seq_lengths=jnp.array([5]), query_seq_lengths=jnp.array([3]))
    out, residual = sdpa(q[0], k[0], v[0], bias, causal_mask(4, 6), **kw)
    batched_out, batched_residual = sdpa(q, k, v, bias[None], causal_mask(4, 6)[None, None], **kw)
    assert out.shape == (4, 4, 3) and residual.shape == (4, 4)
    np.testing.assert_array_equal(out, batched_out[0])
    np.testing.assert_array_equal(residual, batched_residual[0])
    out, weights = sdpa(q[0], k[0], v[0], return_weights=True)
    assert weights.shape == (4, 4, 6)
    np.testing.assert_array_equal(weights, sdpa(q, k, v, return_weights=True)[1][0])
    # jax.nn's 4-D masks and biases of unbatched calls are taken too.
    np.testing.assert_array_equal(sdpa(q[0], k[0], v[0], bias[None]), sdpa(q, k, v, bias[None])[0])


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ("reference",))
def test_query_seq_lengths_zero_outputs_weights_and_gradients_of_padding_rows(implementation):
    q, k, v = qkv(B=2, T=5, S=6, N=4, K=2)
    lengths = jnp.array([5, 2])
    attend = (reference if implementation == "reference"
              else functools.partial(sdpa, implementation=implementation))
    out = attend(q, k, v, is_causal=True, query_seq_lengths=lengths)
    np.testing.assert_array_equal(out[1, 2:], 0.0)
    np.testing.assert_allclose(out[:, :2], attend(q, k, v, is_causal=True)[:, :2], rtol=1e-6, atol=1e-6)
    np.testing.assert_allclose(out[0], attend(q, k, v, is_causal=True)[0], rtol=1e-6, atol=1e-6)
    _, weights, residual = reference(q, k, v, is_causal=True, query_seq_lengths=lengths,
                                     return_weights=True, return_residual=True)
    np.testing.assert_array_equal(weights[1, :, 2:], 0.0)
    assert np.all(residual[1, 2:] == -np.inf) and np.all(np.isfinite(residual[0]))
    d_q, d_k = jax.grad(lambda q, k: (attend(q, k, v, is_causal=True, query_seq_lengths=lengths) ** 2).sum(),
                        (0, 1))(q, k)
    np.testing.assert_array_equal(d_q[1, 2:], 0.0)
    # Keys only the padding rows see get no gradient: row 1's queries 0, 1 see keys <= 2.
    np.testing.assert_array_equal(d_k[1, 3:], 0.0)
    assert np.any(d_k[0, 3:] != 0.0)
    np.testing.assert_array_equal(attend(q, k, v, query_seq_lengths=jnp.array([0, 0])), 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ("reference",))
def test_the_residual_is_the_logsumexp_with_the_sink(implementation):
    """log sum_j exp(logit_j) (+ exp(sink)) per row, in the query's dtype, -inf for a row with nothing, no gradient."""
    q, k, v = qkv(B=2, T=4, S=5, N=4, K=2)
    attend = reference if implementation == "reference" else functools.partial(sdpa, implementation=implementation)
    mask = padding_mask(jnp.array([5, 0]), 5)  # row 1 sees no key
    bias = jnp.asarray(np.random.default_rng(3).standard_normal((1, 4, 4, 5)), jnp.float32)
    out, residual = attend(q, k, v, bias, mask, scale=0.4, logits_soft_cap=2.0, return_residual=True)
    assert residual.dtype == q.dtype == jnp.float32 and residual.shape == (2, 4, 4)
    logits = 2.0 * np.tanh(0.4 * np.einsum("btnh,bsnh->bnts", q, np.repeat(k, 2, axis=2)) / 2.0) + np.asarray(bias)
    expected = np.log(np.exp(logits[0]).sum(-1)).T  # [T, N]
    np.testing.assert_allclose(residual[0], expected, rtol=1e-5, atol=1e-5)
    assert np.all(residual[1] == -np.inf)
    sinks = _sinks(4)
    _, with_sink = attend(q, k, v, bias, mask, scale=0.4, logits_soft_cap=2.0, sinks=sinks, return_residual=True)
    np.testing.assert_allclose(with_sink[0], np.logaddexp(expected, np.asarray(sinks)[None]), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(with_sink[1], np.broadcast_to(sinks, (4, 4)), rtol=1e-6)  # the sink alone
    grads = jax.grad(lambda q: attend(q, k, v, return_residual=True)[1].sum())(q)
    np.testing.assert_array_equal(grads, 0.0)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ("reference",))
def test_the_residual_is_in_the_query_dtype_and_its_cotangent_too(implementation):
    """jax.nn's dtype: bfloat16 inputs give the float32 logsumexp rounded to bfloat16 (-inf stays -inf),
    and `jax.vjp` takes a bfloat16 cotangent for it, which changes no gradient."""
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(B=2, T=4, S=5, N=4, K=2))
    attend = reference if implementation == "reference" else functools.partial(sdpa, implementation=implementation)
    mask = padding_mask(jnp.array([5, 0]), 5)  # row 1 sees no key
    (out, residual), vjp = jax.vjp(lambda q, k, v: attend(q, k, v, mask=mask, return_residual=True), q, k, v)
    assert residual.dtype == jnp.bfloat16 and np.all(residual[1] == -np.inf)
    _, expected = reference(*(x.astype(jnp.float32) for x in (q, k, v)), mask=mask, return_residual=True)
    np.testing.assert_allclose(np.asarray(residual[0], np.float32), expected[0], rtol=1e-2)
    grads = vjp((jnp.ones_like(out), jnp.ones_like(residual)))
    for g, g0 in zip(grads, vjp((jnp.ones_like(out), jnp.zeros_like(residual)))):
        assert g.dtype == jnp.bfloat16
        np.testing.assert_array_equal(g, g0)


def test_the_residual_matches_jax_nn_where_rows_see_keys():
    q, k, v = qkv(B=2, T=6, S=6, N=4, K=2)
    kw = dict(is_causal=True, local_window_size=(2, 1), key_value_seq_lengths=jnp.array([6, 4], jnp.int32))
    _, ours = sdpa(q, k, v, return_residual=True, **kw)
    _, theirs = jax.nn.dot_product_attention(q, k, v, return_residual=True, **kw)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5, atol=1e-5)


def test_soft_cap_is_applied_after_the_scale_and_before_the_bias():
    q, k, v = qkv(B=1, T=3, S=4, N=2, K=1, H=4, seed=3)
    q = q * 4  # logits large enough for the cap to matter
    bias = jnp.asarray(np.random.default_rng(5).standard_normal((1, 2, 3, 4)), jnp.float32)
    _, weights = reference(q, k, v, bias, scale=0.5, logits_soft_cap=1.5, return_weights=True)
    logits = 1.5 * np.tanh(0.5 * np.einsum("btnh,bsnh->bnts", q, np.repeat(k, 2, axis=2)) / 1.5) + np.asarray(bias)
    expected = np.exp(logits - logits.max(-1, keepdims=True))
    np.testing.assert_allclose(weights, expected / expected.sum(-1, keepdims=True), rtol=1e-5, atol=1e-6)
    for implementation in IMPLEMENTATIONS:  # a negative control: the cap changes the result
        capped = sdpa(q, k, v, bias, scale=0.5, logits_soft_cap=1.5, implementation=implementation)
        np.testing.assert_allclose(capped, reference(q, k, v, bias, scale=0.5, logits_soft_cap=1.5), rtol=1e-5,
                                   atol=1e-6)
        assert not np.allclose(capped, reference(q, k, v, bias, scale=0.5), atol=1e-2)
        assert not np.allclose(capped, reference(q, k, v, bias, scale=0.5, logits_soft_cap=1.5 / 0.5), atol=1e-2)


def test_sinks_take_weight_without_a_value_and_a_row_with_nothing_gives_zeros():
    q, k, v = qkv(B=2, T=4, S=5, N=4, K=2)
    sinks = _sinks(4)
    mask = padding_mask(jnp.array([5, 0]), 5)  # row 1: no key, only the sink
    for implementation in IMPLEMENTATIONS:
        out = sdpa(q, k, v, mask=mask, sinks=sinks, implementation=implementation)
        np.testing.assert_allclose(out, reference(q, k, v, mask=mask, sinks=sinks), rtol=1e-5, atol=1e-6)
        np.testing.assert_array_equal(out[1], 0.0)
    _, weights, residual = reference(q, k, v, mask=mask, sinks=sinks, return_weights=True, return_residual=True)
    sink_weight = np.exp(np.asarray(sinks)[None, :, None] - np.asarray(residual).transpose(0, 2, 1))  # [B, N, T]
    np.testing.assert_allclose(np.asarray(weights[0]).sum(-1) + sink_weight[0], 1.0, rtol=1e-6)
    np.testing.assert_array_equal(weights[1], 0.0)
    # The negative control: a sink of -1e4 is no sink; a sink of 0 is not.
    np.testing.assert_allclose(sdpa(q, k, v, sinks=jnp.full(4, -1e4)), sdpa(q, k, v), atol=1e-7)
    assert not np.allclose(sdpa(q, k, v, sinks=jnp.zeros(4)), sdpa(q, k, v), atol=1e-3)


@pytest.mark.parametrize("implementation", ["xla", "custom_vjp", "reference"])
def test_soft_cap_and_sink_gradients_match_finite_differences(implementation):
    """Float64 (softmax stays float64), sinks differentiable, with an empty row and a window."""
    with jax.enable_x64(True):
        q, k, v = (x.astype(jnp.float64) for x in qkv(B=2, T=3, S=4, N=4, K=2, H=4))
        bias = jnp.asarray(np.random.default_rng(0).normal(size=(1, 4, 3, 4)))
        sinks = jnp.asarray(np.random.default_rng(1).normal(size=4))
        attend = (reference_attention if implementation == "reference" else
                  functools.partial(scaled_dot_product_attention, implementation=implementation))
        f = functools.partial(attend, is_causal=True, local_window_size=(1, 0), logits_soft_cap=1.2,
                              key_value_seq_lengths=jnp.array([4, 0]))
        # Jitted: the many evaluations of the finite differences run one compiled program.
        check_grads(jax.jit(lambda q, k, v, b, s: f(q, k, v, b, sinks=s)), (q, k, v, bias, sinks), order=1,
                    modes=("rev",))


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS + ("reference",))
def test_windows_have_jax_nns_meaning_and_need_no_causal_mask(implementation):
    q, k, v = qkv(B=2, T=6, S=6, N=4, K=2)
    attend = reference if implementation == "reference" else functools.partial(sdpa, implementation=implementation)
    for ours, mask in (({"local_window_size": 2}, local_window_mask(6, 6, (2, 2))),
                       ({"local_window_size": (0, 2)}, local_window_mask(6, 6, (0, 2))),
                       ({"local_window_size": (3, 2), "is_causal": True}, sliding_window_mask(6, 6, 4))):
        np.testing.assert_allclose(attend(q, k, v, **ours), sdpa(q, k, v, mask=mask), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(attend(q, k, v, **ours),
                                   jax.nn.dot_product_attention(q, k, v, **ours), rtol=1e-5, atol=1e-6)
    # The model's window W = 3 is (W - 1, 0); the former int meaning (W = the query and W - 1 back) is gone.
    old = sdpa(q, k, v, mask=sliding_window_mask(6, 6, 3))
    np.testing.assert_allclose(attend(q, k, v, local_window_size=(2, 0)), old, rtol=1e-5, atol=1e-6)
    assert not np.allclose(attend(q, k, v, is_causal=True, local_window_size=3), old, atol=1e-3)


def test_windows_are_end_aligned_when_there_are_fewer_queries_than_keys():
    """A documented difference: jax.nn aligns windows at the first key, jaxattn at the last."""
    q, k, v = qkv(B=1, T=2, S=6, N=2, K=2)
    ours = sdpa(q, k, v, local_window_size=(1, 0))
    np.testing.assert_allclose(ours, sdpa(q, k, v, mask=local_window_mask(2, 6, (1, 0))), rtol=1e-6)
    assert not np.allclose(ours, jax.nn.dot_product_attention(q, k, v, local_window_size=(1, 0)), atol=1e-3)


@pytest.mark.parametrize("implementation", IMPLEMENTATIONS)
def test_every_feature_at_once_is_rank_promotion_clean(implementation):
    """A causal mask, a window, a dense mask, a bias, both lengths, a cap and sinks together (the
    fixture raises on implicit rank promotion), values and gradients equal to the reference."""
    q, k, v = qkv(B=2, T=5, S=7, N=4, K=2, Hv=3)
    bias = jnp.asarray(np.random.default_rng(6).standard_normal((2, 1, 5, 7)), jnp.float32)
    mask = np.random.default_rng(7).random((7,)) < 0.8  # rank 1: broadcast explicitly
    kw = dict(is_causal=True, local_window_size=(3, 1), key_value_seq_lengths=jnp.array([7, 5]),
              query_seq_lengths=jnp.array([5, 3]), logits_soft_cap=2.5)
    target = jnp.asarray(np.random.default_rng(8).standard_normal((2, 5, 4, 3)), jnp.float32)

    def loss(attend):
        return lambda q, k, v, b, s: jnp.vdot(attend(q, k, v, b, mask, sinks=s, **kw), target)
    args = (q, k, v, bias, _sinks(4))
    attend = functools.partial(scaled_dot_product_attention, implementation=implementation)
    (value, grads), (value_r, grads_r) = jax.jit(lambda *args: [  # one compiled program for both
        jax.value_and_grad(loss(f), (0, 1, 2, 3, 4))(*args) for f in (attend, reference_attention)])(*args)
    np.testing.assert_allclose(value, value_r, rtol=1e-5)
    for name, g, g_r in zip("qkvbs", grads, grads_r):
        np.testing.assert_allclose(g, g_r, rtol=1e-4, atol=1e-5, err_msg=name)


@pytest.mark.parametrize("fn", [scaled_dot_product_attention, reference_attention], ids=["fast", "reference"])
def test_new_arguments_are_checked_before_tracing(fn):
    q, k, v = qkv(B=2, T=3, S=4, N=4, K=2)
    with pytest.raises(ValueError, match=r"local_window_size must be a non-negative int w .* got \(-1, 2\)"):
        fn(q, k, v, local_window_size=(-1, 2))
    with pytest.raises(ValueError, match=r"sinks must be \[N\] = \(4,\), one logit per query head, got shape \(2,\)"):
        fn(q, k, v, sinks=jnp.zeros(2))
    with pytest.raises(TypeError, match=r"sinks must be a floating-point array, got dtype int32"):
        fn(q, k, v, sinks=jnp.zeros(4, jnp.int32))
    for cap in (0.0, -1.0, float("inf"), True, jnp.ones(2)):
        with pytest.raises(ValueError, match=r"logits_soft_cap must be a positive finite number known when tracing"):
            fn(q, k, v, logits_soft_cap=cap)
    with pytest.raises(ValueError, match=r"logits_soft_cap .* got a traced value"):
        jax.jit(lambda c: fn(q, k, v, logits_soft_cap=c))(2.0)
    with pytest.raises(ValueError, match=r"query_seq_lengths \(3,\) must be \[B\] = \(2,\) for query \(2, 3, 4, 8\)"):
        fn(q, k, v, query_seq_lengths=jnp.array([1, 2, 3]))
    with pytest.raises(ValueError, match=r"query_seq_lengths must be in \[0, T=3\] for query .* got \[4, 1\]"):
        fn(q, k, v, query_seq_lengths=jnp.array([4, 1]))
    with pytest.raises(TypeError, match=r"query_seq_lengths must be an integer array"):
        fn(q, k, v, query_seq_lengths=jnp.array([1.0, 2.0]))
    with pytest.raises(ValueError, match=r"mask of shape \(2, 4, 3, 4\) is not broadcastable to \[N, T, S\] = "
                                         r"\(4, 3, 4\)"):
        fn(q[0], k[0], v[0], mask=jnp.ones((2, 4, 3, 4), bool))  # unbatched: a leading 1 at most
    with pytest.raises(ValueError, match=r"query_seq_lengths \(2,\) must be \[B\] = \(1,\)"):
        fn(q[0], k[0], v[0], query_seq_lengths=jnp.array([1, 2]))  # unbatched: B = 1, as jax.nn


# --------------------------------------------------------------------------------------------
# Axes of size zero, non-finite scales and lengths: what cannot work is refused naming the argument,
# what can (no rows, queries or keys) gives the one result every implementation gives.

ATTENDS = {impl: functools.partial(scaled_dot_product_attention, implementation=impl) for impl in IMPLEMENTATIONS}
ATTENDS["reference"] = reference_attention


@pytest.mark.parametrize("name", ATTENDS)
def test_a_head_dim_or_kv_heads_of_zero_is_a_value_error_naming_them(name):
    attend, z = ATTENDS[name], lambda *shape: jnp.ones(shape)
    with pytest.raises(ValueError, match=r"the head dim H must be positive, got query H=0, key H=0: query \(1, 4, 2, 0\)"):
        attend(z(1, 4, 2, 0), z(1, 4, 2, 0), z(1, 4, 2, 4))
    with pytest.raises(ValueError, match=r"key and value need at least one key/value head, got K=0"):
        attend(z(1, 4, 2, 4), z(1, 4, 0, 4), z(1, 4, 0, 4))
    for scale in (float("nan"), float("inf"), jnp.float32(-jnp.inf)):
        with pytest.raises(ValueError, match=r"scale must be a finite number, got"):
            attend(z(1, 4, 2, 4), z(1, 4, 2, 4), z(1, 4, 2, 4), scale=scale)


def test_cached_attention_refuses_the_same_and_an_empty_cache():
    from jaxattn.attention import cached_attention
    z, positions = (lambda *shape: jnp.ones(shape)), jnp.zeros((1, 1), jnp.int32)
    with pytest.raises(ValueError, match=r"the head dim H must be positive, got query H=0, key_cache H=0"):
        cached_attention(z(1, 1, 2, 0), z(1, 2, 5, 0), z(1, 2, 5, 4), positions)
    with pytest.raises(ValueError, match=r"key_cache and value_cache need at least one key/value head, got K=0"):
        cached_attention(z(1, 1, 2, 4), z(1, 0, 5, 4), z(1, 0, 5, 4), positions)
    with pytest.raises(ValueError, match=r"key_cache and value_cache hold no slots \(L=0\)"):
        cached_attention(z(1, 1, 2, 4), z(1, 2, 0, 4), z(1, 2, 0, 4), positions)
    with pytest.raises(ValueError, match=r"scale must be a finite number, got nan"):
        cached_attention(z(1, 1, 2, 4), z(1, 2, 5, 4), z(1, 2, 5, 4), positions, scale=float("nan"))


@pytest.mark.parametrize("name", ATTENDS)
def test_no_keys_or_no_queries_give_the_empty_rows_result(name):
    """S = 0: every row has nothing to attend to (zeros, the residual -inf or the head's sink); T = 0:
    an empty output. Every implementation alike, gradients included, causal or not."""
    attend = ATTENDS[name]
    q, k, v = (x.astype(jnp.bfloat16) for x in qkv(B=2, T=3, S=4, N=4, K=2, H=8))
    sinks = jnp.array([0.5, -1.0, 2.0, 0.0])
    out, weights, residual = attend(q, k[:, :0], v[:, :0], is_causal=True, sinks=sinks, return_weights=True,
                                    return_residual=True)
    chex.assert_shape([out, weights, residual], [(2, 3, 4, 8), (2, 4, 3, 0), (2, 3, 4)])
    assert out.dtype == residual.dtype == jnp.bfloat16 and not np.any(np.asarray(out, np.float32))
    np.testing.assert_array_equal(np.asarray(residual, np.float32), np.broadcast_to(sinks, (2, 3, 4)))
    _, residual = attend(q, k[:, :0], v[:, :0], return_residual=True)
    assert np.all(np.asarray(residual, np.float32) == -np.inf)
    grads = jax.grad(lambda q: attend(q, k[:, :0], v[:, :0]).astype(jnp.float32).sum())(q)
    assert grads.dtype == jnp.bfloat16 and not np.any(np.asarray(grads, np.float32))
    chex.assert_shape(attend(q[:, :0], k, v, is_causal=True), (2, 0, 4, 8))


def test_padding_mask_lengths_follow_the_rule_of_key_value_seq_lengths():
    q, k, v = qkv(B=2, T=4, S=16, N=4, K=4)
    bad = jnp.array([-1, 20])
    with pytest.raises(ValueError, match=r"lengths must be in \[0, max_len=16\], got \[-1, 20\]"):
        padding_mask(bad, 16)
    with pytest.raises(ValueError, match=r"key_value_seq_lengths must be in \[0, S=16\] .* got \[-1, 20\]"):
        scaled_dot_product_attention(q, k, v, key_value_seq_lengths=bad)
    good = jnp.array([0, 16])
    np.testing.assert_array_equal(padding_mask(good, 16)[:, 0, 0], np.arange(16)[None, :] < np.array([[0], [16]]))
