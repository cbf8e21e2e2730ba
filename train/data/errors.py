"""`DataError`: the corpus cannot be found, fetched or read.

A module of its own, below everything that raises it: `train.data.shards` and `train.data.shard_format`
(a prepared directory's files), `train.data.batches` (a shard truncated while a run reads it),
`train.data.corpus` (the corpus as a whole, which reads the other two), `train.data.tokenize_corpus` and
the modules behind it (`python -m train.prepare`), the fine-tuning data and `train.run.finish`. Kept in
`train.data.corpus`, it made the two modules below import the one above them (a circle); kept in
`train.data.shards`, the others would import the shard format only for an exception.
"""


class DataError(ValueError):
    """The corpus cannot be found, fetched or read."""
