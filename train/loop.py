"""A training run: one `Run` owns the state, the metrics file, the progress bar and the checkpoints.

`train(config)` reads the corpus, resolves the runtime (kernels, devices),
compiles the programs of `train.steps` ahead of time, then dispatches chunks
of `steps_per_dispatch` optimizer steps, reading each chunk's losses while the
next one runs, and evaluates (and checkpoints) every `eval_interval` steps.
At the end it samples through the KV cache, plots the losses and writes
`result.json` beside `metrics.jsonl`, `config.json` and `checkpoints/`.

Nothing is lost and nothing is silent: the run directory is claimed and locked
before anything is written (`train.rundir`); a non-finite loss stops the run
before it is logged or saved (`TrainingDiverged`); SIGINT and SIGTERM stop it at
the next dispatch boundary with a checkpoint that `--resume` continues exactly
(`Interrupted`).
"""

from __future__ import annotations

import dataclasses
import json
import math
import signal
import statistics
import sys
import threading
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import numpy as np

from jaxattn import sharding
from jaxattn.decoding import generate_windowed
from jaxattn.model import count_params
from train import data as data_lib
from train import distributed
from train import runtime as runtime_lib
from train.checkpoint import Checkpointer, CheckpointError, check_compatible
from train.config import ExperimentConfig, TrainConfig
from train.metrics import MetricsLog, Throughput, peak_memory
from train.plots import plot_losses
from train.rundir import claim, repair_metrics
from train.steps import build_programs
from train.tokenizer import Tokenizer


@dataclasses.dataclass
class RunResult:
    final_val_loss: float
    final_train_loss: float
    best_val_loss: float
    steps: int
    median_tokens_per_s: float
    median_ms_per_iter: float
    fastest_ms_per_iter: float  # the fastest dispatch: the least disturbed by other processes
    compile_s: float
    wall_s: float
    peak_rss_gib: float  # the process's peak resident memory (the arrays, on a CPU)
    device_peak_gib: float | None  # an accelerator's peak bytes in use, where JAX reports it
    num_params: int
    sample: str
    out_dir: str
    config: ExperimentConfig = dataclasses.field(repr=False, default=None)  # resolved
    params: Any = dataclasses.field(repr=False, default=None)  # the final parameters

    def figures(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("config", "params")}


class TrainingDiverged(RuntimeError):
    """The loss became NaN or infinite; nothing from that point was logged or saved."""


class Interrupted(RuntimeError):
    """SIGINT or SIGTERM stopped the run; `step` is where `--resume` continues."""

    def __init__(self, message: str, step: int):
        super().__init__(message)
        self.step = step


class StopSignals:
    """While active, SIGINT and SIGTERM only ask the run to stop at its next dispatch boundary
    (only possible in the main thread; elsewhere signals keep their handlers)."""

    SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self):
        self.requested = None  # the signal's name once one arrived

    def __enter__(self) -> "StopSignals":
        self._previous = {}
        if threading.current_thread() is threading.main_thread():
            self._previous = {sig: signal.signal(sig, self._handle) for sig in self.SIGNALS}
        return self

    def _handle(self, signum, frame) -> None:
        self.requested = signal.Signals(signum).name

    def __exit__(self, *exc) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)


def with_vocabulary(config: ExperimentConfig, tokenizer: Tokenizer) -> ExperimentConfig:
    """The config with the model's vocabulary set from the tokenizer."""
    return config.replace(model=config.model.replace(vocab_size=tokenizer.vocab_size))


def chunks(start: int, stop: int, tc: TrainConfig):
    """Step ranges [a, b) of at most steps_per_dispatch that never cross an eval boundary."""
    step = start
    while step < stop:
        end = min(step + tc.steps_per_dispatch, (step // tc.eval_interval + 1) * tc.eval_interval, stop)
        yield step, end
        step = end


class Run:
    """One training run from its current step to `max_iters`."""

    def __init__(self, config: ExperimentConfig, runtime: runtime_lib.Runtime, corpus: data_lib.Corpus, *,
                 resume: bool, quiet: bool, after_eval: Callable[[int], None] | None):
        self.config, self.runtime, self.corpus, self.after_eval = config, runtime, corpus, after_eval
        tc = config.train
        self.out, self.main = Path(tc.out_dir), distributed.is_main()
        self.quiet = quiet or not self.main  # only process 0 prints and writes
        self.log = (lambda *a: None) if self.quiet else partial(print, flush=True)
        self.programs = build_programs(config, runtime)
        self.train_data, self.val_data = self.programs.place((np.asarray(corpus.train), np.asarray(corpus.val)))
        self.state = self.programs.init(tc.seed)  # created where it lives on the mesh
        self.checkpoints = Checkpointer(self.out) if tc.checkpoint or resume else None
        self.best_val, self.last_eval, interval = math.inf, None, []
        if resume:
            interval = self._resume()
        self.start_step = int(self.state["step"])
        self.metrics = MetricsLog(self.out / "metrics.jsonl", tc.log_interval, interval, write=self.main)
        self.throughput = Throughput(tc.batch_size * tc.block_size)
        self.signals = StopSignals()

    def _resume(self) -> list[float]:
        """Restores the newest valid checkpoint; returns the losses of its unfinished log interval."""
        if self.checkpoints.latest_step() is None:
            raise CheckpointError(f"--resume: no checkpoint in {self.checkpoints.root / 'latest'} (the run "
                                  "stopped before its first save): --overwrite starts it again")
        for warning in check_compatible(self.checkpoints.read_meta("latest"), self.config):  # before any array
            self.log(f"warning: resumed run differs from the checkpoint ({warning}); it will not replay exactly")
        warn = partial(print, file=sys.stderr) if self.main else (lambda *a: None)
        abstract = self.programs.layout.abstract(jax.eval_shape(lambda: self.state))  # this run's mesh
        self.state, meta = self.checkpoints.restore("latest", abstract,
                                                    on_skip=lambda message: warn(f"warning: {message}"))
        if meta["step"] >= self.config.train.max_iters:
            raise CheckpointError(f"--resume: the checkpoint is at step {meta['step']} and train.max_iters="
                                  f"{self.config.train.max_iters}: nothing to train (raise train.max_iters)")
        self.log(f"resumed from step {meta['step']} (val loss {meta['val_loss']})")
        self.best_val = math.inf if meta.get("best_val_loss") is None else meta["best_val_loss"]
        if self.main:
            repair_metrics(self.out / "metrics.jsonl", meta["step"],
                           evaluates_again=self._due_for_eval(meta["step"]))
        return meta.get("interval_losses", [])

    def compile(self) -> float:
        """Compiles every train-steps program the run needs, and the evaluation; returns seconds."""
        start, tc = time.perf_counter(), self.config.train
        sizes = sorted({b - a for a, b in chunks(self.start_step, tc.max_iters, tc)})
        self.compiled = {n: self.programs.train_steps.lower(self.state, self.train_data, n).compile() for n in sizes}
        self.evaluate_program = self.programs.evaluate.lower(
            self.state["params"], self.train_data, self.val_data).compile()
        self.log(f"compiled {sizes}-step train programs and eval in {time.perf_counter() - start:.1f}s")
        return time.perf_counter() - start

    def _due_for_eval(self, step: int) -> bool:
        return step % self.config.train.eval_interval == 0 or step == self.config.train.max_iters

    def train(self) -> None:
        """Dispatches every chunk, reading a chunk's losses while the next one runs."""
        tc = self.config.train
        self.bar = _progress_bar(tc.max_iters, self.start_step, self.quiet)
        with self.signals:
            if self._due_for_eval(self.start_step):
                self.evaluate(self.start_step)
            pending = None  # (first step, outputs) of the chunk in flight
            for first, last in chunks(self.start_step, tc.max_iters, tc):
                self.state, outputs = self.compiled[last - first](self.state, self.train_data)
                if pending is not None:
                    self.record(*pending)
                pending = (first, outputs)
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

    def record(self, first_step: int, outputs) -> None:
        """Waits for a chunk's (losses, lrs), then logs them and advances the bar."""
        losses, lrs = (np.asarray(x) for x in outputs)
        self.throughput.lap(len(losses))
        if not np.all(np.isfinite(losses)):
            bad = int(np.flatnonzero(~np.isfinite(losses))[0])
            self.diverged(f"the training loss is {losses[bad]} at step {first_step + bad + 1}")
        self.metrics.add_steps(first_step, losses, lrs, self.config.train.max_iters)
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
        losses = {k: float(v) for k, v in self.evaluate_program(self.state["params"], self.train_data,
                                                                self.val_data).items()}
        if not all(math.isfinite(v) for v in losses.values()):
            self.diverged(f"the evaluated losses are {losses} at step {step}")
        self.metrics.add_eval(step, losses)
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
        self.checkpoints.save(kind, step, self.state, config=self.config, tokenizer=self.corpus.tokenizer,
                              val_loss=val_loss, best_val_loss=self.best_val,
                              extra={"interval_losses": self.metrics.pending()})

    def stop(self, step: int) -> None:
        """After a stop signal: a checkpoint at `step` (unless one exists), then `Interrupted`."""
        self.bar.close()
        if self.checkpoints is None:
            raise Interrupted(f"{self.signals.requested} at step {step}: train.checkpoint is off, nothing was "
                              "saved", step)
        if step > self.start_step and self.checkpoints.latest_step() != step:
            self.save("latest", step, None)
        where = self.checkpoints.root / "latest" / str(self.checkpoints.latest_step())
        raise Interrupted(f"{self.signals.requested} at step {step}: saved {where}; --resume continues from "
                          "there", step)

    def sample(self) -> tuple[str, str]:
        """(text, how) of the end-of-run sample: the prompt continued through the KV cache."""
        tc, tokenizer = self.config.train, self.corpus.tokenizer
        prompt = tokenizer.encode(tc.sample_prompt)
        mesh = self.programs.layout.mesh
        ids = generate_windowed(self.state["params"], self.config.model, prompt, max_new_tokens=tc.sample_tokens,
                                rng=jax.random.PRNGKey(tc.seed), temperature=tc.sample_temperature,
                                kernels=self.runtime.kernels, mesh=mesh if mesh.size > 1 else None)
        on = f", on the {sharding.MeshShape.of(mesh)} mesh" if mesh.size > 1 else ""
        return tokenizer.decode(np.concatenate([prompt, ids[0]])), f"jaxattn.generate_windowed, KV cache{on}"

    def close(self) -> None:
        if self.checkpoints is not None:
            self.checkpoints.close()


def _progress_bar(total: int, initial: int, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="it", disable=quiet, dynamic_ncols=True, mininterval=0.5,
                file=sys.stdout)


def _check_sample_prompt(config: ExperimentConfig, tokenizer: Tokenizer) -> None:
    """DataError now, rather than after the whole run, when the sample prompt cannot be encoded."""
    if config.train.sample_tokens > 0:
        try:
            tokenizer.encode(config.train.sample_prompt)
        except ValueError as err:
            raise data_lib.DataError(f"train.sample_prompt cannot be encoded: {err}") from None


def train(config: ExperimentConfig, *, runtime: runtime_lib.Runtime | None = None, resume: bool = False,
          overwrite: bool = False, quiet: bool = False, loss_plot: str | None = None, sample: bool = True,
          after_eval: Callable[[int], None] | None = None) -> RunResult:
    """Runs an experiment end to end and returns its figures.

    Args:
      runtime: the resolved runtime (default: `train.runtime.start(config.runtime, ...)` now).
      resume: continue the run in `train.out_dir` from its newest valid checkpoint.
      overwrite: replace a run already in `train.out_dir` (else that is refused).
      after_eval: called with the step after each evaluation, outside the timed steps
        (bench/train.py runs a baseline in turns with this run).

    Raises:
      RunDirectoryError, DataError, CheckpointError, TrainingDiverged, Interrupted.
    """
    wall_start = time.perf_counter()
    tc = config.train
    corpus = data_lib.load_corpus(tc.data_path, tokenizer=tc.tokenizer, val_fraction=tc.val_fraction)
    data_lib.check_block_size(corpus, tc.block_size)
    _check_sample_prompt(config, corpus.tokenizer)
    runtime = runtime or runtime_lib.start(config.runtime, tc.batch_size, model=config.model)
    config = with_vocabulary(config, corpus.tokenizer).replace(runtime=runtime.config)
    main = distributed.is_main()
    log = (lambda *a: None) if quiet or not main else partial(print, flush=True)
    for warning in runtime.warnings if main else ():
        print(f"warning: {warning}", file=sys.stderr)
    log(f"config {config.name} (data {corpus.path}, {len(corpus.train):,} train / {len(corpus.val):,} val tokens):")
    log(config.to_json())
    log("\n".join(runtime.describe()))
    lock = _claim_on_main(Path(tc.out_dir), resume=resume, overwrite=overwrite)
    run = None
    try:
        run = Run(config, runtime, corpus, resume=resume, quiet=quiet, after_eval=after_eval)
        log("\n".join(describe_layout(run.programs.layout, run.state)))
        if main:  # only once the checkpoint has been accepted
            (run.out / "config.json").write_text(config.to_json())
        log(f"parameters: {count_params(run.state['params']):,}")
        compile_s = run.compile()
        run.train()
        return _finish(run, compile_s, wall_start, sample=sample, loss_plot=loss_plot, log=log)
    finally:
        if run is not None:
            run.close()
        if lock is not None:
            lock.release()


def _claim_on_main(out_dir: Path, *, resume: bool, overwrite: bool):
    """Process 0 claims and locks the run directory (None elsewhere); every process learns whether it could."""
    if not distributed.is_main():
        distributed.agree(True, "claim the run directory")
        return None
    try:
        lock = claim(out_dir, resume=resume, overwrite=overwrite)
    except BaseException:
        distributed.agree(False, "claim the run directory")
        raise
    distributed.agree(True, "claim the run directory")
    return lock


def describe_layout(layout, state) -> list[str]:
    """What the mesh splits: one line, plus the logical axes left replicated."""
    shape = sharding.MeshShape.of(layout.mesh)
    if shape.size == 1:
        return []
    held = sharding.per_device_bytes((state["params"], state["opt_state"]))
    lines = [f"mesh {shape}: the batch split {shape.batch_ways} ways; parameters and optimizer state "
             f"{held / 2**20:.2f} MiB per device"]
    return lines + [f"  {note}" for note in layout.params.notes]


def _finish(run: Run, compile_s: float, wall_start: float, *, sample: bool, loss_plot, log) -> RunResult:
    """The end-of-run sample, loss plot and result.json."""
    config, tc = run.config, run.config.train
    text, how = run.sample() if sample and tc.sample_tokens > 0 else ("", "")
    if text:
        log(f"--- sample ({how}, temperature {tc.sample_temperature}) ---\n{text}\n---")
    if tc.plot and run.main:
        plot_losses(run.metrics.records(), Path(loss_plot) if loss_plot else run.out / "loss.png", title=config.name)
    step_seconds = run.throughput.step_seconds()
    median = statistics.median(step_seconds) if step_seconds else math.nan
    last = run.last_eval or {"train": math.nan, "val": math.nan}
    result = RunResult(
        final_val_loss=last["val"], final_train_loss=last["train"], best_val_loss=run.best_val,
        steps=tc.max_iters, median_tokens_per_s=tc.batch_size * tc.block_size / median,
        median_ms_per_iter=1e3 * median, fastest_ms_per_iter=1e3 * min(step_seconds, default=math.nan),
        compile_s=compile_s, wall_s=time.perf_counter() - wall_start, **peak_memory(),
        num_params=count_params(run.state["params"]), sample=text, out_dir=str(run.out), config=config,
        params=run.state["params"])
    if run.main:
        (run.out / "result.json").write_text(json.dumps(result.figures(), indent=2))
    return result
