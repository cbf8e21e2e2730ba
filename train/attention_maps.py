"""Draw a trained model's attention: `python -m train.attention_maps --checkpoint DIR --text "..." --out maps.png`.

One heatmap per layer (rows) and head (columns): row t of a map is how query character t
distributes its attention over key characters 0..t (causal, so the upper triangle is empty).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from train.checkpoint import CheckpointError, load_for_sampling

VISIBLE = {"\n": "⏎", " ": "␣", "\t": "⇥"}


def attention_weights(params, model_config, token_ids: np.ndarray) -> np.ndarray:
    """Weights of every layer and head for one sequence: [L, N, T, T] float32."""
    from jaxattn.model import DecoderLM

    _, weights = DecoderLM(model_config).apply({"params": params}, jnp.asarray(token_ids)[None],
                                               return_weights=True)
    return np.stack([np.asarray(w[0], np.float32) for w in weights])  # [L, N, T, T]


def draw(weights: np.ndarray, chars: list[str], png: Path, *, title: str) -> None:
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    num_layers, num_heads, T, _ = weights.shape
    cell = max(1.6, 0.13 * T)
    fig, axes = plt.subplots(num_layers, num_heads, figsize=(cell * num_heads + 1, cell * num_layers + 0.6),
                             dpi=80, squeeze=False)
    labels = [VISIBLE.get(c, c) for c in chars]
    fontsize = max(3.5, min(8.0, 260 / T))
    for layer in range(num_layers):
        for head in range(num_heads):
            ax = axes[layer, head]
            ax.imshow(weights[layer, head], cmap="viridis", vmin=0.0, vmax=1.0, interpolation="nearest")
            ax.set_xticks(range(T), labels, fontsize=fontsize)
            ax.set_yticks(range(T), labels, fontsize=fontsize)
            ax.tick_params(length=0, pad=1)
            ax.set_title(f"layer {layer} head {head}", fontsize=8)
            if head == 0:
                ax.set_ylabel("query", fontsize=7)
            if layer == num_layers - 1:
                ax.set_xlabel("key", fontsize=7)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(png)
    plt.close(fig)


def main(argv: list[str] | None = None) -> Path:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, help="a run's out_dir (or its checkpoints/best)")
    parser.add_argument("--text", default="ROMEO:\nBut soft, what light", help="the characters to look at")
    parser.add_argument("--out", default="maps.png")
    args = parser.parse_args(argv)
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
    kind = "MLA" if model_config.attention == "mla" else f"{model_config.num_heads}q/{model_config.kv_heads}kv heads"
    draw(weights, chars, Path(args.out),
         title=f"attention weights ({kind}, {model_config.positions} positions) from {args.checkpoint}")
    print(f"wrote {args.out}")
    return Path(args.out)


if __name__ == "__main__":
    main()
