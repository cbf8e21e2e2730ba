"""Counting XLA compiles: a test that says nothing compiles after start-up watches them here."""

from __future__ import annotations

import contextlib

import jax


@contextlib.contextmanager
def counting_compiles():
    """Yields a list that gets one entry per backend compile while the `with` runs."""
    compiles = []

    def listener(event, duration, **kwargs):
        if "backend_compile" in event:
            compiles.append(event)

    jax.monitoring.register_event_duration_secs_listener(listener)
    try:
        yield compiles
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
