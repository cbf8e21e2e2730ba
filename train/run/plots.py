"""The pictures the programs draw: loss curves, the model-kind comparison, attention maps.

Each function writes one PNG (creating its folder) and needs no display
(matplotlib's Agg backend).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

VISIBLE = {"\n": "⏎", " ": "␣", "\t": "⇥"}  # how attention maps label invisible characters


def _pyplot():
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    return plt


def image_types() -> list[str]:
    """The file extensions matplotlib can write."""
    from matplotlib.figure import Figure
    return sorted(Figure().canvas.get_supported_filetypes())


def can_write(path) -> bool:
    """Whether matplotlib can write an image to `path` (judged by its extension)."""
    return Path(path).suffix.lstrip(".").lower() in image_types()


def _save(fig, png: Path) -> None:
    png = Path(png)
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png)
    _pyplot().close(fig)


def plot_losses(records: list[dict], png: Path, *, title: str) -> None:
    """Training loss per log interval and the evaluated train/val losses against step.

    `records` are `metrics.jsonl` lines: `{"step", "loss"}` and `{"step", "train_loss", "val_loss"}`.
    """
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    fig, ax = _pyplot().subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.6, label="train (batch)")
    ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "s-", label="val (eval)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    _save(fig, png)


COMPARISON_PANELS = (("val_loss", "val loss (lower is better)"), ("train_tokens_per_s", "train tokens/s"),
                     ("decode_tokens_per_s", "decode tokens/s, batch 1"),
                     ("kv_bytes_per_token", "KV-cache bytes/token"))


def plot_comparison(rows: list[dict], png: Path) -> None:
    """One bar panel per measure, the kinds (`train.compare`) on the x axis, one bar per position scheme."""
    kinds = list(dict.fromkeys(r["kind"] for r in rows))
    positions = list(dict.fromkeys(r["positions"] for r in rows))
    fig, axes = _pyplot().subplots(1, len(COMPARISON_PANELS), figsize=(15, 3.6), dpi=90)
    width = 0.8 / len(positions)
    for ax, (key, title) in zip(axes, COMPARISON_PANELS):
        for j, pos in enumerate(positions):
            values = [next((r[key] for r in rows if r["kind"] == k and r["positions"] == pos), np.nan)
                      for k in kinds]
            ax.bar(np.arange(len(kinds)) + (j - (len(positions) - 1) / 2) * width, values, width, label=pos)
        ax.set_xticks(np.arange(len(kinds)), kinds)
        ax.set_title(title, fontsize=10)
        ax.grid(axis="y", alpha=0.3)
        if key == "val_loss":
            losses = [r[key] for r in rows]
            ax.set_ylim(min(losses) - 0.05, max(losses) + 0.05)
    axes[0].legend(title="positions", fontsize=8)
    _save(fig, png)


def plot_attention_maps(weights: np.ndarray, chars: list[str], png: Path, *, title: str) -> None:
    """One heatmap per layer (rows) and head (columns) of `weights [L, N, T, T]`; row t is query t."""
    num_layers, num_heads, T, _ = weights.shape
    cell = max(1.6, 0.13 * T)
    fig, axes = _pyplot().subplots(num_layers, num_heads, dpi=80, squeeze=False,
                                   figsize=(cell * num_heads + 1, cell * num_layers + 0.6))
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
    _save(fig, png)
