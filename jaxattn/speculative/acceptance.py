"""Which drafted tokens the target model keeps, and the token that follows them: pure, jittable maths.

Shapes: B rows, k drafted tokens per row, V the vocabulary. The target model has scored the row's
last committed token followed by its k drafts in one forward pass, so `target_logits[b, i]` is the
target's next-token distribution after draft i (i = 0: after the committed token alone) and
`target_logits[b, k]` the one after all k. A row may propose fewer than k tokens (`num_proposed[b]`,
0 included); its drafts past that are ignored.

Two rules, each returning `(accepted [B] int32, next_token [B] int32)`: the row keeps its first
`accepted` drafts and then emits `next_token`, so every step emits `accepted + 1` tokens:

* `greedy_accept`: drafts are kept while they equal the target's argmax; `next_token` is the argmax
  after the kept run. The output is exactly greedy decoding's.
* `rejection_accept` (Leviathan et al. 2023; Chen et al. 2023): draft i, drawn from `q_i`, is kept
  with probability `min(1, p_i(d) / q_i(d))`; at the first rejection `next_token` is drawn from the
  normalised `max(0, p_i - q_i)`; when all are kept it is drawn from `p` after the last draft (the
  bonus token). Each emitted token is then distributed as a plain draw from `p` would be.

`p` is the distribution `jaxattn.sampling.sample` draws from: temperature, then top-k, then top-p
(`target_probs`), softmaxed in float32. A proposer that drafts deterministically (prompt lookup,
greedy drafting) has a point mass for `q` (`point_mass`).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxattn import sampling


def proposed_mask(num_proposed, k: int) -> jax.Array:
    """`[B, k]` bool: True for the drafts a row proposed (`i < num_proposed[b]`)."""
    return jnp.arange(k)[None, :] < jnp.asarray(num_proposed, jnp.int32)[:, None]


def leading_true(keep) -> jax.Array:
    """`[B, k]` bool -> `[B]` int32: the length of each row's leading run of True."""
    return jnp.sum(jnp.cumprod(keep.astype(jnp.int32), axis=-1), axis=-1).astype(jnp.int32)


def _at(values, index) -> jax.Array:
    """`values [B, T, ...]` at `index [B]` along T -> `[B, ...]`."""
    return values[jnp.arange(values.shape[0]), index]


def greedy_accept(target_logits, draft_tokens, num_proposed) -> tuple[jax.Array, jax.Array]:
    """Exact-match verification.

    Args:
      target_logits: `[B, k+1, V]` the target's logits after the committed token and after each draft.
      draft_tokens: `[B, k]` int drafted ids.
      num_proposed: `[B]` int in `[0, k]`, the drafts each row proposed.

    Returns:
      `(accepted [B], next_token [B])`: the leading drafts equal to the target's argmax, and the
      argmax after them (lowest id on ties, as `jaxattn.sampling.greedy`).
    """
    k = draft_tokens.shape[1]
    choices = jnp.argmax(target_logits, axis=-1).astype(jnp.int32)  # [B, k+1]
    keep = (choices[:, :k] == draft_tokens) & proposed_mask(num_proposed, k)
    accepted = leading_true(keep)
    return accepted, _at(choices, accepted)


def target_probs(target_logits, *, temperature=1.0, top_k=0, top_p=1.0) -> jax.Array:
    """`[B, T, V]` logits -> `[B, T, V]` float32 probabilities: what `jaxattn.sampling.sample` draws from
    at each position (temperature > 0; temperature, then top-k, then top-p; filtered tokens get 0)."""
    B, T, V = target_logits.shape
    flat = sampling.apply_temperature(target_logits.astype(jnp.float32).reshape(B * T, V), temperature)
    top_k, top_p = jnp.asarray(top_k, jnp.int32), jnp.asarray(top_p, jnp.float32)
    # As `sample`: the two argsorts of the filter only where top-k or top-p is on.
    flat = jax.lax.cond((top_k > 0) | (top_p < 1.0), lambda x: sampling.filter_logits(x, top_k=top_k, top_p=top_p),
                        lambda x: x, flat)
    return jax.nn.softmax(flat, axis=-1).reshape(B, T, V)


def point_mass(draft_tokens, vocab_size: int) -> jax.Array:
    """`[B, k]` ids -> `[B, k, V]` float32 one-hot: the draft distribution of a deterministic proposer."""
    return jax.nn.one_hot(draft_tokens, vocab_size, dtype=jnp.float32)


def _draw(key, probs) -> jax.Array:
    """`[B, V]` non-negative weights (not necessarily normalised) -> `[B]` int32 draws."""
    return jax.random.categorical(key, jnp.log(probs), axis=-1).astype(jnp.int32)


def rejection_accept(p, q, draft_tokens, num_proposed, key) -> tuple[jax.Array, jax.Array]:
    """Rejection-sampling verification: the emitted tokens are distributed as draws from `p`.

    Args:
      p: `[B, k+1, V]` the target's probabilities (`target_probs`).
      q: `[B, k, V]` the distributions the drafts were drawn from (`point_mass` for a deterministic draft).
      draft_tokens: `[B, k]` int drafted ids, draft i drawn from `q[:, i]`.
      num_proposed: `[B]` int in `[0, k]`, the drafts each row proposed.
      key: a PRNG key (the same key and inputs give the same result).

    Returns:
      `(accepted [B], next_token [B])`: drafts kept before the first rejection, and the token after
      them: from the normalised `max(0, p - q)` at a rejection, else (every proposed draft kept) from
      `p` at position `accepted` (the bonus token).
    """
    B, k = draft_tokens.shape
    p, q = p.astype(jnp.float32), q.astype(jnp.float32)
    accept_key, residual_key, bonus_key = jax.random.split(key, 3)
    p_draft = jnp.take_along_axis(p[:, :k], draft_tokens[..., None], axis=-1)[..., 0]  # [B, k]
    q_draft = jnp.take_along_axis(q, draft_tokens[..., None], axis=-1)[..., 0]
    u = jax.random.uniform(accept_key, (B, k))
    keep = (u * q_draft < p_draft) & proposed_mask(num_proposed, k)  # u < p/q without dividing by q
    accepted = leading_true(keep)
    p_next = _at(p, accepted)  # [B, V]
    rejected = accepted < jnp.asarray(num_proposed, jnp.int32)
    q_padded = jnp.concatenate([q, jnp.zeros((B, 1, p.shape[-1]), jnp.float32)], axis=1)  # [B, k+1, V]
    q_next = jnp.where(rejected[:, None], _at(q_padded, accepted), 0.0)
    residual = jnp.maximum(p_next - q_next, 0.0)
    # A rejection leaves residual mass (it happens only where p(d) < q(d)); if rounding left none, p itself.
    residual = jnp.where(jnp.sum(residual, axis=-1, keepdims=True) > 0, residual, p_next)
    drawn_residual, drawn_bonus = _draw(residual_key, residual), _draw(bonus_key, p_next)
    return accepted, jnp.where(rejected, drawn_residual, drawn_bonus)


def accept(target_logits, draft_tokens, num_proposed, key, *, draft_probs=None, temperature=1.0, top_k=0,
           top_p=1.0) -> tuple[jax.Array, jax.Array]:
    """Either rule, as the sampling knobs say: `greedy_accept` when `temperature == 0`, else
    `rejection_accept` against `target_probs(target_logits, ...)` (the knobs are traced scalars, so one
    compiled program serves both; `draft_probs` None: a point mass on each draft).

    Shapes as `greedy_accept`; `draft_probs` `[B, k, V]` as `rejection_accept`'s q.
    """
    V = target_logits.shape[-1]
    temperature = jnp.asarray(temperature, jnp.float32)

    def sampled(logits):
        p = target_probs(logits, temperature=temperature, top_k=top_k, top_p=top_p)
        q = point_mass(draft_tokens, V) if draft_probs is None else draft_probs
        return rejection_accept(p, q, draft_tokens, num_proposed, key)

    def greedy(logits):
        return greedy_accept(logits, draft_tokens, num_proposed)

    return jax.lax.cond(temperature > 0, sampled, greedy, target_logits.astype(jnp.float32))
