"""llama.cpp's GGUF files into jaxattn, without torch or transformers: the model, its tokenizer, its chat template.

```python
from jaxattn import gguf
config, params, tokenizer, chat_template = gguf.load_gguf("SmolLM2-135M-Instruct-Q8_0.gguf")
logits = jaxattn.DecoderLM(config).apply({"params": params}, tokens)
ids = tokenizer.encode("Hello")           # a jaxattn.hf.HFTokenizer: encode, decode, eos_token_id
```

The file is read with the `gguf` package's `GGUFReader` (llama.cpp's own Python reader) and
becomes what `jaxattn.hf` reads from a transformers checkpoint: its metadata a config.json dict
(`jaxattn.gguf.hf_config`), its tensors the state dict under transformers' names, each dequantized
when it is loaded (`jaxattn.gguf.reader`). `jaxattn.hf.load_state_dict` then does the rest with
the family's own mapping and checks, so a GGUF file loads as the transformers checkpoint it was
converted from, and computes what transformers' own GGUF loader
(`AutoModelForCausalLM.from_pretrained(dir, gguf_file=name)`) computes from it.

Architectures (`general.architecture`, one record each in `jaxattn.gguf.architectures`):
`llama` (Llama 1/2/3, SmolLM; Mistral 7B's files, which llama.cpp writes as `llama`), `qwen2`,
`qwen3`, `phi3`, `gemma2`, `gemma3` (text). Tensor types (`TENSOR_TYPES`): F32, F16, BF16 and
llama.cpp's block formats Q8_0, Q4_0, Q4_1, Q5_0, Q5_1, Q2_K, Q3_K, Q4_K, Q5_K and Q6_K, all
dequantized to float32 by `gguf.quants.dequantize` and then cast to `dtype`. The block formats can
be kept quantized afterwards: `GGUFModel.kept_quantization()` names the `jaxattn.quantize` modes that
give back the file's own numbers (Q8_0, Q4_0, Q4_1) or the nearest native format (the others), for
the layers and the head (`jaxattn.gguf.kept`; `train.sample` and `train.serve --gguf` do so by default).

Errors: every failure is a `jaxattn.hf.HFCheckpointError` (a ValueError), its message naming the
file: `UnsupportedCheckpoint` for an architecture, tensor type, tokenizer kind, RoPE scaling or
tensor jaxattn does not read (naming it), `InvalidCheckpoint` for a file that is missing, is not
GGUF, or holds metadata or tensors no model can have (naming the key or tensor).

Where the file states what transformers' loader drops, jaxattn reads it and so computes the model
the file describes rather than transformers' (`jaxattn.gguf.hf_config`): RoPE scaling (linear, and
Llama 3.1's, which llama.cpp stores as `rope_freqs.weight`), Qwen3's head size, Gemma 2's
soft-caps and Gemma 3's local/global pattern. On every other file both compute the same logits.

Contracts:

* `load_gguf(path, dtype="float32", *, allow_nonfinite=False) -> (ModelConfig, params,
  tokenizer, chat_template)`: `dtype` ("float32" or "bfloat16") as in `jaxattn.hf.load_pretrained`;
  the tokenizer a `jaxattn.hf.HFTokenizer` (its `eos_token_id` is `tokenizer.ggml.eos_token_id`);
  `chat_template` the file's `tokenizer.chat_template` or None. The metadata, tensor types and
  tokenizer are all checked before any tensor is dequantized.
* `GGUFModel.open(path)` is that file opened and checked without loading the weights: its
  `metadata`, `hf_config()` (the config.json dict), `tokenizer()`, `chat_template`,
  `special_tokens` (`{"bos_token": ..., ...}` for the template), `load(dtype)` and
  `kept_quantization()`.

Modules: `reader` (the file, its tensors dequantized), `hf_config` (metadata -> config.json),
`tokenizer`, `architecture` and `architectures` (one record per architecture), `kept` (block
formats -> quantize modes).
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Any

from jaxattn.config import ModelConfig
from jaxattn.gguf.architectures import ARCHITECTURES
from jaxattn.gguf.hf_config import hf_config
from jaxattn.gguf.kept import KeptQuantization, kept_quantization
from jaxattn.gguf.reader import TENSOR_TYPES, GGUFFile, GGUFTensors
from jaxattn.gguf.tokenizer import build_tokenizer, special_tokens
from jaxattn.hf.checkpoint import load_state_dict
from jaxattn.hf.errors import HFCheckpointError, InvalidCheckpoint, UnsupportedCheckpoint
from jaxattn.hf.fields import Fields
from jaxattn.hf.tokenizer import HFTokenizer

__all__ = ["ARCHITECTURES", "GGUFModel", "HFCheckpointError", "InvalidCheckpoint", "KeptQuantization", "TENSOR_TYPES",
           "UnsupportedCheckpoint", "load_gguf"]


@dataclasses.dataclass(frozen=True)
class GGUFModel:
    """A GGUF file opened and checked (metadata, architecture, tensor types); nothing dequantized yet.

    Attributes:
      file: the `jaxattn.gguf.reader.GGUFFile` (its `path`, `metadata`, `architecture`, `tensors`).
    """

    file: GGUFFile

    @classmethod
    def open(cls, path: str | Path) -> GGUFModel:
        """The file at `path`; errors as the module docstring says."""
        return cls(GGUFFile(path))

    @property
    def path(self) -> Path:
        return self.file.path

    @property
    def metadata(self) -> dict[str, Any]:
        return self.file.metadata

    def hf_config(self) -> dict[str, Any]:
        """The transformers config.json dict this file describes (`jaxattn.gguf.hf_config`)."""
        return hf_config(self.metadata, self.file.tensors, self.file.architecture, self.path, self.file.dequantized)

    def tokenizer(self) -> HFTokenizer:
        """The file's tokenizer (`jaxattn.gguf.tokenizer`) with its end-of-sequence id."""
        eos = self.metadata.get("tokenizer.ggml.eos_token_id")
        return HFTokenizer(build_tokenizer(self.metadata, self.file.architecture, self.path),
                           eos if isinstance(eos, int) else None)

    @property
    def chat_template(self) -> str | None:
        """`tokenizer.chat_template`, or None when the file has none."""
        template = self.metadata.get("tokenizer.chat_template")
        if template is not None and not isinstance(template, str):
            raise InvalidCheckpoint(self.path, "tokenizer.chat_template", "is not a string")
        return template

    @property
    def special_tokens(self) -> dict[str, str]:
        """The named special tokens the file gives (`bos_token`, `eos_token`, `unk_token`, `pad_token`)."""
        return special_tokens(self.metadata, self.path)

    def kept_quantization(self) -> KeptQuantization | None:
        """The `jaxattn.quantize` modes that keep the file's matmul weights quantized (its layers' and its
        head's), or None when they are float: `jaxattn.gguf.kept`."""
        return kept_quantization(self.file)

    def load(self, dtype: str = "float32", *, allow_nonfinite: bool = False) -> tuple[ModelConfig, dict]:
        """`(ModelConfig, DecoderLM params)`, each tensor dequantized as it is loaded."""
        fields = Fields(self.hf_config(), self.path)
        heads = fields.integer("num_attention_heads")
        tensors = GGUFTensors(self.file, heads, fields.integer("num_key_value_heads", heads))
        return load_state_dict(fields, tensors, dtype, allow_nonfinite=allow_nonfinite)


def load_gguf(path: str | Path, dtype: str = "float32", *, allow_nonfinite: bool = False
              ) -> tuple[ModelConfig, dict, HFTokenizer, str | None]:
    """`(ModelConfig, DecoderLM params, tokenizer, chat template or None)` of a llama.cpp GGUF file.

    See the module docstring for what is read and the errors; the tokenizer and the chat template
    are read (and checked) before any tensor is dequantized.
    """
    model = GGUFModel.open(path)
    tokenizer, template = model.tokenizer(), model.chat_template
    config, params = model.load(dtype, allow_nonfinite=allow_nonfinite)
    return config, params, tokenizer, template
