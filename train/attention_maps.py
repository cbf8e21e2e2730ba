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
training builds it: `--data`, the config's data_path, then train.data.corpus's defaults),
loaded by `train.models.load.load_model` with the weights as they were saved.

A model loaded with `--allow-nonfinite` whose attention weights on the text are not finite is
refused in one line (exit 1), naming the layers and heads and the first layer whose output is
not finite; nothing is drawn, since every map from that layer on is NaN. When the maps are
finite though some weights are not, they are drawn and a warning names those weights.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

from train import outputs
from train.checkpoints.store import CheckpointError
from train.cli import ArgumentParser, UsageError, guard
from train.data.errors import DataError
from train.models.fresh import fresh_params
from train.models.load import load_model
from train.models.nonfinite import describe_nonfinite, list_weights
from train.models.source import SourceFlags
from train.run.plots import plot_attention_maps

PROGRAM = "python -m train.attention_maps"
# No GGUF file; a fresh model takes the tokenizer its config trains with; the weights as saved, named so.
FLAGS = SourceFlags(sources=("checkpoint", "hf", "random_init"), init_seed=True, as_saved=True, fit_vocab=True)
DEFAULT_TEXT = "ROMEO:\nBut soft, what light"
HTML_SUFFIXES = (".html", ".htm")


class NonFiniteError(RuntimeError):
    """The attention weights are not finite (exit 1)."""


def attention_weights(params, model_config, token_ids: np.ndarray) -> np.ndarray:
    """Weights of every layer and head for one sequence: [L, N, T, T] float32 (docs/theory.md §14);
    the viewer's `model_weights`, jitted once per config, so the PNG and the page share it."""
    from jaxattn.viewer.page import model_weights
    return model_weights(model_config, params, token_ids)


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
    FLAGS.add_to(parser)
    text = parser.add_mutually_exclusive_group()
    text.add_argument("--text", default=DEFAULT_TEXT, help="the characters to look at")
    text.add_argument("--text-file", metavar="PATH", help="read the text from a UTF-8 file (long inputs)")
    parser.add_argument("--max-tokens", type=int, metavar="N", help="keep only the text's first N tokens")
    parser.add_argument("--out", default=None, help="the PNG grid (default maps.png; none with --html alone)")
    parser.add_argument("--html", metavar="PATH", help="write the interactive page (jaxattn.viewer) here")
    args = parser.parse_args(argv)
    args.model_source = FLAGS.read(parser, args)
    if args.max_tokens is not None and args.max_tokens <= 0:
        parser.error(f"--max-tokens must be positive, got {args.max_tokens}")
    if args.html is not None and not args.html.lower().endswith(HTML_SUFFIXES):
        parser.error(f"--html {args.html}: the page's name must end in .html or .htm")
    if args.out is None and args.html is None:
        args.out = "maps.png"
    return args


def source_name(args: argparse.Namespace) -> str:
    """The model's source for the title: the directory as given, or the config and its seed."""
    source = args.model_source
    return f"{source.random_init} (random init, seed {source.seed})" if source.kind == "random_init" else source.path


def check_html_length(ids, flag: str) -> None:
    """UsageError when the page would hold more tokens than the viewer shows."""
    from jaxattn.viewer import MAX_TOKENS
    if len(ids) > MAX_TOKENS:
        raise UsageError(f"{flag} has {len(ids)} tokens; the HTML viewer shows at most {MAX_TOKENS} "
                         f"(jaxattn.viewer.MAX_TOKENS): give a shorter text or --max-tokens {MAX_TOKENS}")


def model_and_ids(args: argparse.Namespace):
    """(params, model config, tokenizer, ids) with the text cut to --max-tokens and, for a trained model, its
    context; a fresh model's context is made the text's length instead (its parameters drawn again)."""
    text, flag = read_text(args)
    loaded = load_model(args.model_source)
    params, model_config, tokenizer = loaded.params, loaded.config, loaded.tokenizer
    fresh = args.model_source.kind == "random_init"
    cut = fresh or (args.max_tokens is not None and args.max_tokens < model_config.max_seq_len)
    limit, why = (args.max_tokens, "--max-tokens") if cut else (model_config.max_seq_len, "max_seq_len")
    ids = token_ids(tokenizer, text, limit, flag, why)
    if args.html is not None:
        check_html_length(ids, flag)
    if len(ids) > model_config.max_seq_len:  # fresh parameters: the context is the text's length
        model_config = model_config.replace(max_seq_len=len(ids))
        params = fresh_params(model_config, args.model_source.seed)
    return params, model_config, tokenizer, ids


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
