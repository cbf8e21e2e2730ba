"""Reading and writing safetensors checkpoints without torch, one tensor at a time.

A Hugging Face checkpoint directory holds either one `model.safetensors` or
shards listed by `model.safetensors.index.json` (`{"weight_map": {name: file}}`).
`CheckpointReader` reads every file's header first (names, shapes, dtypes: no
tensor data), so a checkpoint can be validated before anything is loaded, then
hands out one numpy array at a time: the caller converts it and lets it go, so
peak host memory stays near one copy of the model.

bfloat16 tensors come back as `ml_dtypes.bfloat16` numpy arrays (the numpy
dtype JAX uses); importing `ml_dtypes` is what lets safetensors' numpy reader
name that dtype.
"""

from __future__ import annotations

import json
from pathlib import Path

import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy for safe_open(framework="numpy"))
import numpy as np
from safetensors import safe_open
from safetensors.numpy import save_file

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def checkpoint_files(directory: Path) -> dict[str, Path]:
    """`{tensor name: file}`: the index's weight map, else built from the headers of the files.

    Raises FileNotFoundError when the directory holds no safetensors weights.
    """
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = [directory / SINGLE_FILE] if (directory / SINGLE_FILE).is_file() else sorted(
        directory.glob("*.safetensors"))
    if not files:
        others = sorted(p.name for p in directory.glob("*.bin")) + sorted(p.name for p in directory.glob("*.pt*"))
        hint = f" (found {others}: only safetensors weights are read)" if others else ""
        raise FileNotFoundError(f"no *.safetensors weights in {directory}{hint}")
    mapping = {}
    for file in files:
        with safe_open(file, framework="numpy") as f:
            mapping.update({name: file for name in f.keys()})
    return mapping


class CheckpointReader:
    """The tensors of a checkpoint directory: shapes from headers, arrays on request.

    Use as a context manager; files are opened once (memory-mapped by
    safetensors) and closed on exit.
    """

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.files = checkpoint_files(self.directory)
        self._open: dict[Path, object] = {}

    def __enter__(self) -> "CheckpointReader":
        return self

    def __exit__(self, *exc) -> None:
        for handle in self._open.values():
            handle.__exit__(None, None, None)
        self._open.clear()

    def _handle(self, file: Path):
        if file not in self._open:
            if not file.is_file():
                raise FileNotFoundError(f"{file.name}, listed in {INDEX_FILE}, is missing from {self.directory}")
            self._open[file] = safe_open(file, framework="numpy").__enter__()
        return self._open[file]

    def names(self) -> list[str]:
        return sorted(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        """The stored shape, read from the header (no tensor data)."""
        return tuple(self._handle(self.files[name]).get_slice(name).get_shape())

    def dtype(self, name: str) -> str:
        """The stored dtype as safetensors names it ("F32", "BF16", "F16", ...)."""
        return self._handle(self.files[name]).get_slice(name).get_dtype()

    def read(self, name: str) -> np.ndarray:
        """One tensor as a numpy array in its stored dtype (bfloat16 as `ml_dtypes.bfloat16`)."""
        return self._handle(self.files[name]).get_tensor(name)


def write_safetensors(path: Path, tensors: dict[str, np.ndarray]) -> None:
    """Writes one safetensors file of contiguous arrays, with the `{"format": "pt"}` metadata transformers expects."""
    arrays = {name: np.ascontiguousarray(array) for name, array in tensors.items()}
    save_file(arrays, str(path), metadata={"format": "pt"})
