"""A training run: one `Run` owns the state, the metrics file, the progress bar and the checkpoints.

`train(config)` reads the corpus, resolves the runtime (kernels, devices),
compiles the programs of `train.steps` ahead of time, then dispatches chunks
of `steps_per_dispatch` optimizer steps, reading each chunk's losses while the
next one runs, and evaluates (and checkpoints) every `eval_interval` steps.
At the end it samples through the KV cache, plots the losses and writes
`result.json` beside `metrics.jsonl`, `config.json` and `checkpoints/`.
"""

from __future__ import annotations

import dataclasses
import json
import math
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.decoding import generate_windowed
from jaxattn.model import count_params
from train import data as data_lib
from train import runtime as runtime_lib
from train.checkpoint import Checkpointer, CheckpointError, check_compatible
from train.config import ExperimentConfig, TrainConfig
from train.plots import plot_losses
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
    num_params: int
    sample: str
    out_dir: str
    config: ExperimentConfig = dataclasses.field(repr=False, default=None)  # resolved
    params: Any = dataclasses.field(repr=False, default=None)  # the final parameters

    def figures(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self) if f.name not in ("config", "params")}


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


class MetricsLog:
    """`metrics.jsonl`: the mean loss of each log interval, and each evaluation."""

    def __init__(self, path: Path, log_interval: int, *, fresh: bool):
        self.path, self.log_interval, self._interval = path, log_interval, []
        if fresh and path.exists():
            path.unlink()

    def _append(self, record: dict) -> None:
        with open(self.path, "a") as f:
            f.write(json.dumps(record) + "\n")

    def add_steps(self, first_step: int, losses: np.ndarray, lrs: np.ndarray, last_step: int) -> None:
        for i, loss in enumerate(losses):  # step first_step + i + 1 has just finished
            step = first_step + i + 1
            self._interval.append(float(loss))
            if step % self.log_interval == 0 or step == last_step:
                self._append({"step": step, "loss": float(np.mean(self._interval)), "lr": float(lrs[i])})
                self._interval.clear()

    def add_eval(self, step: int, losses: dict) -> None:
        self._append({"step": step, "train_loss": losses["train"], "val_loss": losses["val"]})

    def records(self) -> list[dict]:
        return [json.loads(line) for line in self.path.read_text().splitlines()]


class Throughput:
    """Seconds per optimizer step of each dispatch; evaluation and checkpoint time left out."""

    def __init__(self, tokens_per_step: int):
        self.tokens_per_step, self.laps, self.tick = tokens_per_step, [], time.perf_counter()

    def restart(self) -> None:
        self.tick = time.perf_counter()

    def lap(self, steps: int) -> None:
        now = time.perf_counter()
        self.laps.append((now - self.tick) / steps)
        self.tick = now

    def step_seconds(self) -> list[float]:
        return self.laps[1:] or self.laps  # the first dispatch warms up

    def recent_tokens_per_s(self) -> float:
        return self.tokens_per_step / statistics.median(self.laps[-20:])


class Run:
    """One training run from its current step to `max_iters`."""

    def __init__(self, config: ExperimentConfig, runtime: runtime_lib.Runtime, corpus: data_lib.Corpus, *,
                 resume: bool, quiet: bool, after_eval: Callable[[int], None] | None):
        self.config, self.runtime, self.corpus, self.after_eval = config, runtime, corpus, after_eval
        tc = config.train
        self.out, self.quiet = Path(tc.out_dir), quiet
        self.log = (lambda *a: None) if quiet else partial(print, flush=True)
        self.programs = build_programs(config, runtime)
        self.train_data, self.val_data = self.programs.place((jnp.asarray(corpus.train), jnp.asarray(corpus.val)))
        self.state = self.programs.place(self.programs.init(tc.seed))
        self.checkpoints = Checkpointer(self.out) if tc.checkpoint or resume else None
        self.best_val, self.last_eval = math.inf, None
        if resume:
            self._resume()
        self.start_step = int(self.state["step"])
        self.metrics = MetricsLog(self.out / "metrics.jsonl", tc.log_interval, fresh=not resume)
        self.throughput = Throughput(tc.batch_size * tc.block_size)
        self.bar = _progress_bar(tc.max_iters, self.start_step, quiet)

    def _resume(self) -> None:
        if self.checkpoints.latest_step() is None:
            raise CheckpointError(f"--resume: no checkpoint in {self.checkpoints.root / 'latest'}")
        self.state, meta = self.checkpoints.restore("latest", jax.eval_shape(lambda: self.state))
        for warning in check_compatible(meta, self.config):
            self.log(f"warning: resumed run differs from the checkpoint ({warning}); it will not replay exactly")
        self.log(f"resumed from step {meta['step']} (val loss {meta['val_loss']})")
        self.best_val = math.inf if meta.get("best_val_loss") is None else meta["best_val_loss"]

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
        if self._due_for_eval(self.start_step):
            self.evaluate(self.start_step)
        pending = None  # (first step, outputs) of the chunk in flight
        for first, last in chunks(self.start_step, tc.max_iters, tc):
            self.state, outputs = self.compiled[last - first](self.state, self.train_data)
            if pending is not None:
                self.record(*pending)
            pending = (first, outputs)
            if self._due_for_eval(last):
                self.record(*pending)
                pending = None
                self.evaluate(last)
        if pending is not None:
            self.record(*pending)
        self.bar.close()
        if self.checkpoints is not None:
            self.checkpoints.close()

    def record(self, first_step: int, outputs) -> None:
        """Waits for a chunk's (losses, lrs), then logs them and advances the bar."""
        losses, lrs = (np.asarray(x) for x in outputs)
        self.throughput.lap(len(losses))
        self.metrics.add_steps(first_step, losses, lrs, self.config.train.max_iters)
        self.bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{self.throughput.recent_tokens_per_s():,.0f}")
        self.bar.update(len(losses))

    def evaluate(self, step: int) -> None:
        """Losses on the fixed eval batches; checkpoints (latest, and best by val loss) after the first."""
        losses = {k: float(v) for k, v in self.evaluate_program(self.state["params"], self.train_data,
                                                                self.val_data).items()}
        self.metrics.add_eval(step, losses)
        if not self.quiet:
            self.bar.write(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        improved = losses["val"] < self.best_val
        self.best_val = min(self.best_val, losses["val"])
        if self.checkpoints is not None and step > self.start_step:
            saved = dict(config=self.config, tokenizer=self.corpus.tokenizer, val_loss=losses["val"],
                         best_val_loss=self.best_val)
            self.checkpoints.save("latest", step, self.state, **saved)
            if improved:
                self.checkpoints.save("best", step, self.state, **saved)
        self.last_eval = losses
        if self.after_eval is not None:
            self.after_eval(step)
        self.throughput.restart()  # evaluation and checkpoints stay out of the rate

    def sample(self) -> tuple[str, str]:
        """(text, how) of the end-of-run sample: the prompt continued through the KV cache."""
        tc, tokenizer = self.config.train, self.corpus.tokenizer
        prompt = tokenizer.encode(tc.sample_prompt)
        ids = generate_windowed(self.state["params"], self.config.model, prompt, max_new_tokens=tc.sample_tokens,
                                rng=jax.random.PRNGKey(tc.seed), temperature=tc.sample_temperature,
                                kernels=self.runtime.kernels)
        return tokenizer.decode(np.concatenate([prompt, ids[0]])), "jaxattn.generate_windowed, KV cache"


def _progress_bar(total: int, initial: int, quiet: bool):
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, unit="it", disable=quiet, dynamic_ncols=True, mininterval=0.5,
                file=sys.stdout)


def train(config: ExperimentConfig, *, runtime: runtime_lib.Runtime | None = None, resume: bool = False,
          quiet: bool = False, loss_plot: str | None = None, sample: bool = True,
          after_eval: Callable[[int], None] | None = None) -> RunResult:
    """Runs an experiment end to end and returns its figures.

    Args:
      runtime: the resolved runtime (default: `train.runtime.start(config.runtime, ...)` now).
      after_eval: called with the step after each evaluation, outside the timed steps
        (bench/train.py runs a baseline in turns with this run).
    """
    wall_start = time.perf_counter()
    tc = config.train
    corpus = data_lib.load_corpus(tc.data_path, tokenizer=tc.tokenizer, val_fraction=tc.val_fraction)
    data_lib.check_block_size(corpus, tc.block_size)
    runtime = runtime or runtime_lib.start(config.runtime, tc.batch_size)
    config = with_vocabulary(config, corpus.tokenizer).replace(runtime=runtime.config)
    log = (lambda *a: None) if quiet else partial(print, flush=True)
    for warning in runtime.warnings:
        print(f"warning: {warning}", file=sys.stderr)
    log(f"config {config.name} (data {corpus.path}, {len(corpus.train):,} train / {len(corpus.val):,} val tokens):")
    log(config.to_json())
    log("\n".join(runtime.describe()))
    run = Run(config, runtime, corpus, resume=resume, quiet=quiet, after_eval=after_eval)
    run.out.mkdir(parents=True, exist_ok=True)
    (run.out / "config.json").write_text(config.to_json())
    num_params = count_params(run.state["params"])
    log(f"parameters: {num_params:,}")
    compile_s = run.compile()
    run.train()
    text, how = run.sample() if sample and tc.sample_tokens > 0 else ("", "")
    if text:
        log(f"--- sample ({how}, temperature {tc.sample_temperature}) ---\n{text}\n---")
    if tc.plot:
        plot_losses(run.metrics.records(), Path(loss_plot) if loss_plot else run.out / "loss.png", title=config.name)
    step_seconds = run.throughput.step_seconds()
    median = statistics.median(step_seconds) if step_seconds else math.nan
    last = run.last_eval or {"train": math.nan, "val": math.nan}
    result = RunResult(
        final_val_loss=last["val"], final_train_loss=last["train"], best_val_loss=run.best_val,
        steps=tc.max_iters, median_tokens_per_s=tc.batch_size * tc.block_size / median,
        median_ms_per_iter=1e3 * median, fastest_ms_per_iter=1e3 * min(step_seconds, default=math.nan),
        compile_s=compile_s, wall_s=time.perf_counter() - wall_start, num_params=num_params, sample=text,
        out_dir=str(run.out), config=config, params=run.state["params"])
    (run.out / "result.json").write_text(json.dumps(result.figures(), indent=2))
    return result
