"""Training on a device mesh: speed and memory per device (`python bench/train.py --mesh`).

    PYTHONPATH=$PWD python bench/mesh.py [--iters 10] [--batch 16] [--gpt2-batch 8]

Two parts, each in fresh processes (the host device count is fixed when JAX starts):

1. The 10.7M-parameter config (configs/shakespeare_char.toml, with a smaller batch and a few
   iterations: a CPU is slow at it) trained on 1, 2 and 8 host devices under several meshes:
   median tokens/s, peak RSS of the process, and each device's share of parameters and
   optimizer state, with XLA's compiled per-device sizes (`memory_analysis`).
2. A GPT-2-small-shaped model (124M parameters, vocabulary padded to 50304 as nanoGPT does) on
   8 host devices, compiled only: XLA's per-device memory of one train step under data-only,
   FSDP and FSDP x tensor meshes, showing the parameters and Adam's moments falling with the
   FSDP and tensor sizes.

Writes bench/results/mesh.json and mesh.md.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench import fresh  # noqa: E402
from bench.machine import describe_machine, machine_line, portable_command, write_results  # noqa: E402

RESULTS = ROOT / "bench" / "results"
TRAIN_MESHES = (("data:1", 1), ("data:2", 2), ("fsdp:2", 2), ("data:8", 8), ("fsdp:8", 8),
                ("data:2,fsdp:2,tensor:2", 8))
GPT2_MESHES = ("data:8", "fsdp:8", "fsdp:4,tensor:2", "fsdp:2,tensor:4")
GPT2 = dict(vocab_size=50304, d_model=768, num_layers=12, num_heads=12, max_seq_len=1024, positions="learned",
            norm="layernorm", mlp="gelu", use_bias=True, tie_embeddings=True)
MIB = 2**20


def compiled_memory(programs, state, batch_size: int) -> dict:
    """XLA's per-device sizes (MiB) of one compiled train step (its batch's windows among the arguments)."""
    compiled = programs.train_steps.lower(state, programs.train_inputs(1, batch_size), programs.frozen).compile()
    stats = compiled.memory_analysis()
    return {"arguments_mib": stats.argument_size_in_bytes / MIB, "outputs_mib": stats.output_size_in_bytes / MIB,
            "temporaries_mib": stats.temp_size_in_bytes / MIB}


def state_mib_per_device(layout, shapes) -> float:
    """Parameters and optimizer state held by one device, from the layout's shard shapes."""
    import jax
    import numpy as np
    total = 0
    for leaf, sharding in zip(jax.tree.leaves(shapes), jax.tree.leaves(layout.state)):
        total += int(np.prod(sharding.shard_shape(leaf.shape))) * leaf.dtype.itemsize
    return total / MIB


def train_worker(mesh: str, iters: int, batch: int) -> dict:
    """Trains the 10.7M config on `mesh` in this process; its figures."""
    import jax

    from train.config import load_config
    from train.run import runtime as runtime_lib
    from train.run.experiment import run_experiment
    from train.run.steps import build_programs
    out = tempfile.mkdtemp()
    config = load_config("shakespeare_char", [
        f"train.max_iters={iters}", f"train.eval_interval={iters}", "train.eval_iters=1", "train.sample_tokens=0",
        "train.plot=false", "train.checkpoint=false", f"train.batch_size={batch}", f"train.lr_decay_iters={iters}",
        f"train.out_dir='{out}'", f"runtime.mesh='{mesh}'", "train.steps_per_dispatch=1"])
    runtime = runtime_lib.start(config.runtime, batch, model=config.model)
    result = run_experiment(config, runtime=runtime, quiet=True)
    programs = build_programs(result.config, runtime)
    shapes = jax.eval_shape(lambda: programs.init(0))
    state = programs.layout.abstract(shapes)
    return {"mesh": mesh, "devices": jax.device_count(), "tokens_per_s": result.median_tokens_per_s,
            "ms_per_iter": result.median_ms_per_iter, "val_loss": result.final_val_loss,
            "peak_rss_gib": result.peak_rss_gib, "state_mib_per_device": state_mib_per_device(programs.layout, shapes),
            **compiled_memory(programs, state, batch)}


def gpt2_worker(batch: int) -> list[dict]:
    """XLA's per-device memory of a GPT-2-small train step on each 8-device mesh (compiled, not run)."""
    import jax

    from jaxattn.config import ModelConfig
    from jaxattn.model import count_params
    from train.config import ExperimentConfig, RuntimeConfig, TrainConfig
    from train.run import runtime as runtime_lib
    from train.run.steps import build_programs
    rows = []
    for mesh in GPT2_MESHES:
        config = ExperimentConfig(name="gpt2_small", model=ModelConfig(**GPT2),
                                  train=TrainConfig(batch_size=batch, block_size=1024),
                                  runtime=RuntimeConfig(mesh=mesh, attention="xla", matmul="xla"))
        runtime = runtime_lib.resolve(config.runtime, batch, model=config.model)
        programs = build_programs(config, runtime)
        shapes = jax.eval_shape(lambda: programs.init(0))
        rows.append({"mesh": mesh, "params": count_params(shapes["params"]),
                     "state_mib_per_device": state_mib_per_device(programs.layout, shapes),
                     **compiled_memory(programs, programs.layout.abstract(shapes), batch)})
    return rows


def worker(spec: dict) -> dict | list:
    """In a fresh process of `spec["devices"]` host devices: one training run on `spec["mesh"]`, or, with
    `spec["gpt2_batch"]`, the GPT-2 compiles."""
    import jax
    jax.config.update("jax_num_cpu_devices", spec["devices"])  # before JAX starts its backends
    if "gpt2_batch" in spec:
        return gpt2_worker(spec["gpt2_batch"])
    return train_worker(spec["mesh"], spec["iters"], spec["batch"])


def markdown(record: dict) -> str:
    m, lines = record["machine"], []
    lines += ["# Training on a device mesh", "",
              f"Machine: {machine_line(m)}. Command: `{record['command']}`.", "",
              f"## The 10.7M config (shakespeare_char, batch {record['batch']}, {record['iters']} iterations)", "",
              "Host devices share the machine's cores, so more devices do not mean more compute here: the "
              "columns to read are the per-device memory ones.", "",
              "| mesh | devices | tokens/s | ms/iter | peak RSS GiB | params + Adam per device MiB "
              "| XLA arguments MiB | XLA temporaries MiB |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for r in record["train"]:
        lines.append(f"| {r['mesh']} | {r['devices']} | {r['tokens_per_s']:,.0f} | {r['ms_per_iter']:.0f} | "
                     f"{r['peak_rss_gib']:.2f} | {r['state_mib_per_device']:.1f} | {r['arguments_mib']:.1f} | "
                     f"{r['temporaries_mib']:.1f} |")
    lines += ["", f"## GPT-2 small on 8 devices (batch {record['gpt2_batch']} x 1024, compiled only)", "",
              "Per device, from `jax.jit(...).lower(...).compile().memory_analysis()`; the arguments are the "
              "parameters, Adam's moments and the corpus, the temporaries the activations and gradients.", "",
              "| mesh | params + Adam per device MiB | XLA arguments MiB | XLA temporaries MiB |",
              "| --- | --- | --- | --- |"]
    for r in record["gpt2"]:
        lines.append(f"| {r['mesh']} | {r['state_mib_per_device']:.0f} | {r['arguments_mib']:.0f} | "
                     f"{r['temporaries_mib']:.0f} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16, help="the 10.7M config's batch (divisible by 8)")
    parser.add_argument("--gpt2-batch", type=int, default=8)
    parser.add_argument("--out", default=str(RESULTS))
    args = parser.parse_args(argv)
    record = {"machine": describe_machine(), "iters": args.iters, "batch": args.batch, "gpt2_batch": args.gpt2_batch,
              "command": "PYTHONPATH=$PWD python bench/mesh.py " + portable_command(argv or sys.argv[1:], ("--out",)),
              "train": [], "gpt2": []}
    for mesh, devices in TRAIN_MESHES:
        spec = {"devices": devices, "mesh": mesh, "iters": args.iters, "batch": args.batch}
        record["train"].append(fresh.call("bench.mesh:worker", spec))
        print(json.dumps(record["train"][-1]), flush=True)
    record["gpt2"] = fresh.call("bench.mesh:worker", {"devices": 8, "gpt2_batch": args.gpt2_batch})
    write_results(args.out, "mesh", record, markdown(record))
    return record


if __name__ == "__main__":
    main()
