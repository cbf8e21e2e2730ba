"""The one skeleton of every attention layer: `__call__` and `extend` written once over named steps.

A layer (`jaxattn.layers.gqa.Attention`, `jaxattn.layers.mla.MultiHeadLatentAttention`) is built
for one layer of a model: `layer` picks its `AttentionSpec` (`ModelConfig.layer_attention`:
window, RoPE on or off and its settings, soft cap, sinks; docs/theory.md §21). It
defines the steps; this class runs them in the one order both share:

    project     x (and a context) -> queries q, keys/values kv (pytrees the layer chooses)
    mix_values  a value embedding mixed into the values (self-attention, layers with a table of
                `ModelConfig.value_embeddings`; identity without one; docs/theory.md §23)
    normalise   q/k norms that act on whole projections (identity unless the layer has them)
    rotate      RoPE on the rotary part of q and of the keys (identity for a NoPE layer)
    update_cache  (extend) writes kv into the layer's cache; `write_pages` into its page pool (extend_paged)
    attend      whole sequences; `attend_cached` against the cache (extend); `attend_pages` against
                pages (extend_paged)
    project_out merges heads, W_O, residual dropout

What a layer caches per token is declared once, by the layer: `cache_fields(config)` (a
`jaxattn.cache.containers.CacheField` per array of kv, in kv's order) and `cache_type` (the container). The
dense cache and the paged pools are built from that declaration (`jaxattn.cache.build`), and the writes,
the page gathers and the reference paged attention here are written once over it.

Windows are passed structurally to the attention functions (`local_window_size=(W - 1, 0)`
for whole sequences, `window=W` against the cache), so a blockwise kernel skips the
blocks they hide. Attention weights are returned one way: when the "intermediates"
collection is mutable (`jaxattn.attention_weights`), each layer sows its `[B, N, T, S]`
float32 weights there as "attention_weights"; otherwise they are never computed.
"""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp

from jaxattn.attention import scaled_dot_product_attention
from jaxattn.cache.containers import CacheField, PagedBatch, RowGroup, gather_pages, write_pages, write_rows
from jaxattn.config import AttentionSpec, ModelConfig
from jaxattn.kernels import Kernels, paged_select
from jaxattn.masks import check_segment_ids
from jaxattn.layers.primitives import logical
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

    cache_type = None  # the container of this kind's cache (a flax struct with one field per CacheField)

    @staticmethod
    def cache_fields(config: ModelConfig) -> dict[str, CacheField]:
        """What this kind keeps per token: one `CacheField` per array of its kv, in kv's order."""
        raise NotImplementedError

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
        """Writes row b's new kv (`[B, T, ...]` arrays, tokens first) at slots `starts[b] + arange(T)` of the
        layer's dense cache (slot = position), each array in its field's layout."""
        fields = self.cache_fields(self.config)
        return self.cache_type(**{
            name: write_rows(getattr(cache, name), field.to_dense(new), starts, axis=1 + field.slot_axis,
                             implementation=self.kernels.decode)
            for (name, field), new in zip(fields.items(), kv)})

    def write_pages(self, pool, kv, slots):
        """Writes the step's new kv (`[1, Tf, ...]` arrays) to `slots [Tf]` of the layer's page pool."""
        names = self.cache_fields(self.config)
        return self.cache_type(**{name: write_pages(getattr(pool, name), new[0], slots)
                                  for name, new in zip(names, kv)})

    def gather_cache(self, pool, block_table):
        """The dense cache `[R, ..., Pr * ps, ...]` of the rows whose pages `block_table [R, Pr]` lists."""
        fields = self.cache_fields(self.config)
        return self.cache_type(**{name: field.to_dense(gather_pages(getattr(pool, name), block_table))
                                  for name, field in fields.items()})

    def attend(self, q, kv, *, mask=None, is_causal=False, window=None, deterministic=True,
               return_weights=False, segment_ids=None):
        """Attention over whole sequences -> `(out, weights [B, N, T, S] float32 or None)`; `segment_ids`
        `[B, T]` (self-attention) or None as in `scaled_dot_product_attention`."""
        raise NotImplementedError

    def attend_cached(self, q, cache, positions):
        """Attention of queries at absolute `positions [B, T]` to everything the cache holds -> out."""
        raise NotImplementedError

    def attend_pages(self, q, pool, rows: RowGroup):
        """Attention of one group's queries (`[R, C, ...]`, at `rows.positions`) to their rows' pages
        -> `[R, C, N, Hv]`, by the kernel `jaxattn.kernels.paged_select.choose` picks for `kernels.paged`
        and the call: "gather" (the reference) gathers each row's pages into the dense layout and calls
        `attend_cached`; the others take `paged_operands` and give `paged_output` its result."""
        queries, key_pages, value_pages = self.paged_operands(q, pool)
        kernel, _ = paged_select.choose(self.kernels.paged, queries, key_pages, value_pages)
        if kernel == paged_select.GATHER:
            return self.attend_cached(q, self.gather_cache(pool, rows.block_table), rows.positions)
        out = paged_select.KERNELS[kernel](queries, key_pages, value_pages, rows.block_table, rows.positions,
                                           scale=self.scale, window=self.spec.window, **self.cap_and_sinks())
        return self.paged_output(out)

    def paged_operands(self, q, pool):
        """`(queries, key_pages, value_pages)` of `jaxattn.kernels.paged`'s contract for q against the pool
        (not read on the "gather" path: under `jit` they cost nothing there)."""
        raise NotImplementedError

    def paged_output(self, out):
        """A paged kernel's `[R, C, N, Hv']` result -> this layer's `[R, C, N, Hv]`; identity by default."""
        return out

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
                 is_causal=False, deterministic=True, value_embedding=None, segment_ids=None):
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
          segment_ids: `[B, T]` int document ids of packed rows (0 = padding; docs/theory.md §27): a
            token attends only within its document. Self-attention only; `positions` are the
            caller's (the model restarts them per document, `jaxattn.masks.segment_positions`).

        Returns:
          `[B, T, D]`; the weights are sown into "intermediates" when it is mutable.
        """
        self.check_inputs(x, context)
        if context is not None and value_embedding is not None:
            raise ValueError("value_embedding applies to self-attention; it was given with a context")
        if context is not None and segment_ids is not None:
            raise ValueError("segment_ids mark documents packed into x's rows (self-attention); they were given "
                             "with a context")
        if segment_ids is not None:  # checked here for either path (MLA's absorbed one is no kernel call)
            segment_ids = check_segment_ids("segment_ids", segment_ids, x.shape[:2], "[B, T]", f"x {x.shape}")
        positions = jnp.arange(x.shape[1]) if positions is None else positions
        if context_positions is None:
            context_positions = positions if context is None else jnp.arange(context.shape[1])
        q, kv = self.project(x, context)
        q, kv = self.normalise(q, self.mix_values(kv, value_embedding))
        q, kv = self.rotate(q, kv, positions, context_positions)
        window = self.spec.window if is_causal and context is None else None
        capture = self.is_mutable_collection(WEIGHTS[0]) and not self.is_initializing()
        out, weights = self.attend(q, kv, mask=mask, is_causal=is_causal, window=window,
                                   deterministic=deterministic, return_weights=capture, segment_ids=segment_ids)
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

    def extend_paged(self, x, pool, batch: PagedBatch, *, value_embedding=None):
        """The step's new tokens of many sequences, written to the layer's page pool and attending
        causally to their own sequences' tokens (`jaxattn.cache.containers.PagedBatch`).

        Args:
          x: `[1, Tf, D]` the step's tokens, flat (the groups of `batch` tile them in order).
          pool: this layer's page pool (its `cache_type`, arrays `[P, ps, ...]`).
          batch: where each token goes and which rows its queries belong to.
          value_embedding: `[1, Tf, K, Hv]` or None, as in `extend`.

        Returns:
          `([1, Tf, D], new_pool)`; padding tokens' outputs are the projection of zeros.
        """
        self.check_inputs(x, None)
        positions = batch.positions[None, :]  # [1, Tf]
        q, kv = self.project(x)
        q, kv = self.normalise(q, self.mix_values(kv, value_embedding))
        q, kv = self.rotate(q, kv, positions, positions)
        pool = self.write_pages(pool, kv, batch.slots)
        outs, start = [], 0
        for rows in batch.groups:  # each group's R x C queries are the next R * C flat tokens
            R, C = rows.positions.shape
            take = lambda a: a[0, start:start + R * C].reshape(R, C, *a.shape[2:])  # noqa: E731
            out = self.attend_pages(jax.tree.map(take, q), pool, rows)  # [R, C, N, Hv]
            outs.append(out.reshape(R * C, *out.shape[2:]))
            start += R * C
        return self.project_out(jnp.concatenate(outs)[None]), pool

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
                     return_weights=False, segment_ids=None):
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
            implementation=self.kernels.attention, segment_ids=segment_ids, **self.cap_and_sinks())
        return result if return_weights else (result, None)

    def dropout(self, deterministic: bool):
        """(rate, rng) of attention-weight dropout."""
        rate = 0.0 if deterministic else self.config.dropout
        return rate, (self.make_rng("dropout") if rate > 0.0 else None)
