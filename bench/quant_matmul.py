"""The matmuls of one decoded token against float32, int8 and int4 weights: how close each comes to the memory roofline.

    PYTHONPATH=$PWD python bench/quant_matmul.py [--rounds 10] [--layers 30]

The SmolLM2-135M shapes (d_model 576, 9 query and 3 key/value heads of 64, MLP 1536): per layer the 7
projections q, k, v, o, gate, up, down, at batch 1, chained layer after layer as decoding runs them
(each layer's input depends on the last), then the tied head (`[576, 49152]`, quantized as the layers
are: `jaxattn.quantize`'s `tied_head`; --no-head leaves it out), one jitted program per formulation:

* float32 in XLA (`Kernels.matmul` "xla");
* int8 per channel, the XLA reference (`Kernels.quantized` "xla": dequantize, then a float32 dot);
* int8 per channel and int4 in groups of 32 in the native loop (`Kernels.quantized` "native_cpu");
* int8 per channel and int4 in groups of 32 with the activations rounded to int8 in groups of 32 and
  integer dots (`Kernels.quantized` "native_cpu_q8act"), the weights in rows as quantized and in the
  panels `jaxattn.kernels.prepare_weights` gives that kernel (`jaxattn.quantization.to_panels`).

Timed in turns (`bench.timing.in_turns`), medians. GB/s is the bytes of weights (values and scales)
read per token over the time per token; the machine's streaming read bandwidth (a float32 sum over a
buffer of the float32 weights' size, in XLA) is measured beside it. Writes bench/results/quant_matmul.json
and quant_matmul.md with the CPU named.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from bench.timing import in_turns  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
D, Q, KV, F = 576, 576, 192, 1536
HEAD = (D, 49152)  # the tied head, [D, V]
SHAPES = {"q": (D, Q), "k": (D, KV), "v": (D, KV), "o": (Q, D), "gate": (D, F), "up": (D, F), "down": (F, D)}


def streaming_read(nbytes: int):
    """(a zero-argument call that reads a float32 buffer of about `nbytes` once, a jitted XLA sum, the
    buffer's bytes): timed, the machine's streaming read bandwidth."""
    import jax
    import jax.numpy as jnp
    import numpy as np

    buffer = jnp.asarray(np.random.default_rng(0).normal(size=nbytes // 4).astype(np.float32))
    total = jax.jit(jnp.sum)
    return (lambda: total(buffer)), buffer.size * 4


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--layers", type=int, default=30)
    parser.add_argument("--no-head", dest="head", action="store_false", help="leave out the tied head")
    args = parser.parse_args()

    import jax
    import jax.numpy as jnp
    import numpy as np

    from jaxattn.kernels import matmul_kernel, quantized_matmul_kernel
    from jaxattn.quantization import quantize_weight, to_panels

    rng = np.random.default_rng(0)
    weights = [{name: jnp.asarray(rng.normal(scale=0.05, size=shape).astype(np.float32))
                for name, shape in SHAPES.items()} for _ in range(args.layers)]
    if args.head:
        weights.append({"head": jnp.asarray(rng.normal(scale=0.05, size=HEAD).astype(np.float32))})
    formats = {"float32": lambda w: w, "int8": lambda w: quantize_weight(w, "int8:channel"),
               "int4 (groups of 32)": lambda w: quantize_weight(w, "int4"),
               "int8 in panels": lambda w: to_panels(quantize_weight(w, "int8:channel")),
               "int4 (groups of 32) in panels": lambda w: to_panels(quantize_weight(w, "int4"))}
    stored = {name: jax.block_until_ready([{k: f(w) for k, w in layer.items()} for layer in weights])
              for name, f in formats.items()}
    candidates = {"float32, XLA": ("float32", matmul_kernel("xla")),
                  "int8, XLA reference": ("int8", quantized_matmul_kernel("xla")),
                  "int8, native": ("int8", quantized_matmul_kernel("native_cpu")),
                  "int8, native, int8 activations": ("int8", quantized_matmul_kernel("native_cpu_q8act")),
                  "int4 (groups of 32), native": ("int4 (groups of 32)", quantized_matmul_kernel("native_cpu")),
                  "int4 (groups of 32), native, int8 activations": ("int4 (groups of 32)",
                                                                    quantized_matmul_kernel("native_cpu_q8act")),
                  "int8 in panels, native, int8 activations": ("int8 in panels",
                                                               quantized_matmul_kernel("native_cpu_q8act")),
                  "int4 (groups of 32) in panels, native, int8 activations": (
                      "int4 (groups of 32) in panels", quantized_matmul_kernel("native_cpu_q8act"))}

    def token(matmul):
        def run(layers, h):  # h [1, D]
            for w in layers:
                if "head" in w:  # the logits feed nothing; their sum keeps them computed
                    return h + 1e-9 * jnp.sum(matmul(h, w["head"]))
                q, k, v = matmul(h, w["q"]), matmul(h, w["k"]), matmul(h, w["v"])
                o = matmul(q, w["o"])
                d = matmul(jax.nn.silu(matmul(h, w["gate"])) * matmul(h, w["up"]), w["down"])
                h = h + 1e-3 * (o + d) + 1e-6 * (jnp.sum(k) + jnp.sum(v))
            return h
        return jax.jit(run)

    x = jnp.asarray(rng.normal(size=(1, D)).astype(np.float32))
    calls = {name: (lambda f=token(kernel), p=stored[fmt]: f(p, x)) for name, (fmt, kernel) in candidates.items()}
    nbytes = {fmt: sum(leaf.size * leaf.dtype.itemsize for leaf in jax.tree_util.tree_leaves(layers))
              for fmt, layers in stored.items()}
    calls["streaming read (float32 sum)"] = streaming_read(nbytes["float32"])[0]
    load_before = os.getloadavg()[0]
    timings = in_turns(calls, args.rounds)
    load = (load_before, os.getloadavg()[0])  # a shared machine's other work: these figures move with it

    rows = []
    for name, timing in timings.items():
        fmt = candidates[name][0] if name in candidates else "float32"
        ms = timing.median_s * 1e3
        rows.append({"formulation": name, "weights": fmt, "weight_bytes": nbytes[fmt], "ms_per_token": ms,
                     "gb_per_s": nbytes[fmt] / timing.median_s / 1e9, "times_s": timing.times_s})
    base = rows[0]["ms_per_token"]
    for row in rows:
        row["speedup_vs_float32"] = base / row["ms_per_token"]
    record = {"machine": describe_machine(), "layers": args.layers, "projections": SHAPES,
              "head": HEAD if args.head else None, "rounds": args.rounds, "load_average_1min": load,
              "batch": 1, "rows": rows}
    lines = [f"# Quantized matmuls of one token on {machine_line(record['machine'])}", "",
             f"{args.layers} layers x 7 SmolLM2-135M-shaped projections (q, k, v, o, gate, up, down)"
             f"{', then the tied head [576, 49152]' if args.head else ''}, batch 1, "
             f"medians of {args.rounds} turns. GB/s: bytes of weights (values and scales) per token over the time.", "",
             "| formulation | weight MB | ms per token | GB/s | vs float32 |", "| --- | --- | --- | --- | --- |"]
    for row in rows:
        lines.append(f"| {row['formulation']} | {row['weight_bytes'] / 1e6:.1f} | {row['ms_per_token']:.2f} | "
                     f"{row['gb_per_s']:.1f} | {row['speedup_vs_float32']:.2f}x |")
    lines.append("")
    lines.append("The streaming read is the machine's bandwidth for reference (its \"vs float32\" is not a speed-up). "
                 f"The 1-minute load average was {load[0]:.1f} before and {load[1]:.1f} after, on "
                 f"{os.cpu_count()} CPUs: with other work running, every figure is lower and noisier.")
    write_results(RESULTS, "quant_matmul", record, "\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
