"""Draw a trained model's attention: `python -m train.attention_maps --checkpoint DIR --text "..." --out maps.png`.

One heatmap per layer (rows) and head (columns): row t of a map is how query character t
distributes its attention over key characters 0..t (causal, so the upper triangle is empty).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from jaxattn.model import DecoderLM
from train.checkpoint import CheckpointError, load_for_sampling
from train.plots import can_write, image_types, plot_attention_maps


def attention_weights(params, model_config, token_ids: np.ndarray) -> np.ndarray:
    """Weights of every layer and head for one sequence: [L, N, T, T] float32 (docs/theory.md §14)."""
    _, weights = DecoderLM(model_config).apply({"params": params}, jnp.asarray(token_ids)[None],
                                               return_weights=True)
    return np.stack([np.asarray(w[0], np.float32) for w in weights])  # [L, N, T, T]


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run's out_dir (or its checkpoints/best)")
    parser.add_argument("--text", default="ROMEO:\nBut soft, what light", help="the characters to look at")
    parser.add_argument("--out", default="maps.png")
    args = parser.parse_args(argv)
    if not can_write(args.out):  # before any work: matplotlib decides by the file's extension
        parser.error(f"--out {args.out}: not an image type matplotlib writes ({', '.join(image_types())})")
    try:
        params, model_config, tokenizer = load_for_sampling(args.checkpoint)
    except CheckpointError as err:
        parser.exit(1, f"error: {err}\n")
    if not args.text:
        parser.error("--text must not be empty")
    try:
        ids = tokenizer.encode(args.text)
    except ValueError as err:
        parser.error(str(err))
    if len(ids) > model_config.max_seq_len:
        print(f"--text has {len(ids)} tokens; keeping the first {model_config.max_seq_len} (max_seq_len)")
        ids = ids[:model_config.max_seq_len]
    weights = attention_weights(params, model_config, ids)
    chars = [tokenizer.decode([i]) for i in ids]
    kind = "MLA" if model_config.mla else f"{model_config.num_heads}q/{model_config.num_kv_heads}kv heads"
    plot_attention_maps(weights, chars, Path(args.out),
                        title=f"attention weights ({kind}, {model_config.positions} positions) from {args.checkpoint}")
    print(f"wrote {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
