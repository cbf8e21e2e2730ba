"""Sample text from a trained (or randomly initialised) LM.

    python -m train.sample --checkpoint runs/shakespeare_char_baby --prompt "ROMEO:" --max-new-tokens 500
    echo "JULIET:" | python -m train.sample --checkpoint DIR --num-samples 3 --temperature 0.8 --top-k 40
    python -m train.sample --random-init shakespeare_char_baby_mla --prompt "ROMEO:"   # --data FILE: its characters
    python -m train.sample --random-init CONFIG.toml --data data/texts_bpe   # a prepared corpus's tokenizer
    python -m train.sample --hf exports/baby --prompt "ROMEO:"   # a transformers directory with tokenizer.json
    python -m train.sample --checkpoint DIR --num-samples 8 --cpu-devices 8 --mesh data:2,fsdp:2,tensor:2

The text goes to stdout; the kernels, compile time and steady-state tokens/s go to
stderr, with a progress bar on a terminal. Generation is `jaxattn.generate_windowed`:
the KV-cached `generate`, continued in windows past the model's context (`max_seq_len`),
as nanoGPT crops its context; a prompt longer than the context is cropped to its last
`max_seq_len - 1` tokens. Ctrl-C (or SIGTERM) stops between windows and prints what was
generated (exit 130). With --hf (what `python -m train.export` writes, or any supported
transformers save with a tokenizer.json) a sample ends at the tokenizer's end-of-sequence
token, when it has one. With --mesh the parameters are laid out on a device mesh by
`jaxattn.axes.RULES` and the KV cache is split by rows (the samples) and kv heads;
the tokens are those of one device.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import jax
import numpy as np
from tqdm import tqdm

from jaxattn import Kernels, axes, resolve_kernels
from jaxattn.config import ModelConfig
from jaxattn.windowed import windows
from jaxattn.model import DecoderLM
from train import config as config_lib
from train import data as data_lib
from train import export as export_lib
from train import runtime as runtime_lib
from train import sampling_checkpoint, shards
from train.checkpoint import CheckpointError
from train.config import RuntimeConfig
from train.data_errors import DataError
from train.cli import ArgumentParser, StopSignals, Stopped, UsageError, guard
from train.tokenizer import CharTokenizer, Tokenizer


PROGRAM = "python -m train.sample"
BIG_REQUEST = 1_000_000  # tokens (all samples together) from which the memory and time are announced
BYTES_PER_TOKEN = 16  # a generous estimate of the host memory one drawn token takes: its id and its text


def random_init(name: str, seed: int = 0, data: str | None = None) -> tuple[dict, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of configs/NAME.toml (or a .toml file), randomly initialised.

    The tokenizer is that of `data` when it is a directory prepared by `python -m train.prepare`
    (any kind: char, byte, bpe, hf), else the characters of the text file `data` (default: Tiny
    Shakespeare, found or downloaded as `train.data` does). UsageError for an unknown config or a
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
    """The model of `--checkpoint`, `--hf` or `--random-init`."""
    if args.random_init is not None:
        return random_init(args.random_init, args.seed, args.data)
    if args.hf is not None:
        return export_lib.load_hf(args.hf, allow_nonfinite=args.allow_nonfinite)
    return sampling_checkpoint.load_for_sampling(args.checkpoint)


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
    _check_size(args.max_new_tokens * args.num_samples, f"{args.num_samples} x {args.max_new_tokens}")


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


def _check_size(tokens: int, what: str) -> None:
    """UsageError for a request whose tokens cannot fit in this machine's memory; a warning for a big one."""
    need = tokens * BYTES_PER_TOKEN
    have = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else None
    if have and need > have:
        raise UsageError(f"{tokens:,} tokens ({what}) take about {need / 2**30:,.0f} GiB of host memory, more than "
                         f"this machine's {have / 2**30:,.0f} GiB: ask for fewer --max-new-tokens or --num-samples")
    if tokens >= BIG_REQUEST:
        print(f"warning: {tokens:,} tokens ({what}) take a while and up to {need / 2**30:,.2f} GiB of memory; "
              "Ctrl-C stops and prints what was generated", file=sys.stderr)


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a training run directory (or its checkpoints/...)")
    source.add_argument("--hf", metavar="DIR", help="a transformers directory with a tokenizer.json "
                        "(e.g. written by python -m train.export)")
    source.add_argument("--random-init", metavar="CONFIG", help="a config name from configs/, randomly initialised")
    parser.add_argument("--data", metavar="FILE_OR_DIR", help="with --random-init: the text whose characters are "
                        "the vocabulary (default: Tiny Shakespeare), or a directory prepared by python -m "
                        "train.prepare, whose tokenizer is used")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="with --hf: load weights holding NaN or infinity (refused otherwise)")
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
    args = parser.parse_args(argv)
    if args.data is not None and args.random_init is None:
        parser.error("--data goes with --random-init (a checkpoint carries its own tokenizer)")
    if args.allow_nonfinite and args.hf is None:
        parser.error("--allow-nonfinite goes with --hf")
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
    first = config.max_seq_len - min(prompt_len, config.max_seq_len - 1)
    return min(max_new_tokens, first + 1)


def sample(args, params, config: ModelConfig, prompt_ids: np.ndarray, kernels, mesh) -> tuple[np.ndarray, str | None]:
    """(`[num_samples, n]` ids, the stop signal's name or None): a warm-up call (compiling), then
    the timed one, window by window (`jaxattn.windowed.windows`); a stop signal ends it between
    windows with the n tokens drawn so far."""
    def stream(max_new_tokens):
        return windows(params, config, prompt_ids, max_new_tokens=max_new_tokens, rng=jax.random.PRNGKey(args.seed),
                       num_samples=args.num_samples, temperature=args.temperature, top_k=args.top_k,
                       top_p=args.top_p, kernels=kernels, mesh=mesh)

    with StopSignals() as signals:
        start, warm = time.perf_counter(), warmup_tokens(config, len(prompt_ids), args.max_new_tokens)
        for _ in stream(warm):
            pass
        compile_s = time.perf_counter() - start
        if signals.requested:
            raise Stopped(f"{signals.requested} while compiling: nothing was generated")
        print(f"compile: {compile_s:.2f} s (a warm-up call of {warm} token(s) per sample, compiling)",
              file=sys.stderr, flush=True)
        start, drawn = time.perf_counter(), []
        with tqdm(total=args.max_new_tokens, unit="tok", desc="sampling", file=sys.stderr, disable=None,
                  leave=False) as bar:
            for chunk in signals.until_requested(stream(args.max_new_tokens)):
                drawn.append(chunk)
                bar.update(chunk.shape[1])
    ids = np.concatenate(drawn, axis=1)
    steady = time.perf_counter() - start
    print(f"decode: {ids.size} tokens ({args.num_samples} x {ids.shape[1]}) in {steady:.3f} s "
          f"= {ids.size / steady:,.0f} tokens/s", file=sys.stderr)
    return ids, signals.requested if ids.shape[1] < args.max_new_tokens else None


def run(argv=None) -> int:
    """Loads the model, samples, reports kernels and timing on stderr, prints the texts (prompt +
    continuation) on stdout; after a stop signal prints what was drawn and raises `Stopped`."""
    args = parse_args(argv)
    _check_knobs(args)
    if args.cpu_devices is not None:
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before anything starts JAX
    prompt = read_prompt(args.prompt)
    params, config, tokenizer = load(args)
    prompt_ids = encode_prompt(tokenizer, prompt, config)
    mesh = device_mesh(args, config)
    kernels, reasons = resolve_kernels(Kernels.auto())
    print(f"kernels: decode {kernels.decode!r} ({reasons['decode']}), matmul {kernels.matmul!r} "
          f"({reasons['matmul']})" + (f"; mesh {axes.MeshShape.of(mesh)}" if mesh is not None else ""),
          file=sys.stderr)
    ids, stopped = sample(args, params, config, prompt_ids, kernels, mesh)
    eos = getattr(tokenizer, "eos_token_id", None)
    print("\n---------------\n".join(prompt + tokenizer.decode(until_eos(row, eos)) for row in ids), flush=True)
    if stopped:
        raise Stopped(f"{stopped} after {ids.shape[1]} of {args.max_new_tokens} new tokens per sample: what was "
                      "generated is printed above")
    return 0


def main(argv=None) -> int:
    """0 after printing the samples; one line and exit 1, 2 or 130 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError, DataError))


if __name__ == "__main__":
    sys.exit(main())
