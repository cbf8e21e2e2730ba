"""The errors of the Hugging Face interop: every failure to read a checkpoint is an `HFCheckpointError`."""

from __future__ import annotations

from pathlib import Path


class HFCheckpointError(ValueError):
    """A Hugging Face checkpoint that cannot be read, or a model that cannot be written as one.

    The base of `UnsupportedCheckpoint` (a feature jaxattn does not implement)
    and `InvalidCheckpoint` (a file that is missing, damaged or says
    something impossible). A ValueError, so callers that catch bad input
    as ValueError keep working.
    """


class UnsupportedCheckpoint(HFCheckpointError):
    """A checkpoint or config jaxattn cannot reproduce exactly.

    Raised for an architecture that is not supported, or a feature of a
    supported one that jaxattn does not implement (the message names the
    architecture or the config field); and, when exporting, for a
    `ModelConfig` that no transformers architecture reproduces (the message
    names the field that prevents it). Raised before any tensor is read or
    written.
    """


class InvalidCheckpoint(HFCheckpointError):
    """A checkpoint file that is missing, unreadable, malformed, or holds values no model can have.

    Attributes:
      path: the file (or the directory, when a file is missing from it).
      key: the config key (dotted for nested ones, e.g. "rope_parameters.factor")
        or tensor name the problem is in, or None when it is the whole file.
      problem: what is wrong, without the path and key.

    The message is "PATH: KEY: PROBLEM" (or "PATH: PROBLEM" without a key).
    """

    def __init__(self, path: str | Path, key: str | None, problem: str):
        self.path, self.key, self.problem = Path(path), key, problem
        super().__init__(f"{path}: {problem}" if key is None else f"{path}: {key}: {problem}")

    def __reduce__(self):  # pickles (e.g. across processes) with its three arguments
        return type(self), (self.path, self.key, self.problem)
