"""The one skeleton of every attention layer: `__call__` and `extend` written once over named steps.

A layer (`jaxattn.gqa.Attention`, `jaxattn.mla.MultiHeadLatentAttention`) is built
for one layer of a model: `layer` picks its `AttentionSpec` (`ModelConfig.layer_attention`:
window, RoPE on or off and its settings, soft cap, sinks; docs/theory.md §21). It
defines the steps; this class runs them in the one order both share:

    project     x (and a context) -> queries q, keys/values kv (pytrees the layer chooses)
    mix_values  a value embedding mixed into the values (self-attention, layers with a table of
                `ModelConfig.value_embeddings`; identity without one; docs/theory.md §23)
    normalise   q/k norms that act on whole projections (identity unless the layer has them)
    rotate      RoPE on the rotary part of q and of the keys (identity for a NoPE layer)
    update_cache  (extend only) writes kv into the layer's cache
    attend      whole sequences; `attend_cached` against the cache (extend)
    project_out merges heads, W_O, residual dropout

Windows are passed structurally to the attention functions (`local_window_size=(W - 1, 0)`
for whole sequences, `window=W` against the cache), so a blockwise kernel skips the
blocks they hide. Attention weights are returned one way: when the "intermediates"
collection is mutable (`jaxattn.attention_weights`), each layer sows its `[B, N, T, S]`
float32 weights there as "attention_weights"; otherwise they are never computed.
"""

from __future__ import annotations

import flax.linen as nn
import jax.numpy as jnp

from jaxattn.attention import scaled_dot_product_attention
from jaxattn.config import AttentionSpec, ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.primitives import logical
from jaxattn.rope import rope_attention_factor, rope_frequencies
from jaxattn.axes import HEADS

WEIGHTS = ("intermediates", "attention_weights")  # (collection, name) the layers sow their weights under


class AttentionLayer(nn.Module):
    """The shared skeleton; subclasses define the steps (see the module docstring).

    Attributes:
      config: the model's maths.
      kernels: which implementations run it.
      layer: which layer of the model this is (its `AttentionSpec`); 0 by default.
    """

    config: ModelConfig
    kernels: Kernels = Kernels()
    layer: int = 0

    @property
    def spec(self) -> AttentionSpec:
        """This layer's resolved attention (window, RoPE, soft cap, sinks)."""
        return self.config.layer_attention(self.layer)

    # -- steps a layer defines -------------------------------------------------------------

    def project(self, x, context=None):
        """x `[B, T, D]` (and context `[B, S, D]`) -> (q, kv)."""
        raise NotImplementedError

    def mix_values(self, kv, value_embedding):
        """Mixes a value embedding `[B, S, K, Hv]` into kv's values; identity for None. A layer
        without value embeddings (the default) refuses one."""
        if value_embedding is not None:
            raise ValueError(f"value_embedding: {type(self).__name__} has no value embeddings")
        return kv

    def normalise(self, q, kv):
        """Norms over whole projections; identity by default."""
        return q, kv

    def rotate(self, q, kv, q_positions, k_positions):
        """RoPE on the rotary parts of q and kv."""
        raise NotImplementedError

    def update_cache(self, cache, kv, starts):
        """Writes row b's new kv at slots `starts[b] + arange(T)` of the layer's cache (slot = position)."""
        raise NotImplementedError

    def attend(self, q, kv, *, mask=None, is_causal=False, window=None, deterministic=True,
               return_weights=False):
        """Attention over whole sequences -> `(out, weights [B, N, T, S] float32 or None)`."""
        raise NotImplementedError

    def attend_cached(self, q, cache, positions):
        """Attention of queries at absolute `positions [B, T]` to everything the cache holds -> out."""
        raise NotImplementedError

    def project_out(self, out, *, deterministic=True):
        """`[B, T, N, Hv] -> [B, T, D]`."""
        raise NotImplementedError

    def check_inputs(self, x, context) -> None:
        """ValueError unless x is `[B, T, D]` (and context `[B, S, D]` with the same B)."""
        if not hasattr(x, "ndim") or x.ndim != 3:
            raise ValueError(f"x must be [B, T, D], got shape {getattr(x, 'shape', type(x))}")
        if context is not None and (not hasattr(context, "ndim") or context.ndim != 3
                                    or context.shape[0] != x.shape[0]):
            raise ValueError(f"context must be [B, S, D] with B = {x.shape[0]}, "
                             f"got {getattr(context, 'shape', type(context))}")

    # -- whole sequences and cached extension, written once ---------------------------------

    def __call__(self, x, context=None, *, positions=None, context_positions=None, mask=None,
                 is_causal=False, deterministic=True, value_embedding=None):
        """Self-attention over x, or cross-attention from x to `context` (where the layer has it).

        Args:
          x: `[B, T, D]` queries' inputs.
          context: `[B, S, D]` keys'/values' inputs (None: self-attention).
          positions: `[B, T]` or `[T]` query positions for RoPE (default arange(T)).
          context_positions: `[B, S]` or `[S]` key positions (default: `positions`
            for self-attention, arange(S) for cross-attention).
          mask: boolean, True = attend, broadcastable to `[B, N, T, S]`
            (e.g. a padding mask `[B, 1, 1, S]`).
          is_causal: hide keys after each query (aligned to the end of the keys); a
            local layer's window applies to causal self-attention.
          deterministic: no dropout when True; else needs rngs={'dropout': key}.
          value_embedding: `[B, T, K, Hv]`, this layer's value embedding of x's tokens (`mix_values`);
            self-attention only.

        Returns:
          `[B, T, D]`; the weights are sown into "intermediates" when it is mutable.
        """
        self.check_inputs(x, context)
        if context is not None and value_embedding is not None:
            raise ValueError("value_embedding applies to self-attention; it was given with a context")
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        if context_positions is None:
            context_positions = positions if context is None else jnp.arange(context.shape[1])
        q, kv = self.project(x, context)
        q, kv = self.normalise(q, self.mix_values(kv, value_embedding))
        q, kv = self.rotate(q, kv, positions, context_positions)
        window = self.spec.window if is_causal and context is None else None
        capture = self.is_mutable_collection(WEIGHTS[0]) and not self.is_initializing()
        out, weights = self.attend(q, kv, mask=mask, is_causal=is_causal, window=window,
                                   deterministic=deterministic, return_weights=capture)
        if capture:
            self.sow(*WEIGHTS, weights)
        return self.project_out(out, deterministic=deterministic)

    def extend(self, x, cache, positions, *, value_embedding=None):
        """Appends the T tokens of x to the cache and attends causally to all of row b's tokens.

        Args:
          x: `[B, T, D]` new tokens.
          cache: this layer's cache (`KVCache` or `LatentCache`) of L slots; slot j holds position j.
          positions: `[B, T]` int absolute positions of the new tokens, consecutive in each row from
            the row's cache length: `positions[b, t] = positions[b, 0] + t`, `positions[b, -1] < L`
            (the model computes them once for every layer).
          value_embedding: `[B, T, K, Hv]` or None, as in `__call__`; the cache keeps the mixed values.

        Returns:
          `([B, T, D], new_cache)`. Deterministic (no dropout).
        """
        self.check_inputs(x, None)
        q, kv = self.project(x)
        q, kv = self.normalise(q, self.mix_values(kv, value_embedding))
        q, kv = self.rotate(q, kv, positions, positions)
        cache = self.update_cache(cache, kv, positions[:, 0])  # the rows' first new slots
        return self.project_out(self.attend_cached(q, cache, positions)), cache

    # -- shared pieces -----------------------------------------------------------------------

    def setup_rope_sinks_dropout(self, num_heads: int, rotated: int, all_rotated: bool) -> None:
        """From setup: this layer's RoPE frequencies over its `rotated` dims (`inv_freq`), YaRN's
        attention factor (`rope_factor`, 1 when `all_rotated` folds it into the scale), the
        `sinks` parameter `[N]` (logical axis "heads") and the residual dropout."""
        spec, c = self.spec, self.config
        if spec.rope:
            self.inv_freq = rope_frequencies(rotated, theta=spec.rope_theta, scaling=spec.rope_scaling)
        factor = rope_attention_factor(spec.rope_scaling)  # 1 without YaRN and for NoPE layers
        self.rope_factor = 1.0 if all_rotated else factor
        self.scale_factor = factor ** 2 if all_rotated else 1.0
        if spec.sinks:
            self.sinks = self.param("sinks", logical(nn.initializers.normal(c.init_std), HEADS), (num_heads,),
                                    jnp.dtype(c.param_dtype))
        self.resid_dropout = nn.Dropout(c.dropout)

    def cap_and_sinks(self) -> dict:
        """This layer's logit soft cap and sinks, as keyword arguments of the attention functions
        (only those it has, so a kernel that cannot take one is asked only where it is used)."""
        spec, extra = self.spec, {}
        if spec.logits_soft_cap is not None:
            extra["logits_soft_cap"] = spec.logits_soft_cap
        if spec.sinks:
            extra["sinks"] = self.sinks.astype(jnp.float32)
        return extra

    def attend_heads(self, q, k, v, *, mask=None, is_causal=False, window=None, deterministic=True,
                     return_weights=False):
        """`scaled_dot_product_attention` of per-head q `[B, T, N, H]`, k `[B, S, K, H]`, v `[B, S, K, Hv]`
        with this layer's scale, dropout, kernel and features -> `(out [B, T, N, Hv], weights or None)`.

        The window W is passed as its structural `local_window_size=(W - 1, 0)`, so a blockwise
        kernel skips the blocks it hides.
        """
        rate, rng = self.dropout(deterministic)
        result = scaled_dot_product_attention(
            q, k, v, mask=mask, is_causal=is_causal, scale=self.scale,
            local_window_size=None if window is None else (window - 1, 0),
            dropout_rate=rate, dropout_rng=rng, return_weights=return_weights,
            implementation=self.kernels.attention, **self.cap_and_sinks())
        return result if return_weights else (result, None)

    def dropout(self, deterministic: bool):
        """(rate, rng) of attention-weight dropout."""
        rate = 0.0 if deterministic else self.config.dropout
        return rate, (self.make_rng("dropout") if rate > 0.0 else None)
