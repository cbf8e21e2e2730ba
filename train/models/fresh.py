"""A config's model with fresh parameters and the tokenizer its text is read with: what
`--random-init CONFIG` loads (`train.models.load.load_model`). CONFIG is a name in configs/ or a
.toml file.

The tokenizer comes one of two ways, as the program asks:

* `random_init` (`train.sample`, `train.serve`): that of `--data`, a corpus prepared by
  `python -m train.prepare` (any kind), else the characters of a text file (default: Tiny
  Shakespeare); a config whose vocab_size is not the tokenizer's is refused.
* `as_trained` (`train.attention_maps`, which draws any config): the one training builds for the
  config (its `train.tokenizer` over `--data`, else its `train.data_path`), and the model's
  vocab_size made the tokenizer's.
"""

from __future__ import annotations

from pathlib import Path

import flax.linen as nn
import jax
import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.model import DecoderLM
from train import config as config_lib
from train.cli import UsageError
from train.data import corpus as data_lib
from train.data import shards
from train.data.tokenizer import CharTokenizer, Tokenizer, build_tokenizer


def read_config(name: str) -> config_lib.ExperimentConfig:
    """The experiment config `name`; UsageError naming `--random-init` when it is missing or invalid."""
    try:
        return config_lib.load_config(name)
    except FileNotFoundError as err:
        raise UsageError(f"--random-init: {err}") from None
    except (TypeError, ValueError) as err:
        raise UsageError(f"--random-init {name}: {err}") from None


def fresh_params(config: ModelConfig, seed: int = 0):
    """Parameters of `DecoderLM(config)` initialised from `seed` (plain arrays, unboxed)."""
    variables = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(seed), np.zeros((1, 1), np.int32))
    return nn.unbox(variables["params"])


def data_tokenizer(data: str | None) -> tuple[Tokenizer, str]:
    """(the tokenizer of `--data`, where it came from in words): a directory prepared by
    `python -m train.prepare` gives its tokenizer, a text file (default: Tiny Shakespeare, found or
    downloaded as `train.data.corpus` does) its characters. DataError for a missing or damaged `data`."""
    if data is not None and Path(data).expanduser().is_dir():
        return shards.open_prepared(Path(data).expanduser()).tokenizer, f"the prepared corpus --data {data}"
    tokenizer = CharTokenizer.from_text(data_lib.read_text(data_lib.resolve_data_path(data)))
    return tokenizer, f"the characters of --data {data}" if data else "the characters of Tiny Shakespeare"


def random_init(name: str, seed: int = 0, data: str | None = None) -> tuple[dict, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of the config `name`, randomly initialised from `seed`, with
    the tokenizer of `data` (`data_tokenizer`). UsageError for an unknown config or a vocab_size other
    than the tokenizer's; DataError for a missing or damaged `data`."""
    config = read_config(name).model
    tokenizer, where = data_tokenizer(data)
    if tokenizer.vocab_size != config.vocab_size:
        raise UsageError(f"config {name!r} has vocab_size {config.vocab_size}, but the tokenizer of {where} "
                         f"has {tokenizer.vocab_size} ids")
    return fresh_params(config, seed), config, tokenizer


def as_trained(name: str, data: str | None = None) -> tuple[ModelConfig, Tokenizer]:
    """(model config, tokenizer) of the config `name` with the tokenizer training builds for it (a char
    tokenizer from the corpus at `data`, else at the config's data_path; or bytes), the model's
    vocab_size set from it. UsageError for an unknown config; DataError for a missing corpus."""
    config = read_config(name)
    kind = config.train.tokenizer
    corpus = "" if kind == "byte" else data_lib.read_text(data_lib.resolve_data_path(data or config.train.data_path))
    tokenizer = build_tokenizer(kind, corpus)
    return config.model.replace(vocab_size=tokenizer.vocab_size), tokenizer
