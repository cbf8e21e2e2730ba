"""Batches of packed documents (`train.data.packing.pack`): a fine-tuning run's chats, read as rows.

A packed split is R rows of T = block_size predictions, each row documents back to back, with the
weight of each prediction (0 across documents and at padding; 0 outside the assistant's turns of a
chat) and the segment ids and positions that keep attention to one document. A batch is B rows:
`{"inputs", "targets", "weights", "segment_ids", "positions"}`, each `[n, B, T]` for a chunk of n
steps. Rows are drawn as `train.data.batches` draws windows, from `batch_key(seed, split, step)`, so a
batch is a pure function of (seed, split, step) and a resumed run replays an uninterrupted one.

The loss of a batch is the weighted mean of its predictions (`train.run.steps`). Evaluation: the train
split on `eval_iters` fixed batches, the val split whole (every row once, in batches of `eval_rows`),
each the weighted mean over what it read.
"""

from __future__ import annotations

from typing import Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from train.data.batches import EVAL_SPLITS, TRAIN, draw_starts, place_rows

FIELDS = ("inputs", "targets", "weights", "segment_ids", "positions")


def rows_of(packed, rows: np.ndarray) -> dict[str, np.ndarray]:
    """The packed split's rows `rows [...]` as a batch `{field: [..., T]}`."""
    return {field: getattr(packed, field)[rows] for field in FIELDS}


class PackedBatches:
    """`train.data.batches.RunBatches`' surface over packed splits (`train.data.packing.Packed`).

    Args:
      train, val: the packed splits.
      tc: the run's TrainConfig (seed, batch_size, eval_iters).
      windows: `rows -> NamedSharding` of `[n, rows, T]` arrays (rows split over the mesh).
      eval_rows: the rows of a val evaluation batch.
    """

    packed = True  # its batches are `{field: [n, B, T]}` (`train.run.steps.Programs.inputs`)

    def __init__(self, train, val, tc, windows: Callable[[int], NamedSharding], eval_rows: int):
        self.splits = {"train": train, "val": val}
        self.tc, self.sharding, self.eval_rows = tc, windows, eval_rows
        self._fixed: dict[str, tuple] = {}

    def close(self) -> None:
        """Nothing to close: packed splits are in memory."""

    def _place(self, batch: dict[str, np.ndarray], rows: int) -> dict[str, jax.Array]:
        sharding = self.sharding(rows)
        return {field: place_rows(np.asarray(value), sharding) for field, value in batch.items()}

    def train_chunk(self, first: int, last: int) -> dict[str, jax.Array]:
        """The batches `{field: [last - first, B, T]}` of training steps first .. last - 1."""
        tc, packed = self.tc, self.splits["train"]
        rows = draw_starts(tc.seed, TRAIN, np.arange(first, last), tc.batch_size, len(packed.inputs))
        return self._place(rows_of(packed, rows), tc.batch_size)

    def eval_shapes(self) -> set[tuple[int, int]]:
        """The (batches, rows) of every evaluation input, for compiling ahead."""
        return {(self.tc.eval_iters, self.tc.batch_size), (self._val_batches(), self.eval_rows)}

    def _val_batches(self) -> int:
        return -(-len(self.splits["val"].inputs) // self.eval_rows)

    def evaluate(self, losses: Callable[[dict, jax.Array], jax.Array]) -> dict[str, float]:
        """{'train', 'val'}: each split's weighted mean loss, from `losses(batch, weights)` -> the
        weighted loss sum of each batch."""
        out = {}
        for split in ("train", "val"):
            batch, weights, total_weight = self._eval_input(split)
            out[split] = float(np.sum(np.asarray(losses(batch, weights), np.float64))) / max(total_weight, 1e-9)
        return out

    def _eval_input(self, split: str) -> tuple[dict, jax.Array, float]:
        if split not in self._fixed:
            tc, packed = self.tc, self.splits[split]
            if split == "train":
                rows = draw_starts(tc.seed, EVAL_SPLITS[split], np.arange(tc.eval_iters), tc.batch_size,
                                   len(packed.inputs))
                batch, width = rows_of(packed, rows), tc.batch_size
            else:  # every val row once; the batches padded with rows of weight 0 to one compiled shape
                count = self._val_batches() * self.eval_rows
                rows = np.resize(np.arange(len(packed.inputs)), count).reshape(-1, self.eval_rows)
                batch, width = rows_of(packed, rows), self.eval_rows
                batch["weights"] = np.where((np.arange(count) < len(packed.inputs)).reshape(rows.shape)[..., None],
                                            batch["weights"], 0.0).astype(np.float32)
            weights = batch.pop("weights")
            placed = self._place(batch, width)
            self._fixed[split] = (placed, place_rows(weights, self.sharding(width)), float(np.sum(weights)))
        return self._fixed[split]
