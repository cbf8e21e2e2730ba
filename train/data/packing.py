"""Documents packed into rows (`pack`): what a fine-tuning run trains on, read as batches by
`train.data.packed_batches`.

```text
packed = pack(documents, row_len=512, pad_id=0, seed=0)  # inputs, targets, weights [R, 512], ...
```

**Packing** (`pack`): documents laid back to back into rows of `row_len + 1` tokens (best-fit
decreasing), a row's inputs its first `row_len` tokens and its targets its last `row_len`; weights
are 0 where the target is padding or another document's first token; segment ids and positions
let attention keep to one document. A document longer than a row is split into pieces that
overlap by one token, so each of its predictions is made exactly once. `Packed` says the rest.
"""

from __future__ import annotations

import bisect
import dataclasses
from collections.abc import Sequence

import numpy as np

from train.data.documents import Document


@dataclasses.dataclass(frozen=True)
class Packed:
    """Documents packed into R rows of T = row_len predictions.

    Row r holds a buffer of T + 1 tokens: documents back to back, then `pad_id`; `inputs[r]` is its
    first T tokens and `targets[r]` its last T (next-token targets).

    Attributes:
      inputs, targets: int32 [R, T].
      weights: float32 [R, T]: the weight of predicting `targets[r, t]`: the document's weight of that
        token when `inputs[r, t]` and `targets[r, t]` are of the same document, else 0 (a document's
        last token, whose next token is another document's, and padding).
      segment_ids: int32 [R, T]: the document of `inputs[r, t]` within its row, 1, 2, ...; 0 = padding.
        Attention that keeps to equal segment ids never looks across documents.
      positions: int32 [R, T]: the position of `inputs[r, t]` within its document (0 at its first
        token; 0 at padding).
      placements: int64 [P, 5]: each piece placed, as (row, offset in the row's buffer, document index,
        start of the piece in the document, length).
      skipped: documents of fewer than two tokens, left out (nothing to predict).
    """

    inputs: np.ndarray
    targets: np.ndarray
    weights: np.ndarray
    segment_ids: np.ndarray
    positions: np.ndarray
    placements: np.ndarray
    skipped: int = 0

    @property
    def efficiency(self) -> float:
        """The fraction of the R * T input slots that hold a document's token, not padding."""
        return float(np.mean(self.segment_ids > 0)) if self.segment_ids.size else 0.0


def pack(documents: Sequence[Document], row_len: int, *, pad_id: int = 0, seed: int = 0) -> Packed:
    """Packs (ids [L], weights [L]) documents into rows of `row_len` next-token predictions.

    A document of L tokens makes L - 1 predictions (token j from tokens 0..j-1, weighted by
    weights[j]; weights[0] is never used). One of more than row_len + 1 tokens is split into pieces
    ids[k*T : k*T + T + 1] (T = row_len), overlapping by one token, so that each of its predictions
    is made exactly once; each piece is a document of its own in its row (its own segment id,
    positions from 0). The pieces are placed best-fit decreasing (longest first, each into the row
    with the least room that holds it, else a new row); equal lengths are ordered by a permutation
    drawn from `seed`, and the rows are shuffled with it: the result is a function of (documents,
    row_len, pad_id, seed). Documents of fewer than two tokens are left out (counted in `skipped`).

    ValueError for row_len < 1, a document whose ids and weights are not 1-D of one length, or no
    document of two tokens or more.
    """
    if row_len < 1:
        raise ValueError(f"row_len must be at least 1, got {row_len}")
    capacity = row_len + 1  # tokens in a row's buffer
    pieces = []  # (document index, start, length)
    skipped = 0
    for index, (ids, weights) in enumerate(documents):
        ids, weights = np.asarray(ids), np.asarray(weights)
        if ids.ndim != 1 or weights.shape != ids.shape:
            raise ValueError(f"document {index}: ids and weights must be 1-D and of one length, got shapes "
                             f"{ids.shape} and {weights.shape}")
        if len(ids) < 2:
            skipped += 1
            continue
        for start in range(0, len(ids) - 1, row_len):  # piece k predicts tokens k*T+1 .. k*T+T
            pieces.append((index, start, min(len(ids) - start, capacity)))
    if not pieces:
        raise ValueError("no document has two tokens or more: nothing to pack")

    rng = np.random.default_rng(seed)
    order = rng.permutation(len(pieces))
    order = order[np.argsort([-pieces[i][2] for i in order], kind="stable")]
    room: list[tuple[int, int]] = []  # (room left, row), sorted
    rows: list[list[tuple[int, int, int]]] = []
    for i in order:
        length = pieces[i][2]
        at = bisect.bisect_left(room, (length, -1))
        if at == len(room):
            row = len(rows)
            rows.append([])
            left = capacity
        else:
            left, row = room.pop(at)
        rows[row].append(pieces[i])
        if left - length > 0:
            bisect.insort(room, (left - length, row))
    shuffled = [rows[r] for r in rng.permutation(len(rows))]
    return _lay_out(documents, shuffled, row_len, pad_id, skipped)


def _lay_out(documents: Sequence[Document], rows: list[list[tuple[int, int, int]]], row_len: int,
             pad_id: int, skipped: int) -> Packed:
    """The arrays of `Packed` for rows of pieces (document index, start, length)."""
    n_rows, width = len(rows), row_len + 1
    tokens = np.full((n_rows, width), pad_id, np.int32)
    token_weights = np.zeros((n_rows, width), np.float32)
    segments = np.zeros((n_rows, width), np.int32)
    positions = np.zeros((n_rows, width), np.int32)
    placements = []
    for r, row in enumerate(rows):
        offset = 0
        for segment, (index, start, length) in enumerate(row, start=1):
            ids, weights = documents[index]
            span = slice(offset, offset + length)
            tokens[r, span] = np.asarray(ids)[start:start + length]
            token_weights[r, span] = np.asarray(weights)[start:start + length]
            segments[r, span] = segment
            positions[r, span] = np.arange(length)
            placements.append((r, offset, index, start, length))
            offset += length
    same_document = (segments[:, :-1] == segments[:, 1:]) & (segments[:, 1:] > 0)  # [R, T]
    return Packed(inputs=tokens[:, :-1], targets=tokens[:, 1:],
                  weights=np.where(same_document, token_weights[:, 1:], 0.0).astype(np.float32),
                  segment_ids=segments[:, :-1], positions=positions[:, :-1],
                  placements=np.asarray(placements, np.int64).reshape(-1, 5), skipped=skipped)
