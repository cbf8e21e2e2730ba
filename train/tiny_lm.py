"""Train the tiny character-level LM: `python -m train.tiny_lm [--config NAME] [--set k=v ...]`.

The default is nanoGPT's CPU "baby" Shakespeare run (configs/shakespeare_char_baby.toml).
One jitted call runs `steps_per_dispatch` optimizer steps with lax.scan; batches are drawn
on device from (seed, step), so no host work or sync happens inside a step and `--resume`
replays exactly the batches an uninterrupted run would see.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import statistics
import sys
import time
from functools import partial
from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np
import optax

from jaxattn.matmul import cpu_flags, fast_operand_dtype, resolve_operand_dtype
from train import data as data_lib
from train.checkpoint import Checkpointer, CheckpointError, check_compatible
from train.config import DEFAULT_CONFIG, ExperimentConfig, TrainConfig, load_config
from train.tokenizer import Tokenizer

EVAL_SPLITS = {"train": 2, "val": 3}  # rng split ids of the fixed eval batches (0, 1: training batches)


# ----------------------------------------------------------------------------- optimizer

def lr_schedule(tc: TrainConfig) -> Callable[[jax.Array], jax.Array]:
    """nanoGPT's get_lr: linear warmup to lr, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    def schedule(step):
        step = jnp.asarray(step, jnp.float32)
        warmup = tc.lr * (step + 1) / (tc.warmup_iters + 1)
        ratio = jnp.clip((step - tc.warmup_iters) / max(tc.lr_decay_iters - tc.warmup_iters, 1), 0.0, 1.0)
        cosine = tc.min_lr + 0.5 * (1.0 + jnp.cos(math.pi * ratio)) * (tc.lr - tc.min_lr)
        return jnp.where(step < tc.warmup_iters, warmup, cosine)
    return schedule


def _is_embedding(path) -> bool:
    names = [str(getattr(k, "key", getattr(k, "name", k))).lower() for k in path]
    return any("embed" in n or n in ("wte", "wpe") for n in names)


def decay_mask(params: Any, decay_embeddings: bool) -> Any:
    """True where weight decay applies: matrices (ndim >= 2), embeddings only if asked."""
    return jax.tree_util.tree_map_with_path(
        lambda path, p: p.ndim >= 2 and (decay_embeddings or not _is_embedding(path)), params)


def make_optimizer(tc: TrainConfig) -> optax.GradientTransformation:
    """AdamW with nanoGPT's schedule, global-norm clipping and decay on matrices only."""
    adamw = optax.adamw(lr_schedule(tc), b1=tc.beta1, b2=tc.beta2, weight_decay=tc.weight_decay,
                        mask=partial(decay_mask, decay_embeddings=tc.decay_embeddings))
    if tc.grad_clip > 0:
        return optax.chain(optax.clip_by_global_norm(tc.grad_clip), adamw)
    return adamw


# ----------------------------------------------------------------------------- steps

def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token loss in float32; logits [B,T,V], targets [B,T]."""
    logits = logits.reshape(-1, logits.shape[-1]).astype(jnp.float32)  # [B*T, V]
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets.reshape(-1)).mean()


@dataclasses.dataclass(frozen=True)
class Programs:
    """The jitted functions of a run (compiled lazily per distinct number of steps)."""

    init: Callable  # (seed) -> state
    train_steps: Callable  # (state, train_data, num_steps) -> (state, (losses, lrs) [num_steps] each)
    evaluate: Callable  # (params, train_data, val_data) -> {'train': loss, 'val': loss}


def build_programs(config: ExperimentConfig) -> Programs:
    from jaxattn.model import DecoderLM

    model, tc = DecoderLM(config.model), config.train
    optimizer = make_optimizer(tc)
    schedule = lr_schedule(tc)
    dropout = config.model.dropout > 0
    B, T = tc.batch_size, tc.block_size

    def loss_fn(params, x, y, dropout_key):
        rngs = {"dropout": dropout_key} if dropout else None
        logits = model.apply({"params": params}, x, deterministic=not dropout, rngs=rngs)
        return cross_entropy(logits, y)

    loss_and_grads = jax.value_and_grad(loss_fn)
    if tc.data_parallel > 1:
        loss_and_grads = _data_parallel(loss_and_grads, tc.data_parallel)

    def one_step(state, train_data):
        step = state["step"]
        x, y = data_lib.get_batch(train_data, data_lib.batch_key(tc.seed, data_lib.TRAIN, step), B, T)
        loss, grads = loss_and_grads(state["params"], x, y, jax.random.fold_in(state["rng"], step))
        updates, opt_state = optimizer.update(grads, state["opt_state"], state["params"])
        params = optax.apply_updates(state["params"], updates)
        # The lr is returned with the loss so that logging it needs no extra device call.
        return {**state, "params": params, "opt_state": opt_state, "step": step + 1}, (loss, schedule(step))

    @partial(jax.jit, static_argnums=(2,), donate_argnums=(0,))
    def train_steps(state, train_data, num_steps):
        return jax.lax.scan(lambda s, _: one_step(s, train_data), state, None, length=num_steps)

    @jax.jit
    def evaluate(params, train_data, val_data):
        def split_loss(split_data, split_id):
            def batch_loss(_, i):
                key = data_lib.batch_key(tc.seed, split_id, i)
                x, y = data_lib.get_batch(split_data, key, B, T)
                logits = model.apply({"params": params}, x, deterministic=True)
                return None, cross_entropy(logits, y)
            return jax.lax.scan(batch_loss, None, jnp.arange(tc.eval_iters))[1].mean()
        return {"train": split_loss(train_data, EVAL_SPLITS["train"]),
                "val": split_loss(val_data, EVAL_SPLITS["val"])}

    def init(seed):
        params_key, dropout_key = jax.random.split(jax.random.PRNGKey(seed))
        params = model.init(params_key, jnp.zeros((1, T), jnp.int32))["params"]
        return {"params": params, "opt_state": optimizer.init(params), "step": jnp.int32(0),
                "rng": dropout_key}

    return Programs(init=init, train_steps=train_steps, evaluate=evaluate)


def _fit_data_parallel(config: ExperimentConfig) -> ExperimentConfig:
    """Falls back to one device, with a warning, when JAX started with fewer host devices than
    train.data_parallel asks for (e.g. `train()` called after JAX was initialised). The maths is
    the same either way; only the speed differs."""
    wanted, available = config.train.data_parallel, len(jax.devices())
    if wanted <= available:
        return config
    print(f"warning: train.data_parallel={wanted} but JAX has {available} device(s); training on one. "
          f"Start Python with XLA_FLAGS=--xla_force_host_platform_device_count={wanted} "
          f"(python -m train.tiny_lm does this) to use {wanted} cores.", file=sys.stderr)
    return config.replace(train=config.train.replace(data_parallel=1))


def _mesh(num_devices: int):
    from jax.sharding import Mesh

    devices = jax.devices()
    if len(devices) < num_devices:
        raise ValueError(f"train.data_parallel={num_devices} needs {num_devices} devices, JAX has {len(devices)}; "
                         f"start it with XLA_FLAGS=--xla_force_host_platform_device_count={num_devices} "
                         "(the command-line programs do this)")
    return Mesh(np.array(devices[:num_devices]), ("data",))


def _replicate(tree, num_devices: int):
    from jax.sharding import NamedSharding, PartitionSpec as P
    return jax.device_put(tree, NamedSharding(_mesh(num_devices), P()))


def _data_parallel(loss_and_grads: Callable, num_devices: int) -> Callable:
    """The same (loss, grads) computed as the mean over `num_devices` host devices, each taking
    B / num_devices rows of the batch; params are replicated. Equal to the single-device
    result up to float summation order."""
    from jax.flatten_util import ravel_pytree
    from jax.sharding import PartitionSpec as P

    mesh = _mesh(num_devices)

    def local(params, x, y, dropout_key):  # x, y: [B / num_devices, T]
        key = jax.random.fold_in(dropout_key, jax.lax.axis_index("data"))
        flat, unravel = ravel_pytree(loss_and_grads(params, x, y, key))  # [1 + num_params]
        # One buffer: XLA:CPU's all-reduce of the ~30 separate arrays took 3.2 ms, of one 0.9 ms.
        return unravel(jax.lax.pmean(flat, "data"))

    return jax.shard_map(local, mesh=mesh, in_specs=(P(), P("data"), P("data"), P()),
                         out_specs=P(), check_vma=False)


# ----------------------------------------------------------------------------- sampling

def sample_text(config: ExperimentConfig, params: Any, tokenizer: Tokenizer, *, seed: int) -> tuple[str, str]:
    """(text, method). jaxattn.decoding.generate (KV cache) when prompt + sample fit in
    max_seq_len; otherwise nanoGPT's way: a sliding window of block_size tokens re-run each step."""
    tc = config.train
    prompt = tokenizer.encode(tc.sample_prompt)[-tc.block_size:]
    key = jax.random.PRNGKey(seed)
    fits = len(prompt) + tc.sample_tokens <= config.model.max_seq_len
    try:
        from jaxattn.decoding import generate
    except ImportError:
        generate = None
    if generate is not None and fits:
        out = generate(params, config.model, jnp.asarray(prompt)[None], jnp.asarray([len(prompt)]),
                       max_new_tokens=tc.sample_tokens, rng=key, temperature=tc.sample_temperature)
        ids = np.asarray(out.tokens)[0]
        method = "jaxattn.decoding.generate, KV cache"
    else:
        ids = full_forward_sample(config, params, prompt, tc.sample_tokens, tc.sample_temperature, key)
        method = (f"sliding {tc.block_size}-token window, full forward per token, no KV cache: "
                  + ("longer than max_seq_len" if not fits else "jaxattn.decoding not available"))
    return tokenizer.decode(np.concatenate([prompt, ids])), method


def full_forward_sample(config: ExperimentConfig, params, prompt: np.ndarray, num_tokens: int,
                        temperature: float, key: jax.Array) -> np.ndarray:
    """Samples by re-running the whole window each step (no cache); returns [num_tokens] ids."""
    from jaxattn.model import DecoderLM

    model, T = DecoderLM(config.model), config.train.block_size
    prompt = prompt[-T:]
    buffer = jnp.zeros((1, T), jnp.int32).at[0, :len(prompt)].set(jnp.asarray(prompt))

    @jax.jit
    def run(buffer, key):
        def step(carry, step_key):
            buffer, n = carry  # buffer [1, T] holds n valid tokens, left-aligned
            logits = model.apply({"params": params}, buffer)[0, n - 1]  # [V]
            if temperature == 0:
                token = jnp.argmax(logits).astype(jnp.int32)
            else:
                token = jax.random.categorical(step_key, logits / temperature).astype(jnp.int32)
            shifted = jnp.roll(buffer, -1, axis=1).at[0, -1].set(token)
            buffer = jnp.where(n == T, shifted, buffer.at[0, jnp.minimum(n, T - 1)].set(token))
            return (buffer, jnp.minimum(n + 1, T)), token
        return jax.lax.scan(step, (buffer, jnp.int32(len(prompt))), jax.random.split(key, num_tokens))[1]

    return np.asarray(run(buffer, key))


# ----------------------------------------------------------------------------- the run

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
    config: ExperimentConfig = dataclasses.field(repr=False, default=None)  # resolved (vocab from data)
    params: Any = dataclasses.field(repr=False, default=None)  # the final parameters

    def figures(self) -> dict:
        return {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                if f.name not in ("config", "params")}


def resolve(config: ExperimentConfig, tokenizer: Tokenizer) -> ExperimentConfig:
    """The config with the model's vocabulary set from the tokenizer and `matmul_dtype="auto"`
    replaced by what it means on this machine (so the printed and saved config say which),
    checked against block_size."""
    model = config.model.replace(vocab_size=tokenizer.vocab_size,
                                 matmul_dtype=resolve_operand_dtype(config.model.matmul_dtype))
    if model.max_seq_len < config.train.block_size:
        raise ValueError(f"model.max_seq_len={model.max_seq_len} is shorter than "
                         f"train.block_size={config.train.block_size}")
    return config.replace(model=model)


def _append_jsonl(path: Path, record: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def _chunks(start: int, stop: int, tc: TrainConfig):
    """Step ranges [a, b) of at most steps_per_dispatch that never cross an eval boundary."""
    step = start
    while step < stop:
        next_eval = (step // tc.eval_interval + 1) * tc.eval_interval
        end = min(step + tc.steps_per_dispatch, next_eval, stop)
        yield step, end
        step = end


def train(config: ExperimentConfig, *, resume: bool = False, quiet: bool = False,
          loss_plot: str | None = None, sample: bool = True,
          after_eval: Callable[[int], None] | None = None) -> RunResult:
    """Runs an experiment end to end and returns its figures.

    `after_eval(step)`, if given, is called after each evaluation, outside the timed steps:
    bench/train.py uses it to run a baseline in turns with this run.
    """
    from tqdm import tqdm
    from jaxattn.model import count_params

    wall_start = time.perf_counter()
    tc = config.train
    corpus = data_lib.load_corpus(tc.data_path, tokenizer=tc.tokenizer, val_fraction=tc.val_fraction)
    asked_auto = config.model.matmul_dtype == "auto"
    config = _fit_data_parallel(resolve(config, corpus.tokenizer))
    tc = config.train
    data_lib.check_block_size(corpus, tc.block_size)
    out = Path(tc.out_dir)
    out.mkdir(parents=True, exist_ok=True)
    log = (lambda *a: None) if quiet else partial(print, flush=True)
    log(f"config {config.name} (data {corpus.path}, {len(corpus.train):,} train / {len(corpus.val):,} val tokens):")
    log(config.to_json())
    if asked_auto:
        reason = fast_operand_dtype(jax.default_backend(), cpu_flags())[1]
        log(f'model.matmul_dtype "auto" -> "{config.model.matmul_dtype}" ({reason})')
    (out / "config.json").write_text(config.to_json())

    programs = build_programs(config)
    train_data, val_data = jnp.asarray(corpus.train), jnp.asarray(corpus.val)
    state = programs.init(tc.seed)
    if tc.data_parallel > 1:  # every array replicated on the data-parallel devices
        state, train_data, val_data = _replicate((state, train_data, val_data), tc.data_parallel)
    log(f"parameters: {count_params(state['params']):,}; XLA_FLAGS={os.environ.get('XLA_FLAGS', '')!r}")
    num_params = count_params(state["params"])
    ckpt = Checkpointer(out) if tc.checkpoint or resume else None
    best_val = math.inf
    metrics_path = out / "metrics.jsonl"
    if resume:
        state, best_val = _resume(ckpt, state, config, log)
    elif metrics_path.exists():
        metrics_path.unlink()
    start_step = int(state["step"])

    compile_start = time.perf_counter()
    compiled = {}
    for a, b in _chunks(start_step, tc.max_iters, tc):
        if b - a not in compiled:
            compiled[b - a] = programs.train_steps.lower(state, train_data, b - a).compile()
    evaluate = programs.evaluate.lower(state["params"], train_data, val_data).compile()
    compile_s = time.perf_counter() - compile_start
    log(f"compiled {sorted(compiled)}-step train programs and eval in {compile_s:.1f}s")

    def run_eval(step):
        nonlocal best_val
        losses = {k: float(v) for k, v in evaluate(state["params"], train_data, val_data).items()}
        record = {"step": step, "train_loss": losses["train"], "val_loss": losses["val"]}
        _append_jsonl(metrics_path, record)
        (bar.write if not quiet else log)(f"step {step}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}")
        if ckpt is not None and step > start_step:
            improved = losses["val"] < best_val
            best_val = min(best_val, losses["val"])
            kw = dict(config=config, tokenizer=corpus.tokenizer, val_loss=losses["val"], best_val_loss=best_val)
            ckpt.save("latest", step, state, **kw)
            if improved:
                ckpt.save("best", step, state, **kw)
        else:
            best_val = min(best_val, losses["val"])
        if after_eval is not None:
            after_eval(step)
        return losses

    tokens_per_step = tc.batch_size * tc.block_size
    interval_losses: list[float] = []
    bar = tqdm(total=tc.max_iters, initial=start_step, unit="it", disable=quiet, dynamic_ncols=True,
               mininterval=0.5, file=sys.stdout)
    chunk_times: list[tuple[int, float]] = []  # (steps, seconds) per dispatch, eval excluded
    last = run_eval(start_step) if start_step % tc.eval_interval == 0 or start_step == tc.max_iters else None
    pending = None  # (first step, (losses, lrs)) of the chunk in flight: read after dispatching the next
    tick = time.perf_counter()

    def drain(pending):
        nonlocal tick
        first, (losses, lrs) = pending
        losses, lrs = np.asarray(losses), np.asarray(lrs)  # waits for that chunk
        now = time.perf_counter()
        chunk_times.append((len(losses), now - tick))
        tick = now
        for i, loss in enumerate(losses):  # the mean loss of each log interval, at its last step
            step = first + i + 1
            interval_losses.append(float(loss))
            if step % tc.log_interval == 0 or step == tc.max_iters:
                _append_jsonl(metrics_path, {"step": step, "loss": float(np.mean(interval_losses)),
                                             "lr": float(lrs[i])})
                interval_losses.clear()
        steps_s = [s / t for s, t in chunk_times[-20:]] or [0.0]
        bar.set_postfix(loss=f"{losses[-1]:.4f}", tok_s=f"{statistics.median(steps_s) * tokens_per_step:,.0f}")
        bar.update(len(losses))

    for a, b in _chunks(start_step, tc.max_iters, tc):
        state, outputs = compiled[b - a](state, train_data)
        if pending is not None:
            drain(pending)
        pending = (a, outputs)
        if b % tc.eval_interval == 0 or b == tc.max_iters:
            drain(pending)
            pending = None
            last = run_eval(b)
            tick = time.perf_counter()  # keep eval and checkpoint time out of the rate
    if pending is not None:
        drain(pending)
    bar.close()
    if ckpt is not None:
        ckpt.close()

    per_step = [t / s for s, t in chunk_times[1:] or chunk_times]  # the first dispatch warms up
    median_step = statistics.median(per_step) if per_step else float("nan")
    text, method = ("", "")
    if sample and tc.sample_tokens > 0:
        text, method = sample_text(config, state["params"], corpus.tokenizer, seed=tc.seed)
        log(f"--- sample ({method}, temperature {tc.sample_temperature}) ---\n{text}\n---")
    if tc.plot:
        plot_losses(metrics_path, Path(loss_plot) if loss_plot else out / "loss.png", title=config.name)
    result = RunResult(
        final_val_loss=last["val"] if last else float("nan"),
        final_train_loss=last["train"] if last else float("nan"), best_val_loss=best_val,
        steps=tc.max_iters, median_tokens_per_s=tokens_per_step / median_step,
        median_ms_per_iter=1e3 * median_step, fastest_ms_per_iter=1e3 * min(per_step, default=float("nan")),
        compile_s=compile_s,
        wall_s=time.perf_counter() - wall_start, num_params=num_params, sample=text, out_dir=str(out),
        config=config, params=state["params"])
    (out / "result.json").write_text(json.dumps(result.figures(), indent=2))
    return result


def _resume(ckpt: Checkpointer, state, config: ExperimentConfig, log) -> tuple[Any, float]:
    if ckpt.latest_step() is None:
        raise CheckpointError(f"--resume: no checkpoint in {ckpt.root / 'latest'}")
    restored, meta = ckpt.restore("latest", jax.eval_shape(lambda: state))
    for warning in check_compatible(meta, config):
        log(f"warning: resumed run differs from the checkpoint ({warning}); it will not replay exactly")
    log(f"resumed from step {meta['step']} (val loss {meta['val_loss']})")
    best = meta.get("best_val_loss")
    return restored, math.inf if best is None else best


def plot_losses(metrics_path: Path, png: Path, *, title: str) -> None:
    """Training loss per log interval and eval train/val losses against step."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    records = [json.loads(line) for line in metrics_path.read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    evals = [r for r in records if "val_loss" in r]
    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    ax.plot([r["step"] for r in steps], [r["loss"] for r in steps], lw=0.8, alpha=0.6, label="train (batch)")
    ax.plot([r["step"] for r in evals], [r["train_loss"] for r in evals], "o-", label="train (eval)")
    ax.plot([r["step"] for r in evals], [r["val_loss"] for r in evals], "s-", label="val (eval)")
    ax.set(xlabel="step", ylabel="cross-entropy (nats/char)", title=title)
    ax.grid(alpha=0.3)
    ax.legend()
    png.parent.mkdir(parents=True, exist_ok=True)
    fig.tight_layout()
    fig.savefig(png)
    plt.close(fig)


def run_flags(tc: TrainConfig) -> str:
    """train.xla_flags plus the host device count data parallelism needs."""
    devices = f"--xla_force_host_platform_device_count={tc.data_parallel}" if tc.data_parallel > 1 else ""
    return f"{tc.xla_flags} {devices}".strip()


def apply_xla_flags(flags: str) -> bool:
    """Adds `flags` to XLA_FLAGS if JAX's backend has not started yet; returns whether they apply."""
    from jax._src import xla_bridge

    current = os.environ.get("XLA_FLAGS", "")
    missing = [f for f in flags.split() if f not in current.split()]
    if not missing:
        return True
    if xla_bridge.backends_are_initialized():
        print(f"warning: JAX already started; train.xla_flags {missing} are not applied", file=sys.stderr)
        return False
    os.environ["XLA_FLAGS"] = " ".join([current, *missing]).strip()
    return True


def main(argv: list[str] | None = None) -> RunResult:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", default=DEFAULT_CONFIG, help="configs/NAME.toml or a path")
    parser.add_argument("--set", nargs="*", default=[], metavar="TABLE.FIELD=VALUE",
                        help="overrides, e.g. model.positions=rope train.max_iters=500")
    parser.add_argument("--data", help="the text file to train on (= train.data_path)")
    parser.add_argument("--out-dir", help="= train.out_dir")
    parser.add_argument("--resume", action="store_true", help="continue from out_dir's latest checkpoint")
    parser.add_argument("--loss-plot", help="where to write the loss curve PNG (default out_dir/loss.png)")
    parser.add_argument("--quiet", action="store_true")
    args = parser.parse_args(argv)
    overrides = list(args.set)
    overrides += [f"train.data_path={json.dumps(args.data)}"] if args.data else []
    overrides += [f"train.out_dir={json.dumps(args.out_dir)}"] if args.out_dir else []
    try:
        config = load_config(args.config, overrides)
    except (ValueError, TypeError, FileNotFoundError) as err:
        parser.error(str(err))
    apply_xla_flags(run_flags(config.train))
    try:
        result = train(config, resume=args.resume, quiet=args.quiet, loss_plot=args.loss_plot)
    except (data_lib.DataError, CheckpointError) as err:
        sys.exit(f"error: {err}")
    print(f"final: val loss {result.final_val_loss:.4f} at iter {result.steps} | "
          f"{result.median_tokens_per_s:,.0f} tokens/s median ({result.median_ms_per_iter:.1f} ms/iter, "
          f"excluding compile) | compile {result.compile_s:.1f}s | wall {result.wall_s:.1f}s")
    return result


if __name__ == "__main__":
    main()
