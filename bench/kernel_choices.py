"""Each kernel choice against the reference on the machine it runs on, side by side: the evidence behind "auto".

    PYTHONPATH=$PWD python bench/kernel_choices.py [--rounds 8] [--decode-tokens 256]

Training: the default config's jitted step (50 optimizer steps per dispatch, the batch split over
the CPU cores as the runtime resolves it) compiled once per kernel variant in this process, then
timed in turns (`bench.timing.in_turns`), so every variant sees the same minutes of a machine whose
speed drifts. Attention: one causal self-attention call's forward and backward (the gradient of a
weighted sum of its output with respect to q, k and v) at the shapes of the runs that take it (the
SmolLM2-135M fine-tune of bench/finetune.py, configs/shakespeare_char.toml, and longer rows), by the
reference, the dense hand-written backward, its causal blocks of query rows and the blockwise kernel,
in turns. Decoding: `generate` (greedy, prompt 16, in a cache of 1024 slots) of the baby MHA and
GQA models and the 10.7M-shaped MHA model at batch 1 and 8 with each decode and matmul kernel, in
turns likewise. Writes bench/results/kernel_choices.json and kernel_choices.md with the CPU, the
kernels "auto" picks there, and each variant's median and ratio to the reference.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from bench.machine import describe_machine, machine_line, write_results  # noqa: E402
from bench.timing import in_turns, ratio  # noqa: E402
from train.config import load_config  # noqa: E402
from train.run import runtime as runtime_lib  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"


def medians_in_turns(calls: dict, rounds: int) -> dict[str, float]:
    """Median seconds of each zero-argument call, timed in turns after one warm-up each."""
    return {name: timing.median_s for name, timing in in_turns(calls, rounds).items()}


def training_variants(runtime) -> dict:
    from jaxattn.kernels import Kernels
    chosen = runtime.kernels
    return {"reference": Kernels(), "attention custom_vjp": Kernels(attention="custom_vjp"),
            "attention causal_blocks": Kernels(attention="causal_blocks"),
            "attention chunked": Kernels(attention="chunked"),
            "matmul bfloat16": Kernels(matmul="bfloat16"), "matmul bfloat16_cpu": Kernels(matmul="bfloat16_cpu"),
            f"auto ({chosen.attention}, {chosen.matmul})": chosen}


def time_training(runtime, rounds: int) -> list[dict]:
    import dataclasses

    import numpy as np

    from train.data import corpus as data_lib
    from train.data.batches import RunBatches
    from train.run.experiment import with_vocabulary
    from train.run.steps import build_programs

    config = load_config()
    corpus = data_lib.load_corpus(config.train.data_path)
    config = with_vocabulary(config, corpus.tokenizer)
    steps = config.train.steps_per_dispatch
    calls = {}
    for name, kernels in training_variants(runtime).items():
        programs = build_programs(config, dataclasses.replace(runtime, kernels=kernels))
        data = RunBatches(corpus.train, corpus.val, config.train, programs.layout.windows,
                          programs.eval_rows).train_chunk(0, steps)  # [steps, B, T + 1], read once
        state = {"s": programs.init(config.train.seed)}
        compiled = programs.train_steps.lower(state["s"], data, programs.frozen).compile()

        def call(compiled=compiled, state=state, data=data, frozen=programs.frozen):
            state["s"], (losses, _, _) = compiled(state["s"], data, frozen)
            np.asarray(losses)
        calls[name] = call
    medians = medians_in_turns(calls, rounds)
    return [{"variant": name, "ms_per_step": 1e3 * s / steps, "vs_reference": ratio(medians["reference"], s)}
            for name, s in medians.items()]


# (name, B, T, N, K, H, dtype) of the causal self-attentions timed alone
ATTENTION_SHAPES = (("SmolLM2-135M fine-tune, bfloat16", 8, 256, 9, 3, 64, "bfloat16"),
                    ("shakespeare_char, float32", 64, 256, 6, 6, 64, "float32"),
                    ("128 rows, bfloat16", 16, 128, 9, 3, 64, "bfloat16"),
                    ("512 rows, bfloat16", 4, 512, 9, 3, 64, "bfloat16"),
                    ("1024 rows, bfloat16", 4, 1024, 9, 3, 64, "bfloat16"))
ATTENTION_VARIANTS = ("xla", "custom_vjp", "causal_blocks", "chunked")


def time_attention(rounds: int) -> list[dict]:
    import jax
    import jax.numpy as jnp

    from jaxattn import scaled_dot_product_attention

    rows = []
    for name, B, T, N, K, H, dtype in ATTENTION_SHAPES:
        keys = jax.random.split(jax.random.PRNGKey(0), 4)
        q = jax.random.normal(keys[0], (B, T, N, H), dtype)
        k, v = (jax.random.normal(key, (B, T, K, H), dtype) for key in keys[1:3])
        weights = jax.random.normal(keys[3], (B, T, N, H), jnp.float32)
        calls = {}
        for variant in ATTENTION_VARIANTS:
            def loss(q, k, v, variant=variant):
                out = scaled_dot_product_attention(q, k, v, is_causal=True, implementation=variant)
                return jnp.vdot(out.astype(jnp.float32), weights)
            step = jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2))).lower(q, k, v).compile()
            calls[variant] = lambda step=step: jax.block_until_ready(step(q, k, v))
        medians = medians_in_turns(calls, rounds)
        rows += [{"shape": name, "B": B, "T": T, "N": N, "K": K, "H": H, "dtype": dtype, "variant": variant,
                  "ms": 1e3 * s, "vs_reference": ratio(medians["xla"], s)} for variant, s in medians.items()]
    return rows


def time_decoding(rounds: int, new_tokens: int) -> list[dict]:
    import functools

    import jax
    import numpy as np

    from jaxattn import Kernels, ModelConfig, generate
    from jaxattn.model import DecoderLM

    rows = []
    small = dict(d_model=384, num_layers=6, num_heads=6)  # the 10.7M shape of configs/shakespeare_char.toml
    for kind, kv, size in (("baby MHA", None, {}), ("baby GQA kv=2", 2, {}), ("small MHA", None, small)):
        config = ModelConfig(vocab_size=65, max_seq_len=1024, num_kv_heads=kv, **size)
        params = jax.jit(DecoderLM(config).init)(jax.random.PRNGKey(0), np.zeros((1, 1), np.int32))["params"]
        for batch in (1, 8):
            prompt = np.asarray(jax.random.randint(jax.random.PRNGKey(0), (batch, 16), 1, 65), np.int32)
            variants = {"reference": Kernels(), "decode xla_cpu": Kernels(decode="xla_cpu"),
                        "decode blocked": Kernels(decode="blocked"),
                        "decode xla_cpu, matmul bfloat16_cpu": Kernels(decode="xla_cpu", matmul="bfloat16_cpu")}
            calls = {name: functools.partial(
                lambda k: generate(params, config, prompt, np.full(batch, 16), max_new_tokens=new_tokens,
                                   rng=jax.random.PRNGKey(0), temperature=0.0, kernels=k).tokens,
                kernels) for name, kernels in variants.items()}
            medians = medians_in_turns(calls, rounds)
            rows += [{"model": kind, "batch": batch, "variant": name,
                      "tokens_per_s": batch * new_tokens / s, "vs_reference": ratio(medians["reference"], s)}
                     for name, s in medians.items()]
    return rows


def markdown(record: dict) -> str:
    lines = [f"# Kernel choices on {machine_line(record['machine'])}", "",
             f"`auto` picks here: {record['auto']}.", "",
             "## Training step (default config, 50 steps per dispatch, medians of rounds in turns)", "",
             "| variant | ms/step | speed vs reference |", "| --- | ---: | ---: |"]
    lines += [f"| {r['variant']} | {r['ms_per_step']:.1f} | {r['vs_reference']:.2f}x |" for r in record["training"]]
    lines += ["", "## Causal self-attention, forward and backward (medians of rounds in turns)", "",
              "| shape | B, T, N, K, H | variant | ms | speed vs reference |", "| --- | --- | --- | ---: | ---: |"]
    lines += [f"| {r['shape']} | {r['B']}, {r['T']}, {r['N']}, {r['K']}, {r['H']} | {r['variant']} | {r['ms']:.1f} | "
              f"{r['vs_reference']:.2f}x |" for r in record.get("attention", [])]
    lines += ["", f"## Decoding (greedy, prompt 16, {record['decode_tokens']} new tokens)", "",
              "| model | batch | variant | tokens/s | speed vs reference |", "| --- | ---: | --- | ---: | ---: |"]
    lines += [f"| {r['model']} | {r['batch']} | {r['variant']} | {r['tokens_per_s']:,.0f} | {r['vs_reference']:.2f}x |"
              for r in record["decoding"]]
    lines += ["", f"Made by: `{record['command']}`", ""]
    return "\n".join(lines)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=256)
    parser.add_argument("--out", type=Path, default=RESULTS, help="the directory of kernel_choices.json and .md")
    args = parser.parse_args(argv)
    config = load_config()
    runtime = runtime_lib.start(config.runtime, config.train.batch_size)  # before anything starts JAX
    print("\n".join(runtime.describe()), flush=True)
    record = {"command": "PYTHONPATH=$PWD python bench/kernel_choices.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "machine": describe_machine(), "auto": str(runtime.kernels), "reasons": runtime.reasons,
              "mesh": str(runtime.mesh_shape), "decode_tokens": args.decode_tokens,
              "training": time_training(runtime, args.rounds), "attention": time_attention(args.rounds),
              "decoding": time_decoding(args.rounds, args.decode_tokens)}
    write_results(args.out, "kernel_choices", record, markdown(record))
    return record


if __name__ == "__main__":
    main()
