"""Serving many requests at once: a paged KV cache and continuous batching (docs/serving.md).

* `Engine`, `EngineConfig` (`jaxattn.serving.engine`): the scheduler and the step loop;
* `SamplingParams`, `Request` (`jaxattn.serving.requests`): what a caller asks and gets;
* `PageAllocator` (`jaxattn.serving.pages`): pages, refcounts, the prefix cache;
* `jaxattn.serving.step`: the compiled step programs, one per shape bucket;
* `TextStream` (`jaxattn.serving.text`): streamed text in whole characters, stop strings.
"""

from jaxattn.serving.engine import Engine, EngineConfig
from jaxattn.serving.pages import PageAllocator, page_keys
from jaxattn.serving.requests import Request, SamplingParams, Status
from jaxattn.serving.step import StepShape
from jaxattn.serving.text import TextStream

__all__ = ["Engine", "EngineConfig", "PageAllocator", "Request", "SamplingParams", "Status", "StepShape",
           "TextStream", "page_keys"]
