"""The transformer block and the scanned period of blocks a `DecoderLM` stacks.

`Block`: one layer's attention and MLP branches on the residual stream `[B, T, D]`, with the norms
and residual form the config asks for (docs/theory.md §20). `LayerPeriod`: the P blocks of one
period of a scanned model, and `scanned_layers(R)`: that period under `nn.scan` over its R repeats
(`jaxattn.scan_plan`). The model (`jaxattn.model.DecoderLM`) embeds, runs these and reads logits.
"""

from __future__ import annotations

import functools

import flax.linen as nn

from jaxattn.axes import ACTIVATION_EMBED, BATCH, LENGTH
from jaxattn.cache.containers import PagedBatch
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.layers.kinds import attention_class
from jaxattn.layers.moe import mlp_for_layer
from jaxattn.layers.primitives import make_norm
from jaxattn.scan_plan import SCANNED

# The logical axes of the residual stream `[B, T, D]`. Under `jaxattn.axes.activation_rules`
# (as `train.run.steps` traces its programs) rows are split over the batch axes and D is kept whole,
# so each layer's weights are gathered to the rows rather than the rows resharded to the weights
# (docs/theory.md §16); anywhere else the constraint is a no-op.
RESIDUAL_AXES = (BATCH, LENGTH, ACTIVATION_EMBED)


class Block(nn.Module):
    """Transformer block `layer` of a model: attention and MLP branches on the residual stream.

    `config.norm_placement` (docs/theory.md §20): "pre" `x + f(attn_norm(x))`;
    "sandwich" `x + post_attn_norm(f(attn_norm(x)))` (Gemma 2/3); "post"
    `x + post_attn_norm(f(x))` (OLMo 2), likewise for the MLP with `mlp_norm`,
    `post_mlp_norm`. `config.residual`: "sequential" feeds the MLP branch the
    stream after attention; "parallel" feeds both branches the same x,
    `x + attn_branch(x) + mlp_branch(x)` (GPT-NeoX). Residual dropout is inside
    the attention layer and the MLP. The MLP is dense or a mixture of experts, called alike
    (`x, *, padding_mask, deterministic -> y`).
    """

    config: ModelConfig
    kernels: Kernels = Kernels()
    layer: int = 0

    def setup(self):
        c, k = self.config, self.kernels
        if c.norm_placement != "post":
            self.attn_norm = make_norm(c)
        self.attn = attention_class(c)(c, k, layer=self.layer)
        if c.norm_placement != "post":
            self.mlp_norm = make_norm(c)
        self.mlp = mlp_for_layer(c, k, self.layer)  # dense or a mixture of experts, called alike
        if c.norm_placement != "pre":
            self.post_attn_norm = make_norm(c)
            self.post_mlp_norm = make_norm(c)

    def __call__(self, x, *, positions, padding_mask=None, deterministic=True, value_embedding=None,
                 segment_ids=None):
        """`[B, T, D] -> [B, T, D]`, causal, the tokens at `positions` (`[B, T]` or `[T]`).

        `padding_mask [B, T]` (True = a real token) hides padding keys from attention and keeps
        padding out of an MLP's losses; `value_embedding` `[B, T, K, H]` goes to the values (or None);
        `segment_ids [B, T]` (packed rows, 0 = padding) keep each token within its document, and
        without a `padding_mask` their padding is kept out of the MLP's losses. They stay structural
        (no dense mask), so a kernel that takes segment ids gets them as such.
        """
        mask = None if padding_mask is None else padding_mask[:, None, None, :]  # [B, 1, 1, S]
        attend = lambda h: self.attn(h, positions=positions, mask=mask, is_causal=True,  # noqa: E731
                                     deterministic=deterministic, value_embedding=value_embedding,
                                     segment_ids=segment_ids)
        if padding_mask is None and segment_ids is not None:
            padding_mask = segment_ids != 0  # [B, T]: for the MLP only
        return self.residuals(x, attend, deterministic, padding_mask)

    def extend(self, x, cache, positions, *, value_embedding=None):
        """`[B, T, D]` new tokens at absolute `positions [B, T]` (row b's from its cache length on)
        -> (`[B, T, D]`, new layer cache)."""
        return self._with_cache(x, lambda h: self.attn.extend(h, cache, positions, value_embedding=value_embedding))

    def extend_paged(self, x, pool, batch: PagedBatch, *, value_embedding=None):
        """`[1, Tf, D]` flat new tokens of many sequences (`PagedBatch`) -> (`[1, Tf, D]`, new layer pool)."""
        return self._with_cache(x, lambda h: self.attn.extend_paged(h, pool, batch, value_embedding=value_embedding))

    def _with_cache(self, x, attend_and_update):
        """The residual branches around an attention call that also returns its updated cache."""
        updated = []

        def attend(h):
            out, cache = attend_and_update(h)
            updated.append(cache)
            return out

        return self.residuals(x, attend, True), updated[0]

    def residuals(self, x, attend, deterministic, padding_mask=None):
        """The two branches around `attend` (`[B, T, D] -> [B, T, D]`) and the MLP, per the config."""
        c = self.config
        pre = c.norm_placement != "post"
        post = c.norm_placement != "pre"

        def branch(h, f, pre_norm, post_norm):
            y = f(pre_norm(h) if pre else h)
            return post_norm(y) if post else y

        mlp = lambda h: self.mlp(h, padding_mask=padding_mask, deterministic=deterministic)  # noqa: E731
        attn_out = branch(x, attend, lambda h: self.attn_norm(h), lambda h: self.post_attn_norm(h))
        if c.residual == "parallel":
            return x + attn_out + branch(x, mlp, lambda h: self.mlp_norm(h), lambda h: self.post_mlp_norm(h))
        x = x + attn_out
        return x + branch(x, mlp, lambda h: self.mlp_norm(h), lambda h: self.post_mlp_norm(h))


class LayerPeriod(nn.Module):
    """One scan step: the P blocks of a period, layers `first .. first + P - 1` for their programs
    (`jaxattn.scan_plan`); `DecoderLM` scans it over the period's repeats, so its parameters and
    caches carry a leading `[R]` outside the scan and none inside."""

    config: ModelConfig
    kernels: Kernels = Kernels()
    first: int = 0
    period: int = 1

    def setup(self):
        self.blocks = [Block(self.config, self.kernels, layer=self.first + j) for j in range(self.period)]

    def __call__(self, x, shared, value_embeddings):
        """x `[B, T, D]`; shared `(positions, padding_mask, deterministic, segment_ids)`; value_embeddings
        per block (or None) -> (x, None)."""
        positions, padding_mask, deterministic, segment_ids = shared
        for block, value_embedding in zip(self.blocks, value_embeddings):
            x = block(x, positions=positions, padding_mask=padding_mask, deterministic=deterministic,
                      value_embedding=value_embedding, segment_ids=segment_ids)
            x = nn.with_logical_constraint(x, RESIDUAL_AXES)
        return x, None

    def extend(self, x, positions, per_step):
        """x `[B, T, D]` at `positions [B, T]`; per_step `(caches, value_embeddings)` per block ->
        (x, the blocks' new caches)."""
        caches, value_embeddings = per_step
        updated = []
        for block, cache, value_embedding in zip(self.blocks, caches, value_embeddings):
            x, cache = block.extend(x, cache, positions, value_embedding=value_embedding)
            updated.append(cache)
        return x, tuple(updated)


@functools.lru_cache(maxsize=None)
def scanned_layers(repeats: int):
    """`LayerPeriod` scanned over `repeats` steps. Every collection (parameters, sown weights and
    losses) gets the leading `[R]` axis, named "layers" for meshes; each repeat draws its own
    initialisation and dropout; the first argument is broadcast to every step, the second scanned."""
    return nn.scan(LayerPeriod, variable_axes={True: 0}, split_rngs={True: True}, in_axes=(nn.broadcast, 0),
                   length=repeats, methods=["__call__", "extend"], metadata_params={nn.PARTITION_NAME: SCANNED})
