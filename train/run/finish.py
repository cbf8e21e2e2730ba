"""The end of a trained run (a `train.run.loop.Run`): its sample through the KV cache (cut short by a stop
signal, if one comes), the loss plot, and its figures (`RunResult`, written as result.json)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Callable

import jax
import numpy as np

from jaxattn.axes import MeshShape
from jaxattn.model import count_params
from jaxattn.windowed import windows
from train.config import ExperimentConfig
from train.data.errors import DataError
from train.data.tokenizer import Tokenizer
from train.run.loop import Run
from train.run.metrics import RunResult, first_at_or_below, peak_memory, speeds
from train.run.plots import plot_losses


def check_sample_prompt(config: ExperimentConfig, tokenizer: Tokenizer) -> None:
    """DataError now, rather than after the whole run, when the sample prompt cannot be encoded."""
    if config.train.sample_tokens > 0:
        try:
            tokenizer.encode(config.train.sample_prompt)
        except ValueError as err:
            raise DataError(f"train.sample_prompt cannot be encoded: {err}") from None


def finish(run: Run, compile_s: float, wall_start: float, *, sample: bool, loss_plot: str | None,
           log: Callable[[str], None]) -> RunResult:
    """The end-of-run sample (unless `sample` is False), loss plot and result.json of a trained `run`."""
    tc, params = run.config.train, run.model_params  # a LoRA run's merged once
    text, how, stopped = "", "", None
    if sample and tc.sample_tokens > 0:
        log(f"sampling {tc.sample_tokens} tokens...")
        text, how, stopped = end_of_run_sample(run, params)
    if text:
        cut = ", stopped early" if stopped else ""
        log(f"--- sample ({how}, temperature {tc.sample_temperature}{cut}) ---\n{text}\n---")
    if tc.plot and run.main:
        plot_losses(run.metrics.records(), Path(loss_plot) if loss_plot else run.out / "loss.png",
                    title=plot_title(run.config))
    result = _result(run, params, text, stopped, compile_s, wall_start)
    if run.main:
        (run.out / "result.json").write_text(json.dumps(result.figures(), indent=2))
    return result


def plot_title(config) -> str:
    """The loss plot's title: the config's name, and for a fine-tuning run what it fine-tuned and how."""
    if config.train.init_from is None:
        return config.name
    how = "full fine-tune" if config.lora is None else f"LoRA (rank {config.lora.rank})"
    return f"{config.name}: {how} of {config.train.init_from}"


def end_of_run_sample(run: Run, params) -> tuple[str, str, str | None]:
    """(text, how, why it stopped early or None): the prompt continued through the KV cache by the model
    `params` (`run.model_params`), window by window, until done or a stop signal."""
    tc, tokenizer, signals = run.config.train, run.corpus.tokenizer, run.signals
    prompt = tokenizer.encode(tc.sample_prompt)
    mesh = run.programs.layout.mesh
    drawn = [chunk[0] for chunk in signals.until_requested(windows(
        params, run.config.model, prompt, max_new_tokens=tc.sample_tokens,
        rng=jax.random.PRNGKey(tc.seed), temperature=tc.sample_temperature, kernels=run.runtime.kernels,
        mesh=mesh if mesh.size > 1 else None))]
    done = sum(map(len, drawn))
    stopped = None if done == tc.sample_tokens else (
        f"{signals.requested} during the end-of-run sample, after {done} of {tc.sample_tokens} tokens: "
        "the run is trained and saved, its sample cut short")
    on = f", on the {MeshShape.of(mesh)} mesh" if mesh.size > 1 else ""
    text = tokenizer.decode(np.concatenate([prompt, *drawn]))
    return text, f"jaxattn.generate_windowed, KV cache{on}", stopped


def _result(run: Run, params, text: str, stopped: str | None, compile_s: float, wall_start: float) -> RunResult:
    tc = run.config.train
    last = run.last_eval or {"train": math.nan, "val": math.nan}
    reached = None if tc.target_loss is None or not run.main else first_at_or_below(run.metrics.records(),
                                                                                     tc.target_loss)
    return RunResult(
        final_val_loss=last["val"], final_train_loss=last["train"], best_val_loss=run.best_val,
        steps=tc.max_iters, **speeds(run.throughput.step_seconds(), tc.batch_size * tc.block_size),
        compile_s=compile_s, wall_s=time.perf_counter() - wall_start, train_seconds=run.throughput.seconds,
        target_loss=tc.target_loss, target_reached=reached, input_wait_s=run.input_wait_s, **peak_memory(),
        num_params=count_params(params), sample=text, out_dir=str(run.out), stopped=stopped,
        config=run.config, params=params)
