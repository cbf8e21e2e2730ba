"""Train the tiny character-level LM: `python -m train.tiny_lm [--config NAME] [--set TABLE.FIELD=VALUE ...]`.

The default is nanoGPT's CPU "baby" Shakespeare run (configs/shakespeare_char_baby.toml).
A directory that already holds a run is never replaced without --overwrite (--resume
continues it); Ctrl-C or SIGTERM saves a checkpoint and exits 130. The run prints its resolved config and runtime (kernels and devices, with the reason for
each "auto"), a progress bar with loss and tokens/s, the evaluations, and at the end the
final val loss, speed, peak memory and a sample; it writes config.json, metrics.jsonl, loss.png,
result.json and checkpoints (latest and best) under train.out_dir.

Where the work is done: train.loop (the run), train.steps (the jitted programs),
train.runtime (devices and kernels), train.checkpoint, train.plots.
"""

from __future__ import annotations

import argparse
import json
import sys

from train import data as data_lib
from train import runtime as runtime_lib
from train.checkpoint import CheckpointError
from train.config import DEFAULT_CONFIG, load_config
from train.loop import Interrupted, RunResult, TrainingDiverged, train
from train.metrics import describe_memory
from train.rundir import RunDirectoryError

RUNTIME_ERRORS = (data_lib.DataError, CheckpointError, RunDirectoryError, TrainingDiverged, OSError)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m train.tiny_lm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="configs/NAME.toml or a path")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="TABLE.FIELD=VALUE",
                        help="overrides, e.g. model.positions=rope train.max_iters=500 runtime.matmul=xla "
                             "(may be repeated)")
    parser.add_argument("--data", help="the text file to train on (= train.data_path)")
    parser.add_argument("--out-dir", help="= train.out_dir")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir's latest checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace the run already in out_dir")
    parser.add_argument("--loss-plot", help="where to write the loss curve PNG (default out_dir/loss.png)")
    parser.add_argument("--quiet", action="store_true")
    return parser


def overrides(args: argparse.Namespace) -> list[str]:
    """`--set` items plus the flags that are shorthands for config fields."""
    extra = [f"train.data_path={json.dumps(args.data)}"] if args.data else []
    extra += [f"train.out_dir={json.dumps(args.out_dir)}"] if args.out_dir else []
    return list(args.set) + extra


def main(argv: list[str] | None = None) -> RunResult:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        config = load_config(args.config, overrides(args))
        runtime = runtime_lib.start(config.runtime, config.train.batch_size)  # before anything starts JAX
    except (ValueError, TypeError, FileNotFoundError) as err:
        parser.error(str(err))
    try:
        result = train(config, runtime=runtime, resume=args.resume, overwrite=args.overwrite, quiet=args.quiet,
                       loss_plot=args.loss_plot)
    except Interrupted as stop:
        print(f"stopped: {stop}", file=sys.stderr)
        sys.exit(130)
    except RUNTIME_ERRORS as err:  # one line each: a full disk, a corrupted checkpoint, a diverged run
        print(f"error: {err}", file=sys.stderr)
        sys.exit(1)
    print(f"final: val loss {result.final_val_loss:.4f} at iter {result.steps} | "
          f"{result.median_tokens_per_s:,.0f} tokens/s median ({result.median_ms_per_iter:.1f} ms/iter, "
          f"excluding compile) | compile {result.compile_s:.1f}s | wall {result.wall_s:.1f}s | "
          + describe_memory(result.figures()))
    return result


if __name__ == "__main__":
    main()
