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

from __future__ import annotations

import argparse
import codecs
import io
import json
import os
import re
import shutil
import stat
import sys
import tempfile
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from train.cli import ArgumentParser, UsageError, guard
from train.data import shards
from train.data.errors import DataError
from train.outputs import check_folder

try:
    import fcntl
except ImportError:  # not POSIX: the marker of a running prepare is not locked
    fcntl = None

PROGRAM = "python -m train.prepare"
CHUNK_CHARS = 1 << 20  # text encoded at a time: at least this much, at most twice (`_cut`)
READ_BYTES = 1 << 20
COPY_TOKENS = 1 << 22
DEFAULT_SHARD_TOKENS = shards.DEFAULT_SHARD_TOKENS
MAX_BPE_VOCAB = shards.MAX_VOCAB
TEMP_PREFIX = ".prepare-"  # the temporary folder inside --out (tempfile.mkdtemp adds 8 characters)
MARKER = "PREPARING"  # in the temporary folder: says who made it; locked while that run lives
MARKER_TEXT = f"a temporary folder of {PROGRAM}"
SPOOL = "spool.tmp"
# Unicode's White_Space but the newline (what the tokenizers' `\s` matches; Python's str.isspace also counts
# U+001C..U+001F), before a non-space character: the places of `_cut`'s rule 2.
_BEFORE_WORD = re.compile("[\t\x0b\x0c\r \x85\xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000](?=\\S)")
OWN_FILE = re.compile(rf"^((train|val)_\d{{5}}\.bin(\.part)?|{re.escape(shards.TOKENIZER)}|"
                      rf"{re.escape(shards.MANIFEST)}|{re.escape(SPOOL)}|{MARKER})$")  # what may lie in it


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


def special_kind(path: Path) -> str | None:
    """"a character device", "a block device", "a named pipe (FIFO)" or "a socket"; None for anything else."""
    try:
        mode = path.stat().st_mode
    except OSError:
        return None
    for test, kind in ((stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISFIFO, "a named pipe (FIFO)"), (stat.S_ISSOCK, "a socket")):
        if test(mode):
            return kind
    return None


def input_files(data: str | Path) -> list[Path]:
    """The text files of --data: the file, or a directory's *.txt files by name; DataError if none, or
    when --data is neither a file nor a directory (a device, a named pipe, a socket)."""
    data = Path(data)
    if not data.exists():
        raise DataError(f"--data {data} does not exist")
    if data.is_file():
        return [data]
    if not data.is_dir():
        raise DataError(f"--data {data} is {special_kind(data) or 'not a regular file'}, not a text file or a "
                        "directory")
    files = sorted(p for p in data.glob("*.txt") if p.is_file())
    if not files:
        raise DataError(f"--data {data} is a directory with no *.txt files")
    return files


def _cut(text: str, final: bool) -> int:
    """Where the next chunk of `text` ends: between CHUNK_CHARS and 2 * CHUNK_CHARS characters (0: not
    known yet, wait for more text; the whole text when it is the file's last).

    A chunk is encoded on its own, so it ends where the tokenizer's pre-tokenization splits anyway.
    GPT-2's pre-tokenizer (a `bpe:` tokenizer's, and that of the byte-level `hf:` ones) cuts text into
    pieces that never hold whitespace except one leading space (" king") or whitespace alone, and a
    run of whitespace before a non-space character is split before its last character, which begins a
    piece of its own (a tab, a newline) or the next word's (a space). So a piece always ends before the
    last whitespace character of such a run, and after a newline that stands alone between two
    non-space characters, whatever comes before and after; the pieces, and the ids, of two chunks cut
    there are those of the whole text. The places, in order:

    1. after the first newline between two non-space characters at or after CHUNK_CHARS ("king\\nthe"
       -> "king\\n" | "the"), as earlier versions cut (their ids are kept where such a place lies
       within 2 * CHUNK_CHARS);
    2. else before the first whitespace character other than a newline that is followed by a non-space
       character, at or after CHUNK_CHARS ("king  the" -> "king " | " the"), so that text without
       newlines is never held whole. Before it, not after: pre-tokenizers like Llama 3's join a space
       or tab to the word after it (and punctuation to the newlines after it, hence rule 1's newline
       between non-space characters);
    3. else (2 * CHUNK_CHARS characters without either: one very long word, or text written without
       spaces) at 2 * CHUNK_CHARS, the only cut that may split a piece of the pre-tokenizer in two and
       give other ids than the whole text there.

    A non-space character is one that Python's `str.isspace` refuses (it counts every character the
    tokenizers' `\\s` does, and U+001C..U+001F besides); the whitespace a rule 2 place begins with is
    one of Unicode's White_Space characters, what `\\s` matches.
    """
    if final:
        return len(text)
    limit = 2 * CHUNK_CHARS
    pos = text.find("\n", max(CHUNK_CHARS - 1, 1), limit)  # 1: ends at pos + 1 in [CHUNK_CHARS, limit]
    while 0 < pos < len(text) - 1:
        if not text[pos - 1].isspace() and not text[pos + 1].isspace():
            return pos + 1
        pos = text.find("\n", pos + 1, limit)
    if len(text) <= limit:
        return 0  # a place of kind 1 may still come
    found = _BEFORE_WORD.search(text, max(CHUNK_CHARS, 1), limit + 2)  # 2: ends in [CHUNK_CHARS, limit]
    return found.start() if found else limit  # 3


def read_chunks(path: Path, progress: Callable[[int], None] = lambda n: None) -> Iterator[str]:
    """The UTF-8 text of `path` in chunks of CHUNK_CHARS to 2 * CHUNK_CHARS characters (`_cut`; the
    last may be shorter), newlines made LF.

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
    from train.data.tokenizer import ByteTokenizer, CharTokenizer, to_json
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


def _check_out(out: Path, overwrite: bool) -> list[tuple[Path, int | None]]:
    """Refuses an --out that is not a directory, or holds anything but leftovers without `overwrite`;
    returns the leftover temporary folders to remove (`_leftover`), locked."""
    if out.exists() and not out.is_dir():
        raise DataError(f"--out {out} is {special_kind(out) or 'a file'}, not a directory")
    check_folder(out, "--out")
    leftovers, others = [], False
    for entry in sorted(out.iterdir()) if out.is_dir() else ():
        held = _leftover(entry)
        if held is False:
            others = True
        else:
            leftovers.append((entry, held))
    if others and not overwrite:
        for _, fd in leftovers:
            _release(fd)
        raise DataError(f"--out {out} is not empty: pass --overwrite to replace a prepared corpus there "
                        "(other files stay), or choose another directory")
    return leftovers


def _hold(marker: Path, create: bool = False) -> int | bool | None:
    """The marker opened and locked (its descriptor; None where files cannot be locked), or False when
    another process holds it (or it cannot be opened)."""
    try:
        fd = os.open(marker, os.O_RDWR | (os.O_CREAT | os.O_EXCL if create else 0), 0o644)
    except OSError:
        return False
    if fcntl is None:
        os.close(fd)
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return False
    return fd


def _release(fd: int | None) -> None:
    if fd is not None:
        os.close(fd)  # closing the descriptor drops its lock


def _leftover(entry: Path) -> int | bool | None:
    """For a temporary folder this program left in --out when it was killed: its marker, locked (see
    `_hold`); False for anything else, which is never removed: a name not TEMP_PREFIX + 8 characters, no
    marker of this program, a file in it this program does not write, or a marker a running prepare holds."""
    if not (entry.name.startswith(TEMP_PREFIX) and len(entry.name) == len(TEMP_PREFIX) + 8):
        return False
    if entry.is_symlink() or not entry.is_dir():
        return False
    try:
        if not (entry / MARKER).read_text(encoding="utf-8").startswith(MARKER_TEXT):
            return False
        if not all(OWN_FILE.match(p.name) and p.is_file() and not p.is_symlink() for p in entry.iterdir()):
            return False
    except (OSError, UnicodeDecodeError):
        return False
    return _hold(entry / MARKER)


def _make_temp(out: Path) -> tuple[Path, int | None]:
    """The temporary folder of this run in `out`, with its marker created locked (so that no other run
    takes the folder for a leftover while this one lives) and then filled in."""
    tmp = Path(tempfile.mkdtemp(prefix=TEMP_PREFIX, dir=out))
    fd = _hold(tmp / MARKER, create=True)
    (tmp / MARKER).write_text(f"{MARKER_TEXT}, process {os.getpid()}: removed by the next run into "
                              f"{out} once this one has ended\n", encoding="utf-8")
    return tmp, (None if fd is False else fd)


def _split_file(spool: Path, n: int, dtype, val_fraction: float, writers: dict) -> int:
    """Copies a file's spooled tokens to the train writer (its first part) and the val writer; the train count.

    Read in chunks, not through a memory map, whose pages would count toward the process's resident
    memory up to the size of the file."""
    n_train = int(n * (1.0 - val_fraction))  # train.data.corpus.load_corpus's rule
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
    missing input, a device or pipe as `data`, a non-UTF-8 or empty corpus, a split shorter than
    `min_split_tokens`, a non-empty `out` without `overwrite`; UnwritablePath when `out` cannot be
    written. The temporary folders a killed prepare left in `out` (`_leftover`) do not count as
    anything in it: they are removed, with a `note:` line on stderr, once `out` is accepted.
    """
    kind, arg = parse_tokenizer(tokenizer)
    if shard_tokens < 1:
        raise UsageError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    files, out = input_files(data), Path(out)
    leftovers = _check_out(out, overwrite)
    if all(p.stat().st_size == 0 for p in files):
        for _, fd in leftovers:
            _release(fd)
        raise DataError(f"empty corpus: {', '.join(map(str, files))} hold no text")
    for folder, fd in leftovers:
        shutil.rmtree(folder, ignore_errors=True)
        _release(fd)
        print(f"note: removed {folder}, the temporary folder of a {PROGRAM} into {out} that was killed before "
              "it finished", file=sys.stderr)
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp, lock = _make_temp(out)
    try:
        manifest = _prepare_into(tmp, files, kind, arg, shard_tokens, val_fraction, min_split_tokens)
        manifest["source"] = str(data)
        (tmp / shards.MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        for old in out.iterdir():
            if old != tmp and (shards.SHARD_NAME.match(old.name) or old.name in (shards.MANIFEST, shards.TOKENIZER)):
                old.unlink()
        for new in sorted(tmp.iterdir()):
            if new.name != MARKER:
                new.replace(out / new.name)
        (tmp / MARKER).unlink()
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_out and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        _release(lock)
    tmp.rmdir()
    return manifest


def _prepare_into(tmp: Path, files: list[Path], kind: str, arg, shard_tokens: int, val_fraction: float,
                  min_split_tokens: int) -> dict:
    tokenizer_json, encode, vocab_size = build(kind, arg, files)
    hash_ = shards.tokenizer_hash(tokenizer_json)
    dtype = shards.dtype_for(vocab_size)
    (tmp / shards.TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
    writers = {s: shards.SplitWriter(tmp, s, vocab_size, hash_, shard_tokens) for s in shards.SPLITS}
    spool, sources = tmp / SPOOL, []
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
    for writer in writers.values():
        writer.close()
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
        "checksums": {"algorithm": shards.CHECKSUM, "of": f"each shard's body: the bytes after its "
                      f"{shards.HEADER_SIZE}-byte header", f"ends_{shards.CHECKSUM}": "of the first and the last "
                      "ends_bytes of the body (the whole body when it is at most twice that)",
                      "ends_bytes": shards.ENDS_BYTES},
        **{s: {"tokens": counts[s], "shards": writers[s].records} for s in shards.SPLITS},
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
