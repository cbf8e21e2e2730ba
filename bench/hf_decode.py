"""Hugging Face transformers `generate` (KV cache, greedy) on GPT-2-shaped random models, or on a checkpoint.

Run with an interpreter that has torch and transformers (bench/decode.py passes
--hf-python) and as many torch threads as the other side's JAX uses (--threads, default: every core
this process may run on); prints one JSON record of the results on stdout:

    /path/to/python-with-torch-and-transformers bench/hf_decode.py --cases baby:1:256,small:8:1000
    /path/to/python-with-torch-and-transformers bench/hf_decode.py --checkpoint DIR --prompt-file P.json \
        --cases moe:8:256

With --checkpoint (bench/decode_moe.py), the model is `AutoModelForCausalLM` from DIR in float32, the
prompt the JSON list of rows in --prompt-file, and each result also holds the generated ids.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel  # noqa: E402

from bench.machine import cpu_cores  # noqa: E402
from bench.timing import time_call  # noqa: E402

SHAPES = {"baby": dict(n_layer=4, n_head=4, n_embd=128), "small": dict(n_layer=6, n_head=6, n_embd=384)}


def gpt2(shape: str, batch: int, prompt_len: int):
    config = GPT2Config(vocab_size=65, n_positions=1024, bos_token_id=0, eos_token_id=0, **SHAPES[shape])
    prompt = torch.randint(1, 65, (batch, prompt_len), generator=torch.Generator().manual_seed(0))
    return GPT2LMHeadModel(config).eval(), prompt


def from_checkpoint(path: str, prompt_file: str, batch: int):
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    rows = json.loads(Path(prompt_file).read_text())
    if len(rows) != batch:
        raise SystemExit(f"error: --prompt-file holds {len(rows)} rows for a batch of {batch}")
    return model, torch.tensor(rows, dtype=torch.long)


def measure(model, prompt, shape: str, new_tokens: int, repeats: int) -> dict:
    batch, prompt_len = prompt.shape
    last = {}

    def run():  # greedy: every call gives the same tokens, kept from the last one
        last["out"] = model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=new_tokens,
                                     min_new_tokens=new_tokens, do_sample=False, use_cache=True, pad_token_id=0)
    with torch.inference_mode():
        timing = time_call(run, repeats)
    out = last["out"]
    assert out.shape == (batch, prompt_len + new_tokens)
    return dict(model=shape, batch=batch, new_tokens=new_tokens, seconds=timing.median_s,
                tokens_per_s=batch * new_tokens / timing.median_s, runs=timing.times_s,
                params=sum(p.numel() for p in model.parameters()), new_tokens_ids=out[:, prompt_len:].tolist())


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--cases", required=True, help="comma-separated MODEL:BATCH:NEW_TOKENS")
    parser.add_argument("--prompt-len", type=int, default=16)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=cpu_cores(),
                        help="torch threads (default: the cores this process may run on, %(default)s)")
    parser.add_argument("--checkpoint", help="a Hugging Face checkpoint directory instead of GPT-2 shapes")
    parser.add_argument("--prompt-file", help="with --checkpoint: a JSON list of prompt rows")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    results = []
    for case in args.cases.split(","):
        shape, batch, new = case.split(":")
        model, prompt = (from_checkpoint(args.checkpoint, args.prompt_file, int(batch)) if args.checkpoint
                         else gpt2(shape, int(batch), args.prompt_len))
        results.append(measure(model, prompt, shape, int(new), args.repeats))
    print(json.dumps(dict(torch=torch.__version__, threads=torch.get_num_threads(), results=results)))


if __name__ == "__main__":
    main()
