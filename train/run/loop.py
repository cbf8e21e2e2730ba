"""A training run's loop: one `Run` owns the state, the metrics file, the progress bar and the checkpoints.

A `Run` is restored (when resumed, through `train.run.resume`), compiles the programs of `train.run.steps`
ahead of time, then (`Run.run_steps`) dispatches chunks of `steps_per_dispatch` optimizer steps,
reading each chunk's losses while the next one runs, and evaluates (and checkpoints) every
`eval_interval` steps. What is around a run is elsewhere: its setup (the corpus, the runtime, the
run directory) in `train.run.experiment`, its end (the sample, the loss plot, result.json) in `train.run.finish`.

Nothing is lost and nothing is silent: a non-finite loss stops the run before it is logged or saved
(`TrainingDiverged`). A stop signal (`train.cli.StopSignals`) only asks the run to stop, and it does
so at the next safe point with what was done kept (`Interrupted`): after compiling (nothing trained,
nothing written) or at the next dispatch boundary (a checkpoint that `--resume` continues exactly).
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import sys
import time
from functools import partial
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from train.checkpoints import init_from
from train.checkpoints.init_from import Initial
from train.checkpoints.store import Checkpointer
from train.cli import StopSignals
from train.config import ExperimentConfig, TrainConfig
from train.data import corpus as data_lib
from train.data.batches import Feed, RunBatches
from train.data.packed_batches import PackedBatches
from train.run import crash_points, distributed
from train.run.collective_watch import watch_for
from train.run import runtime as runtime_lib
from train.run.host_memory import release_freed_memory
from train.run.metrics import MetricsLog, Throughput
from train.run.resume import resume_from_checkpoint
from train.run.rundir import repair_metrics
from train.run.steps import build_programs


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; nothing from that point was logged or saved."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run; `step` is where `--resume` continues."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


def chunks(start: int, stop: int, tc: TrainConfig):
    """Step ranges [a, b) of at most steps_per_dispatch that never cross an eval boundary."""
    step = start
    while step < stop:
        end = min(step + tc.steps_per_dispatch, (step // tc.eval_interval + 1) * tc.eval_interval, stop)
        yield step, end
        step = end


class Run:
    """One training run from its current step to `max_iters`: restored (when resumed), compiled, then
    trained chunk by chunk, its losses recorded, evaluated and checkpointed."""

    def __init__(self, config: ExperimentConfig, runtime: runtime_lib.Runtime, corpus: data_lib.Corpus, *,
                 resume: bool, quiet: bool, after_eval: Callable[[int], None] | None, signals: "StopSignals",
                 initial: Initial | None = None):
        self.config, self.runtime, self.corpus, self.after_eval = config, runtime, corpus, after_eval
        self.initial = initial  # the checkpoint a fine-tuning run starts from (train.init_from); its weights go below
        tc = config.train
        self.out, self.main, self.signals = Path(tc.out_dir), distributed.is_main(), signals
        self.quiet = quiet or not self.main  # only process 0 prints and writes
        self.log = (lambda *a: None) if self.quiet else partial(print, flush=True)
        self.warn = partial(print, file=sys.stderr, flush=True) if self.main else (lambda *a: None)  # even --quiet
        self.feed: Feed | None = None  # reads the training batches ahead, from compile() on
        self.batches: RunBatches | None = None
        self.checkpoints: Checkpointer | None = None
        try:  # what is opened here is closed here if the run cannot start (`close` otherwise)
            self.programs = build_programs(config, runtime, initial)
            if initial is not None:  # placed by the programs: its source and sha256 are what the run keeps
                self.initial = dataclasses.replace(initial, params=None)
            batches = PackedBatches if corpus.packed else RunBatches
            self.batches = batches(corpus.train, corpus.val, tc, self.programs.layout.windows, self.programs.eval_rows)
            self.state = self.programs.init(tc.seed)  # created where it lives on the mesh
            self.checkpoints = Checkpointer(self.out) if tc.checkpoint or resume else None
            self.best_val, self.last_eval, meta = math.inf, None, {}
            if resume:
                meta = self._resume()
        except BaseException:
            self.close()
            raise
        self.start_step = int(self.state["step"])
        # On several host devices: one error line before XLA's collective timeout aborts the process.
        self.watch = watch_for(runtime.mesh_shape.size, runtime.platform.is_cpu)
        self.metrics = MetricsLog.resumed(self.out / "metrics.jsonl", tc.log_interval, meta, write=self.main)
        self.throughput = Throughput(tc.batch_size * tc.block_size, meta.get("step_seconds", []),
                                     meta.get("train_seconds", 0.0))

    def _resume(self) -> dict:
        """Restores the newest valid checkpoint that matches this run, onto its mesh; returns its meta."""
        abstract = self.programs.layout.abstract(jax.eval_shape(lambda: self.state))  # this run's mesh
        self.state, meta = resume_from_checkpoint(self.checkpoints, abstract, self.config, self.corpus,
                                                  log=self.log, warn=self.warn, initial=self.initial)
        self.best_val = math.inf if meta.get("best_val_loss") is None else meta["best_val_loss"]
        if self.main:
            repair_metrics(self.out / "metrics.jsonl", meta["step"],
                           evaluates_again=self._due_for_eval(meta["step"]))
        return meta

    def compile(self) -> float:
        """Compiles every train-steps program the run needs, and the evaluation, while the first
        batches are read; returns seconds."""
        start, tc = time.perf_counter(), self.config.train
        self.feed = Feed(self.batches.train_chunk, chunks(self.start_step, tc.max_iters, tc))
        sizes, inputs = sorted({b - a for a, b in chunks(self.start_step, tc.max_iters, tc)}), self.programs.inputs
        frozen, packed = self.programs.frozen, self.batches.packed
        self.compiled = {n: self.programs.train_steps.lower(self.state, self.programs.train_inputs(
            n, tc.batch_size, packed), frozen).compile() for n in sizes}
        self.evaluators = {shape: self.programs.evaluate.lower(self.state["params"], *inputs(*shape, packed),
                                                               frozen).compile()
                           for shape in self.batches.eval_shapes()}
        self.log(f"compiled {sizes}-step train programs and eval in {time.perf_counter() - start:.1f}s")
        release_freed_memory()  # the compiler's freed heap: not resident through training
        if self.signals.requested:
            self._stop_before_training()
        return time.perf_counter() - start

    def _stop_before_training(self) -> None:
        """`Interrupted` for a signal that came before the first step: nothing new was done."""
        latest = None if self.checkpoints is None else self.checkpoints.latest_step()
        if latest is None:
            raise Interrupted(f"{self.signals.requested} before training began: nothing was trained or written; "
                              "run the same command again", self.start_step)
        raise Interrupted(f"{self.signals.requested} before training went on: the run stays at step "
                          f"{self.start_step} ({self.checkpoints.root / 'latest' / str(latest)}); --resume "
                          "continues from there", self.start_step)

    def _due_for_eval(self, step: int) -> bool:
        return step % self.config.train.eval_interval == 0 or step == self.config.train.max_iters

    def run_steps(self) -> None:
        """Runs the steps from `start_step` to `max_iters`: dispatches every chunk, reading a chunk's
        losses while the next one runs, and evaluates (and checkpoints) when due; a stop signal stops
        it at the next dispatch boundary (`stop`)."""
        tc = self.config.train
        self.bar = _progress_bar(tc.max_iters, self.start_step, self.quiet)
        if self._due_for_eval(self.start_step):
            self.evaluate(self.start_step)
        pending = None  # (first step, chunk outputs) of the chunk in flight
        for first, last in chunks(self.start_step, tc.max_iters, tc):
            self.state, chunk_outputs = self.compiled[last - first](self.state, self.feed.next(), self.programs.frozen)
            crash_points.kill_if_planned("step", *range(first + 1, last + 1))
            if pending is not None:
                self.record(*pending)
            pending = (first, chunk_outputs)
            if self._due_for_eval(last) or self.signals.requested:
                self.record(*pending)
                pending = None
                if self._due_for_eval(last):
                    self.evaluate(last)
                if self.signals.requested:
                    self.stop(last)
        if pending is not None:
            self.record(*pending)
        self.bar.close()

    @property
    def model_params(self):
        """The model's whole params now (a LoRA run's adapters merged into its frozen base)."""
        return self.programs.model_params(self.state["params"])

    @property
    def input_wait_s(self) -> float:
        """Seconds the steps waited for their batches (this process; 0 before training)."""
        return 0.0 if self.feed is None else self.feed.waited

    def record(self, first_step: int, outputs) -> None:
        """Waits for a chunk's (losses, lrs, the layers' sown losses), then logs them and advances the bar."""
        with self.watch.waiting() if self.watch is not None else contextlib.nullcontext():
            losses, lrs, layer_losses = jax.device_get(outputs)
        self.throughput.lap(len(losses))
        if not np.all(np.isfinite(losses)):
            bad = int(np.flatnonzero(~np.isfinite(losses))[0])
            self.diverged(f"the training loss is {losses[bad]} at step {first_step + bad + 1}")
        self.metrics.add_steps(first_step, losses, lrs, self.config.train.max_iters, layer_losses)
        self.bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{self.throughput.recent_tokens_per_s():,.0f}")
        self.bar.update(len(losses))

    def diverged(self, what: str) -> None:
        last = None if self.checkpoints is None else self.checkpoints.latest_step()
        good = "no checkpoint was saved" if last is None else \
            f"the last good checkpoint is {self.checkpoints.root / 'latest' / str(last)}"
        raise TrainingDiverged(f"{what}: training stopped before logging or saving it; {good} "
                               "(a lower train.lr, or train.grad_clip, may help)")

    def evaluate(self, step: int) -> None:
        """Losses on the fixed eval batches; checkpoints (latest, and best by val loss) after the first."""
        params, frozen = self.state["params"], self.programs.frozen
        losses = self.batches.evaluate(lambda windows, weights: self.evaluators[weights.shape[:2]](
            params, windows, weights, frozen))
        crash_points.kill_if_planned("eval", step)
        if not all(math.isfinite(v) for v in losses.values()):
            self.diverged(f"the evaluated losses are {losses} at step {step}")
        self.metrics.add_eval(step, losses, self.throughput.seconds)
        if not self.quiet:
            self.bar.write(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        improved = losses["val"] < self.best_val
        self.best_val = min(self.best_val, losses["val"])
        if self.checkpoints is not None and step > self.start_step:
            self.save("latest", step, losses["val"])
            if improved:
                self.save("best", step, losses["val"])
        self.last_eval = losses
        if self.after_eval is not None:
            self.after_eval(step)
        self.throughput.restart()  # evaluation and checkpoints stay out of the rate

    def save(self, kind: str, step: int, val_loss: float | None) -> None:
        """Writes a checkpoint whole: a second stop signal takes effect once it is written."""
        with self.signals.deferred():
            self.checkpoints.save(kind, step, self.state, config=self.config, tokenizer=self.corpus.tokenizer,
                                  val_loss=val_loss, best_val_loss=self.best_val,
                                  extra={**self.metrics.pending_meta(), **init_from.meta_record(self.initial),
                                         "step_seconds": self.throughput.step_seconds(),
                                         "train_seconds": self.throughput.seconds})

    def stop(self, step: int) -> None:
        """After a stop signal: a checkpoint at `step` (unless one exists), then `Interrupted`."""
        self.bar.close()
        if self.checkpoints is None:
            raise Interrupted(f"{self.signals.requested} at step {step}: train.checkpoint is off, nothing was "
                              "saved", step)
        if step > self.start_step and self.checkpoints.latest_step() != step:
            self.save("latest", step, None)
        where = self.checkpoints.root / "latest" / str(self.checkpoints.latest_step())
        then = "finishes the run (sample, loss plot, result.json)" if step >= self.config.train.max_iters \
            else "continues from there"
        raise Interrupted(f"{self.signals.requested} at step {step}: saved {where}; --resume {then}", step)

    def close(self) -> None:
        """Stops the batch reader and closes the checkpoint managers (waiting for their threads), in
        that order, whatever was opened; idempotent."""
        for part in (self.feed, self.batches, self.checkpoints):
            if part is not None:
                part.close()


def _progress_bar(total: int, initial: int, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="it", disable=quiet, dynamic_ncols=True, mininterval=0.5,
                file=sys.stdout)
