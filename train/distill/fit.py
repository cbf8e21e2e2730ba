"""Fitting a draft model's next-token distribution to its target's (`fit`), and the agreement it reaches.

The loss is the cross-entropy of the draft's softmax against the target's, the target's kept to its K
highest logits (`train.distill.corpus.teacher_targets`) and renormalised over them: the KL divergence to
that truncated distribution, less its entropy. The target's top-1 carries most of the weight, and the
runners-up what the draft should rank next. It is taken where a draft model proposes (a reply's
positions; every position of plain text), at `positions` of them a row drawn afresh each step: the
blocks run over the whole row, the head (most of a step's work, with its vocabulary-wide softmax) only
at the drawn positions.

Trained: the blocks and the final norm, with optax's AdamW. Frozen: the embedding, which is the head
too in a tied model: the draft is to write what the target's head reads, and the table is most of the
draft's parameters, so freezing it saves its gradient and its optimizer state.

The learning rate warms up over `WARMUP` steps, then falls along a half cosine to a tenth of its peak
as the time budget (or the step limit, whichever is nearer) is spent. Every `eval_every` steps,
and at the end, a line reports the step, the minutes, the mean loss since the last line and the
draft's top-1 agreement with the target's on held-out rows (`agreement`: reply positions only).
"""

from __future__ import annotations

import functools
import math
import time
from dataclasses import dataclass, field
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxattn.config import ModelConfig
from jaxattn.kernels import Kernels
from jaxattn.model import DecoderLM
from train.distill.corpus import Rows

WARMUP = 10
FROZEN = ("wte",)  # the embedding (and tied head): see the module docstring


@dataclass(frozen=True)
class FitSettings:
    """How long and how fast: `minutes` of training (compilation included), at most `steps` steps (None: no
    limit), `batch` rows a step and the loss at `positions` of each, AdamW at `lr` with `weight_decay`, a
    line every `eval_every` steps."""

    minutes: float
    batch: int = 8
    positions: int = 64
    lr: float = 1e-3
    weight_decay: float = 0.01
    steps: int | None = None
    eval_every: int = 20
    seed: int = 0


@dataclass
class FitReport:
    """What `fit` did: the steps, the seconds, agreement before and after, and each reported line's numbers."""

    steps: int = 0
    seconds: float = 0.0
    agreement_before: float = 0.0
    agreement_after: float = 0.0
    lines: list[dict] = field(default_factory=list)


def split(params) -> tuple[dict, dict]:
    """(trained, frozen) parameters: `FROZEN` frozen, the rest trained."""
    return ({k: v for k, v in params.items() if k not in FROZEN}, {k: v for k, v in params.items() if k in FROZEN})


def batch_arrays(data: Rows, positions: int, rng: np.random.Generator) -> tuple:
    """The arrays one step reads of `data`: tokens `[B, T]`, and at `positions` drawn positions a row
    (without repeats; fewer in a shorter row, the rest weighted 0) their indices, weights and the target's
    top ids and logits `[B, P, K]`."""
    _, reply = data.masks()
    picks, weights = np.zeros((len(data), positions), np.int32), np.zeros((len(data), positions), np.float32)
    for i, row in enumerate(reply):
        where = np.flatnonzero(row)
        chosen = np.sort(rng.choice(where, size=min(positions, len(where)), replace=False))
        picks[i, :len(chosen)], weights[i, :len(chosen)] = chosen, 1.0
    gather = (lambda a: np.take_along_axis(a, picks[..., None], axis=1))
    return tuple(jnp.asarray(a) for a in (data.tokens, picks, weights, gather(data.top_ids),
                                          gather(data.top_logits)))


def distill_loss(trained, frozen, tokens, picks, weights, top_ids, top_logits, *, config: ModelConfig,
                 kernels: Kernels):
    """The weighted mean over the picked positions of the cross-entropy of the draft's softmax against the
    target's top-K renormalised (see the module docstring)."""
    model, variables = DecoderLM(config, kernels), {"params": {**frozen, **trained}}
    hidden = model.apply(variables, tokens, method=DecoderLM.hidden)  # [B, T, D]
    picked = jnp.take_along_axis(hidden, picks[..., None], axis=1)  # [B, P, D]
    log_q = jax.nn.log_softmax(model.apply(variables, picked, method=DecoderLM.logits), axis=-1)
    per_position = -(jax.nn.softmax(top_logits, axis=-1) * jnp.take_along_axis(log_q, top_ids, axis=-1)).sum(-1)
    return (per_position * weights).sum() / jnp.maximum(weights.sum(), 1.0)


def make_step(config: ModelConfig, kernels: Kernels, optimizer: optax.GradientTransformation):
    """A jitted `step(trained, frozen, opt_state, lr, *batch_arrays) -> (trained, opt_state, loss)`."""
    loss_and_grad = jax.value_and_grad(functools.partial(distill_loss, config=config, kernels=kernels))

    @jax.jit
    def step(trained, frozen, opt_state, lr, *batch):
        loss, grads = loss_and_grad(trained, frozen, *batch)
        opt_state.hyperparams["learning_rate"] = lr
        updates, opt_state = optimizer.update(grads, opt_state, trained)
        return optax.apply_updates(trained, updates), opt_state, loss

    return step


@functools.partial(jax.jit, static_argnames=("config",))
def _top1(params, tokens, *, config: ModelConfig):
    return jnp.argmax(DecoderLM(config, Kernels()).apply({"params": params}, tokens), axis=-1)


def agreement(params, config: ModelConfig, held_out: Rows, batch: int) -> float:
    """The share of the held-out rows' reply positions where the draft's argmax is the target's (float32,
    the reference kernels, as the draft decodes)."""
    agree = total = 0.0
    _, reply = held_out.masks()
    for low in range(0, len(held_out), batch):
        chunk = held_out.take(slice(low, low + batch))
        mask = reply[low:low + batch]
        padded = np.concatenate([chunk.tokens, np.zeros((batch - len(chunk), chunk.tokens.shape[1]), np.int32)])
        top1 = np.asarray(_top1(params, jnp.asarray(padded), config=config))[:len(chunk)]
        agree += float(((top1 == chunk.top_ids[..., 0]) * mask).sum())
        total += float(mask.sum())
    return agree / max(total, 1.0)


def learning_rate(settings: FitSettings, step: int, elapsed: float) -> float:
    """The peak after `WARMUP` steps of warm-up, then a half cosine down to a tenth of it, by the share
    of the budget (time or steps) spent."""
    if step < WARMUP:
        return settings.lr * (step + 1) / WARMUP
    spent = elapsed / (settings.minutes * 60.0)
    if settings.steps is not None:
        spent = max(spent, step / settings.steps)
    return settings.lr * (0.1 + 0.45 * (1.0 + math.cos(math.pi * min(spent, 1.0))))


def fit(params, config: ModelConfig, train: Rows, held_out: Rows, settings: FitSettings, *, kernels: Kernels,
        say: Callable[[str], None] = print) -> tuple[dict, FitReport]:
    """The draft's parameters after training on `train` for the settings' budget, and what happened."""
    trained, frozen = split(params)
    optimizer = optax.inject_hyperparams(optax.adamw)(learning_rate=settings.lr,
                                                      weight_decay=settings.weight_decay)
    opt_state = optimizer.init(trained)
    step_fn = make_step(config, kernels, optimizer)
    report = FitReport(agreement_before=agreement(params, config, held_out, settings.batch))
    say(f"step 0: held-out top-1 agreement {report.agreement_before:.3f} (the cut, before training)")
    rng, losses, start = np.random.default_rng(settings.seed), [], time.perf_counter()
    order, at = rng.permutation(len(train)), 0
    while (time.perf_counter() - start) < settings.minutes * 60 and report.steps != settings.steps:
        if at + settings.batch > len(order):
            order, at = rng.permutation(len(train)), 0
        picked = train.take(np.sort(order[at:at + settings.batch]))
        at += settings.batch
        lr = learning_rate(settings, report.steps, time.perf_counter() - start)
        trained, opt_state, loss = step_fn(trained, frozen, opt_state, jnp.float32(lr),
                                              *batch_arrays(picked, settings.positions, rng))
        losses.append(float(loss))
        report.steps += 1
        if report.steps % settings.eval_every == 0:
            _line(report, {**frozen, **trained}, config, held_out, settings, losses, start, lr, say)
            losses = []
    if losses or not report.lines:
        _line(report, {**frozen, **trained}, config, held_out, settings, losses, start, lr if report.steps else 0.0,
              say)
    report.seconds = time.perf_counter() - start
    report.agreement_after = report.lines[-1]["agreement"]
    return {**frozen, **trained}, report


def _line(report: FitReport, params, config, held_out: Rows, settings: FitSettings, losses: list[float],
          start: float, lr: float, say) -> None:
    """Measures the held-out agreement and reports a progress line."""
    line = {"step": report.steps, "minutes": (time.perf_counter() - start) / 60.0,
            "loss": float(np.mean(losses)) if losses else float("nan"), "lr": lr,
            "agreement": agreement(params, config, held_out, settings.batch)}
    report.lines.append(line)
    say(f"step {line['step']}: {line['minutes']:.1f} min, loss {line['loss']:.4f}, lr {lr:.2e}, "
        f"held-out top-1 agreement {line['agreement']:.3f}")
