"""What a checkpoint's meta holds and what it must match: the run's config and tokenizer, a sha256
of every array, the format (format 1, from before the model config and the runtime were
separate, is upgraded when read), and the checks a resumed run makes against it.

Nothing here reads or writes files: `train.checkpoint` stores the meta beside the arrays.
"""

from __future__ import annotations

import hashlib
import math
from pathlib import Path
from typing import Any

import jax
import numpy as np
from jax.experimental import multihost_utils

from train.config import ExperimentConfig
from train.data.shard_format import tokenizer_hash
from train.data.tokenizer import JSON_KINDS, Tokenizer
from train.data.tokenizer import from_dict as tokenizer_from_dict

FORMAT_VERSION = 2
_MLA_FIELDS = ("kv_lora_rank", "q_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# The train settings and kernels whose change makes a resumed run differ from an uninterrupted one.
_EXACT_TRAIN = ("seed", "batch_size", "block_size", "lr", "min_lr", "warmup_iters",
                "lr_decay_iters", "beta1", "beta2", "weight_decay", "grad_clip", "data_path")
_EXACT_KERNELS = ("attention", "matmul")  # the ones whose rounding reaches the training losses


class CheckpointError(ValueError):
    """A checkpoint is missing, unreadable, corrupted or does not match the run."""


def build_meta(step: int, state: Any, *, config: ExperimentConfig, tokenizer: Tokenizer, val_loss: float | None,
               best_val_loss: float | None, extra: dict | None = None) -> dict:
    """The meta saved with `state` at `step` (JSON-serializable; a non-finite loss is saved as None)."""
    return {"format": FORMAT_VERSION, "step": int(step), "val_loss": _finite_or_none(val_loss),
            "best_val_loss": _finite_or_none(best_val_loss), "config": config.to_dict(),
            "tokenizer": tokenizer.to_dict(), "checksums": checksums(state), **(extra or {})}


def _finite_or_none(x: float | None) -> float | None:
    return None if x is None or not math.isfinite(float(x)) else float(x)


def path_name(path) -> str:
    """'opt_state/0/count' for a key path, whatever the containers (a restore may give dicts
    where the saved state had named tuples)."""
    parts = (getattr(k, "key", getattr(k, "idx", getattr(k, "name", k))) for k in path)
    return "/".join(str(part) for part in parts)


def _on_host(leaf) -> np.ndarray:
    """The whole array in this process; one split over processes is gathered (every process calls this)."""
    if isinstance(leaf, jax.Array) and not leaf.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(leaf, tiled=True))
    return np.asarray(leaf)


def checksums(state: Any) -> dict[str, str]:
    """sha256 of every array of a pytree, by its path (the same in every process of a run)."""
    return {path_name(path): hashlib.sha256(np.ascontiguousarray(_on_host(leaf)).tobytes()).hexdigest()
            for path, leaf in jax.tree_util.tree_leaves_with_path(state)}


def verify_checksums(state: Any, meta: dict, where: Path) -> None:
    """CheckpointError naming the first array whose sha256 differs from the one in `meta`."""
    saved = meta.get("checksums")
    if saved is None:  # written before checksums existed
        return
    for key, digest in checksums(state).items():
        if saved.get(key) != digest:
            raise CheckpointError(f"checkpoint {where} is corrupted: array {key} does not match its saved "
                                  "sha256")


def current_format(meta: Any, where: Path, meta_file: Path) -> dict:
    """`meta` as read from `meta_file` of the step `where`, upgraded to today's format;
    CheckpointError when its format is unknown."""
    if isinstance(meta, dict) and meta.get("format") == 1:
        meta = upgrade_format_1(meta)
    if not isinstance(meta, dict) or meta.get("format") != FORMAT_VERSION or "config" not in meta:
        raise CheckpointError(f"checkpoint {where}: its meta ({meta_file}) has an unknown format: "
                              f"{meta!r:.200}")
    return meta


def upgrade_format_1(meta: dict) -> dict:
    """A format-1 meta with its config in today's form: MLA's sizes in `model.mla`, the
    implementation choices (matmul_dtype, attention_impl, mla_path, data_parallel, xla_flags)
    in `runtime`. The arrays did not change."""
    model, train = dict(meta["config"]["model"]), dict(meta["config"]["train"])
    mla = {name: model.pop(name) for name in _MLA_FIELDS if name in model}
    model["mla"] = mla if model.pop("attention", "standard") == "mla" else None
    matmul = {"float32": "xla", "bfloat16": "bfloat16_cpu"}.get(model.pop("matmul_dtype", "float32"), "auto")
    runtime = {"attention": model.pop("attention_impl", "xla"), "mla": model.pop("mla_path", "naive"),
               "matmul": matmul, "mesh": f"data:{train.pop('data_parallel', 1)}",
               "xla_flags": train.pop("xla_flags", "")}
    config = {**meta["config"], "model": model, "train": train, "runtime": runtime}
    return {**meta, "format": FORMAT_VERSION, "config": config}


def check_compatible(meta: dict, config: ExperimentConfig) -> list[str]:
    """Raises if the checkpoint's model differs; returns warnings for train settings that
    change the batches or schedule (a resume is exact only when these match)."""
    saved = ExperimentConfig.from_dict(meta["config"])
    if saved.model != config.model:
        diff = {k: (v, getattr(config.model, k)) for k, v in saved.model.to_dict().items()
                if getattr(config.model, k) != v and k != "rope_scaling"}
        raise CheckpointError(f"checkpoint model config differs from this run's: "
                              f"{{field: (checkpoint, now)}} = {diff or 'rope_scaling'}")
    warnings = [f"train.{k} was {getattr(saved.train, k)!r}, now {getattr(config.train, k)!r}"
                for k in _EXACT_TRAIN if getattr(saved.train, k) != getattr(config.train, k)]
    return warnings + [f"runtime.{k} was {getattr(saved.runtime, k)!r}, now {getattr(config.runtime, k)!r}"
                       for k in _EXACT_KERNELS if getattr(saved.runtime, k) != getattr(config.runtime, k)]


def check_tokenizer(meta: dict, tokenizer: Tokenizer, corpus: str) -> None:
    """CheckpointError unless `tokenizer` (this run's corpus's) is the checkpoint's: with another
    one every token id would mean another character, and the run would go on training on noise."""
    saved = tokenizer_from_dict(meta["tokenizer"])
    if saved == tokenizer:
        return
    was = meta["config"]["train"].get("data_path") or "the default corpus"
    raise CheckpointError(f"--resume: the corpus {corpus} does not give the run's tokenizer: "
                          f"{_tokenizer_difference(saved, tokenizer)}, so every token id would mean something "
                          f"else. Resume with the run's corpus ({was}), or start a new run in another --out-dir")


def _tokenizer_difference(saved: Tokenizer, tokenizer: Tokenizer) -> str:
    if saved.kind == tokenizer.kind == "char":
        added, missing = sorted(set(tokenizer.chars) - set(saved.chars)), sorted(set(saved.chars) - set(tokenizer.chars))
        return (f"its characters differ from the run's ({saved.vocab_size} then, {tokenizer.vocab_size} now; "
                f"new {''.join(added)!r}, gone {''.join(missing)!r})")
    if saved.kind == tokenizer.kind and saved.kind in JSON_KINDS:
        return (f"it is another {saved.kind} tokenizer ({saved.vocab_size} ids then, {tokenizer.vocab_size} now; "
                f"hash (prepared.json's tokenizer.hash) {tokenizer_hash(saved.json).hex()} then, "
                f"{tokenizer_hash(tokenizer.json).hex()} now)")
    return f"it is a {tokenizer.kind} tokenizer and the run's is a {saved.kind} tokenizer"
