"""Loading a Hugging Face checkpoint directory into jaxattn, and writing one transformers loads.

Both directions validate everything first (config, tensor names and shapes)
and only then move data: a checkpoint that cannot be loaded exactly fails
before a tensor is read, and a config that cannot be exported fails before a
file is written. Tensors are read one at a time (see
`jaxattn.hf.safetensors_io`).

Weights are read from F32, F16, BF16 or F64 tensors (`WEIGHT_DTYPES`), cast to the
model's dtype. U8 is read only where the layout's chosen form is packed
(`Entry.packed`: GPT-OSS's MXFP4 experts, `*_blocks` and `*_scales`), whose codec
dequantizes the raw bytes; any other dtype, or U8 elsewhere, is refused naming the tensor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import secrets
from pathlib import Path
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxattn import fused_to_separate_qkv, separate_to_fused_qkv
from jaxattn.config import ModelConfig
from jaxattn.scan_plan import relayout
from jaxattn.model import abstract_params
from jaxattn.hf.architectures import config_from_hf
from jaxattn.hf.errors import InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.export import hf_config
from jaxattn.hf.family import Family
from jaxattn.hf.fields import Fields, read_json_object
from jaxattn.hf.layouts import is_ignored, layout, stored_form, stored_names
from jaxattn.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, CheckpointReader, write_safetensors
from jaxattn.hf.tokenizer import TOKENIZER_FILES, HFTokenizer, as_tokenizer, tokenizer_files
from jaxattn.hf.weights import Entry

DTYPES = ("float32", "bfloat16")
MAX_LISTED = 8  # problems listed in one error message
WEIGHT_DTYPES = ("F32", "F16", "BF16", "F64")  # the safetensors dtypes weights are read from
PACKED_DTYPES = ("U8",)  # the dtype of packed (quantized) tensors, read only where the layout says so
# 8-bit and smaller floats: quantized checkpoints, whose per-block scales jaxattn does not apply.
LOW_PRECISION_DTYPES = ("F8_E4M3", "F8_E5M2", "F8_E8M0", "F6_E2M3", "F6_E3M2", "F4")
# The files a save writes (with a tokenizer, TOKENIZER_FILES too); overwriting replaces these and
# an older sharded save (its index and the shards it lists): the rest of a directory is the user's.
MODEL_FILES = (SINGLE_FILE, "config.json", "generation_config.json")
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


def _unwrap(params) -> dict:
    """The params dict, from `{'params': ...}` too, with `init`'s logical-axis boxes removed."""
    params = dict(nn.unbox(params))
    return dict(params["params"]) if set(params) == {"params"} else params


def _match_qkv(params: dict, config: ModelConfig, fused: bool) -> tuple[dict, ModelConfig]:
    """Params and config with attention projections fused (GPT-2, GPT-NeoX, Phi-3) or separate (the rest)."""
    if config.mla is not None or config.fused_qkv == fused:
        return params, config
    convert = (lambda a: separate_to_fused_qkv(a)) if fused else (lambda a: fused_to_separate_qkv(a, config))
    params = {name: ({**value, "attn": convert(value["attn"])} if name.startswith("blocks_") else value)
              for name, value in params.items()}
    return params, config.replace(fused_qkv=fused)


def _check_params(flat: dict, config: ModelConfig) -> None:
    model = flat_abstract_params(config)
    problems = [f"parameter {'/'.join(p)}: expected shape {model[p].shape}, found "
                f"{flat[p].shape if p in flat else 'none'}" for p in model if p not in flat
                or tuple(flat[p].shape) != model[p].shape]
    problems += [f"unexpected parameter {'/'.join(p)} of shape {flat[p].shape}" for p in flat if p not in model]
    if problems:
        raise ValueError("params do not match DecoderLM(config):\n  " + "\n  ".join(problems[:MAX_LISTED]))


def _hf_tensors(entries: list[Entry], flat: dict, dtype) -> dict[str, np.ndarray]:
    tensors = {}
    for entry in entries:
        if entry.path in flat:
            arrays = entry.codec.to_hf(np.asarray(flat[entry.path]).astype(dtype, copy=False))
        elif entry.zero_fill:
            arrays = [np.zeros(shape, dtype) for shape in entry.shapes]
        else:
            raise AssertionError(f"{'/'.join(entry.path)} has no value to export")
        tensors.update(zip(entry.names, arrays, strict=True))
    return tensors


def _check_directory(directory: Path, overwrite: bool, names: list[str]) -> None:
    """FileExistsError unless `directory` is absent, empty, or may be overwritten (nothing is replaced unasked)."""
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{directory} is not empty; pass overwrite=True to replace its checkpoint "
                              "or choose an empty directory")
    taken = [name for name in names if (directory / name).exists() and not (directory / name).is_file()]
    if taken:
        raise FileExistsError(f"{directory / taken[0]} is not a file; a save writes a file there")


def _older_save(directory: Path, written: list[str]) -> list[Path]:
    """The files of an older sharded save that a new save replaces: the index and the shards it lists.

    Only `*.safetensors` files in `directory` itself that the index names are
    listed; any other file (an adapter, a README) is the user's. An index that
    cannot be read is listed alone: its shards are unknown, so they stay.
    """
    index = directory / INDEX_FILE
    if not index.is_file():
        return []
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
        shards = set(weight_map.values())
    except (OSError, ValueError, AttributeError, TypeError):
        return [index]
    mine = [name for name in shards if isinstance(name, str) and name.endswith(".safetensors")
            and name == Path(name).name and name not in written and (directory / name).is_file()]
    return [index, *sorted(directory / name for name in mine)]


def _write_json(path: Path, value: dict) -> None:
    path.write_text(json.dumps(value, indent=2, sort_keys=True) + "\n")


def generation_config(eos_token_id: int | None) -> dict[str, Any]:
    """The generation_config.json transformers writes for a causal LM (its end-of-sequence id when known)."""
    return {"_from_model_config": True, **({} if eos_token_id is None else {"eos_token_id": eos_token_id})}


def _stage(directory: Path, contents: dict[str, Callable[[Path], None]]) -> dict[Path, Path]:
    """Writes each file under a temporary name in `directory`: `{final path: temporary path}`.

    On any failure the temporary files are removed and the error re-raised: nothing is in place yet.
    """
    staged: dict[Path, Path] = {}
    try:
        for name, write in contents.items():
            staged[directory / name] = directory / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
            write(staged[directory / name])
    except BaseException:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)
        raise
    return staged


def _write_all(directory: Path, contents: dict[str, Callable[[Path], None]], stale: list[Path]) -> None:
    """Stages every file, renames each into place (each rename atomic), then removes an older save's shards.

    A directory this call created is removed again when staging fails.
    """
    created = not directory.exists()
    directory.mkdir(parents=True, exist_ok=True)
    try:
        staged = _stage(directory, contents)
    except BaseException:
        if created:
            with contextlib.suppress(OSError):
                directory.rmdir()
        raise
    for final, temporary in staged.items():
        os.replace(temporary, final)
    for path in stale:
        path.unlink(missing_ok=True)


@dataclasses.dataclass(frozen=True)
class SaveReport:
    """What `save_pretrained` did.

    Attributes:
      directory: the checkpoint directory.
      architecture: the transformers class written, e.g. "LlamaForCausalLM".
      written: every file the save wrote, sorted.
      replaced: the files of an older save that it replaced or removed, sorted: earlier
        versions of `written` files, and an older `model.safetensors.index.json` with
        the shards it lists. Nothing else in the directory is touched.
    """

    directory: Path
    architecture: str
    written: tuple[Path, ...]
    replaced: tuple[Path, ...]


def _contents(config: ModelConfig, params, family: Family, hf: dict, tokenizer, eos_token_id) -> dict:
    """`{file name: write(path)}` of a save, the weights first."""
    params, config = _match_qkv(params, config, fused=family.fused_qkv)
    tensors = _hf_tensors(layout(family, config), flatten_dict(params), jnp.dtype(config.param_dtype))
    contents = {SINGLE_FILE: lambda path: write_safetensors(path, tensors),
                "config.json": lambda path: _write_json(path, hf),
                "generation_config.json": lambda path: _write_json(path, generation_config(eos_token_id))}
    assert tuple(contents) == MODEL_FILES
    return contents | ({} if tokenizer is None else tokenizer_files(tokenizer, eos_token_id))


def save_pretrained(path, config: ModelConfig, params, tokenizer=None, *, overwrite: bool = False,
                    eos_token_id: int | None = None) -> SaveReport:
    """Writes a directory that transformers' `AutoModelForCausalLM.from_pretrained` loads as the same model.

    See `jaxattn.hf` for the contract. Everything is checked (config, params,
    tokenizer, directory) before a file is written; every file is written
    under a temporary name and renamed into place once all are written.
    Returns a `SaveReport` (the files written and those replaced).
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    if eos_token_id is None and isinstance(tokenizer, HFTokenizer):
        eos_token_id = tokenizer.eos_token_id
    unrolled, config = relayout(_unwrap(params), config, scan_layers=False)  # transformers' layers are per layer
    family, hf = hf_config(config, eos_token_id)
    flat_in = flatten_dict(unrolled)
    _check_params(flat_in, config)
    tokenizer = None if tokenizer is None else as_tokenizer(tokenizer)
    directory = Path(path)
    names = [*MODEL_FILES, *(TOKENIZER_FILES if tokenizer is not None else ())]
    _check_directory(directory, overwrite, names)
    stale = _older_save(directory, names)
    replaced = [directory / name for name in names if (directory / name).exists()] + stale
    contents = _contents(config, unflatten_dict(flat_in), family, hf, tokenizer, eos_token_id)
    _write_all(directory, contents, stale)
    return SaveReport(directory, family.architecture, tuple(sorted(directory / name for name in names)),
                      tuple(sorted(replaced)))
