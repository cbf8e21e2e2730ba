"""nanoGPT's CPU baby run (and its GPU Shakespeare run), ported into one file so that bench/train.py
can time it side by side.

    /path/to/python-with-torch bench/nanogpt_baseline.py --data PATH [--max-iters N] [--json OUT]
    python bench/nanogpt_baseline.py --data PATH --config gpu --device cuda --compile   # on a GPU

Source: github.com/karpathy/nanoGPT, `model.py` (GPT, CausalSelfAttention, MLP, LayerNorm,
_init_weights, configure_optimizers) and `train.py` (get_batch, estimate_loss, get_lr, the loop),
run as `python train.py config/train_shakespeare_char.py --device=cpu --compile=False
--eval_iters=20 --log_interval=1 --block_size=64 --batch_size=12 --n_layer=4 --n_head=4
--n_embd=128 --max_iters=2000 --lr_decay_iters=2000 --dropout=0.0`, with
data/shakespeare_char/prepare.py's char-level split (sorted characters, first 90% train, last 10% val).
What is left out is what the CPU run does not execute: DDP, autocast / GradScaler (no-ops in fp32 on
CPU), torch.compile, checkpoints, wandb, from_pretrained, generate, the manual-attention fallback.
One deliberate difference: nanoGPT takes one more optimizer step after its eval at iter max_iters;
this port stops at that eval (the figures are the same, the step is never evaluated).

`--config gpu` is config/train_shakespeare_char.py as nanoGPT's README runs it on a GPU (6 layers,
6 heads, n_embd 384, block 256, batch 64, 5000 iters, dropout 0.2, eval_iters 200, log_interval 10);
with `--device cuda` the port does what train.py does there: bfloat16 autocast (float16 with a
GradScaler where bfloat16 is missing), TF32 matmuls, pinned non-blocking batches, fused AdamW, and
with `--compile` torch.compile of the model.

Timing: each iteration (forward, next batch, backward, clip, AdamW step, loss.item()) is timed on its
own, so eval time is excluded; the median skips the first 10 iterations. On a GPU the loss is read
(a device sync) every log_interval iterations as nanoGPT does, so the timed unit is that window,
divided by its iterations; torch.compile's first compile falls in the first, skipped, window.
`--lockstep` pauses at each eval point for bench/train.py to interleave the two runs. torch runs
--threads threads, by default one per core this process may run on: as many as JAX uses on the other
side of a race. Needs torch (any CPU build), never imports jax. Prints and returns a JSON record (the
last line of stdout).
"""

from __future__ import annotations

import argparse
import inspect
import json
import math
import os
import sys
import time
from contextlib import nullcontext
from dataclasses import asdict, dataclass, replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn as nn  # noqa: E402
from torch.nn import functional as F  # noqa: E402

from bench.machine import cpu_cores  # noqa: E402
from bench.timing import median  # noqa: E402

DEFAULT_DATA = os.environ.get("JAXATTN_SHAKESPEARE")  # else --data is required
LOCKSTEP_PREFIX = "LOCKSTEP at iter"
WARMUP_ITERS_EXCLUDED = 10  # first iterations left out of the median (allocator and thread-pool warm-up)


# ----------------------------------------------------------------------------- model.py

@dataclass
class GPTConfig:
    block_size: int = 64
    vocab_size: int = 65
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0
    bias: bool = False  # train.py's default: no bias in Linear and LayerNorm


class LayerNorm(nn.Module):
    """LayerNorm with an optional bias (PyTorch's has no bias=False)."""

    def __init__(self, ndim, bias):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(ndim))
        self.bias = nn.Parameter(torch.zeros(ndim)) if bias else None

    def forward(self, input):
        return F.layer_norm(input, self.weight.shape, self.weight, self.bias, 1e-5)


class CausalSelfAttention(nn.Module):
    def __init__(self, config):
        super().__init__()
        assert config.n_embd % config.n_head == 0
        self.c_attn = nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias)
        self.c_proj = nn.Linear(config.n_embd, config.n_embd, bias=config.bias)
        self.resid_dropout = nn.Dropout(config.dropout)
        self.n_head, self.n_embd, self.dropout = config.n_head, config.n_embd, config.dropout

    def forward(self, x):
        B, T, C = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        k = k.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        q = q.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        v = v.view(B, T, self.n_head, C // self.n_head).transpose(1, 2)  # (B, nh, T, hs)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=None,
                                           dropout_p=self.dropout if self.training else 0, is_causal=True)
        y = y.transpose(1, 2).contiguous().view(B, T, C)  # (B, T, C)
        return self.resid_dropout(self.c_proj(y))


class MLP(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.c_fc = nn.Linear(config.n_embd, 4 * config.n_embd, bias=config.bias)
        self.gelu = nn.GELU()  # exact (erf) GELU
        self.c_proj = nn.Linear(4 * config.n_embd, config.n_embd, bias=config.bias)
        self.dropout = nn.Dropout(config.dropout)

    def forward(self, x):
        return self.dropout(self.c_proj(self.gelu(self.c_fc(x))))


class Block(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.ln_1 = LayerNorm(config.n_embd, bias=config.bias)
        self.attn = CausalSelfAttention(config)
        self.ln_2 = LayerNorm(config.n_embd, bias=config.bias)
        self.mlp = MLP(config)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class GPT(nn.Module):
    def __init__(self, config):
        super().__init__()
        self.config = config
        self.transformer = nn.ModuleDict(dict(
            wte=nn.Embedding(config.vocab_size, config.n_embd),
            wpe=nn.Embedding(config.block_size, config.n_embd),
            drop=nn.Dropout(config.dropout),
            h=nn.ModuleList([Block(config) for _ in range(config.n_layer)]),
            ln_f=LayerNorm(config.n_embd, bias=config.bias),
        ))
        self.lm_head = nn.Linear(config.n_embd, config.vocab_size, bias=False)
        self.transformer.wte.weight = self.lm_head.weight  # weight tying
        self.apply(self._init_weights)
        for pn, p in self.named_parameters():  # GPT-2's scaled init of the residual projections
            if pn.endswith("c_proj.weight"):
                torch.nn.init.normal_(p, mean=0.0, std=0.02 / math.sqrt(2 * config.n_layer))

    def _init_weights(self, module):
        if isinstance(module, nn.Linear):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if module.bias is not None:
                torch.nn.init.zeros_(module.bias)
        elif isinstance(module, nn.Embedding):
            torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)

    def forward(self, idx, targets):
        t = idx.size(1)
        pos = torch.arange(0, t, dtype=torch.long, device=idx.device)  # (t)
        x = self.transformer.drop(self.transformer.wte(idx) + self.transformer.wpe(pos))  # (b, t, n_embd)
        for block in self.transformer.h:
            x = block(x)
        logits = self.lm_head(self.transformer.ln_f(x))  # (b, t, vocab)
        loss = F.cross_entropy(logits.view(-1, logits.size(-1)), targets.view(-1), ignore_index=-1)
        return logits, loss

    def configure_optimizers(self, weight_decay, learning_rate, betas, device_type="cpu"):
        """AdamW, decay on every >= 2-D tensor (matmul weights and the tied embedding), none on norms;
        fused on CUDA where torch has it (as nanoGPT)."""
        params = [p for p in self.parameters() if p.requires_grad]
        groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
        fused = device_type == "cuda" and "fused" in inspect.signature(torch.optim.AdamW).parameters
        return torch.optim.AdamW(groups, lr=learning_rate, betas=betas, fused=fused)


# ----------------------------------------------------------------------------- train.py

@dataclass
class TrainArgs:
    """config/train_shakespeare_char.py with the baby-run command-line overrides."""

    max_iters: int = 2000
    eval_interval: int = 250
    eval_iters: int = 20
    batch_size: int = 12
    block_size: int = 64
    learning_rate: float = 1e-3
    min_lr: float = 1e-4
    warmup_iters: int = 100
    lr_decay_iters: int = 2000
    weight_decay: float = 1e-1
    beta1: float = 0.9
    beta2: float = 0.99
    grad_clip: float = 1.0
    seed: int = 1337
    log_interval: int = 1  # the loss is read (a device sync) every log_interval iterations
    n_layer: int = 4
    n_head: int = 4
    n_embd: int = 128
    dropout: float = 0.0


# config/train_shakespeare_char.py as run on a GPU (nanoGPT's README): its own values, unchanged
GPU_ARGS = TrainArgs(max_iters=5000, eval_interval=250, eval_iters=200, batch_size=64, block_size=256,
                     learning_rate=1e-3, min_lr=1e-4, warmup_iters=100, lr_decay_iters=5000, beta2=0.99,
                     grad_clip=1.0, weight_decay=1e-1, log_interval=10, n_layer=6, n_head=6, n_embd=384,
                     dropout=0.2)
PRESETS = {"baby": TrainArgs(), "gpu": GPU_ARGS}


class Device:
    """Where the run goes and what train.py does there: autocast, pinned batches, the sync."""

    def __init__(self, name: str):
        self.name, self.type = name, "cuda" if "cuda" in name else "cpu"
        self.dtype = "float32"
        if self.type == "cuda":
            torch.backends.cuda.matmul.allow_tf32 = True
            torch.backends.cudnn.allow_tf32 = True
            self.dtype = "bfloat16" if torch.cuda.is_bf16_supported() else "float16"
        ptdtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[self.dtype]
        self.ctx = nullcontext() if self.type == "cpu" else torch.amp.autocast(device_type=self.type,
                                                                               dtype=ptdtype)

    def put(self, x, y):
        if self.type == "cuda":
            return x.pin_memory().to(self.name, non_blocking=True), y.pin_memory().to(self.name, non_blocking=True)
        return x, y

    def describe(self) -> str:
        if self.type == "cuda":
            return f"{torch.cuda.get_device_name(0)}, {self.dtype} autocast"
        return "cpu, float32"


def load_splits(path: str) -> tuple[np.ndarray, np.ndarray, int]:
    """prepare.py: ids in the sorted character set as uint16, first 90% train, last 10% val."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    stoi = {ch: i for i, ch in enumerate(sorted(set(text)))}
    ids = np.array([stoi[c] for c in text], dtype=np.uint16)
    n = len(text)
    return ids[:int(n * 0.9)], ids[int(n * 0.9):], len(stoi)


def get_batch(data: np.ndarray, a: TrainArgs, device: Device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """train.py's get_batch: torch.randint offsets, numpy slices cast to int64; x, y (B, T)."""
    ix = torch.randint(len(data) - a.block_size, (a.batch_size,))
    x = torch.stack([torch.from_numpy((data[i:i + a.block_size]).astype(np.int64)) for i in ix])
    y = torch.stack([torch.from_numpy((data[i + 1:i + 1 + a.block_size]).astype(np.int64)) for i in ix])
    return device.put(x, y) if device is not None else (x, y)


@torch.no_grad()
def estimate_loss(model: GPT, splits: dict, a: TrainArgs, device: Device | None = None) -> dict:
    out = {}
    model.eval()
    for split, data in splits.items():
        losses = torch.zeros(a.eval_iters)
        for k in range(a.eval_iters):
            X, Y = get_batch(data, a, device)
            with device.ctx if device is not None else nullcontext():
                losses[k] = model(X, Y)[1].item()
        out[split] = losses.mean().item()
    model.train()
    return out


def get_lr(it: int, a: TrainArgs) -> float:
    """Linear warmup, cosine decay to min_lr at lr_decay_iters, then min_lr."""
    if it < a.warmup_iters:
        return a.learning_rate * (it + 1) / (a.warmup_iters + 1)
    if it > a.lr_decay_iters:
        return a.min_lr
    decay_ratio = (it - a.warmup_iters) / (a.lr_decay_iters - a.warmup_iters)
    coeff = 0.5 * (1.0 + math.cos(math.pi * decay_ratio))
    return a.min_lr + coeff * (a.learning_rate - a.min_lr)


def train_step(model, optimizer, X, Y, next_batch, a: TrainArgs, ctx=None, scaler=None):
    """One iteration of train.py's loop body (gradient_accumulation_steps = 1); returns (loss, X, Y),
    the loss a tensor (reading it is the device sync, every log_interval iterations as nanoGPT)."""
    with ctx if ctx is not None else nullcontext():
        _, loss = model(X, Y)
    X, Y = next_batch()
    if scaler is None:  # the CPU run, float32 (train.py's GradScaler is disabled there)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        optimizer.step()
    else:
        scaler.scale(loss).backward()
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), a.grad_clip)
        scaler.step(optimizer)
        scaler.update()
    optimizer.zero_grad(set_to_none=True)
    return loss, X, Y


def wait_for_turn(iter_num: int) -> float:
    """Lockstep mode: report reaching an eval point, then block until the driver says go.

    bench/train.py runs our training and this one in turns of one eval interval each, so that
    both are timed in the same minutes of a machine whose speed drifts.
    """
    start = time.perf_counter()
    print(f"{LOCKSTEP_PREFIX} {iter_num}", flush=True)
    if sys.stdin.readline().strip() != "go":
        raise SystemExit("lockstep driver went away")
    return time.perf_counter() - start  # seconds spent waiting (left out of wall_s)


def window_ends(iter_num: int, a: TrainArgs) -> bool:
    """Whether the loss is read after iteration `iter_num`: every log_interval, and before each eval."""
    done = iter_num + 1
    return done % a.log_interval == 0 or done % a.eval_interval == 0 or done == a.max_iters


def run(data_path: str, a: TrainArgs, threads: int | None = None, log=print, lockstep: bool = False,
        device: str = "cpu", compile: bool = False) -> dict:
    """The run; its figures as a JSON-ready dict. With `lockstep`, pauses at every eval point. `threads`:
    torch's (default: every core this process may run on, as many as JAX uses on the other side)."""
    wall_start = time.perf_counter()
    torch.set_num_threads(threads or cpu_cores())
    torch.manual_seed(a.seed)
    dev = Device(device)
    train_data, val_data, vocab_size = load_splits(data_path)
    model = GPT(GPTConfig(block_size=a.block_size, vocab_size=vocab_size, n_layer=a.n_layer, n_head=a.n_head,
                          n_embd=a.n_embd, dropout=a.dropout)).to(dev.name)
    params = sum(p.numel() for p in model.parameters())
    optimizer = model.configure_optimizers(a.weight_decay, a.learning_rate, (a.beta1, a.beta2), dev.type)
    scaler = None if dev.type == "cpu" else torch.amp.GradScaler(dev.type, enabled=dev.dtype == "float16")
    if compile:
        model = torch.compile(model)
    splits = {"train": train_data, "val": val_data}
    evals, windows, waited = [], [], 0.0  # windows: (first iter, iters, seconds)
    X, Y = get_batch(train_data, a, dev)
    start = (0, time.perf_counter())
    for iter_num in range(a.max_iters + 1):
        lr = get_lr(iter_num, a)
        for group in optimizer.param_groups:
            group["lr"] = lr
        if iter_num % a.eval_interval == 0 or iter_num == a.max_iters:
            if lockstep:
                waited += wait_for_turn(iter_num)
            losses = estimate_loss(model, splits, a, dev)
            evals.append({"iter": iter_num, **losses})
            log(f"step {iter_num}: train loss {losses['train']:.4f}, val loss {losses['val']:.4f}", flush=True)
            start = (iter_num, time.perf_counter())
        if iter_num == a.max_iters:
            break
        loss, X, Y = train_step(model, optimizer, X, Y, lambda: get_batch(train_data, a, dev), a, dev.ctx, scaler)
        if window_ends(iter_num, a):
            loss.item()  # the sync
            now = time.perf_counter()
            windows.append((start[0], iter_num + 1 - start[0], now - start[1]))
            start = (iter_num + 1, now)
    per_iter = [seconds / n for first, n, seconds in windows if first >= WARMUP_ITERS_EXCLUDED] or \
        [seconds / n for _, n, seconds in windows]
    median_s = median(per_iter)
    train_s = sum(seconds for _, _, seconds in windows)
    return {
        "impl": f"nanoGPT (port: bench/nanogpt_baseline.py, torch {'compiled' if compile else 'eager'})",
        "iters": a.max_iters, "device": dev.describe(), "compiled": compile,
        "median_ms_per_iter": 1e3 * median_s, "median_tokens_per_s": a.batch_size * a.block_size / median_s,
        "fastest_ms_per_iter": 1e3 * min(per_iter), "final_val_loss": evals[-1]["val"],
        "final_train_loss": evals[-1]["train"], "evals": evals, "train_s": train_s,
        "first_window_s": windows[0][2] if windows else None,  # with --compile: torch.compile's compile in it
        "wall_s": time.perf_counter() - wall_start - waited,
        "params": params, "data": os.path.basename(data_path), "args": asdict(a),
        "env": {"torch": torch.__version__, "threads": torch.get_num_threads(), "cpus": os.cpu_count()},
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--data", default=DEFAULT_DATA, required=DEFAULT_DATA is None,
                        help="Tiny Shakespeare text file (default $JAXATTN_SHAKESPEARE)")
    parser.add_argument("--config", choices=sorted(PRESETS), default="baby",
                        help="baby: the CPU baby run (default); gpu: config/train_shakespeare_char.py as is")
    parser.add_argument("--max-iters", type=int, help="default: the config's (2000 baby, 5000 gpu)")
    parser.add_argument("--lr-decay-iters", type=int, help="default: the config's")
    parser.add_argument("--eval-interval", type=int, help="default: the config's (250)")
    parser.add_argument("--threads", type=int, default=cpu_cores(),
                        help="torch threads (default: the cores this process may run on, %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    parser.add_argument("--compile", action="store_true", help="torch.compile the model (nanoGPT does on a GPU)")
    parser.add_argument("--json", help="also write the JSON record to this file")
    parser.add_argument("--lockstep", action="store_true",
                        help=f"at each eval point print '{LOCKSTEP_PREFIX} <iter>' and wait for 'go' on stdin")
    args = parser.parse_args(argv)
    changes = {k: v for k, v in (("max_iters", args.max_iters), ("lr_decay_iters", args.lr_decay_iters),
                                 ("eval_interval", args.eval_interval)) if v is not None}
    record = run(args.data, replace(PRESETS[args.config], **changes), args.threads, lockstep=args.lockstep,
                 device=args.device, compile=args.compile)
    record["config"] = args.config
    if args.json:
        with open(args.json, "w") as f:
            json.dump(record, f, indent=2)
    print(json.dumps(record))
    return record


if __name__ == "__main__":
    main()
