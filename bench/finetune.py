"""LoRA fine-tuning steps: jaxattn's training program beside PEFT + transformers, on the same weights and threads.

    PYTHONPATH=$PWD python bench/finetune.py [--rounds 2] [--steps 4] [--threads N] [--seq 256] [--batch 8]
        [--rank 16] [--runners jax,peft] [--out bench/results/finetune]
    PYTHONPATH=$PWD python bench/finetune.py --quick     # a smoke run: a tiny Llama, one round

One optimizer step of LoRA fine-tuning (rank --rank, alpha twice it, no dropout, on q, k, v, o, gate,
up and down of every layer; AdamW) on a batch of --batch sequences of --seq tokens, on one set of random
weights of SmolLM2-135M's shape (bench/serve.py's `smollm2` checkpoint: Llama, 30 layers, d 576, 9 query /
3 kv heads of 64, MLP 1536, vocab 49152, tied; random init, seed 0, written once with
`jaxattn.hf.save_pretrained` under --cache-dir), each runner starting from that directory:

* `jax`: `train.run.steps.build_programs` of a run with `train.init_from = "hf:DIR"` and a `[lora]` table, as
  `python -m train.tiny_lm` builds it (the kernels "auto" resolves to on this machine; the base float32,
  or --base-dtype bfloat16), one step per call on windows of --seq + 1 tokens.
* `jax_bf16`: the same with bfloat16 matmul operands and float32 sums (`runtime.matmul=bfloat16_cpu`, the
  numbers of `torch.autocast`), which "auto" picks only on a CPU with AMX-BF16.
* `jax_bf16_base`: `jax_bf16` with the frozen base held in bfloat16 (`lora.base_dtype = "bfloat16"`).
* `jax_bf16_compute`: `jax_bf16_base` computing in bfloat16 (`--set model.dtype=bfloat16`): activations kept
  in bfloat16 for the backward pass, as `torch.autocast` keeps them.
* `jax_adam8bit`: `jax_bf16_compute` with AdamW's moments in 8 bits (`train.adam_states = "int8"`,
  train.run.adam8bit: bitsandbytes' block-wise 8-bit Adam).
* `jax_scan`, `jax_adam8bit_scan` (only when named in --runners): `jax_bf16_compute` and `jax_adam8bit` with
  the layers under one scan (`--set model.scan_layers=true`): 14 stacked adapter tensors instead of 420.
* `peft`: transformers' `LlamaForCausalLM` (float32, attn_implementation "sdpa") wrapped by
  `peft.get_peft_model`, `torch.optim.AdamW` over the adapters, `loss.backward()` and `step()` on
  --seq tokens with labels; torch threads = --threads.
* `peft_bf16`: `peft` with the step's forward under `torch.autocast("cpu", torch.bfloat16)`.
* `products_xla`, `products_torch`: the floor under a step at bfloat16 precision, no step at all: the matrix
  products the chain rule asks of this LoRA step (bench/step_products.py), each distinct one timed alone
  (bfloat16 operands, float32 sums), by XLA and by torch, summed over the step.

Each runner runs in a fresh process restricted to --threads cores, once per round, the runners in turns
(the order reversed every other round); inside, one untimed step compiles (or warms up), then --steps
timed steps; reported: the median over rounds of each process's median ms/step, its peak resident
memory (the kernel's, the whole process: the loaded base included), the adapters' parameters and their
optimizer state's bytes, beside what a full fine-tune's AdamW state would take (two float32 moments per
parameter). Writes --out.json and --out.md with the CPU named, the command, the checks of the
targets (jaxattn at least 1.5x PEFT's speed, peak memory no higher, optimizer state under 2% of a full
fine-tune's) and the floor beside them: what 1.5x PEFT's autocast step leaves for everything in a step
but its products.

    python -m bench.fresh bench.finetune:run_case SPEC_JSON     # one cell, what each fresh process runs
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
from pathlib import Path

from bench import fresh, step_products
from bench.machine import (
    cpu_cores,
    describe_machine,
    load_average,
    machine_line,
    pin_to_cores,
    portable_command,
    write_results,
)
from bench.quant import quick_config  # the smoke run's tiny Llama, as the decoding bench's
from bench.serve import default_cache_dir, ensure_checkpoint

ROOT = Path(__file__).resolve().parent.parent
TARGETS = ("q", "k", "v", "o", "gate", "up", "down")
PEFT_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
SPEEDUP_TARGET, STATE_FRACTION_TARGET = 1.5, 0.02
SEED = 0


def windows(spec: dict, vocab: int, count: int):
    """`count` batches of token windows `[B, seq + 1]`, the same for every runner."""
    import numpy as np
    rng = np.random.default_rng(SEED)
    return rng.integers(0, vocab, size=(count, spec["batch"], spec["seq"] + 1), dtype=np.int64)


def run_jax(spec: dict) -> dict:
    """jaxattn's training program of a LoRA run from the checkpoint: one optimizer step per call."""
    import jax
    import numpy as np

    from bench.timing import time_call
    from jaxattn import hf
    from train.checkpoints import init_from
    from train.config import load_config
    from train.run import runtime as runtime_lib
    from train.run.host_memory import release_freed_memory
    from train.run.steps import build_programs
    lora = {"rank": spec["rank"], "alpha": 2.0 * spec["rank"], "targets": list(TARGETS),
            "base_dtype": spec["base_dtype"]}
    overrides = [f"train.init_from='hf:{spec['checkpoint']}'", f"train.batch_size={spec['batch']}",
                 f"train.block_size={spec['seq']}", "train.steps_per_dispatch=1", "train.grad_clip=0",
                 "train.weight_decay=0.0", "train.warmup_iters=0", "runtime.mesh='data:1'",
                 f"runtime.matmul={json.dumps(spec.get('matmul', 'auto'))}",
                 f"train.adam_states={json.dumps(spec.get('adam_states', 'float32'))}",
                 *(f"lora.{k}={json.dumps(v)}" for k, v in lora.items())]
    config = load_config(overrides=overrides)
    # the bench's checkpoint has no tokenizer (random weights; the batches are ids): read as init_from.load reads
    # it, its weights float32 and hashed, without the tokenizer no step uses
    model_config, params = hf.load_pretrained(spec["checkpoint"], dtype="float32")
    params = jax.tree.map(lambda x: np.asarray(x, np.float32), params)
    initial = init_from.Initial(source=config.train.init_from, config=model_config, params=params, tokenizer=None,
                                digest=init_from.digest(params))
    del params
    settings = {k: spec[k] for k in ("dtype", "scan_layers") if spec.get(k)}
    config = init_from.with_base_model(config, initial, settings or None)
    runtime = runtime_lib.start(config.runtime, config.train.batch_size, model=config.model)
    programs = build_programs(config, runtime, initial)
    del initial  # the base lives on in the programs' frozen part
    state = programs.init(config.train.seed)
    batches = [np.asarray(b, np.int32)[None] for b in windows(spec, config.model.vocab_size, spec["steps"] + 1)]
    compiled = programs.train_steps.lower(state, programs.train_inputs(1, spec["batch"]), programs.frozen).compile()
    release_freed_memory()  # as train.run.loop does once its programs are compiled
    holder = {"state": state, "i": 0}

    def step():
        holder["state"], (holder["losses"], _, _) = compiled(holder["state"], batches[holder["i"] % len(batches)],
                                                             programs.frozen)
        holder["i"] += 1
        return holder["losses"]
    timing = time_call(step, spec["steps"])
    adapters = holder["state"]["params"]
    opt_bytes = sum(x.nbytes for x in jax.tree.leaves(holder["state"]["opt_state"]))
    return {"ms_per_step": 1000 * timing.median_s, "times_s": timing.times_s, "compile_s": timing.compile_s,
            "trainable_params": int(sum(x.size for x in jax.tree.leaves(adapters))),
            "optimizer_state_bytes": int(opt_bytes), "kernels": runtime.kernels.to_dict(),
            "last_loss": float(np.asarray(holder["losses"])[-1])}


def run_peft(spec: dict) -> dict:
    """transformers + PEFT: the same adapters on the same checkpoint, torch's AdamW, one step per call
    (under `torch.autocast("cpu", torch.bfloat16)` where `spec["autocast"]`)."""
    import contextlib

    import peft
    import torch
    import transformers

    from bench.timing import time_call
    torch.set_num_threads(spec["threads"])
    model = transformers.AutoModelForCausalLM.from_pretrained(spec["checkpoint"], torch_dtype=torch.float32,
                                                              attn_implementation="sdpa")
    settings = peft.LoraConfig(r=spec["rank"], lora_alpha=2 * spec["rank"], lora_dropout=0.0,
                               target_modules=list(PEFT_MODULES), task_type="CAUSAL_LM")
    model = peft.get_peft_model(model, settings)
    model.train()
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-4, weight_decay=0.0)
    batches = [torch.from_numpy(b[:, :-1].copy()) for b in windows(spec, model.config.vocab_size, spec["steps"] + 1)]
    last = {"i": 0, "loss": None}

    def step():
        ids = batches[last["i"] % len(batches)]
        with torch.autocast("cpu", dtype=torch.bfloat16) if spec.get("autocast") else contextlib.nullcontext():
            loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        last["i"] += 1
        last["loss"] = float(loss.detach())
        return last["loss"]
    timing = time_call(step, spec["steps"])
    state_bytes = sum(t.numel() * t.element_size() for s in optimizer.state.values() for t in s.values()
                      if torch.is_tensor(t))
    return {"ms_per_step": 1000 * timing.median_s, "times_s": timing.times_s, "compile_s": timing.compile_s,
            "trainable_params": int(sum(p.numel() for p in trainable)), "optimizer_state_bytes": int(state_bytes),
            "last_loss": last["loss"], "torch": torch.__version__, "peft": peft.__version__, "transformers": transformers.__version__}


def run_jax_bf16(spec: dict) -> dict:
    """`run_jax` with bfloat16 matmul operands and float32 sums (`runtime.matmul = "bfloat16_cpu"`), the base
    still float32: what "auto" picks only on a CPU with AMX-BF16 (`jaxattn.kernels.select`)."""
    return run_jax({**spec, "matmul": "bfloat16_cpu"})


def run_jax_bf16_base(spec: dict) -> dict:
    """`run_jax_bf16` with the frozen base held in bfloat16 (`lora.base_dtype = "bfloat16"`)."""
    return run_jax({**spec, "matmul": "bfloat16_cpu", "base_dtype": "bfloat16"})


def run_jax_bf16_compute(spec: dict) -> dict:
    """`run_jax_bf16_base` computing in bfloat16 (`--set model.dtype=bfloat16`: activations and matmul operands
    bfloat16, softmax and norm statistics float32): what `torch.autocast` keeps for its backward pass."""
    return run_jax({**spec, "matmul": "bfloat16_cpu", "base_dtype": "bfloat16", "dtype": "bfloat16"})


def run_jax_adam8bit(spec: dict) -> dict:
    """`run_jax_bf16_compute` with AdamW's moments in 8 bits (`train.adam_states = "int8"`)."""
    return run_jax_bf16_compute({**spec, "adam_states": "int8"})


def run_jax_scan(spec: dict) -> dict:
    """`run_jax_bf16_compute` with the layers under one scan (`--set model.scan_layers=true`): 14 stacked adapter
    tensors instead of 420, compiled once."""
    return run_jax_bf16_compute({**spec, "scan_layers": True})


def run_jax_adam8bit_scan(spec: dict) -> dict:
    """`run_jax_adam8bit` with the layers under one scan: the 8-bit moments of 14 stacked tensors."""
    return run_jax_adam8bit({**spec, "scan_layers": True})


def run_peft_bf16(spec: dict) -> dict:
    """`run_peft` under `torch.autocast("cpu", torch.bfloat16)`: the peer's bfloat16 operands."""
    return run_peft({**spec, "autocast": True})


def products_of(spec: dict) -> list[step_products.Product]:
    """The products the chain rule asks of this runner's LoRA step, for the checkpoint's model."""
    from jaxattn.hf.architectures import config_from_hf
    from jaxattn.hf.checkpoint import read_config_json
    _, model = config_from_hf(read_config_json(Path(spec["checkpoint"])), "float32")
    return step_products.step_products(model, spec["batch"], spec["seq"], spec["rank"], TARGETS)


def run_products_xla(spec: dict) -> dict:
    """The step's products alone with XLA (bfloat16 operands, float32 sums), each at its best."""
    return step_products.time_products_xla(products_of(spec), rounds=spec["steps"] + 2)


def run_products_torch(spec: dict) -> dict:
    """The step's products alone with torch's `matmul` of bfloat16 tensors, each at its best."""
    return step_products.time_products_torch(products_of(spec), spec["threads"], rounds=spec["steps"] + 2)


CELLS = {"jax": run_jax, "jax_bf16": run_jax_bf16, "jax_bf16_base": run_jax_bf16_base,
         "jax_bf16_compute": run_jax_bf16_compute, "jax_adam8bit": run_jax_adam8bit, "jax_scan": run_jax_scan,
         "jax_adam8bit_scan": run_jax_adam8bit_scan, "peft": run_peft, "peft_bf16": run_peft_bf16,
         "products_xla": run_products_xla, "products_torch": run_products_torch}
JAX_RUNNERS = ("jax", "jax_bf16", "jax_bf16_base", "jax_bf16_compute", "jax_adam8bit", "jax_scan",
               "jax_adam8bit_scan")
STATE_RUNNERS = ("jax", "jax_adam8bit", "jax_adam8bit_scan")  # float32 moments, 8-bit ones
# the scanned runners only on request: their step is slower (docs/performance.md §17)
FLOOR_RUNNERS = ("products_xla", "products_torch")  # no step: the step's products alone
DEFAULT_RUNNERS = (*(r for r in JAX_RUNNERS if not r.endswith("scan")), "peft", "peft_bf16", *FLOOR_RUNNERS)


def run_case(spec: dict) -> dict:
    """One runner on `spec["threads"]` cores: what each fresh process runs."""
    pin_to_cores(spec["threads"])
    return CELLS[spec["runner"]](spec)


# ---------------------------------------------------------------- the driver

def measure(specs: list[dict], rounds: int, timeout: float) -> dict[str, dict]:
    """Each runner once a round in a fresh process, in turns; per runner its spec, every round's record
    (with the process's peak resident memory) and `failed` (then it is not run again)."""
    cells = {s["runner"]: {"spec": s, "records": []} for s in specs}
    order = list(cells)
    for round_index in range(rounds):
        for name in order if round_index % 2 == 0 else order[::-1]:
            cell = cells[name]
            if "failed" in cell:
                continue
            print(f"round {round_index + 1} of {rounds}: {name}", file=sys.stderr, flush=True)
            try:
                done = fresh.run(fresh.function_argv("bench.finetune:run_case", cell["spec"]), what=name,
                                 env=fresh.environment(cell["spec"]["threads"]), timeout=timeout)
            except fresh.FreshProcessError as err:
                cell["failed"] = str(err)
                continue
            cell["records"].append({**done.json(), "peak_rss_bytes": done.peak_rss_bytes,
                                    "load_average": load_average()})
    return cells


def summarize(cells: dict[str, dict], full_params: int) -> list[dict]:
    """One row per runner: medians over rounds (for the floor's runners, the products' ms and GFLOP/s)."""
    rows = []
    for name, cell in cells.items():
        records = cell["records"]
        row = {"runner": name, "rounds": len(records), "failed": cell.get("failed")}
        if records:
            row["ms_per_step"] = statistics.median(r["ms_per_step"] for r in records)
        if records and name in FLOOR_RUNNERS:
            row.update(flops=records[0]["flops"], gflops=statistics.median(r["gflops"] for r in records))
        elif records:
            row.update(peak_rss_mb=statistics.median(r["peak_rss_bytes"] for r in records) / 2**20,
                       trainable_params=records[0]["trainable_params"],
                       optimizer_state_mb=records[0]["optimizer_state_bytes"] / 2**20,
                       state_fraction=records[0]["optimizer_state_bytes"] / (8 * full_params),
                       compile_s=statistics.median(r["compile_s"] for r in records))
        rows.append(row)
    return rows


def floor(rows: list[dict]) -> dict | None:
    """The step's products alone beside the steps at bfloat16 precision: what 1.5x PEFT's autocast step
    leaves for everything else, and what each bfloat16 step spends beyond its library's products (None
    without the floor's runners and PEFT's autocast step)."""
    by = {r["runner"]: r for r in rows if r.get("ms_per_step")}
    if "peft_bf16" not in by or not any(r in by for r in FLOOR_RUNNERS):
        return None
    target = by["peft_bf16"]["ms_per_step"] / SPEEDUP_TARGET
    library = {"products_xla": ("jax_bf16_compute", "jax_adam8bit"), "products_torch": ("peft_bf16",)}
    out = {"target_ms": target, "products": []}
    for name in (r for r in FLOOR_RUNNERS if r in by):
        products = by[name]["ms_per_step"]
        steps = {step: by[step]["ms_per_step"] - products for step in library[name] if step in by}
        out["products"].append({"runner": name, "ms": products, "tflop": by[name]["flops"] / 1e12,
                                "gflops": by[name]["gflops"], "left_for_the_rest_ms": target - products,
                                "the_rest_ms": steps})
    return out


def checks(rows: list[dict]) -> list[dict]:
    by = {r["runner"]: r for r in rows if r.get("ms_per_step")}
    out = []
    pairs = [(mine, peer) for mine in JAX_RUNNERS
             for peer in ("peft", "peft_bf16")
             if mine in by and peer in by and (peer == "peft" or mine != "jax")]  # bfloat16 beside both peers
    for mine, peer in pairs:
        speedup = by[peer]["ms_per_step"] / by[mine]["ms_per_step"]
        out.append({"check": f"jaxattn LoRA step ({mine}) at least {SPEEDUP_TARGET}x {peer}'s",
                    "value": f"{speedup:.2f}x", "holds": speedup >= SPEEDUP_TARGET})
    for mine, peer in pairs:
        out.append({"check": f"peak memory ({mine}) no higher than {peer}'s",
                    "value": f"{by[mine]['peak_rss_mb']:,.0f} MB vs {by[peer]['peak_rss_mb']:,.0f} MB",
                    "holds": by[mine]["peak_rss_mb"] <= by[peer]["peak_rss_mb"]})
    for mine in (m for m in STATE_RUNNERS if m in by):
        fraction = by[mine]["state_fraction"]
        out.append({"check": f"optimizer state ({mine}) under {100 * STATE_FRACTION_TARGET:.0f}% of a full "
                             "fine-tune's", "value": f"{100 * fraction:.2f}%",
                    "holds": fraction < STATE_FRACTION_TARGET})
    return out


def floor_markdown(record: dict) -> list[str]:
    """The floor's section: the products alone beside 1.5x PEFT's autocast step, then each distinct product
    by XLA and by torch."""
    found = record.get("floor")
    if not found:
        return []
    lines = ["", "## The floor: the step's products alone", "",
             f"1.5x PEFT's autocast step is {found['target_ms']:,.0f} ms. The products the chain rule asks of "
             "this step (bench/step_products.py), each distinct one timed alone at its best with bfloat16 "
             "operands and float32 sums, summed over the step:", "",
             "| products by | TFLOP | ms | GFLOP/s | left of 1.5x PEFT's autocast step for all the rest, ms "
             "| the rest in the steps, ms |", "| --- | ---: | ---: | ---: | ---: | --- |"]
    for p in found["products"]:
        rest = ", ".join(f"{step} {ms:,.0f}" for step, ms in p["the_rest_ms"].items()) or "–"
        lines.append(f"| {p['runner']} | {p['tflop']:.3g} | {p['ms']:,.0f} | {p['gflops']:,.0f} | "
                     f"{p['left_for_the_rest_ms']:,.0f} | {rest} |")
    shapes = {name: {(s["batch"], s["m"], s["k"], s["n"]): s for s in cell["records"][0]["shapes"]}
              for name, cell in record.get("cells", {}).items() if name in FLOOR_RUNNERS and cell["records"]}
    if shapes:
        names = [n for n in FLOOR_RUNNERS if n in shapes]
        every = list(dict.fromkeys(shape for n in names for shape in shapes[n]))
        lines += ["", "Each distinct product (of the first round), `[batch, m, k] @ [batch, k, n]`:", "",
                  "| batch, m, k, n | a step | " + " | ".join(f"{n} ms, GFLOP/s" for n in names) + " |",
                  "| --- | ---: | " + " | ".join("---:" for _ in names) + " |"]
        for shape in every:
            count = next(shapes[n][shape]["count"] for n in names if shape in shapes[n])
            cells = [f"{shapes[n][shape]['ms_each']:.3f}, {shapes[n][shape]['gflops']:,.0f}" if shape in shapes[n]
                     else "–" for n in names]
            lines.append(f"| {', '.join(map(str, shape))} | {count} | " + " | ".join(cells) + " |")
    return lines


def markdown(record: dict) -> str:
    a = record["settings"]
    lines = ["# LoRA fine-tuning step: jaxattn beside PEFT + transformers", "",
             f"Machine: {machine_line(record['machine'])}.", "",
             f"Command: `{record['command']}`", "",
             f"Model: {record['model']}; batch {a['batch']} x {a['seq']} tokens, rank {a['rank']} (alpha "
             f"{2 * a['rank']}) on {', '.join(TARGETS)}; {a['threads']} threads each; {a['rounds']} rounds of "
             f"{a['steps']} timed steps, medians.", "",
             "| runner | ms/step | vs PEFT | peak memory MB | trained params | optimizer state MB | of full FT's |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    peft_ms = next((r.get("ms_per_step") for r in record["rows"] if r["runner"] == "peft"), None)
    for r in (r for r in record["rows"] if r["runner"] not in FLOOR_RUNNERS):
        if not r.get("ms_per_step"):
            lines.append(f"| {r['runner']} | failed: {r.get('failed')} | | | | | |")
            continue
        versus = f"{peft_ms / r['ms_per_step']:.2f}x" if peft_ms else "–"
        lines.append(f"| {r['runner']} | {r['ms_per_step']:,.0f} | {versus} | {r['peak_rss_mb']:,.0f} | "
                     f"{r['trainable_params']:,} | {r['optimizer_state_mb']:,.1f} | {100 * r['state_fraction']:.2f}% |")
    lines += ["", "| check | value | holds |", "| --- | --- | --- |"]
    lines += [f"| {c['check']} | {c['value']} | {'yes' if c['holds'] else 'no'} |" for c in record["checks"]]
    lines += floor_markdown(record)
    failed = [r for r in record["rows"] if r["runner"] in FLOOR_RUNNERS and not r.get("ms_per_step")]
    lines += [f"\n{r['runner']} failed: {r.get('failed')}" for r in failed]
    return "\n".join(lines) + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(prog="bench/finetune.py", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--steps", type=int, default=4, help="timed steps per process")
    parser.add_argument("--threads", type=int, default=cpu_cores())
    parser.add_argument("--seq", type=int, default=256)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--base-dtype", choices=("float32", "bfloat16"), default="float32")
    parser.add_argument("--runners", default=",".join(DEFAULT_RUNNERS))
    parser.add_argument("--cache-dir", type=Path, default=default_cache_dir())
    parser.add_argument("--timeout", type=float, default=3600)
    parser.add_argument("--quick", action="store_true", help="a tiny Llama, one round, two steps (a smoke run)")
    parser.add_argument("--out", default=None, help="writes OUT.json and OUT.md (default bench/results/finetune; "
                        "--quick: a temporary directory, never the committed results)")
    args = parser.parse_args(argv)
    args.runners = [r.strip() for r in args.runners.split(",") if r.strip()]
    unknown = sorted(set(args.runners) - set(CELLS))
    if unknown:
        parser.error(f"--runners: unknown {unknown}; choose from {sorted(CELLS)}")
    if args.quick:
        args.rounds, args.steps, args.seq, args.batch, args.rank = 1, 2, 32, 2, 4
    return args


def main(argv=None) -> dict:
    args = parse_args(argv)
    name, config = ("quick", quick_config()) if args.quick else ("smollm2", None)
    checkpoint, facts = ensure_checkpoint(name, args.cache_dir, config)
    spec = {"checkpoint": str(checkpoint), "threads": args.threads, "steps": args.steps, "seq": args.seq,
            "batch": args.batch, "rank": args.rank, "base_dtype": args.base_dtype}
    cells = measure([{**spec, "runner": r} for r in args.runners], args.rounds, args.timeout)
    for cell in cells.values():  # the results name the checkpoint, not where this machine keeps it
        cell["spec"]["checkpoint"] = checkpoint.name
    rows = summarize(cells, facts["params"])
    record = {"machine": describe_machine(), "command": portable_command(sys.argv, ("--cache-dir", "--out")),
              "model": f"{name} ({facts['architecture']}, {facts['params']:,} parameters, random weights)",
              "settings": {**{k: v for k, v in spec.items() if k != "checkpoint"}, "rounds": args.rounds},
              "rows": rows, "checks": checks(rows), "floor": floor(rows), "cells": cells}
    out = Path(args.out) if args.out else (Path(tempfile.gettempdir()) / "jaxattn-finetune-quick" / "finetune"
                                           if args.quick else ROOT / "bench" / "results" / "finetune")
    write_results(out.parent, out.name, record, markdown(record))
    print(markdown(record))
    return record


if __name__ == "__main__":
    main()
