"""Sinusoidal absolute positions (Vaswani et al., 2017)."""

import chex
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn import sinusoidal_positions


class SinusoidalShapeTest(chex.TestCase):

    @chex.variants(with_jit=True, without_jit=True)
    def test_shape_and_dtype(self):
        table = self.variant(sinusoidal_positions, static_argnums=(0, 1))(7, 6)
        chex.assert_shape(table, (7, 6))
        chex.assert_type(table, jnp.float32)


@pytest.mark.parametrize("base", [10000.0, 100.0])
def test_matches_formula(base):
    """PE[pos, 2i] = sin(pos / base^(2i/dim)), PE[pos, 2i+1] = cos(pos / base^(2i/dim))."""
    P, dim = 50, 16
    table = np.asarray(sinusoidal_positions(P, dim, base=base))
    expected = np.zeros((P, dim))
    for pos in range(P):
        for i in range(dim // 2):
            angle = pos / base ** (2 * i / dim)
            expected[pos, 2 * i] = np.sin(angle)
            expected[pos, 2 * i + 1] = np.cos(angle)
    # float32 angles up to 49 rad: absolute error ~ 49 * 2^-24 ~ 3e-6.
    np.testing.assert_allclose(table, expected, atol=2e-5)
    np.testing.assert_array_equal(table[0], np.tile([0.0, 1.0], dim // 2))


def test_bounded_and_distinct_rows():
    table = np.asarray(sinusoidal_positions(64, 32))
    assert np.abs(table).max() <= 1.0
    # Each (sin, cos) pair lies on the unit circle.
    np.testing.assert_allclose(table[:, 0::2] ** 2 + table[:, 1::2] ** 2, 1.0, rtol=1e-5)
    distances = np.linalg.norm(table[:, None] - table[None], axis=-1)
    assert (distances + np.eye(64) > 1e-3).all()


@pytest.mark.parametrize("args,name", [
    ((0, 4), "num_positions"), ((-1, 4), "num_positions"), ((4, 0), "dim"), ((4, 2.0), "dim")])
def test_non_positive_sizes_raise(args, name):
    with pytest.raises(ValueError, match=rf"{name} must be a positive integer"):
        sinusoidal_positions(*args)


def test_odd_dim_raises():
    with pytest.raises(ValueError, match=r"even dim, got dim=5"):
        sinusoidal_positions(4, 5)
