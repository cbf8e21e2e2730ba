"""The training corpus: where it comes from and how it is split.

`train.data_path` (`--data`) is a text file, tokenized (characters or bytes) when the run
starts, or a directory prepared by `python -m train.prepare` (any tokenizer, a corpus of any
size: its shards are read as the run goes; `open_corpus`).

Resolution of the text file, first match wins:
  1. an explicit path (`--data PATH` or `train.data_path` in the config);
  2. the environment variable JAXATTN_SHAKESPEARE (the Makefile points it at an optional
     local copy, ../shared/data/tinyshakespeare.txt, when that file exists);
  3. the cache: $XDG_CACHE_HOME/jaxattn/tinyshakespeare.txt (default ~/.cache/jaxattn);
  4. a download of Tiny Shakespeare into the cache, checked against its sha256.

Batches are drawn from the splits by `train.data.batches`; a corpus that cannot be found, fetched or
read raises `train.data.errors.DataError`.

A prepared directory's shards are verified against the checksums its manifest pins when a run opens
it (`train.data.shards.verify_shards`): in full when a run starts, only the ends of each shard when it
resumes (`verify_mode`); JAXATTN_VERIFY_SHARDS=quick or full chooses for every run (quick for a
corpus too large to read at every start). A manifest from before the checksums loads with a warning
(`Corpus.warnings`): only the ids of the windows a run reads are checked.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import numpy as np

from train.cli import UsageError
from train.data.batches import ShardStream
from train.data.chats import chat_documents
from train.data.errors import DataError
from train.data.packing import pack
from train.data.shards import VERIFY_MODES, open_prepared, verify_shards
from train.data.tokenizer import Tokenizer, build_tokenizer

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_FILENAME = "tinyshakespeare.txt"
ENV_PATH = "JAXATTN_SHAKESPEARE"
ENV_URL = "JAXATTN_SHAKESPEARE_URL"
ENV_VERIFY = "JAXATTN_VERIFY_SHARDS"
CHAT_SUFFIX = ".jsonl"  # a run's data path with it is chat data (`open_chat_corpus`)


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/jaxattn, or ~/.cache/jaxattn."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "jaxattn"


def download(url: str, dest: Path, sha256: str | None = SHAKESPEARE_SHA256,
             *, timeout: float = 30.0, progress: bool = True) -> Path:
    """Downloads `url` to `dest` atomically: a temp file in dest's directory, checked, then renamed.

    A failed download or a checksum mismatch leaves nothing at `dest` and no temp file.
    """
    from tqdm import tqdm

    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(prefix=dest.name + ".", suffix=".part", dir=dest.parent)
    try:
        digest = hashlib.sha256()
        with os.fdopen(fd, "wb") as out, urllib.request.urlopen(url, timeout=timeout) as response:
            total = int(response.headers.get("Content-Length") or 0) or None
            with tqdm(total=total, unit="B", unit_scale=True, desc=f"downloading {dest.name}",
                      disable=not progress) as bar:
                for chunk in iter(lambda: response.read(1 << 16), b""):
                    out.write(chunk)
                    digest.update(chunk)
                    bar.update(len(chunk))
        if sha256 is not None and digest.hexdigest() != sha256:
            raise DataError(
                f"checksum mismatch for {url}: expected sha256 {sha256}, got {digest.hexdigest()}; "
                "the file was not saved")
        os.replace(tmp_name, dest)
    except BaseException:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
        raise
    return dest


def _where_to_put_it(reason: str) -> str:
    return (f"{reason}\nTiny Shakespeare could not be found or downloaded. Put the file "
            f"(sha256 {SHAKESPEARE_SHA256}) at {cache_dir() / SHAKESPEARE_FILENAME}, "
            f"or point {ENV_PATH}=/path/to/tinyshakespeare.txt at it, or pass --data PATH. "
            f"Its public address is {SHAKESPEARE_URL}.")


def _existing_file(path: str | os.PathLike, source: str) -> Path:
    path = Path(path).expanduser()
    if not path.exists():
        raise DataError(f"data file {str(path)!r} (from {source}) does not exist")
    if not path.is_file():
        raise DataError(f"data path {str(path)!r} (from {source}) is not a file")
    return path


def resolve_data_path(path: str | os.PathLike | None = None, *, url: str | None = None,
                      download_if_missing: bool = True) -> Path:
    """The corpus text file, following the resolution order of this module's docstring."""
    if path:
        return _existing_file(path, "--data / train.data_path")
    if os.environ.get(ENV_PATH):
        return _existing_file(os.environ[ENV_PATH], f"${ENV_PATH}")
    cached = cache_dir() / SHAKESPEARE_FILENAME
    if cached.is_file():
        return cached
    if not download_if_missing:
        raise DataError(_where_to_put_it(f"{cached} does not exist and downloading is disabled."))
    url = url or os.environ.get(ENV_URL) or SHAKESPEARE_URL
    try:
        return download(url, cached, SHAKESPEARE_SHA256)
    except (urllib.error.URLError, OSError, TimeoutError) as err:
        raise DataError(_where_to_put_it(f"downloading {url} failed: {err}")) from err


def read_text(path: str | os.PathLike) -> str:
    """The UTF-8 text of a file; empty or non-UTF-8 files raise DataError."""
    path = Path(path)
    try:
        text = path.read_text(encoding="utf-8")
    except UnicodeDecodeError as err:
        raise DataError(f"data file {str(path)!r} is not UTF-8 text: {err}") from err
    if not text:
        raise DataError(f"data file {str(path)!r} is empty")
    return text


@dataclasses.dataclass(frozen=True)
class Corpus:
    """A tokenized corpus split into train and val.

    Attributes:
      train, val: the splits: int32 id arrays (a text file) or `train.data.batches.ShardStream`s (a
        prepared directory); `len()` of each is its token count.
      tokenizer: the tokenizer the ids are of.
      path: the text file or prepared directory.
      prepared: a prepared directory's manifest (`train.data.shards`), else None.
      warnings: what a run says before it starts (an unverified prepared corpus), one line each.
      packed: the splits are `train.data.packing.Packed` rows of documents (a chat JSONL corpus,
        `open_chat_corpus`), not token streams.
    """

    train: Any
    val: Any
    tokenizer: Any
    path: str
    prepared: dict | None = None
    warnings: tuple[str, ...] = ()
    packed: bool = False


def load_corpus(path: str | os.PathLike | None = None, *, tokenizer: str | Tokenizer = "char",
                val_fraction: float = 0.1, min_split_tokens: int = 2) -> Corpus:
    """Reads, tokenizes and splits the corpus (nanoGPT: first 90% train, last 10% val)."""
    if not 0.0 < val_fraction < 1.0:
        raise ValueError(f"val_fraction must be in (0, 1), got {val_fraction}")
    file = resolve_data_path(path)
    text = read_text(file)
    tok = build_tokenizer(tokenizer, text) if isinstance(tokenizer, str) else tokenizer
    ids = tok.encode(text)
    n_train = int(len(ids) * (1.0 - val_fraction))
    train, val = ids[:n_train], ids[n_train:]
    if min(len(train), len(val)) < min_split_tokens:
        raise DataError(f"data file {str(file)!r} is too short ({len(ids)} tokens) to split into "
                        f"train and val with at least {min_split_tokens} tokens each")
    return Corpus(train=train, val=val, tokenizer=tok, path=str(file))


def verify_mode(resume: bool) -> str:
    """How a run verifies a prepared corpus's shards: JAXATTN_VERIFY_SHARDS (full or quick) when set,
    else "full" when it starts and "quick" when it resumes; UsageError for another value."""
    value = os.environ.get(ENV_VERIFY, "").strip()
    if not value:
        return "quick" if resume else "full"
    if value not in VERIFY_MODES:
        raise UsageError(f"{ENV_VERIFY}={value!r}: expected full (hash every shard) or quick (the ends of each "
                         "shard), or unset (full when a run starts, quick when it resumes)")
    return value


def open_corpus(path: str | os.PathLike | None = None, *, tokenizer: str | Tokenizer = "char",
                val_fraction: float = 0.1, verify: str = "full") -> Corpus:
    """The corpus of a run: a prepared directory (`python -m train.prepare`), whose shards are read
    as the run goes, or a text file read and tokenized now (`load_corpus`).

    A prepared directory fixes its tokenizer and split: DataError when its tokenizer kind is not
    `tokenizer` (the run's `train.tokenizer`), or the directory is not a whole prepared corpus, or a
    shard is not the one its manifest pins (`verify`: "full" or "quick", `train.data.shards.verify_shards`).
    `tokenizer` may be a Tokenizer itself (a fine-tuning run's, its checkpoint's: `train.init_from`): a
    text file is encoded with it, and a prepared directory must have been prepared with it.
    """
    if not isinstance(tokenizer, str):
        return _corpus_of_tokenizer(path, tokenizer, val_fraction, verify)
    if path is not None and Path(path).expanduser().is_dir():
        return _prepared_corpus(Path(path).expanduser(), tokenizer, verify)
    if tokenizer not in ("char", "byte"):
        raise DataError(f"train.tokenizer = {tokenizer!r} needs a prepared corpus: python -m train.prepare "
                        f"--data FILE_OR_DIR --tokenizer {'bpe:VOCAB' if tokenizer == 'bpe' else 'hf:DIR'} "
                        "--out DIR, then --data DIR")
    return load_corpus(path, tokenizer=tokenizer, val_fraction=val_fraction)


def _corpus_of_tokenizer(path, tokenizer: Tokenizer, val_fraction: float, verify: str) -> Corpus:
    """`open_corpus` with the tokenizer given: a text file encoded with it, a prepared directory checked to be
    prepared with it (the same tokenizer.json), else DataError naming both."""
    if path is None or not Path(path).expanduser().is_dir():
        return load_corpus(path, tokenizer=tokenizer, val_fraction=val_fraction)
    corpus = _prepared_corpus(Path(path).expanduser(), tokenizer.kind, verify)
    if corpus.tokenizer != tokenizer:
        raise DataError(f"the prepared corpus {path} was prepared with another tokenizer than the checkpoint's "
                        f"({corpus.tokenizer.vocab_size} ids, the checkpoint's {tokenizer.vocab_size}): prepare it "
                        "again with python -m train.prepare --tokenizer hf:DIR, DIR the checkpoint's directory")
    return corpus


def _prepared_corpus(directory: Path, tokenizer: str, verify: str) -> Corpus:
    prepared = open_prepared(directory)
    if prepared.tokenizer_kind != tokenizer:
        raise DataError(f"the prepared corpus {directory} has a {prepared.tokenizer_kind} tokenizer and "
                        f"train.tokenizer is {tokenizer!r}: set train.tokenizer = \"{prepared.tokenizer_kind}\" "
                        f"(--set train.tokenizer={prepared.tokenizer_kind})")
    verify_shards(prepared, verify)
    unverified = prepared.unverified_warning()
    vocab = prepared.vocab_size
    return Corpus(train=ShardStream.of_maps(prepared.train, vocab), val=ShardStream.of_maps(prepared.val, vocab),
                  tokenizer=prepared.tokenizer, path=str(directory), prepared=prepared.manifest,
                  warnings=() if unverified is None else (unverified,))


def is_chat_file(path: str | os.PathLike | None) -> bool:
    """Whether a run's data path is a chat JSONL file (`open_chat_corpus`), by its suffix."""
    return path is not None and Path(path).suffix == CHAT_SUFFIX


def open_chat_corpus(path: str | os.PathLike, tokenizer: Tokenizer, template, *, block_size: int,
                     val_fraction: float, train_on: str, seed: int, long_chats: str = "split") -> Corpus:
    """A chat JSONL file (`train.data.chats.read_chat_jsonl`) as a packed corpus: each conversation
    rendered with `template` (the checkpoint's chat template) and weighted by `train_on` ("assistant": the
    assistant's turns alone, or "all"), the conversations longer than a row split, dropped or refused
    (`long_chats`: `fit_long_chats`), the last `val_fraction` of them (at least one) held out, each split
    packed into rows of `block_size` predictions.

    DataError naming the file (and line) for a bad line, a file of fewer than two conversations, a
    checkpoint without a chat template, or a long conversation with `long_chats="error"`."""
    if template is None:
        raise DataError(f"{path}: chat data is rendered with the checkpoint's chat template, and train.init_from "
                        "has none (a chat_template.jinja, or tokenizer_config.json's chat_template)")
    documents, warnings = fit_long_chats(chat_documents(path, template, tokenizer, train_on=train_on), block_size,
                                         long_chats, path)
    if len(documents) < 2:
        raise DataError(f"{path}: {len(documents)} conversation(s): a run needs at least two, one to hold out")
    held_out = max(1, round(len(documents) * val_fraction))
    train = pack(documents[:-held_out], block_size, seed=seed)
    val = pack(documents[-held_out:], block_size, seed=seed)
    counted = float(np.sum(train.weights))
    if counted == 0:
        raise DataError(f"{path}: no training token counts toward the loss (train.train_on={train_on!r})")
    return Corpus(train=train, val=val, tokenizer=tokenizer, path=str(path), packed=True, warnings=tuple(warnings))


def fit_long_chats(documents: list, block_size: int, mode: str, path) -> tuple[list, list[str]]:
    """The conversations longer than a row's `block_size + 1` tokens, as `mode` says: "split" (kept: packing
    splits them), "drop" (left out) or "error" (DataError naming the first) -> (documents, warnings). A warning
    says how many, the longest, and for "split" the share of the counted predictions (tokens of weight > 0)
    made in a piece after the first, which sees none of the conversation before its piece."""
    limit = block_size + 1
    long = [i for i, (ids, _) in enumerate(documents) if len(ids) > limit]
    if not long:
        return documents, []
    longest = max(len(documents[i][0]) for i in long)
    what = (f"{path}: {len(long)} of {len(documents)} conversations are longer than train.block_size + 1 = {limit} "
            f"tokens (the longest {longest:,})")
    if mode == "error":
        raise DataError(f"{what}; conversation {long[0] + 1} is the first (train.long_chats = \"error\"): raise "
                        "train.block_size, or set train.long_chats = \"split\" or \"drop\"")
    if mode == "drop":
        dropped = set(long)
        return [d for i, d in enumerate(documents) if i not in dropped], [f"{what}: left out (train.long_chats = \"drop\")"]
    counted = sum(float(np.sum(np.asarray(weights)[1:])) for _, weights in documents)
    cut = sum(float(np.sum(np.asarray(documents[i][1])[limit:])) for i in long)
    return documents, [f"{what}: split into pieces of {limit}, and {cut / max(counted, 1):.1%} of the predictions that "
                       "count toward the loss lose the conversation's beginning; raise train.block_size, or set "
                       "train.long_chats = \"drop\" or \"error\""]


def describe(corpus: Corpus) -> str:
    """"PATH, N train / M val tokens", with a prepared corpus's tokenizer and its hash; for a packed
    corpus its rows, how full they are and how many predictions count."""
    if corpus.packed:
        train, val = corpus.train, corpus.val
        return (f"{corpus.path}, packed: {len(train.inputs):,} train / {len(val.inputs):,} val rows of "
                f"{train.inputs.shape[1]} tokens, {100 * train.efficiency:.0f}% full, "
                f"{int(np.sum(train.weights)):,} training predictions counted")
    counts = f"{len(corpus.train):,} train / {len(corpus.val):,} val tokens"
    if corpus.prepared is None:
        return f"{corpus.path}, {counts}"
    tok = corpus.prepared["tokenizer"]
    return (f"{corpus.path}, prepared: {tok['spec']} tokenizer of {tok['vocab_size']:,} ids, hash {tok['hash']}, "
            f"{counts}")


def unused_settings(corpus: Corpus, tc) -> list[str]:
    """Warnings for the `TrainConfig` settings a prepared corpus overrides (its split is fixed)."""
    if corpus.prepared is None:
        return []
    kept = corpus.prepared["split"]["val_fraction"]
    return [] if kept == tc.val_fraction else [
        f"train.val_fraction={tc.val_fraction} is not used: the prepared corpus {corpus.path} keeps its split "
        f"(val_fraction {kept}, python -m train.prepare --val-fraction)"]


def check_block_size(corpus: Corpus, block_size: int) -> None:
    """Each split must hold one input block plus its shifted target (a packed corpus's rows are of it)."""
    if corpus.packed:
        return
    shortest = min(len(corpus.train), len(corpus.val))
    if shortest < block_size + 1:
        raise DataError(f"the corpus splits (train {len(corpus.train)}, val {len(corpus.val)} tokens) "
                        f"are shorter than block_size + 1 = {block_size + 1}")
