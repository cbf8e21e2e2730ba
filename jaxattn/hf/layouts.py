"""A family's checkpoint tensors: its layout, and which stored tensors are not parameters.

Each family's layout (`Family.layout(config)`, built from
`jaxattn.hf.weights` entries) lists every tensor of a transformers checkpoint
of that config with the jaxattn parameter it holds; the same list validates a
checkpoint (names and shapes, before any data is read), loads it and writes
it. What else a stored file may hold is decided here, for every family alike.
"""

from __future__ import annotations

import re

from jaxattn.config import ModelConfig
from jaxattn.hf.family import Family
from jaxattn.hf.weights import Entry


def layout(family: Family, c: ModelConfig) -> list[Entry]:
    """Every tensor of a `family` checkpoint of config `c`, in model order."""
    return family.layout(c)


def stored_form(entries: list[Entry], stored: dict[str, str]) -> list[Entry]:
    """Each entry in the form the checkpoint holds: the first of it and its `alternatives` whose tensors
    are all in `stored` (else the entry itself, whose missing tensors are then reported)."""
    return [next((form for form in (entry, *entry.alternatives) if all(name in stored for name in form.names)),
                 entry) for entry in entries]


def stored_names(family: Family, names: list[str]) -> dict[str, str]:
    """`{current name: stored name}`: legacy names renamed, the base-model prefix added where a hub file lacks it."""
    aliases = dict(family.aliases)
    prefixed = any(name.startswith(family.prefix) for name in names)
    mapping = {}
    for name in names:
        current = aliases.get(name, name)
        if not prefixed and not current.startswith("lm_head."):
            current = family.prefix + current
        mapping[current] = name
    return mapping


def is_ignored(family: Family, name: str, c: ModelConfig, num_extra_layers: int = 0) -> bool:
    """A stored tensor that is not a parameter: a buffer, the tied head's copy, layers beyond the model's."""
    if any(re.search(pattern, name) for pattern in family.ignore):
        return True
    if c.tie_embeddings and name == "lm_head.weight":  # transformers ties it to the embedding anyway
        return True
    extra = re.match(re.escape(family.prefix) + r"layers\.(\d+)\.", name)  # e.g. DeepSeek-V3's MTP layers
    return bool(extra) and c.num_layers <= int(extra.group(1)) < c.num_layers + num_extra_layers
