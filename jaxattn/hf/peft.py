"""PEFT's LoRA adapter format (`adapter_config.json`, `adapter_model.safetensors`) out of and into jaxattn.

```python
from jaxattn.hf import peft
peft.save_adapter(out_dir, config, params_with_lora, lora_config)   # peft.PeftModel.from_pretrained loads it
params_with_lora, lora_config = peft.load_adapter(adapter_dir, config, params)
```

The mapping (`jaxattn.hf.peft_modules`) is read off the family's layout (`jaxattn.hf.weights.Entry`:
path, names, codec), not written per family: an Entry whose path is a weight `jaxattn.lora.roles_of`
names holds one Hugging Face module per tensor name (the name minus ".weight", e.g.
`model.layers.0.self_attn.q_proj`). Its adapter is stored as PEFT stores a LoRA `nn.Linear`'s:
`base_model.model.<module>.lora_A.weight [r, in]` (our `a [in, r]` transposed) and `.lora_B.weight
[out, r]` (our `b [r, width]` with its columns in Hugging Face's order, transposed). That order is the
codec's: the codec's `to_hf` is applied once to a probe array holding each column's index (and once
to one holding each row's), which gives, for each tensor, which of our columns each of its output rows
is (e.g. q/k's `half_split_columns` for interleaved RoPE) and whether it is stored `[out, in]` or,
GPT-2's Conv1D, `[in, out]` (PEFT's `fan_in_fan_out`). A tensor must hold exactly one part of our
weight (see `jaxattn.lora.LoraWeight`); own models with a fused `qkv` export to families with separate
q/k/v projections part by part, and load into them likewise.

Not representable, refused with `UnsupportedCheckpoint` naming the module or key:
* a tensor that holds several of our parts (GPT-2's `c_attn`, GPT-NeoX's per-head fused
  `query_key_value`, Phi-3's `qkv_proj` and `gate_up_proj`): PEFT gives such a module one `lora_A`,
  jaxattn one per part;
* the routed experts (target "experts"): PEFT 0.21 adapts them as one module per expert or as fused
  parameters (`target_parameters`), neither of which this module reads or writes;
* on loading: `peft_type` other than "LORA", non-empty `rank_pattern` / `alpha_pattern`, DoRA
  (`use_dora`), `bias` other than "none", `lora_bias`, `modules_to_save`, `layers_to_transform`,
  `exclude_modules`, `target_parameters`, `trainable_token_indices`, `layer_replication`, aLoRA and
  QALoRA; target modules the family's layout does not have, or that are no LoRA target here (norms,
  embeddings, the head, MLA's `kv_a_proj_with_mqa`); a target adapted in some layers and not others
  (jaxattn adapts a target in every layer).
A tensor missing from the file, an unexpected one, or one of the wrong shape is `InvalidCheckpoint`
naming the tensor (and both shapes).
"""

from __future__ import annotations

import json
import math
import os
import re
import secrets
from pathlib import Path
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
from flax.traverse_util import flatten_dict, unflatten_dict
from safetensors import safe_open

from jaxattn.config import ModelConfig
from jaxattn.hf.checkpoint import flat_abstract_params
from jaxattn.hf.errors import InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.family import Family
from jaxattn.hf.layouts import layout
from jaxattn.hf.peft_modules import Module, every_module, family_config, locate, modules, target_modules
from jaxattn.hf.safetensors_io import read_header, write_safetensors
from jaxattn.scan_plan import relayout
from jaxattn.config.lora import TARGETS, LoraConfig
from jaxattn.lora.params import add_lora, roles_of
from jaxattn.lora.weight import LoraWeight, is_lora

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModelForCausalLM's name for the wrapped model, in every key

# adapter_config.json keys whose non-neutral values change what PEFT computes in ways a LoraWeight
# does not hold: key -> (is it neutral?, why).
REFUSED_KEYS = {
    "rank_pattern": (lambda v: not v, "a rank per module; jaxattn's LoraConfig has one rank"),
    "alpha_pattern": (lambda v: not v, "an alpha per module; jaxattn's LoraConfig has one alpha"),
    "use_dora": (lambda v: not v, "DoRA's magnitude vector is not implemented"),
    "bias": (lambda v: v in (None, "none"), "trained biases are not implemented"),
    "lora_bias": (lambda v: not v, "a bias on lora_B is not implemented"),
    "modules_to_save": (lambda v: not v, "fully trained module copies are not adapters"),
    "layers_to_transform": (lambda v: v is None or v == [], "jaxattn adapts a target in every layer"),
    "exclude_modules": (lambda v: not v, "jaxattn adapts a target in every layer"),
    "target_parameters": (lambda v: not v, "adapters on raw parameters (experts) are not read"),
    "trainable_token_indices": (lambda v: not v, "trainable token embeddings are not implemented"),
    "layer_replication": (lambda v: not v, "replicated layers are not implemented"),
    "alora_invocation_tokens": (lambda v: not v, "activated LoRA is not implemented"),
    "use_qalora": (lambda v: not v, "QALoRA's pooled input is not implemented"),
}


def _unwrap(params: Any) -> dict:
    """The params dict, from `{'params': ...}` too, with `init`'s logical-axis boxes removed."""
    params = dict(nn.unbox(params))
    return dict(params["params"]) if set(params) == {"params"} else params

def save_adapter(directory, config: ModelConfig, params, lora_config: LoraConfig, *,
                 base_model_name_or_path: str | None = None, overwrite: bool = False) -> Path:
    """Writes the LoRA adapters of `params` as PEFT does: `adapter_config.json` and `adapter_model.safetensors`.

    `peft.PeftModel.from_pretrained(model, directory)` loads it onto the transformers model that
    `jaxattn.hf.save_pretrained(config, ...)` writes (or that the params were loaded from). Args:
      directory: created if absent; it may hold other files (a checkpoint), which stay as they are.
      config: the model's config (scanned or not; params stacked accordingly).
      params: params with `LoraWeight`s (`jaxattn.lora.add_lora`; boxed or not, `{"params": ...}` or not).
      lora_config: the config the adapters were made with (rank, alpha, dropout, rsLoRA written as
        `r`, `lora_alpha`, `lora_dropout`, `use_rslora`); checked against every LoraWeight.
      base_model_name_or_path: written as is (PEFT's hub reference; None by default).
      overwrite: replace an existing adapter (else FileExistsError).

    Returns the directory. Raises UnsupportedCheckpoint (see the module docstring) for adapters PEFT
    cannot hold, ValueError for params without LoraWeights or whose rank or scale differ from `lora_config`.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    if not isinstance(lora_config, LoraConfig):
        raise TypeError(f"lora_config must be a jaxattn.lora.LoraConfig, got {type(lora_config).__name__}")
    directory = Path(directory)
    existing = [directory / name for name in (CONFIG_FILE, WEIGHTS_FILE) if (directory / name).exists()]
    if existing and not overwrite:
        raise FileExistsError(f"{existing[0]} exists; pass overwrite=True to replace the adapter")
    unrolled, config = relayout(_unwrap(params), config, scan_layers=False)  # PEFT's modules are per layer
    loras = _adapted_weights(unrolled, lora_config)
    family, in_family = family_config(config)
    tensors, written, conv1d = _adapter_tensors(family, modules(family, in_family), loras, config)
    adapter_config = _adapter_config(lora_config, target_modules(written, every_module(layout(family, in_family))),
                                     conv1d, base_model_name_or_path)
    _write(directory, {WEIGHTS_FILE: lambda path: write_safetensors(path, tensors),
                       CONFIG_FILE: lambda path: path.write_text(json.dumps(adapter_config, indent=2, sort_keys=True)
                                                                 + "\n")})
    return directory


def _adapted_weights(unrolled: dict, lora_config: LoraConfig) -> dict[tuple, LoraWeight]:
    """`{path: LoraWeight}` of unrolled params; ValueError for none, or one whose rank, scale or dropout
    differ from `lora_config`'s."""
    loras = {path: w for path, w in flatten_dict(unrolled).items() if is_lora(w)}
    if not loras:
        raise ValueError("params hold no LoraWeight (jaxattn.lora.add_lora makes them)")
    for path, w in loras.items():
        ranks = {a.shape[-1] for a in w.a if a is not None}
        c = lora_config
        if ranks != {c.rank} or not math.isclose(w.scale, c.scale) or w.dropout != c.dropout:
            raise ValueError(f"{'/'.join(path)}: rank {sorted(ranks)}, scale {w.scale}, dropout {w.dropout} differ "
                             f"from lora_config's rank {c.rank}, scale {c.scale}, dropout {c.dropout}")
    return loras


def _adapter_tensors(family: Family, table: dict[str, Module], loras: dict[tuple, LoraWeight],
                     config: ModelConfig) -> tuple[dict[str, np.ndarray], list[str], set[bool]]:
    """`(tensors by PEFT key, the modules written, their Conv1D flags)`: each adapted part's `lora_A [r, in]`
    and `lora_B [out, r]` under its Hugging Face module; UnsupportedCheckpoint for a part no module holds
    alone, or for Linear and Conv1D modules mixed."""
    tensors, written, used, conv1d = {}, [], set(), set()
    for name, module in table.items():
        candidates = range(len(roles_of(module.path))) if module.part is None else (module.part,)
        located = [locate(module.path, part, config) for part in candidates]
        adapted = [(path, part) for path, part in located if path in loras and loras[path].a[part] is not None]
        if not adapted:
            continue
        if module.why is not None:
            raise UnsupportedCheckpoint(f"{family.architecture} module {name}: {module.why}")
        (path, part), = adapted
        w = loras[path]
        tensors[f"{PREFIX}{name}.lora_A.weight"] = np.asarray(w.a[part]).T  # [r, in]
        tensors[f"{PREFIX}{name}.lora_B.weight"] = np.asarray(w.b[part])[:, module.columns].T  # [out, r]
        written.append(name)
        used.add((path, part))
        conv1d.add(module.conv1d)
    left = [(path, w.parts[j]) for path, w in loras.items() for j, a in enumerate(w.a)
            if a is not None and (path, j) not in used]
    if left:
        raise UnsupportedCheckpoint(f"{'/'.join(left[0][0])} part {left[0][1]!r} has no {family.architecture} module "
                                    f"that PEFT adapts")
    if len(conv1d) > 1:
        raise UnsupportedCheckpoint(f"{family.architecture}: the adapted modules mix Linear and Conv1D, which "
                                    "one fan_in_fan_out cannot describe")
    return tensors, written, conv1d


def _adapter_config(lora_config: LoraConfig, targets: list[str], conv1d: set[bool],
                    base_model_name_or_path: str | None) -> dict[str, Any]:
    """adapter_config.json as PEFT writes it for these adapters (`targets`: its `target_modules`)."""
    return dict(
        peft_type="LORA", task_type="CAUSAL_LM", r=lora_config.rank,
        lora_alpha=int(lora_config.alpha) if lora_config.alpha.is_integer() else lora_config.alpha,  # as PEFT writes it
        lora_dropout=lora_config.dropout, use_rslora=lora_config.rslora,
        target_modules=targets,
        bias="none", fan_in_fan_out=conv1d == {True}, base_model_name_or_path=base_model_name_or_path,
        modules_to_save=None, rank_pattern={}, alpha_pattern={}, use_dora=False, lora_bias=False,
        init_lora_weights=True, layers_to_transform=None, layers_pattern=None, inference_mode=True, revision=None)


def _write(directory: Path, contents: dict) -> None:
    """Each file under a temporary name, then renamed into place (a failed save leaves the older adapter)."""
    directory.mkdir(parents=True, exist_ok=True)
    staged = {}
    try:
        for name, write in contents.items():
            staged[name] = directory / f".{name}.{os.getpid()}-{secrets.token_hex(4)}.partial"
            write(staged[name])
    except BaseException:
        for temporary in staged.values():
            temporary.unlink(missing_ok=True)
        raise
    for name, temporary in staged.items():
        os.replace(temporary, directory / name)


def _read_config(path: Path) -> dict:
    if not path.is_file():
        raise InvalidCheckpoint(path, None, "is missing (a PEFT adapter directory has adapter_config.json)")
    try:
        value = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise InvalidCheckpoint(path, None, f"cannot be read as JSON: {err}") from None
    if not isinstance(value, dict):
        raise InvalidCheckpoint(path, None, f"must hold a JSON object, got {type(value).__name__}")
    if value.get("peft_type") != "LORA":
        raise UnsupportedCheckpoint(f"{path}: peft_type={value.get('peft_type')!r} is not supported (only 'LORA')")
    for key, (neutral, why) in REFUSED_KEYS.items():
        if not neutral(value.get(key)):
            raise UnsupportedCheckpoint(f"{path}: {key}={value[key]!r} is not supported ({why})")
    return value


def _lora_config(path: Path, hf: dict, targets: tuple[str, ...]) -> LoraConfig:
    try:
        return LoraConfig(rank=hf.get("r", 8), alpha=hf.get("lora_alpha", 8), dropout=hf.get("lora_dropout", 0.0),
                          rslora=bool(hf.get("use_rslora", False)), targets=targets)
    except ValueError as err:
        raise InvalidCheckpoint(path, None, str(err)) from None


def _matched(path: Path, hf: dict, every: set[str], architecture: str) -> set[str]:
    """The modules of the layout that PEFT's `target_modules` picks (PEFT's rules: a string is a regular
    expression matched against whole names; a list matches a name or a dotted suffix of one)."""
    wanted = hf.get("target_modules")
    if isinstance(wanted, str):
        found = {name for name in every if re.fullmatch(wanted, name)}
        if not found:
            raise UnsupportedCheckpoint(f"{path}: target_modules={wanted!r} matches no module of {architecture}")
        return found
    if not isinstance(wanted, list) or not wanted or not all(isinstance(t, str) for t in wanted):
        raise InvalidCheckpoint(path, "target_modules", f"must be a string or a list of names, got {wanted!r}")
    found = set()
    for target in wanted:
        hits = {name for name in every if name == target or name.endswith("." + target)}
        if not hits:
            raise UnsupportedCheckpoint(f"{path}: target module {target!r} is not in the {architecture} layout")
        found |= hits
    return found



def load_adapter(directory, config: ModelConfig, params, *, dtype: str | None = None) -> tuple[dict, LoraConfig]:
    """A PEFT LoRA adapter directory onto `params`: `(params with LoraWeights, its LoraConfig)`.

    `config` and `params` are the base model's (e.g. from `jaxattn.hf.load_pretrained`; scanned or not,
    boxed or not); the returned params are unboxed, in `config`'s layout, their adapters in `dtype`
    (default `config.param_dtype`). The LoraConfig's rank, alpha, dropout and rsLoRA are the file's
    `r`, `lora_alpha`, `lora_dropout`, `use_rslora`; its targets those of the modules
    `target_modules` picks. See the module docstring for what is refused.
    """
    if not isinstance(config, ModelConfig):
        raise TypeError(f"config must be a jaxattn.ModelConfig, got {type(config).__name__}")
    directory = Path(directory)
    config_path, weights_path = directory / CONFIG_FILE, directory / WEIGHTS_FILE
    hf = _read_config(config_path)
    dtype = jnp.dtype(dtype or config.param_dtype)
    family, in_family = family_config(config.replace(scan_layers=False))
    table, entries = modules(family, in_family), layout(family, in_family)
    matched = _matched(config_path, hf, every_module(entries), family.architecture)
    targets = _matched_targets(config_path, matched, table)
    lora = _lora_config(config_path, hf, tuple(t for t in TARGETS if t in targets))
    arrays = _read_adapters(weights_path, {name: table[name] for name in matched}, lora, in_family)
    with_lora = add_lora(_unwrap(params), config, lora, jax.random.PRNGKey(0))  # every a and b is set below
    unrolled, unrolled_config = relayout(with_lora, config, scan_layers=False)
    filled = _filled(flatten_dict(unrolled), {name: table[name] for name in matched}, arrays, unrolled_config,
                     lora.rank, dtype)
    params, _ = relayout(unflatten_dict(filled), unrolled_config, config.scan_layers)
    return params, lora


def _matched_targets(config_path: Path, matched: set[str], table: dict[str, Module]) -> set[str]:
    """The targets the `matched` modules adapt; UnsupportedCheckpoint for a module that is no LoRA target
    here or cannot hold an adapter, or for a target adapted in some layers and not others."""
    for name in sorted(matched):
        if name not in table:
            raise UnsupportedCheckpoint(f"{config_path}: target module {name} is not a LoRA target jaxattn represents "
                                        f"(see jaxattn.lora.TARGETS)")
        if table[name].why is not None:
            raise UnsupportedCheckpoint(f"{config_path}: target module {name}: {table[name].why}")
    targets = {t for name in matched for t in table[name].targets}
    for name, module in table.items():
        if module.why is None and set(module.targets) & targets and name not in matched:
            raise UnsupportedCheckpoint(f"{config_path}: the adapter adapts {sorted(set(module.targets) & targets)} "
                                        f"but not module {name}: jaxattn adapts a target in every layer")
    return targets


def _read_adapters(weights_path: Path, matched: dict[str, Module], lora: LoraConfig,
                   config: ModelConfig) -> dict[str, np.ndarray]:
    """The `lora_A`, `lora_B` tensors of the `matched` modules as float32, by PEFT key, once the file's
    header holds exactly those, of their shapes (InvalidCheckpoint naming a tensor otherwise)."""
    if not weights_path.is_file():
        raise InvalidCheckpoint(weights_path, None, "is missing")
    header = read_header(weights_path)
    shapes = flat_abstract_params(config)
    expected = {}
    for name, module in matched.items():
        expected[f"{PREFIX}{name}.lora_A.weight"] = (lora.rank, shapes[module.path].shape[0])
        expected[f"{PREFIX}{name}.lora_B.weight"] = (len(module.columns), lora.rank)
    for key in sorted(header):
        if key not in expected:
            raise InvalidCheckpoint(weights_path, key, f"is not an adapter of the modules target_modules picks "
                                    f"({len(matched)} modules)")
    for key, shape in sorted(expected.items()):
        if key not in header:
            raise InvalidCheckpoint(weights_path, key, "is missing")
        if tuple(header[key].shape) != shape:
            raise InvalidCheckpoint(weights_path, key, f"expected shape {shape}, found {tuple(header[key].shape)}")
    with safe_open(weights_path, framework="numpy") as file:
        return {key: np.asarray(file.get_tensor(key), np.float32) for key in expected}


def _filled(flat: dict, matched: dict[str, Module], arrays: dict[str, np.ndarray], config: ModelConfig, rank: int,
            dtype) -> dict:
    """Flat unrolled params of `config` with each adapted part's `a [in, r]` and `b [r, width]` (its
    columns in our order) from the file's `arrays` (rank `rank`), in `dtype`."""
    filled: dict[tuple, dict[int, tuple]] = {}
    for name, module in matched.items():
        path, part = locate(module.path, module.part, config)
        b = np.zeros((rank, flat[path].widths[part]), np.float32)
        b[:, module.columns] = arrays[f"{PREFIX}{name}.lora_B.weight"].T
        filled.setdefault(path, {})[part] = (arrays[f"{PREFIX}{name}.lora_A.weight"].T, b)
    for path, parts in filled.items():
        w: LoraWeight = flat[path]
        missing = [w.parts[j] for j, a in enumerate(w.a) if a is not None and j not in parts]
        assert not missing, f"{'/'.join(path)}: parts {missing} adapted but not in the file"  # the check above
        a = tuple(None if a is None else jnp.asarray(parts[j][0], dtype) for j, a in enumerate(w.a))
        flat[path] = w.replace(a=a, b=tuple(None if b is None else jnp.asarray(parts[j][1], dtype)
                                            for j, b in enumerate(w.b)))
    return flat
