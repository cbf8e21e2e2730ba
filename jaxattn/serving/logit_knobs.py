"""The logit knobs beyond temperature, top-k and top-p: logit bias, the three penalties and min-p, on
the device, per drawn row; and each row's knobs written into a step's host arrays.

The order is vLLM's sampler's: the bias and the penalties change the raw logits (so greedy rows feel
them too), then the temperature divides them, then min-p, top-k and top-p filter (`jaxattn.serving.step.draw`
calls them in that order, each under `jax.lax.cond` on "some row asks", so steps without them run
none of it).

**The penalties' token history.** A penalty needs, per row, the count of each token among the tokens
drawn so far (presence, frequency) and which tokens the prompt or the draws hold (repetition). The
engine keeps one int32 per slot of the KV-cache pool, `history [num_pages, page_size]`, written by every
step at the slots its tokens' keys and values are written to (the same `PagedBatch.slots`, dropped
padding included). A row's tokens are then `history[block_table]`, read through the block table the
step already has: `[M, pages_per_seq * page_size]`, the first `position` of them the sequence so far.
Why this layout: it adds no per-step host array of the rows' tokens (a padded `[M, max_model_len]`
copied every step would be paid by every step, penalised or not); the write is one scatter of the
step's tokens, small beside the KV writes; pages shared by the prefix cache hold their tokens as they
hold their keys. The counts `[M, V]` are built from it by one scatter-add, only when a row asks. An
engine that gives back pages behind a sliding window loses their tokens, so it refuses penalties
(`jaxattn.serving.validation`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.serving.validation import MAX_LOGIT_BIAS


def apply_logit_bias(logits: jax.Array, bias_ids: jax.Array, bias_values: jax.Array) -> jax.Array:
    """`[M, V]` logits plus each row's bias: `bias_ids`, `bias_values` `[M, B]` (padding: `NO_TOKEN`, dropped)."""
    rows = jnp.arange(logits.shape[0])[:, None]
    return logits.at[rows, bias_ids].add(bias_values, mode="drop")


def sequence_tokens(history: jax.Array, block_table: jax.Array) -> jax.Array:
    """`[M, pages_per_seq * page_size]` int32: each row's tokens by position, read through its block table."""
    return history[block_table].reshape(block_table.shape[0], -1)


def apply_penalties(logits: jax.Array, tokens: jax.Array, position: jax.Array, prompt_len: jax.Array,
                    presence: jax.Array, frequency: jax.Array, repetition: jax.Array) -> jax.Array:
    """`[M, V]` logits penalised per row.

    Args:
      tokens: `[M, L]` each row's tokens by position (`sequence_tokens`); those at `>= position` are not
        the sequence's yet.
      position: `[M]` the drawn token's position: the sequence so far is `tokens[:, :position]`.
      prompt_len: `[M]` the prompt's tokens; the ones after it were drawn.
      presence, frequency: `[M]` OpenAI's: `logits[j] -= c[j] * frequency + (c[j] > 0) * presence`, `c[j]`
        the count of token j among the drawn tokens.
      repetition: `[M]` transformers': a token of the prompt or the draws has a positive logit divided by
        it, a negative one multiplied (1 = off). Applied first, as vLLM does.
    """
    M, V = logits.shape
    index = jnp.arange(tokens.shape[1])[None, :]
    seen = index < position[:, None]
    drawn = seen & (index >= prompt_len[:, None])
    rows = jnp.arange(M)[:, None]
    counts = jnp.zeros((M, V), jnp.float32).at[rows, tokens].add(drawn.astype(jnp.float32), mode="drop")
    in_sequence = jnp.zeros((M, V), jnp.bool_).at[rows, tokens].max(seen, mode="drop")
    r = repetition[:, None]
    logits = jnp.where(in_sequence, jnp.where(logits > 0, logits / r, logits * r), logits)
    return logits - counts * frequency[:, None] - (counts > 0) * presence[:, None]


def apply_min_p(logits: jax.Array, min_p: jax.Array) -> jax.Array:
    """`[M, V]` logits (after the temperature) with every token of probability `< min_p * max probability`
    set to -inf (0 = off; the most likely token always stays)."""
    probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
    keep = probs >= min_p[:, None] * jnp.max(probs, axis=-1, keepdims=True)
    return jnp.where(keep, logits, -jnp.inf)


# -- the host side: a row's knobs into the step's arrays -----------------------------------------------

NO_TOKEN = np.iinfo(np.int32).max  # a bias entry that is padding: past any vocabulary, dropped by the scatter


def empty_knobs(M: int) -> dict:
    """The host arrays of rows that ask for none of these knobs."""
    return dict(presence=np.zeros(M, np.float32), frequency=np.zeros(M, np.float32),
                repetition=np.ones(M, np.float32), min_p=np.zeros(M, np.float32),
                prompt_len=np.zeros(M, np.int32),
                bias_ids=np.full((M, MAX_LOGIT_BIAS), NO_TOKEN, np.int32),
                bias_values=np.zeros((M, MAX_LOGIT_BIAS), np.float32))


def fill_logit_knobs(knobs, draws: list[int], requests: list) -> None:
    """Writes each request's bias, penalties and min_p into its row `draws[i]` of the step's knobs
    (`jaxattn.serving.step.DrawKnobs`): one array write per knob for all rows (the bias row by row)."""
    samplings = [request.sampling for request in requests]
    knobs.presence[draws] = [sampling.presence_penalty for sampling in samplings]
    knobs.frequency[draws] = [sampling.frequency_penalty for sampling in samplings]
    knobs.repetition[draws] = [sampling.repetition_penalty for sampling in samplings]
    knobs.min_p[draws] = [sampling.min_p for sampling in samplings]
    knobs.prompt_len[draws] = [len(request.prompt_ids) for request in requests]
    for draw, sampling in zip(draws, samplings):
        if sampling.logit_bias:
            ids, values = zip(*sampling.logit_bias)
            knobs.bias_ids[draw, :len(ids)], knobs.bias_values[draw, :len(ids)] = ids, values


def fill_draw_knobs(knobs, draws: list[int], requests: list) -> None:
    """Writes request i's every knob into row `draws[i]` of a step's `DrawKnobs`: temperature, top-k, top-p,
    seed, the drawn token's position (the request's next) and `fill_logit_knobs`'."""
    knobs.temperature[draws] = [request.sampling.temperature for request in requests]
    knobs.top_k[draws] = [request.sampling.top_k for request in requests]
    knobs.top_p[draws] = [request.sampling.top_p for request in requests]
    knobs.seed[draws] = [request.seed for request in requests]
    knobs.position[draws] = [request.num_tokens for request in requests]
    fill_logit_knobs(knobs, draws, requests)
