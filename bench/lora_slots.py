"""Adapters in slots on SmolLM2-135M's projections: the base matmuls alone, and with each form of `slot_delta`.

    PYTHONPATH=$PWD .venv/bin/python bench/lora_slots.py [--rounds 20] [--slots 32] [--out bench/results]
    PYTHONPATH=$PWD .venv/bin/python bench/lora_slots.py --quick --out DIR    # a smoke run

One layer's projections as the model fuses them (`jaxattn.lora.empty_slots` on a one-layer model of
SmolLM2-135M's shape: d_model 576, 9 query and 3 key/value heads of 64, MLP 1536): `qkv [576, 960]` (parts
q, k, v), `out [576, 576]`, `gate_up [576, 3072]` (parts gate, up), `down [1536, 576]`, float32, with
--slots slots (`max_loras`) of rank 16 on every part. For 32 token rows (a decode step) and 256 (a prompt
chunk), and 1, 2, 8 and 32 distinct rank-16 adapters (`add_lora`, a and b redrawn, `write_slot`) mixed
evenly among the rows (row m uses adapter m mod n), four jitted programs: the base matmuls alone, and
base + the delta of each form of `jaxattn.lora.slot_delta` ("gather", "segment", "segment_cpu"). Each
(rows, adapters) group's programs are timed in turns (`bench.timing.time_compiled`), medians; the forms'
outputs are compared with "gather"'s (max |difference|). The load average before and after is recorded:
a ratio means little while another process shares the cores. Writes lora_slots_<cpu class>.{json,md}.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe_machine, load_average, machine_line, portable_command, write_results  # noqa: E402
from bench.timing import time_compiled  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
RANK, ROWS, ADAPTERS = 16, (32, 256), (1, 2, 8, 32)
CELLS = ("base", "gather", "segment", "segment_cpu", "native_cpu")


def smollm2_layer():
    """A one-layer ModelConfig of SmolLM2-135M's shape (a small vocabulary: the head is not timed)."""
    from jaxattn.config import ModelConfig
    return ModelConfig(vocab_size=64, d_model=576, num_layers=1, num_heads=9, num_kv_heads=3, mlp_hidden=1536,
                       max_seq_len=256, positions="rope", mlp="swiglu", norm="rmsnorm", fused_qkv=True)


def random_params(config, seed: int = 0, std: float = 0.02):
    """Params of `DecoderLM(config)` drawn N(0, std) from their shapes with numpy (nothing compiled)."""
    import flax.linen as nn
    import jax.numpy as jnp
    import numpy as np
    from flax.traverse_util import flatten_dict, unflatten_dict

    from jaxattn.model import abstract_params
    rng = np.random.default_rng(seed)
    shapes = flatten_dict(nn.unbox(abstract_params(config)))
    return unflatten_dict({path: jnp.asarray(rng.normal(0.0, std, leaf.shape).astype(leaf.dtype))
                           for path, leaf in shapes.items()})


def slotted_weights(slots: int, adapters: int, seed: int = 0) -> dict:
    """{name: LoraSlots} of one layer's four projections, slots 0..adapters-1 filled with distinct adapters
    (`add_lora`'s a, b redrawn N(0, 0.02) so that no product is of zeros)."""
    import jax

    from flax.traverse_util import flatten_dict

    from jaxattn.lora import LoraConfig, add_lora, combine_lora, empty_slots, is_slots, split_lora, write_slot
    config = smollm2_layer()
    base = random_params(config, seed)
    targets = ("q", "k", "v", "o", "gate", "up", "down")
    slotted = empty_slots(base, config, slots, RANK, targets)
    lora = LoraConfig(rank=RANK, alpha=32.0, targets=targets)
    for i in range(adapters):
        ab, frozen = split_lora(add_lora(base, config, lora, jax.random.PRNGKey(i)))
        leaves, tree = jax.tree.flatten(ab)
        keys = jax.random.split(jax.random.PRNGKey(1000 + i), len(leaves))
        ab = jax.tree.unflatten(tree, [0.02 * jax.random.normal(k, x.shape, x.dtype) for k, x in zip(keys, leaves)])
        slotted = write_slot(slotted, i, combine_lora(frozen, ab))
    return {path[-2]: w for path, w in flatten_dict(slotted).items() if is_slots(w)}


def programs(weights: dict, rows: int, adapters: int) -> dict:
    """{cell: (jitted function, its arguments)}: the four projections of `rows` token rows."""
    import functools

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxattn.lora import slot_delta
    rng = np.random.default_rng(rows)
    x = jnp.asarray(rng.normal(size=(rows, 576)).astype(np.float32))
    h = jnp.asarray(rng.normal(size=(rows, 1536)).astype(np.float32))
    token_slots = jnp.asarray(np.arange(rows) % adapters, jnp.int32)
    weights = {name: w.replace(token_slots=token_slots) for name, w in weights.items()}
    inputs = {"qkv": x, "out": x, "gate_up": x, "down": h}

    def project(form, weights, inputs):
        outs = []
        for name, w in weights.items():
            y = jnp.dot(inputs[name], w.base, preferred_element_type=jnp.float32)
            outs.append(y if form == "base" else y + slot_delta(inputs[name], w, form))
        return outs
    return {cell: (jax.jit(functools.partial(project, cell)), (weights, inputs)) for cell in CELLS}


def measure(slots: int, rounds: int, rows_list, adapter_list) -> list[dict]:
    import numpy as np
    found = []
    for adapters in adapter_list:
        weights = slotted_weights(slots if slots else adapters, adapters)
        for rows in rows_list:
            table = programs(weights, rows, adapters)
            outs = {cell: function(*arguments) for cell, (function, arguments) in table.items() if cell != "base"}
            diff = max(float(np.max(np.abs(np.asarray(g) - np.asarray(o)))) for cell in CELLS[2:]
                       for g, o in zip(outs["gather"], outs[cell]))
            timed = time_compiled(table, rounds)
            found.append({"rows": rows, "adapters": adapters, "slots": slots or adapters, "forms_max_diff": diff,
                          **{f"{cell}_ms": timed[cell]["median_s"] * 1e3 for cell in CELLS}})
    return found


def markdown(record: dict) -> str:
    forms = CELLS[1:]
    lines = [f"# Adapters in slots: one layer's projections on {machine_line(record['machine'])}", "",
             f"CPU class: {record['machine']['cpu_class']}, {record['machine']['cores']} cores. SmolLM2-135M's four fused projections (qkv, out, gate_up, down), float32, rank-{RANK} adapters "
             f"on every part, {record['slots_words']}; the adapters mixed evenly among the rows. Medians of "
             f"{record['rounds']} rounds, each group's programs in turns; load average {record['load_before']} "
             f"before, {record['load_after']} after (2 cores: above 2, another process shared them). "
             f"Command: `{record['command']}`.", "",
             "| rows | adapters | slots | base ms | " + " | ".join(f"base + {f} ms" for f in forms) + " | "
             + " | ".join(f"{f} / base" for f in forms) + " | forms' max diff |",
             "| ---: " * (4 + 2 * len(forms) + 1) + "|"]
    for r in record["rows"]:
        lines.append(f"| {r['rows']} | {r['adapters']} | {r['slots']} | {r['base_ms']:.2f} | "
                     + " | ".join(f"{r[f + '_ms']:.2f}" for f in forms) + " | "
                     + " | ".join(f"{r[f + '_ms'] / r['base_ms']:.2f}x" for f in forms)
                     + f" | {r['forms_max_diff']:.1e} |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=20)
    parser.add_argument("--slots", type=int, default=32, help="max_loras; 0: as many as the adapters in use")
    parser.add_argument("--out", type=Path, default=RESULTS)
    parser.add_argument("--quick", action="store_true", help="8 rows, 1 and 2 adapters, 2 rounds (a smoke run)")
    args = parser.parse_args(argv)
    rows_list, adapter_list = ((8,), (1, 2)) if args.quick else (ROWS, ADAPTERS)
    rounds = 2 if args.quick else args.rounds
    machine, load_before = describe_machine(), load_average()
    rows = measure(args.slots, rounds, rows_list, adapter_list)
    argv_run = sys.argv if argv is None else ["bench/lora_slots.py", *argv]
    command = "PYTHONPATH=$PWD .venv/bin/python " + portable_command(argv_run, ("--out",))
    record = {"machine": machine, "command": command, "rank": RANK, "rounds": rounds,
              "slots_words": f"{args.slots} slots" if args.slots else "as many slots as adapters",
              "load_before": load_before, "load_after": load_average(), "rows": rows}
    write_results(args.out, f"lora_slots_{machine['cpu_class_slug']}", record, markdown(record))
    return record


if __name__ == "__main__":
    main()
