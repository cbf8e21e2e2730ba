"""Draw a trained model's attention: `python -m train.attention_maps --checkpoint DIR --text "..." --out maps.png`.

    python -m train.attention_maps --checkpoint runs/shakespeare_char_baby --out maps.png
    python -m train.attention_maps --hf exports/baby --text "ROMEO:" --out maps.png   # a transformers directory

One heatmap per layer (rows) and head (columns): row t of a map is how query character t
distributes its attention over key characters 0..t (causal, so the upper triangle is empty).
"""

from __future__ import annotations

import argparse
import functools
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

import jaxattn
from jaxattn.model import DecoderLM
from train import outputs
from train.checkpoint import CheckpointError, load_for_sampling
from train.cli import ArgumentParser, UsageError, guard
from train.export import load_hf
from train.plots import plot_attention_maps


def attention_weights(params, model_config, token_ids: np.ndarray) -> np.ndarray:
    """Weights of every layer and head for one sequence: [L, N, T, T] float32 (docs/theory.md §14)."""
    apply = jax.jit(functools.partial(jaxattn.attention_weights, DecoderLM(model_config)))  # one compile
    _, weights = apply({"params": params}, jnp.asarray(token_ids)[None])
    return np.stack([np.asarray(w[0], np.float32) for w in weights])  # [L, N, T, T]


PROGRAM = "python -m train.attention_maps"


def load(args: argparse.Namespace):
    """(params, model config, tokenizer) of `--hf` or `--checkpoint`; CheckpointError (one line) if unreadable."""
    if args.hf is not None:
        return load_hf(args.hf, allow_nonfinite=args.allow_nonfinite)
    return load_for_sampling(args.checkpoint)


def token_ids(tokenizer, text: str, max_seq_len: int):
    """The ids of `text`, at most `max_seq_len` of them (with a note when cut); UsageError if it has none."""
    if not text:
        raise UsageError("--text must not be empty")
    try:
        ids = tokenizer.encode(text)
    except ValueError as err:  # unknown characters (both tokenizer kinds raise ValueError)
        raise UsageError(f"--text cannot be encoded: {err}") from err
    if len(ids) > max_seq_len:
        print(f"--text has {len(ids)} tokens; keeping the first {max_seq_len} (max_seq_len)")
    return ids[:max_seq_len]


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a run's out_dir (or its checkpoints/best)")
    source.add_argument("--hf", metavar="DIR", help="a transformers directory with a tokenizer.json")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="with --hf: load weights holding NaN or infinity (refused otherwise)")
    parser.add_argument("--text", default="ROMEO:\nBut soft, what light", help="the characters to look at")
    parser.add_argument("--out", default="maps.png")
    args = parser.parse_args(argv)
    if args.allow_nonfinite and args.hf is None:
        parser.error("--allow-nonfinite goes with --hf")
    return args


def run(argv: list[str] | None) -> Path:
    """Checks --out, loads the model, draws the maps; returns their path."""
    args = parse_args(argv)
    outputs.check_image_file(args.out, "--out")  # before any work: the type, and that it can be written
    params, model_config, tokenizer = load(args)
    ids = token_ids(tokenizer, args.text, model_config.max_seq_len)
    weights = attention_weights(params, model_config, ids)
    chars = [tokenizer.decode([i]) for i in ids]
    kind = "MLA" if model_config.mla else f"{model_config.num_heads}q/{model_config.num_kv_heads}kv heads"
    plot_attention_maps(weights, chars, Path(args.out),
                        title=f"attention weights ({kind}, {model_config.positions} positions) "
                              f"from {args.checkpoint if args.hf is None else args.hf}")
    print(f"wrote {args.out}")
    return Path(args.out)


def main(argv: list[str] | None = None) -> Path:
    """Writes the maps and returns their path; one line and exit 2 (usage), 1 (an unreadable
    checkpoint, an unwritable --out) or 130 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError,))


if __name__ == "__main__":
    main()
