"""A corpus larger than 4 GiB, prepared and trained on: peak memory, tokens/s and the wait for input.

    PYTHONPATH=$PWD python bench/large_corpus.py [--gib 4.5] [--iters 500] [--rounds 2] [--scratch DIR] [--source FILE]

Writes Tiny Shakespeare repeated until the train split holds --gib GiB of uint16 character ids
(more than 2**31 tokens at the default, so the 64-bit start draw of `train.data.batches.draw_starts`
runs), prepares it with `python -m train.prepare --tokenizer char` into one train shard, deletes
the text, then trains the default baby config for --iters iterations on it and on Tiny
Shakespeare itself, in fresh processes, in turns. Each child's peak resident memory is read
from the kernel when it exits (`os.wait4`); tokens/s and the seconds the steps waited for their
batches come from the run's result.json. Writes bench/results/large_corpus.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from bench.timing import median  # noqa: E402

LIMIT_GIB = 1.5  # the memory a run over a 4 GiB corpus must stay under
RUN = ["train.eval_iters=5", "train.sample_tokens=0", "train.plot=false", "train.checkpoint=false"]


def write_text(path: Path, source: Path, train_gib: float) -> int:
    """`source` repeated into `path` until its train split (90%) is `train_gib` GiB of uint16 ids; its bytes."""
    text, target, written = source.read_bytes(), int(train_gib * 2**30 / 2 / 0.9), 0
    with open(path, "wb") as f:
        while written < target:
            f.write(text)
            written += len(text)
    return written


def prepare(text: Path, out: Path) -> dict:
    """`python -m train.prepare --tokenizer char` into one train shard: wall time, peak RSS, shard sizes."""
    done = fresh.run([sys.executable, "-m", "train.prepare", "--data", text, "--tokenizer", "char", "--out", out,
                      "--shard-tokens", str(4 * 2**30)], what="train.prepare")
    manifest = json.loads((out / "prepared.json").read_text())
    return {"wall_s": done.wall_s, "peak_rss_gib": done.peak_rss_bytes / 2**30, "text_bytes": text.stat().st_size,
            "train_tokens": manifest["train"]["tokens"], "val_tokens": manifest["val"]["tokens"],
            "train_shard_gib": (out / "train_00000.bin").stat().st_size / 2**30}


def train(data: Path, out: Path, iters: int) -> dict:
    """The baby config for `iters` iterations on `data`: peak RSS (kernel and result.json), speed, wait."""
    done = fresh.run([sys.executable, "-m", "train.tiny_lm", "--quiet", "--data", data, "--out-dir", out,
                      "--set", f"train.max_iters={iters}", f"train.eval_interval={iters}",
                      f"train.lr_decay_iters={iters}", *RUN], what="train.tiny_lm")
    result = json.loads((out / "result.json").read_text())
    keep = ("median_tokens_per_s", "median_ms_per_iter", "input_wait_s", "final_val_loss", "peak_rss_gib")
    return {"wall_s": done.wall_s, "peak_rss_gib_kernel": done.peak_rss_bytes / 2**30,
            **{k: result[k] for k in keep}}


def markdown(record: dict) -> str:
    p, rows = record["prepare"], []
    for name, runs in record["runs"].items():
        rows.append(f"| {name} | {median([r['median_tokens_per_s'] for r in runs]):,.0f} | "
                    f"{median([r['median_ms_per_iter'] for r in runs]):.2f} | "
                    f"{max(r['peak_rss_gib_kernel'] for r in runs):.3f} | "
                    f"{max(r['input_wait_s'] for r in runs):.3f} | {runs[0]['final_val_loss']:.4f} |")
    held = max(r["peak_rss_gib_kernel"] for r in record["runs"]["large"]) < LIMIT_GIB
    return "\n".join([
        f"# A corpus of {p['train_shard_gib']:.2f} GiB ({p['train_tokens']:,} train tokens)", "",
        f"Machine: {machine_line(record['machine'])}. Command: `{record['command']}`", "",
        f"prepare (`--tokenizer char`, {p['text_bytes'] / 2**30:.2f} GiB of text): {p['wall_s']:.1f} s "
        f"({p['text_bytes'] / p['wall_s'] / 1e6:.0f} MB/s), peak RSS {p['peak_rss_gib']:.3f} GiB", "",
        f"Training, {record['iters']} iters of the baby config, {record['rounds']} rounds in turns:", "",
        "| corpus | tokens/s (median) | ms/iter | peak RSS (max, GiB) | waiting for input (max, s) | val loss |",
        "| --- | ---: | ---: | ---: | ---: | ---: |", *rows, "",
        f"Peak memory of the run over the large corpus under {LIMIT_GIB} GiB: {'yes' if held else 'NO'}.", ""])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gib", type=float, default=4.5, help="GiB of train tokens (uint16)")
    parser.add_argument("--iters", type=int, default=500)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--scratch", type=Path, default=None, help="where the corpus goes (default: a temp dir)")
    parser.add_argument("--out-dir", type=Path, default=ROOT / "bench" / "results")
    parser.add_argument("--source", type=Path, default=None,
                        help="the text repeated and trained on beside (default: Tiny Shakespeare, as train.data.corpus finds it)")
    args = parser.parse_args()
    from train.data.corpus import resolve_data_path
    source = resolve_data_path(args.source)
    scratch = Path(tempfile.mkdtemp(prefix="large-corpus-", dir=args.scratch))
    try:
        text = scratch / "corpus.txt"
        print(f"writing {write_text(text, source, args.gib) / 2**30:.2f} GiB of text...", file=sys.stderr)
        record_prepare = prepare(text, scratch / "prepared")
        text.unlink()
        runs = {"large": [], "tiny shakespeare": []}
        for round_index in range(args.rounds):
            sides = [("large", scratch / "prepared"), ("tiny shakespeare", source)]
            for name, data in sides if round_index % 2 == 0 else sides[::-1]:
                print(f"round {round_index + 1}: training on {name}...", file=sys.stderr)
                runs[name].append(train(data, scratch / "run", args.iters))
                shutil.rmtree(scratch / "run")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    command = f"PYTHONPATH=$PWD python bench/large_corpus.py --gib {args.gib} --iters {args.iters} --rounds {args.rounds}"
    record = {"machine": describe_machine(), "command": command, "iters": args.iters, "rounds": args.rounds,
              "limit_gib": LIMIT_GIB, "prepare": record_prepare, "runs": runs}
    write_results(args.out_dir, "large_corpus", record, markdown(record))
    return 0


if __name__ == "__main__":
    sys.exit(main())
