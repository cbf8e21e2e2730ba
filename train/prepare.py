"""Tokenize a corpus once into memory-mapped token shards (the format: `train.data.shards`).

    python -m train.prepare --data corpus.txt --tokenizer char --out data/shakespeare_char
    python -m train.prepare --data texts/ --tokenizer bpe:8192 --out data/texts_bpe --shard-tokens 100000000
    python -m train.prepare --data texts/ --tokenizer hf:exports/baby --out data/texts_hf --overwrite

--data is a UTF-8 text file, or a directory whose *.txt files (not its subdirectories) are read in
sorted name order (a device, a named pipe or a socket is refused, named as what it is). Text is read
as `train.data.corpus.read_text` reads it (UTF-8, universal newlines: CRLF and CR become LF), in chunks of
at most 2 * CHUNK_CHARS characters, never whole, whatever its lines. --tokenizer:

* char: the sorted set of the corpus's characters (train.data.tokenizer.CharTokenizer); needs a first
  pass over the text to find them, so two passes.
* byte: the UTF-8 bytes, vocabulary 256; one pass.
* bpe:VOCAB: a byte-level BPE of VOCAB ids (> 256) trained on the corpus with the `tokenizers`
  library (`train_from_iterator` over the streamed chunks, GPT-2's pre-tokenizer, no special
  tokens), then one pass to encode: two passes.
* hf:DIR: DIR/tokenizer.json as it is (encoded without special tokens); one pass.

The split (deterministic): each file's token stream is split on its own, its first
int(n * (1 - val_fraction)) tokens to train and the rest to val, exactly as `train.data.corpus.load_corpus`
splits a single file; the train stream is the files' train parts in order, and the val stream
their val parts. For one file and `char`, the prepared streams are load_corpus's train and val ids.
A file is encoded in chunks cut where GPT-2's pre-tokenizer always splits (`_cut`: after a newline,
else before a space, that lies between two non-space characters), so `bpe` tokens equal encoding
each file whole, except inside a run of 2 * CHUNK_CHARS characters with no such place, which is
cut where the chunk is full; an `hf:` tokenizer whose pre-tokenizer splits elsewhere may differ at
the cuts.

A file's tokens are first spooled to a temporary file (its count is known only at its end), then
cut into train and val shards, each hashed as it is written (sha256 of its body: prepared.json pins
every shard's name, size and checksum, `train.data.shards`). Everything is written in a temporary folder
`--out/.prepare-XXXXXXXX` and moved into place at the end, so a failed or stopped run leaves --out
as it was. A run killed outright (SIGKILL, a power cut) leaves that folder behind: the folder holds
a marker file, locked while its run lives, and the next run into --out removes such a folder (and
says so) when its marker is unlocked and it holds nothing but what this program writes; nothing
else is removed. A non-empty --out is refused unless --overwrite, which replaces the shards,
tokenizer.json and prepared.json and leaves every other file there. Exit codes: 0 done, 1 bad input
(one `error:` line naming it), 2 usage.
"""

# The work is in train.data: the text read in chunks (`text_chunks`), tokenized into shards
# (`tokenize_corpus`), written in a temporary folder moved into place (`staging`).

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from train.cli import ArgumentParser, guard
from train.data.errors import DataError
from train.data.staging import PROGRAM
from train.data.tokenize_corpus import DEFAULT_SHARD_TOKENS, prepare


def summary(out: Path, manifest: dict) -> str:
    tok = manifest["tokenizer"]
    return (f"prepared {out}: tokenizer {tok['spec']} ({tok['vocab_size']} ids, {manifest['dtype']}), "
            f"train {manifest['train']['tokens']:,} tokens in {len(manifest['train']['shards'])} shards, "
            f"val {manifest['val']['tokens']:,} tokens in {len(manifest['val']['shards'])} shards, "
            f"from {len(manifest['sources'])} files")


def run(argv: list[str] | None = None) -> dict:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", required=True, metavar="FILE_OR_DIR", help="a UTF-8 text file or a directory of *.txt")
    parser.add_argument("--tokenizer", required=True, metavar="SPEC", help="char, byte, bpe:VOCAB or hf:DIR")
    parser.add_argument("--out", required=True, metavar="DIR", help="the prepared directory to write")
    parser.add_argument("--shard-tokens", type=int, default=DEFAULT_SHARD_TOKENS, metavar="N",
                        help=f"tokens per shard file (default {DEFAULT_SHARD_TOKENS:,})")
    parser.add_argument("--val-fraction", type=float, default=0.1, metavar="F",
                        help="the last fraction of each file's tokens held out (default 0.1)")
    parser.add_argument("--overwrite", action="store_true", help="replace a prepared corpus in DIR (other files stay)")
    args = parser.parse_args(argv)
    manifest = prepare(args.data, args.tokenizer, args.out, shard_tokens=args.shard_tokens,
                       val_fraction=args.val_fraction, overwrite=args.overwrite)
    print(summary(Path(args.out), manifest))
    return manifest


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 written, 1 bad input or an unwritable --out, 2 a usage error (one `error:` line each)."""
    guard(PROGRAM, lambda: run(argv), expected=(DataError,))
    return 0


if __name__ == "__main__":
    sys.exit(main())
