"""An experiment end to end: `run_experiment(config)` prepares a run, trains it and finishes it.

It reads the corpus, resolves the runtime (kernels, devices) and claims the run directory, then a
`train.run.loop.Run` compiles the programs of `train.run.steps` ahead of time and runs its steps, evaluating
(and checkpointing) every `eval_interval` steps. At the end it samples through the KV cache, plots
the losses and writes `result.json` beside `metrics.jsonl`, `config.json` and `checkpoints/`
(`train.run.finish`). `--resume` restores through `train.run.resume`.

Nothing is lost and nothing is silent: the outputs are checked and the run directory is claimed and
locked before anything is written (`train.outputs`, `train.run.rundir`); a non-finite loss stops the run
before it is logged or saved (`TrainingDiverged`). From the claim to the end, SIGINT and SIGTERM only
ask the run to stop, and it does so at the next safe point with what was done kept (`Interrupted`):
after compiling (nothing trained, nothing written), at the next dispatch boundary (a checkpoint that
`--resume` continues exactly), or between windows of the end-of-run sample (the partial sample
printed, the plot and `result.json` written). A resumed run whose checkpoint is at `max_iters`
(stopped or killed during its final save or sample) is finished: evaluated, sampled, plotted and its
`result.json` written.

This module sits above `train.run.loop` (the run's steps, evaluations and saves) and `train.run.finish` (its
end, which reads a `Run`): it is the one that needs both.
"""

from __future__ import annotations

import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax

from jaxattn import sharding
from jaxattn.axes import MeshShape
from train import outputs
from train.checkpoints import init_from
from train.cli import StopSignals
from train.config import ExperimentConfig
from train.data import corpus as data_lib
from train.data.tokenizer import Tokenizer
from train.run import distributed
from train.run import runtime as runtime_lib
from train.run.finish import check_sample_prompt, finish
from train.run.loop import Run
from train.run.metrics import RunResult, describe_adapters, describe_params
from train.run.rundir import claim_on_main


def with_vocabulary(config: ExperimentConfig, tokenizer: Tokenizer) -> ExperimentConfig:
    """The config with the model's vocabulary set from the tokenizer."""
    return config.replace(model=config.model.replace(vocab_size=tokenizer.vocab_size))


def run_experiment(config: ExperimentConfig, *, runtime: runtime_lib.Runtime | None = None, resume: bool = False,
                   overwrite: bool = False, quiet: bool = False, loss_plot: str | None = None, sample: bool = True,
                   after_eval: Callable[[int], None] | None = None) -> RunResult:
    """Runs an experiment end to end and returns its figures.

    Args:
      runtime: the resolved runtime (default: `train.run.runtime.start(config.runtime, ...)` now).
      resume: continue the run in `train.out_dir` from its newest valid checkpoint.
      overwrite: replace a run already in `train.out_dir` (else that is refused).
      loss_plot: where to write the loss curve (default `out_dir/loss.png`); checked first.
      after_eval: called with the step after each evaluation, outside the timed steps
        (bench/train.py runs a baseline in turns with this run).

    A stop signal during the end-of-run sample does not raise: the result says so in `stopped`.

    Raises:
      RunDirectoryError, DataError, CheckpointError, TrainingDiverged, Interrupted, UnwritablePath.
    """
    wall_start, tc = time.perf_counter(), config.train
    config, corpus, runtime, initial = _prepare(config, runtime, loss_plot, resume)
    main = distributed.is_main()  # asked once the runtime has started JAX
    log = (lambda *a: None) if quiet or not main else partial(print, flush=True)
    _print_setup(config, corpus, runtime, log)
    lock = claim_on_main(Path(tc.out_dir), resume=resume, overwrite=overwrite)
    run = None
    try:
        with StopSignals() as signals:  # from here a signal asks; the run stops where nothing is lost
            run = Run(config, runtime, corpus, resume=resume, quiet=quiet, after_eval=after_eval, signals=signals,
                      initial=initial)
            initial = None  # the checkpoint's host weights, placed by the run: not held twice
            log("\n".join(describe_layout(run.programs.layout, run.state)))
            whole = jax.eval_shape(lambda: run.model_params)  # shapes: a LoRA run's merged model is not made here
            log(describe_params(config.model, whole))
            if config.lora is not None:
                log(describe_adapters(run.state["params"], whole))
            compile_s = run.compile()
            if main:  # once the checkpoint is accepted and the programs compiled: the run begins here
                (run.out / "config.json").write_text(config.to_json())
            run.run_steps()
            return finish(run, compile_s, wall_start, sample=sample, loss_plot=loss_plot, log=log)
    finally:
        if run is not None:
            run.close()
        if lock is not None:
            lock.release()


def _prepare(config: ExperimentConfig, runtime: runtime_lib.Runtime | None, loss_plot: str | None, resume: bool
             ) -> tuple[ExperimentConfig, data_lib.Corpus, runtime_lib.Runtime, init_from.Initial | None]:
    """Before anything is written: the outputs checked, the checkpoint a fine-tuning run starts from read
    (`train.init_from`), the corpus read (a prepared one verified: in full, or quickly when resuming),
    the runtime resolved (unless given). Returns the config completed with the vocabulary (or the
    checkpoint's model) and the runtime, the corpus, the runtime, the checkpoint (None from scratch)."""
    tc = config.train
    if loss_plot is not None:
        outputs.check_image_file(loss_plot, "--loss-plot")
    initial = None if tc.init_from is None else init_from.load(tc.init_from)
    if data_lib.is_chat_file(tc.data_path):
        if initial is None:
            raise data_lib.DataError(f"{tc.data_path}: chat data fine-tunes a checkpoint: set train.init_from "
                                     "(hf:DIR or gguf:FILE), whose chat template and tokenizer render it")
        corpus = data_lib.open_chat_corpus(tc.data_path, initial.tokenizer, initial.chat_template,
                                           block_size=tc.block_size, val_fraction=tc.val_fraction,
                                           train_on=tc.train_on, seed=tc.seed, long_chats=tc.long_chats)
    else:
        corpus = data_lib.open_corpus(tc.data_path, tokenizer=tc.tokenizer if initial is None else initial.tokenizer,
                                      val_fraction=tc.val_fraction, verify=data_lib.verify_mode(resume))
    data_lib.check_block_size(corpus, tc.block_size)
    if initial is None:
        config = with_vocabulary(config, corpus.tokenizer)
    else:
        config = init_from.with_base_model(config, initial)
    check_sample_prompt(config, corpus.tokenizer)
    runtime = runtime or runtime_lib.start(config.runtime, tc.batch_size, model=config.model, block_size=tc.block_size)
    return config.replace(runtime=runtime.config), corpus, runtime, initial


def _print_setup(config: ExperimentConfig, corpus: data_lib.Corpus, runtime: runtime_lib.Runtime,
                 log: Callable[[str], None]) -> None:
    """The warnings (process 0, even when quiet), then the resolved config and runtime."""
    if distributed.is_main():
        for warning in (*runtime.warnings, *corpus.warnings, *data_lib.unused_settings(corpus, config.train)):
            print(f"warning: {warning}", file=sys.stderr)
    log(f"config {config.name} (data {data_lib.describe(corpus)}):")
    log(config.to_json())
    log("\n".join(runtime.describe()))


def describe_layout(layout, state) -> list[str]:
    """What the mesh splits: one line, plus the logical axes left replicated."""
    shape = MeshShape.of(layout.mesh)
    if shape.size == 1:
        return []
    held = sharding.per_device_bytes((state["params"], state["opt_state"]))
    lines = [f"mesh {shape}: the batch split {shape.batch_ways} ways; parameters and optimizer state "
             f"{held / 2**20:.2f} MiB per device"]
    return lines + [f"  {note}" for note in layout.params.notes]
