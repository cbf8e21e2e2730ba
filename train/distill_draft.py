"""Distil a small draft model for speculative decoding from a target model, and write it as a directory.

    python -m train.distill_draft --gguf SmolLM2-135M-Instruct.Q4_1.gguf --layers 2 --out drafts/smollm2-2l --minutes 7
    python -m train.distill_draft --hf DIR --layers 3 --out DIR2 --minutes 5 --seq-len 256 --batch 4

The draft keeps the target's width, heads, vocabulary, embedding, final norm and head, and --layers of
its blocks (`train.distill.draft`: by default the first --layers, --init ends for the first --layers - 1 and
the last). It is trained for --minutes (optax AdamW; the embedding frozen) to match the target's
next-token distribution (`train.distill.fit`) on:

* the target's own greedy replies, of up to --reply-tokens tokens, to --prompts chat requests of three
  kinds in the target's chat template (free requests, passages of --text to summarise or rewrite,
  standard-library Python functions to edit or explain: `train.distill.prompts`); the replies of the last
  --held-out requests are kept out of training and are where top-1 agreement is measured;
* --text-windows windows of --seq-len tokens of --text (Tiny Shakespeare by default).

The target's scores are computed once, before training (`train.distill.corpus`). A line every --eval-every
steps reports the loss and the held-out agreement; the last line compares the agreement of the cut before
training with the draft's after. DIR then holds a transformers directory (`jaxattn.hf.save_pretrained`,
with the target's tokenizer and chat template) that `python -m train.sample --hf DIR` loads,
`python -m train.sample ... --speculative draft:DIR` and `jaxattn.speculative.DraftProposer` draft with, and distill.json (the settings and the progress lines).
A non-empty DIR is refused unless --overwrite.

Exit codes as every program's (`train.cli`): 2 with one `error:` line for a bad flag.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
from tqdm import tqdm

from jaxattn import Kernels, resolve_kernels, with_fused_qkv
from jaxattn.hf.chat_template import ChatTemplate
from train.checkpoints.meta import CheckpointError
from train.cli import ArgumentParser, UsageError, guard
from train.data.corpus import resolve_data_path
from train.data.errors import DataError
from train.distill import corpus, draft, fit, prompts
from train.models.load import load_model
from train.models.source import SourceFlags
from train.outputs import check_folder

PROGRAM = "python -m train.distill_draft"
FLAGS = SourceFlags(sources=("hf", "gguf"), data=False, allow_nonfinite=False, as_saved=True)
POSITIVE = ("layers", "seq_len", "batch", "positions", "prompts", "held_out", "reply_batch", "reply_tokens", "top_k",
            "eval_every")
RECORDED = ("layers", "init", "minutes", "seq_len", "batch", "positions", "lr", "prompts", "held_out", "reply_tokens",
            "text_windows", "top_k", "seed")  # the settings distill.json keeps


def parse_args(argv=None) -> argparse.Namespace:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    FLAGS.add_to(parser)
    parser.add_argument("--layers", type=int, default=2, help="the draft's layers (default 2)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the directory to write the draft to")
    parser.add_argument("--minutes", type=float, required=True, help="training time, compilation included")
    parser.add_argument("--init", choices=draft.INITS, default="first", help="the blocks kept: the first "
                        "--layers (first, default) or the first --layers - 1 and the last (ends)")
    parser.add_argument("--seq-len", type=int, default=384, help="tokens a row (default 384)")
    parser.add_argument("--batch", type=int, default=8, help="rows a step (default 8)")
    parser.add_argument("--positions", type=int, default=64, help="positions of a row whose loss a step takes, "
                        "drawn afresh each step (default 64)")
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW's peak learning rate (default 1e-3)")
    parser.add_argument("--steps", type=int, help="stop after this many steps (default: when --minutes are spent)")
    parser.add_argument("--prompts", type=int, default=72, help="chat requests the target replies to (default 72)")
    parser.add_argument("--held-out", type=int, default=9, help="of them, kept for measuring (default 9)")
    parser.add_argument("--reply-batch", type=int, default=24, help="replies generated at once (default 24)")
    parser.add_argument("--reply-tokens", type=int, default=160, help="the most tokens a reply (default 160)")
    parser.add_argument("--text", metavar="FILE", help="plain text (default: Tiny Shakespeare, as training finds it)")
    parser.add_argument("--text-windows", type=int, default=48, help="windows of --text trained on (default 48)")
    parser.add_argument("--top-k", type=int, default=16, help="the target's highest logits kept a position "
                        "(default 16)")
    parser.add_argument("--eval-every", type=int, default=20, help="steps between progress lines (default 20)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier draft in DIR")
    args = parser.parse_args(argv)
    args.model_source = FLAGS.read(parser, args)
    _check(parser, args)
    return args


def _check(parser: ArgumentParser, args: argparse.Namespace) -> None:
    """The flags' usage errors (`parser.error`), before anything is loaded."""
    for name in POSITIVE:
        if getattr(args, name) < 1:
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if not args.minutes > 0:
        parser.error(f"--minutes must be > 0, got {args.minutes}")
    if not args.lr > 0:
        parser.error(f"--lr must be > 0, got {args.lr}")
    if args.steps is not None and args.steps < 1:
        parser.error(f"--steps must be >= 1, got {args.steps}")
    if args.text_windows < 0:
        parser.error(f"--text-windows must be >= 0, got {args.text_windows}")
    if args.held_out >= args.prompts:
        parser.error(f"--held-out ({args.held_out}) must leave some of the --prompts ({args.prompts}) to train on")
    if args.seq_len < 16:
        parser.error(f"--seq-len must be >= 16, got {args.seq_len}")
    out = Path(args.out)
    if out.is_dir() and any(out.iterdir()) and not args.overwrite:
        parser.error(f"--out {out} is not empty: pass --overwrite to replace an earlier draft there")
    check_folder(out, "--out")


def bar(desc: str, total: int) -> tqdm:
    return tqdm(total=total, desc=desc, unit="row", file=sys.stderr, disable=None, leave=False)


def render(requests: list[str], chat: tuple[str | None, dict[str, str]]) -> list[str]:
    """Each request as the target's chat template renders one user message (plain, with a newline, without)."""
    template, specials = chat
    if template is None:
        return [request + "\n" for request in requests]
    rendered = ChatTemplate(template, specials)
    return [rendered.render([{"role": "user", "content": request}]) for request in requests]


def make_data(loaded, args) -> tuple[corpus.Rows, corpus.Rows]:
    """(training rows, held-out rows) with the target's scores (see the module docstring)."""
    rng = np.random.default_rng(args.seed)
    text = resolve_data_path(args.text).read_text(encoding="utf-8")
    encode, eos = loaded.tokenizer.encode, getattr(loaded.tokenizer, "eos_token_id", None)
    asked = [np.asarray(encode(t), np.int32) for t in render(prompts.chat_requests(args.prompts, text, rng),
                                                                 loaded.read_chat())]
    fused, fused_config = with_fused_qkv(loaded.params, loaded.config)  # the same numbers, a faster token
    start = time.perf_counter()
    with bar("target replies", len(asked)) as progress:
        answers = corpus.replies(fused, fused_config, asked, max_new_tokens=args.reply_tokens,
                                 batch=args.reply_batch, stop_token=eos, progress=progress.update)
    print(f"target replies: {len(asked)} of {np.mean([len(a) for a in answers]):.0f} tokens on average "
          f"({time.perf_counter() - start:.0f} s)", flush=True)
    chats = corpus.rows([np.concatenate([p, a]) for p, a in zip(asked, answers)], [len(p) - 1 for p in asked],
                        args.seq_len)
    windows = corpus.text_windows(text, encode, args.text_windows, args.seq_len, rng)
    data = corpus.concat([chats, corpus.rows(windows, [0] * len(windows), args.seq_len)])
    start = time.perf_counter()
    with bar("target scores", len(data)) as progress:
        data = corpus.teacher_targets(fused, fused_config, data, k=min(args.top_k, loaded.config.vocab_size),
                                      batch=args.batch, progress=progress.update)
    print(f"target scores: {len(data)} rows of {args.seq_len} tokens ({time.perf_counter() - start:.0f} s)",
          flush=True)
    held = np.arange(args.prompts - args.held_out, args.prompts)
    return data.take(np.setdiff1d(np.arange(len(data)), held)), data.take(held)


def run(argv=None) -> int:
    """Loads the target, makes the data, cuts and trains the draft, writes it; prints what it did."""
    args = parse_args(argv)
    loaded = load_model(args.model_source)
    try:
        draft.kept_layers(loaded.config.num_layers, args.layers, args.init)
        draft.check_cuttable(loaded.config)
    except ValueError as err:
        raise UsageError(f"--layers {args.layers}: {err}") from None
    train_rows, held_out = make_data(loaded, args)
    params, config = draft.cut(loaded.params, loaded.config, args.layers, args.init)
    kernels, _ = resolve_kernels(Kernels.auto())
    settings = fit.FitSettings(minutes=args.minutes, batch=args.batch, positions=args.positions, lr=args.lr,
                               steps=args.steps, eval_every=args.eval_every, seed=args.seed)
    print(f"training a {args.layers}-layer draft ({args.init}: the target's blocks "
          f"{draft.kept_layers(loaded.config.num_layers, args.layers, args.init)}) on {len(train_rows)} rows for "
          f"{args.minutes:g} min; {len(held_out)} held-out rows", flush=True)
    params, report = fit.fit(params, config, train_rows, held_out, settings, kernels=kernels,
                             say=lambda line: print(line, flush=True))
    saved = draft.save(args.out, config, params, loaded.tokenizer, loaded.read_chat(), overwrite=args.overwrite)
    record = {"target": Path(args.model_source.path).name, **{name: getattr(args, name) for name in RECORDED},
              "steps": report.steps, "train_seconds": report.seconds, "agreement_before": report.agreement_before,
              "agreement_after": report.agreement_after, "lines": report.lines}
    (Path(args.out) / "distill.json").write_text(json.dumps(record, indent=2) + "\n")
    print(f"held-out top-1 agreement with the target: {report.agreement_before:.3f} before training, "
          f"{report.agreement_after:.3f} after {report.steps} steps ({report.seconds / 60:.1f} min)")
    print(f"wrote {saved.directory} ({saved.architecture}); draft with it: python -m train.sample (the target) "
          f"--speculative draft:{saved.directory},k=4, or a DraftProposer of "
          f"load_model(ModelSource(hf={str(saved.directory)!r}))")
    return 0


def main(argv=None) -> int:
    """0 once the draft is written; one line and exit 1 or 2 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError, DataError))


if __name__ == "__main__":
    sys.exit(main())
