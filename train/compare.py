"""Model kinds side by side: `python -m train.compare [--iters N] [--out DIR]`.

Trains the baby config once per kind (the attention kinds MHA, GQA with 2 kv heads, MQA, MLA;
MoE: MHA with the mixture-of-experts MLPs of configs/shakespeare_char_baby_moe.toml) and
position scheme (learned, RoPE), then measures each trained model's cached decoding speed,
KV-cache size, and total and active parameters (those one token touches: all of them for the
dense kinds). Writes compare.md (table), compare.json and compare.png under --out (default runs/compare;
`--out docs` refreshes the figures docs/training.md shows). Its training runs go to --runs, which
it replaces on each invocation.
Runs are sequential and the machine may be shared: compare speeds within one table only.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from jaxattn.cache.build import cache_bytes_per_token
from jaxattn.decoding import generate
from jaxattn.model import active_params
from train import outputs
from train.cli import ArgumentParser, Stopped, UsageError, guard
from train.config import DEFAULT_CONFIG, ExperimentConfig, load_config
from train.run import runtime as runtime_lib
from train.run.experiment import run_experiment
from train.run.loop import Interrupted
from train.run.plots import plot_comparison
from train.tiny_lm import RUNTIME_ERRORS

PROGRAM = "python -m train.compare"

KINDS = {
    "MHA": [],
    "GQA": ["model.num_kv_heads=2"],
    "MQA": ["model.num_kv_heads=1"],
    "MLA": ["model.mla={kv_lora_rank = 32, qk_nope_head_dim = 32, qk_rope_head_dim = 16, v_head_dim = 32}"],
    # configs/shakespeare_char_baby_moe.toml's model (tests/train/run/test_train_moe.py checks they agree)
    "MoE": ["model.dense_layers=[0]", "model.moe={num_experts = 8, experts_per_token = 2, expert_hidden = 168, "
            "aux_loss_coef = 0.01, z_loss_coef = 0.001, norm_topk_prob = true}"],
}
POSITIONS = ("learned", "rope")


def decode_tokens_per_s(config: ExperimentConfig, params, kernels, *, batch_size: int = 1, repeats: int = 5) -> float:
    """Median tokens/s of jaxattn.generate (KV cache) filling the context after a 1-token prompt."""
    new_tokens = config.model.max_seq_len - 1
    prompt = jnp.zeros((batch_size, 1), jnp.int32)
    lengths = jnp.ones((batch_size,), jnp.int32)

    def run(seed):
        out = generate(params, config.model, prompt, lengths, max_new_tokens=new_tokens,
                       rng=jax.random.PRNGKey(seed), temperature=1.0, kernels=kernels)
        return np.asarray(out.tokens)  # waits for the result

    run(0)  # compile
    times = []
    for i in range(repeats):
        start = time.perf_counter()
        run(i + 1)
        times.append(time.perf_counter() - start)
    return batch_size * new_tokens / statistics.median(times)


def kv_bytes_per_token(config: ExperimentConfig) -> int:
    """Bytes one token adds to the decode cache, summed over layers."""
    return int(cache_bytes_per_token(config.model)["bytes"])


def run_one(kind: str, positions: str, args, runtime: runtime_lib.Runtime) -> dict:
    overrides = KINDS[kind] + [f"model.positions='{positions}'", f"train.max_iters={args.iters}",
                               f"train.lr_decay_iters={args.iters}",
                               f"train.eval_interval={min(250, args.iters)}",
                               f"train.out_dir='{args.runs}/{kind.lower()}_{positions}'",
                               "train.plot=false", "train.checkpoint=false", *args.set]
    result = run_experiment(load_config(args.config, overrides), runtime=runtime, overwrite=True, quiet=True,
                            sample=False)
    row = {"kind": kind, "positions": positions, "val_loss": result.final_val_loss,
           "train_tokens_per_s": result.median_tokens_per_s, "ms_per_iter": result.median_ms_per_iter,
           "decode_tokens_per_s": decode_tokens_per_s(result.config, result.params, runtime.kernels),
           "kv_bytes_per_token": kv_bytes_per_token(result.config), "params": result.num_params,
           "active_params": active_params(result.config.model), "compile_s": result.compile_s, "iters": args.iters}
    print(json.dumps(row), flush=True)
    return row


def markdown(rows: list[dict], command: str) -> str:
    lines = [f"Command: `{command}` ({rows[0]['iters']} iters each, baby config, one run each, "
             "one after another, not in turns: compare speeds within one table only).", "",
             "| kind | positions | val loss | train tokens/s | ms/iter | decode tokens/s (batch 1) "
             "| KV-cache bytes/token | total params | active params |",
             "| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in rows:
        lines.append(f"| {r['kind']} | {r['positions']} | {r['val_loss']:.4f} | "
                     f"{r['train_tokens_per_s']:,.0f} | {r['ms_per_iter']:.1f} | {r['decode_tokens_per_s']:,.0f} | "
                     f"{r['kv_bytes_per_token']:,} | {r['params']:,} | {r['active_params']:,} |")
    return "\n".join(lines) + "\n"


def build_parser() -> argparse.ArgumentParser:
    parser = ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=2000, help="training steps per run")
    parser.add_argument("--out", default="runs/compare", help="where compare.{md,json,png} go (docs: the guides')")
    parser.add_argument("--runs", default="runs/compare/runs", help="run directories, replaced on each invocation")
    parser.add_argument("--config", default=DEFAULT_CONFIG)
    parser.add_argument("--kinds", default=",".join(KINDS), help="subset of " + ",".join(KINDS))
    parser.add_argument("--positions", default=",".join(POSITIONS))
    parser.add_argument("--set", nargs="+", action="extend", default=[], help="extra overrides for every run")
    return parser


def run(argv: list[str] | None) -> list[dict]:
    """Checks the arguments and the output folders, trains and measures each row, writes the tables."""
    parser = build_parser()
    args = parser.parse_args(argv)
    canonical = {k.upper(): k for k in KINDS}
    kinds = [canonical.get(k.strip().upper(), k.strip()) for k in args.kinds.split(",")]
    positions = [p.strip() for p in args.positions.split(",")]
    for name, asked, known in (("--kinds", kinds, KINDS), ("--positions", positions, POSITIONS)):
        if sorted(set(asked) - set(known)):
            parser.error(f"unknown {name} {sorted(set(asked) - set(known))}; choose from {list(known)}")
    if args.iters < 1:
        parser.error(f"--iters must be >= 1, got {args.iters}")
    out = outputs.check_folder(args.out, "--out")
    outputs.check_folder(args.runs, "--runs")
    try:
        base = load_config(args.config, args.set)
        runtime = runtime_lib.start(base.runtime, base.train.batch_size)  # before anything starts JAX
    except (ValueError, TypeError, FileNotFoundError) as err:
        raise UsageError(str(err)) from err
    print("\n".join(runtime.describe()), flush=True)
    rows = []
    try:
        for kind, pos in ((kind, pos) for kind in kinds for pos in positions):
            rows.append(run_one(kind, pos, args, runtime))
    except (Interrupted, KeyboardInterrupt) as stop:
        kept = write(rows, out, args) if rows else "nothing was measured"
        raise Stopped(f"{stop or 'interrupted'} ({kind}, {pos} positions); {kept}") from None
    print(write(rows, out, args))
    print(markdown(rows, command(args)))
    return rows


def command(args) -> str:
    """The command line of the table: the flags that changed what was measured."""
    flags = [f" --iters {args.iters}" if args.iters != 2000 else "",
             f" --kinds {args.kinds}" if args.kinds != ",".join(KINDS) else "",
             f" --positions {args.positions}" if args.positions != ",".join(POSITIONS) else ""]
    return "python -m train.compare" + "".join(flags)


def write(rows: list[dict], out: Path, args) -> str:
    """Writes compare.md, compare.json and compare.png of `rows` under `out`; says so."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "compare.md").write_text(markdown(rows, command(args)))
    (out / "compare.json").write_text(json.dumps(rows, indent=2))
    plot_comparison(rows, out / "compare.png")
    return f"the {len(rows)} finished row(s) are in {out}/compare.md, compare.json and compare.png"


def main(argv: list[str] | None = None) -> list[dict]:
    """The rows; one line and exit 1, 2 or 130 on a failure (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=RUNTIME_ERRORS)


if __name__ == "__main__":
    main()
