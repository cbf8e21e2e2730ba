"""Sample text from a trained (or randomly initialised) character LM.

    python -m train.sample --checkpoint runs/shakespeare_char_baby --prompt "ROMEO:" --max-new-tokens 500
    echo "JULIET:" | python -m train.sample --checkpoint DIR --num-samples 3 --temperature 0.8 --top-k 40
    python -m train.sample --random-init shakespeare_char_baby_mla --prompt "ROMEO:"
    python -m train.sample --hf exports/baby --prompt "ROMEO:"   # a transformers directory with tokenizer.json
    python -m train.sample --checkpoint DIR --num-samples 8 --cpu-devices 8 --mesh data:2,fsdp:2,tensor:2

The text goes to stdout; the kernels, compile time and steady-state tokens/s go to
stderr. Generation is `jaxattn.generate_windowed`: the KV-cached `generate`, continued
in windows past the model's context (`max_seq_len`), as nanoGPT crops its context; a
prompt longer than the context is cropped to its last `max_seq_len - 1` tokens. With --hf
(what `python -m train.export` writes, or any supported transformers save with a
tokenizer.json) a sample ends at the tokenizer's end-of-sequence token, when it has one.
With --mesh the parameters are laid out on a device mesh by `jaxattn.sharding`'s rules
and the KV cache is split by rows (the samples) and kv heads; the tokens are those of
one device.
"""

from __future__ import annotations

import argparse
import sys
import time

import jax
import numpy as np

from jaxattn import Kernels, resolve_kernels, sharding
from jaxattn.config import ModelConfig
from jaxattn.decoding import generate_windowed
from jaxattn.model import DecoderLM
from train import checkpoint as checkpoint_lib
from train import config as config_lib
from train import data as data_lib
from train import export as export_lib
from train.tokenizer import CharTokenizer, Tokenizer


class SampleError(ValueError):
    """A user-facing problem with the arguments, the checkpoint or the prompt."""


def random_init(name: str, seed: int = 0) -> tuple[dict, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of configs/NAME.toml, randomly initialised, with Tiny Shakespeare's characters."""
    try:
        config = config_lib.load_config(name).model
    except FileNotFoundError as err:
        raise SampleError(str(err)) from err
    tokenizer = CharTokenizer.from_text(data_lib.read_text(data_lib.resolve_data_path()))
    if tokenizer.vocab_size != config.vocab_size:
        raise SampleError(f"config {name!r} has vocab_size {config.vocab_size}, but the character "
                          f"vocabulary of Tiny Shakespeare has {tokenizer.vocab_size}")
    params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(seed), np.zeros((1, 1), np.int32))["params"]
    return params, config, tokenizer


def load(args: argparse.Namespace) -> tuple[dict, ModelConfig, Tokenizer]:
    """The model of `--checkpoint`, `--hf` or `--random-init`."""
    if args.random_init is not None:
        return random_init(args.random_init, args.seed)
    try:
        if args.hf is not None:
            return export_lib.load_hf(args.hf)
        return checkpoint_lib.load_for_sampling(args.checkpoint)
    except checkpoint_lib.CheckpointError as err:
        raise SampleError(str(err)) from err


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
        raise SampleError("the prompt is empty: pass --prompt TEXT or pipe text on stdin")
    return prompt


def encode_prompt(tokenizer: Tokenizer, prompt: str, config: ModelConfig) -> np.ndarray:
    """Prompt ids `[P]`; SampleError for characters the tokenizer does not know."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as err:  # unknown characters (both tokenizer kinds raise ValueError)
        raise SampleError(f"the prompt cannot be encoded: {err}") from err
    if len(ids) >= config.max_seq_len:
        print(f"note: the prompt is {len(ids)} tokens and the model's context {config.max_seq_len}: "
              f"it sees the last {config.max_seq_len - 1}", file=sys.stderr)
    return ids


def _check_knobs(args) -> None:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise SampleError("--max-new-tokens and --num-samples must be >= 1")
    if not args.temperature >= 0:
        raise SampleError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed < 2 ** 63:
        raise SampleError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.top_k < 0:
        raise SampleError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise SampleError(f"--top-p must be in (0, 1], got {args.top_p}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a training run directory (or its checkpoints/...)")
    source.add_argument("--hf", metavar="DIR", help="a transformers directory with a tokenizer.json "
                        "(e.g. written by python -m train.export)")
    source.add_argument("--random-init", metavar="CONFIG", help="a config name from configs/, randomly initialised")
    parser.add_argument("--prompt", help="prompt text; '-' or absent (with piped stdin) reads stdin")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=200, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=1337)
    parser.add_argument("--mesh", help="sample on a device mesh, e.g. data:2,tensor:4 (product = device count)")
    parser.add_argument("--cpu-devices", type=int, metavar="N", help="make N host devices on a CPU (before JAX starts)")
    return parser.parse_args(argv)


def device_mesh(args: argparse.Namespace, config: ModelConfig):
    """The `--mesh` (None without it); SampleError when it does not fit the devices or the model."""
    if args.mesh is None:
        return None
    try:
        shape = sharding.MeshShape.parse(args.mesh)
        sharding.check_mesh(config, shape)
        return sharding.make_mesh(shape, jax.devices()[:shape.size] if shape.size <= jax.device_count() else None)
    except ValueError as err:
        raise SampleError(str(err)) from err


def run(args: argparse.Namespace) -> list[str]:
    """Loads the model, samples, reports kernels and timing on stderr and returns the texts (prompt + continuation)."""
    _check_knobs(args)
    if args.cpu_devices is not None:
        if args.cpu_devices < 1:
            raise SampleError(f"--cpu-devices must be >= 1, got {args.cpu_devices}")
        jax.config.update("jax_num_cpu_devices", args.cpu_devices)  # before anything starts JAX
    prompt = read_prompt(args.prompt)
    params, config, tokenizer = load(args)
    prompt_ids = encode_prompt(tokenizer, prompt, config)
    mesh = device_mesh(args, config)
    kernels, reasons = resolve_kernels(Kernels.auto())
    print(f"kernels: decode {kernels.decode!r} ({reasons['decode']}), matmul {kernels.matmul!r} "
          f"({reasons['matmul']})" + (f"; mesh {sharding.MeshShape.of(mesh)}" if mesh is not None else ""),
          file=sys.stderr)

    def sample():
        return generate_windowed(params, config, prompt_ids, max_new_tokens=args.max_new_tokens,
                                 rng=jax.random.PRNGKey(args.seed), num_samples=args.num_samples,
                                 temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, kernels=kernels,
                                 mesh=mesh)

    start = time.perf_counter()
    sample()  # compiles (at most two programs: the first window and the later ones) and runs
    first = time.perf_counter() - start
    start = time.perf_counter()
    ids = sample()  # same seed: same tokens; now only runs
    steady = time.perf_counter() - start
    print(f"compile: {max(first - steady, 0.0):.2f} s (first call {first:.2f} s minus steady call); "
          f"decode: {ids.size} tokens ({args.num_samples} x {args.max_new_tokens}) in {steady:.3f} s "
          f"= {ids.size / steady:,.0f} tokens/s", file=sys.stderr)
    eos = getattr(tokenizer, "eos_token_id", None)
    return [prompt + tokenizer.decode(until_eos(row, eos)) for row in ids]


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        texts = run(args)
    except (SampleError, data_lib.DataError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    print("\n---------------\n".join(texts))
    return 0


if __name__ == "__main__":
    sys.exit(main())
