"""The shared argument checks (`jaxattn._validate`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxattn._validate import concrete_or_none, is_int, require_positive_int


def test_is_int_takes_integers_and_never_a_bool():
    assert all(is_int(x) for x in (0, -3, 7, np.int64(3), np.int32(-1), np.uint8(2)))
    assert not any(is_int(x) for x in (True, False, np.bool_(True), 3.0, np.float32(3), "3", None))
    # numpy=False: Python ints only (JSON values and config fields).
    assert is_int(3, numpy=False) and not is_int(np.int64(3), numpy=False) and not is_int(True, numpy=False)


@pytest.mark.parametrize("bad", [0, -1, 1.5, True, np.bool_(True), "2"])
def test_require_positive_int_names_the_argument(bad):
    with pytest.raises(ValueError, match=r"n must be a positive integer, got"):
        require_positive_int("n", bad)
    require_positive_int("n", np.int64(2))


def test_concrete_or_none_is_none_only_for_traced_values():
    np.testing.assert_array_equal(concrete_or_none(jnp.arange(3)), [0, 1, 2])
    seen = []
    jax.jit(lambda x: seen.append(concrete_or_none(x)) or x)(1.0)
    assert seen == [None]
