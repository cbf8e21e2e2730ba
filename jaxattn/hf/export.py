"""A `ModelConfig` -> the transformers architecture and config.json that compute the same function.

`export_family` picks the first family of the registry
(`jaxattn.hf.families.REGISTERED`, in its order) whose `refusal` is empty,
biases included (`Family.biases`): that family computes exactly what the
config computes. Without one, `UnsupportedCheckpoint` names, for the nearest
families (fewest differences in kind: attention, positions, norm, MLP, block
layout; then fewest differences), the field that keeps each from it.
`hf_config` writes that family's config.json (the form transformers 5.23
reads, checked in tests/test_hf*.py by loading it with
`AutoModelForCausalLM`). In the registry's order:

| jaxattn config | exports to |
| --- | --- |
| learned positions, LayerNorm, GELU MLP, MHA | GPT-2 (zero biases where the config has none) |
| RoPE (whole heads or an even part), LayerNorm, GELU MLP, MHA | GPT-NeoX (sequential or parallel residual) |
| RoPE, RMSNorm, gated MLP | Llama (SmolLM when tied) |
| ... with one sliding window for every layer, no biases | Mistral |
| ... with windows on some layers, or q/k/v biases only | Qwen2 |
| ... with a per-head qk norm | Qwen3 |
| MLA (rope, rmsnorm, gated MLP, norm_eps 1e-6) | DeepSeek-V3 (DeepSeek-V2 for MLP biases, interleaved RoPE) |
| ... with routed experts: sigmoid router (DeepSeek-V3) or softmax, greedy or group-limited by max (V2) | DeepSeek-V3, -V2 |
| Llama-like with routed experts and a gated shared expert / q-k head norm / renormalised top-k | Qwen2-MoE, Qwen3-MoE, Mixtral |
| RoPE on an even part of each head, RMSNorm, gated MLP, no biases | Phi-3 (one window or none) |
| NoPE layers, or no positions at all, or windows with biases | SmolLM3 |
| post-norm, full-width qk norm | OLMo 2 |
| sandwich (1 + w) RMSNorms, sqrt(D) embeddings, integral query_pre_attn_scalar | Gemma 2, Gemma 3 (qk norm) |
| attention sinks, routed experts with a biased router, softmax over the top k, clamped experts | GPT-OSS |

Interleaved RoPE exports to the half-split families by renaming head dims
(`jaxattn.hf.weights.half_split_columns`).
"""

from __future__ import annotations

from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.hf.errors import UnsupportedCheckpoint
from jaxattn.hf.families import FAMILIES
from jaxattn.hf.family import Family, Problem

MAX_LISTED = 3  # architectures named per field in a refusal


def problems(family: Family, c: ModelConfig) -> list[Problem]:
    """Why `c` does not export to `family` ([]: it does)."""
    return family.refusal(c) + family.biases.problems(c, family.architecture)


def _nearest(refused: list[tuple[Family, list[Problem]]]) -> str:
    """One sentence per field that keeps the nearest families from computing the config."""
    rank = lambda found: (sum(p.major for p in found), len(found))  # noqa: E731
    best = min(rank(found) for _, found in refused)
    fields: dict[str, list[Problem]] = {}
    for _, found in refused:
        if rank(found) == best:
            fields.setdefault(found[0].field, []).append(found[0])
    return "; ".join(f"ModelConfig.{field}={listed[0].value!r} has no transformers counterpart: "
                     + ", ".join(p.why for p in listed[:MAX_LISTED]) + (", ..." if len(listed) > MAX_LISTED else "")
                     for field, listed in fields.items())


def export_family(c: ModelConfig) -> Family:
    """The transformers family that computes exactly what `c` computes (UnsupportedCheckpoint if none)."""
    refused = []
    for family in FAMILIES.values():
        found = problems(family, c)
        if not found:
            return family
        refused.append((family, found))
    raise UnsupportedCheckpoint(_nearest(refused))


def hf_config(c: ModelConfig, eos_token_id: int | None = None) -> tuple[Family, dict[str, Any]]:
    """`(family, config.json dict)` of the transformers model equal to `c` (UnsupportedCheckpoint if none)."""
    family = export_family(c)
    return family, dict(architectures=[family.architecture], model_type=family.model_type, vocab_size=c.vocab_size,
                        **family.write(c), **family.biases.write(c), tie_word_embeddings=c.tie_embeddings,
                        dtype=c.param_dtype, torch_dtype=c.param_dtype, bos_token_id=None,
                        eos_token_id=eos_token_id, pad_token_id=None, use_cache=True)
