"""Reading checkpoints made elsewhere: transformers directories and llama.cpp GGUF files, with their
tokenizers, for the programs that start from one (`train.sample`, `train.serve`, `train.export`,
`train.attention_maps`, a fine-tuning run's `train.init_from`).

Every failure is a `CheckpointError` of one line naming the file and the key, tensor, architecture
or tensor type; the packages these need (safetensors, tokenizers, gguf) are imported on first use.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from jaxattn.config import ModelConfig
from train.checkpoints.store import CheckpointError
from train.cli import one_line


def hf_package():
    """`jaxattn.hf`, imported on first use (it needs safetensors); ImportError as a CheckpointError."""
    try:
        from jaxattn import hf
    except ImportError as err:
        raise CheckpointError(f"Hugging Face interop needs {err.name or 'a missing package'}: "
                              "pip install safetensors tokenizers") from err
    return hf


def gguf_package():
    """`jaxattn.gguf`, imported on first use (it needs the gguf package); ImportError as a CheckpointError."""
    try:
        from jaxattn import gguf
    except ImportError as err:
        raise CheckpointError(f"reading GGUF files needs {err.name or 'a missing package'}: pip install gguf") from err
    return gguf


def open_gguf(path: str | Path):
    """The `jaxattn.gguf.GGUFModel` of `path`; CheckpointError (one line, naming the file) when it cannot be read."""
    gguf, hf = gguf_package(), hf_package()
    try:
        return gguf.GGUFModel.open(path)
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


def load_gguf_model(model, allow_nonfinite: bool) -> tuple[Any, ModelConfig, Any]:
    hf = hf_package()
    try:
        tokenizer = model.tokenizer()
        config, params = model.load("float32", allow_nonfinite=allow_nonfinite)
    except hf.HFCheckpointError as err:
        message = one_line(err).replace(hf.checkpoint.NONFINITE_HINT, "--allow-nonfinite loads them anyway")
        raise CheckpointError(f"cannot load {message}") from err
    return params, config, tokenizer


def load_gguf(path: str | Path, *, allow_nonfinite: bool = False) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of a llama.cpp GGUF file, as `load_hf` gives them for a directory.

    The weights are dequantized to float32. CheckpointError (one line, naming the file and the key,
    tensor, architecture or tensor type) for a file that is missing, is not GGUF, or holds what
    jaxattn does not read; the tokenizer is built (and checked) before any tensor is read.
    """
    return load_gguf_model(open_gguf(path), allow_nonfinite)


def gguf_kept_quantization(path: str | Path) -> str | None:
    """The `jaxattn.quantize` mode that keeps a GGUF file's weights as the file stores them, or None.

    "int8:32" when its matmul weights are all Q8_0 (`jaxattn.gguf.GGUFModel.kept_quantization`:
    quantizing `load_gguf`'s float32 params so gives back the file's int8 values and scales
    exactly); None for any other file. A separate step from `load_gguf`, whose params stay float32.
    CheckpointError as `load_gguf` raises it.
    """
    return open_gguf(path).kept_quantization()


def chat_of(model) -> tuple[str | None, dict[str, str]]:
    hf = hf_package()
    try:
        return model.chat_template, model.special_tokens
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


def gguf_chat(path: str | Path) -> tuple[str | None, dict[str, str]]:
    """(the chat template or None, the named special tokens) of a GGUF file, for `train.serve`."""
    return chat_of(open_gguf(path))


def hf_config(directory: str | Path) -> ModelConfig:
    """The model config of a transformers directory, from its config.json alone (no tensor is read);
    CheckpointError (one line naming the file and the key) when it cannot be read or is unsupported."""
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is not a directory (expected a transformers save: "
                              "config.json, *.safetensors, tokenizer.json)")
    hf = hf_package()
    try:
        return hf.architectures.config_from_hf(hf.checkpoint.read_config_json(path))[1]
    except hf.HFCheckpointError as err:
        where = "" if isinstance(err, hf.InvalidCheckpoint) else f"{path}: "
        raise CheckpointError(f"cannot load {where}{one_line(err)}") from err


def gguf_config(path: str | Path) -> ModelConfig:
    """The model config of a GGUF file, from its metadata alone; CheckpointError as `load_gguf` raises it."""
    model, hf = open_gguf(path), hf_package()
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
        raise CheckpointError(f"{str(path)!r} is not a directory (expected a transformers save: "
                              "config.json, *.safetensors, tokenizer.json)")
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json: the text cannot be encoded (python -m "
                              "train.export writes one; for a transformers model, save its fast tokenizer there)")
    hf = hf_package()
    try:
        tokenizer = hf.load_tokenizer(path)
        config, params = hf.load_pretrained(path, dtype="float32", allow_nonfinite=allow_nonfinite)
    except hf.HFCheckpointError as err:
        message = one_line(err).replace(hf.checkpoint.NONFINITE_HINT, "--allow-nonfinite loads them anyway")
        where = "" if isinstance(err, hf.InvalidCheckpoint) else f"{path}: "  # an InvalidCheckpoint names its file
        raise CheckpointError(f"cannot load {where}{message}") from err
    except OSError as err:
        raise CheckpointError(f"cannot load {path}: {err.filename or path}: {err.strerror or err}") from err
    return params, config, tokenizer
