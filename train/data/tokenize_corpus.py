"""A corpus tokenized once into a prepared directory of token shards (`prepare`, what `python -m
train.prepare` runs; the directory's format: `train.data.shards`).

The tokenizer (`build`, from a --tokenizer spec, `parse_tokenizer`) takes the passes over the text it
needs: char finds the corpus's characters first, bpe trains on it first (two passes), byte and hf
encode at once (one). Each file is read in chunks (`train.data.text_chunks`) and encoded; its tokens
are spooled to a temporary file (their count is known only at its end), then split, the first
int(n * (1 - val_fraction)) to train and the rest to val, as `train.data.corpus.load_corpus` splits a
file, and streamed into shards (`shard_format.SplitWriter`), each hashed as it is written. A progress
bar on stderr follows every pass. Everything is written in a temporary folder moved into place at the
end (`train.data.staging`), so a failed or stopped prepare leaves its --out as it was.
"""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from train.cli import UsageError
from train.data import shard_format
from train.data.errors import DataError
from train.data.shards import DEFAULT_SHARD_TOKENS, MANIFEST, TOKENIZER
from train.data.staging import SPOOL, check_out, make_temp, move_into_place, release, remove_leftovers
from train.data.text_chunks import input_files, read_chunks
from train.data.tokenizer import ByteTokenizer, CharTokenizer, to_json

COPY_TOKENS = 1 << 22  # tokens copied from the spool to the shards at a time
MAX_BPE_VOCAB = shard_format.MAX_VOCAB


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
        path = Path(arg) / TOKENIZER
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
    written. The temporary folders a killed prepare left in `out` (`train.data.staging.leftover`) do not
    count as anything in it: they are removed, with a `note:` line on stderr, once `out` is accepted.
    """
    kind, arg = parse_tokenizer(tokenizer)
    if shard_tokens < 1:
        raise UsageError(f"--shard-tokens must be at least 1, got {shard_tokens}")
    if not 0.0 < val_fraction < 1.0:
        raise UsageError(f"--val-fraction must be in (0, 1), got {val_fraction}")
    files, out = input_files(data), Path(out)
    leftovers = check_out(out, overwrite)
    if all(p.stat().st_size == 0 for p in files):
        for _, fd in leftovers:
            release(fd)
        raise DataError(f"empty corpus: {', '.join(map(str, files))} hold no text")
    remove_leftovers(leftovers, out)
    made_out = not out.exists()
    out.mkdir(parents=True, exist_ok=True)
    tmp, lock = make_temp(out)
    try:
        manifest = _prepare_into(tmp, files, kind, arg, shard_tokens, val_fraction, min_split_tokens)
        manifest["source"] = str(data)
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2, ensure_ascii=False) + "\n")
        move_into_place(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        if made_out and not any(out.iterdir()):
            out.rmdir()
        raise
    finally:
        release(lock)
    tmp.rmdir()
    return manifest


def _prepare_into(tmp: Path, files: list[Path], kind: str, arg, shard_tokens: int, val_fraction: float,
                  min_split_tokens: int) -> dict:
    """Writes the tokenizer.json and the shards of `files` into `tmp`; returns the manifest (without its source).
    DataError for a corpus of no tokens, or a split of fewer than `min_split_tokens`."""
    tokenizer_json, encode, vocab_size = build(kind, arg, files)
    hash_ = shard_format.tokenizer_hash(tokenizer_json)
    (tmp / TOKENIZER).write_text(tokenizer_json, encoding="utf-8")
    writers = {s: shard_format.SplitWriter(tmp, s, vocab_size, hash_, shard_tokens) for s in shard_format.SPLITS}
    sources = _encode_files(files, kind, encode, vocab_size, tmp / SPOOL, val_fraction, writers)
    for writer in writers.values():
        writer.close()
    counts = {s: writers[s].tokens for s in shard_format.SPLITS}
    if counts["train"] + counts["val"] == 0:
        raise DataError(f"empty corpus: {', '.join(map(str, files))} give no tokens")
    if min(counts.values()) < min_split_tokens:
        raise DataError(f"the corpus is too short ({counts['train'] + counts['val']} tokens) to split into train "
                        f"and val with at least {min_split_tokens} tokens each")
    return {
        "format": "jaxattn prepared corpus", "version": shard_format.VERSION,
        "tokenizer": {"kind": kind, "spec": kind if arg is None else f"{kind}:{arg}", "file": TOKENIZER,
                      "hash": hash_.hex(), "vocab_size": vocab_size},
        "dtype": shard_format.dtype_for(vocab_size).name, "shard_tokens": shard_tokens,
        "split": {"rule": "per file: the first int(n * (1 - val_fraction)) tokens train, the rest val",
                  "val_fraction": val_fraction},
        "checksums": _checksums(),
        **{s: {"tokens": counts[s], "shards": writers[s].records} for s in shard_format.SPLITS},
        "sources": sources,
    }


def _encode_files(files: list[Path], kind: str, encode: Callable[[str], np.ndarray], vocab_size: int, spool: Path,
                  val_fraction: float, writers: dict) -> list[dict]:
    """Encodes each file in chunks into `spool`, then splits it into the writers (`_split_file`); the
    manifest's `sources`, one record per file. The spool is removed at the end."""
    dtype, sources = shard_format.dtype_for(vocab_size), []
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
    return sources


def _checksums() -> dict:
    """What the manifest says of the checksums each shard's record holds (`shard_format.shard_record`)."""
    checksum, header = shard_format.CHECKSUM, shard_format.HEADER_SIZE
    return {"algorithm": checksum, "of": f"each shard's body: the bytes after its {header}-byte header",
            f"ends_{checksum}": "of the first and the last ends_bytes of the body (the whole body when it is at most "
                                "twice that)",
            "ends_bytes": shard_format.ENDS_BYTES}
