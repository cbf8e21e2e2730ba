"""Speculative decoding at batch 1 on a real model: prompt lookup beside plain greedy decoding, and
transformers' prompt lookup beside its own greedy decoding, on the same prompts and weights.

    PYTHONPATH=$PWD .venv/bin/python bench/speculative.py --gguf SmolLM2-135M-Instruct.Q4_1.gguf
        [--new-tokens 128] [--rounds 5] [--k 4] [--n-min 1] [--n-max 3] [--threads N] [--no-hf]
        [--draft DIR [--draft-k 4,2]] [--out bench/results/speculative]

The model is the GGUF file's, dequantized to float32 (`jaxattn.gguf.load_gguf`), q, k and v fused into one
projection as `train.sample` runs it, with the kernels `generate` picks on this machine (`kernels=None`).
The transformers peer loads the same float32 weights from a directory written by
`jaxattn.hf.save_pretrained` (a temporary one), with as many torch threads as JAX's cores.

Three prompts, each in the model's chat template (its default system prompt):

* `summary`: summarise a passage of about 400 tokens (written for this benchmark, below);
* `code_edit`: rename a variable in a Python function and give the function back;
* `free`: write a story (little to copy: prompt lookup should back off and cost next to nothing).

With --draft DIR (a draft model of the same tokenizer, a transformers directory such as
`python -m train.distill_draft` writes), one more candidate per --draft-k: `jaxattn.speculative_generate` with
a `DraftProposer` of that k (greedy, adaptive k; with --draft-fixed also at a fixed k, drafting at every step,
as "draft_k{k}_fixed"), its q, k and v fused as the target's, with its acceptance,
drafts kept per step, the seconds spent drafting and its tokens against plain greedy decoding's; the
directory's distill.json (how it was made), where it has one, goes into the record.

Per prompt four candidates, timed in turns (`bench.timing.in_turns`: each warmed up once, then one call of
each per round, the order reversed every other round; medians of --rounds): `jaxattn.generate` greedy,
`jaxattn.speculative_generate` with an `NgramProposer` (greedy, adaptive k), transformers' `generate`
greedy, and transformers' `generate(..., prompt_lookup_num_tokens=k, max_matching_ngram_size=n_max)`.
Every call makes exactly --new-tokens tokens (no stop token; the reply's end-of-turn is reported). Tokens/s
counts the new tokens over the whole call, prompt included, the same prompt for both sides of a ratio.
Reported beside the speed-ups: our acceptance rate, drafts kept per step, steps, whether the speculative
tokens equal plain greedy decoding's (how many leading tokens agree) and transformers' against ours,
and the 1-minute load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bench.machine import cpu_cores, load_average, pin_to_cores, write_results  # noqa: E402

SUMMARY_PASSAGE = """\
The town of Harrowgate Mill grew up around a single water wheel on the River Lune. In 1742 a miller named \
Thomas Ashby built the wheel to grind oats for the farms of the valley, and for almost forty years the mill \
was the only building on that bend of the river. Farmers brought their grain by cart along a muddy track, \
and while they waited for the flour they traded news, livestock and tools. By 1780 a blacksmith, a tavern \
and a chapel stood beside the mill, and the track had become a road.

The real change came with the canal. In 1796 the Lune Valley Canal Company cut a waterway from the coast to \
the mill, so that coal, lime and timber could arrive by barge instead of by cart. The price of coal in the \
town fell by half within three years. Cheap coal brought a steam engine, and the steam engine brought the \
first cotton spinning mill in 1811. Within a generation the population rose from about three hundred people \
to more than four thousand, most of them working long shifts in the spinning rooms.

Growth had a cost. The river, once clear enough to drink, was soon dark with dye and waste from the mills. \
An outbreak of cholera in 1832 killed one person in every twelve, and the town council, after years of \
argument, finally paid for a clean water supply from a reservoir in the hills. The reservoir, finished in \
1851, is still in use today.

The cotton trade declined after the First World War, and the last spinning mill closed in 1967. For a time \
the town seemed likely to empty. Instead, its old buildings found new uses: the great spinning mill became \
a museum of the textile industry, the canal was cleared for pleasure boats, and the original water wheel \
was restored by volunteers in 1994. Today Harrowgate Mill is known less for what it makes than for what it \
remembers, and every summer thousands of visitors walk the towpath from the coast to watch the old wheel turn.\
"""

CODE = '''\
def summarize_orders(orders, tax_rate):
    x = 0.0
    for order in orders:
        if order["status"] == "cancelled":
            continue
        price = order["price"] * order["quantity"]
        if order.get("discount"):
            price = price * (1 - order["discount"])
        x = x + price
    if x > 1000:
        x = x * 0.98
    tax = x * tax_rate
    report = {"subtotal": round(x, 2), "tax": round(tax, 2), "total": round(x + tax, 2)}
    if x == 0:
        report["note"] = "no billable orders"
    return report
'''

PROMPTS = {
    "summary": "Summarise the following text in a few sentences.\n\n" + SUMMARY_PASSAGE,
    "code_edit": "Rename the variable x to subtotal in this Python function. Reply with the whole function.\n\n"
                 "```python\n" + CODE + "```",
    "free": "Write a story about a lighthouse keeper who finds a lost dog on the rocks.",
}


def leading_agreement(a, b) -> int:
    """How many leading tokens two id sequences share."""
    n = min(len(a), len(b))
    return next((i for i in range(n) if a[i] != b[i]), n)


def load(gguf_path: str):
    """(config, fused params, tokenizer, chat template, the unfused float32 params for the peer)."""
    from jaxattn import gguf
    from jaxattn.hf.chat_template import ChatTemplate
    from jaxattn.layers.primitives import with_fused_qkv
    config, params, tokenizer, template = gguf.load_gguf(gguf_path, dtype="float32")
    fused, fused_config = with_fused_qkv(params, config)
    chat = ChatTemplate(template, gguf.GGUFModel.open(gguf_path).special_tokens)
    return fused_config, fused, tokenizer, chat, (config, params)


def load_draft(directory: Path):
    """(config, fused params, the directory's distill.json or None) of a draft model's transformers directory."""
    import json

    from jaxattn import hf
    from jaxattn.layers.primitives import with_fused_qkv
    config, params = hf.load_pretrained(directory, dtype="float32")
    params, config = with_fused_qkv(params, config)
    made = directory / "distill.json"
    return config, params, (json.loads(made.read_text()) if made.is_file() else None)


def hf_model(saved, tokenizer, threads: int, scratch: str):
    """transformers' model of the same float32 weights, from a directory `jaxattn.hf.save_pretrained` writes."""
    import torch
    from transformers import AutoModelForCausalLM

    from jaxattn import hf
    config, params = saved
    hf.save_pretrained(scratch, config, params, eos_token_id=tokenizer.eos_token_id, overwrite=True)
    torch.set_num_threads(threads)
    return AutoModelForCausalLM.from_pretrained(scratch, dtype=torch.float32).eval()


def candidates(model, prompt_ids: list[int], args, hf=None, draft=None) -> tuple[dict, dict]:
    """({name: zero-argument call}, {name: the last output}) of the candidates for one prompt: the four, and
    "draft_k{k}" for each --draft-k with a draft model (`draft`: its config and params), "draft_k{k}_fixed"
    too with --draft-fixed."""
    import jax
    import numpy as np

    import jaxattn as ja
    from jaxattn.speculative import DraftProposer, NgramProposer, NgramSettings
    config, params = model
    ids = np.asarray([prompt_ids], np.int32)
    lengths = np.asarray([len(prompt_ids)], np.int32)
    proposer = NgramProposer(NgramSettings(n_min=args.n_min, n_max=args.n_max, k=args.k))
    last: dict = {}
    common = dict(max_new_tokens=args.new_tokens, rng=jax.random.PRNGKey(0), temperature=0.0)

    def plain():
        last["plain"] = ja.generate(params, config, ids, lengths, **common)
        return last["plain"].tokens

    def ngram():
        last["ngram"] = ja.speculative_generate(params, config, ids, lengths, proposer=proposer, **common)
        return last["ngram"].tokens

    calls = {"plain": plain, "ngram": ngram}
    schedules = {"": True, **({"_fixed": False} if args.draft_fixed else {})}
    ks = args.draft_k if draft is not None else ()
    for k, (suffix, adaptive) in [(k, schedule) for k in ks for schedule in schedules.items()]:
        def drafted(name=f"draft_k{k}{suffix}", proposer=DraftProposer(draft[1], draft[0], k=k), adaptive=adaptive):
            last[name] = ja.speculative_generate(params, config, ids, lengths, proposer=proposer, adaptive=adaptive,
                                                 **common)
            return last[name].tokens
        calls[f"draft_k{k}{suffix}"] = drafted
    if hf is not None:
        import torch
        from transformers import GenerationConfig
        tensor = torch.tensor(ids, dtype=torch.long)
        settings = dict(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)

        def peer(name, **extra):
            def call():
                with torch.inference_mode():
                    out = hf.generate(tensor, attention_mask=torch.ones_like(tensor),
                                      generation_config=GenerationConfig(**settings, **extra))
                last[name] = out[0, len(prompt_ids):].tolist()
                return last[name]
            return call

        calls["hf_plain"] = peer("hf_plain")
        calls["hf_lookup"] = peer("hf_lookup", prompt_lookup_num_tokens=args.k, max_matching_ngram_size=args.n_max)
    return calls, last


def measure_prompt(kind: str, model, tokenizer, chat, args, hf=None, draft=None) -> dict:
    """One prompt's candidates timed in turns; tokens/s, speed-ups and our acceptance."""
    from bench.timing import in_turns
    text = chat.render([{"role": "user", "content": PROMPTS[kind]}])
    prompt_ids = tokenizer.encode(text)
    calls, last = candidates(model, prompt_ids, args, hf, draft)
    timings = in_turns(calls, args.rounds)
    plain = [int(t) for t in last["plain"].tokens[0]]
    ngram = [int(t) for t in last["ngram"].tokens[0]]
    stats = last["ngram"].stats
    row = {"prompt_tokens": len(prompt_ids),
           "tokens_per_s": {name: args.new_tokens / t.median_s for name, t in timings.items()},
           "times_s": {name: t.times_s for name, t in timings.items()},
           "ngram": stats.as_dict(), "k_trace": stats.k_trace,
           "ngram_equals_plain": ngram == plain, "ngram_agrees_for": leading_agreement(ngram, plain),
           "end_of_turn_at": plain.index(tokenizer.eos_token_id) if tokenizer.eos_token_id in plain else None,
           "reply": tokenizer.decode(plain)}
    tps = row["tokens_per_s"]
    row["speedup"] = tps["ngram"] / tps["plain"]
    row["drafts"] = {name: draft_row(last[name], plain, tps[name] / tps["plain"]) for name in calls
                     if name.startswith("draft_")}
    if hf is not None:
        row["hf_speedup"] = tps["hf_lookup"] / tps["hf_plain"]
        row["hf_agrees_for"] = leading_agreement(last["hf_plain"], plain)
        row["hf_lookup_agrees_for"] = leading_agreement(last["hf_lookup"], last["hf_plain"])
    return row


def draft_row(out, plain: list[int], speedup: float) -> dict:
    """A draft candidate's speed-up, stats, k trace and tokens against plain greedy decoding's."""
    tokens = [int(t) for t in out.tokens[0]]
    return {"speedup": speedup, "stats": out.stats.as_dict(), "k_trace": out.stats.k_trace,
            "equals_plain": tokens == plain, "agrees_for": leading_agreement(tokens, plain)}


def draft_markdown(record: dict) -> list[str]:
    """The draft candidates' table and how the draft was made (empty without --draft)."""
    if not record.get("draft"):
        return []
    made = record["draft"].get("distill") or {}
    lines = ["", f"Draft model `{record['draft']['name']}`: {record['draft']['layers']} layers"
             + (f", distilled for {made['minutes']:g} min ({made['steps']} steps, init {made['init']}); held-out "
                f"top-1 agreement with the target {made['agreement_before']:.3f} before training, "
                f"{made['agreement_after']:.3f} after" if made else "") + ". Greedy; draft_kN: adaptive k up to N, "
             "draft_kN_fixed: N drafts at every step.", "",
             "| prompt | plain tok/s | draft | draft tok/s | speed-up | acceptance | kept per step | steps "
             "| drafting s | same tokens |", "|---|---:|---|---:|---:|---:|---:|---:|---:|---|"]
    for kind, row in record["prompts"].items():
        tps = row["tokens_per_s"]
        for name, drafted in row["drafts"].items():
            stats = drafted["stats"]
            same = "yes" if drafted["equals_plain"] else f"first {drafted['agrees_for']}"
            lines.append(f"| {kind} | {tps['plain']:.1f} | {name} | {tps[name]:.1f} | {drafted['speedup']:.2f}x | "
                         f"{stats['acceptance_rate']:.2f} | {stats['mean_accepted']:.2f} | {stats['steps']} | "
                         f"{stats['draft_seconds']:.2f} | {same} |")
    return lines


def markdown(record: dict) -> str:
    rows = record["prompts"]
    drafted = (f" and a draft model (k {', '.join(map(str, record['draft']['k']))})" if record.get("draft")
               else "")
    lines = [f"# Speculative decoding at batch 1: {record['model']}, prompt lookup (k={record['k']}, "
             f"n {record['n_min']}..{record['n_max']}){drafted}, {record['new_tokens']} new tokens, greedy", "",
             f"{record['machine']['cpu']}, {record['threads']} threads; medians of {record['rounds']} rounds in "
             f"turns; 1-minute load average {record['load_before']} before, {record['load_after']} after. "
             f"Tokens/s over the whole call (prompt included).", "",
             f"`{record['command']}`", "",
             "| prompt | prompt tokens | plain tok/s | ngram tok/s | speed-up | acceptance | kept per step "
             "| steps | same tokens | transformers plain tok/s | transformers lookup tok/s | transformers speed-up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---|---:|---:|---:|"]
    for kind, row in rows.items():
        tps, stats = row["tokens_per_s"], row["ngram"]
        same = "yes" if row["ngram_equals_plain"] else f"first {row['ngram_agrees_for']}"
        peer = (f"{tps['hf_plain']:.1f} | {tps['hf_lookup']:.1f} | {row['hf_speedup']:.2f}x" if "hf_speedup" in row
                else "– | – | –")
        lines.append(f"| {kind} | {row['prompt_tokens']} | {tps['plain']:.1f} | {tps['ngram']:.1f} | "
                     f"{row['speedup']:.2f}x | {stats['acceptance_rate']:.2f} | {stats['mean_accepted']:.2f} | "
                     f"{stats['steps']} | {same} | {peer} |")
    lines += draft_markdown(record)
    lines += ["", "Acceptance: drafts kept / drafts proposed; kept per step: drafts kept per verification step "
              "(each step also emits one token of its own). Same tokens: the speculative greedy tokens against "
              "`jaxattn.generate`'s.", ""]
    for kind, row in rows.items():
        eot = row["end_of_turn_at"]
        lines.append(f"- {kind}: the reply ends its turn at token {eot}" if eot is not None
                     else f"- {kind}: the reply fills all {record['new_tokens']} tokens")
    return "\n".join(lines) + "\n"


def command_line(argv: list[str]) -> str:
    """The command with relative paths only: the GGUF file by its name, --out inside the repository relative to it."""
    words = []
    for i, word in enumerate(argv):
        flag = argv[i - 1] if i else ""
        if flag == "--gguf":
            word = Path(word).name
        elif flag == "--out" and Path(word).resolve().is_relative_to(ROOT):
            word = Path(word).resolve().relative_to(ROOT).as_posix()
        elif flag == "--out":
            word = "OUT"
        elif flag == "--draft":
            word = Path(word).resolve().relative_to(ROOT).as_posix() if Path(word).resolve().is_relative_to(ROOT) \
                else "DRAFT_DIR"
        words.append(word)
    return " ".join(["PYTHONPATH=$PWD python bench/speculative.py", *words])


def parse_args(argv=None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--gguf", type=Path, required=True, help="SmolLM2-135M-Instruct's GGUF file")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--k", type=int, default=4, help="the most drafts per step (ours and transformers')")
    parser.add_argument("--n-min", type=int, default=1)
    parser.add_argument("--n-max", type=int, default=3, help="the longest n-gram matched (transformers' "
                        "max_matching_ngram_size)")
    parser.add_argument("--threads", type=int, default=cpu_cores())
    parser.add_argument("--prompts", default=",".join(PROMPTS), help="comma-separated, of " + ", ".join(PROMPTS))
    parser.add_argument("--no-hf", action="store_true", help="leave transformers out")
    parser.add_argument("--draft", type=Path, help="a draft model's transformers directory (same tokenizer)")
    parser.add_argument("--draft-k", default="4", help="comma-separated ks of the draft candidates (default 4)")
    parser.add_argument("--draft-fixed", action="store_true", help="each draft candidate also with k fixed "
                        "(adaptive=False: drafting at every step)")
    parser.add_argument("--out", type=Path, default=ROOT / "bench" / "results" / "speculative")
    args = parser.parse_args(argv)
    if not args.gguf.is_file():
        parser.error(f"--gguf {args.gguf}: no such file")
    if args.draft is not None and not (args.draft / "config.json").is_file():
        parser.error(f"--draft {args.draft}: no config.json there")
    try:
        args.draft_k = sorted({int(k) for k in args.draft_k.split(",")}, reverse=True)
    except ValueError:
        parser.error(f"--draft-k: comma-separated ints, got {args.draft_k!r}")
    if min(args.draft_k) < 1:
        parser.error("--draft-k: each k must be >= 1")
    unknown = set(args.prompts.split(",")) - set(PROMPTS)
    if unknown:
        parser.error(f"--prompts: unknown {sorted(unknown)}")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    pin_to_cores(args.threads)  # before JAX and torch size their thread pools
    from bench.machine import describe_machine
    config, params, tokenizer, chat, saved = load(str(args.gguf))
    draft = None if args.draft is None else load_draft(args.draft)
    load_before = load_average()
    with tempfile.TemporaryDirectory(prefix="speculative-hf-") as scratch:
        hf = None if args.no_hf else hf_model(saved, tokenizer, args.threads, scratch)
        prompts = {kind: measure_prompt(kind, (config, params), tokenizer, chat, args, hf, draft)
                   for kind in args.prompts.split(",")}
    record = {"model": args.gguf.name, "dtype": "float32", "new_tokens": args.new_tokens, "rounds": args.rounds,
              "k": args.k, "n_min": args.n_min, "n_max": args.n_max, "threads": args.threads,
              "load_before": load_before, "load_after": load_average(), "machine": describe_machine(),
              "command": command_line(sys.argv[1:] if argv is None else argv),
              "median_speedup": statistics.median(row["speedup"] for row in prompts.values()), "prompts": prompts}
    if draft is not None:
        record["draft"] = {"name": args.draft.name, "layers": draft[0].num_layers, "k": args.draft_k,
                           "distill": draft[2]}
    out = Path(args.out)
    write_results(out.parent, out.name, record, markdown(record))
    return 0


if __name__ == "__main__":
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    sys.exit(main())
