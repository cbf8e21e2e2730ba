"""The registry of llama.cpp architectures jaxattn reads: one module per architecture, one line each below.

Each module `jaxattn.gguf.architectures.<name>` defines `ARCHITECTURE`, a
`jaxattn.gguf.architecture.Architecture` record: how the files llama.cpp writes for
that `general.architecture` become the config.json and tensors of a `jaxattn.hf`
family. Adding one: write its module, add its name here.
"""

from __future__ import annotations

import importlib

from jaxattn.gguf.architecture import Architecture

REGISTERED = ("llama", "qwen2", "qwen3", "phi3", "gemma2", "gemma3")

ARCHITECTURES: dict[str, Architecture] = {}
for _name in REGISTERED:
    _record = importlib.import_module(f"{__name__}.{_name}").ARCHITECTURE
    ARCHITECTURES[_record.name] = _record
