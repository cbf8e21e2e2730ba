"""What the training tests share: a tiny run's config over a slice of the corpus, and its metrics."""

import json
from pathlib import Path

from train.config import load_config

TINY_MODEL = ["model.d_model=32", "model.num_layers=2", "model.num_heads=2", "model.max_seq_len=16"]
TINY_TRAIN = ["train.batch_size=4", "train.block_size=16", "train.eval_iters=8", "train.eval_interval=10",
              "train.log_interval=5", "train.warmup_iters=5", "train.lr=3e-3", "train.sample_tokens=20",
              "train.lr_decay_iters=40", "runtime.mesh=data:1"]


def tiny_run_config(text_file, out_dir, *extra):
    """The tiny model's run on `text_file` into `out_dir`, with `--set`-style `extra` overrides."""
    return load_config(overrides=TINY_MODEL + TINY_TRAIN + [f"train.data_path='{text_file}'",
                                                            f"train.out_dir='{out_dir}'", *extra])


def run_metrics(out_dir) -> list[dict]:
    """The records of a run's metrics.jsonl."""
    return [json.loads(line) for line in (Path(out_dir) / "metrics.jsonl").read_text().splitlines()]
