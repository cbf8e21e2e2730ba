"""A GGUF file opened with the `gguf` package's `GGUFReader`: its metadata, its tensors, checked before use.

`GGUFFile(path)` memory-maps the file and reads its metadata and tensor directory (no tensor
data): a file `GGUFReader` cannot parse (not GGUF, truncated, a version it does not know) is an
`InvalidCheckpoint` naming it; an architecture with no record in
`jaxattn.gguf.architectures`, a tensor type outside `TENSOR_TYPES`, or a tensor the
architecture's record does not know is an `UnsupportedCheckpoint` naming it and the file.

`GGUFTensors` hands the tensors out by their transformers names with `jaxattn.hf`'s reading
surface (`jaxattn.hf.checkpoint.ArraySource`): each is dequantized to float32 with
`gguf.quants.dequantize` when it is read, then has llama.cpp's own changes undone (the q/k row
permutation, Gemma's 1 + w norms), so one tensor at a time is held in float32.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize

from jaxattn.gguf.architecture import Architecture
from jaxattn.gguf.architectures import ARCHITECTURES
from jaxattn.hf.errors import InvalidCheckpoint, UnsupportedCheckpoint

# The tensor types read, each dequantized to float32 by `gguf.quants.dequantize` (llama.cpp's
# block formats: 32 values per block for Q4_0 ... Q8_0, 256 for the K-quants). Q8_0 is int8 with
# one scale per 32 values: it is dequantized too (`GGUFModel.kept_quantization` says when quantizing
# the result as "int8:32" gives the file's blocks back exactly).
TENSOR_TYPES = ("F32", "F16", "BF16", "Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q2_K", "Q3_K", "Q4_K", "Q5_K",
                "Q6_K")
UNKNOWN_TYPE = re.compile(r"(\d+) is not a valid GGMLQuantizationType")


def _supported() -> str:
    return ", ".join(sorted(ARCHITECTURES))


class _PlainReader(GGUFReader):
    """`GGUFReader`, its metadata parsed from a plain ndarray view of the file's map instead of the
    `numpy.memmap` itself: the same bytes and fields (tests/gguf/test_gguf.py compares them), but a
    large vocabulary's hundred thousand strings parse in 2.5 s instead of 7 (SmolLM2's 49,152 tokens
    and 48,900 merges): slicing a memmap runs its `__array_finalize__` each time, about 70% of the
    parse. Overrides the reader's one slicing method, `_get`, with its own body; a slice the file ends
    inside is a `TruncatedFile` naming the tensor whose data starts there (the reader's own error was
    numpy's "cannot reshape array")."""

    def _build_tensors(self, start_offs: int, fields) -> None:
        # Where each tensor's data starts (the parts of a tensor's field: name length, name, dims, ..., offset).
        self.__dict__["_tensor_at"] = {int(start_offs + field.parts[-1][0]): str(bytes(field.parts[1]), "utf-8")
                                       for field in fields}
        super()._build_tensors(start_offs, fields)

    def _get(self, offset: int, dtype, count: int = 1, override_order=None) -> np.ndarray:
        plain = self.__dict__.get("_plain")
        if plain is None:
            plain = self.__dict__["_plain"] = self.data.view(np.ndarray)
        count = int(count)
        array = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
        if array.size < count:
            raise TruncatedFile(self.__dict__.get("_tensor_at", {}).get(offset), count * np.dtype(dtype).itemsize,
                                array.nbytes)
        return array.view(array.dtype.newbyteorder(self.byte_order if override_order is None else override_order))


class TruncatedFile(ValueError):
    """The file ends inside what the reader asked for: `tensor`'s data (None: metadata), `had` of `wanted` bytes."""

    def __init__(self, tensor: str | None, wanted: int, had: int):
        super().__init__(f"{tensor} ({had:,} of {wanted:,} bytes)")
        self.tensor, self.wanted, self.had = tensor, wanted, had


class GGUFFile:
    """A GGUF file's metadata and tensor directory, checked; the tensors stay on disk until read.

    Attributes:
      path: the file.
      metadata: `{key: value}` of every metadata key (strings, numbers, bools, lists), the
        reader's own `GGUF.*` header fields left out.
      architecture: the `Architecture` record of `general.architecture`.
      tensors: `{llama.cpp name: gguf.ReaderTensor}` in file order.
    """

    def __init__(self, path: str | Path):
        self.path = Path(path)
        if not self.path.is_file():
            raise InvalidCheckpoint(self.path, None, "is a directory, not a GGUF file" if self.path.is_dir()
                                    else "does not exist")
        try:
            reader = _PlainReader(self.path)
        except OSError as err:
            raise InvalidCheckpoint(self.path, None, f"cannot be read ({err.strerror or err})") from None
        except TruncatedFile as err:
            if err.tensor is None:
                raise InvalidCheckpoint(self.path, None, f"ends inside its header ({err.had:,} of the {err.wanted:,} "
                                        "bytes of a field): truncated, or not a GGUF file?") from None
            raise InvalidCheckpoint(self.path, err.tensor, f"holds {err.had:,} of its {err.wanted:,} bytes: the file "
                                    "ends before this tensor's data (truncated? downloaded in part?)") from None
        except Exception as err:  # noqa: BLE001 (GGUFReader raises ValueError, KeyError, IndexError, ...)
            unknown = UNKNOWN_TYPE.search(str(err))
            if unknown:
                raise UnsupportedCheckpoint(f"{self.path}: a tensor of ggml type {unknown.group(1)}, which the gguf "
                                            f"package does not know; types read: {', '.join(TENSOR_TYPES)}") from None
            raise InvalidCheckpoint(self.path, None, f"is not a GGUF file the gguf package reads "
                                    f"({type(err).__name__}: {err})") from None
        self.metadata = {name: self._value(name, field) for name, field in reader.fields.items()
                         if not name.startswith("GGUF.")}
        self.tensors = {tensor.name: tensor for tensor in reader.tensors}
        self.architecture = self._architecture()
        self._check_tensors()

    def _value(self, name: str, field) -> Any:
        try:
            return field.contents()
        except UnicodeDecodeError as err:
            raise InvalidCheckpoint(self.path, name, f"holds text that is not UTF-8 ({err.reason})") from None

    def _architecture(self) -> Architecture:
        name = self.metadata.get("general.architecture")
        if not isinstance(name, str):
            raise InvalidCheckpoint(self.path, "general.architecture", "is missing or not a string: a GGUF file "
                                    "names its architecture there")
        if name not in ARCHITECTURES:
            raise UnsupportedCheckpoint(f"{self.path}: unsupported architecture {name!r} (general.architecture); "
                                        f"jaxattn reads {_supported()}")
        return ARCHITECTURES[name]

    def _check_tensors(self) -> None:
        for name, tensor in self.tensors.items():
            kind = GGMLQuantizationType(tensor.tensor_type).name
            if kind not in TENSOR_TYPES:
                raise UnsupportedCheckpoint(f"{self.path}: {name}: tensor type {kind} is not read; jaxattn "
                                            f"dequantizes {', '.join(TENSOR_TYPES)}")
            if name in self.architecture.config_tensors:
                continue
            why = self.architecture.refusal(name)
            if why is not None:
                raise UnsupportedCheckpoint(f"{self.path}: {name}: {why}")
            if self.architecture.hf_name(name) is None:
                raise UnsupportedCheckpoint(f"{self.path}: {name}: a tensor the {self.architecture.name!r} "
                                            "architecture has no counterpart for in jaxattn")

    def shape(self, name: str) -> tuple[int, ...]:
        """Tensor `name`'s shape in numpy's order (llama.cpp lists dimensions fastest first)."""
        return tuple(int(d) for d in reversed(self.tensors[name].shape.tolist()))

    def type_name(self, name: str) -> str:
        """Tensor `name`'s ggml type, e.g. "Q4_K"."""
        return GGMLQuantizationType(self.tensors[name].tensor_type).name

    def dequantized(self, name: str) -> np.ndarray:
        """Tensor `name` as float32 in its numpy shape, as stored (no llama.cpp change undone)."""
        tensor = self.tensors[name]
        try:
            values = np.asarray(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)
            return values.reshape(self.shape(name))
        except (ValueError, OSError) as err:  # the file changed since it was opened, or a short mapping
            raise InvalidCheckpoint(self.path, name, f"cannot be read: {err}") from None


def reverse_permute(weights: np.ndarray, n_head: int, num_kv_heads: int | None = None) -> np.ndarray:
    """llama.cpp's q/k row permutation undone: transformers' `LlamaTensorProcessor._reverse_permute_weights`.

    llama.cpp's converter groups each head's rows as (2, H/2) pairs interleaved; transformers and
    jaxattn rotate the two halves of a head. `num_kv_heads` (when it differs) is the key's head count.
    """
    if num_kv_heads is not None and n_head != num_kv_heads:
        n_head = num_kv_heads
    dim = weights.shape[0] // n_head // 2
    w = weights.reshape(n_head, dim, 2, *weights.shape[1:])
    return w.swapaxes(2, 1).reshape(weights.shape)


class GGUFTensors:
    """A GGUF file's tensors by transformers name, dequantized on `read`: a `jaxattn.hf` tensor source.

    `heads` and `kv_heads` are the config's query and key/value head counts (the q/k permutation
    is per head). Every tensor reads as float32 ("F32"): the file's own type is in `type_name`.
    """

    config_name = "its metadata"

    def __init__(self, file: GGUFFile, heads: int, kv_heads: int):
        self.file, self.heads, self.kv_heads = file, heads, kv_heads
        self.source = file.path
        self._stored = {file.architecture.hf_name(name): name for name in file.tensors
                        if name not in file.architecture.config_tensors}
        self.files = {name: file.path for name in self._stored}

    def names(self) -> list[str]:
        return sorted(self._stored)

    def gguf_name(self, name: str) -> str:
        """llama.cpp's name of transformers tensor `name`."""
        return self._stored[name]

    def shape(self, name: str) -> tuple[int, ...]:
        return self.file.shape(self._stored[name])

    def dtype(self, name: str) -> str:
        return "F32"

    def type_name(self, name: str) -> str:
        return self.file.type_name(self._stored[name])

    def read(self, name: str) -> np.ndarray:
        stored, architecture = self._stored[name], self.file.architecture
        values = self.file.dequantized(stored)
        if architecture.permute_qk and ".attn_q." in stored:
            values = reverse_permute(values, self.heads, self.heads)
        elif architecture.permute_qk and ".attn_k." in stored:
            values = reverse_permute(values, self.heads, self.kv_heads)
        if architecture.norm_offset and "norm.weight" in stored:
            values = values - 1
        return values
