"""Decode tokens/s of mixture-of-experts models: KV-cached `generate` vs Hugging Face's `generate`, same weights.

    PYTHONPATH=$PWD python bench/decode_moe.py [--hf-python PYTHON] [--models mixtral,deepseek_v3]
        [--batches 1,8] [--new-tokens 256] [--repeats 3] [--threads N]

Each model (random weights at a scale where routing is decisive) is exported with
`jaxattn.hf.save_pretrained`; Hugging Face's `generate` (KV cache, greedy) loads that checkpoint
with `AutoModelForCausalLM` in a fresh process (`bench/hf_decode.py --checkpoint`), and runs right
before ours, case by case, with as many torch threads as JAX's CPU client uses (--threads, default:
every core this process may run on; both counts are recorded). On a machine shared with other jobs,
torch's idle threads spin on the cores their partners need: OMP_WAIT_POLICY=PASSIVE, where set, is
passed on to it. Ours runs the kernels "auto" resolves to on the machine
(`jaxattn.resolve_kernels`), and, in turns with it, each fixed routed-experts implementation
(`Kernels.moe`). Both sides decode greedily from the same prompt: the report says whether the tokens
agree. Writes bench/results/decode_moe.{json,md}.

Models: "mixtral" (MixtralForCausalLM: 4 layers, d 128, GQA 4/2, 8 experts, k 2, expert width
256) and "deepseek_v3" (DeepseekV3ForCausalLM: MLA, 4 layers with the first dense, 16 routed
experts in 4 groups (2 chosen), k 4, one shared expert, sigmoid scores with the correction bias).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from bench import fresh  # noqa: E402
from bench.machine import cpu_cores, describe_machine, machine_line, portable_command, write_results  # noqa: E402
from bench.timing import in_turns  # noqa: E402
from jaxattn import DecoderLM, MLAConfig, ModelConfig, MoEConfig, generate, hf, resolve_kernels  # noqa: E402
from jaxattn.model import active_params, count_params  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
PROMPT_LEN, VOCAB = 16, 256
COMMON = dict(vocab_size=VOCAB, d_model=128, num_layers=4, num_heads=4, positions="rope", norm="rmsnorm",
              mlp="swiglu", max_seq_len=1024, tie_embeddings=False)
MODELS = {
    "mixtral": ModelConfig(**COMMON, num_kv_heads=2, moe=MoEConfig(
        num_experts=8, experts_per_token=2, expert_hidden=256, norm_topk_prob=True)),
    "deepseek_v3": ModelConfig(**COMMON, norm_eps=1e-6, rope_interleaved=True, mlp_hidden=512, dense_layers=(0,),
                               mla=MLAConfig(kv_lora_rank=64, q_lora_rank=96, qk_nope_head_dim=32,
                                             qk_rope_head_dim=16, v_head_dim=32),
                               moe=MoEConfig(num_experts=16, experts_per_token=4, expert_hidden=128,
                                             scoring="sigmoid", n_group=4, topk_group=2, correction_bias=True,
                                             norm_topk_prob=True, routed_scaling_factor=2.5, num_shared_experts=1,
                                             shared_expert_hidden=128)),
}
FIXED = ("dense", "grouped_cpu", "gathered")


def random_params(config: ModelConfig, seed: int = 0):
    """Every parameter redrawn (std 0.1; norms at 1; the correction bias at std 0.3)."""
    shapes = jax.eval_shape(DecoderLM(config).init, jax.random.PRNGKey(0), jnp.zeros((1, 1), jnp.int32))["params"]
    shapes = jax.tree.map(lambda box: getattr(box, "value", box), shapes,
                          is_leaf=lambda x: hasattr(x, "value") and hasattr(x, "names"))
    leaves, tree = jax.tree_util.tree_flatten_with_path(shapes)
    keys = jax.random.split(jax.random.PRNGKey(seed), len(leaves))

    def draw(path, leaf, key):
        name = jax.tree_util.keystr(path)
        if "scale" in name:
            return jnp.ones(leaf.shape, leaf.dtype)
        return (0.3 if "correction" in name else 0.1) * jax.random.normal(key, leaf.shape, leaf.dtype)
    return jax.tree.unflatten(tree, [draw(path, leaf, key) for (path, leaf), key in zip(leaves, keys)])


def prompt(batch: int) -> np.ndarray:
    return np.asarray(jax.random.randint(jax.random.PRNGKey(0), (batch, PROMPT_LEN), 1, VOCAB), np.int32)


def time_ours(params, config, kernels: dict, batch, new_tokens, repeats) -> dict:
    """Greedy `generate` with each of `kernels` ({name: Kernels}), in turns: speed and the tokens of each."""
    tokens = {}

    def decoding(name, chosen):
        def call():
            tokens[name] = generate(params, config, prompt(batch), np.full((batch,), PROMPT_LEN, np.int32),
                                    max_new_tokens=new_tokens, rng=jax.random.PRNGKey(0), temperature=0.0,
                                    kernels=chosen).tokens
            return tokens[name]
        return call
    timings = in_turns({name: decoding(name, chosen) for name, chosen in kernels.items()}, repeats)
    return {name: dict(seconds=t.median_s, tokens_per_s=batch * new_tokens / t.median_s, runs=t.times_s,
                       tokens=np.asarray(tokens[name]).tolist()) for name, t in timings.items()}


def time_hf(hf_python, checkpoint, batch, new_tokens, repeats, threads) -> dict:
    """Hugging Face's `generate` on the checkpoint, in a fresh process with `threads` torch threads."""
    prompt_file = Path(checkpoint) / f"prompt_{batch}.json"
    prompt_file.write_text(json.dumps(prompt(batch).tolist()))
    data = fresh.run([hf_python, Path(__file__).with_name("hf_decode.py"), "--checkpoint", checkpoint,
                      "--prompt-file", prompt_file, "--cases", f"moe:{batch}:{new_tokens}",
                      "--threads", str(threads), "--repeats", str(repeats)], what="Hugging Face's generate",
                     env=fresh.environment(threads)).json()
    return dict(data["results"][0], torch=data["torch"])


def measure(name, config, args, checkpoint) -> list[dict]:
    params = random_params(config)
    hf.save_pretrained(checkpoint, config, params)
    auto = resolve_kernels()[0]
    rows = []
    for batch in args.batches:
        theirs = time_hf(args.hf_python, checkpoint, batch, args.new_tokens, args.repeats, args.threads)
        kernels = {"auto": auto, **{impl: auto.replace(moe=impl) for impl in FIXED}}
        ours = time_ours(params, config, kernels, batch, args.new_tokens, args.repeats)
        same = all(np.array_equal(run["tokens"], theirs["new_tokens_ids"]) for run in ours.values())
        rows.append(dict(model=name, batch=batch, new_tokens=args.new_tokens, params=count_params(params),
                         active_params=active_params(config), hf=theirs, ours=ours, tokens_agree=same,
                         auto_kernels=auto.to_dict()))
        print(json.dumps({k: v for k, v in rows[-1].items() if k not in ("hf", "ours")}
                         | {"hf_tok_s": theirs["tokens_per_s"], "ours_tok_s": ours["auto"]["tokens_per_s"]}), flush=True)
    return rows


def report(rows, args, machine: dict) -> str:
    lines = [f"# MoE decoding on {machine_line(machine)}",
             "", f"Greedy, prompt {PROMPT_LEN}, {args.new_tokens} new tokens, median of {args.repeats} runs; Hugging "
             f"Face `generate` (torch {rows[0]['hf']['torch']}, {args.threads} threads) on the checkpoint "
             "`jaxattn.hf.save_pretrained` wrote, run right before ours. Ours: KV-cached `jaxattn.generate` on "
             f"{machine['cores']} cores with the kernels `auto` resolves to, and with each routed-experts "
             "implementation fixed, in turns.", "",
             "| model | params (active) | batch | HF tok/s | ours auto tok/s | auto / HF | "
             + " | ".join(f"{i} tok/s" for i in FIXED) + " | tokens agree |",
             "| --- | ---: | ---: | ---: | ---: | ---: |" + " ---: |" * len(FIXED) + " --- |"]
    for r in rows:
        ours, theirs = r["ours"], r["hf"]["tokens_per_s"]
        lines.append(f"| {r['model']} | {r['params'] / 1e6:.2f}M ({r['active_params'] / 1e6:.2f}M) | {r['batch']} "
                     f"| {theirs:,.0f} | {ours['auto']['tokens_per_s']:,.0f} | "
                     f"{ours['auto']['tokens_per_s'] / theirs:.1f}x | "
                     + " | ".join(f"{ours[i]['tokens_per_s']:,.0f}" for i in FIXED)
                     + f" | {'yes' if r['tokens_agree'] else 'no'} |")
    command = "PYTHONPATH=$PWD python " + portable_command(["bench/decode_moe.py"] + sys.argv[1:], ("--hf-python",))
    return "\n".join(lines + ["", f"Made by: `{command}`", ""])


def main() -> None:
    ints = lambda s: [int(x) for x in s.split(",")]  # noqa: E731
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hf-python", default=sys.executable, help="interpreter with torch and transformers")
    parser.add_argument("--models", default=",".join(MODELS))
    parser.add_argument("--batches", default="1,8", type=ints)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=cpu_cores(),
                        help="torch threads (default: the cores JAX uses, %(default)s)")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            rows += measure(name, MODELS[name], args, Path(tmp) / name)
    recorded = dict(vars(args), hf_python="this interpreter" if args.hf_python == sys.executable else
                    Path(args.hf_python).name)  # no machine path in the results
    machine = describe_machine()
    threads = {"ours": machine["cores"], "hf": args.threads,
               "hf_omp_wait_policy": os.environ.get("OMP_WAIT_POLICY")}  # None: torch's default
    meta = dict(machine=machine, args=recorded, threads=threads)
    write_results(RESULTS, "decode_moe", dict(meta=meta, rows=rows), report(rows, args, machine))


if __name__ == "__main__":
    main()
