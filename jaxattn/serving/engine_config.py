"""The engine's shape and memory: one frozen value, checked when it is built.

`EngineConfig` is read by every part of the engine: the scheduler (`max_seqs`, `max_waiting`, `chunk`,
`prefill_rows`, `token_budget`, `decode_steps`), the KV-cache manager (`page_size`, the pool, `prefix_caching`)
and the model runner (the compiled shapes: `buckets()`, `prefill_shapes()`, `steps_per_call()`; `kv_cache`;
the LoRA slots: `max_loras`, `max_lora_rank`, `lora_targets`, read by `jaxattn.serving.loras` too).
"""

from __future__ import annotations

import dataclasses

from jaxattn.cache.containers import KV_CACHES
from jaxattn.config.lora import TARGETS
from jaxattn.lora import FORMS
from jaxattn.speculative.ngram import NgramSettings


@dataclasses.dataclass(frozen=True)
class EngineConfig:
    """The engine's shape and memory.

    Attributes:
      max_seqs: the most requests running at once (decode rows per step).
      max_waiting: the most requests waiting beyond the rows the next step can fill; one more is
        refused (`jaxattn.serving.scheduler.QueueFull`; None: no limit).
      page_size: slots per page.
      num_pages: pages in the pool (None: from `kv_memory_gib`, else enough for every running sequence
        to reach the context, `max_seqs * ceil(max_seq_len / page_size)`, bounded by a share of the
        memory available: `jaxattn.serving.kv_memory`).
      kv_memory_gib: the pool's size in GiB instead of `num_pages`.
      chunk: prompt tokens per prefill row per step.
      prefill_rows: prompt chunks per step.
      token_budget: tokens per step, decoding first (None: max_seqs + prefill_rows * chunk).
      decode_buckets: the decode-row counts compiled (None: 1, 4, 16, ... up to max_seqs); a
        step runs the smallest that holds its decoding sequences.
      short_chunk: a second prefill shape, one row of this many tokens (None: chunk // 8, at least
        page_size; 0: none), for a step whose prompt work is one short piece (a prompt's tail, a
        short prompt, the few tokens after a prefix-cache hit): it costs its tokens, not a full chunk.
      prefix_caching: share full prompt pages between requests.
      max_model_len: the longest sequence (prompt + output; None: the model's max_seq_len).
      kv_cache: the pages' storage: "auto" (the compute dtype) or "int8" (int8 values and a float32
        scale per token and head: about a quarter of float32's bytes, so `kv_memory_gib` holds about
        four times the pages; `jaxattn.cache.build.cache_bytes_per_token`).
      decode_steps: the most decode steps one program call runs when every running row only decodes
        (`jaxattn.serving.multi_step`; 1: a call per step); None: the platform's (`steps_per_call`).
      overlap: queue a plain decode step's successor before reading its tokens, the successor fed them
        on the device (`jaxattn.serving.scheduler.Scheduler.schedule_ahead`): the host's part of a step
        runs while the device computes the one before. False: every step read back before the next.
      max_loras: LoRA adapters held in the model at once, chosen per request (`jaxattn.serving.loras`);
        0: none, the parameters and the step programs as without adapters. More adapters may be added
        than slots: they wait on the host and are written into a slot when a request needs one.
      max_lora_rank: the slots' rank, the most an adapter added may have (lower ranks are zero-padded).
      lora_targets: the projections the slots cover (`jaxattn.lora.TARGETS`); an adapter may adapt any
        of them, not others. MLA's k and v (its `wkv_b`) cannot be slotted: name q, o and the MLP's there.
      speculative: speculative decoding by prompt lookup (`jaxattn.speculative.NgramSettings`: n_min, n_max,
        k): a decode row drafts up to k tokens copied from its prompt and output, verified in one forward
        of k + 1 tokens per row (`jaxattn.serving.verify`), its k adapting to its acceptance; greedy tokens
        unchanged, sampled ones distributed as before. None: off.
      adaptive_k: with speculative decoding, each row drafts the count expected to give the most tokens a
        second, from its acceptance and the measured cost of wider steps (`jaxattn.speculative.schedule.AdaptiveK`,
        `DraftCosts`); False: always k.
      lora_form: how the slots' products run, one of `jaxattn.lora.FORMS` (the same sums), or "auto": the
        platform's (`jaxattn.kernels.select.lora_form`: the native loop on a CPU, float32 adapters).
    """

    max_seqs: int = 8
    page_size: int = 16
    num_pages: int | None = None
    kv_memory_gib: float | None = None
    chunk: int = 128
    prefill_rows: int = 2
    token_budget: int | None = None
    decode_buckets: tuple[int, ...] | None = None
    prefix_caching: bool = True
    max_model_len: int | None = None
    short_chunk: int | None = None
    kv_cache: str = "auto"
    max_waiting: int | None = None
    decode_steps: int | None = None
    overlap: bool = True
    max_loras: int = 0
    max_lora_rank: int = 16
    lora_targets: tuple[str, ...] = ("q", "k", "v", "o", "gate", "up", "down")
    lora_form: str = "auto"
    speculative: NgramSettings | None = None
    adaptive_k: bool = True

    def __post_init__(self):
        if self.kv_cache not in KV_CACHES:
            raise ValueError(f"EngineConfig.kv_cache must be one of {KV_CACHES}, got {self.kv_cache!r}")
        for name in ("max_seqs", "page_size", "chunk", "prefill_rows"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ValueError(f"EngineConfig.{name} must be a positive int, got {value!r}")
        for name in ("num_pages", "token_budget", "max_model_len", "max_waiting", "decode_steps"):
            value = getattr(self, name)
            if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
                raise ValueError(f"EngineConfig.{name} must be a positive int or None, got {value!r}")
        for name in ("overlap", "adaptive_k"):
            if not isinstance(getattr(self, name), bool):
                raise TypeError(f"EngineConfig.{name} must be a bool, got {getattr(self, name)!r}")
        self._check_loras()
        if self.speculative is not None and not isinstance(self.speculative, NgramSettings):
            raise TypeError(f"EngineConfig.speculative must be an NgramSettings or None, got {self.speculative!r}")
        if self.num_pages is not None and self.kv_memory_gib is not None:
            raise ValueError("EngineConfig: give num_pages or kv_memory_gib, not both")
        if self.kv_memory_gib is not None and not self.kv_memory_gib > 0:
            raise ValueError(f"EngineConfig.kv_memory_gib must be > 0, got {self.kv_memory_gib!r}")
        if self.short_chunk is not None and (not isinstance(self.short_chunk, int) or self.short_chunk < 0):
            raise ValueError(f"EngineConfig.short_chunk must be an int >= 0 or None, got {self.short_chunk!r}")
        if self.decode_buckets is not None and (not self.decode_buckets or any(
                not isinstance(b, int) or b < 1 or b > self.max_seqs for b in self.decode_buckets)):
            raise ValueError(f"EngineConfig.decode_buckets must be ints in [1, max_seqs={self.max_seqs}], "
                             f"got {self.decode_buckets!r}")

    def _check_loras(self) -> None:
        if not isinstance(self.max_loras, int) or isinstance(self.max_loras, bool) or self.max_loras < 0:
            raise ValueError(f"EngineConfig.max_loras must be an int >= 0, got {self.max_loras!r}")
        if not isinstance(self.max_lora_rank, int) or isinstance(self.max_lora_rank, bool) or self.max_lora_rank < 1:
            raise ValueError(f"EngineConfig.max_lora_rank must be a positive int, got {self.max_lora_rank!r}")
        targets = self.lora_targets
        slottable = tuple(t for t in TARGETS if t != "experts")  # routed experts are read merged: no slots
        if isinstance(targets, str) or not targets or any(t not in slottable for t in targets):
            raise ValueError(f"EngineConfig.lora_targets must be one or more of {slottable}, got {targets!r}")
        object.__setattr__(self, "lora_targets", tuple(targets))
        if self.lora_form not in ("auto", *FORMS):
            raise ValueError(f"EngineConfig.lora_form must be one of {('auto', *FORMS)}, got {self.lora_form!r}")

    @property
    def budget(self) -> int:
        """Tokens per step: `token_budget`, or room for every decode row and every prefill row."""
        return self.token_budget or self.max_seqs + self.prefill_rows * self.chunk

    def steps_per_call(self, platform: str) -> tuple[int, str]:
        """The most decode steps a program call runs on `platform` (a JAX backend name), and why.

        A call costs the host a fixed time (scheduling, inputs, reading the tokens back), which an
        accelerator's step is short enough to make the bottleneck: there 8 steps share it. A CPU's step
        of a real model takes tens of milliseconds against about one of the host, so one step a call
        keeps the programs (and the start) fewer there."""
        if self.decode_steps is not None:
            return self.decode_steps, "decode_steps given"
        if platform == "cpu":
            return 1, "cpu: the host's time is small beside a step's; fewer programs to compile"
        return 8, f"{platform}: the host's time per call is shared by 8 steps"

    def prefill_shapes(self) -> tuple[tuple[int, int], ...]:
        """The (rows, chunk) prefill shapes compiled: the full one and, unless 0, one short row."""
        short = max(self.page_size, self.chunk // 8) if self.short_chunk is None else self.short_chunk
        full = (self.prefill_rows, self.chunk)
        return (full,) if short == 0 or short >= self.chunk else ((1, short), full)

    def buckets(self) -> tuple[int, ...]:
        """The decode-row counts compiled, always ending at max_seqs."""
        if self.decode_buckets is not None:
            return tuple(sorted(set(self.decode_buckets) | {self.max_seqs}))
        sizes, size = {self.max_seqs}, 1
        while size < self.max_seqs:
            sizes.add(size)
            size *= 4
        return tuple(sorted(sizes))
