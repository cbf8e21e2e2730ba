"""Checkpoints made elsewhere: transformers directories (`jaxattn.hf`) and llama.cpp GGUF files
(`jaxattn.gguf`), with their tokenizers and chat templates.

The one reader of both kinds, for `train.models.load.load_model` (`--hf DIR`, `--gguf FILE`) and a
fine-tuning run's start (`train.checkpoints.init_from`, `train.init_from = "hf:DIR"` or
`"gguf:FILE"`): `read(kind, path)` gives (params, model config, tokenizer), `read_config` the config
alone, `read_chat` the chat template and the named special tokens, `gguf_kept_quantization` how a GGUF
file's quantized weights are kept so.

Every failure is a `CheckpointError` of one line naming the file and the key, tensor, architecture
or tensor type.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

from jaxattn import gguf, hf
from jaxattn.config import ModelConfig
from jaxattn.hf.chat_template import find_chat_template, special_tokens
from train.checkpoints.meta import CheckpointError
from train.cli import one_line

KINDS = ("hf", "gguf")  # a transformers directory, a llama.cpp file
NONFINITE_HINT = "--allow-nonfinite loads them anyway"  # in place of jaxattn.hf's own hint: the programs' flag
NOT_A_DIRECTORY = "is not a directory (expected a transformers save: config.json, *.safetensors, tokenizer.json)"


def read(kind: str, path: str | Path, *, allow_nonfinite: bool = False) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of the checkpoint of `kind` ("hf" or "gguf") at `path`:
    `load_hf` or `load_gguf`."""
    return (load_gguf if kind == "gguf" else load_hf)(path, allow_nonfinite=allow_nonfinite)


def read_config(kind: str, path: str | Path) -> ModelConfig:
    """The model config of the checkpoint of `kind` at `path`, without reading a tensor: `hf_config`
    or `gguf_config`."""
    return gguf_config(path) if kind == "gguf" else hf_config(path)


def read_chat(kind: str, path: str | Path, *, template: bool = True) -> tuple[str | None, dict[str, str]]:
    """(the chat template's source or None, the named special tokens) of the checkpoint of `kind` at
    `path`: a directory's chat_template.jinja or tokenizer_config.json (`jaxattn.hf.chat_template`), a
    GGUF file's metadata. With `template` False the template is not read (None): a caller that brings
    its own is not refused for the checkpoint's. `jaxattn.hf.chat_template.ChatTemplateError` for a
    directory's template or tokenizer_config.json that cannot be read; CheckpointError for a GGUF file's."""
    if kind == "gguf":
        source, tokens = chat_of(open_gguf(path))
        return (source if template else None), tokens
    return (find_chat_template(path) if template else None), special_tokens(path)


def open_gguf(path: str | Path) -> gguf.GGUFModel:
    """The `jaxattn.gguf.GGUFModel` of `path`; CheckpointError (one line, naming the file) when it cannot be read.

    Opened once per program however often it is asked for (the weights, the kept quantization, the chat
    template): reading a file's metadata takes seconds for a large vocabulary. A file changed since is
    opened again."""
    try:
        stat = Path(path).stat()
    except OSError:
        stat = None  # GGUFModel.open names what is wrong
    try:
        return _open_gguf(str(path), None if stat is None else (stat.st_mtime_ns, stat.st_size))
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


@functools.lru_cache(maxsize=4)
def _open_gguf(path: str, version) -> gguf.GGUFModel:
    return gguf.GGUFModel.open(path)


def load_gguf_model(model: gguf.GGUFModel, allow_nonfinite: bool) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of an open GGUF file, the weights dequantized to float32;
    the tokenizer is built (and checked) before any tensor is read."""
    try:
        tokenizer = model.tokenizer()
        config, params = model.load("float32", allow_nonfinite=allow_nonfinite)
    except hf.HFCheckpointError as err:
        message = one_line(err).replace(hf.checkpoint.NONFINITE_HINT, NONFINITE_HINT)
        raise CheckpointError(f"cannot load {message}") from err
    return params, config, tokenizer


def load_gguf(path: str | Path, *, allow_nonfinite: bool = False) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of a llama.cpp GGUF file, as `load_hf` gives them for a directory.

    The weights are dequantized to float32. CheckpointError (one line, naming the file and the key,
    tensor, architecture or tensor type) for a file that is missing, is not GGUF, or holds what
    jaxattn does not read; the tokenizer is built (and checked) before any tensor is read.
    """
    return load_gguf_model(open_gguf(path), allow_nonfinite)


def gguf_kept_quantization(path: str | Path) -> gguf.KeptQuantization | None:
    """The `jaxattn.quantize` modes that keep a GGUF file's weights quantized (its layers' and its head's:
    the file's own numbers for Q8_0, Q4_0 and Q4_1, the nearest native format for the others;
    `jaxattn.gguf.kept`), or None for a file of float weights. A separate step from `load_gguf`,
    whose params stay float32. CheckpointError as `load_gguf` raises it.
    """
    return open_gguf(path).kept_quantization()


def chat_of(model: gguf.GGUFModel) -> tuple[str | None, dict[str, str]]:
    """(the chat template or None, the named special tokens) of an open GGUF file."""
    try:
        return model.chat_template, model.special_tokens
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


def hf_config(directory: str | Path) -> ModelConfig:
    """The model config of a transformers directory, from its config.json alone (no tensor is read);
    CheckpointError (one line naming the file and the key) when it cannot be read or is unsupported."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} {NOT_A_DIRECTORY}")
    try:
        return hf.architectures.config_from_hf(hf.checkpoint.read_config_json(path))[1]
    except hf.HFCheckpointError as err:
        where = "" if isinstance(err, hf.InvalidCheckpoint) else f"{path}: "
        raise CheckpointError(f"cannot load {where}{one_line(err)}") from err


def gguf_config(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file, from its metadata alone; CheckpointError as `load_gguf` raises it."""
    model = open_gguf(path)
    try:
        return hf.architectures.config_from_hf(model.hf_config())[1]
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


def load_hf(directory: str | Path, *, allow_nonfinite: bool = False) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of a transformers directory holding a tokenizer.json.

    The tokenizer has `encode(text) -> ids`, `decode(ids) -> str` and `eos_token_id`
    (int or None); the params are float32, for `jaxattn.DecoderLM(config)`. CheckpointError
    (one line, naming the file and the key or tensor) for a missing directory or
    tokenizer.json, an unsupported architecture, a damaged file, or weights holding NaN or
    infinity (loaded anyway with `allow_nonfinite`). The tokenizer is read first: a bad
    directory fails before any tensor.
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} {NOT_A_DIRECTORY}")
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json: the text cannot be encoded (python -m "
                              "train.export writes one; for a transformers model, save its fast tokenizer there)")
    try:
        tokenizer = hf.load_tokenizer(path)
        config, params = hf.load_pretrained(path, dtype="float32", allow_nonfinite=allow_nonfinite)
    except hf.HFCheckpointError as err:
        message = one_line(err).replace(hf.checkpoint.NONFINITE_HINT, NONFINITE_HINT)
        where = "" if isinstance(err, hf.InvalidCheckpoint) else f"{path}: "  # an InvalidCheckpoint names its file
        raise CheckpointError(f"cannot load {where}{message}") from err
    except OSError as err:
        raise CheckpointError(f"cannot load {path}: {err.filename or path}: {err.strerror or err}") from err
    return params, config, tokenizer
