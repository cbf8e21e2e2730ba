"""The registry of Hugging Face families: one module per family, one line each below.

Each module `jaxattn.hf.families.<name>` defines `FAMILY`, a
`jaxattn.hf.family.Family` record. `REGISTERED` is also the export order:
`jaxattn.hf.export` writes a `ModelConfig` as the first family whose
`refusal` is empty, so a family that computes a superset of an earlier one's
configs (Mistral's window, Qwen2's biases, SmolLM3's NoPE layers, Phi-3's
partial rotary over Llama) comes after it, and the plainest match wins.
Adding a family: write its module, add its name here. What several families share lives beside
them: `common` (config.json readers and writers, per-layer attention, Llama-style tensors), `gemma`
(Gemma 2 and 3), `mla` (DeepSeek-V2/V3's MLA and experts), `moe` (mixture-of-experts MLPs).
"""

from __future__ import annotations

import importlib

from jaxattn.hf.family import Family

REGISTERED = (
    "gpt2",
    "gpt_neox",
    "llama",
    "mistral",
    "qwen2",
    "qwen3",
    "deepseek_v3",
    "deepseek_v2",
    "qwen2_moe",
    "qwen3_moe",
    "mixtral",
    "phi3",
    "smollm3",
    "olmo2",
    "gemma2",
    "gemma3",
    "gpt_oss",
)

FAMILIES: dict[str, Family] = {}
for _name in REGISTERED:
    _family = importlib.import_module(f"{__name__}.{_name}").FAMILY
    FAMILIES[_family.model_type] = _family
