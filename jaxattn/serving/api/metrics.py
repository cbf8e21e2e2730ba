"""`GET /metrics`: the engine's state and the requests' latencies in Prometheus text (prometheus_client).

Gauges are read from the engine when scraped (`jaxattn_requests_running`, `_waiting`,
`jaxattn_kv_pages_used`, `_total`, `_cached`, and for LoRA adapters `jaxattn_lora_adapters_loaded` and
`jaxattn_lora_requests_running{adapter=...}`, one series per adapter held); counters and histograms are
updated on the engine's thread after each step. Pages "used" are those held by requests; pages that
are free but still hold a prefix-cache entry are `jaxattn_kv_pages_cached`.

With speculative decoding (`EngineConfig.speculative`) the spec-decode counters, vLLM's, are read from the
engine's `Speculator` when scraped: `jaxattn_spec_decode_num_drafts` (rows that drafted, over the
verification steps), `_num_draft_tokens`, `_num_accepted_tokens`, `_num_accepted_tokens_per_pos{position}`
(the acceptance rate per position is it over `_num_drafts`), `_verify_steps` and `_draft_seconds`.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client import CONTENT_TYPE_LATEST
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from jaxattn.serving import Engine, Request

CONTENT_TYPE = CONTENT_TYPE_LATEST
# Seconds. Time to first token spans a CPU's prompt chunks and a queue; inter-token latency one step.
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 20, 40, 80, 160)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5)


class ServerMetrics:
    """The server's metrics in a registry of their own."""

    def __init__(self, engine: Engine):
        self.registry = registry = CollectorRegistry()
        allocator = engine.allocator
        Gauge("jaxattn_requests_running", "Requests holding a row of the engine", registry=registry
              ).set_function(lambda: len(engine.running))
        Gauge("jaxattn_requests_waiting", "Requests waiting for a row or pages", registry=registry
              ).set_function(lambda: len(engine.waiting))
        Gauge("jaxattn_kv_pages_used", "KV-cache pages held by requests", registry=registry
              ).set_function(lambda: allocator.in_use)
        Gauge("jaxattn_kv_pages_total", "KV-cache pages in the pool", registry=registry
              ).set_function(lambda: allocator.num_pages)
        Gauge("jaxattn_kv_pages_cached", "Free pages that still hold a prefix-cache entry", registry=registry
              ).set_function(lambda: allocator.cached)
        self.prefix_hits = Counter("jaxattn_prefix_cache_hits", "Prompt pages found in the prefix cache",
                                   registry=registry)
        self.prefix_queries = Counter("jaxattn_prefix_cache_queries", "Full prompt pages looked up",
                                      registry=registry)
        self.generated = Counter("jaxattn_generated_tokens", "Tokens drawn", registry=registry)
        self.prompt_tokens = Counter("jaxattn_prompt_tokens", "Prompt tokens of finished requests",
                                     registry=registry)
        self.finished = Counter("jaxattn_requests_finished", "Requests ended, by reason", ["reason"],
                                registry=registry)
        self.ttft = Histogram("jaxattn_time_to_first_token_seconds", "From arrival to the first token",
                              buckets=TTFT_BUCKETS, registry=registry)
        self.itl = Histogram("jaxattn_inter_token_latency_seconds", "Between a request's tokens",
                             buckets=ITL_BUCKETS, registry=registry)
        Gauge("jaxattn_lora_adapters_loaded", "LoRA adapters held (in slots or on the host)", registry=registry
              ).set_function(lambda: len(engine.lora_names))
        registry.register(LoraRunning(engine))
        if engine.speculator is not None:
            registry.register(SpecDecode(engine.speculator))
        self._seen = {"hits": 0, "queries": 0, "generated": 0}
        self._engine = engine

    def on_tokens(self, request: Request, first: int) -> None:
        times = request.token_times
        if first == 0:
            self.ttft.observe(times[0] - request.arrival_time)
        for i in range(max(first, 1), len(times)):
            self.itl.observe(times[i] - times[i - 1])

    def on_step(self, engine: Engine, ended: list[Request]) -> None:
        for name, now, counter in (("hits", engine.allocator.hits, self.prefix_hits),
                                   ("queries", engine.allocator.queries, self.prefix_queries),
                                   ("generated", engine.stats["generated_tokens"], self.generated)):
            if now > self._seen[name]:
                counter.inc(now - self._seen[name])
                self._seen[name] = now
        for request in ended:
            self.finished.labels(request.finish_reason).inc()
            self.prompt_tokens.inc(len(request.prompt_ids))

    def text(self) -> bytes:
        return generate_latest(self.registry)


class LoraRunning:
    """`jaxattn_lora_requests_running{adapter=...}`: per adapter held, the running requests that name it."""

    def __init__(self, engine: Engine):
        self._engine = engine

    def describe(self):
        return [GaugeMetricFamily("jaxattn_lora_requests_running", "Running requests of each LoRA adapter",
                                  labels=["adapter"])]

    def collect(self):
        family = self.describe()[0]
        running = [request.sampling.lora for request in list(self._engine.running)]
        for name in self._engine.lora_names:
            family.add_metric([name], running.count(name))
        yield family


class SpecDecode:
    """Speculative decoding's counters (vLLM's spec-decode metrics), read from the engine's `Speculator`."""

    COUNTERS = (("num_drafts", "drafts_made", "Rows that drafted tokens in a verification step"),
                ("num_draft_tokens", "draft_tokens", "Tokens drafted"),
                ("num_accepted_tokens", "accepted_tokens", "Drafted tokens kept"),
                ("verify_steps", "steps", "Verification steps"),
                ("draft_seconds", "draft_seconds", "Host seconds spent drafting"))

    def __init__(self, speculator):
        self._speculator = speculator

    def describe(self):
        return list(self.collect())

    def collect(self):
        for name, attribute, documentation in self.COUNTERS:
            yield CounterMetricFamily(f"jaxattn_spec_decode_{name}", documentation,
                                      value=getattr(self._speculator, attribute))
        family = CounterMetricFamily("jaxattn_spec_decode_num_accepted_tokens_per_pos",
                                     "Drafted tokens kept at each position (0: the first draft)", labels=["position"])
        for position, count in enumerate(self._speculator.accepted_per_position.tolist()):
            family.add_metric([str(position)], count)
        yield family
