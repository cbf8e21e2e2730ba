"""A decoder-only language model from one `ModelConfig` (GPT-2 / Llama / Gemma / DeepSeek shapes).

tokens `[B, T]` -> embeddings (times `embed_multiplier`, + learned or sinusoidal
positions) `[B, T, D]` -> `num_layers` blocks (`jaxattn.layers.block.Block`), each with its own
attention (`ModelConfig.layer_attention`) and value embedding (`ModelConfig.value_embeddings`:
`embed_values`) -> final norm -> lm_head -> float32 logits
`[B, T, V]` (soft-capped when `final_logits_soft_cap`).

`__call__` runs whole sequences (training, scoring). `extend` appends tokens
to a `DecodeCache` (prefill and one-token decode steps) and returns the new
cache; the cache goes in and comes out, the module keeps no state.
`DecoderLM(config, kernels)`: the config is the maths, the optional
`jaxattn.kernels.Kernels` says which implementations run it.
`abstract_params(config)` is its parameter tree as shapes and dtypes, with each
leaf's logical axis names (nothing allocated); `count_params` and `active_params` count it.
`attention_weights(model, variables, tokens)` returns the logits and every
layer's attention weights (sown by the layers into "intermediates"). A layer's
MLP is dense or, where `ModelConfig.layer_is_moe`, a mixture of experts
(`jaxattn.layers.moe.MoE`): both are called alike, and a layer with training losses of its own sows
them (`jaxattn.layer_losses`). The absolute positions added to the embeddings are one module,
chosen once from the config (`jaxattn.layers.absolute_positions`); positions are computed here, once
per call, and passed down to every layer. Packed rows (`segment_ids`, docs/theory.md §27) go down
to every attention layer too, and their positions restart at each document
(`jaxattn.masks.segment_positions`), so a packed row gives each document what it gives alone.
The inputs' checks are `jaxattn.model_checks` (values where they are known, i.e. outside `jit`).
"""

from __future__ import annotations

import functools
import re

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax
from flax.traverse_util import flatten_dict

from jaxattn import head_loss
from jaxattn import kernels as kernels_lib
from jaxattn.axes import ACTIVATION_EMBED, ACTIVATION_VOCAB, EMBED, KV_HEADS, VOCAB
from jaxattn.cache.containers import DecodeCache, PagedBatch
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.layers.absolute_positions import absolute_positions
from jaxattn.layers.attention_layer import WEIGHTS
from jaxattn.layers.block import RESIDUAL_AXES, Block, scanned_layers
from jaxattn.layers.primitives import check_config, logical, make_linear, make_norm
from jaxattn.lora.weight import is_lora
from jaxattn.masks import check_segment_ids, segment_positions
from jaxattn.model_checks import check_cache, check_capacity, check_length, check_paged, check_token_range, check_tokens
from jaxattn.quantization import TIED_HEAD, is_quantized, take_columns
from jaxattn.scan_plan import SCANNED, plan_layers
from jaxattn.softmax import soft_cap


class DecoderLM(nn.Module):
    """Token embedding `wte`, the absolute positions `wpe` (a learned table for "learned" positions),
    value-embedding tables `value_embed_j` (`[V, K*H]`, logical axes ("vocab", "kv_heads")), blocks
    `blocks_i` (with `config.scan_layers`, the scanned ones stacked under `layers`:
    `jaxattn.scan_plan`), `final_norm`, lm_head."""

    config: ModelConfig
    kernels: Kernels = Kernels()

    def setup(self):
        c, k = self.config, self.kernels
        check_config(c, k)
        dtypes = dict(dtype=jnp.dtype(c.dtype), param_dtype=jnp.dtype(c.param_dtype))
        tokens = logical(nn.initializers.normal(c.init_std), VOCAB, EMBED)
        self.wte = nn.Embed(c.vocab_size, c.d_model, embedding_init=tokens, **dtypes)
        values = logical(nn.initializers.normal(c.init_std), VOCAB, KV_HEADS)
        self.value_embed = [nn.Embed(c.vocab_size, c.num_kv_heads * c.head_dim, embedding_init=values, **dtypes)
                            for _ in range(c.value_embeddings)]  # params value_embed_0 .. value_embed_{E-1}
        self.wpe = absolute_positions(c)
        self.embed_dropout = nn.Dropout(c.dropout)
        plan = plan_layers(c)  # every layer unrolled unless config.scan_layers
        self.blocks = {i: Block(c, k, layer=i) for i in plan.prefix + plan.suffix}  # params blocks_{i}
        if plan.repeats:
            self.layers = scanned_layers(plan.repeats)(c, k, first=plan.first, period=plan.period)
        self.final_norm = make_norm(c)
        if not c.tie_embeddings:
            self.lm_head = make_linear(c, k, c.vocab_size, (EMBED, VOCAB), use_bias=False,
                                       residual=c.zero_init_out)  # zero-initialised with zero_init_out

    # -- the named steps -------------------------------------------------------------------

    def embed(self, tokens, positions, *, deterministic=True):
        """tokens `[B, T]`, positions `[B, T]` or `[T]` -> `[B, T, D]`: the token rows, scaled, plus
        the absolute positions (`jaxattn.layers.absolute_positions`; RoPE and none add nothing here)."""
        c = self.config
        head = self.get_variable("params", TIED_HEAD)
        if is_quantized(head) and "wte" not in self.variables["params"]:  # the table only as the head's copy
            x = take_columns(head, tokens.reshape(-1)).reshape(*tokens.shape, -1).astype(self.wte.dtype)
        else:
            # nn.Embed's lookup, with the table gathered first on a mesh (FSDP splits it along D; looking
            # rows up in a split table would give activations split along D, not by rows).
            table = nn.with_logical_constraint(self.wte.embedding, (ACTIVATION_VOCAB, ACTIVATION_EMBED))
            x = jnp.take(table.astype(self.wte.dtype), tokens, axis=0)
        if c.embed_multiplier != 1.0:  # Gemma's sqrt(D), rounded to the compute dtype as Gemma does
            x = x * jnp.asarray(c.embed_multiplier, x.dtype)
        return self.embed_dropout(self.wpe.add_to(x, positions), deterministic=deterministic)

    def embed_values(self, tokens) -> list:
        """tokens `[B, T]` -> per layer its value embedding `[B, T, K, H]` (compute dtype) or None.

        Layer i looks `tokens` up in table `config.value_embedding_table(i)` (docs/theory.md §23); each
        table is looked up once and shared by its two layers.
        """
        c = self.config
        looked_up = []
        for embed in self.value_embed:  # gathered whole first, as in `embed`
            table = nn.with_logical_constraint(embed.embedding, (ACTIVATION_VOCAB, None))
            rows = jnp.take(table.astype(embed.dtype), tokens, axis=0)  # [B, T, K*H]
            looked_up.append(rows.reshape(*tokens.shape, c.num_kv_heads, c.head_dim))  # [B, T, K, H]
        which = [c.value_embedding_table(i) for i in range(c.num_layers)]
        return [None if j is None else looked_up[j] for j in which]

    def logits(self, x):
        """Final norm and lm_head: `[B, T, D] -> [B, T, V]` float32 (one 2-D matmul), soft-capped
        by `final_logits_soft_cap` (docs/theory.md §17)."""
        x = self.final_norm(x)
        if not self.config.tie_embeddings:
            logits = self.lm_head(x).astype(jnp.float32)
        elif is_quantized(head := self.get_variable("params", TIED_HEAD)):  # `jaxattn.quantize`'s copy [D, V]
            B, T, D = x.shape
            matmul = kernels_lib.quantized_matmul_kernel(self.kernels.quantized)
            logits = matmul(x.reshape(B * T, D), head).reshape(B, T, -1)  # [B*T, V] float32
        else:
            B, T, D = x.shape
            rows = x.reshape(B * T, D)
            if head is None:  # wte [V, D] read as the head [D, V], in the kernel's form for a transposed weight
                matmul = kernels_lib.transposed_matmul_kernel(self.kernels.matmul)
                logits = matmul(rows, self.wte.embedding.astype(x.dtype))  # [B*T, V] float32
            else:  # a float tied_head [D, V]: a quantized model's weights dequantized
                logits = kernels_lib.matmul_kernel(self.kernels.matmul)(rows, head.astype(x.dtype))  # [B*T, V] float32
            logits = logits.reshape(B, T, -1)
        return soft_cap(logits, self.config.final_logits_soft_cap)

    def head_matrix(self):
        """The head `[D, V]` as a float array in the compute dtype (the tied embedding's transpose, or
        lm_head's kernel), or None where it is quantized or adapted (`jaxattn.head_loss` then cannot take it)."""
        if self.config.tie_embeddings:
            tied = self.get_variable("params", TIED_HEAD)  # a quantized model's copy, when it has one
            head = self.wte.embedding.T if tied is None else tied
        else:
            head = self.lm_head.get_variable("params", "kernel")
        if is_quantized(head) or is_lora(head):
            return None
        return head.astype(jnp.dtype(self.config.dtype))

    # -- whole sequences -------------------------------------------------------------------

    def __call__(self, tokens, *, positions=None, padding_mask=None, deterministic=True, check=False,
                 segment_ids=None):
        """Causal forward pass.

        Args:
          tokens: `[B, T]` int ids.
          positions: `[B, T]` or `[T]` absolute positions (default arange(T), or with `segment_ids`
            each token's position within its document, `jaxattn.masks.segment_positions`).
          padding_mask: `[B, T]` bool, True = real token; padding keys are hidden.
          segment_ids: `[B, T]` int document ids of packed rows (docs/theory.md §27): 1, 2, ... per
            document of a row, 0 = padding (attends to nothing, never attended, outside the MLP's
            losses). Each token attends only within its document (with the causal mask and every
            layer's window), so a packed row's logits are each document's logits run alone. For
            training and scoring; `extend` (caches) takes no segment ids.
          deterministic: no dropout when True; else pass rngs={'dropout': key}.

        Returns:
          logits `[B, T, V]` float32 (`attention_weights` also gives every layer's weights).

        Token ids must be in `[0, vocab_size)`: checked here when their values are
        known (outside `jit`); under `jit` an id outside gives NaN logits unless
        `check=True` inside `checkify.checkify` (see `extend`).
        """
        return self.logits(self.hidden(tokens, positions=positions, padding_mask=padding_mask,
                                        deterministic=deterministic, check=check, segment_ids=segment_ids))

    def token_losses(self, tokens, targets, *, fused=True, **kwargs):
        """Next-token losses `[B*T]` float32 of `tokens [B, T]` against `targets [B, T]` (`__call__`'s
        keyword arguments otherwise). `fused`: the head and the cross entropy together, a chunk of rows at
        a time (`jaxattn.head_loss`: no `[B, T, V]` logits kept), where `head_matrix()` is a float matrix;
        else the cross entropy of `__call__`'s logits. The two are equal up to float32 summation order;
        the fused gradient recomputes the logits for the head's own gradient (where it is differentiated)."""
        x = self.hidden(tokens, **kwargs)  # [B, T, D]
        head = self.head_matrix() if fused else None
        if head is None:
            logits = self.logits(x).reshape(-1, self.config.vocab_size)  # [B*T, V] float32
            return optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1))
        x = self.final_norm(x).astype(head.dtype)
        matmul = kernels_lib.matmul_kernel(self.kernels.matmul)
        return head_loss.token_losses(x.reshape(-1, x.shape[-1]), head, targets.reshape(-1), matmul=matmul,
                                      cap=self.config.final_logits_soft_cap)

    def hidden(self, tokens, *, positions=None, padding_mask=None, deterministic=True, check=False,
               segment_ids=None):
        """`__call__` up to the final norm: `[B, T] -> [B, T, D]` (the layers' last residual stream)."""
        check_tokens(tokens)
        check_token_range(tokens, self.config.vocab_size, check)
        B, T = tokens.shape
        if segment_ids is not None:
            segment_ids = check_segment_ids("segment_ids", segment_ids, (B, T), "[B, T]", f"tokens {tokens.shape}")
        if positions is None:
            # A packed row fits the table as a whole, as under `jit` its documents' lengths are unknown.
            check_length(T, self.wpe.max_positions, self.config)
            positions = jnp.arange(T) if segment_ids is None else segment_positions(segment_ids)  # [T] or [B, T]
        if padding_mask is not None and (padding_mask.shape != (B, T) or padding_mask.dtype != jnp.bool_):
            raise ValueError(f"padding_mask must be bool [B, T] = {(B, T)}, got "
                             f"{padding_mask.dtype} {padding_mask.shape}")
        x = nn.with_logical_constraint(self.embed(tokens, positions, deterministic=deterministic), RESIDUAL_AXES)
        values = self.embed_values(tokens)
        for unit in self._units():
            if unit == SCANNED:
                shared = (positions, padding_mask, deterministic, segment_ids)
                x, _ = self.layers(x, shared, self._scanned_values(values))
            else:
                x = self.blocks[unit](x, positions=positions, padding_mask=padding_mask, deterministic=deterministic,
                                      value_embedding=values[unit], segment_ids=segment_ids)
            x = nn.with_logical_constraint(x, RESIDUAL_AXES)
        return x

    def _units(self) -> list:
        """The layers in order: an unrolled layer's index, or `SCANNED` for the scanned periods."""
        plan = plan_layers(self.config)
        return [*plan.prefix, *([SCANNED] if plan.repeats else []), *plan.suffix]

    def _scanned_values(self, values: list) -> tuple:
        """Per block of the period, its value embeddings stacked over the repeats `[R, B, T, K, H]` (or None)."""
        plan = plan_layers(self.config)
        return tuple(None if values[plan.layer(0, j)] is None else
                     jnp.stack([values[plan.layer(r, j)] for r in range(plan.repeats)]) for j in range(plan.period))

    # -- cached extension ------------------------------------------------------------------

    def extend(self, tokens, cache: DecodeCache, *, num_new=None, check=False):
        """Appends tokens to the cache: prefill (T > 1, right-padded) or decode (T = 1).

        Args:
          tokens: `[B, T]`; token t of row b is placed at absolute position
            `cache.lengths[b] + t` and attends causally to everything before it.
          cache: `DecodeCache` from `init_cache`, with `lengths[b] + T <= max_len`.
          num_new: `[B]` int, how many of row b's T tokens are real (default T);
            the rest are padding, written to slots that later tokens overwrite
            and that no real query sees.

        Returns:
          `(logits [B, T, V] float32, new_cache)`, `new_cache.lengths = lengths + num_new`.

        Preconditions: `lengths[b] + T <= max_len` (past it the write would be
        clamped and the logits wrong), `0 <= num_new[b] <= T`, token ids in
        `[0, vocab_size)`. They raise a ValueError here when the values are known
        (outside `jit`). Under `jit` they cannot be checked for free: pass
        `check=True` inside `jax.experimental.checkify.checkify` (as
        `jaxattn.decoding.checked_extend` does) to have them checked on the device.
        """
        check_tokens(tokens)
        check_cache(tokens, cache, self.config)
        check_token_range(tokens, self.config.vocab_size, check)
        B, T = tokens.shape
        num_new = jnp.full((B,), T, jnp.int32) if num_new is None else jnp.asarray(num_new, jnp.int32)
        if num_new.shape != (B,):
            raise ValueError(f"num_new must be [B] = {(B,)}, got {num_new.shape}")
        check_capacity(T, cache, num_new, check)
        starts = cache.lengths
        positions = starts[:, None] + jnp.arange(T)[None, :]  # [B, T] absolute
        x = self.embed(tokens, positions)
        values, period = self.embed_values(tokens), plan_layers(self.config).period
        caches, layers = list(cache.layers), []  # one cache per unrolled layer, P stacked ones for the scan
        for unit in self._units():
            if unit == SCANNED:
                x, updated = self.layers.extend(x, positions, (tuple(caches[:period]), self._scanned_values(values)))
                del caches[:period]
                layers.extend(updated)
            else:
                x, layer_cache = self.blocks[unit].extend(x, caches.pop(0), positions, value_embedding=values[unit])
                layers.append(layer_cache)
        return self.logits(x), DecodeCache(layers=tuple(layers), lengths=starts + num_new, num_slots=cache.num_slots)

    def extend_paged(self, tokens, pools: tuple, batch: PagedBatch):
        """One step of a paged cache: the new tokens of many sequences at once, flat.

        Args:
          tokens: `[Tf]` int ids (`batch` says where each belongs; padding tokens are any id).
          pools: tuple over layers of each layer's page pool (`jaxattn.cache.build.init_pools`).
          batch: positions, cache slots, rows of queries and the tokens to read logits at.

        Returns:
          `(logits [M, V] float32 at batch.logit_tokens, new pools)`: the head runs only where a token
          is drawn. Deterministic; token ids are not checked (the engine checks them on admission).
        """
        hidden, new_pools = self.paged_hidden(tokens, pools, batch)
        return self.logits(hidden[None, batch.logit_tokens])[0], new_pools

    def paged_hidden(self, tokens, pools: tuple, batch: PagedBatch):
        """`extend_paged` without the head: `(hidden states [Tf, D] before the final norm, new pools)`, for
        a caller that runs `logits` on more tokens than `batch.logit_tokens` (prompt log-probabilities)."""
        check_paged(tokens, pools, batch, self.config)
        tokens = tokens[None, :]  # [1, Tf]: one row of flat tokens; only attention looks at rows
        x = self.embed(tokens, batch.positions[None, :])
        new_pools = []
        for block, pool, value_embedding in zip(self.blocks.values(), pools, self.embed_values(tokens)):
            x, pool = block.extend_paged(x, pool, batch, value_embedding=value_embedding)
            new_pools.append(pool)
        return x[0], tuple(new_pools)


@functools.lru_cache(maxsize=64)
def abstract_params(config: ModelConfig):
    """`DecoderLM(config)`'s "params" tree without allocating it: each leaf an
    `nn.LogicallyPartitioned` box (its logical axis names) around a `jax.ShapeDtypeStruct`;
    `nn.unbox` gives the bare shapes. Traces `init` once per config (cached; the tree is immutable)."""
    init = lambda: DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))  # noqa: E731
    return jax.eval_shape(init)["params"]


def attention_weights(model: nn.Module, variables, tokens, **kwargs):
    """`(logits, weights)`: `model.apply(variables, tokens, **kwargs)` with every attention layer's
    weights, a tuple in layer order of `[B, N, T, S]` float32 (docs/theory.md §14).

    The layers sow them into the "intermediates" collection, made mutable here (any
    "intermediates" in `variables` are ignored); a model without them gives `()`.
    """
    variables = {name: value for name, value in variables.items() if name != WEIGHTS[0]}
    logits, state = model.apply(variables, tokens, mutable=[WEIGHTS[0]], **kwargs)
    sown = flatten_dict(state.get(WEIGHTS[0], {}))
    if getattr(model, "config", None) is not None and SCANNED in state.get(WEIGHTS[0], {}):
        sown = _unscanned(sown, plan_layers(model.config))

    def layer_order(path):
        found = [int(m.group(1)) for part in path for m in [re.fullmatch(r"\w*?_(\d+)", str(part))] if m]
        return found, path

    paths = sorted((p for p in sown if p[-1] == WEIGHTS[1]), key=layer_order)
    return logits, tuple(w for p in paths for w in sown[p])


def _unscanned(sown: dict, plan) -> dict:
    """Sown values of the scanned layers (`layers/blocks_j/...`, each `[R, ...]`) as `blocks_i/...` per layer."""
    out = {}
    for path, values in sown.items():
        if path[0] != SCANNED:
            out[path] = values
            continue
        j = int(path[1].rpartition("_")[2])
        for r in range(plan.repeats):
            out[(f"blocks_{plan.layer(r, j)}", *path[2:])] = jax.tree.map(lambda value: value[r], values)
    return out


def count_params(params) -> int:
    """Total number of parameters (numbers) in a parameter pytree."""
    return sum(int(x.size) for x in jax.tree_util.tree_leaves(params))


def active_params(config: ModelConfig) -> int:
    """How many of `DecoderLM(config)`'s parameters touch one token: all but those of the routed
    experts it is not sent to (`ModelConfig.idle_expert_params`; every parameter of a dense model)."""
    return count_params(nn.unbox(abstract_params(config))) - config.idle_expert_params
