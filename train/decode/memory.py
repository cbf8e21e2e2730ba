"""What drawing N samples of M new tokens holds in memory at its peak, and the plan that fits it to
this machine: how many samples one call draws (`rows_per_call`), the estimate (`estimate_memory`,
a `MemoryEstimate`), and `plan_memory`, which halves the calls until one fits in half of what is free,
refuses a run beyond the machine's memory (naming the --num-samples or --max-new-tokens that fits)
and warns about one that takes most of what is free.

The arithmetic follows the programs `jaxattn.windowed.windows` compiles; docs/performance.md,
"Sampling memory", holds it against the peak memory measured (bench/sample_memory.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import jax
import numpy as np
import psutil

from jaxattn import Kernels, axes
from jaxattn.cache.build import cache_bytes_per_token
from jaxattn.config import ModelConfig
from jaxattn.decoding import call_lengths
from jaxattn.windowed import window_programs
from train.cli import UsageError

ID_BYTES = 4  # a drawn token on the host: its int32 id (the texts are decoded and printed one sample at a time)
# Samples drawn together by one call. On a CPU tokens/s gains little from wider calls (docs/performance.md,
# "Sampling memory"), while the time and memory XLA takes to compile a call grow with its rows (the CPU
# decode kernels write the cache with one update per row); an accelerator gains from wider calls.
ROWS_PER_CALL = {"cpu": 16}
ROWS_PER_CALL_ACCELERATOR = 256
# XLA's own memory while it compiles a call's program: a part of its own, and a part per row and layer
# where the cache is written one row at a time (every decode kernel but "xla"); a second program (the
# later windows') adds a share of it. Fitted to the peak memory of the default model at 1 to 8 layers
# (docs/performance.md, "Sampling memory"; bench/sample_memory.py measures it).
COMPILE_BYTES = 100 * 2 ** 20
COMPILE_BYTES_PER_ROW_LAYER = 3 * 2 ** 19
SECOND_PROGRAM = 0.4
# A paused `windows` stream, besides its arrays: its Python objects, and what the allocator keeps of the
# memory freed between them (bench/sample_memory.py measures a run that holds thousands).
STREAM_BYTES = 16 * 2 ** 10
SAMPLING_BUFFERS = 4  # [rows, V] float32 buffers a decoding step holds: logits, top-k/top-p sorts, the draw
WARN_FRACTION = 0.8  # of the memory free now, from which the estimate is a warning


def gib(size: float) -> str:
    """Bytes as GiB with two decimals ("0.47 GiB"), or thousands of GiB without."""
    return f"{size / 2 ** 30:,.0f} GiB" if size >= 2 ** 40 else f"{size / 2 ** 30:,.2f} GiB"


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return int(psutil.virtual_memory().total)


def check_ids_fit(tokens: int, what: str, physical: int | None = None) -> None:
    """UsageError, before any model is loaded, for a request whose token ids alone cannot fit in this
    machine's memory (`physical` bytes, default: the machine's); the whole estimate comes after loading
    (`plan_memory`)."""
    need, have = tokens * ID_BYTES, physical_memory() if physical is None else physical
    if need > have:
        raise UsageError(f"{tokens:,} tokens ({what}) take about {gib(need)} of host memory for their ids alone, "
                         f"more than this machine's {gib(have)}: ask for fewer --max-new-tokens or --num-samples")


@dataclass(frozen=True)
class MemoryEstimate:
    """What sampling holds at its peak, in bytes; `total` is the process's peak resident memory on a CPU.

    Attributes:
      rows: samples drawn together by one call; `calls` of them make one window of every sample.
      process: this process before sampling (Python, JAX, the parameters): measured.
      cache: one call's KV cache at its length (the model's context at most); XLA updates it in
        place, in the prefill and in the decoding loop.
      logits: one call's float32 logits: the prefill's `[rows, prompt bucket, V]` and the sampling
        buffers of a step (sorts for top-k/top-p), `[rows, V]` each.
      activations: one call's other buffers: a layer's activations and attention scores in the
        prefill and in a step, the drawn tokens.
      compile: XLA's own memory while compiling the calls' programs (`COMPILE_BYTES`).
      ids: every sample's token ids on the host.
      streams: what each call keeps between windows, when there are several: the history of its
        rows (half a context), the tokens of its last window, its key (`STREAM_BYTES`).
    """

    rows: int
    calls: int
    process: int
    cache: int
    logits: int
    activations: int
    compile: int
    ids: int
    streams: int = 0

    @property
    def per_call(self) -> int:
        """What one call's compiled program holds (buffers XLA allocates when it runs)."""
        return self.cache + self.logits + self.activations

    @property
    def total(self) -> int:
        return self.process + self.per_call + self.compile + self.ids + self.streams

    def describe(self) -> str:
        parts = [("this process now", self.process), ("KV cache", self.cache), ("logits", self.logits),
                 ("activations", self.activations), ("compiling", self.compile), ("token ids", self.ids),
                 ("between windows", self.streams)]
        return (f"about {gib(self.total)} at its peak (" + ", ".join(f"{name} {gib(size)}" for name, size in parts)
                + f"); {self.rows} sample(s) per call, {self.calls:,} call(s) a window")


def windows_shapes(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> list[tuple[int, int, int]]:
    """(prompt bucket, cache length, new tokens) of each program `windows` compiles: the first window's,
    and the later windows' when there are any."""
    return [(*call_lengths(config, prompt, new), new) for prompt, new in window_programs(config, prompt_len,
                                                                                        max_new_tokens)]


def call_bytes(config: ModelConfig, rows: int, prompt_len: int, max_new_tokens: int) -> tuple[int, int, int]:
    """(KV cache, logits, activations) in bytes that one call of `rows` samples holds at its peak: the
    largest of the programs `windows` compiles, each the cache plus the larger of its two phases, the
    prefill (logits `[rows, bucket, V]`) and the decoding loop (a few `[rows, V]` sampling buffers).
    tests/train/decode/test_sample_memory.py holds it against `memory_analysis()` of the compiled programs."""
    act, V, N = np.dtype(config.dtype).itemsize, config.vocab_size, config.num_heads
    hidden = 2 * config.d_model + config.mlp_hidden + (N + 2 * config.num_kv_heads) * config.head_dim
    per_token = cache_bytes_per_token(config)["bytes"]
    largest = (0, 0, 0)
    for bucket, length, new in windows_shapes(config, prompt_len, max_new_tokens):
        per_position = hidden * act + 4 * N * length  # a layer's activations and float32 attention scores
        prefill = (4 * rows * bucket * V, rows * bucket * per_position)
        step = (4 * rows * V * SAMPLING_BUFFERS, rows * per_position)
        logits, activations = max(prefill, step, key=sum)
        largest = max(largest, (rows * length * per_token, logits, activations + 2 * 4 * rows * new), key=sum)
    return largest


def rows_per_call(num_samples: int, mesh=None, platform: str | None = None) -> int:
    """How many samples one call draws: `ROWS_PER_CALL` for the platform, at most `num_samples`, a
    multiple of the mesh's batch split where it has one."""
    platform = jax.default_backend() if platform is None else platform
    rows = min(num_samples, ROWS_PER_CALL.get(platform, ROWS_PER_CALL_ACCELERATOR))
    if mesh is not None:
        split = mesh.shape.get(axes.DATA, 1) * mesh.shape.get(axes.FSDP, 1)
        rows = min(num_samples, -(-rows // split) * split)
    return rows


def estimate_memory(config: ModelConfig, *, prompt_len: int, num_samples: int, max_new_tokens: int, rows: int,
                    process: int, kernels: Kernels = Kernels()) -> MemoryEstimate:
    """What sampling `num_samples` x `max_new_tokens` tokens `rows` at a time holds (`MemoryEstimate`);
    `process` is this process's resident memory before it starts."""
    cache, logits, activations = call_bytes(config, rows, prompt_len, max_new_tokens)
    unrolled = kernels.decode != "xla"  # every other decode kernel writes the cache one row at a time
    shapes = windows_shapes(config, prompt_len, max_new_tokens)  # the later windows' program too when 2
    compile_bytes = int((COMPILE_BYTES + (COMPILE_BYTES_PER_ROW_LAYER * rows * config.num_layers if unrolled else 0))
                        * (1 + SECOND_PROGRAM * (len(shapes) - 1)))
    calls = -(-num_samples // rows)
    per_call = STREAM_BYTES + ID_BYTES * rows * (config.max_seq_len // 2 + shapes[-1][2])  # history, last window
    held = 0 if len(shapes) == 1 else calls * per_call
    return MemoryEstimate(rows=rows, calls=calls, process=process, cache=cache, logits=logits,
                          activations=activations, compile=compile_bytes,
                          ids=ID_BYTES * num_samples * max_new_tokens, streams=held)


def plan_memory(config: ModelConfig, *, prompt_len: int, num_samples: int, max_new_tokens: int, rows: int,
                process: int, available: int, physical: int, kernels: Kernels = Kernels()
                ) -> tuple[MemoryEstimate, list[str]]:
    """(the estimate, warnings): `rows` per call, fewer when one call would take more than half of the
    `available` bytes. UsageError when the estimate exceeds `physical`, naming it and the
    --num-samples (or --max-new-tokens) that fits."""
    def estimate(rows_, samples=num_samples, new=max_new_tokens):
        return estimate_memory(config, prompt_len=prompt_len, num_samples=samples, max_new_tokens=new,
                               rows=rows_, process=process, kernels=kernels)

    rows = min(rows, num_samples)
    while rows > 1:  # halved until one call and its compiling take at most half of what is free
        trial = estimate(rows)
        if trial.per_call + trial.compile <= available / 2:
            break
        rows = max(1, rows // 2)
    plan = estimate(rows)
    what = f"{num_samples} x {max_new_tokens} tokens"
    if plan.total > physical:
        hint = _what_fits(estimate, rows, num_samples, max_new_tokens, process, available, physical)
        raise UsageError(f"sampling {what} takes {plan.describe()}, more than this machine's {gib(physical)} "
                         f"of memory: {hint}")
    warnings = []
    if plan.total - process > WARN_FRACTION * available:
        warnings.append(f"sampling {what} takes {plan.describe()}: {gib(plan.total - process)} more than now, "
                        f"{(plan.total - process) / max(available, 1):.0%} of the {gib(available)} free; it may "
                        "swap or be killed")
    return plan, warnings


def _what_fits(estimate: Callable[..., MemoryEstimate], rows: int, num_samples: int, max_new_tokens: int,
               process: int, available: int, physical: int) -> str:
    """The end of `plan_memory`'s refusal: the most --num-samples that fit in the memory free (else in
    the machine's), else the most --max-new-tokens one sample fits, else that nothing does."""
    def most(asked, passes) -> int:  # the largest n < asked with passes(n), by bisection; 0 if none
        low, high = 0, asked - 1
        while low < high:
            middle = (low + high + 1) // 2
            low, high = (middle, high) if passes(middle) else (low, middle - 1)
        return low

    def free(e: MemoryEstimate) -> bool:
        return e.total <= physical and e.total - process <= WARN_FRACTION * available

    fits, where = most(num_samples, lambda n: free(estimate(min(rows, n), samples=n))), "in the memory free"
    if fits < 1:
        fits = most(num_samples, lambda n: estimate(min(rows, n), samples=n).total <= physical)
        where = "in this machine's memory"
    if fits >= 1:
        return f"--num-samples {fits:,} fits {where} with --max-new-tokens {max_new_tokens}"
    new = most(max_new_tokens, lambda m: estimate(1, samples=1, new=m).total <= physical)
    if new >= 1:
        return f"--max-new-tokens {new:,} fits in this machine's memory with --num-samples 1"
    return "even one sample of one token does not fit: this model's context is too large for it"
