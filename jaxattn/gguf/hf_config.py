"""A GGUF file's metadata -> the transformers config.json dict `jaxattn.hf` reads, as transformers derives it.

transformers 5.23's loader (`load_gguf_checkpoint` in `transformers.modeling_gguf_pytorch_utils`)
copies the keys its `GGUF_CONFIG_MAPPING` lists for the architecture (`Architecture.config`:
`llama.block_count` -> `num_hidden_layers`, ...) and the tokenizer's ids, sets `model_type`,
`tie_word_embeddings` (true when the file holds no `output.weight`) and, when the file states no
`{architecture}.vocab_size`, the vocabulary's size from `tokenizer.ggml.tokens`. Every other
config.json key keeps its class default, as there.

Read here beyond that loader, where the file states them: each record's `extra_config` keys, and
RoPE scaling: `{architecture}.rope.scaling.type` "linear" with its `factor`, and Llama 3.1's
"llama3" scaling, which llama.cpp stores as the factor of each frequency (the tensor
`rope_freqs.weight`, `llama3_scaling`), both as config.json's `rope_scaling`. Any other scaling
type ("yarn", ...) is refused naming the key. transformers' loader drops all of these and
computes a different model from the one the file describes.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any, Callable, Mapping

import numpy as np

from jaxattn.gguf.architecture import LLAMA3_ROPE, TOKEN_ID_KEYS, Architecture
from jaxattn.hf.errors import InvalidCheckpoint, UnsupportedCheckpoint

TOKENS_KEY = "tokenizer.ggml.tokens"
LLAMA3_CONTEXT = 8192  # Llama 3's original context, llama.cpp's default for the factors it writes


def llama3_factors(inv_freq: np.ndarray, factor: float, low: float, high: float, context: int) -> np.ndarray:
    """The divisor of each RoPE frequency under 'llama3' scaling, as llama.cpp's converter writes them."""
    wavelen = 2 * math.pi / inv_freq
    smooth = (context / wavelen - low) / (high - low)
    medium = 1 / ((1 - smooth) / factor + smooth)
    return np.where(wavelen < context / high, 1.0, np.where(wavelen > context / low, factor, medium))


def llama3_scaling(factors: np.ndarray, theta: float, dims: int, path: Path) -> dict[str, Any] | None:
    """config.json's 'llama3' `rope_scaling` whose frequency divisors are `factors` (llama.cpp's `rope_freqs`).

    llama.cpp keeps only the divisors: `factor` is the largest, and the two wavelength thresholds
    come from the divisors between 1 and it (a line in 1 / wavelength), the original context taken
    as Llama 3's (8192, what llama.cpp assumes when it writes them). The result is checked by
    recomputing every divisor: factors that no 'llama3' scaling gives are refused, naming the tensor.
    """
    factors = np.asarray(factors, np.float64).reshape(-1)
    if factors.shape != (dims // 2,):
        raise InvalidCheckpoint(path, LLAMA3_ROPE, f"has {factors.size} values, expected {dims // 2} (one per "
                                f"rotated pair of a {dims}-dim head)")
    if np.allclose(factors, 1.0):
        return None
    factor, context = float(factors.max()), LLAMA3_CONTEXT
    inv_freq = 1.0 / theta ** (np.arange(0, dims, 2, dtype=np.float64) / dims)
    medium = (factors > 1 + 1e-6) & (factors < factor * (1 - 1e-6))
    low, high = 1.0, 4.0  # Llama 3.1's, when too few divisors lie between to say
    if medium.sum() >= 2:
        smooth = (1 / factors[medium] - 1 / factor) / (1 - 1 / factor)
        # smooth = context / (high - low) * (1 / wavelength) - low / (high - low)
        slope, intercept = np.polyfit(inv_freq[medium] / (2 * math.pi), smooth, 1)
        low = round(-intercept * context / slope, 3)  # Llama 3's are round numbers; the check below holds it
        high = round(low + context / slope, 3)
    if not (0 < low < high and np.allclose(llama3_factors(inv_freq, factor, low, high, context), factors,
                                           rtol=1e-4, atol=0)):
        raise UnsupportedCheckpoint(f"{path}: {LLAMA3_ROPE}: per-frequency RoPE factors that no 'llama3' scaling "
                                    "gives; jaxattn does not read them")
    return {"rope_type": "llama3", "factor": factor, "low_freq_factor": low, "high_freq_factor": high,
            "original_max_position_embeddings": context}


def rope_scaling(metadata: Mapping[str, Any], architecture: Architecture, path: Path) -> dict[str, Any] | None:
    """config.json's `rope_scaling` of the file's `rope.scaling.*` keys (None without scaling)."""
    key = f"{architecture.name}.rope.scaling.type"
    kind = metadata.get(key, "none")
    if kind == "none":
        return None
    if kind == "linear":
        return {"rope_type": "linear", "factor": metadata.get(f"{architecture.name}.rope.scaling.factor")}
    raise UnsupportedCheckpoint(f"{path}: {key}={kind!r}: this RoPE scaling is not read from GGUF files (only "
                                "'linear'); transformers' GGUF loader ignores it and computes another model")


def hf_config(metadata: Mapping[str, Any], tensor_names, architecture: Architecture, path: str | Path,
              read: Callable[[str], np.ndarray] | None = None) -> dict[str, Any]:
    """The config.json dict of a GGUF file with this metadata and these tensors (llama.cpp names);
    `read(name)` reads a tensor the record takes into the config (`Architecture.config_tensors`)."""
    prefix = f"{architecture.name}."
    config: dict[str, Any] = {"model_type": architecture.model_type_of(metadata)}
    for key, target in architecture.config.items():
        if prefix + key in metadata:
            config[target] = metadata[prefix + key]
    for key, target in architecture.extra_config.items():  # scalars only: a list form is left to the default
        if prefix + key in metadata and not isinstance(metadata[prefix + key], list):
            config[target] = metadata[prefix + key]
    for key, target in TOKEN_ID_KEYS.items():
        if key in metadata:
            config[target] = metadata[key]
    config["tie_word_embeddings"] = "output.weight" not in set(tensor_names)
    if "vocab_size" not in config and isinstance(metadata.get(TOKENS_KEY), list):
        config["vocab_size"] = len(metadata[TOKENS_KEY])
    scaling = rope_scaling(metadata, architecture, Path(path))
    if LLAMA3_ROPE in architecture.config_tensors and LLAMA3_ROPE in set(tensor_names) and read is not None:
        heads = config.get("num_attention_heads") or 1
        dims = config.get("head_dim") or (config.get("hidden_size") or 0) // heads
        llama3 = llama3_scaling(read(LLAMA3_ROPE), float(config.get("rope_theta", 10000.0)), int(dims), Path(path))
        if llama3 is not None and scaling is not None:
            raise UnsupportedCheckpoint(f"{path}: both {architecture.name}.rope.scaling.type and {LLAMA3_ROPE}: "
                                        "two RoPE scalings at once")
        scaling = llama3 or scaling
    if scaling is not None:
        config["rope_scaling"] = scaling
    return config
