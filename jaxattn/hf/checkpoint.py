"""Loading a Hugging Face checkpoint directory (or a config and its tensors) into jaxattn.

Everything is validated first (config, tensor names and shapes) and only then is data moved: a
checkpoint that cannot be loaded exactly fails before a tensor is read. Tensors are read one at a
time (see `jaxattn.hf.safetensors_io`). Writing one transformers loads is `jaxattn.hf.save`.

Weights are read from F32, F16, BF16 or F64 tensors (`WEIGHT_DTYPES`), cast to the
model's dtype. U8 is read only where the layout's chosen form is packed
(`Entry.packed`: GPT-OSS's MXFP4 experts, `*_blocks` and `*_scales`), whose codec
dequantizes the raw bytes; any other dtype, or U8 elsewhere, is refused naming the tensor.
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxattn.config import ModelConfig
from jaxattn.scan_plan import relayout
from jaxattn.model import abstract_params
from jaxattn.hf.architectures import config_from_hf
from jaxattn.hf.errors import InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.family import Family
from jaxattn.hf.fields import Fields, read_json_object
from jaxattn.hf.layouts import is_ignored, layout, stored_form, stored_names
from jaxattn.hf.safetensors_io import CheckpointReader
from jaxattn.hf.weights import Entry

DTYPES = ("float32", "bfloat16")
MAX_LISTED = 8  # problems listed in one error message
WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")  # the safetensors dtypes weights are read from
PACKED_DTYPES = ("U8",)  # the dtype of packed (quantized) tensors, read only where the layout says so
# 8-bit and smaller floats: quantized checkpoints, whose per-block scales jaxattn does not apply.
LOW_PRECISION_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4")
NONFINITE_HINT = "allow_nonfinite=True loads them anyway"  # the end of a non-finite tensor's message


def flat_abstract_params(config: ModelConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """The flat `{path: shape/dtype}` of `DecoderLM(config)`'s parameters, without allocating them."""
    return flatten_dict(nn.unbox(abstract_params(config)))


def read_config_json(directory: Path) -> Fields:
    """The directory's config.json as `Fields`; InvalidCheckpoint if absent or not a JSON object."""
    if not directory.is_dir():
        raise InvalidCheckpoint(directory, None, "does not exist" if not directory.exists() else "is not a directory")
    path = directory / "config.json"
    return Fields(read_json_object(path, ": not a Hugging Face checkpoint directory"), path)


def _problems(entries: list[Entry], stored: dict[str, str], reader: CheckpointReader,
              ignored) -> list[tuple[str, str]]:
    """`(tensor name, problem)` for every tensor that is missing, unexpected or of the wrong shape."""
    expected = {name: shape for e in entries for name, shape in zip(e.names, e.shapes, strict=True)}
    problems = [(name, f"missing tensor {name}: expected shape {shape}, found none")
                for name, shape in expected.items() if name not in stored]
    problems += [(name, f"tensor {name}: expected shape {shape}, found {reader.shape(stored[name])}")
                 for name, shape in expected.items() if name in stored and reader.shape(stored[name]) != shape]
    problems += [(name, f"unexpected tensor {name}: expected none, found shape {reader.shape(stored[name])}")
                 for name in stored if name not in expected and not ignored(name)]
    return problems


def _raise_problems(reader: CheckpointReader, problems: list[tuple[str, str]]) -> None:
    if problems:
        listed = [text for _, text in problems[:MAX_LISTED]]
        more = [f"... and {len(problems) - MAX_LISTED} more"] if len(problems) > MAX_LISTED else []
        config = getattr(reader, "config_name", "config.json")  # what a source's config came from
        raise InvalidCheckpoint(reader.source, problems[0][0], f"the tensors do not match {config}:\n  "
                                + "\n  ".join(listed + more))


def _check_dtypes(entries: list[Entry], stored: dict[str, str], reader: CheckpointReader) -> None:
    """Every tensor to load is of a floating dtype read here (see `WEIGHT_DTYPES`), or U8 where its entry is
    packed (`PACKED_DTYPES`); checked from the headers."""
    for entry, name in ((entry, name) for entry in entries for name in entry.names):
        dtype = reader.dtype(stored[name])
        file = reader.files[stored[name]]
        if entry.packed:
            if dtype not in PACKED_DTYPES:
                raise InvalidCheckpoint(file, stored[name], f"is {dtype}; a packed (quantized) tensor is read from "
                                        f"{', '.join(PACKED_DTYPES)}")
            continue
        if dtype in WEIGHT_DTYPES:
            continue
        if dtype in LOW_PRECISION_DTYPES:
            raise UnsupportedCheckpoint(f"{file}: {stored[name]}: {dtype} weights are not read (quantized "
                                        f"checkpoints keep scales jaxattn does not apply); weights are read from "
                                        f"{', '.join(WEIGHT_DTYPES)}: dequantize the checkpoint first")
        raise InvalidCheckpoint(file, stored[name], f"is {dtype}, a dtype that cannot hold weights; weights are "
                                f"read from {', '.join(WEIGHT_DTYPES)}")


def _check_layout(family: Family, entries: list[Entry], model: dict) -> None:
    """The layout and `DecoderLM` agree on the parameters (else a bug in the layout, not in a file)."""
    paths = {e.path for e in entries}
    if paths != set(model):
        raise AssertionError(f"the {family.model_type} layout and DecoderLM disagree: only in the layout "
                             f"{sorted(paths - set(model))}, only in the model {sorted(set(model) - paths)}")


def _finite(stored: np.ndarray, dtype: np.dtype, file, name: str, allow_nonfinite: bool) -> np.ndarray:
    """`stored` as `dtype`; InvalidCheckpoint counting its NaN and infinite values unless they are allowed."""
    with np.errstate(over="ignore"):  # F64 beyond float32's range becomes inf, reported below
        array = stored.astype(dtype, copy=False)
    if allow_nonfinite or np.isfinite(array).all():
        return array
    nan, bad = int(np.count_nonzero(np.isnan(array))), int(np.count_nonzero(~np.isfinite(array)))
    cause = f" once converted to {dtype.name} (too large for it)" if np.isfinite(stored).all() else ""
    raise InvalidCheckpoint(file, name, f"{bad:,} of {array.size:,} values are not finite ({nan:,} "
                            f"NaN, {bad - nan:,} infinite){cause}; {NONFINITE_HINT}")


def _read_finite(reader: CheckpointReader, name: str, dtype: np.dtype, allow_nonfinite: bool) -> np.ndarray:
    """Tensor `name` as `dtype`, checked by `_finite`."""
    return _finite(reader.read(name), dtype, reader.files[name], name, allow_nonfinite)


def _read_packed(entry: Entry, stored, reader, dtype, allow_nonfinite) -> np.ndarray:
    """A packed entry's raw tensors, dequantized by its codec, as `dtype`; non-finite values (e.g. from scale
    bytes 254 and 255) are reported for its tensors together."""
    names = [stored[name] for name in entry.names]
    value = entry.codec.to_jax([reader.read(name) for name in names])
    return _finite(value, dtype, reader.files[names[0]], " and ".join(names) + " (dequantized)", allow_nonfinite)


def _load_entry(entry: Entry, stored, reader, dtype, expected: jax.ShapeDtypeStruct, allow_nonfinite) -> jax.Array:
    if entry.packed:
        value = np.ascontiguousarray(_read_packed(entry, stored, reader, dtype, allow_nonfinite))
    else:
        arrays = [_read_finite(reader, stored[name], dtype, allow_nonfinite) for name in entry.names]
        value = np.ascontiguousarray(entry.codec.to_jax(arrays))
    if value.shape != expected.shape:  # the layout and the model disagree: a bug here, not in the file
        raise AssertionError(f"{'/'.join(entry.path)}: layout gives {value.shape}, model wants {expected.shape}")
    return jnp.asarray(value)


def _read_params(family: Family, config: ModelConfig, hf: Fields, reader, dtype: str,
                 allow_nonfinite: bool) -> dict:
    """The params of `config` from `reader`'s tensors (transformers names), checked as the module docstring says.

    `reader` is a `CheckpointReader` or any object with its reading surface (see `ArraySource`).
    """
    entries, model = layout(family, config), flat_abstract_params(config)
    _check_layout(family, entries, model)
    extra_layers = family.extra_layers(hf)
    np_dtype = jnp.dtype(dtype)
    stored = stored_names(family, reader.names())
    entries = stored_form(entries, stored)
    ignored = lambda name: is_ignored(family, name, config, extra_layers)  # noqa: E731
    _raise_problems(reader, _problems(entries, stored, reader, ignored))
    _check_dtypes(entries, stored, reader)
    flat = {e.path: _load_entry(e, stored, reader, np_dtype, model[e.path], allow_nonfinite) for e in entries}
    return unflatten_dict(flat)


def load_pretrained(path, dtype: str = "float32", *, allow_nonfinite: bool = False,
                    scan_layers: bool = False) -> tuple[ModelConfig, dict]:
    """Reads a Hugging Face checkpoint directory: `(ModelConfig, DecoderLM params)`.

    See `jaxattn.hf` for the contract; `dtype` ("float32" or "bfloat16") sets
    the config's dtype and param_dtype and the parameters' dtype. A tensor
    holding NaN or infinite values (after conversion to `dtype`) raises
    InvalidCheckpoint naming it, unless `allow_nonfinite` (for the rare
    checkpoint that stores -inf masks or overflowed values on purpose).
    `scan_layers`: the config scans its repeated layers and the parameters are stacked
    (`jaxattn.scan_plan`); else every layer is its own `blocks_{i}`.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    directory = Path(path)
    hf = read_config_json(directory)
    family, config = config_from_hf(hf, dtype)
    with CheckpointReader(directory) as reader:
        params = _read_params(family, config, hf, reader, dtype, allow_nonfinite)
    params, config = relayout(params, config, scan_layers)
    return config, params


class ArraySource:
    """A state dict `{transformers name: numpy array}` with `CheckpointReader`'s reading surface.

    The reading surface: `source` (the path errors name), `files` (`{name: path}`), `names()`,
    `shape(name)`, `dtype(name)` (safetensors' dtype name, "F32", "BF16", ...), `read(name)` and,
    optionally, `config_name` (what the config came from, for messages). A source may compute
    `read` on request (e.g. dequantize): shapes and dtypes are asked for first, and each array is
    read once, converted and let go.
    """

    def __init__(self, tensors: dict[str, np.ndarray], source: str | Path = "state dict"):
        self.tensors, self.source = dict(tensors), Path(source)
        self.files = {name: self.source for name in self.tensors}

    def names(self) -> list[str]:
        return sorted(self.tensors)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(np.shape(self.tensors[name]))

    def dtype(self, name: str) -> str:
        kind = np.asarray(self.tensors[name]).dtype
        return SAFETENSORS_DTYPES.get(kind.name, kind.name.upper())

    def read(self, name: str) -> np.ndarray:
        return np.asarray(self.tensors[name])


# numpy's dtype names -> safetensors' (what `_check_dtypes` reads and refuses by).
SAFETENSORS_DTYPES = {"float32": "F32", "float16": "F16", "bfloat16": "BF16", "float64": "F64", "uint8": "U8",
                      "int8": "I8", "int16": "I16", "int32": "I32", "int64": "I64", "bool": "BOOL"}


def load_state_dict(hf_config, tensors, dtype: str = "float32", *,
                    allow_nonfinite: bool = False) -> tuple[ModelConfig, dict]:
    """`(ModelConfig, DecoderLM params)` of a transformers config.json and its tensors by transformers name.

    `hf_config` is the config.json as a dict (or `Fields`, naming the file it describes);
    `tensors` a `{name: numpy array}` state dict, or a source with `CheckpointReader`'s reading
    surface (see `ArraySource`) whose arrays are made one at a time (jaxattn.gguf dequantizes
    each on request). Everything `load_pretrained` checks is checked, with the same errors; this
    is `load_pretrained` without the files.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    hf = hf_config if isinstance(hf_config, Fields) else Fields(hf_config)
    family, config = config_from_hf(hf, dtype)
    reader = ArraySource(tensors) if isinstance(tensors, dict) else tensors
    return config, _read_params(family, config, hf, reader, dtype, allow_nonfinite)
