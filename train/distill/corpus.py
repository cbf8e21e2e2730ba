"""What a draft model learns from: the target's own replies and text, with the target's next-token scores.

* `replies`: the target's greedy replies to chat requests (`train.distill.prompts`), generated in
  batches with `jaxattn.generate` (prompts sorted by length, padded to a multiple of `PROMPT_BUCKET` so that
  a few programs compile), each cut after its end-of-turn token;
* `text_windows`: windows of `seq_len` tokens of plain text (Tiny Shakespeare by default);
* `rows`: those sequences as right-padded `[N, seq_len]` rows, a sequence longer than a row keeping its
  last `seq_len` tokens (the reply, and the end of its prompt);
* `teacher_targets`: the target's `k` highest logits and their ids at every position of every row, in
  batches: what the draft's distribution is fitted to (`train.distill.fit`).

A row's `start` is its first position whose next token is the reply's (the prompt's last token); 0 for
plain text. Draft top-1 agreement is measured from there on: the positions where, at decoding time,
a draft model proposes.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn as ja
from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM

PROMPT_BUCKET = 64  # prompts padded to a multiple of this many tokens: one `generate` program per bucket


@dataclass(frozen=True)
class Rows:
    """Right-padded rows of token ids with the target's scores.

    Attributes:
      tokens: `[N, T]` int32 ids, 0 past `lengths`.
      lengths: `[N]` int32 real tokens per row.
      starts: `[N]` int32 first position whose next token is a reply's (0 for plain text).
      top_ids, top_logits: `[N, T, K]` the target's K highest logits at each position and their ids (None
        before `teacher_targets`).
    """

    tokens: np.ndarray
    lengths: np.ndarray
    starts: np.ndarray
    top_ids: np.ndarray | None = None
    top_logits: np.ndarray | None = None

    def __len__(self) -> int:
        return len(self.tokens)

    def take(self, index) -> "Rows":
        """The rows at `index` (an index array or a slice)."""
        pick = (lambda a: None if a is None else a[index])
        return Rows(*(pick(a) for a in (self.tokens, self.lengths, self.starts, self.top_ids, self.top_logits)))

    def masks(self) -> tuple[np.ndarray, np.ndarray]:
        """(`[N, T]` float32 1 at every real position, 1 at every real position from `starts` on)."""
        positions = np.arange(self.tokens.shape[1])[None]
        real = positions < self.lengths[:, None]
        return real.astype(np.float32), (real & (positions >= self.starts[:, None])).astype(np.float32)


def replies(params, config: ModelConfig, prompts: Sequence[np.ndarray], *, max_new_tokens: int, batch: int,
            stop_token: int | None, progress: Callable[[int], None] = lambda n: None) -> list[np.ndarray]:
    """The target's greedy reply to each prompt (`[n]` ids, cut after `stop_token`), in the prompts' order;
    `progress(rows)` after each batch."""
    order = np.argsort([len(p) for p in prompts], kind="stable")
    out: list[np.ndarray] = [np.zeros((0,), np.int32)] * len(prompts)
    for low in range(0, len(order), batch):
        chunk = order[low:low + batch]
        width = -(-max(len(prompts[i]) for i in chunk) // PROMPT_BUCKET) * PROMPT_BUCKET
        ids = np.zeros((batch, width), np.int32)  # a short last batch is padded with copies of its first row
        lengths = np.zeros((batch,), np.int32)
        for row in range(batch):
            prompt = prompts[chunk[min(row, len(chunk) - 1)]]
            ids[row, :len(prompt)], lengths[row] = prompt, len(prompt)
        made = ja.generate(params, config, ids, lengths, max_new_tokens=max_new_tokens, rng=jax.random.PRNGKey(0),
                           temperature=0.0, stop_token=stop_token)
        tokens, counts = np.asarray(made.tokens), np.asarray(made.counts)
        for row, i in enumerate(chunk):
            out[i] = tokens[row, :counts[row]].astype(np.int32)
        progress(len(chunk))
    return out


def text_windows(text: str, encode: Callable[[str], Sequence[int]], n: int, seq_len: int,
                 rng: np.random.Generator) -> list[np.ndarray]:
    """n windows of `seq_len` tokens (fewer where the text is short) of `text`, each from a random offset."""
    chars = seq_len * 8  # more characters than a window of tokens takes, for any tokenizer of a byte or more
    windows = []
    for _ in range(n):
        start = int(rng.integers(0, max(len(text) - chars, 1)))
        ids = np.asarray(encode(text[start:start + chars]), np.int32)[:seq_len]
        if len(ids) >= 2:
            windows.append(ids)
    return windows


def rows(sequences: Sequence[np.ndarray], starts: Sequence[int], seq_len: int) -> Rows:
    """`sequences` as right-padded rows of `seq_len` (a longer one keeps its last `seq_len` tokens), with
    each one's `starts` moved by what was cut from its front (0 at least)."""
    tokens = np.zeros((len(sequences), seq_len), np.int32)
    lengths, moved = np.zeros((len(sequences),), np.int32), np.zeros((len(sequences),), np.int32)
    for i, (seq, start) in enumerate(zip(sequences, starts)):
        cut = max(len(seq) - seq_len, 0)
        kept = seq[cut:]
        tokens[i, :len(kept)], lengths[i], moved[i] = kept, len(kept), max(start - cut, 0)
    return Rows(tokens, lengths, moved)


@functools.partial(jax.jit, static_argnames=("config", "k"))
def _top_logits(params, tokens, *, config: ModelConfig, k: int):
    logits = DecoderLM(config, Kernels()).apply({"params": params}, tokens)
    values, ids = jax.lax.top_k(logits, k)
    return ids.astype(jnp.int32), values


def teacher_targets(params, config: ModelConfig, data: Rows, *, k: int, batch: int,
                    progress: Callable[[int], None] = lambda n: None) -> Rows:
    """`data` with the target's k highest logits and their ids at every position (float32, the reference
    kernels: the target's own numbers), computed `batch` rows at a time; `progress(rows)` after each."""
    ids, values = [], []
    for low in range(0, len(data), batch):
        chunk = data.tokens[low:low + batch]
        padded = np.concatenate([chunk, np.zeros((batch - len(chunk), chunk.shape[1]), np.int32)])
        top_ids, top_values = _top_logits(params, jnp.asarray(padded), config=config, k=k)
        ids.append(np.asarray(top_ids)[:len(chunk)])
        values.append(np.asarray(top_values)[:len(chunk)])
        progress(len(chunk))
    return Rows(data.tokens, data.lengths, data.starts, np.concatenate(ids), np.concatenate(values))


def concat(parts: Sequence[Rows]) -> Rows:
    """The rows of `parts`, one after another."""
    fields = ("tokens", "lengths", "starts", "top_ids", "top_logits")
    return Rows(*(None if getattr(parts[0], f) is None else np.concatenate([getattr(p, f) for p in parts])
                  for f in fields))
