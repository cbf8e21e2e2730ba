"""A Hugging Face config.json -> the `ModelConfig` that computes the same function.

Generic over the registry (`jaxattn.hf.families.FAMILIES`): the family is
config.json's `model_type`, checked against its `architectures`, and its
record's `read` turns the transformers config into `ModelConfig` fields (with
transformers 5.23's class defaults for keys a config.json leaves out); its
`biases` rule adds the bias fields. Every value is read through
`jaxattn.hf.fields`: a missing required key, a value of the wrong JSON type or
an impossible size raises `InvalidCheckpoint` naming the file and key.
Anything jaxattn would compute differently raises `UnsupportedCheckpoint`
naming the architecture or the field, before any tensor is read:

* a quantized checkpoint (`quantization_config`) unless its family reads that `quant_method`
  (`Family.quantized`: GPT-OSS's "mxfp4" experts, dequantized to floats on loading, the other
  tensors of such a checkpoint read as usual); any other method (GPTQ, AWQ, FP8, ...) is refused;
* mixture-of-experts layers in a family that does not read them (`Family.reads_experts`;
  the families that do turn them into `ModelConfig.moe`), named by the config key that
  shows them (`MOE_KEYS`, e.g. `n_routed_experts`, `num_experts`, `num_local_experts`);
* a `model_type` no family is registered for, or an `architectures` entry
  other than the family's causal LM class;
* a feature of a registered family jaxattn does not compute (the family's reader says which).
"""

from __future__ import annotations

from typing import Any, Mapping

from jaxattn._validate import is_int
from jaxattn.config import ModelConfig
from jaxattn.hf.errors import HFCheckpointError, InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.families import FAMILIES
from jaxattn.hf.family import Family
from jaxattn.hf.fields import Fields

# model_type -> the transformers class each family is read from and exported to.
ARCHITECTURES = {name: family.architecture for name, family in FAMILIES.items()}
# config.json keys holding a number of experts: set (> 0), the model has mixture-of-experts layers.
MOE_KEYS = ("n_routed_experts", "num_local_experts", "num_experts", "moe_num_experts")


def _refuse_quantized(hf: Fields, family: Family | None) -> None:
    """UnsupportedCheckpoint for a `quantization_config` whose `quant_method` the family does not read.

    A method it reads (`Family.quantized`) passes: which tensors are packed is then decided by the
    names the checkpoint holds (the layout's `Entry.packed` alternatives); a packed tensor of any
    other parameter is an unexpected tensor, reported by name when the tensors are checked.
    """
    quantization = hf.section("quantization_config")
    if quantization:  # GPTQ, AWQ, FP8 ...: integer or 8-bit tensors with scales jaxattn does not apply
        method = quantization.get("quant_method", "?")
        if family is not None and isinstance(method, str) and method in family.quantized:
            return
        raise UnsupportedCheckpoint(f"a quantized checkpoint (quantization_config.quant_method={method!r}) is not "
                                    "read: jaxattn loads F32, F16, BF16 or F64 weights; dequantize it first")


def _refuse_experts(hf: Fields, family: Family | None, name: str) -> None:
    """UnsupportedCheckpoint naming "mixture-of-experts" and the key, when any layer has routed experts
    and the family does not read them (`Family.reads_experts`)."""
    if family is not None and family.reads_experts:
        return
    if family is not None and family.experts is not None:
        key, count, layers = family.experts(hf)
        where = f"layers {layers}" if count and layers else ""
    else:  # any experts key set: every layer (the architecture's own rules are unknown here)
        key = next((k for k in MOE_KEYS if is_int(hf.get(k), numpy=False) and hf[k] > 0), None)
        count, where = (hf[key], "its MLP layers") if key else (0, "")
    if where:
        raise UnsupportedCheckpoint(f"{name}: {key}={count}: {where} are mixture-of-experts, which jaxattn does "
                                    "not load (dense MLP layers only)")


def family_of(hf: Fields) -> Family:
    """The registered family of a config.json (its `model_type`), checked against `architectures`."""
    model_type, named = hf.text("model_type"), hf.texts("architectures", [])
    family = FAMILIES.get(model_type)
    _refuse_quantized(hf, family)
    _refuse_experts(hf, family, family.architecture if family else f"model_type={model_type!r} {named}")
    if family is None:
        raise UnsupportedCheckpoint(f"unsupported architecture: model_type={model_type!r} architectures={named}; "
                                    f"supported: {sorted(ARCHITECTURES.values())}")
    if named and family.architecture not in named:
        raise UnsupportedCheckpoint(f"unsupported architecture {named} for model_type={model_type!r}: only "
                                    f"{family.architecture} (a causal LM with its head) is read")
    return family


def config_from_hf(hf: Mapping[str, Any], dtype: str = "float32") -> tuple[Family, ModelConfig]:
    """`(family, ModelConfig)` computing what transformers computes for this config.json.

    `hf` is the parsed config.json, or `Fields` naming the file it came from.
    Raises UnsupportedCheckpoint (naming the architecture or field) for
    anything else, InvalidCheckpoint (naming the file and key) for a key
    that is missing or of the wrong type, and for values that make no model
    (e.g. hidden_size not divisible by num_attention_heads).
    """
    hf = hf if isinstance(hf, Fields) else Fields(hf)
    family = family_of(hf)
    try:
        fields = {**family.read(hf), **family.biases.read(hf)}
        return family, ModelConfig(**fields, dtype=dtype, param_dtype=dtype, dropout=0.0)
    except HFCheckpointError:
        raise
    except (ValueError, TypeError) as err:  # ModelConfig's and RopeScaling's own checks, e.g. divisibility
        raise InvalidCheckpoint(hf.path, None, f"describes no model jaxattn can build: {err}") from None
