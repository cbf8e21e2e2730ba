"""A run's data: where the corpus comes from, how it is tokenized, prepared and read as batches.

* `corpus`: find, download and split the corpus (a text file or a prepared directory); `errors`: `DataError`;
* `tokenizer`: a run's tokenizer (characters, bytes, a tokenizer.json), saved with its checkpoints;
* `shards`: the on-disk format of a prepared corpus (`python -m train.prepare` writes it);
* `batches`: deterministic training and evaluation batches, read on the host;
* `chats`, `packed_batches`: fine-tuning chats rendered with a chat template, packed into rows.
"""
