"""Reading and writing safetensors checkpoints without torch, one tensor at a time.

A Hugging Face checkpoint directory holds `model.safetensors`, or shards
listed by `model.safetensors.index.json` (`{"weight_map": {name: file}}`);
like transformers, the single file wins when both are there. `CheckpointReader`
reads and checks every file's header first (names, shapes, dtypes, byte
offsets: no tensor data), so a checkpoint can be validated before anything
is loaded, then hands out one numpy array at a time: the caller converts it
and lets it go, so peak host memory stays near one copy of the model.

Headers are checked here, before safetensors' own reader opens a file: an
empty or truncated file, a header length or header JSON that is corrupt, or a
header that lies (offsets past the end of the file, overlapping, leaving
gaps, or not `prod(shape) * itemsize` bytes long) raises `InvalidCheckpoint`
naming the file and the tensor.

bfloat16 tensors come back as `ml_dtypes.bfloat16` numpy arrays (the numpy
dtype JAX uses); importing `ml_dtypes` is what lets safetensors' numpy reader
name that dtype.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safe_open(framework="numpy"))
import numpy as np
from safetensors import SafetensorError, safe_open
from safetensors.numpy import save_file

from jaxattn._validate import is_int
from jaxattn.hf.errors import InvalidCheckpoint
from jaxattn.hf.fields import read_json_object

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"
MAX_HEADER_BYTES = 100_000_000  # safetensors' own limit
# Every dtype safetensors 0.8 writes, in bits per element (F4 and F6 pack several elements per byte).
DTYPE_BITS = {"BOOL": 8, "F4": 4, "F6_E2M3": 6, "F6_E3M2": 6, "U8": 8, "I8": 8, "F8_E5M2": 8, "F8_E4M3": 8,
              "F8_E8M0": 8, "I16": 16, "U16": 16, "F16": 16, "BF16": 16, "I32": 32, "U32": 32, "F32": 32,
              "C64": 64, "F64": 64, "I64": 64, "U64": 64}


@dataclasses.dataclass(frozen=True)
class TensorInfo:
    """One tensor's header entry: dtype (safetensors' name), shape, and byte range within the data section."""

    dtype: str
    shape: tuple[int, ...]
    begin: int
    end: int


def _header_bytes(path: Path) -> tuple[bytes, int]:
    """(the JSON header's bytes, the size of the data section after it)."""
    try:
        size = path.stat().st_size
        with open(path, "rb") as f:
            length = int.from_bytes(f.read(8), "little") if size >= 8 else 0
            raw = f.read(length) if 8 + length <= size and length <= MAX_HEADER_BYTES else b""
    except OSError as err:
        raise InvalidCheckpoint(path, None, f"cannot be read ({err.strerror or err})") from None
    if size < 8:
        raise InvalidCheckpoint(path, None, f"is {'empty' if size == 0 else f'truncated to {size} bytes'}: a "
                                "safetensors file starts with an 8-byte header length")
    if length > MAX_HEADER_BYTES or 8 + length > size:
        raise InvalidCheckpoint(path, None, f"is truncated or not a safetensors file: its first 8 bytes give a "
                                f"{length:,}-byte header, the file has {size - 8:,} bytes after them")
    return raw, size - 8 - length


def _header_json(path: Path, raw: bytes) -> dict:
    try:
        header = json.loads(raw.decode("utf-8")) if raw.startswith(b"{") else None
    except (UnicodeDecodeError, ValueError, RecursionError) as err:
        raise InvalidCheckpoint(path, None, f"has a corrupt header (not JSON: {err})") from None
    if not isinstance(header, dict):
        raise InvalidCheckpoint(path, None, "has a corrupt header (not a JSON object {...})")
    metadata = header.pop("__metadata__", None)
    if metadata is not None and not (isinstance(metadata, dict) and all(isinstance(v, str) for v in metadata.values())):
        raise InvalidCheckpoint(path, "__metadata__", "expected an object of strings in the header")
    return header


def _is_index(value) -> bool:
    return is_int(value, numpy=False) and value >= 0


def _tensor_info(path: Path, name: str, entry) -> TensorInfo:
    """One header entry, checked: a known dtype, a shape, and offsets spanning exactly its bytes."""
    def bad(problem: str) -> InvalidCheckpoint:
        return InvalidCheckpoint(path, name, f"{problem} (the header is corrupt)")
    if not isinstance(entry, dict):
        raise bad(f"header entry {json.dumps(entry)[:60]} is not an object with dtype, shape, data_offsets")
    dtype, shape, offsets = entry.get("dtype"), entry.get("shape"), entry.get("data_offsets")
    if dtype not in DTYPE_BITS:
        raise bad(f"dtype {dtype!r} is not a safetensors dtype ({', '.join(DTYPE_BITS)})")
    if not isinstance(shape, list) or not all(_is_index(n) for n in shape):
        raise bad(f"shape {shape!r} is not a list of sizes")
    if not (isinstance(offsets, list) and len(offsets) == 2 and all(map(_is_index, offsets))
            and offsets[0] <= offsets[1]):
        raise bad(f"data_offsets {offsets!r} are not [begin, end] with begin <= end")
    bits = math.prod(shape) * DTYPE_BITS[dtype]
    if bits != 8 * (offsets[1] - offsets[0]):
        raise bad(f"data_offsets {offsets} span {offsets[1] - offsets[0]:,} bytes, but shape {tuple(shape)} of "
                  f"{dtype} is {bits / 8:,g} bytes")
    return TensorInfo(dtype, tuple(shape), offsets[0], offsets[1])


def _check_coverage(path: Path, infos: dict[str, TensorInfo], data_bytes: int) -> None:
    """The tensors tile the data section exactly, as safetensors requires: no overlap, nothing past the end, no gap."""
    ordered = sorted(infos.items(), key=lambda item: (item[1].begin, item[1].end))
    where = lambda info: f"data_offsets [{info.begin}, {info.end}]"  # noqa: E731
    furthest = (None, 0)  # the tensor reaching furthest so far, and where it ends
    for name, info in ordered:
        if info.begin < furthest[1]:
            raise InvalidCheckpoint(path, name, f"{where(info)} overlap those of {furthest[0]} (the header lies)")
        furthest = max(furthest, (name, info.end), key=lambda item: item[1])
    for name, info in ordered:
        if info.end > data_bytes:
            raise InvalidCheckpoint(path, name, f"{where(info)} run past the end of the file's {data_bytes:,} data "
                                    "bytes (the file is truncated, or the header lies)")
    end = 0
    for name, info in ordered:
        if info.begin > end:
            raise InvalidCheckpoint(path, name, f"{where(info)} leave a gap after byte {end} (the header lies)")
        end = info.end
    if end != data_bytes:
        raise InvalidCheckpoint(path, None, f"{data_bytes - end:,} bytes after the last tensor belong to no "
                                "tensor of the header (a damaged file)")


def read_header(path: Path) -> dict[str, TensorInfo]:
    """`{tensor name: TensorInfo}` of a safetensors file, checked against the file's size.

    InvalidCheckpoint (naming the file, and the tensor where there is one)
    for anything safetensors' reader would refuse or misread.
    """
    raw, data_bytes = _header_bytes(path)
    infos = {name: _tensor_info(path, name, entry) for name, entry in _header_json(path, raw).items()}
    _check_coverage(path, infos, data_bytes)
    return infos


def _weight_map(index: Path) -> dict[str, Path]:
    """`{tensor name: shard}` of an index file; InvalidCheckpoint if it has no weight_map of file names."""
    weight_map = read_json_object(index).get("weight_map")
    if not isinstance(weight_map, dict) or not all(isinstance(f, str) for f in weight_map.values()):
        raise InvalidCheckpoint(index, "weight_map", "expected an object {tensor name: shard file name}")
    return {name: index.parent / file for name, file in weight_map.items()}


def _listed_files(directory: Path) -> tuple[Path, dict[str, Path] | None]:
    """(the file that says which files hold the weights, the index's weight map or None)."""
    if (directory / SINGLE_FILE).is_file():  # transformers' order: the single file first
        return directory / SINGLE_FILE, None
    if (directory / INDEX_FILE).is_file():
        return directory / INDEX_FILE, _weight_map(directory / INDEX_FILE)
    if any(directory.glob("*.safetensors")):
        return directory, None
    others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
    hint = f" (found {others}: only safetensors weights are read)" if others else ""
    raise InvalidCheckpoint(directory, None, f"holds no model.safetensors, {INDEX_FILE} or other *.safetensors "
                                             f"weights{hint}")


def _check_shards(index: Path, weight_map: dict[str, Path], headers: dict[Path, dict[str, TensorInfo]]) -> None:
    for name, file in weight_map.items():
        if file not in headers:
            raise InvalidCheckpoint(index, name, f"is in shard {file.name}, which does not exist in {index.parent}")
        if name not in headers[file]:
            raise InvalidCheckpoint(index, name, f"is listed in shard {file.name}, whose header has no such tensor")


def _read_headers(files) -> dict[Path, dict[str, TensorInfo]]:
    return {file: read_header(file) for file in sorted(set(files)) if file.is_file()}


class CheckpointReader:
    """The tensors of a checkpoint directory: names, shapes and dtypes from checked headers, arrays on request.

    Attributes:
      directory: the checkpoint directory.
      source: the file that lists the weights (model.safetensors, the index), or
        the directory when its *.safetensors files are read without an index.
      files: `{tensor name: file}`.

    Use as a context manager; files are opened once (memory-mapped by
    safetensors) on first read and closed on exit. Raises InvalidCheckpoint
    (naming the file and tensor) when a file or header is missing or damaged.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        if not self.directory.is_dir():
            raise InvalidCheckpoint(self.directory, None, "is not a directory")
        self.source, weight_map = _listed_files(self.directory)
        listed = weight_map.values() if weight_map is not None else (
            [self.source] if self.source.is_file() else self.directory.glob("*.safetensors"))
        self._headers = _read_headers(listed)
        if weight_map is not None:
            _check_shards(self.source, weight_map, self._headers)
            self.files = dict(weight_map)
        else:
            self.files = {name: file for file, infos in self._headers.items() for name in infos}
        self._open: dict[Path, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def names(self) -> list[str]:
        return sorted(self.files)

    def info(self, name: str) -> TensorInfo:
        return self._headers[self.files[name]][name]

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the header (no tensor data)."""
        return self.info(name).shape

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("F32", "BF16", "F16", ...)."""
        return self.info(name).dtype

    def read(self, name: str) -> np.ndarray:
        """One tensor as a numpy array in its stored dtype (bfloat16 as `ml_dtypes.bfloat16`)."""
        file = self.files[name]
        try:
            if file not in self._open:
                self._open[file] = safe_open(file, framework="numpy").__enter__()
            return self._open[file].get_tensor(name)
        except (SafetensorError, OSError) as err:  # the file changed since its header was checked
            raise InvalidCheckpoint(file, name, f"cannot be read: {err}") from None


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes one safetensors file of contiguous arrays, with the `{"format": "pt"}` metadata transformers expects."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})
