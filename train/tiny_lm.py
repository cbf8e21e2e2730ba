"""Train the tiny character-level LM: `python -m train.tiny_lm [--config NAME] [--set TABLE.FIELD=VALUE ...]`.

The default is nanoGPT's CPU "baby" Shakespeare run (configs/shakespeare_char_baby.toml). A directory
that already holds a run is never replaced without --overwrite (--resume continues it); Ctrl-C or
SIGTERM stops where nothing is lost and exits 130, and --resume also finishes a run stopped during its
final save or sample. The run prints its resolved config and runtime (kernels and devices, with the
reason for each "auto"), a progress bar with loss and tokens/s, the evaluations, and at the end the
final val loss, speed, peak memory and a sample; it writes config.json, metrics.jsonl, loss.png,
result.json and checkpoints (latest and best) under train.out_dir, and keeps its compiled programs.

Where the work is done: train.run (the run: experiment, loop, steps, runtime, resume, finish), train.data
(its corpus and batches), train.checkpoints (the checkpoint store and its meta).
"""

from __future__ import annotations

import argparse
import json

from train import kept_programs
from train.checkpoints import init_from
from train.checkpoints.store import CheckpointError
from train.cli import ArgumentParser, Stopped, UsageError, guard
from train.config import DEFAULT_CONFIG, load_config
from train.data.errors import DataError
from train.run import distributed
from train.run import runtime as runtime_lib
from train.run.experiment import run_experiment
from train.run.loop import Interrupted, TrainingDiverged
from train.run.metrics import RunResult, describe_memory
from train.run.rundir import RESUME_OR_OVERWRITE, RunDirectoryError

PROGRAM = "python -m train.tiny_lm"
RUNTIME_ERRORS = (DataError, CheckpointError, RunDirectoryError, TrainingDiverged, distributed.DistributedError)


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="configs/NAME.toml or a path")
    parser.add_argument("--set", nargs="+", action="extend", default=[], metavar="TABLE.FIELD=VALUE",
                        help="overrides, e.g. model.positions=rope train.max_iters=500 runtime.matmul=xla "
                             "(may be repeated; applied in order). An inline table is merged into the config's: "
                             "\"model.moe={aux_loss_coef = 0}\" keeps its other keys, as does "
                             "model.moe.aux_loss_coef=0; model.moe=none first drops it")
    parser.add_argument("--data", help="the text file to train on (= train.data_path)")
    parser.add_argument("--init-from", metavar="hf:DIR|gguf:FILE", help="= train.init_from: fine-tune a checkpoint "
                        "(its model and tokenizer); --set lora.rank=16 trains adapters only (docs/finetuning.md)")
    parser.add_argument("--out-dir", help="= train.out_dir")
    parser.add_argument("--target-loss", type=float, metavar="LOSS",
                        help="= train.target_loss: the final line says when the val loss first reached it")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir's latest checkpoint")
    parser.add_argument("--overwrite", action="store_true", help="replace the run already in out_dir")
    parser.add_argument("--loss-plot", help="where to write the loss curve PNG (default out_dir/loss.png)")
    parser.add_argument("--quiet", action="store_true")
    kept_programs.add_flag(parser)
    mesh = parser.add_argument_group("devices and processes (docs/meshes.md)")
    mesh.add_argument("--mesh", help="= runtime.mesh, e.g. data:2,fsdp:2,tensor:2 (product = device count)")
    mesh.add_argument("--cpu-devices", type=int, metavar="N", help="= runtime.cpu_devices: N host devices on a CPU")
    mesh.add_argument("--coordinator", metavar="HOST:PORT", help="join a multi-process run (process 0 serves it)")
    mesh.add_argument("--num-processes", type=int, default=1, metavar="N")
    mesh.add_argument("--process-id", type=int, default=0, metavar="I")
    mesh.add_argument("--join-timeout", type=int, default=distributed.JOIN_TIMEOUT_S, metavar="SECONDS",
                      help="give up joining the other processes after this long (default %(default)s)")
    return parser


def overrides(args: argparse.Namespace) -> list[str]:
    """`--set` items plus the flags that are shorthands for config fields."""
    extra = [f"train.data_path={json.dumps(args.data)}"] if args.data is not None else []  # "" is refused, not ignored
    extra += [f"train.out_dir={json.dumps(args.out_dir)}"] if args.out_dir is not None else []
    extra += [f"train.init_from={json.dumps(args.init_from)}"] if args.init_from is not None else []
    extra += [f"runtime.mesh={json.dumps(args.mesh)}"] if args.mesh is not None else []
    extra += [f"train.target_loss={args.target_loss}"] if args.target_loss is not None else []
    extra += [f"runtime.cpu_devices={args.cpu_devices}"] if args.cpu_devices is not None else []
    return list(args.set) + extra


def cluster(args: argparse.Namespace) -> distributed.Cluster | None:
    """The processes to join (None: this process alone); ValueError for inconsistent flags."""
    if args.coordinator is None:
        if args.num_processes != 1 or args.process_id != 0:
            raise ValueError("--num-processes and --process-id need --coordinator HOST:PORT")
        return None
    return distributed.Cluster(args.coordinator, args.num_processes, args.process_id, args.join_timeout)


def run(argv: list[str] | None) -> RunResult:
    """The program: parse, join the other processes, start JAX, train, print the final line."""
    args = build_parser().parse_args(argv)
    if args.resume and args.overwrite:
        raise UsageError(RESUME_OR_OVERWRITE)
    kept = kept_programs.KeptPrograms(args)  # before anything compiles
    try:
        config, processes = load_config(args.config, overrides(args)), cluster(args)
        config = init_from.with_checkpoint_model(config, overrides(args))  # before JAX starts: kernels for it
    except CheckpointError:  # a checkpoint that cannot be read: a runtime error
        raise
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise UsageError(str(err)) from err
    if processes is not None:  # before anything starts JAX; every process must agree on these settings
        distributed.join(processes, {**config.to_dict(), "--resume": args.resume, "--overwrite": args.overwrite})
    try:
        runtime = runtime_lib.start(config.runtime, config.train.batch_size, model=config.model,
                                    num_processes=args.num_processes, block_size=config.train.block_size)
    except (ValueError, TypeError) as err:
        raise UsageError(str(err)) from err
    try:
        result = run_experiment(config, runtime=runtime, resume=args.resume, overwrite=args.overwrite, quiet=args.quiet,
                                loss_plot=args.loss_plot)
    except Interrupted as stop:
        raise Stopped(str(stop)) from None
    if distributed.is_main():
        print(final_line(result))
        kept.report(quiet=args.quiet)
    if result.stopped:
        raise Stopped(result.stopped)
    return result


def final_line(result: RunResult) -> str:
    """"final: val loss <loss> at iter <n> | <speed> tokens/s median (...) | compile ... | peak memory ..."."""
    speed = ("speed not measured" if result.median_ms_per_iter is None else
             f"{result.median_tokens_per_s:,.0f} tokens/s median ({result.median_ms_per_iter:.1f} ms/iter, "
             f"excluding compile; {result.input_wait_s:.2f}s waiting for input)")
    return (f"final: val loss {result.final_val_loss:.4f} at iter {result.steps} | {speed} | "
            f"compile {result.compile_s:.1f}s | wall {result.wall_s:.1f}s | " + describe_memory(result.figures())
            + target_part(result))


def target_part(result: RunResult) -> str:
    """" | val loss 1.8857 first reached at iter 750 after 21.3s of training" (with --target-loss)."""
    if result.target_loss is None:
        return ""
    hit = result.target_reached
    if hit is None:
        return f" | val loss {result.target_loss:.4f} not reached in {result.steps} iters"
    if hit.get("train_seconds") is None:  # metrics written before evaluations carried the seconds
        return f" | val loss {result.target_loss:.4f} first reached at iter {hit['step']}"
    return (f" | val loss {result.target_loss:.4f} first reached at iter {hit['step']} after "
            f"{hit['train_seconds']:.1f}s of training (compile and evaluation excluded)")


def main(argv: list[str] | None = None) -> RunResult:
    """Trains and returns the run's figures; on any failure one line and exit 1, 2 or 130 (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=RUNTIME_ERRORS)


if __name__ == "__main__":
    main()
