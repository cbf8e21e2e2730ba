"""One token shard: its bytes on disk, written (one shard, or a split streamed into many) and read back.

A shard is a fixed 64-byte little-endian header, then `count` tokens of its dtype (no padding):

    offset size  field
    0      8     magic b"JXATTOK1"
    8      2     header version (1)
    10     2     dtype code: 2 = uint16, 4 = uint32 (the itemsize)
    12     4     vocabulary size
    16     8     token count
    24     16    tokenizer hash: sha256 of tokenizer.json's canonical JSON, first 16 bytes
    40     24    reserved, zero

uint16 when the vocabulary has at most 65536 ids, else uint32. The canonical JSON of a tokenizer
is its JSON parsed and written again with sorted keys, no spaces and UTF-8 (`canonical_json`), so
the hash does not depend on how a file was indented. A shard that cannot be read is a
`train.data.errors.DataError` with one line naming it.

The checksums a manifest pins of each shard (`shard_record`) are computed here: the sha256 of its
body, the bytes after the header (`body_digest`), and of the first and last ENDS_BYTES of its body
(`ends_digest`). A prepared directory of shards, its manifest and their checks: `train.data.shards`.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import struct
from pathlib import Path
from typing import Any

import numpy as np

from train.data.errors import DataError
from train.data.tokenizer import canonical_json  # what the hash is of

MAGIC = b"JXATTOK1"
VERSION = 1
HEADER = struct.Struct("<8sHHIQ16s24x")  # 64 bytes: the tokens start 64-byte aligned
HEADER_SIZE = HEADER.size
DTYPES = {2: np.dtype("<u2"), 4: np.dtype("<u4")}  # dtype code (= itemsize) -> dtype
MAX_UINT16_VOCAB = 1 << 16
MAX_VOCAB = (1 << 32) - 1  # the header's field
HASH_BYTES = 16
SPLITS = ("train", "val")
SHARD_NAME = re.compile(r"^(train|val)_(\d{5})\.bin$")
CHECKSUM = "sha256"  # of each shard's body: as fast as any stdlib hash where the CPU has SHA instructions
# (docs/performance.md, "Input")
ENDS_BYTES = 1 << 16  # the quick check hashes the first and the last ENDS_BYTES of each body
READ_CHUNK = 1 << 23  # bytes hashed at a time


def dtype_for(vocab_size: int) -> np.dtype:
    """uint16 when every id of a `vocab_size` vocabulary fits, else uint32."""
    if not 0 < vocab_size <= MAX_VOCAB:
        raise ValueError(f"vocab_size must be in [1, {MAX_VOCAB}], got {vocab_size}")
    return DTYPES[2] if vocab_size <= MAX_UINT16_VOCAB else DTYPES[4]


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:05d}.bin"


def tokenizer_hash(tokenizer_json: str | dict[str, Any]) -> bytes:
    """The 16-byte hash a shard header carries: sha256 of the tokenizer's canonical JSON, truncated."""
    return hashlib.sha256(canonical_json(tokenizer_json)).digest()[:HASH_BYTES]


def hash_bytes(value: bytes | str) -> bytes:
    """A hash given as 16 bytes or as 32 hex digits, as bytes."""
    raw = bytes.fromhex(value) if isinstance(value, str) else bytes(value)
    if len(raw) != HASH_BYTES:
        raise ValueError(f"a tokenizer hash is {HASH_BYTES} bytes ({2 * HASH_BYTES} hex digits), got {value!r}")
    return raw


@dataclasses.dataclass(frozen=True)
class ShardHeader:
    """A shard's header: `count` tokens of `dtype` at offset HEADER_SIZE of `path`."""

    path: Path
    version: int
    dtype: np.dtype
    vocab_size: int
    count: int
    tokenizer_hash: bytes


def _pack(dtype: np.dtype, vocab_size: int, count: int, hash_: bytes) -> bytes:
    return HEADER.pack(MAGIC, VERSION, dtype.itemsize, vocab_size, count, hash_bytes(hash_))


def _as_ids(tokens, vocab_size: int, dtype: np.dtype, where: str) -> np.ndarray:
    """`tokens` as a 1-D array of `dtype`; ValueError for ids outside [0, vocab_size)."""
    ids = np.asarray(tokens)
    if ids.ndim != 1 or not (ids.size == 0 or np.issubdtype(ids.dtype, np.integer)):
        raise ValueError(f"{where}: tokens must be a 1-D integer array, got {ids.dtype} {ids.shape}")
    if ids.size and (int(ids.min()) < 0 or int(ids.max()) >= vocab_size):
        raise ValueError(f"{where}: token ids {int(ids.min())}..{int(ids.max())} are outside the "
                         f"vocabulary [0, {vocab_size})")
    return ids.astype(dtype, copy=False)


def write_shard(path: str | os.PathLike, tokens, vocab_size: int, tokenizer_hash: bytes | str) -> Path:
    """Writes `tokens` (1-D, ids in [0, vocab_size), at least one) as a shard at `path`, atomically."""
    path, dtype = Path(path), dtype_for(vocab_size)
    ids = _as_ids(tokens, vocab_size, dtype, str(path))
    if ids.size == 0:
        raise ValueError(f"{path}: a shard holds at least one token")
    part = path.with_name(path.name + ".part")
    with open(part, "wb") as f:
        f.write(_pack(dtype, vocab_size, ids.size, tokenizer_hash))
        ids.tofile(f)
    os.replace(part, path)
    return path


def _body_hasher():
    return hashlib.new(CHECKSUM)


def ends_digest(path: str | os.PathLike, body_bytes: int, ends_bytes: int | None = None) -> str:
    """The hex sha256 of the first and the last `ends_bytes` (default ENDS_BYTES) of a shard's body of
    `body_bytes` bytes (of the whole body when it is at most twice that long): what the quick check compares."""
    ends_bytes = ENDS_BYTES if ends_bytes is None else ends_bytes
    digest = _body_hasher()
    with open(path, "rb") as f:
        if body_bytes <= 2 * ends_bytes:
            digest.update(os.pread(f.fileno(), body_bytes, HEADER_SIZE))
        else:
            digest.update(os.pread(f.fileno(), ends_bytes, HEADER_SIZE))
            digest.update(os.pread(f.fileno(), ends_bytes, HEADER_SIZE + body_bytes - ends_bytes))
    return digest.hexdigest()


def body_digest(path: str | os.PathLike, progress=None) -> str:
    """The hex sha256 of a shard's body (every byte after its header), read in chunks of READ_CHUNK;
    `progress(n)` is called with the bytes hashed."""
    digest, buffer = _body_hasher(), bytearray(READ_CHUNK)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as f:
        f.seek(HEADER_SIZE)
        while n := f.readinto(buffer):
            digest.update(view[:n])
            if progress is not None:
                progress(n)
    return digest.hexdigest()


def shard_record(path: str | os.PathLike, body_sha256: str | None = None) -> dict[str, Any]:
    """What the manifest pins of the shard at `path`: its name, size in bytes, token count, the sha256 of
    its body (computed unless given) and of the ends of its body (`ends_digest`)."""
    header = read_header(path)
    body = header.count * header.dtype.itemsize
    return {"name": header.path.name, "bytes": HEADER_SIZE + body, "tokens": header.count,
            CHECKSUM: body_sha256 or body_digest(path), f"ends_{CHECKSUM}": ends_digest(path, body)}


class SplitWriter:
    """Streams one split's tokens into `{split}_NNNNN.bin` shards of `shard_tokens` tokens (the last fewer).

    `write(ids)` appends; `close()` finishes the last shard and returns the shard paths. A shard is
    written as `NAME.part` and renamed once its header holds its count; no shard is ever empty. The
    body of each shard is hashed as it is written: `records` holds each finished shard's
    `shard_record`, what the manifest pins.
    """

    def __init__(self, directory: str | os.PathLike, split: str, vocab_size: int, tokenizer_hash: bytes,
                 shard_tokens: int):
        if split not in SPLITS or shard_tokens < 1:
            raise ValueError(f"split must be one of {SPLITS} and shard_tokens >= 1, got {split!r}, {shard_tokens}")
        self.directory, self.split, self.vocab_size = Path(directory), split, vocab_size
        self.hash, self.shard_tokens, self.dtype = hash_bytes(tokenizer_hash), shard_tokens, dtype_for(vocab_size)
        self.paths: list[Path] = []
        self.records: list[dict[str, Any]] = []
        self.tokens = 0
        self._file, self._in_shard, self._digest = None, 0, None

    def write(self, tokens) -> None:
        ids = _as_ids(tokens, self.vocab_size, self.dtype, f"{self.split} tokens")
        while ids.size:
            if self._file is None:
                self._open()
            take = min(ids.size, self.shard_tokens - self._in_shard)
            ids[:take].tofile(self._file)
            self._digest.update(np.ascontiguousarray(ids[:take]))
            self._in_shard += take
            self.tokens += take
            ids = ids[take:]
            if self._in_shard == self.shard_tokens:
                self._finish()

    def _open(self) -> None:
        path = self.directory / shard_name(self.split, len(self.paths))
        self._file = open(path.with_name(path.name + ".part"), "wb")
        self._file.write(_pack(self.dtype, self.vocab_size, 0, self.hash))
        self.paths.append(path)
        self._in_shard, self._digest = 0, _body_hasher()

    def _finish(self) -> None:
        self._file.seek(0)
        self._file.write(_pack(self.dtype, self.vocab_size, self._in_shard, self.hash))
        self._file.close()
        os.replace(self._file.name, self.paths[-1])
        self.records.append(shard_record(self.paths[-1], self._digest.hexdigest()))
        self._file, self._digest = None, None

    def close(self) -> list[Path]:
        if self._file is not None:
            self._finish()
        return list(self.paths)


def read_header(path: str | os.PathLike) -> ShardHeader:
    """The header of the shard at `path`, checked against the file; DataError naming it if it is no shard."""
    path = Path(path)
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            raw = f.read(HEADER_SIZE)
    except OSError as err:
        raise DataError(f"shard {path} cannot be read: {err.strerror or err}") from None
    if len(raw) < HEADER_SIZE or raw[:8] != MAGIC:
        raise DataError(f"{path} is not a token shard (no {MAGIC.decode()} header of {HEADER_SIZE} bytes)")
    magic, version, code, vocab_size, count, hash_ = HEADER.unpack(raw)
    if version != VERSION:
        raise DataError(f"shard {path} has header version {version}; this jaxattn reads version {VERSION}")
    if code not in DTYPES:
        raise DataError(f"shard {path} has dtype code {code}; known: 2 (uint16), 4 (uint32)")
    dtype = DTYPES[code]
    if vocab_size < 1 or dtype != dtype_for(vocab_size):
        raise DataError(f"shard {path} stores a vocabulary of {vocab_size} as {dtype.name}; expected "
                        f"{dtype_for(max(vocab_size, 1)).name}")
    expected = HEADER_SIZE + count * dtype.itemsize
    if size != expected:
        kind = "truncated" if size < expected else "longer than its header says"
        raise DataError(f"shard {path} is {kind}: {size} bytes, but its header of {count} {dtype.name} "
                        f"tokens needs {expected} bytes")
    if count == 0:
        raise DataError(f"shard {path} holds no tokens")
    return ShardHeader(path, version, dtype, vocab_size, count, hash_)


def open_shard(path: str | os.PathLike) -> np.memmap:
    """The tokens of a shard as a read-only memory map `[count]` (nothing is read until it is indexed)."""
    header = read_header(path)
    return np.memmap(header.path, dtype=header.dtype, mode="r", offset=HEADER_SIZE, shape=(header.count,))
