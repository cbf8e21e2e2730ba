"""Loading a Hugging Face checkpoint directory into jaxattn, and writing one transformers loads.

Both directions validate everything first (config, tensor names and shapes)
and only then move data: a checkpoint that cannot be loaded exactly fails
before a tensor is read, and a config that cannot be exported fails before a
file is written. Tensors are read one at a time (see
`jaxattn.hf.safetensors_io`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict

from jaxattn.config import ModelConfig
from jaxattn.hf.architectures import config_from_hf
from jaxattn.hf.export import hf_config
from jaxattn.hf.layouts import FAMILIES, is_ignored, layout
from jaxattn.hf.safetensors_io import INDEX_FILE, CheckpointReader, write_safetensors
from jaxattn.hf.tokenizer import HFTokenizer, as_tokenizer, save_tokenizer
from jaxattn.hf.weights import Entry
from jaxattn.layers import fused_to_separate_qkv, separate_to_fused_qkv
from jaxattn.model import DecoderLM

DTYPES = ("float32", "bfloat16")
MAX_LISTED = 8  # problems listed in one error message


def abstract_params(config: ModelConfig) -> dict[tuple[str, ...], jax.ShapeDtypeStruct]:
    """The flat `{path: shape/dtype}` of `DecoderLM(config)`'s parameters, without allocating them."""
    init = lambda: DecoderLM(config).init(jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))  # noqa: E731
    return flatten_dict(nn.unbox(jax.eval_shape(init)["params"]))


def read_config_json(directory: Path) -> dict[str, Any]:
    path = directory / "config.json"
    if not path.is_file():
        raise FileNotFoundError(f"{directory} holds no config.json: not a Hugging Face checkpoint directory")
    return json.loads(path.read_text())


def _stored_names(reader: CheckpointReader, family: str) -> dict[str, str]:
    """`{current name: stored name}`: legacy names renamed, the base-model prefix added where a hub file lacks it."""
    info = FAMILIES[family]
    aliases, names = dict(info.aliases), reader.names()
    prefixed = any(name.startswith(info.prefix) for name in names)
    mapping = {}
    for name in names:
        current = aliases.get(name, name)
        if not prefixed and not current.startswith("lm_head."):
            current = info.prefix + current
        mapping[current] = name
    return mapping


def _problems(entries: list[Entry], stored: dict[str, str], reader: CheckpointReader, ignored) -> list[str]:
    expected = {name: shape for e in entries for name, shape in zip(e.names, e.shapes, strict=True)}
    problems = [f"missing tensor {name}: expected shape {shape}, found none"
                for name, shape in expected.items() if name not in stored]
    problems += [f"tensor {name}: expected shape {shape}, found {reader.shape(stored[name])}"
                 for name, shape in expected.items() if name in stored and reader.shape(stored[name]) != shape]
    problems += [f"unexpected tensor {name}: expected none, found shape {reader.shape(stored[name])}"
                 for name in stored if name not in expected and not ignored(name)]
    return problems


def _raise_problems(directory: Path, problems: list[str]) -> None:
    if problems:
        more = f"\n  ... and {len(problems) - MAX_LISTED} more" if len(problems) > MAX_LISTED else ""
        raise ValueError(f"checkpoint {directory} does not match its config.json:\n  "
                         + "\n  ".join(problems[:MAX_LISTED]) + more)


def _check_layout(family: str, entries: list[Entry], model: dict) -> None:
    """The layout and `DecoderLM` agree on the parameters (else a bug in the layout, not in a file)."""
    paths = {e.path for e in entries}
    if paths != set(model):
        raise AssertionError(f"the {family} layout and DecoderLM disagree: only in the layout "
                             f"{sorted(paths - set(model))}, only in the model {sorted(set(model) - paths)}")


def _load_entry(entry: Entry, stored, reader, dtype, expected: jax.ShapeDtypeStruct) -> jax.Array:
    arrays = [reader.read(stored[name]).astype(dtype, copy=False) for name in entry.names]
    value = np.ascontiguousarray(entry.codec.to_jax(arrays))
    if value.shape != expected.shape:  # the layout and the model disagree: a bug here, not in the file
        raise AssertionError(f"{'/'.join(entry.path)}: layout gives {value.shape}, model wants {expected.shape}")
    return jnp.asarray(value)


def load_pretrained(path, dtype: str = "float32") -> tuple[ModelConfig, dict]:
    """Reads a Hugging Face checkpoint directory: `(ModelConfig, DecoderLM params)`.

    See `jaxattn.hf` for the contract; `dtype` ("float32" or "bfloat16") sets
    the config's dtype and param_dtype and the parameters' dtype.
    """
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")
    directory = Path(path)
    hf = read_config_json(directory)
    family, config = config_from_hf(hf, dtype)
    entries, model = layout(family, config), abstract_params(config)
    _check_layout(family, entries, model)
    extra_layers = int(hf.get("num_nextn_predict_layers") or 0) if family == "deepseek_v3" else 0
    np_dtype = jnp.dtype(dtype)
    with CheckpointReader(directory) as reader:
        stored = _stored_names(reader, family)
        ignored = lambda name: is_ignored(family, name, config, extra_layers)  # noqa: E731
        _raise_problems(directory, _problems(entries, stored, reader, ignored))
        flat = {e.path: _load_entry(e, stored, reader, np_dtype, model[e.path]) for e in entries}
    return config, unflatten_dict(flat)


def _unwrap(params) -> dict:
    """The params dict, from `{'params': ...}` too, with `init`'s logical-axis boxes removed."""
    params = dict(nn.unbox(params))
    return dict(params["params"]) if set(params) == {"params"} else params


def _match_qkv(params: dict, config: ModelConfig, fused: bool) -> tuple[dict, ModelConfig]:
    """Params and config with attention projections fused (GPT-2, GPT-NeoX) or separate (the rest)."""
    if config.mla is not None or config.fused_qkv == fused:
        return params, config
    convert = (lambda a: separate_to_fused_qkv(a)) if fused else (lambda a: fused_to_separate_qkv(a, config))
    params = {name: ({**value, "attn": convert(value["attn"])} if name.startswith("blocks_") else value)
              for name, value in params.items()}
    return params, config.replace(fused_qkv=fused)


def _check_params(flat: dict, config: ModelConfig) -> None:
    model = abstract_params(config)
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


def _check_directory(directory: Path, overwrite: bool) -> None:
    """FileExistsError unless `directory` is absent, empty, or may be overwritten (nothing is replaced unasked)."""
    if directory.exists() and not directory.is_dir():
        raise FileExistsError(f"{directory} exists and is not a directory")
    if directory.is_dir() and any(directory.iterdir()) and not overwrite:
        raise FileExistsError(f"{directory} is not empty; pass overwrite=True to replace its checkpoint "
                              "or choose an empty directory")


# What a save writes: with overwrite=True these are replaced (a stale shard would shadow the new
# file, a stale generation_config.json or tokenizer would say the wrong end-of-sequence id);
# anything else in the directory is the user's and stays.
_WRITTEN = (INDEX_FILE, "config.json", "generation_config.json", "tokenizer.json", "tokenizer_config.json")


def _prepare_directory(directory: Path) -> None:
    """Creates `directory`, less the files of an older save."""
    for stale in [*(directory / name for name in _WRITTEN), *directory.glob("*.safetensors")]:
        stale.unlink(missing_ok=True)
    directory.mkdir(parents=True, exist_ok=True)


def save_pretrained(path, config: ModelConfig, params, tokenizer=None, *, overwrite: bool = False,
                    eos_token_id: int | None = None) -> Path:
    """Writes a directory that transformers' `AutoModelForCausalLM.from_pretrained` loads as the same model.

    See `jaxattn.hf` for the contract. Returns the directory. Everything is
    checked (config, params, tokenizer, directory) before a file is written.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    if eos_token_id is None and isinstance(tokenizer, HFTokenizer):
        eos_token_id = tokenizer.eos_token_id
    family, hf = hf_config(config, eos_token_id)
    flat_in = flatten_dict(_unwrap(params))
    _check_params(flat_in, config)
    tokenizer = None if tokenizer is None else as_tokenizer(tokenizer)
    directory = Path(path)
    _check_directory(directory, overwrite)
    params, config = _match_qkv(unflatten_dict(flat_in), config, fused=family in ("gpt2", "gpt_neox"))
    tensors = _hf_tensors(layout(family, config), flatten_dict(params), jnp.dtype(config.param_dtype))
    _prepare_directory(directory)
    write_safetensors(directory / "model.safetensors", tensors)
    (directory / "config.json").write_text(json.dumps(hf, indent=2, sort_keys=True) + "\n")
    if tokenizer is not None:
        save_tokenizer(directory, tokenizer, eos_token_id)
    return directory
