"""Argument checks that fail with a readable message before JAX traces.

Shapes are static under `jax.jit`, so these checks run once per compilation
and cost nothing at run time.
"""

from __future__ import annotations

import math
from typing import Sequence

import jax
import jax.numpy as jnp
import numpy as np


def is_int(value, *, numpy: bool = True) -> bool:
    """Whether `value` is an integer: a Python int or (unless `numpy=False`) a numpy integer, never a bool.

    `bool` is a subclass of `int` (`True == 1`), so `isinstance(value, int)` alone takes `True`
    for a count. `numpy=False` takes Python ints only: for values read from JSON or written to it
    (config fields: `to_dict` goes to JSON, which refuses numpy integers) and for arguments
    documented as a Python `int`.
    """
    kinds = (int, np.integer) if numpy else int
    return isinstance(value, kinds) and not isinstance(value, bool)


def require_rank(name: str, x, rank: int, layout: str) -> None:
    if not hasattr(x, "shape"):
        raise TypeError(f"{name} must be an array, got {type(x).__name__}")
    if x.ndim != rank:
        raise ValueError(
            f"{name} must have rank {rank} {layout}, got shape {tuple(x.shape)}"
        )


def require_broadcastable(name: str, shape: Sequence[int], target: Sequence[int],
                          target_desc: str) -> None:
    """Raises unless `shape` broadcasts to `target` (numpy rules, no growth of rank)."""
    shape, target = tuple(shape), tuple(target)
    ok = len(shape) <= len(target) and all(
        s in (1, t) for s, t in zip(shape[::-1], target[::-1])
    )
    if not ok:
        raise ValueError(
            f"{name} of shape {shape} is not broadcastable to {target_desc} = {target}"
        )


def require_bool(name: str, x) -> None:
    if x.dtype != jnp.bool_:
        raise TypeError(
            f"{name} must be a boolean array (True = attend), got dtype {x.dtype}; "
            "pass additive scores as `bias` instead"
        )


def require_float(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise TypeError(f"{name} must be a floating-point array, got dtype {x.dtype}")


def concrete_or_none(x):
    """`x` as a numpy array when its value is known now (not a tracer under `jit`), else None."""
    try:
        return np.asarray(x)
    except (jax.errors.TracerArrayConversionError, jax.errors.ConcretizationTypeError):
        return None


def require_integer(name: str, x) -> None:
    if not jnp.issubdtype(x.dtype, jnp.integer):
        raise TypeError(f"{name} must be an integer array, got dtype {x.dtype}")


def require_positive_int(name: str, value) -> None:
    if not is_int(value) or value <= 0:
        raise ValueError(f"{name} must be a positive integer, got {value!r}")


def require_field_positive_int(owner: str, name: str, value) -> None:
    if not is_int(value, numpy=False) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive integer, got {value!r}")


def require_field_positive_number(owner: str, name: str, value, *, none_ok: bool = True) -> None:
    if value is None and none_ok:
        return
    if not (is_int(value, numpy=False) or isinstance(value, float)) or not math.isfinite(value) or value <= 0:
        raise ValueError(f"{owner}.{name} must be a positive number{' or None' if none_ok else ''}, got {value!r}")


def require_field_fraction(owner: str, name: str, value, *, none_ok: bool) -> None:
    if value is None and none_ok:
        return
    if not (is_int(value, numpy=False) or isinstance(value, float)) or not 0.0 < value <= 1.0:
        raise ValueError(f"{owner}.{name} must be a number in (0, 1]{' or None' if none_ok else ''}, got {value!r}")
