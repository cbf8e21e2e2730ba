"""Tokenize a corpus once into memory-mapped token shards (the format: `train.shards`).

    python -m train.prepare --data corpus.txt --tokenizer char --out data/shakespeare_char
    python -m train.prepare --data texts/ --tokenizer bpe:8192 --out data/texts_bpe --shard-tokens 100000000
    python -m train.prepare --data texts/ --tokenizer hf:exports/baby --out data/texts_hf --overwrite

--data is a UTF-8 text file, or a directory whose *.txt files (not its subdirectories) are read in
sorted name order. Text is read as `train.data.read_text` reads it (UTF-8, universal newlines: CRLF
and CR become LF), in chunks, never whole. --tokenizer:

* char: the sorted set of the corpus's characters (train.tokenizer.CharTokenizer); needs a first
  pass over the text to find them, so two passes.
* byte: the UTF-8 bytes, vocabulary 256; one pass.
* bpe:VOCAB: a byte-level BPE of VOCAB ids (> 256) trained on the corpus with the `tokenizers`
  library (`train_from_iterator` over the streamed chunks, GPT-2's pre-tokenizer, no special
  tokens), then one pass to encode: two passes.
* hf:DIR: DIR/tokenizer.json as it is (encoded without special tokens); one pass.

The split (deterministic): each file's token stream is split on its own, its first
int(n * (1 - val_fraction)) tokens to train and the rest to val, exactly as `train.data.load_corpus`
splits a single file; the train stream is the files' train parts in order, and the val stream
their val parts. For one file and `char`, the prepared streams are load_corpus's train and val ids.
A file is encoded in chunks cut only after a newline that lies between two non-space characters,
where GPT-2's pre-tokenizer always splits, so `bpe` tokens equal encoding each file whole; an
`hf:` tokenizer whose pre-tokenizer splits elsewhere may differ there (a chunk holds 1 MiB of text
or more).

A file's tokens are first spooled to a temporary file (its count is known only at its end), then
cut into train and val shards. Everything is written in a temporary folder inside --out and moved
into place at the end, so a failed or stopped run leaves --out as it was. A non-empty --out is
refused unless --overwrite, which replaces the shards, tokenizer.json and prepared.json and leaves
every other file there. Exit codes: 0 done, 1 bad input (one `error:` line naming it), 2 usage.
"""

from __future__ import annotations

import argparse
import codecs
import io
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from train import shards
from train.cli import ArgumentParser, UsageError, guard
from train.data_errors import DataError
from train.outputs import check_folder

PROGRAM = "python -m train.prepare"
CHUNK_CHARS = 1 << 20  # text encoded at a time (at least; up to 16x while no cut place is found)
READ_BYTES = 1 << 20
COPY_TOKENS = 1 << 22
DEFAULT_SHARD_TOKENS = 100_000_000
MAX_BPE_VOCAB = shards.MAX_VOCAB


def parse_tokenizer(spec: str) -> tuple[str, str | int | None]:
    """("char", None), ("byte", None), ("bpe", VOCAB) or ("hf", DIR); UsageError for anything else."""
    if spec in ("char", "byte"):
        return spec, None
    kind, _, arg = spec.partition(":")
    if kind == "bpe" and arg.isdigit() and 256 < int(arg) <= MAX_BPE_VOCAB:
        return "bpe", int(arg)
    if kind == "hf" and arg:
        return "hf", arg
    raise UsageError(f"--tokenizer {spec!r}: expected char, byte, bpe:VOCAB (VOCAB an integer in "
                     f"257..{MAX_BPE_VOCAB}) or hf:DIR (a directory with a tokenizer.json)")


def input_files(data: str | Path) -> list[Path]:
    """The text files of --data: the file, or a directory's *.txt files by name; DataError if none."""
    data = Path(data)
    if not data.exists():
        raise DataError(f"--data {data} does not exist")
    if data.is_file():
        return [data]
    files = sorted(p for p in data.glob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"--data {data} is a directory with no *.txt files")
    return files


def _cut(text: str, final: bool) -> int:
    """Where to end the next chunk of `text`: after the first newline between two non-space characters
    at or after CHUNK_CHARS (0: none yet; the whole text once it is 16 * CHUNK_CHARS long, or `final`)."""
    if final:
        return len(text)
    pos = text.find("\n", max(CHUNK_CHARS - 1, 1))  # the first such place at or after CHUNK_CHARS
    while 0 < pos < len(text) - 1:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos + 1
        pos = text.find("\n", pos + 1)
    return len(text) if len(text) >= 16 * CHUNK_CHARS else 0  # no such place: 0 waits for more text


def read_chunks(path: Path, progress: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The UTF-8 text of `path` in chunks of about CHUNK_CHARS characters, newlines made LF.

    `progress(n)` is called with the bytes read. DataError naming the file and offset for bytes
    that are not UTF-8.
    """
    decoder = io.IncrementalNewlineDecoder(codecs.getincrementaldecoder("utf-8")(), translate=True)
    pending, offset = "", 0
    with open(path, "rb") as f:
        while True:
            block = f.read(READ_BYTES)
            try:
                pending += decoder.decode(block, final=not block)
            except UnicodeDecodeError as err:
                raise DataError(f"data file {path} is not UTF-8 text (near byte {offset + err.start}): "
                                f"{err.reason}") from None
            offset += len(block)
            progress(len(block))
            while len(pending) >= CHUNK_CHARS or (not block and pending):
                cut = _cut(pending, final=not block)
                if cut == 0:
                    break
                chunk, pending = pending[:cut], pending[cut:]
                yield chunk
            if not block:
                return


def _bar(total: int, desc: str):
    from tqdm import tqdm
    return tqdm(total=total, unit="B", unit_scale=True, desc=desc, file=sys.stderr, disable=None,
                dynamic_ncols=True)


def _texts(files: list[Path], desc: str) -> Iterator[str]:
    """Every chunk of every file, with a progress bar over their bytes."""
    with _bar(sum(p.stat().st_size for p in files), desc) as bar:
        for path in files:
            yield from read_chunks(path, bar.update)


def _bpe(files: list[Path], vocab: int, desc: str):
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    hf = Tokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab, initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  special_tokens=[], show_progress=False)
    hf.train_from_iterator(_texts(files, desc), trainer=trainer)
    return hf


def build(kind: str, arg, files: list[Path]) -> tuple[str, Callable[[str], np.ndarray], int]:
    """(tokenizer.json text, encode: str -> ids, vocab size) of a --tokenizer; the passes it needs run here."""
    from train.tokenizer import ByteTokenizer, CharTokenizer, to_json
    if kind in ("char", "byte"):
        if kind == "char":
            chars: set[str] = set()
            for text in _texts(files, "pass 1/2: characters"):
                chars.update(text)
            if not chars:
                raise DataError(f"empty corpus: {', '.join(map(str, files))} hold no text")
            tok = CharTokenizer("".join(chars))
        else:
            tok = ByteTokenizer()
        return to_json(tok), tok.encode, tok.vocab_size
    if kind == "bpe":
        hf = _bpe(files, arg, "pass 1/2: training BPE")
        text = hf.to_str()
    else:
        from tokenizers import Tokenizer
        path = Path(arg) / shards.TOKENIZER
        try:
            text = path.read_text(encoding="utf-8")
            hf = Tokenizer.from_str(text)
        except OSError as err:
            raise DataError(f"--tokenizer hf:{arg}: {path} cannot be read ({err.strerror or err})") from None
        except Exception as err:  # noqa: BLE001: `tokenizers` raises a bare Exception
            raise DataError(f"--tokenizer hf:{arg}: {path} is not a tokenizer.json the tokenizers "
                            f"library reads ({err})") from None
    return text, lambda s: np.asarray(hf.encode(s, add_special_tokens=False).ids, np.int64), \
        hf.get_vocab_size(with_added_tokens=True)


def _encoded(encode: Callable[[str], np.ndarray], text: str, path: Path, kind: str) -> np.ndarray:
    """`encode(text)`; DataError naming the file when the tokenizer cannot encode it (e.g. a word-level
    tokenizer.json without an unknown token meeting a word it lacks)."""
    try:
        return encode(text)
    except Exception as err:  # noqa: BLE001: `tokenizers` raises a bare Exception
        first = str(err).strip().splitlines()[0][:200] if str(err).strip() else type(err).__name__
        raise DataError(f"the {kind} tokenizer cannot encode {path}: {first}") from None


def _check_out(out: Path, overwrite: bool) -> None:
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise DataError(f"--out {out} is not empty: pass --overwrite to replace a prepared corpus there "
                        "(other files stay), or choose another directory")
    check_folder(out, "--out")


def _split_file(spool: Path, n: int, dtype, val_fraction: float, writers: dict) -> int:
    """Copies a file's spooled tokens to the train writer (its first part) and the val writer; the train count.

    Read in chunks, not through a memory map, whose pages would count toward the process's resident
    memory up to the size of the file."""
    n_train = int(n * (1.0 - val_fraction))  # train.data.load_corpus's rule
    with open(spool, "rb") as f:
        for start in range(0, n, COPY_TOKENS):
            ids = np.fromfile(f, dtype=dtype, count=min(COPY_TOKENS, n - start))
            if start < n_train:
                writers["train"].write(ids[:n_train - start])
            if start + len(ids) > n_train:
                writers["val"].write(ids[max(0, n_train - start):])
    return n_train


def prepare(data: str | Path, tokenizer: str, out: str | Path, *, shard_tokens: int = DEFAULT_SHARD_TOKENS,
            val_fraction: float = 0.1, overwrite: bool = False, min_split_tokens: int = 2) -> dict:
    """Tokenizes `data` into a prepared directory `out` (see the module docstring); returns its manifest.

    UsageError for a bad `tokenizer` spec, `shard_tokens` or `val_fraction`; DataError for a
    missing input, a non-UTF-8 or empty corpus, a split shorter than `min_split_tokens`, a
    non-empty `out` without `overwrite`; UnwritablePath when `out` cannot be written.
    """
    kind, arg = parse_tokenizer(tokenizer)
    if shard_tokens < 1:
        raise UsageError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    files, out = input_files(data), Path(out)
    _check_out(out, overwrite)
    if all(p.stat().st_size == 0 for p in files):
        raise DataError(f"empty corpus: {', '.join(map(str, files))} hold no text")
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".prepare-", dir=out))
    try:
        manifest = _prepare_into(tmp, files, kind, arg, shard_tokens, val_fraction, min_split_tokens)
        manifest["source"] = str(data)
        (tmp / shards.MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        for old in out.iterdir():
            if old != tmp and (shards.SHARD_NAME.match(old.name) or old.name in (shards.MANIFEST, shards.TOKENIZER)):
                old.unlink()
        for new in sorted(tmp.iterdir()):
            new.replace(out / new.name)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_out and not any(out.iterdir()):
            out.rmdir()
        raise
    tmp.rmdir()
    return manifest


def _prepare_into(tmp: Path, files: list[Path], kind: str, arg, shard_tokens: int, val_fraction: float,
                  min_split_tokens: int) -> dict:
    tokenizer_json, encode, vocab_size = build(kind, arg, files)
    hash_ = shards.tokenizer_hash(tokenizer_json)
    dtype = shards.dtype_for(vocab_size)
    (tmp / shards.TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
    writers = {s: shards.SplitWriter(tmp, s, vocab_size, hash_, shard_tokens) for s in shards.SPLITS}
    spool, sources = tmp / "spool.tmp", []
    passes = "pass 1/1" if kind in ("byte", "hf") else "pass 2/2"
    with _bar(sum(p.stat().st_size for p in files), f"{passes}: encoding") as bar:
        for path in files:
            n = 0
            with open(spool, "wb") as f:
                for text in read_chunks(path, bar.update):
                    ids = _encoded(encode, text, path, kind)
                    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
                        raise DataError(f"the tokenizer gave ids outside [0, {vocab_size}) for {path}")
                    ids.astype(dtype).tofile(f)
                    n += ids.size
            n_train = _split_file(spool, n, dtype, val_fraction, writers)
            sources.append({"file": path.name, "bytes": path.stat().st_size, "tokens": n,
                            "train_tokens": n_train, "val_tokens": n - n_train})
    spool.unlink()
    paths = {s: w.close() for s, w in writers.items()}
    counts = {s: writers[s].tokens for s in shards.SPLITS}
    if counts["train"] + counts["val"] == 0:
        raise DataError(f"empty corpus: {', '.join(map(str, files))} give no tokens")
    if min(counts.values()) < min_split_tokens:
        raise DataError(f"the corpus is too short ({counts['train'] + counts['val']} tokens) to split into train "
                        f"and val with at least {min_split_tokens} tokens each")
    return {
        "format": "jaxattn prepared corpus", "version": shards.VERSION,
        "tokenizer": {"kind": kind, "spec": kind if arg is None else f"{kind}:{arg}", "file": shards.TOKENIZER,
                      "hash": hash_.hex(), "vocab_size": vocab_size},
        "dtype": dtype.name, "shard_tokens": shard_tokens,
        "split": {"rule": "per file: the first int(n * (1 - val_fraction)) tokens train, the rest val",
                  "val_fraction": val_fraction},
        **{s: {"tokens": counts[s], "shards": [p.name for p in paths[s]]} for s in shards.SPLITS},
        "sources": sources,
    }


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
