"""A run's data: where the corpus comes from, how it is tokenized, prepared and read as batches.

* `corpus`: find, download and split the corpus (a text file or a prepared directory); `errors`: `DataError`;
* `tokenizer`: a run's tokenizer (characters, bytes, a tokenizer.json), saved with its checkpoints;
* `shards`: a prepared corpus on disk, its manifest, opened and checked; `shard_format`: one token
  shard's bytes, written and read;
* `tokenize_corpus`: a corpus tokenized once into a prepared directory (what `python -m train.prepare`
  runs), its text read in chunks (`text_chunks`) and written through a temporary folder (`staging`);
* `batches`: deterministic training and evaluation batches, read on the host;
* `chats`: fine-tuning chats rendered with a chat template, with loss weights; `documents`: the
  (ids, weights) documents, plain text as documents; `packing`: documents packed into rows, read
  as batches by `packed_batches`.
"""
