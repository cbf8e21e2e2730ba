"""`python -m train.sample --speculative SPEC`: the samples drawn by `jaxattn.speculative_generate`.

    --speculative ngram                      prompt lookup (k = 4, n-grams of 1 to 3 tokens)
    --speculative ngram:k=4,n_min=1,n_max=3  with its settings; adaptive=0 keeps k fixed
    --speculative draft:DIR,k=4              a draft model from DIR: a training run, a transformers
                                             directory (it holds a tokenizer.json) or a .gguf file

SPEC is `jaxattn.speculative.parse_speculative`'s; a bad one is a usage error naming the bad part
(exit 2). The draft is loaded as `--checkpoint`, `--hf` or `--gguf` would load it
(`train.models.load.load_model`); it must have the target's vocabulary (exit 2 otherwise) and a
context that holds the target's rows. Speculative decoding runs within the model's context (no
windows past it, no mesh): the prompt and `--max-new-tokens` must fit in `max_seq_len`. The samples
are drawn `rows` at a time, each call with the key `train.decode.calls.call_keys` gives it; at
temperature 0 they are `generate`'s tokens. A sample ends at the tokenizer's end-of-sequence token.
stderr gets the time (compiling included) and the drafts' statistics: the acceptance rate, the drafts
kept per step and the acceptance at each draft position (`jaxattn.speculative.SpeculativeStats`). A
stop signal ends the run after the call in hand.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Callable

import jax.numpy as jnp
import numpy as np

from jaxattn import prepare_weights
from jaxattn.config import ModelConfig
from jaxattn.decoding import call_lengths
from jaxattn.speculative import SpeculativeOptions, SpeculativeStats, make_proposer, parse_speculative
from jaxattn.speculative import speculative_generate
from train.checkpoints.meta import CheckpointError
from train.cli import StopSignals, UsageError
from train.decode.calls import Draw, Sampled, call_keys
from train.models.load import load_model
from train.models.source import ModelSource

HELP = ("decode speculatively (jaxattn.speculative_generate): ngram, ngram:k=4,n_min=1,n_max=3 (prompt lookup), "
        "or draft:DIR,k=4 (a draft model of the same vocabulary: a run, a transformers directory or a .gguf "
        "file); adaptive=0 keeps k fixed; within the model's context, without --mesh")


def spec(text: str) -> SpeculativeOptions:
    """argparse's type for the flag: the options, or the parse error as argparse reports it (one line)."""
    try:
        return parse_speculative(text)
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def add_flag(parser: argparse.ArgumentParser, help: str = HELP) -> None:
    parser.add_argument("--speculative", metavar="SPEC", type=spec, help=help)


def check_flags(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """The usage errors of `--speculative` with flags it does not go with."""
    if args.speculative is None:
        return
    if args.mesh is not None:
        parser.error("--speculative does not go with --mesh: speculative decoding runs on one device")
    if getattr(args, "allow_nonfinite", False):
        parser.error("--speculative does not go with --allow-nonfinite: its loop does not check the logits")


def check_context(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> None:
    """UsageError unless the prompt and the new tokens fit in the model's context."""
    if prompt_len + max_new_tokens > config.max_seq_len:
        raise UsageError(f"--speculative decodes within the model's context, max_seq_len={config.max_seq_len}: the "
                         f"prompt's {prompt_len} tokens and --max-new-tokens {max_new_tokens} do not fit (at most "
                         f"{max(config.max_seq_len - prompt_len, 0)} new tokens; without --speculative, sampling "
                         "continues past the context in windows)")


def draft_source(path: str) -> ModelSource:
    """Where a draft comes from: a .gguf file, a transformers directory (with a tokenizer.json) or a run."""
    if path.endswith(".gguf"):
        return ModelSource(gguf=path)
    if (Path(path) / "tokenizer.json").is_file():
        return ModelSource(hf=path)
    return ModelSource(checkpoint=path)


def load_draft(options: SpeculativeOptions, config: ModelConfig, capacity: int, kernels) -> tuple:
    """`(params, config)` of the draft model; CheckpointError (exit 1) when it cannot be read, UsageError
    (exit 2) when its vocabulary is not the target's or its context is shorter than `capacity`."""
    try:
        loaded = load_model(draft_source(options.draft))
    except CheckpointError as err:
        raise CheckpointError(f"--speculative draft {options.draft}: {err}") from None
    loaded.print_notes()
    draft = loaded.config
    if draft.vocab_size != config.vocab_size:
        raise UsageError(f"--speculative draft {options.draft}: its vocabulary has {draft.vocab_size} tokens and the "
                         f"model's {config.vocab_size}: a draft must share the model's tokenizer")
    if draft.max_seq_len < capacity:
        raise UsageError(f"--speculative draft {options.draft}: its context, max_seq_len={draft.max_seq_len}, is "
                         f"shorter than the {capacity} tokens a row takes here (fewer --max-new-tokens, or a "
                         "shorter prompt)")
    return prepare_weights(loaded.params, kernels), draft


def stats_line(options: SpeculativeOptions, stats: SpeculativeStats) -> str:
    """What the drafts did, in one line."""
    positions = " ".join("-" if rate is None else f"{rate:.2f}" for rate in stats.acceptance_by_position())
    return (f"speculative: {options.describe()}: {stats.steps} verification steps, acceptance "
            f"{stats.acceptance_rate:.2f} ({stats.accepted} of {stats.proposed} drafts), "
            f"{stats.mean_accepted:.2f} drafts kept per step, by position {positions}; "
            f"drafting {stats.draft_seconds:.3f} s")


def merged(stats: list[SpeculativeStats]) -> SpeculativeStats:
    """The calls' statistics together."""
    total = SpeculativeStats.empty(len(stats[0].proposed_at))
    for one in stats:
        total.steps += one.steps
        total.proposed_at += one.proposed_at
        total.accepted_at += one.accepted_at
        total.draft_seconds += one.draft_seconds
        total.k_trace += one.k_trace
    return total


def sample(options: SpeculativeOptions, params, config: ModelConfig, prompt_ids: np.ndarray, draw: Draw, kernels,
           rows: int, *, eos: int | None = None, emit: Callable[[np.ndarray], None] = lambda ids: None) -> Sampled:
    """Draws the samples `rows` at a time with `speculative_generate`, each call's handed to `emit`
    (`[rows, max_new_tokens]` ids, `pad_token` 0 after a row's `eos`); the time and the statistics on stderr."""
    check_context(config, len(prompt_ids), draw.max_new_tokens)
    capacity = min(call_lengths(config, len(prompt_ids), draw.max_new_tokens)[0] + draw.max_new_tokens + options.k,
                   config.max_seq_len)
    draft = load_draft(options, config, capacity, kernels) if options.method == "draft" else None
    proposer = make_proposer(options, draft, kernels=kernels)
    keys, complete, tokens, stats = call_keys(draw.seed, -(-draw.num_samples // rows)), 0, 0, []
    start = time.perf_counter()
    with StopSignals() as signals:
        for i, key in enumerate(keys):
            if i and signals.requested:
                break
            batch = min(rows, draw.num_samples - i * rows)
            out = speculative_generate(params, config, np.tile(prompt_ids, (batch, 1)),
                                       max_new_tokens=draw.max_new_tokens, rng=jnp.asarray(key), proposer=proposer,
                                       temperature=draw.temperature, top_k=draw.top_k, top_p=draw.top_p,
                                       stop_token=eos, kernels=kernels, kv_cache=draw.kv_cache,
                                       adaptive=options.adaptive)
            emit(out.tokens)
            complete, tokens, stats = complete + batch, tokens + int(out.counts.sum()), stats + [out.stats]
    seconds = time.perf_counter() - start
    print(f"decode: {tokens} tokens ({complete} x up to {draw.max_new_tokens}) in {seconds:.3f} s = "
          f"{tokens / seconds:,.0f} tokens/s, compiling included", file=sys.stderr)
    print(stats_line(options, merged(stats)), file=sys.stderr)
    return Sampled(complete, stopped=signals.requested if complete < draw.num_samples else None)
