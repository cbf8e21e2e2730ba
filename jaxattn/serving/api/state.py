"""What the routes read: the served model, the server's limits, and the one `ApiState` holding them
beside the engine's runner and the metrics (`app.state.api`)."""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import numpy as np

from jaxattn.hf.chat_template import ChatTemplate
from jaxattn.serving.api.metrics import ServerMetrics
from jaxattn.serving.api.runner import EngineRunner


@dataclasses.dataclass
class ServedModel:
    """What the API serves: the engine's model under a name, its text codec and its chat template.

    Attributes:
      name: the model id clients send (`--served-model-name`).
      encode: text -> ids; `encode(text, special)` adds the tokenizer's own special tokens (a BOS)
        when `special` (a completion's prompt), not for a rendered chat, whose template writes them.
      max_model_len: the longest prompt + output (the model card's; the engine checks it).
      stop_token_ids: the end-of-sequence ids that end every request.
      chat_template: None: chat is refused with a 400 (completions still work).
      decode: ids -> text, special tokens kept (`/detokenize`; ValueError for ids it cannot decode);
        None: `/detokenize` answers 404.
      vocab_size: the model's vocabulary (ids at or past it are refused); None: unchecked here.
      embed: `embed(ids, normalize)` -> the text's float32 embedding (`jaxattn.serving.embedding.Embedder`),
        run on the engine's thread; None: `/v1/embeddings` answers 404. It runs the base, never an adapter.
      load_adapter: `load_adapter(path)` -> a PEFT LoRA adapter directory's params for `Engine.add_lora`
        (ValueError, one line, for one it cannot read); None: `/v1/load_lora_adapter` answers 400.
    """

    name: str
    encode: Callable[[str, bool], list[int]]
    max_model_len: int
    stop_token_ids: tuple[int, ...] = ()
    chat_template: ChatTemplate | None = None
    decode: Callable[[list[int]], str] | None = None
    vocab_size: int | None = None
    embed: Callable[[list[int], bool], np.ndarray] | None = None
    load_adapter: Callable[[str], Any] | None = None


@dataclasses.dataclass
class Limits:
    """The server's own limits: an API key for `/v1/` (None: open) and the largest body."""

    api_key: str | None = None
    max_body_bytes: int = 4 * 2**20


@dataclasses.dataclass
class ApiState:
    """Everything a route reads (`app.state.api`): the engine's runner, the model, the metrics, the limits."""

    runner: EngineRunner
    served: ServedModel
    metrics: ServerMetrics
    limits: Limits
