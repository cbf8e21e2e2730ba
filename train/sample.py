"""Sample text from a trained (or randomly initialised) LM.

    python -m train.sample --checkpoint runs/shakespeare_char_baby --prompt "ROMEO:" --max-new-tokens 500
    echo "JULIET:" | python -m train.sample --checkpoint DIR --num-samples 3 --temperature 0.8 --top-k 40
    python -m train.sample --random-init shakespeare_char_baby_mla --prompt "ROMEO:"   # --data FILE: its characters
    python -m train.sample --random-init CONFIG.toml --data data/texts_bpe   # a prepared corpus's tokenizer
    python -m train.sample --hf exports/baby --prompt "ROMEO:"   # a transformers directory with tokenizer.json
    python -m train.sample --gguf model-Q4_K_M.gguf --prompt "Hello"   # a llama.cpp file (jaxattn.gguf)
    python -m train.sample --checkpoint DIR --num-samples 8 --cpu-devices 8 --mesh data:2,fsdp:2,tensor:2

The text goes to stdout; the kernels, compile time and steady-state tokens/s go to
stderr, with a progress bar on a terminal. Generation is `jaxattn.generate_windowed`:
the KV-cached `generate`, continued in windows past the model's context (`max_seq_len`),
as nanoGPT crops its context; a prompt longer than the context is cropped to its last
`max_seq_len - 1` tokens. Ctrl-C (or SIGTERM) stops between windows and prints what was
generated (exit 130). With --hf (what `python -m train.export` writes, or any supported
transformers save with a tokenizer.json) or --gguf (a llama.cpp GGUF file, its weights
dequantized to float32, or kept as int8 when they are all Q8_0, its tokenizer built from its
metadata) a sample ends at the tokenizer's end-of-sequence token, when it has one. With --mesh
the parameters are laid out on a device mesh by `jaxattn.axes.RULES` and the KV cache is split
by rows (the samples) and kv heads; the tokens are those of one device.

The samples are drawn ROWS_PER_CALL at a time (fewer where memory is short), so what one call
holds (its KV cache at the model's context, its logits, XLA's buffers) does not grow with
--num-samples; before compiling, stderr gets the memory the whole run takes at its peak, a
warning when that is most of what is free and an error when it is more than the machine has.
A token drawn from logits that are not finite (a model loaded with --allow-nonfinite) ends the
run with a line naming the first layer whose output is not finite.
"""

from __future__ import annotations

import argparse
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import flax.linen as nn
import jax
import numpy as np
import psutil
from tqdm import tqdm

from jaxattn import Kernels, axes, lora, prepare_weights, resolve_kernels, with_fused_qkv
from jaxattn.cache.build import cache_bytes_per_token
from jaxattn.cache.containers import KV_CACHES
from jaxattn.config import ModelConfig
from jaxattn.decoding import call_lengths
from jaxattn.hf import peft as hf_peft
from jaxattn.hf.errors import HFCheckpointError
from jaxattn.model import DecoderLM
from jaxattn.quantization import quantize
from jaxattn.scan_plan import relayout
from jaxattn.windowed import NonFiniteLogits, window_programs, windows
from train import config as config_lib
from train.checkpoints.store import CheckpointError
from train.cli import ArgumentParser, Stopped, StopSignals, UsageError, describe, guard
from train.config import RuntimeConfig
from train.data import corpus as data_lib
from train.data import shards
from train.data.errors import DataError
from train.data.tokenizer import CharTokenizer, Tokenizer
from train.models import pretrained
from train.models import runs as sampling_checkpoint
from train.run import runtime as runtime_lib

PROGRAM = "python -m train.sample"
BIG_REQUEST = 1_000_000  # tokens (all samples together) from which the time is announced
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


QUANT_MODES = ("int8", "int4", "int4:64")  # --quant


def random_init(name: str, seed: int = 0, data: str | None = None) -> tuple[dict, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of configs/NAME.toml (or a .toml file), randomly initialised.

    The tokenizer is that of `data` when it is a directory prepared by `python -m train.prepare`
    (any kind: char, byte, bpe, hf), else the characters of the text file `data` (default: Tiny
    Shakespeare, found or downloaded as `train.data.corpus` does). UsageError for an unknown config or a
    vocab_size other than the tokenizer's; DataError for a missing or damaged `data`.
    """
    try:
        config = config_lib.load_config(name).model
    except (FileNotFoundError, ValueError, TypeError) as err:
        raise UsageError(str(err)) from err
    if data is not None and Path(data).expanduser().is_dir():
        tokenizer, where = shards.open_prepared(Path(data).expanduser()).tokenizer, f"the prepared corpus --data {data}"
    else:
        tokenizer = CharTokenizer.from_text(data_lib.read_text(data_lib.resolve_data_path(data)))
        where = f"the characters of --data {data}" if data else "the characters of Tiny Shakespeare"
    if tokenizer.vocab_size != config.vocab_size:
        raise UsageError(f"config {name!r} has vocab_size {config.vocab_size}, but the tokenizer of {where} "
                         f"has {tokenizer.vocab_size} ids")
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(seed), np.zeros((1, 1), np.int32))["params"]
    return params, config, tokenizer


def load(args: argparse.Namespace) -> tuple[dict, ModelConfig, Tokenizer]:
    """The model of `--checkpoint`, `--hf`, `--gguf` or `--random-init`, its attention's q, k and v
    projections fused into one (`jaxattn.with_fused_qkv`: the same numbers, a faster token; not with
    `--allow-nonfinite`, so that a damaged weight is named as the checkpoint names it), its layers scanned or
    unrolled as `--scan-layers` says (a checkpoint of either layout loads as either), its weights
    quantized as `--quant` asks (`jaxattn.quantize`; UsageError when the model's widths do not fit the mode).

    A `--gguf` file whose matmul weights are all Q8_0 keeps them int8 when neither `--quant` nor
    `--mesh` (which quantized weights do not go with) is given: `args.quant` becomes "int8:32", which
    gives back the file's own values and scales (`pretrained.gguf_kept_quantization`), with a note on stderr."""
    if args.random_init is not None:
        params, config, tokenizer = random_init(args.random_init, args.seed, args.data)
    elif getattr(args, "gguf", None) is not None:
        params, config, tokenizer = pretrained.load_gguf(args.gguf, allow_nonfinite=args.allow_nonfinite)
        if getattr(args, "quant", None) is None and getattr(args, "mesh", None) is None:
            args.quant = pretrained.gguf_kept_quantization(args.gguf)
            if args.quant is not None:  # the float32 it was dequantized to takes 3.5 times the memory
                print(f"note: {args.gguf} stores its weights as Q8_0: kept as int8 (groups of 32); --quant int8 "
                      "for per-channel", file=sys.stderr)
    elif args.hf is not None:
        params, config, tokenizer = pretrained.load_hf(args.hf, allow_nonfinite=args.allow_nonfinite)
    else:
        params, config, tokenizer = sampling_checkpoint.load_for_sampling(args.checkpoint)
    if getattr(args, "adapter", None) is not None:
        params = with_adapter(args.adapter, config, params)
    if not getattr(args, "allow_nonfinite", False):  # a damaged model keeps its layout: errors name its own weights
        params, config = with_fused_qkv(nn.unbox(params), config)  # one matmul for q, k and v: a faster token
    scan = getattr(args, "scan_layers", None)
    if scan is not None:
        params, config = relayout(nn.unbox(params), config, scan)
    if getattr(args, "quant", None) is not None:
        try:
            params = quantize(params, config, args.quant)
        except ValueError as err:
            raise UsageError(f"--quant {args.quant}: {err}") from None
    return params, config, tokenizer


def with_adapter(directory: str, config: ModelConfig, params) -> dict:
    """`params` with the PEFT LoRA adapter in `directory` merged in (`jaxattn.hf.peft.load_adapter`, then
    `jaxattn.lora.merge_lora`: the model then runs as fast as the base); CheckpointError (one line naming the
    file and the key or module) when the adapter cannot be read or does not fit the model."""
    try:
        adapted, _ = hf_peft.load_adapter(directory, config, nn.unbox(params))
    except (HFCheckpointError, ValueError, OSError) as err:
        raise CheckpointError(f"--adapter {directory}: {describe(err)}") from err
    return lora.merge_lora(adapted)


def add_adapter_flag(parser: argparse.ArgumentParser) -> None:
    """`--adapter DIR`: a PEFT LoRA adapter merged into the loaded model (sample and serve)."""
    parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory (adapter_config.json, "
                        "adapter_model.safetensors; python -m train.export of a LoRA run writes one) merged into "
                        "the model first")


def quant_line(args, kernels: Kernels, reasons: dict[str, str]) -> str:
    """The kernels line's part for `--quant` ("" without it)."""
    if getattr(args, "quant", None) is None:
        return ""
    return f"; weights {args.quant}, quantized {kernels.quantized!r} ({reasons['quantized']})"


def add_quant_flag(parser: argparse.ArgumentParser) -> None:
    """`--quant MODE`: weight-only quantization after loading (sample and serve)."""
    parser.add_argument("--quant", choices=QUANT_MODES, help="store the weights as int8 (per output channel) or "
                        "int4 (groups of 32, or :64) and multiply by them so (jaxattn.quantize; the lookup "
                        "tables, norms and the router stay float)")


def check_quant(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    """Usage errors for `--quant` with a flag it does not go with."""
    if args.quant is not None and args.mesh is not None:
        parser.error("--quant does not go with --mesh: quantized weights are laid out on one device")


def until_eos(ids: np.ndarray, eos_token_id: int | None) -> np.ndarray:
    """`ids` up to (without) the first `eos_token_id`; all of them when it is None or absent."""
    ends = np.flatnonzero(ids == eos_token_id) if eos_token_id is not None else []
    return ids[:ends[0]] if len(ends) else ids


def read_prompt(prompt: str | None, stdin=None) -> str:
    """The prompt text: the argument, or stdin when it is '-' or absent and stdin is not a terminal; else a newline."""
    stdin = sys.stdin if stdin is None else stdin
    if prompt == "-" or (prompt is None and not stdin.isatty()):
        prompt = stdin.read()
    elif prompt is None:
        prompt = "\n"  # nanoGPT's default start
    if not prompt:
        raise UsageError("the prompt is empty: pass --prompt TEXT or pipe text on stdin")
    return prompt


def encode_prompt(tokenizer: Tokenizer, prompt: str, config: ModelConfig) -> np.ndarray:
    """Prompt ids `[P]`; UsageError for characters the tokenizer does not know."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as err:  # text outside the vocabulary (every tokenizer kind raises ValueError)
        raise UsageError(f"the prompt cannot be encoded: {err}") from err
    if len(ids) >= config.max_seq_len:
        print(f"note: the prompt is {len(ids)} tokens and the model's context {config.max_seq_len}: "
              f"it sees the last {config.max_seq_len - 1}", file=sys.stderr)
    return ids


def _check_knobs(args) -> None:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UsageError("--max-new-tokens and --num-samples must be >= 1")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed < 2 ** 63:
        raise UsageError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.cpu_devices is not None:
        _check_cpu_devices(args.cpu_devices, args.mesh, args.num_samples)
    tokens, what = args.max_new_tokens * args.num_samples, f"{args.num_samples} x {args.max_new_tokens}"
    _check_size(tokens, what)
    if tokens >= BIG_REQUEST:
        print(f"warning: {tokens:,} tokens ({what}) take a while; Ctrl-C stops and prints what was generated",
              file=sys.stderr)


def _check_cpu_devices(cpu_devices: int, mesh: str | None, num_samples: int) -> None:
    """UsageError unless `--cpu-devices` makes exactly the devices of a `--mesh` (none idle; sampling
    without a mesh uses one device); the runtime's warning when they outnumber the cores."""
    if mesh is None:
        raise UsageError(f"--cpu-devices {cpu_devices} makes host devices for a --mesh of that size: "
                         "pass --mesh too (e.g. --mesh data:N), or leave both out")
    try:
        config = RuntimeConfig(cpu_devices=cpu_devices, mesh=mesh)
        warnings = runtime_lib.check_cpu_devices(config, num_samples)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


def _check_size(tokens: int, what: str, physical: int | None = None) -> None:
    """UsageError, before any model is loaded, for a request whose token ids alone cannot fit in this
    machine's memory (`physical` bytes, default: the machine's); the whole estimate comes after loading
    (`plan_memory`)."""
    need, have = tokens * ID_BYTES, physical_memory() if physical is None else physical
    if need > have:
        raise UsageError(f"{tokens:,} tokens ({what}) take about {gib(need)} of host memory for their ids alone, "
                         f"more than this machine's {gib(have)}: ask for fewer --max-new-tokens or --num-samples")


def physical_memory() -> int:
    """This machine's memory in bytes."""
    return int(psutil.virtual_memory().total)


def gib(size: float) -> str:
    """Bytes as GiB with two decimals ("0.47 GiB"), or thousands of GiB without."""
    return f"{size / 2 ** 30:,.0f} GiB" if size >= 2 ** 40 else f"{size / 2 ** 30:,.2f} GiB"


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


def _windows_shapes(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> list[tuple[int, int, int]]:
    """(prompt bucket, cache length, new tokens) of each program `windows` compiles: the first window's,
    and the later windows' when there are any."""
    return [(*call_lengths(config, prompt, new), new) for prompt, new in window_programs(config, prompt_len,
                                                                                        max_new_tokens)]


def call_bytes(config: ModelConfig, rows: int, prompt_len: int, max_new_tokens: int) -> tuple[int, int, int]:
    """(KV cache, logits, activations) in bytes that one call of `rows` samples holds at its peak: the
    largest of the programs `windows` compiles, each the cache plus the larger of its two phases, the
    prefill (logits `[rows, bucket, V]`) and the decoding loop (a few `[rows, V]` sampling buffers).
    tests/train/test_sample_memory.py holds it against `memory_analysis()` of the compiled programs."""
    act, V, N = np.dtype(config.dtype).itemsize, config.vocab_size, config.num_heads
    hidden = 2 * config.d_model + config.mlp_hidden + (N + 2 * config.num_kv_heads) * config.head_dim
    per_token = cache_bytes_per_token(config)["bytes"]
    largest = (0, 0, 0)
    for bucket, length, new in _windows_shapes(config, prompt_len, max_new_tokens):
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
    shapes = _windows_shapes(config, prompt_len, max_new_tokens)  # the later windows' program too when 2
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
        def most(asked, passes) -> int:  # the largest n < asked with passes(n), by bisection; 0 if none
            low, high = 0, asked - 1
            while low < high:
                middle = (low + high + 1) // 2
                low, high = (middle, high) if passes(middle) else (low, middle - 1)
            return low

        free = lambda e: e.total <= physical and e.total - process <= WARN_FRACTION * available  # noqa: E731
        fits, where = most(num_samples, lambda n: free(estimate(min(rows, n), samples=n))), "in the memory free"
        if fits < 1:
            fits = most(num_samples, lambda n: estimate(min(rows, n), samples=n).total <= physical)
            where = "in this machine's memory"
        new = most(max_new_tokens, lambda m: estimate(1, samples=1, new=m).total <= physical)
        if fits >= 1:
            hint = f"--num-samples {fits:,} fits {where} with --max-new-tokens {max_new_tokens}"
        elif new >= 1:
            hint = f"--max-new-tokens {new:,} fits in this machine's memory with --num-samples 1"
        else:
            hint = "even one sample of one token does not fit: this model's context is too large for it"
        raise UsageError(f"sampling {what} takes {plan.describe()}, more than this machine's {gib(physical)} "
                         f"of memory: {hint}")
    warnings = []
    if plan.total - process > WARN_FRACTION * available:
        warnings.append(f"sampling {what} takes {plan.describe()}: {gib(plan.total - process)} more than now, "
                        f"{(plan.total - process) / max(available, 1):.0%} of the {gib(available)} free; it may "
                        "swap or be killed")
    return plan, warnings


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a training run directory (or its checkpoints/...)")
    source.add_argument("--hf", metavar="DIR", help="a transformers directory with a tokenizer.json "
                        "(e.g. written by python -m train.export)")
    source.add_argument("--gguf", metavar="FILE", help="a llama.cpp GGUF file (weights dequantized to float32, "
                        "all-Q8_0 ones kept as int8; the tokenizer from its metadata)")
    source.add_argument("--random-init", metavar="CONFIG", help="a config name from configs/, randomly initialised")
    parser.add_argument("--data", metavar="FILE_OR_DIR", help="with --random-init: the text whose characters are "
                        "the vocabulary (default: Tiny Shakespeare), or a directory prepared by python -m "
                        "train.prepare, whose tokenizer is used")
    parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                        help="compile the repeated layers once under a scan (a faster start, a slower token on a "
                             "CPU) or each layer on its own; default: as the model was saved")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="with --hf or --gguf: load weights holding NaN or infinity (refused otherwise)")
    parser.add_argument("--prompt", help="prompt text; '-' or absent (with piped stdin) reads stdin")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=200, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--mesh", help="sample on a device mesh, e.g. data:2,tensor:4 (product = device count)")
    parser.add_argument("--cpu-devices", type=int, metavar="N", help="make N host devices on a CPU (before JAX "
                        "starts) for --mesh")
    parser.add_argument("--kv-cache", choices=KV_CACHES, default="auto", help="the KV cache's storage: auto (the "
                        "compute dtype) or int8 (int8 numbers with a float32 scale per token and head; default auto)")
    add_quant_flag(parser)
    add_adapter_flag(parser)
    args = parser.parse_args(argv)
    if args.data is not None and args.random_init is None:
        parser.error("--data goes with --random-init (a checkpoint carries its own tokenizer)")
    if args.allow_nonfinite and args.hf is None and args.gguf is None:
        parser.error("--allow-nonfinite goes with --hf or --gguf")
    check_quant(parser, args)
    return args


def device_mesh(args: argparse.Namespace, config: ModelConfig):
    """The `--mesh` (None without it); UsageError when it does not fit the devices or the model."""
    if args.mesh is None:
        return None
    try:
        shape = axes.MeshShape.parse(args.mesh)
        axes.check_mesh(config, shape)
        return axes.make_mesh(shape, jax.devices()[:shape.size] if shape.size <= jax.device_count() else None)
    except ValueError as err:
        raise UsageError(str(err)) from err


def warmup_tokens(config: ModelConfig, prompt_len: int, max_new_tokens: int) -> int:
    """The fewest new tokens that compile every program `max_new_tokens` needs: the first window's,
    and the later windows' when it has any."""
    programs = window_programs(config, prompt_len, max_new_tokens)
    return programs[0][1] + (len(programs) > 1)  # one token of the later windows compiles theirs


BATCH_KEYS = 2 ** 31 - 1  # folded into the seed's key for the keys of several calls (windows fold in 1, 2, ...)


class NonFiniteError(RuntimeError):
    """A sample's token would be drawn from logits that are not finite (exit 1)."""


def call_keys(seed: int, calls: int):
    """The rng of each call, `keys[i]`: the seed's key itself when one call draws every sample (the
    draws of `generate_windowed`), else keys folded from it apart from those the windows fold in, as
    one `[calls, 2]` host array (8 bytes a call; a device array each would take kilobytes)."""
    key = jax.random.PRNGKey(seed)
    if calls == 1:
        return [key]
    base = jax.random.fold_in(key, BATCH_KEYS)
    return np.asarray(jax.vmap(jax.random.fold_in, (None, 0))(base, np.arange(calls, dtype=np.uint32)))


def nonfinite_error(err: NonFiniteLogits, params, config: ModelConfig, first_row: int) -> NonFiniteError:
    """The one line for `err` (raised by the call whose rows start at `first_row`): which sample and
    token, and the first layer whose output is not finite on what the model saw."""
    where = sampling_checkpoint.describe_nonfinite(params, config, err.context, padding=0)  # generate's pad_token
    return NonFiniteError(f"the logits that new token {err.token + 1} of sample {first_row + err.sample + 1} would "
                          f"be drawn from are not finite (NaN or infinity): {where}")


def sample(args, params, config: ModelConfig, prompt_ids: np.ndarray, kernels, mesh, rows: int | None = None
           ) -> tuple[np.ndarray, str | None]:
    """(`[num_samples, n]` ids, the stop signal's name or None): a warm-up call (compiling), then the
    timed run, window by window (`jaxattn.windowed.windows`), each window drawn by calls of `rows`
    samples (default: all of them). A stop signal ends it between calls, keeping the n tokens of the
    windows every sample has finished; `NonFiniteError` when a token's logits are not finite."""
    num_samples, max_new = args.num_samples, args.max_new_tokens
    rows = num_samples if rows is None else rows
    keys = call_keys(args.seed, -(-num_samples // rows))

    def stream(key, max_new_tokens):
        return windows(params, config, prompt_ids, max_new_tokens=max_new_tokens, rng=key, num_samples=rows,
                       temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, kernels=kernels,
                       mesh=mesh, check_finite=True, kv_cache=args.kv_cache)

    def draw(i, chunks):
        try:
            return next(chunks)
        except NonFiniteLogits as err:
            raise nonfinite_error(err, params, config, i * rows) from None

    with StopSignals() as signals:
        start, warm = time.perf_counter(), warmup_tokens(config, len(prompt_ids), max_new)
        try:
            for _ in stream(keys[0], warm):
                pass
        except NonFiniteLogits as err:
            raise nonfinite_error(err, params, config, 0) from None
        compile_s = time.perf_counter() - start
        if signals.requested:
            raise Stopped(f"{signals.requested} while compiling: nothing was generated")
        print(f"compile: {compile_s:.2f} s (a warm-up call of {warm} token(s) per sample, compiling)",
              file=sys.stderr, flush=True)
        start, done = time.perf_counter(), 0
        ids = np.empty((num_samples, max_new), np.int32)  # pages are taken as they are written
        streams = [None] * len(keys)  # each made at its first window and dropped after its last
        with tqdm(total=num_samples * max_new, unit="tok", desc="sampling", file=sys.stderr, disable=None,
                  leave=False) as bar:
            while done < max_new:  # the window in hand when a signal comes is finished, as `until_requested` does
                for i in range(len(streams)):
                    if i and signals.requested:
                        break  # between calls of a window drawn by several: it is unfinished, and dropped
                    if done == 0:
                        streams[i] = stream(keys[i], max_new)
                    chunk = draw(i, streams[i])
                    low, high = i * rows, min(num_samples, (i + 1) * rows)
                    ids[low:high, done:done + chunk.shape[1]] = chunk[:high - low]
                    bar.update((high - low) * chunk.shape[1])
                    if done + chunk.shape[1] == max_new:
                        streams[i] = None  # its last window: what it holds can go
                else:
                    done += chunk.shape[1]
                if signals.requested:
                    break
    ids = ids[:, :done]
    steady = time.perf_counter() - start
    print(f"decode: {ids.size} tokens ({num_samples} x {ids.shape[1]}) in {steady:.3f} s "
          f"= {ids.size / steady:,.0f} tokens/s", file=sys.stderr)
    return ids, signals.requested if ids.shape[1] < max_new else None


def plan_sampling(args, config: ModelConfig, prompt_len: int, kernels, mesh) -> MemoryEstimate:
    """The memory plan of this run on this machine, reported on stderr (`plan_memory`)."""
    memory = psutil.virtual_memory()
    plan, warnings = plan_memory(config, prompt_len=prompt_len, num_samples=args.num_samples,
                                 max_new_tokens=args.max_new_tokens, rows=rows_per_call(args.num_samples, mesh),
                                 process=psutil.Process().memory_info().rss, available=int(memory.available),
                                 physical=int(memory.total), kernels=kernels)
    print(f"memory: {plan.describe()}", file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return plan


def print_samples(prompt: str, ids: np.ndarray, tokenizer) -> None:
    """The samples on stdout, prompt + text, between separator lines: decoded one at a time."""
    eos = getattr(tokenizer, "eos_token_id", None)
    for i, row in enumerate(ids):
        sys.stdout.write(("\n---------------\n" if i else "") + prompt + tokenizer.decode(until_eos(row, eos)))
    sys.stdout.write("\n")
    sys.stdout.flush()


def run(argv=None) -> int:
    """Loads the model, samples, reports kernels, memory and timing on stderr, prints the texts (prompt +
    continuation) on stdout; after a stop signal prints what was drawn and raises `Stopped`."""
    args = parse_args(argv)
    _check_knobs(args)
    if args.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before anything starts JAX
    prompt = read_prompt(args.prompt)
    params, config, tokenizer = load(args)
    if args.allow_nonfinite and sampling_checkpoint.nonfinite_weights(params):
        print(f"warning: the weights holding NaN or infinity: {sampling_checkpoint.list_weights(params)}; "
              "sampling stops at the first token whose logits are not finite", file=sys.stderr)
    prompt_ids = encode_prompt(tokenizer, prompt, config)
    mesh = device_mesh(args, config)
    kernels, reasons = resolve_kernels(Kernels.auto())
    print(f"kernels: decode {kernels.decode!r} ({reasons['decode']}), matmul {kernels.matmul!r} "
          f"({reasons['matmul']})" + (f"; mesh {axes.MeshShape.of(mesh)}" if mesh is not None else "")
          + quant_line(args, kernels, reasons), file=sys.stderr)
    plan = plan_sampling(args, config, len(prompt_ids), kernels, mesh)
    params = prepare_weights(params, kernels)  # e.g. quantized weights in the native kernel's panels
    ids, stopped = sample(args, params, config, prompt_ids, kernels, mesh, plan.rows)
    print_samples(prompt, ids, tokenizer)
    if stopped:
        raise Stopped(f"{stopped} after {ids.shape[1]} of {args.max_new_tokens} new tokens per sample: what was "
                      "generated is printed above")
    return 0


def main(argv=None) -> int:
    """0 after printing the samples; one line and exit 1, 2 or 130 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError, DataError, NonFiniteError))


if __name__ == "__main__":
    sys.exit(main())
