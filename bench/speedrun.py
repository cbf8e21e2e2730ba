"""The speedrun race against nanoGPT, the recipe's ablation, and a GPU race.

    PYTHONPATH=$PWD python bench/train.py --race [--rounds 3] [--nanogpt-python PY] [--nanogpt-threads N] [--data PATH]
    PYTHONPATH=$PWD python bench/train.py --ablation [--budget 15] [--rounds 1]
    PYTHONPATH=$PWD python3 bench/train.py --gpu-race [--rounds 1] [--max-iters N] [--data PATH]
    ... --quick: a smoke test of any of them (40 iters a run, one round, results in a temp dir)

Every run is a fresh process, one after the other (JAX started anew, no compilation cache), in
turns: each round runs every side once, the order rotated by one each round, so that the drift of
a shared machine falls on all sides alike. Our runs go through
`train.run.experiment.run_experiment(..., sample=False, quiet=True)` with the val loss over the whole
val split (`train.eval_whole_val=true`); our time to a loss is `train_seconds` (training time,
compile and evaluation excluded) at the first evaluation at or below it, so the eval interval sets
how finely it is seen.

--race: nanoGPT's CPU baby run (bench/nanogpt_baseline.py, torch with --nanogpt-threads threads,
  by default as many as the cores JAX uses; its time = its iters x its median ms/iter, its loss its
  own 20-batch estimate), configs/shakespeare_char_speedrun
  (its own eval_interval) and the default configs/shakespeare_char_baby (eval_interval=50 added), both
  with target 1.8857 (nanoGPT's val loss at 2000 iters). Writes bench/results/speedrun.json and .md.
--ablation: the speedrun config, then each switch of SWITCHES turned off (or, where the recipe does
  not use it, on: "not in the recipe"): val loss at a training-time budget, seconds to 1.8857, final
  val loss, ms/iter. Writes bench/results/ablation.json and .md.
--gpu-race: nanoGPT's GPU Shakespeare run (`--config gpu --device cuda --compile`: bfloat16
  autocast, torch.compile) against configs/shakespeare_char (the same model) and that model with the
  speedrun recipe's settings (`recipe_delta`): tokens/s and training seconds to nanoGPT's final val
  loss of the same round. Writes bench/results/speedrun_gpu.json and .md.
--max-iters N shortens every side alike (max_iters and lr_decay_iters, ours and nanoGPT's).
On a machine shared with other jobs, torch's idle threads spin on the cores their partners need:
OMP_WAIT_POLICY=PASSIVE, where set, is passed on to nanoGPT's port.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
import tempfile
from pathlib import Path
from typing import Callable

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, portable_command, write_results  # noqa: E402
from bench.timing import median, ratio  # noqa: E402
from train.config import DEFAULT_CONFIG, ExperimentConfig, TrainConfig, load_config  # noqa: E402
from train.run.metrics import first_at_or_below  # noqa: E402

TARGET = 1.8857  # nanoGPT's val loss after its 2000-iter baby run (bench/results/train.md)
SPEEDRUN = "shakespeare_char_speedrun"
GPU_CONFIG = "shakespeare_char"
RESULTS = ROOT / "bench" / "results"
NANOGPT_SCRIPT = ROOT / "bench" / "nanogpt_baseline.py"
NANOGPT = "nanoGPT"
RACE_OVERRIDES = ("train.eval_whole_val=true", f"train.target_loss={TARGET}")
DEFAULT_RACE_EVAL_INTERVAL = 50  # the default config evaluates every 250: too coarse to time a race
RUN_ONLY = ("train.checkpoint=false", "train.plot=false", "train.sample_tokens=0")  # never the maths
QUICK_ITERS = 40


# ----------------------------------------------------------------------------- what runs

@dataclasses.dataclass(frozen=True)
class Side:
    """One contestant: nanoGPT's port (config None) or one of our configs with its overrides."""

    name: str
    config: str | None = None
    overrides: tuple[str, ...] = ()


def turn_order(sides: list, round_index: int) -> list:
    """The order of round `round_index`: the sides rotated left by the round's number."""
    k = round_index % len(sides)
    return list(sides[k:]) + list(sides[:k])


def length_overrides(max_iters: int | None) -> tuple[str, ...]:
    """--max-iters for our side: the run and its schedule shortened alike."""
    return () if max_iters is None else (f"train.max_iters={max_iters}", f"train.lr_decay_iters={max_iters}")


def race_sides(speedrun: str = SPEEDRUN, extra: tuple[str, ...] = ()) -> list[Side]:
    return [Side(NANOGPT),
            Side("speedrun", speedrun, RACE_OVERRIDES + tuple(extra)),
            Side("default", DEFAULT_CONFIG,
                 RACE_OVERRIDES + (f"train.eval_interval={DEFAULT_RACE_EVAL_INTERVAL}",) + tuple(extra))]


@dataclasses.dataclass(frozen=True)
class Switch:
    """One ingredient of the recipe: how to tell it is in a config, and the overrides that turn it off / on."""

    name: str
    off_label: str
    in_recipe: Callable[[ExperimentConfig], bool]
    off: tuple[str, ...]
    on: tuple[str, ...]


SWITCHES = (
    Switch("Muon", "Muon -> AdamW", lambda c: c.train.optimizer == "muon",
           ('train.optimizer="adamw"',), ('train.optimizer="muon"',)),
    Switch("WSD schedule", "WSD -> cosine", lambda c: c.train.schedule == "wsd",
           ('train.schedule="cosine"',), ('train.schedule="wsd"',)),
    Switch("ReLU² MLP", "ReLU² -> GELU", lambda c: c.model.mlp == "relu2",
           ('model.mlp="gelu"',), ('model.mlp="relu2"',)),
    Switch("zero-init outputs", "zero-init off", lambda c: c.model.zero_init_out,
           ("model.zero_init_out=false",), ("model.zero_init_out=true",)),
    Switch("untied head", "untied -> tied head", lambda c: not c.model.tie_embeddings,
           ("model.tie_embeddings=true",), ("model.tie_embeddings=false",)),
    Switch("final-logit soft cap", "soft cap off", lambda c: c.model.final_logits_soft_cap is not None,
           ("model.final_logits_soft_cap=none",), ("model.final_logits_soft_cap=30.0",)),
    Switch("q/k norm", "q/k norm off", lambda c: c.model.qk_norm != "none",
           ('model.qk_norm="none"',), ('model.qk_norm="head"',)),
    Switch("value embeddings", "value embeddings off", lambda c: c.model.value_embeddings > 0,
           ("model.value_embeddings=0",), ("model.value_embeddings=2",)),
)


def adamw_lr(recipe: TrainConfig, default: TrainConfig) -> tuple[str, ...]:
    """What keeps AdamW sane once Muon is off: the default config's lr (nanoGPT's 1e-3) where the recipe's
    lr differs, min_lr kept at the recipe's fraction of it; nothing where the recipe's lr is the default's."""
    if recipe.lr == default.lr:
        return ()
    return (f"train.lr={default.lr!r}", f"train.min_lr={recipe.min_lr * default.lr / recipe.lr!r}")


def ablation_variants(recipe: ExperimentConfig, default: ExperimentConfig) -> list[dict]:
    """The recipe, then one variant per switch: off where the recipe uses it, else on ("not in the recipe")."""
    variants = [{"name": "recipe", "switch": None, "in_recipe": None, "change": "the speedrun config as it is",
                 "overrides": []}]
    for s in SWITCHES:
        used = bool(s.in_recipe(recipe))
        overrides = list(s.off if used else s.on)
        if used and s.name == "Muon":
            overrides += adamw_lr(recipe.train, default.train)
        variants.append({"name": s.off_label if used else f"+ {s.name}", "switch": s.name, "in_recipe": used,
                         "change": f"{s.name} off" if used else f"{s.name}: not in the recipe, tried on",
                         "overrides": overrides})
    return variants


# what the GPU race carries from the recipe onto nanoGPT's GPU model: what the speedrun config changes
# relative to the default, less the run's length and shapes and its bookkeeping
NOT_RECIPE_TRAIN = {"batch_size", "block_size", "max_iters", "lr_decay_iters", "eval_interval", "eval_iters",
                    "eval_whole_val", "target_loss", "log_interval", "steps_per_dispatch", "seed", "out_dir",
                    "checkpoint", "data_path", "tokenizer", "val_fraction", "sample_tokens",
                    "sample_temperature", "sample_prompt", "plot"}
NOT_RECIPE_MODEL = {"vocab_size", "d_model", "num_layers", "num_heads", "num_kv_heads", "head_dim", "mlp_hidden",
                    "max_seq_len", "dropout", "mla", "layer_pattern", "rope_scaling"}


def toml_value(value) -> str:
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, str):
        return json.dumps(value)
    return repr(value)


def recipe_delta(recipe: ExperimentConfig, default: ExperimentConfig, target: ExperimentConfig) -> list[str]:
    """Overrides that give `target` the recipe: each train/model field the recipe changes relative to
    `default` (NOT_RECIPE_* left out) that `target` does not already have."""
    out = []
    for table, skip in (("train", NOT_RECIPE_TRAIN), ("model", NOT_RECIPE_MODEL)):
        r, d, t = (getattr(c, table) for c in (recipe, default, target))
        for name in r.to_dict():  # the field names of a ModelConfig and of a TrainConfig alike
            value = getattr(r, name)
            if name in skip or value == getattr(d, name) or value == getattr(t, name):
                continue
            out.append(f"{table}.{name}={toml_value(value)}")
    return out


# ----------------------------------------------------------------------------- the figures

def loss_at_budget(evals: list[dict], budget: float) -> dict | None:
    """The last evaluation whose train_seconds is within `budget` (metrics.jsonl eval records)."""
    within = [e for e in evals if e.get("train_seconds") is not None and e["train_seconds"] <= budget]
    return within[-1] if within else None


def race_summary(runs: list[dict]) -> dict:
    """Per side: medians over rounds (`median_X` of each run's X; ms/iter and tokens/s keep their names);
    per side of ours: nanoGPT's median / its median, and the median of
    the per-round ratios (each run's `ratio`, set by `add_round_ratios`)."""
    sides = list(dict.fromkeys(r["side"] for r in runs))
    summary = {}
    for side in sides:
        mine = [r for r in runs if r["side"] == side and "error" not in r]
        summary[side] = {
            "runs": len([r for r in runs if r["side"] == side]),
            "reached": sum(r.get("seconds_to_target") is not None for r in mine),
            **{k if k.startswith("median_") else f"median_{k}": median(r.get(k) for r in mine)
               for k in ("seconds_to_target", "target_step", "final_val_loss", "median_ms_per_iter",
                         "median_tokens_per_s", "compile_s", "wall_s")},
        }
    theirs = summary.get(NANOGPT, {}).get("median_seconds_to_target")
    for side in sides:
        if side == NANOGPT:
            continue
        summary[side]["ratio_of_medians"] = ratio(theirs, summary[side]["median_seconds_to_target"])
        summary[side]["median_round_ratio"] = median(r.get("ratio") for r in runs if r["side"] == side)
    return summary


def add_round_ratios(runs: list[dict]) -> None:
    """Each of our runs' `ratio`: nanoGPT's seconds in the same round / its seconds (None if either is missing)."""
    theirs = {r["round"]: r.get("seconds_to_target") for r in runs if r["side"] == NANOGPT}
    for r in runs:
        if r["side"] != NANOGPT:
            r["ratio"] = ratio(theirs.get(r["round"]), r.get("seconds_to_target"))


def nanogpt_figures(record: dict) -> dict:
    """The port's JSON as a race record: its time to its own final loss = iters x median ms/iter."""
    return {"seconds_to_target": record["iters"] * record["median_ms_per_iter"] / 1e3,
            "target_step": record["iters"], "final_val_loss": record["final_val_loss"],
            "median_ms_per_iter": record["median_ms_per_iter"], "median_tokens_per_s": record["median_tokens_per_s"],
            "fastest_ms_per_iter": record["fastest_ms_per_iter"], "compile_s": None, "wall_s": record["wall_s"],
            "train_s": record.get("train_s"), "first_window_s": record.get("first_window_s"),
            "evals": record["evals"], "torch": record["env"]["torch"], "device": record.get("device", "cpu"),
            "impl": record["impl"]}


# ----------------------------------------------------------------------------- processes

def child_env(data: Path, threads: int | None = None) -> dict:
    """A fresh process's environment: the data file, no compilation cache (each run compiles anew), and
    for nanoGPT's port its torch threads (`fresh.environment`)."""
    return fresh.environment(threads, JAXATTN_SHAKESPEARE=str(data), JAX_ENABLE_COMPILATION_CACHE="false")


def run_ours(side: Side, data: Path, scratch: Path) -> dict:
    """One of our runs in a fresh process (`worker`); its figures, or {"error": why}."""
    out = Path(tempfile.mkdtemp(dir=scratch))
    spec = {"config": side.config, "overrides": list(side.overrides), "out_dir": str(out)}
    try:
        return fresh.run(fresh.function_argv("bench.speedrun:worker", spec), what=f"our run of {side.config}",
                         env=child_env(data)).json()
    except fresh.FreshProcessError as error:
        return {"error": str(error)}
    finally:
        shutil.rmtree(out, ignore_errors=True)


def run_nanogpt(python: str, data: Path, scratch: Path, args: list[str]) -> dict:
    """nanoGPT's port in a fresh process; its race figures, or {"error": why}."""
    path = Path(tempfile.mkdtemp(dir=scratch)) / "nanogpt.json"
    threads = int(args[args.index("--threads") + 1]) if "--threads" in args else None
    try:
        record = fresh.run([python, NANOGPT_SCRIPT, "--data", data, "--json", path, *args], what="nanoGPT's port",
                           env=child_env(data, threads)).json()
    except fresh.FreshProcessError as error:
        return {"error": str(error)}
    return nanogpt_figures(record)


def worker(spec: dict) -> dict:
    """In the fresh process: trains, and returns the figures and the eval records of metrics.jsonl."""
    import jax

    from bench.machine import describe_machine
    from train.run.experiment import run_experiment
    from train.run.loop import TrainingDiverged
    config = load_config(spec["config"], [*spec["overrides"], *RUN_ONLY, f"train.out_dir='{spec['out_dir']}'"])
    try:
        result = run_experiment(config, overwrite=True, quiet=True, sample=False)
    except TrainingDiverged as err:
        return {"error": f"diverged: {err}"[:300]}
    lines = (Path(result.out_dir) / "metrics.jsonl").read_text().splitlines()
    evals = [r for r in map(json.loads, lines) if "val_loss" in r]
    reached = result.target_reached or {}
    return {"config": config.name, "seconds_to_target": reached.get("train_seconds"),
            "target_step": reached.get("step"), "final_val_loss": result.final_val_loss,
            "median_ms_per_iter": result.median_ms_per_iter, "median_tokens_per_s": result.median_tokens_per_s,
            "fastest_ms_per_iter": result.fastest_ms_per_iter, "compile_s": result.compile_s,
            "wall_s": result.wall_s, "train_seconds": result.train_seconds, "steps": result.steps,
            "eval_interval": config.train.eval_interval, "params": result.num_params, "evals": evals,
            "env": {**describe_machine(), "device": jax.devices()[0].device_kind}}


def describe_sides(sides: list[Side]) -> dict:
    """Each side's config, overrides and eval interval (as run, and as its config file has it)."""
    out = {}
    for s in sides:
        out[s.name] = {"config": s.config, "overrides": list(s.overrides)}
        if s.config is not None:
            out[s.name].update(eval_interval=load_config(s.config, s.overrides).train.eval_interval,
                               config_eval_interval=load_config(s.config).train.eval_interval)
    return out


def play(sides: list[Side], rounds: int, run_side: Callable[[Side, int], dict]) -> list[dict]:
    """Every side once a round, in turns; each run's record with its round, turn and side."""
    runs = []
    for rnd in range(rounds):
        for turn, side in enumerate(turn_order(sides, rnd)):
            record = {"round": rnd + 1, "turn": turn + 1, "side": side.name, **run_side(side, rnd)}
            runs.append(record)
            print(json.dumps({k: v for k, v in record.items() if k not in ("evals", "env")}), flush=True)
    return runs


# ----------------------------------------------------------------------------- the three benchmarks

def play_with_nanogpt(args, data: Path, scratch: Path, sides: list[Side], nanogpt_args: list[str],
                      default_rounds: int) -> list[dict]:
    """`play` with nanoGPT's port as the side named NANOGPT (its run shortened by --max-iters too)."""
    if args.max_iters:
        nanogpt_args = [*nanogpt_args, "--max-iters", str(args.max_iters), "--lr-decay-iters", str(args.max_iters)]

    def run_side(side: Side, rnd: int) -> dict:
        if side.name == NANOGPT:
            return run_nanogpt(args.nanogpt_python, data, scratch, nanogpt_args)
        return run_ours(side, data, scratch)
    return play(sides, args.rounds or default_rounds, run_side)


def race(args, data: Path, scratch: Path) -> dict:
    extra = (*length_overrides(args.max_iters), *args.set)
    sides = race_sides(args.speedrun_config, extra)
    runs = play_with_nanogpt(args, data, scratch, sides, ["--threads", str(args.nanogpt_threads)], 3)
    add_round_ratios(runs)
    return {"kind": "race", "target_loss": TARGET, "rounds": args.rounds or 3,
            "sides": describe_sides(sides), "nanogpt_threads": args.nanogpt_threads, "threads": threads(args),
            "runs": runs, "summary": race_summary(runs)}


def threads(args) -> dict:
    """The cores our runs' JAX spreads over and nanoGPT's torch threads (the same by default: a fair race)."""
    return {"ours": cpu_cores(), "nanogpt": args.nanogpt_threads}


def ablation(args, data: Path, scratch: Path) -> dict:
    extra = (*length_overrides(args.max_iters), *args.set)
    recipe = load_config(args.speedrun_config, extra)
    variants = ablation_variants(recipe, load_config(DEFAULT_CONFIG))
    sides = [Side(v["name"], args.speedrun_config, RACE_OVERRIDES + tuple(v["overrides"]) + extra) for v in variants]
    for side in sides:
        load_config(side.config, side.overrides)  # a bad override fails now, not after an hour
    runs = play(sides, args.rounds or 1, lambda side, rnd: run_ours(side, data, scratch))
    for r in runs:
        r["at_budget"] = loss_at_budget(r.get("evals", []), args.budget)
    rows = []
    for v in variants:
        mine = [r for r in runs if r["side"] == v["name"] and "error" not in r]
        rows.append({**v, "runs": len(mine), "errors": [r["error"] for r in runs
                                                         if r["side"] == v["name"] and "error" in r],
                     "val_loss_at_budget": median((r["at_budget"] or {}).get("val_loss") for r in mine),
                     "reached": sum(r.get("seconds_to_target") is not None for r in mine),
                     **{k: median(r.get(k) for r in mine)
                        for k in ("seconds_to_target", "target_step", "final_val_loss", "median_ms_per_iter")}})
    return {"kind": "ablation", "target_loss": TARGET, "budget_s": args.budget, "rounds": args.rounds or 1,
            "config": args.speedrun_config, "extra_overrides": list(extra),
            "eval_interval": recipe.train.eval_interval, "rows": rows, "runs": runs}


def gpu_race(args, data: Path, scratch: Path) -> dict:
    extra = (*length_overrides(args.max_iters), *args.set)
    base = ("train.eval_whole_val=true",)
    delta = recipe_delta(load_config(args.speedrun_config), load_config(DEFAULT_CONFIG), load_config(GPU_CONFIG))
    sides = [Side(NANOGPT), Side("ours", GPU_CONFIG, base + extra),
             Side("ours + recipe", GPU_CONFIG, base + tuple(delta) + extra)]
    for side in sides[1:]:
        load_config(side.config, side.overrides)
    nanogpt_args = ["--config", "gpu", "--device", "cuda", "--compile", "--threads", str(args.nanogpt_threads)]
    runs = play_with_nanogpt(args, data, scratch, sides, nanogpt_args, 1)
    add_target_from_nanogpt(runs)
    add_round_ratios(runs)
    return {"kind": "gpu-race", "rounds": args.rounds or 1, "recipe_overrides": delta, "threads": threads(args),
            "sides": describe_sides(sides), "runs": runs, "summary": race_summary(runs)}


def add_target_from_nanogpt(runs: list[dict]) -> None:
    """The GPU race's target is nanoGPT's final val loss of the same round, known only once it ran (the turns
    rotate), so our time to it is read afterwards from our eval records."""
    targets = {r["round"]: r.get("final_val_loss") for r in runs if r["side"] == NANOGPT}
    for r in runs:
        if r["side"] != NANOGPT and "error" not in r:
            r["target_loss"] = targets.get(r["round"])
            hit = first_at_or_below(r["evals"], r["target_loss"]) if r["target_loss"] is not None else None
            r["seconds_to_target"] = hit and hit.get("train_seconds")
            r["target_step"] = hit and hit.get("step")


# ----------------------------------------------------------------------------- the tables

def fmt(value, spec: str = ".2f", none: str = "-") -> str:
    return none if value is None else format(value, spec)


def _cells(r: dict, keys) -> str:
    return " | ".join(fmt(r.get(k), spec, none) for k, spec, none in keys)


def _side_lines(record: dict) -> list[str]:
    lines = []
    for name, side in record["sides"].items():
        if side["config"] is None:
            continue
        overrides = " ".join(f"`{o}`" for o in side["overrides"]) or "none"
        every = side.get("eval_interval")
        own = "its config's own" if every == side.get("config_eval_interval") else \
            f"its config says {side.get('config_eval_interval')}"
        lines.append(f"- {name}: configs/{side['config']}.toml with {overrides}; evaluated every {every} "
                     f"steps ({own}).")
    return lines


def _machine(record: dict) -> str:
    e = record.get("env") or {}
    return (f"Machine: {e.get('cpu', '?')} ({e.get('cpus', '?')} CPUs, {e.get('platform', '?')}; device "
            f"{e.get('device', '?')}), jax {e.get('jax', '?')}, python {e.get('python', '?')}.")


def _our_cores(record: dict) -> str:
    ours = (record.get("threads") or {}).get("ours")
    return f" (ours: JAX on {ours} cores)" if ours else ""


def _nanogpt_run(record: dict) -> dict:
    return next((r for r in record["runs"] if r["side"] == NANOGPT and "error" not in r), {})


RUN_COLUMNS = (("seconds_to_target", ".1f", "not reached"), ("target_step", "d", "-"),
               ("final_val_loss", ".4f", "-"), ("median_ms_per_iter", ".1f", "-"), ("compile_s", ".1f", "n/a"),
               ("wall_s", ".0f", "-"), ("ratio", ".2f", "-"))
SUMMARY_COLUMNS = (("median_seconds_to_target", ".1f", "never"), ("median_target_step", ".0f", "-"),
                   ("median_final_val_loss", ".4f", "-"), ("median_ms_per_iter", ".1f", "-"),
                   ("median_compile_s", ".1f", "n/a"), ("ratio_of_medians", ".2f", "-"),
                   ("median_round_ratio", ".2f", "-"))


def _run_rows(record: dict, columns) -> list[str]:
    rows = []
    for r in record["runs"]:
        cells = f"failed: {r['error']} |" + " |" * (len(columns) - 1) if "error" in r else _cells(r, columns)
        rows.append(f"| {r['round']} | {r['turn']} | {r['side']} | {cells} |")
    return rows


def race_markdown(record: dict) -> str:
    n, t = _nanogpt_run(record), record["target_loss"]
    iters = n.get("target_step", "its")
    lines = [f"# Speedrun race: training seconds to val loss {t} (whole val split) against nanoGPT's baby run", "",
             f"{record['rounds']} round(s): in each, the three runs one after the other, each in a fresh process, "
             "the order rotated by one each round.", "",
             f"| round | turn | side | seconds to {t} | at step | final val loss | ms/iter (median) | compile s "
             "| wall s | nanoGPT / this (same round) |", "| ---: | ---: | --- |" + " ---: |" * len(RUN_COLUMNS),
             *_run_rows(record, RUN_COLUMNS), "", "## Medians over the rounds", "",
             f"| side | reached {t} | seconds to {t} | at step | final val loss | ms/iter | compile s "
             "| nanoGPT / this (of the medians) | nanoGPT / this (median of the rounds) |",
             "| --- | ---: |" + " ---: |" * len(SUMMARY_COLUMNS)]
    for side, s in record["summary"].items():
        lines.append(f"| {side} | {s['reached']}/{s['runs']} | {_cells(s, SUMMARY_COLUMNS)} |")
    lines += ["", f"- {n.get('impl', 'nanoGPT (port: bench/nanogpt_baseline.py)')}, torch {n.get('torch', '?')}, "
              f"{record.get('nanogpt_threads', 2)} threads{_our_cores(record)}; its time is {iters} iters x its "
              "median ms/iter (evaluation excluded), its val loss its own estimate (20 batches of 12 x 64) at the last iter.",
              *_side_lines(record),
              f"- ours: training seconds (compile and evaluation excluded) at the first evaluation whose val loss "
              f"over the whole val split is at or below {t}, so the eval interval is how finely it is seen.", "",
              _machine(record), "", f"Made by: `{record['command']}`", ""]
    return "\n".join(lines)


def ablation_markdown(record: dict) -> str:
    t, b = record["target_loss"], record["budget_s"]
    recipe = next((r for r in record["rows"] if r["switch"] is None), {})

    def delta(r, key):
        return None if r.get(key) is None or recipe.get(key) is None else r[key] - recipe[key]
    lines = [f"# The speedrun recipe, one switch at a time (configs/{record['config']}.toml)", "",
             f"Each row is the recipe with one switch turned off (or, where the recipe does not use it, turned on: "
             f"\"not in the recipe\"), in fresh processes, {record['rounds']} round(s) in turns (medians). Val loss "
             f"over the whole val split, evaluated every {record['eval_interval']} steps; at {b:g} s: the last "
             f"evaluation within {b:g} s of training (compile and evaluation excluded).", "",
             f"| variant | what it tests | overrides | val loss at {b:g} s | vs recipe | seconds to {t} | at step "
             "| final val loss | vs recipe | ms/iter |", "| --- | --- | --- |" + " ---: |" * 7]
    for r in record["rows"]:
        if not r["runs"]:
            failed = "; ".join(r["errors"])[:200]
            lines.append(f"| {r['name']} | {r['change']} | {' '.join(r['overrides'])} | failed: {failed} |" +
                         " |" * 6)
            continue
        lines.append(f"| {r['name']} | {r['change']} | {' '.join(f'`{o}`' for o in r['overrides']) or '-'} | "
                     f"{fmt(r['val_loss_at_budget'], '.4f')} | {fmt(delta(r, 'val_loss_at_budget'), '+.4f')} | "
                     f"{fmt(r['seconds_to_target'], '.1f', 'not reached')} | {fmt(r['target_step'], '.0f')} | "
                     f"{fmt(r['final_val_loss'], '.4f')} | {fmt(delta(r, 'final_val_loss'), '+.4f')} | "
                     f"{fmt(r['median_ms_per_iter'], '.1f')} |")
    extra = " ".join(f"`{o}`" for o in record["extra_overrides"])
    lines += ["", f"Every run also has `train.eval_whole_val=true train.target_loss={t}`{' ' + extra if extra else ''}.",
              "", _machine(record), "", f"Made by: `{record['command']}`", ""]
    return "\n".join(lines)


GPU_COLUMNS = (("median_tokens_per_s", ",.0f", "-"), ("median_ms_per_iter", ".1f", "-"),
               ("target_loss", ".4f", "-"), ("seconds_to_target", ".1f", "not reached"), ("target_step", "d", "-"),
               ("final_val_loss", ".4f", "-"), ("compile_s", ".1f", "n/a"), ("wall_s", ".0f", "-"),
               ("ratio", ".2f", "-"))
GPU_SUMMARY = (("median_tokens_per_s", ",.0f", "-"), ("median_seconds_to_target", ".1f", "never"),
               ("median_final_val_loss", ".4f", "-"), ("ratio_of_medians", ".2f", "-"))


def gpu_markdown(record: dict) -> str:
    n = _nanogpt_run(record)
    lines = ["# GPU race: nanoGPT's Shakespeare run against ours, training seconds to nanoGPT's val loss", "",
             f"{record['rounds']} round(s) in turns, each run in a fresh process. The target of our runs is "
             "nanoGPT's final val loss of the same round; nanoGPT's time is its iters x its median ms/iter.", "",
             "| round | turn | side | tokens/s | ms/iter | target | seconds to target | at step | final val loss "
             "| compile s | wall s | nanoGPT / this |", "| ---: | ---: | --- |" + " ---: |" * len(GPU_COLUMNS)]
    for r in record["runs"]:
        target = dict(r, target_loss=r.get("final_val_loss")) if r["side"] == NANOGPT else r
        cells = f"failed: {r['error']} |" + " |" * (len(GPU_COLUMNS) - 1) if "error" in r else _cells(target,
                                                                                                        GPU_COLUMNS)
        lines.append(f"| {r['round']} | {r['turn']} | {r['side']} | {cells} |")
    lines += ["", "| side | tokens/s | seconds to target | final val loss | nanoGPT / this (of the medians) |",
              "| --- |" + " ---: |" * len(GPU_SUMMARY)]
    for side, s in record["summary"].items():
        lines.append(f"| {side} | {_cells(s, GPU_SUMMARY)} |")
    lines += ["", f"- {n.get('impl', 'nanoGPT (port: bench/nanogpt_baseline.py)')} `--config gpu --device cuda --compile` "
              f"({n.get('device', '?')}; torch {n.get('torch', '?')}): 6 layers, 6 heads, n_embd 384, block 256, "
              "batch 64, dropout 0.2, eval_iters 200; its val loss its own 200-batch estimate. Its first "
              f"window (torch.compile's compile in it) took {fmt(n.get('first_window_s'), '.1f')} s.",
              *_side_lines(record),
              "- ours: val loss over the whole val split; seconds = training time (compile and evaluation "
              "excluded) at the first evaluation at or below the target. The recipe's overrides (what "
              f"configs/{SPEEDRUN}.toml changes relative to the default, less length, shapes and bookkeeping): "
              + (" ".join(f"`{o}`" for o in record["recipe_overrides"]) or "none") + ".", "",
              _machine(record), "", f"Made by: `{record['command']}`", ""]
    return "\n".join(lines)


# ----------------------------------------------------------------------------- the command line

def main(argv=None) -> dict:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    mode = parser.add_mutually_exclusive_group(required=True)
    mode.add_argument("--race", action="store_true")
    mode.add_argument("--ablation", action="store_true")
    mode.add_argument("--gpu-race", action="store_true")
    parser.add_argument("--rounds", type=int, help="rounds of turns (default 3 for --race, else 1)")
    parser.add_argument("--nanogpt-python", default=sys.executable, help="a Python with torch (default: this one)")
    parser.add_argument("--nanogpt-threads", type=int, default=cpu_cores(),
                        help="nanoGPT's torch threads (default: the cores JAX uses, %(default)s)")
    parser.add_argument("--data", help="Tiny Shakespeare (default $JAXATTN_SHAKESPEARE, then the cache)")
    parser.add_argument("--speedrun-config", default=SPEEDRUN)
    parser.add_argument("--budget", type=float, default=15.0, help="--ablation: training seconds of the budget")
    parser.add_argument("--max-iters", type=int, help="shorten every side alike (max_iters = lr_decay_iters = N)")
    parser.add_argument("--set", nargs="+", action="extend", default=[], help="overrides for all our runs")
    parser.add_argument("--quick", action="store_true", help=f"smoke test: {QUICK_ITERS} iters, one round, temp out")
    parser.add_argument("--out", help="results folder (default bench/results; with --quick a temp folder)")
    args = parser.parse_args(argv)
    if args.quick:
        args.rounds, args.max_iters = 1, args.max_iters or QUICK_ITERS
    from train.data.corpus import resolve_data_path
    data = resolve_data_path(args.data, download_if_missing=False).resolve()
    name, run = (("speedrun", race) if args.race else ("ablation", ablation) if args.ablation
                 else ("speedrun_gpu", gpu_race))
    scratch = Path(tempfile.mkdtemp(prefix="jaxattn_speedrun_"))
    try:
        record = run(args, data, scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    record["command"] = "PYTHONPATH=$PWD python bench/train.py " + portable_command(argv, ("--nanogpt-python",
                                                                                            "--data", "--out"))
    record["env"] = next((r["env"] for r in record["runs"] if "env" in r), None)
    for r in record["runs"]:
        r.pop("env", None)
    out = args.out or (tempfile.mkdtemp(prefix="jaxattn_quick_") if args.quick else RESULTS)
    markdown = {"speedrun": race_markdown, "ablation": ablation_markdown, "speedrun_gpu": gpu_markdown}[name]
    write_results(out, name, record, markdown(record))
    print(f"wrote {Path(out) / name}.json and .md", flush=True)
    return record


if __name__ == "__main__":
    main()
