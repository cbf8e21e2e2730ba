"""Which attention layer a model's config asks for: the one place that maps a config to its kind.

Every block of a model has the same kind of attention: Multi-head Latent Attention when
`config.mla` is set, else standard multi-head attention with N query and K key/value heads. The
model builds its blocks from `attention_class(config)`, and the caches their arrays from that
class's own declaration (`cache_fields`, `cache_type`), so neither asks which kind it is.
"""

from __future__ import annotations

from jaxattn.config import ModelConfig
from jaxattn.layers.gqa import Attention
from jaxattn.layers.mla import MultiHeadLatentAttention


def attention_class(config: ModelConfig) -> type:
    """`MultiHeadLatentAttention` with `config.mla`, else `Attention` (MHA/MQA/GQA)."""
    return Attention if config.mla is None else MultiHeadLatentAttention
