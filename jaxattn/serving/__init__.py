"""Serving many requests at once: a paged KV cache and continuous batching (docs/serving.md).

The engine, in parts that each do one job (vLLM V1's split):

* `Engine` (`jaxattn.serving.engine`): the facade callers use: add, step, cancel, run;
* `EngineConfig` (`jaxattn.serving.engine_config`): its shape and memory;
* `jaxattn.serving.validation`: every check of a request (`RequestError`, a ValueError with the OpenAI
  parameter and code);
* `Scheduler` (`jaxattn.serving.scheduler`): admission, the queue's limit (`QueueFull`), the token
  budget, preemption; each step as a `SchedulerOutput` (`jaxattn.serving.scheduler_output`);
* `Speculator` (`jaxattn.serving.speculation`): speculative decoding's drafts (prompt lookup), each row's
  k, the spec-decode counters;
* `jaxattn.serving.verify`: the verification step's programs (a row's last token and its drafts in one
  forward, the drafts accepted on the device);
* `KVCacheManager` (`jaxattn.serving.kv_cache_manager`): each request's pages;
* `jaxattn.serving.kv_memory`: the pool's size, checked against the memory available before it is taken;
* `PageAllocator` (`jaxattn.serving.pages`): the pool's pages, refcounts, the prefix cache;
* `ModelRunner` (`jaxattn.serving.model_runner`): placed parameters and pools, a step's arrays, the run;
* `jaxattn.serving.step`: the compiled step programs, one per shape bucket;
* `jaxattn.serving.multi_step`: several decode steps in one program call, one program per decode bucket;
* `LoraTable` (`jaxattn.serving.loras`): the LoRA adapters held, which sit in the model's slots and which
  wait on the host, least recently used first out;
* `StepClock` (`jaxattn.serving.step_clock`): where each step's time goes, host phase by phase and the
  device's wait;
* `jaxattn.serving.logit_knobs`: logit bias, the penalties and min-p on the device, per drawn row;
* `Guide` (`jaxattn.serving.guides`): what a request's output must match (a schema, a regex, a grammar);
* `GuideCompiler` (`jaxattn.serving.structured`): guides compiled by llguidance for the model's
  tokenizer, each guided row's mask of allowed tokens;
* `SamplingParams`, `Request` (`jaxattn.serving.requests`): what a caller asks and gets;
* `TextStream` (`jaxattn.serving.text`): streamed text in whole characters, stop strings;
* `Embedder` (`jaxattn.serving.embedding`): a text's embedding, the decoder's last state pooled.

Beside the engine, `jaxattn.serving.api` is its OpenAI-compatible HTTP server (FastAPI), which
`python -m train.serve` runs; it is not imported here, so the engine needs no web framework.
"""

from jaxattn.serving.embedding import Embedder
from jaxattn.serving.engine import Engine
from jaxattn.serving.engine_config import EngineConfig
from jaxattn.serving.guides import Guide
from jaxattn.serving.kv_cache_manager import KVCacheManager
from jaxattn.serving.loras import LoraExists, LoraInUse, LoraTable, UnknownLora
from jaxattn.serving.model_runner import ModelRunner
from jaxattn.serving.pages import PageAllocator, page_keys
from jaxattn.serving.requests import Request, SamplingParams, Status
from jaxattn.serving.scheduler import QueueFull, Scheduler
from jaxattn.serving.scheduler_output import SchedulerOutput
from jaxattn.serving.speculation import Speculator
from jaxattn.serving.step import StepShape
from jaxattn.serving.step_clock import StepClock
from jaxattn.serving.structured import GuideCompiler
from jaxattn.serving.text import TextStream
from jaxattn.serving.validation import RequestError, RequestLimits

__all__ = ["Embedder", "Engine", "EngineConfig", "Guide", "GuideCompiler", "KVCacheManager", "LoraExists",
           "LoraInUse", "LoraTable", "ModelRunner", "PageAllocator", "QueueFull", "Request", "RequestError",
           "RequestLimits", "SamplingParams", "Scheduler", "SchedulerOutput", "Speculator", "Status", "StepClock", "StepShape",
           "TextStream", "UnknownLora", "page_keys"]
