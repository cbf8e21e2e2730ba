"""A LoRA adapter's swap into a serving slot on SmolLM2-135M's shape: its time, and the slots' memory.

    PYTHONPATH=$PWD .venv/bin/python bench/lora_swap.py [--slots 1 8 32] [--rounds 10] [--out bench/results]
    PYTHONPATH=$PWD .venv/bin/python bench/lora_swap.py --quick --out DIR    # a smoke run

SmolLM2-135M's 30 layers (d_model 576, 9 query and 3 key/value heads of 64, MLP 1536; q, k and v fused as
`train.serve` fuses them; a 64-token vocabulary: the head and the embeddings have no slots), float32,
with `--slots` slots (`EngineConfig.max_loras`) of rank 16 on every projection (`jaxattn.lora.empty_slots`).
A rank-16 adapter on every projection (`add_lora`, b redrawn) is kept as the engine keeps one on the
host (`jaxattn.serving.loras.host_adapter`), then written into a slot as the engine swaps one in at
admission (`jaxattn.serving.loras.SlotWriter`: one compiled program, the slots' stacks donated), and
`jaxattn.lora.write_slot` run eagerly for comparison (op by op, every stack copied), each until the
arrays are ready: median and slowest of `--rounds` writes into rotating slots, after one write that
compiles what the writes run. Also:
the adapter read from a PEFT directory (`jaxattn.hf.peft.save_adapter`, then `load_adapter`, what
`/v1/load_lora_adapter` reads), the bytes of every slot, of one slot (their share per loaded adapter),
and of the host copy. Writes lora_swap_<cpu class>.{json,md}.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.lora_slots import random_params  # noqa: E402
from bench.machine import describe_machine, load_average, machine_line, portable_command, write_results  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RANK, TARGETS = 16, ("q", "k", "v", "o", "gate", "up", "down")


def smollm2(layers: int = 30):
    """SmolLM2-135M's shape, q, k and v fused, a small vocabulary (nothing slotted reads it)."""
    from jaxattn.config import ModelConfig
    return ModelConfig(vocab_size=64, d_model=576, num_layers=layers, num_heads=9, num_kv_heads=3, head_dim=64,
                       mlp_hidden=1536, max_seq_len=256, positions="rope", mlp="swiglu", norm="rmsnorm",
                       tie_embeddings=True, fused_qkv=True)


def adapter(config, base):
    """A rank-16 adapter on every projection, its b redrawn N(0, 0.02) (add_lora's are zeros)."""
    import jax

    from jaxattn.lora import LoraConfig, add_lora, combine_lora, split_lora
    lora = LoraConfig(rank=RANK, alpha=32.0, targets=TARGETS)
    ab, frozen = split_lora(add_lora(base, config, lora, jax.random.PRNGKey(0)))
    leaves, tree = jax.tree.flatten(ab)
    keys = jax.random.split(jax.random.PRNGKey(1), len(leaves))
    ab = jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
    return combine_lora(frozen, ab), lora


def slot_bytes(slotted) -> int:
    """The bytes of every slot's a, b and scale."""
    import jax

    from jaxattn.lora import is_slots
    weights = [w for w in jax.tree.leaves(slotted, is_leaf=is_slots) if is_slots(w)]
    return sum(x.nbytes for w in weights for x in (*w.a, *w.b, w.scale) if x is not None)


def time_writes(slotted, kept, slots: int, rounds: int, writer) -> list[float]:
    """Seconds of each of `rounds` writes of `kept` into rotating slots, with `writer(params, slot, adapter)`."""
    import jax

    slotted = jax.block_until_ready(writer(slotted, 0, kept))  # what compiles, here, once
    seconds = []
    for i in range(rounds):
        started = time.perf_counter()
        slotted = jax.block_until_ready(writer(slotted, i % slots, kept))
        seconds.append(time.perf_counter() - started)
    return seconds


def time_read(config, base, adapted, lora) -> float | None:
    """Seconds to read the adapter back from a PEFT directory (None where its family cannot hold it)."""
    from jaxattn.hf import peft
    from jaxattn.hf.errors import HFCheckpointError
    with tempfile.TemporaryDirectory() as folder:
        try:
            peft.save_adapter(folder, config, adapted, lora, overwrite=True)
        except (HFCheckpointError, ValueError):
            return None
        started = time.perf_counter()
        peft.load_adapter(folder, config, base)
        return time.perf_counter() - started


def measure(slot_counts, rounds: int, layers: int) -> dict:
    import jax
    import numpy as np

    from jaxattn.lora import empty_slots, write_slot
    from jaxattn.serving.loras import SlotWriter, host_adapter
    config = smollm2(layers)
    base = random_params(config)
    adapted, lora = adapter(config, base)
    started = time.perf_counter()
    kept, _ = host_adapter(adapted, RANK)
    host_s = time.perf_counter() - started
    rows = []
    for slots in slot_counts:
        slotted = empty_slots(base, config, slots, RANK, TARGETS)
        total, row = slot_bytes(slotted), {"slots": slots}
        for name, writer in (("eager", write_slot), ("engine", SlotWriter(slotted))):  # the engine's donates: last
            seconds = time_writes(slotted, kept, slots, rounds, writer)
            row.update({f"{name}_median_ms": statistics.median(seconds) * 1e3, f"{name}_max_ms": max(seconds) * 1e3})
        rows.append({**row, "slots_bytes": total, "per_slot_bytes": total // slots})
    host_bytes = sum(x.nbytes for x in jax.tree.leaves(kept) if isinstance(x, np.ndarray))
    return {"layers": layers, "rows": rows, "host_copy_ms": host_s * 1e3, "host_bytes": host_bytes,
            "read_peft_s": time_read(config, base, adapted, lora)}


def markdown(record: dict) -> str:
    lines = [f"# A LoRA adapter's swap into a slot: SmolLM2-135M's shape on {machine_line(record['machine'])}", "",
             f"`{record['command']}`; {record['layers']} layers, rank {RANK} on q, k, v, o, gate, up, down, "
             f"float32; {record['rounds']} writes; load average {record['load_before']} before, "
             f"{record['load_after']} after.", "",
             "| slots (max_loras) | the engine's swap (SlotWriter) median | slowest | eager write_slot median | "
             "slowest | all slots | one slot |",
             "| --- | --- | --- | --- | --- | --- | --- |"]
    for row in record["rows"]:
        lines.append(f"| {row['slots']} | {row['engine_median_ms']:.1f} ms | {row['engine_max_ms']:.1f} ms | "
                     f"{row['eager_median_ms']:.1f} ms | {row['eager_max_ms']:.1f} ms | "
                     f"{row['slots_bytes'] / 2**20:.1f} MiB | {row['per_slot_bytes'] / 2**20:.2f} MiB |")
    read = record["read_peft_s"]
    lines += ["", f"Kept on the host: {record['host_bytes'] / 2**20:.2f} MiB an adapter, copied there in "
              f"{record['host_copy_ms']:.1f} ms; read from a PEFT directory (`load_adapter`): "
              + ("not measured (the shape's family cannot hold it)" if read is None else f"{read * 1e3:.0f} ms") + ".",
              ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--slots", type=int, nargs="+", default=[1, 8, 32])
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="2 layers, 2 slots, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    slot_counts, rounds, layers = ([2], 2, 2) if args.quick else (args.slots, args.rounds, 30)
    machine, load_before = describe_machine(), load_average()
    record = measure(slot_counts, rounds, layers)
    argv_run = sys.argv if argv is None else ["bench/lora_swap.py", *argv]
    record.update(machine=machine, rounds=rounds, load_before=load_before, load_after=load_average(),
                  command="PYTHONPATH=$PWD .venv/bin/python " + portable_command(argv_run, ("--out",)))
    write_results(args.out, f"lora_swap_{machine['cpu_class_slug']}", record, markdown(record))
    return record


if __name__ == "__main__":
    main()
