"""What a model computes, as frozen dataclasses checked when built: one `ModelConfig` per model
(`jaxattn.config.model`), holding its layers' attention configs (`MLAConfig`, `LayerKind`, the
resolved `AttentionSpec`: `jaxattn.config.attention`) and mixture-of-experts config (`MoEConfig`:
`jaxattn.config.moe`); and which weights get LoRA adapters (`LoraConfig`: `jaxattn.config.lora`).

How it is computed on a machine (which kernels run) is a separate `jaxattn.kernels.Kernels`. These
modules import nothing of the model, so every layer, kernel and interop module can read them.
"""

from jaxattn.config.attention import AttentionSpec, LayerKind, MLAConfig
from jaxattn.config.lora import LoraConfig
from jaxattn.config.model import ModelConfig
from jaxattn.config.moe import MoEConfig

__all__ = ["AttentionSpec", "LayerKind", "LoraConfig", "MLAConfig", "ModelConfig", "MoEConfig"]
