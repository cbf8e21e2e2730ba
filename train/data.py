"""The training corpus: where it comes from, how it is split and how batches are drawn.

Resolution of the text file, first match wins:
  1. an explicit path (`--data PATH` or `train.data_path` in the config);
  2. the environment variable JAXATTN_SHAKESPEARE (the Makefile sets it when the
     workplace copy exists);
  3. the cache: $XDG_CACHE_HOME/jaxattn/tinyshakespeare.txt (default ~/.cache/jaxattn);
  4. a download of Tiny Shakespeare into the cache, checked against its sha256.

Batches are a pure function of (seed, split, step), computed on device inside the
jitted step, so a resumed run sees exactly the batches an uninterrupted run sees.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import jax
import numpy as np

from train.tokenizer import Tokenizer, build_tokenizer

SHAKESPEARE_URL = (
    "https://raw.githubusercontent.com/karpathy/char-rnn/master/data/tinyshakespeare/input.txt")
SHAKESPEARE_SHA256 = "86c4e6aa9db7c042ec79f339dcb96d42b0075e16b8fc2e86bf0ca57e2dc565ed"
SHAKESPEARE_FILENAME = "tinyshakespeare.txt"
ENV_PATH = "JAXATTN_SHAKESPEARE"
ENV_URL = "JAXATTN_SHAKESPEARE_URL"

TRAIN, VAL = 0, 1  # split ids folded into the batch rng


class DataError(ValueError):
    """The corpus cannot be found, fetched or read."""


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
    """The corpus file, following the resolution order of this module's docstring."""
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
    """A tokenized text split into train (first part) and val (last part) int32 id arrays."""

    train: np.ndarray
    val: np.ndarray
    tokenizer: Tokenizer
    path: str


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


def check_block_size(corpus: Corpus, block_size: int) -> None:
    """Each split must hold one input block plus its shifted target."""
    shortest = min(len(corpus.train), len(corpus.val))
    if shortest < block_size + 1:
        raise DataError(f"the corpus splits (train {len(corpus.train)}, val {len(corpus.val)} tokens) "
                        f"are shorter than block_size + 1 = {block_size + 1}")


def batch_key(seed: int | jax.Array, split: int, step: int | jax.Array) -> jax.Array:
    """The rng of batch `step` of `split`: a pure function of (seed, split, step)."""
    key = jax.random.fold_in(jax.random.PRNGKey(seed), split)
    return jax.random.fold_in(key, step)


def get_batch(data: jax.Array, key: jax.Array, batch_size: int,
              block_size: int) -> tuple[jax.Array, jax.Array]:
    """Random windows of `data` [N]: inputs and next-token targets, both [batch_size, block_size]."""
    starts = jax.random.randint(key, (batch_size,), 0, data.shape[0] - block_size)
    window = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (block_size + 1,)))(starts)
    return window[:, :-1], window[:, 1:]  # [B, T], [B, T]


def windows_at(data: jax.Array, starts: jax.Array, block_size: int) -> tuple[jax.Array, jax.Array]:
    """The windows of `data` [N] beginning at `starts` [R]: inputs and targets, both [R, block_size]."""
    window = jax.vmap(lambda s: jax.lax.dynamic_slice(data, (s,), (block_size + 1,)))(starts)
    return window[:, :-1], window[:, 1:]


def whole_split_windows(num_tokens: int, block_size: int, rows: int) -> tuple[np.ndarray, np.ndarray]:
    """Windows that predict every token of a split once: starts `[batches, rows]` and target weights
    `[batches, rows, block_size]` (1 = counted).

    Windows begin at 0, T, 2T, ...; the tokens after the last whole window are predicted by one more
    window ending at the split's end, counting only those. Padding windows (weight 0) fill the last row
    group. The weighted mean of the losses is the split's loss over its `num_tokens - 1` targets.
    """
    if num_tokens <= block_size:
        raise ValueError(f"a split of {num_tokens} tokens has no window of block_size={block_size} + 1")
    starts = list(range(0, num_tokens - block_size, block_size))
    weights = [np.ones(block_size, np.float32) for _ in starts]
    left = num_tokens - 1 - (starts[-1] + block_size)  # targets after the last whole window
    if left > 0:
        starts.append(num_tokens - 1 - block_size)
        weights.append((np.arange(block_size) >= block_size - left).astype(np.float32))
    pad = -len(starts) % rows
    starts += [0] * pad
    weights += [np.zeros(block_size, np.float32)] * pad
    return (np.asarray(starts, np.int32).reshape(-1, rows),
            np.stack(weights).reshape(-1, rows, block_size))
