"""A prepared corpus on disk (written by `python -m train.prepare`, read with memory maps) and its checks.

A prepared directory holds:

* `train_00000.bin`, `train_00001.bin`, ... and `val_00000.bin`, ...: token shards
  (`train.data.shard_format`). The concatenation of a split's shards, in name order, is that
  split's token stream.
* `tokenizer.json`: the tokenizer. Its kind is named in the manifest: `char` and `byte` are this
  project's own JSON (`train.data.tokenizer.to_json`), `bpe` (trained by `train.prepare`) and `hf`
  (copied from a directory) are a Hugging Face `tokenizers` tokenizer.json. Every shard header
  carries the hash of its canonical JSON (`shard_format.tokenizer_hash`).
* `prepared.json`: the manifest (format version, tokenizer kind, hash and vocabulary size, the
  dtype, the split rule and val fraction, the token count of each split and its shards, the source
  files with their sizes and token counts). It is what tells the loader how to read tokenizer.json,
  and it pins each shard: its name, size, token count, the sha256 of its body (the bytes after the
  header) and the sha256 of the first and last ENDS_BYTES of its body (`shard_format.shard_record`).
  Manifests written before the checksums name their shards only; they load unverified
  (`PreparedCorpus.verified`).

Every failure to read a prepared directory is a `train.data.errors.DataError` with one line naming
the file. `open_prepared` checks what costs no reading: the headers against tokenizer.json and the
manifest, the shards' names and sizes against the manifest. `verify_shards` reads: "full" hashes
every body and compares it with the manifest, "quick" only the ends of each body (which tell renamed
or swapped shards apart, not a flipped bit in the middle).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shlex
import sys
from pathlib import Path
from typing import Any

import numpy as np

from train.data.errors import DataError
from train.data.shard_format import (
    CHECKSUM,
    ENDS_BYTES,
    HEADER_SIZE,
    SHARD_NAME,
    SPLITS,
    ShardHeader,
    body_digest,
    ends_digest,
    hash_bytes,
    read_header,
    shard_name,
    tokenizer_hash,
)
from train.data.tokenizer import JSONTokenizer, from_json

MANIFEST = "prepared.json"
TOKENIZER = "tokenizer.json"
TOKENIZER_KINDS = ("char", "byte", "bpe", "hf")
VERIFY_MODES = ("full", "quick")
DEFAULT_SHARD_TOKENS = 100_000_000  # python -m train.prepare --shard-tokens
DEFAULT_VAL_FRACTION = 0.1  # python -m train.prepare --val-fraction


@dataclasses.dataclass(frozen=True)
class PreparedCorpus:
    """A prepared directory opened for reading: each split is a list of shard memory maps.

    Attributes:
      directory: the prepared directory.
      tokenizer: a `train.data.tokenizer.CharTokenizer` or `ByteTokenizer` (kind char, byte) or a
        `train.data.tokenizer.JSONTokenizer` of tokenizer.json (kind bpe, hf): what a run stores in its
        checkpoints.
      tokenizer_kind: "char", "byte", "bpe" or "hf".
      tokenizer_hash: the 16-byte hash every shard header carries.
      vocab_size: the tokenizer's vocabulary size (ids are below it).
      train, val: the shards of each split, in order; their concatenation is the split's stream.
      manifest: prepared.json as read.
    """

    directory: Path
    tokenizer: Any
    tokenizer_kind: str
    tokenizer_hash: bytes
    vocab_size: int
    train: list[np.memmap]
    val: list[np.memmap]
    manifest: dict[str, Any]

    @property
    def train_tokens(self) -> int:
        return sum(len(s) for s in self.train)

    @property
    def val_tokens(self) -> int:
        return sum(len(s) for s in self.val)

    def stream(self, split: str) -> np.ndarray:
        """The whole stream of `split` as one int64 array in memory (tests and small corpora only)."""
        return np.concatenate([np.asarray(s, dtype=np.int64) for s in getattr(self, split)])

    @property
    def verified(self) -> bool:
        """Whether the manifest pins each shard's checksum (False: written before it did)."""
        return _has_checksums(self.manifest)

    def unverified_warning(self) -> str | None:
        """The one line a run warns with when the shards cannot be verified (None when they can)."""
        if self.verified:
            return None
        return (f"the prepared corpus {self.directory} has no shard checksums ({MANIFEST} was written by an "
                f"older jaxattn): its shards are not verified, only the ids of the windows a run reads; to "
                f"verify them, prepare it again: {prepare_command(self.directory, self.manifest)}")


def shard_paths(directory: str | os.PathLike, split: str) -> list[Path]:
    """The shards of `split` in `directory`, in order; DataError if their numbers are not 0, 1, 2, ..."""
    directory = Path(directory)
    found = sorted(p for p in directory.iterdir() if (m := SHARD_NAME.match(p.name)) and m.group(1) == split)
    for index, path in enumerate(found):
        if path.name != shard_name(split, index):
            raise DataError(f"prepared corpus {directory}: {shard_name(split, index)} is missing "
                            f"(the {split} shards go on with {path.name})")
    return found


def _read_manifest(directory: Path) -> dict[str, Any]:
    path = directory / MANIFEST
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise DataError(f"prepared corpus {directory} has shards but no {MANIFEST} "
                        "(prepare it again with python -m train.prepare)") from None
    except (OSError, ValueError) as err:
        raise DataError(f"{path} cannot be read as JSON: {err}") from None
    kind = manifest.get("tokenizer", {}).get("kind") if isinstance(manifest, dict) else None
    if kind not in TOKENIZER_KINDS:
        raise DataError(f"{path}: tokenizer.kind must be one of {TOKENIZER_KINDS}, got {kind!r}")
    return manifest


def _load_tokenizer(directory: Path, kind: str, text: str):
    path = directory / TOKENIZER
    try:
        if kind in ("char", "byte"):
            tokenizer = from_json(text)
            if tokenizer.kind != kind:
                raise ValueError(f"it holds a {tokenizer.kind} tokenizer, but {MANIFEST} says {kind}")
            return tokenizer
        return JSONTokenizer(kind, text)
    except Exception as err:  # noqa: BLE001: unreadable JSON, or no `tokenizers` package
        raise DataError(f"{path} is not a {kind} tokenizer this jaxattn reads: {err}") from None


def _has_checksums(manifest: dict[str, Any]) -> bool:
    return all(isinstance(manifest.get(split), dict) and isinstance(manifest[split].get("shards"), list)
               and all(isinstance(entry, dict) for entry in manifest[split]["shards"]) for split in SPLITS)


def prepare_command(directory: str | os.PathLike, manifest: dict[str, Any]) -> str:
    """The `python -m train.prepare` command that writes `directory` again from its manifest's source."""
    spec = manifest.get("tokenizer", {}).get("spec") or manifest.get("tokenizer", {}).get("kind")
    words = ["python -m train.prepare --data", shlex.quote(str(manifest.get("source", "SOURCE"))),
             "--tokenizer", shlex.quote(str(spec)), "--out", shlex.quote(str(directory))]
    shard_tokens = manifest.get("shard_tokens", DEFAULT_SHARD_TOKENS)
    val_fraction = manifest.get("split", {}).get("val_fraction", DEFAULT_VAL_FRACTION)
    words += [] if shard_tokens == DEFAULT_SHARD_TOKENS else ["--shard-tokens", str(shard_tokens)]
    words += [] if val_fraction == DEFAULT_VAL_FRACTION else ["--val-fraction", str(val_fraction)]
    return " ".join(words + ["--overwrite"])


def _check_manifest_against_headers(directory: Path, manifest: dict[str, Any], headers: dict[str, list[ShardHeader]],
                                    tokenizer_vocab: int) -> None:
    """The vocabulary and dtype prepared.json states against the shards' headers (which tokenizer.json
    confirms), and the shards it names against those on disk: DataError saying which one is wrong."""
    first = headers["train"][0]
    said_vocab = manifest["tokenizer"].get("vocab_size")
    if said_vocab != first.vocab_size:
        raise DataError(f"{directory / MANIFEST} is wrong: its tokenizer.vocab_size is {said_vocab!r}, but "
                        f"{TOKENIZER} and every shard header say {tokenizer_vocab} (prepared.json was edited or "
                        f"comes from another corpus; prepare the corpus again)")
    if manifest.get("dtype") != first.dtype.name:
        raise DataError(f"{directory / MANIFEST} is wrong: its dtype is {manifest.get('dtype')!r}, but every shard "
                        f"header says {first.dtype.name} (the dtype of a vocabulary of {first.vocab_size} ids; "
                        f"prepared.json was edited or comes from another corpus; prepare the corpus again)")
    for split in SPLITS:
        named = manifest.get(split, {}).get("shards") if isinstance(manifest.get(split), dict) else None
        if not isinstance(named, list):
            continue  # an older manifest may lack the list: the token counts are still checked
        names = [entry.get("name") if isinstance(entry, dict) else entry for entry in named]
        on_disk = [h.path.name for h in headers[split]]
        if names != on_disk:
            extra, missing = sorted(set(on_disk) - set(names)), [str(n) for n in names if n not in on_disk]
            what = (f"{missing[0]}, which it names, is missing" if missing else
                    f"{extra[0]} is not one of the {split} shards it names ({', '.join(map(str, names[:3]))}"
                    f"{', ...' if len(names) > 3 else ''})")
            raise DataError(f"prepared corpus {directory} does not hold the {split} shards {MANIFEST} names: "
                            f"{what} (restore it, or prepare the corpus again)")
        entries = [e for e in named if isinstance(e, dict)]
        for header, entry in zip(headers[split], entries):
            body = header.count * header.dtype.itemsize
            size = HEADER_SIZE + body
            if entry.get("bytes") != size:
                raise DataError(_not_the_shard(directory, manifest, header.path, f"ends_{CHECKSUM}",
                                               lambda: ends_digest(header.path, body, _ends_bytes(manifest)),
                                               f"it is {size} bytes ({header.count} tokens), {MANIFEST} says "
                                               f"{entry.get('bytes')} ({entry.get('tokens')} tokens)"))


def _ends_bytes(manifest: dict[str, Any]) -> int:
    return int(manifest.get("checksums", {}).get("ends_bytes", ENDS_BYTES))


def _not_the_shard(directory: Path, manifest: dict[str, Any], path: Path, key: str, digest, why: str) -> str:
    """The line for a shard that is not the one the manifest pins under its name: when its `key` digest
    is another shard's, the shards were renamed or swapped; else it was damaged or changed."""
    try:
        found = digest()
    except OSError:
        found = None
    for entry in (e for split in SPLITS for e in manifest[split]["shards"] if isinstance(e, dict)):
        if found is not None and entry.get(key) == found and entry.get("name") != path.name:
            return (f"prepared corpus {directory}: {path.name} holds what {MANIFEST} says {entry['name']} "
                    f"holds: its shards were renamed or swapped after they were prepared (put them back, or "
                    f"prepare the corpus again: {prepare_command(directory, manifest)})")
    return (f"shard {path} is not the one {MANIFEST} pins: {why}; it was damaged, replaced or changed after it "
            f"was prepared (prepare the corpus again: {prepare_command(directory, manifest)})")


def verify_shards(prepared: PreparedCorpus, mode: str = "full", *, progress: bool = True) -> None:
    """Reads the shards of `prepared` and compares them with the checksums its manifest pins.

    "full": the sha256 of every shard's body (every byte of the corpus; a progress bar on stderr
    when it is a terminal); "quick": the sha256 of the first and last ENDS_BYTES of each body, which
    tells shards that were renamed, swapped or replaced from the right ones but not a flipped bit in
    the middle of one. DataError (one line naming the shard) for the first shard that differs; nothing
    is read for a manifest without checksums (`PreparedCorpus.verified`).
    """
    if mode not in VERIFY_MODES:
        raise ValueError(f"mode must be one of {VERIFY_MODES}, got {mode!r}")
    if not prepared.verified:
        return
    manifest, directory = prepared.manifest, prepared.directory
    shards = [(directory / entry["name"], entry) for split in SPLITS for entry in manifest[split]["shards"]]
    if mode == "quick":
        ends = _ends_bytes(manifest)
        for path, entry in shards:
            body = entry["bytes"] - HEADER_SIZE
            found = lambda: ends_digest(path, body, ends)  # noqa: E731
            if found() != entry.get(f"ends_{CHECKSUM}"):
                raise DataError(_not_the_shard(directory, manifest, path, f"ends_{CHECKSUM}", found,
                                               f"the {CHECKSUM} of the ends of its tokens differs"))
        return
    from tqdm import tqdm
    total = sum(entry["bytes"] - HEADER_SIZE for _, entry in shards)
    with tqdm(total=total, unit="B", unit_scale=True, desc=f"verifying {directory.name} ({CHECKSUM})",
              file=sys.stderr, disable=None if progress else True, dynamic_ncols=True, leave=False) as bar:
        for path, entry in shards:
            digest = body_digest(path, bar.update)
            if digest != entry.get(CHECKSUM):
                raise DataError(_not_the_shard(directory, manifest, path, CHECKSUM, lambda: digest,
                                               f"the {CHECKSUM} of its tokens is {digest[:16]}..., {MANIFEST} "
                                               f"says {str(entry.get(CHECKSUM))[:16]}..."))


def _one_tokenizer(directory: Path, headers: dict[str, list[ShardHeader]]) -> ShardHeader:
    """The first train shard's header, once every shard's has its tokenizer hash and vocabulary; DataError
    naming the first shard that differs."""
    first = headers["train"][0]
    for header in headers["train"] + headers["val"]:
        if header.tokenizer_hash != first.tokenizer_hash:
            raise DataError(f"prepared corpus {directory} mixes tokenizers: {header.path.name} has tokenizer "
                            f"hash {header.tokenizer_hash.hex()}, {first.path.name} {first.tokenizer_hash.hex()}")
        if header.vocab_size != first.vocab_size:
            raise DataError(f"prepared corpus {directory} mixes vocabularies: {header.path.name} has "
                            f"{header.vocab_size} ids, {first.path.name} {first.vocab_size}")
    return first


def open_prepared(directory: str | os.PathLike,
                  expected_tokenizer_hash: bytes | str | None = None) -> PreparedCorpus:
    """Opens a prepared directory: checks every shard header against tokenizer.json and the manifest.

    DataError (one line naming the file) for: a missing directory, no shards of a split, a gap in
    the shard numbers, a damaged or truncated shard, shards of different tokenizers or
    vocabularies, a tokenizer.json whose hash is not the shards', a manifest whose vocabulary or
    dtype is not the headers', shards whose names or sizes are not those the manifest pins, a token
    count that is not the manifest's, or a tokenizer other than `expected_tokenizer_hash` (16 bytes
    or 32 hex digits). Nothing but the headers is read: `verify_shards` compares the shards' bytes
    with their checksums.
    """
    directory = Path(directory)
    if not directory.is_dir():
        raise DataError(f"prepared corpus {directory} is not a directory (make one with python -m train.prepare)")
    paths = {split: shard_paths(directory, split) for split in SPLITS}
    for split in SPLITS:
        if not paths[split]:
            raise DataError(f"prepared corpus {directory} has no {split} shards ({split}_00000.bin ...): "
                            "make it with python -m train.prepare")
    manifest = _read_manifest(directory)
    try:
        text = (directory / TOKENIZER).read_text(encoding="utf-8")
        hash_ = tokenizer_hash(text)
    except (OSError, ValueError) as err:
        raise DataError(f"{directory / TOKENIZER} cannot be read: {err}") from None
    kind = manifest["tokenizer"]["kind"]
    tokenizer = _load_tokenizer(directory, kind, text)
    headers = {split: [read_header(p) for p in paths[split]] for split in SPLITS}
    first = _one_tokenizer(directory, headers)
    if first.tokenizer_hash != hash_:
        raise DataError(f"the shards in {directory} were written with another tokenizer: their hash is "
                        f"{first.tokenizer_hash.hex()}, {TOKENIZER}'s is {hash_.hex()}")
    if first.vocab_size != tokenizer.vocab_size:
        said = manifest["tokenizer"].get("vocab_size")
        odd = (f"; {MANIFEST} says {said}: the shards' headers are the wrong ones" if said == tokenizer.vocab_size
               else f"; {MANIFEST} says {said}: {TOKENIZER} is the wrong one" if said == first.vocab_size else "")
        raise DataError(f"the shards in {directory} have a vocabulary of {first.vocab_size}, "
                        f"{TOKENIZER} one of {tokenizer.vocab_size}{odd}")
    if expected_tokenizer_hash is not None and hash_bytes(expected_tokenizer_hash) != hash_:
        raise DataError(f"prepared corpus {directory} was made with another tokenizer (hash {hash_.hex()}, "
                        f"expected {hash_bytes(expected_tokenizer_hash).hex()})")
    _check_manifest_against_headers(directory, manifest, headers, tokenizer.vocab_size)
    for split in SPLITS:
        counted = sum(h.count for h in headers[split])
        said = manifest.get(split, {}).get("tokens")
        if said != counted:
            raise DataError(f"prepared corpus {directory}: its {split} shards hold {counted} tokens, "
                            f"{MANIFEST} says {said}")
    maps = {split: [np.memmap(h.path, dtype=h.dtype, mode="r", offset=HEADER_SIZE, shape=(h.count,))
                    for h in headers[split]] for split in SPLITS}
    return PreparedCorpus(directory, tokenizer, kind, hash_, first.vocab_size, maps["train"], maps["val"],
                          manifest)
