"""Sample text from a trained (or randomly initialised) character LM.

    python -m train.sample --checkpoint runs/shakespeare_char_baby --prompt "ROMEO:" --max-new-tokens 500
    echo "JULIET:" | python -m train.sample --checkpoint DIR --num-samples 3 --temperature 0.8 --top-k 40
    python -m train.sample --random-init shakespeare_char_baby_mla --prompt "ROMEO:"

The text goes to stdout; compile time and steady-state tokens/s go to stderr.
Generation uses `jaxattn.decoding.generate` (KV cache, one `lax.scan`). When
prompt + new tokens exceed the model's context (`max_seq_len`, 64 for the baby
model) generation continues in windows, like nanoGPT's cropping: the last half
context of text is prefilled again and the next half context of tokens is
decoded, so every token sees between half and all of a context of history.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import jax
import numpy as np

from jaxattn.config import ModelConfig
from jaxattn.decoding import generate
from jaxattn.model import DecoderLM
from train import checkpoint as checkpoint_lib
from train import config as config_lib
from train import data as data_lib
from train.tokenizer import CharTokenizer, Tokenizer


class SampleError(ValueError):
    """A user-facing problem with the arguments, the checkpoint or the prompt."""


def load_for_sampling(directory: str | Path) -> tuple[dict, ModelConfig, Tokenizer]:
    """(params, model config, tokenizer) of a training run's checkpoint (its best, else its latest)."""
    try:
        params, config, tokenizer = checkpoint_lib.load_for_sampling(directory)
    except checkpoint_lib.CheckpointError as err:
        raise SampleError(str(err)) from err
    _check_params_match(params, config)
    return params, config, tokenizer


def _check_params_match(params, config: ModelConfig) -> None:
    """Raises SampleError when the stored arrays do not have the shapes `DecoderLM(config)` expects."""
    expected = jax.eval_shape(lambda: DecoderLM(config).init(jax.random.PRNGKey(0),
                                                              np.zeros((1, 1), np.int32))["params"])
    got = jax.tree_util.tree_map_with_path(lambda p, x: (jax.tree_util.keystr(p), np.shape(x)), params)
    want = jax.tree_util.tree_map_with_path(lambda p, x: (jax.tree_util.keystr(p), x.shape), expected)
    got, want = dict(jax.tree.leaves(got, is_leaf=_is_pair)), dict(jax.tree.leaves(want, is_leaf=_is_pair))
    if got != want:
        missing, extra = sorted(set(want) - set(got)), sorted(set(got) - set(want))
        wrong = sorted(k for k in set(got) & set(want) if got[k] != want[k])
        raise SampleError(
            "checkpoint is incompatible with its model config: "
            f"missing {missing[:5]}, unexpected {extra[:5]}, "
            f"wrong shapes {[(k, got[k], want[k]) for k in wrong[:5]]}")


def _is_pair(x) -> bool:
    return isinstance(x, tuple) and len(x) == 2 and isinstance(x[0], str)


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


def generate_ids(params, config: ModelConfig, prompt_ids: np.ndarray, *, num_samples: int, max_new_tokens: int,
                 seed: int, temperature: float, top_k: int, top_p: float) -> np.ndarray:
    """`[num_samples, max_new_tokens]` ids continuing `prompt_ids` `[P]`, in windows beyond the context."""
    context = config.max_seq_len
    keep = max(1, context // 2)
    rows = np.tile(np.asarray(prompt_ids, np.int32), (num_samples, 1))  # [S, P]
    prompt_len, rng = rows.shape[1], jax.random.PRNGKey(seed)
    while rows.shape[1] - prompt_len < max_new_tokens:
        first = rows.shape[1] == prompt_len
        window = rows if first else rows[:, -keep:]
        num_new = min(max_new_tokens, context - prompt_len) if first else context - keep
        rng, key = jax.random.split(rng)
        result = generate(params, config, window, np.full(num_samples, window.shape[1]), max_new_tokens=num_new,
                          rng=key, temperature=temperature, top_k=top_k, top_p=top_p)
        rows = np.concatenate([rows, np.asarray(result.tokens)], axis=1)
    return rows[:, prompt_len:prompt_len + max_new_tokens]


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
    """Prompt ids `[P]`; raises SampleError for unknown characters or a prompt that fills the context."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as err:
        raise SampleError(f"the prompt cannot be encoded: {err}") from err
    if len(ids) >= config.max_seq_len:
        raise SampleError(f"the prompt is {len(ids)} tokens long but the model's context is "
                          f"max_seq_len={config.max_seq_len} tokens: use at most {config.max_seq_len - 1}")
    return ids


def _check_knobs(args) -> None:
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise SampleError("--max-new-tokens and --num-samples must be >= 1")
    if args.temperature < 0:
        raise SampleError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0.0 < args.top_p <= 1.0:
        raise SampleError(f"--top-p must be in (0, 1], got {args.top_p}")


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="python -m train.sample", description=__doc__.split("\n\n")[0])
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="DIR", help="a training run directory (or its checkpoints/...)")
    source.add_argument("--random-init", metavar="CONFIG", help="a config name from configs/, randomly initialised")
    parser.add_argument("--prompt", help="prompt text; '-' or absent (with piped stdin) reads stdin")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=200, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=1337)
    return parser.parse_args(argv)


def run(args: argparse.Namespace) -> list[str]:
    """Loads the model, samples, reports timing on stderr and returns the texts (prompt + continuation)."""
    _check_knobs(args)
    prompt = read_prompt(args.prompt)
    if args.checkpoint is not None:
        params, config, tokenizer = load_for_sampling(args.checkpoint)
    else:
        params, config, tokenizer = random_init(args.random_init, args.seed)
    prompt_ids = encode_prompt(tokenizer, prompt, config)
    sample = lambda: generate_ids(params, config, prompt_ids, num_samples=args.num_samples,  # noqa: E731
                                  max_new_tokens=args.max_new_tokens, seed=args.seed,
                                  temperature=args.temperature, top_k=args.top_k, top_p=args.top_p)
    start = time.perf_counter()
    sample()  # compiles (at most two programs: the first window and the later ones) and runs
    first = time.perf_counter() - start
    start = time.perf_counter()
    ids = sample()  # same seed: same tokens; now only runs
    steady = time.perf_counter() - start
    total = ids.size
    print(f"compile: {max(first - steady, 0.0):.2f} s (first call {first:.2f} s minus steady call); "
          f"decode: {total} tokens ({args.num_samples} x {args.max_new_tokens}) in {steady:.3f} s "
          f"= {total / steady:,.0f} tokens/s", file=sys.stderr)
    return [prompt + tokenizer.decode(row) for row in ids]


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
