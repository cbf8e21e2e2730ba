"""Writing a directory transformers loads as the same model (`save_pretrained`), checked before a file
is written.

Everything is validated first (config, params, tokenizer, directory); every file is written under a
temporary name and renamed into place once all are written, so a failed save leaves an older
checkpoint as it was. A save writes `MODEL_FILES` (and, with a tokenizer, its files); overwriting
replaces exactly those and an older sharded save (its index and the shards it lists). The contract
is `jaxattn.hf`'s; reading a checkpoint is `jaxattn.hf.checkpoint`.
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
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxattn import fused_to_separate_qkv, separate_to_fused_qkv
from jaxattn.config import ModelConfig
from jaxattn.hf.checkpoint import MAX_LISTED, flat_abstract_params
from jaxattn.hf.export import hf_config
from jaxattn.hf.family import Family
from jaxattn.hf.layouts import layout
from jaxattn.hf.safetensors_io import INDEX_FILE, SINGLE_FILE, write_safetensors
from jaxattn.hf.tokenizer import TOKENIZER_FILES, HFTokenizer, as_tokenizer, tokenizer_files
from jaxattn.hf.weights import Entry
from jaxattn.scan_plan import relayout

# The files a save writes (with a tokenizer, TOKENIZER_FILES too); overwriting replaces these and
# an older sharded save (its index and the shards it lists): the rest of a directory is the user's.
MODEL_FILES = (SINGLE_FILE, "config.json", "generation_config.json")


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
