"""Rotary position embeddings: the rotation, its properties and its scalings.

The scaling oracles are independent numpy transcriptions, written as loops
over frequencies, of Meta's Llama 3.1 `apply_scaling`, of Hugging Face's
`_compute_yarn_parameters` / `_compute_dynamic_ntk_parameters`, and of the
NTK-aware rule theta' = theta * alpha^(H / (H - 2)).
"""

import functools
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import RopeScaling, apply_rope, rope_attention_factor, rope_frequencies

rope = jax.jit(apply_rope, static_argnames=("theta", "interleaved", "scaling"))


def rand(*shape, seed=0):
    return np.random.default_rng(seed).standard_normal(shape).astype(np.float32)


def numpy_rope_interleaved(x, positions, theta=10000.0):
    """docs/theory.md §8: pair (x[2i], x[2i+1]) as a complex number times e^(i pos theta^(-2i/H))."""
    H = x.shape[-1]
    freqs = theta ** (-np.arange(0, H, 2) / H)  # [H/2]
    angles = np.asarray(positions, np.float64)[..., None] * freqs  # [T, H/2]
    z = x[..., 0::2].astype(np.float64) + 1j * x[..., 1::2]
    z = z * np.exp(1j * angles)[:, None, :]  # broadcast over heads
    out = np.empty(x.shape, np.float64)
    out[..., 0::2], out[..., 1::2] = z.real, z.imag
    return out


class RopeShapeTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_rope_frequencies(self):
        for scaling in (None, RopeScaling("linear", 2.0), RopeScaling("ntk", 2.0),
                        RopeScaling("llama3", 8.0), RopeScaling("yarn", 4.0)):
            freqs = self.variant(functools.partial(rope_frequencies, scaling=scaling),
                                 static_argnums=0)(16)
            chex.assert_shape(freqs, (8,))
            chex.assert_type(freqs, jnp.float32)

    @chex.variants(with_jit=True, without_jit=True)
    def test_apply_rope(self):
        for dtype in (jnp.float32, jnp.bfloat16):
            x = jnp.asarray(rand(2, 5, 3, 8), dtype)
            for positions in (jnp.arange(5), jnp.arange(10).reshape(2, 5)):
                for interleaved in (True, False):
                    fn = self.variant(functools.partial(apply_rope, interleaved=interleaved))
                    out = fn(x, positions)
                    chex.assert_shape(out, (2, 5, 3, 8))
                    chex.assert_type(out, dtype)


def test_interleaved_matches_the_complex_rotation_formula():
    x, pos = rand(1, 6, 2, 8), np.array([0, 1, 2, 5, 17, 100])
    out = rope(x, pos, interleaved=True)
    np.testing.assert_allclose(out[0], numpy_rope_interleaved(x[0], pos), rtol=1e-5, atol=1e-5)
    np.testing.assert_array_equal(out[:, 0], x[:, 0])  # position 0 is the identity


def test_pairings_agree_after_permuting_dimensions():
    """Interleaved on x = half-split on x[perm], un-permuted, perm = [0,2,4,...,1,3,5,...]."""
    H = 8
    x, pos = rand(2, 5, 3, H), np.arange(3, 8)
    perm = np.concatenate([np.arange(0, H, 2), np.arange(1, H, 2)])
    inverse = np.argsort(perm)
    interleaved = rope(x, pos, interleaved=True)
    half_split = rope(x[..., perm], pos, interleaved=False)
    np.testing.assert_allclose(np.asarray(half_split)[..., inverse], interleaved,
                               rtol=1e-6, atol=1e-6)
    # The two pairings are different functions of the same x.
    assert not np.allclose(rope(x, pos, interleaved=False), interleaved, atol=1e-3)


@pytest.mark.parametrize("interleaved", [True, False])
def test_rope_preserves_norms(interleaved):
    x = rand(2, 7, 3, 16)
    out = rope(x, np.arange(0, 700, 100), interleaved=interleaved)
    np.testing.assert_allclose(np.linalg.norm(out, axis=-1), np.linalg.norm(x, axis=-1),
                               rtol=1e-5)


@pytest.mark.parametrize("interleaved", [True, False])
def test_dot_product_depends_only_on_relative_position(interleaved):
    """<R_m q, R_n k> = <R_(m+c) q, R_(n+c) k>, and it changes with m - n."""
    H = 16
    q = np.broadcast_to(rand(1, 1, 1, H, seed=1), (1, 6, 1, H))
    k = np.broadcast_to(rand(1, 1, 1, H, seed=2), (1, 6, 1, H))
    m = np.array([3, 10, 50, 7, 0, 9])
    n = np.array([1, 8, 48, 9, 2, 11])  # m - n = 2, 2, 2, -2, -2, -2
    dots = np.sum(np.asarray(rope(q, m, interleaved=interleaved), np.float64)
                  * np.asarray(rope(k, n, interleaved=interleaved), np.float64), axis=-1).ravel()
    np.testing.assert_allclose(dots[:3], dots[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(dots[3:], dots[3], rtol=1e-4, atol=1e-4)
    assert abs(dots[0] - dots[3]) > 1e-2


def test_batch_positions_equal_shared_positions():
    x = rand(2, 4, 2, 8)
    pos = np.arange(4)
    batched = rope(x, np.stack([pos, pos + 3]), interleaved=False)
    np.testing.assert_allclose(batched[0], rope(x[:1], pos, interleaved=False)[0], rtol=1e-6)
    np.testing.assert_allclose(batched[1], rope(x[1:], pos + 3, interleaved=False)[0],
                               rtol=1e-6)


def test_rope_frequencies_formula():
    freqs = np.asarray(rope_frequencies(8, theta=100.0))
    np.testing.assert_allclose(freqs, [1.0, 100 ** -0.25, 100 ** -0.5, 100 ** -0.75], rtol=1e-6)


def test_inv_freq_overrides_theta_and_scaling():
    x, pos = rand(1, 3, 1, 8), np.arange(3)
    freqs = rope_frequencies(8, theta=50.0)
    np.testing.assert_allclose(apply_rope(x, pos, interleaved=True, inv_freq=freqs),
                               rope(x, pos, theta=50.0, interleaved=True), rtol=1e-6)


# --------------------------------------------------------------------------
# Context-extension scalings.


def test_linear_scaling_equals_positions_divided_by_factor():
    factor = 4.0
    x, pos = rand(1, 5, 2, 8), np.arange(5)
    scaled = rope(x, pos * 4, interleaved=False, scaling=RopeScaling("linear", factor))
    np.testing.assert_allclose(scaled, rope(x, pos, interleaved=False), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(rope_frequencies(8, scaling=RopeScaling("linear", factor)),
                               np.asarray(rope_frequencies(8)) / factor, rtol=1e-6)


def numpy_ntk_aware(head_dim, theta, alpha):
    theta = theta * alpha ** (head_dim / (head_dim - 2))
    return np.array([1.0 / theta ** (2 * i / head_dim) for i in range(head_dim // 2)])


def numpy_hf_dynamic_ntk(head_dim, theta, factor, seq_len, max_position):
    """Hugging Face `_compute_dynamic_ntk_parameters` at a given sequence length."""
    base = theta * ((factor * seq_len / max_position) - (factor - 1)) ** (head_dim / (head_dim - 2))
    return 1.0 / base ** (np.arange(0, head_dim, 2) / head_dim)


def test_ntk_frequencies():
    freqs = np.asarray(rope_frequencies(64, theta=10000.0, scaling=RopeScaling("ntk", 2.0)))
    np.testing.assert_allclose(freqs, numpy_ntk_aware(64, 10000.0, 2.0), rtol=1e-6)
    # HF's dynamic NTK with factor 2 at 1.5x its trained length has alpha = 2.
    np.testing.assert_allclose(freqs, numpy_hf_dynamic_ntk(64, 10000.0, 2.0, 3072, 2048),
                               rtol=1e-6)
    assert freqs[0] == 1.0 and freqs[-1] < rope_frequencies(64)[-1]  # low frequencies stretched
    # head_dim 2 has the single frequency theta^0 = 1 whatever the scaling.
    np.testing.assert_array_equal(rope_frequencies(2, scaling=RopeScaling("ntk", 2.0)), [1.0])


def numpy_llama31(head_dim, theta, factor, low_freq_factor, high_freq_factor, old_context_len):
    """Meta's llama3 `apply_scaling` (reference implementation), frequency by frequency."""
    low_freq_wavelen = old_context_len / low_freq_factor
    high_freq_wavelen = old_context_len / high_freq_factor
    out = []
    for i in range(head_dim // 2):
        freq = 1.0 / theta ** (2 * i / head_dim)
        wavelen = 2 * math.pi / freq
        if wavelen < high_freq_wavelen:
            out.append(freq)
        elif wavelen > low_freq_wavelen:
            out.append(freq / factor)
        else:
            smooth = (old_context_len / wavelen - low_freq_factor) / (
                high_freq_factor - low_freq_factor)
            out.append((1 - smooth) * freq / factor + smooth * freq)
    return np.array(out)


def test_llama31_frequencies():
    """Llama-3.1: factor 8, low 1, high 4, original 8192, head_dim 128, theta 500000."""
    scaling = RopeScaling("llama3", 8.0, original_max_position=8192,
                          low_freq_factor=1.0, high_freq_factor=4.0)
    freqs = np.asarray(rope_frequencies(128, theta=500000.0, scaling=scaling))
    expected = numpy_llama31(128, 500000.0, 8.0, 1.0, 4.0, 8192)
    np.testing.assert_allclose(freqs, expected, rtol=1e-6)
    plain = np.asarray(rope_frequencies(128, theta=500000.0))
    wavelen = 2 * np.pi / plain
    # All three regimes occur in this configuration.
    np.testing.assert_allclose(freqs[wavelen < 2048], plain[wavelen < 2048], rtol=1e-6)
    np.testing.assert_allclose(freqs[wavelen > 8192], plain[wavelen > 8192] / 8, rtol=1e-6)
    assert ((wavelen >= 2048) & (wavelen <= 8192)).any()


def numpy_hf_yarn(head_dim, theta, factor, original_max_position, beta_fast=32, beta_slow=1):
    """Hugging Face `_compute_yarn_parameters` (truncate=True), as plain Python."""
    def correction_dim(num_rotations):
        return (head_dim * math.log(original_max_position / (num_rotations * 2 * math.pi))
                ) / (2 * math.log(theta))

    low = max(math.floor(correction_dim(beta_fast)), 0)
    high = min(math.ceil(correction_dim(beta_slow)), head_dim - 1)
    if low == high:
        high += 0.001
    out = []
    for i in range(head_dim // 2):
        pos_freq = theta ** (2 * i / head_dim)
        extrapolation, interpolation = 1.0 / pos_freq, 1.0 / (factor * pos_freq)
        ramp = min(max((i - low) / (high - low), 0.0), 1.0)
        extrapolation_factor = 1.0 - ramp
        out.append(interpolation * (1 - extrapolation_factor)
                   + extrapolation * extrapolation_factor)
    return np.array(out)


@pytest.mark.parametrize("head_dim,theta,factor,original", [
    (64, 10000.0, 4.0, 4096),  # Hugging Face defaults for beta_fast / beta_slow
    (128, 1000000.0, 4.0, 32768),  # Qwen2.5 long-context configuration
])
def test_yarn_frequencies(head_dim, theta, factor, original):
    scaling = RopeScaling("yarn", factor, original_max_position=original)
    freqs = np.asarray(rope_frequencies(head_dim, theta=theta, scaling=scaling))
    np.testing.assert_allclose(freqs, numpy_hf_yarn(head_dim, theta, factor, original),
                               rtol=1e-6)
    plain = np.asarray(rope_frequencies(head_dim, theta=theta))
    assert freqs[0] == plain[0]  # fast rotations extrapolate
    np.testing.assert_allclose(freqs[-1], plain[-1] / factor, rtol=1e-6)  # slow ones interpolate


def test_rope_attention_factor():
    np.testing.assert_allclose(rope_attention_factor(RopeScaling("yarn", 4.0)),
                               0.1 * math.log(4.0) + 1.0, rtol=1e-12)
    np.testing.assert_allclose(rope_attention_factor(RopeScaling("yarn", 40.0)),
                               0.1 * math.log(40.0) + 1.0, rtol=1e-12)
    assert rope_attention_factor(RopeScaling("yarn", 1.0)) == 1.0  # no extension
    # DeepSeek-V2/V3 style: ratio of two mscales (equal coefficients cancel).
    ds = RopeScaling("yarn", 40.0, mscale=0.707, mscale_all_dim=0.707)
    assert rope_attention_factor(ds) == pytest.approx(1.0)
    ds2 = RopeScaling("yarn", 40.0, mscale=1.0, mscale_all_dim=0.5)
    assert rope_attention_factor(ds2) == pytest.approx(
        (0.1 * math.log(40) + 1) / (0.05 * math.log(40) + 1))
    for scaling in (None, RopeScaling("linear", 4.0), RopeScaling("ntk", 4.0),
                    RopeScaling("llama3", 8.0)):
        assert rope_attention_factor(scaling) == 1.0


# --------------------------------------------------------------------------
# Errors.


def test_rope_errors():
    x = jnp.zeros((1, 3, 2, 8))
    with pytest.raises(ValueError, match=r"even, positive head dim, got head_dim=7"):
        apply_rope(jnp.zeros((1, 3, 2, 7)), jnp.arange(3), interleaved=True)
    for bad in (7, 0, -4):
        with pytest.raises(ValueError, match=rf"head_dim={bad}"):
            rope_frequencies(bad)
    with pytest.raises(ValueError,
                       match=r"x must have rank 4 \[B, T, N, H\], got shape \(3, 2, 8\)"):
        apply_rope(x[0], jnp.arange(3), interleaved=True)
    with pytest.raises(ValueError, match=r"positions must be \[B, T\] = \(1, 3\) or \[T\] = \(3,\)"
                                         r".* got \(4,\)"):
        apply_rope(x, jnp.arange(4), interleaved=True)
    with pytest.raises(ValueError, match=r"positions must be .* got \(2, 3\)"):
        apply_rope(x, jnp.zeros((2, 3), jnp.int32), interleaved=True)
    with pytest.raises(TypeError, match=r"positions must be an integer array, got dtype float32"):
        apply_rope(x, jnp.arange(3.0), interleaved=True)
    with pytest.raises(ValueError, match=r"inv_freq must be \[R/2\] with 2 <= R <= H = 8 .* got \(5,\)"):
        apply_rope(x, jnp.arange(3), interleaved=True, inv_freq=jnp.ones(5))
    for bad in (3, 10, 0):
        with pytest.raises(ValueError, match=rf"rotary_dim must be an even integer in \[2, H=8\], got {bad}"):
            apply_rope(x, jnp.arange(3), interleaved=True, rotary_dim=bad)
    with pytest.raises(TypeError, match=r"interleaved"):  # the pairing must be chosen
        apply_rope(x, jnp.arange(3))


def test_rope_scaling_errors():
    with pytest.raises(ValueError, match=r"RopeScaling.kind must be .* got 'dynamic'"):
        RopeScaling("dynamic", 2.0)
    for bad in (0.0, -1.0):
        with pytest.raises(ValueError, match=r"RopeScaling.factor must be positive"):
            RopeScaling("linear", bad)
