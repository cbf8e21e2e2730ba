"""Draw a model's attention: `python -m train.attention_maps --checkpoint DIR --text "..." --out maps.png`.

    python -m train.attention_maps --checkpoint runs/shakespeare_char_baby --out maps.png
    python -m train.attention_maps --hf exports/baby --text "ROMEO:" --out maps.png   # a transformers directory
    python -m train.attention_maps --checkpoint runs/shakespeare_char_baby --html maps.html
    python -m train.attention_maps --random-init shakespeare_char_baby_gqa --text-file play.txt \\
        --max-tokens 1024 --html maps.html                                            # fresh parameters

The PNG: one heatmap per layer (rows) and head (columns): row t of a map is how query
character t distributes its attention over key characters 0..t (causal, so the upper
triangle is empty). `--html` writes an interactive page instead (or beside it, with
`--out`): head, model and matrix views in one self-contained file that works offline
(jaxattn.viewer), each layer labelled with its kind (MHA/GQA/MQA/MLA, local window, no
RoPE, sinks).

Sources: `--checkpoint` (a training run), `--hf` (a transformers directory; tokens are the
tokenizer's decoded pieces) or `--random-init CONFIG` (a config of configs/ or a .toml
file with fresh parameters from `--seed`; its char tokenizer is built from the corpus as
training builds it: `--data`, the config's data_path, then train.data.corpus's defaults).

A model loaded with `--allow-nonfinite` whose attention weights on the text are not finite is
refused in one line (exit 1), naming the layers and heads and the first layer whose output is
not finite; nothing is drawn, since every map from that layer on is NaN. When the maps are
finite though some weights are not, they are drawn and a warning names those weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.model import DecoderLM
from train import outputs
from train.checkpoints.store import CheckpointError
from train.cli import ArgumentParser, UsageError, guard
from train.data.errors import DataError
from train.models.pretrained import load_hf
from train.models.runs import describe_nonfinite, list_weights, load_for_sampling
from train.run.plots import plot_attention_maps

PROGRAM = "python -m train.attention_maps"
DEFAULT_TEXT = "ROMEO:\nBut soft, what light"
HTML_SUFFIXES = (".html", ".htm")


class NonFiniteError(RuntimeError):
    """The attention weights are not finite (exit 1)."""


def attention_weights(params, model_config, token_ids: np.ndarray) -> np.ndarray:
    """Weights of every layer and head for one sequence: [L, N, T, T] float32 (docs/theory.md §14);
    the viewer's `model_weights`, jitted once per config, so the PNG and the page share it."""
    from jaxattn.viewer.page import model_weights
    return model_weights(model_config, params, token_ids)


def random_init(args: argparse.Namespace):
    """(model config, tokenizer) of `--random-init`: the config's tokenizer as training builds it
    (a char tokenizer from the corpus, or bytes), the model's vocabulary set from it."""
    from train.config import load_config
    from train.data import corpus as data
    from train.data.tokenizer import build_tokenizer
    try:
        config = load_config(args.random_init)
    except FileNotFoundError as err:
        raise UsageError(f"--random-init: {err}") from None
    except (TypeError, ValueError) as err:
        raise UsageError(f"--random-init {args.random_init}: {err}") from None
    kind = config.train.tokenizer
    corpus = "" if kind == "byte" else data.read_text(data.resolve_data_path(args.data or config.train.data_path))
    tokenizer = build_tokenizer(kind, corpus)
    model_config = config.model.replace(vocab_size=tokenizer.vocab_size)
    return model_config, tokenizer


def fresh_params(model_config, seed: int):
    """Parameters of `DecoderLM(model_config)` initialised from `seed`."""
    import flax.linen as nn
    variables = DecoderLM(model_config).init(jax.random.PRNGKey(seed), jnp.zeros((1, 1), jnp.int32))
    return nn.unbox(variables["params"])


def load(args: argparse.Namespace):
    """(params, model config, tokenizer) of `--hf` or `--checkpoint`; CheckpointError (one line) if unreadable."""
    if args.hf is not None:
        return load_hf(args.hf, allow_nonfinite=args.allow_nonfinite)
    return load_for_sampling(args.checkpoint)


def read_text(args: argparse.Namespace) -> tuple[str, str]:
    """(the text, the flag it came from): `--text-file` read as UTF-8, else `--text`."""
    if args.text_file is None:
        return args.text, "--text"
    try:
        return Path(args.text_file).read_text(encoding="utf-8"), "--text-file"
    except UnicodeDecodeError as err:
        raise UsageError(f"--text-file {args.text_file} is not UTF-8 text: {err}") from None


def token_ids(tokenizer, text: str, max_seq_len: int | None, flag: str = "--text", why: str = "max_seq_len"):
    """The ids of `text`, at most `max_seq_len` of them (with a note naming `why` when cut); UsageError
    if it has none."""
    if not text:
        raise UsageError(f"{flag} must not be empty")
    try:
        ids = tokenizer.encode(text)
    except ValueError as err:  # unknown characters (both tokenizer kinds raise ValueError)
        raise UsageError(f"{flag} cannot be encoded: {err}") from err
    if max_seq_len is not None and len(ids) > max_seq_len:
        print(f"{flag} has {len(ids)} tokens; keeping the first {max_seq_len} ({why})")
        ids = ids[:max_seq_len]
    return ids


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", help="a run's out_dir (or its checkpoints/best)")
    source.add_argument("--hf", metavar="DIR", help="a transformers directory with a tokenizer.json")
    source.add_argument("--random-init", metavar="CONFIG",
                        help="fresh parameters of a config (a name in configs/ or a .toml path)")
    parser.add_argument("--allow-nonfinite", action="store_true",
                        help="with --hf: load weights holding NaN or infinity (refused otherwise)")
    parser.add_argument("--seed", type=int, default=None, help="with --random-init: the parameters' seed (0)")
    parser.add_argument("--data", metavar="PATH",
                        help="with --random-init: the corpus its char tokenizer is built from (as training does)")
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", default=DEFAULT_TEXT, help="the characters to look at")
    text.add_argument("--text-file", metavar="PATH", help="read the text from a UTF-8 file (long inputs)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="keep only the text's first N tokens")
    parser.add_argument("--out", default=None, help="the PNG grid (default maps.png; none with --html alone)")
    parser.add_argument("--html", metavar="PATH", help="write the interactive page (jaxattn.viewer) here")
    args = parser.parse_args(argv)
    if args.allow_nonfinite and args.hf is None:
        parser.error("--allow-nonfinite goes with --hf")
    for flag, value in (("--seed", args.seed), ("--data", args.data)):
        if value is not None and args.random_init is None:
            parser.error(f"{flag} goes with --random-init")
    if args.seed is not None and not 0 <= args.seed < 2 ** 32:
        parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
    if args.max_tokens is not None and args.max_tokens <= 0:
        parser.error(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.html is not None and not args.html.lower().endswith(HTML_SUFFIXES):
        parser.error(f"--html {args.html}: the page's name must end in .html or .htm")
    if args.out is None and args.html is None:
        args.out = "maps.png"
    return args


def source_name(args: argparse.Namespace) -> str:
    if args.random_init is not None:
        return f"{args.random_init} (random init, seed {args.seed or 0})"
    return args.checkpoint if args.hf is None else args.hf


def check_html_length(ids, flag: str) -> None:
    """UsageError when the page would hold more tokens than the viewer shows."""
    from jaxattn.viewer import MAX_TOKENS
    if len(ids) > MAX_TOKENS:
        raise UsageError(f"{flag} has {len(ids)} tokens; the HTML viewer shows at most {MAX_TOKENS} "
                         f"(jaxattn.viewer.MAX_TOKENS): give a shorter text or --max-tokens {MAX_TOKENS}")


def model_and_ids(args: argparse.Namespace):
    """(params, model config, tokenizer, ids) with the text cut to --max-tokens and the model's context."""
    text, flag = read_text(args)
    if args.random_init is None:
        params, model_config, tokenizer = load(args)
        cut = args.max_tokens is not None and args.max_tokens < model_config.max_seq_len
        limit, why = (args.max_tokens, "--max-tokens") if cut else (model_config.max_seq_len, "max_seq_len")
        ids = token_ids(tokenizer, text, limit, flag, why)
        if args.html is not None:
            check_html_length(ids, flag)
        return params, model_config, tokenizer, ids
    model_config, tokenizer = random_init(args)
    ids = token_ids(tokenizer, text, args.max_tokens, flag, "--max-tokens")
    if args.html is not None:
        check_html_length(ids, flag)
    if len(ids) > model_config.max_seq_len:  # fresh parameters: the context is the text's length
        model_config = model_config.replace(max_seq_len=len(ids))
    return fresh_params(model_config, args.seed or 0), model_config, tokenizer, ids


def check_finite(weights: np.ndarray, params, model_config, ids, allow_nonfinite: bool) -> None:
    """`NonFiniteError` when the weights `[L, N, T, T]` hold NaN or infinity, naming the layers and heads
    and where the forward pass first goes non-finite; a warning when they are finite but, with
    `--allow-nonfinite`, some parameters are not."""
    finite = np.isfinite(weights).all(axis=(2, 3))  # [L, N]
    if not finite.all():
        heads = "; ".join(f"layer {layer} head{'s' if (~finite[layer]).sum() > 1 else ''} "
                          f"{', '.join(map(str, np.flatnonzero(~finite[layer])))}"
                          for layer in np.flatnonzero(~finite.all(axis=1)))
        raise NonFiniteError(f"the attention weights are not finite (NaN or infinity) in {heads}, so nothing is "
                             f"drawn: {describe_nonfinite(params, model_config, ids)}")
    listed = list_weights(params) if allow_nonfinite else ""
    if listed:
        print(f"warning: the weights holding NaN or infinity ({listed}) leave this text's attention weights "
              "finite: drawing them", file=sys.stderr)


def write_html(path: Path, weights: np.ndarray, tokens: list[str], model_config, title: str) -> None:
    from jaxattn.viewer import attention_page, describe_layers
    page = attention_page(weights, tokens, layers=describe_layers(model_config), title=title)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(page, encoding="utf-8")
    print(f"wrote {path} ({path.stat().st_size:,} bytes)")


def run(argv: list[str] | None) -> Path:
    """Checks the outputs, loads (or initialises) the model, draws the maps; returns the PNG's path,
    or the page's when only --html was given."""
    args = parse_args(argv)
    if args.out is not None:  # before any work: the type, and that it can be written
        outputs.check_image_file(args.out, "--out")
    if args.html is not None:
        outputs.check_file(args.html, "--html")
    params, model_config, tokenizer, ids = model_and_ids(args)
    weights = attention_weights(params, model_config, ids)
    check_finite(weights, params, model_config, ids, args.allow_nonfinite)
    chars = [tokenizer.decode([i]) for i in ids]
    kind = "MLA" if model_config.mla else f"{model_config.num_heads}q/{model_config.num_kv_heads}kv heads"
    title = f"attention weights ({kind}, {model_config.positions} positions) from {source_name(args)}"
    if args.html is not None:
        write_html(Path(args.html), weights, chars, model_config, title)
    if args.out is None:
        return Path(args.html)
    plot_attention_maps(weights, chars, Path(args.out), title=title)
    print(f"wrote {args.out}")
    return Path(args.out)


def main(argv: list[str] | None = None) -> Path:
    """Writes the maps and returns their path; one line and exit 2 (usage), 1 (an unreadable
    checkpoint or corpus, an unwritable --out or --html) or 130 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError, DataError, NonFiniteError))


if __name__ == "__main__":
    main()
