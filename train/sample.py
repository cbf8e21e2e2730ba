"""Sample text from a trained (or randomly initialised) LM.

    python -m train.sample --checkpoint runs/shakespeare_char_baby --prompt "ROMEO:" --max-new-tokens 500
    echo "JULIET:" | python -m train.sample --checkpoint DIR --num-samples 3 --temperature 0.8 --top-k 40
    python -m train.sample --random-init shakespeare_char_baby_mla --prompt "ROMEO:"   # --data FILE: its characters
    python -m train.sample --random-init CONFIG.toml --data data/texts_bpe   # a prepared corpus's tokenizer
    python -m train.sample --hf exports/baby --prompt "ROMEO:"   # a transformers directory with tokenizer.json
    python -m train.sample --gguf model-Q4_K_M.gguf --prompt "Hello"   # a llama.cpp file (jaxattn.gguf)
    python -m train.sample --checkpoint DIR --num-samples 8 --cpu-devices 8 --mesh data:2,fsdp:2,tensor:2
    python -m train.sample --hf exports/baby --prompt "ROMEO:" --speculative ngram:k=4   # or draft:DIR,k=4

The text goes to stdout; the kernels, compile time and steady-state tokens/s go to
stderr, with a progress bar on a terminal. Generation is `jaxattn.generate_windowed`:
the KV-cached `generate`, continued in windows past the model's context (`max_seq_len`),
as nanoGPT crops its context; a prompt longer than the context is cropped to its last
`max_seq_len - 1` tokens. The samples are printed as each call of them is drawn; Ctrl-C (or SIGTERM)
stops the call in hand after its window, keeps what was drawn and draws nothing more (exit 130). With --hf (what `python -m train.export` writes, or any supported
transformers save with a tokenizer.json) or --gguf (a llama.cpp GGUF file, its weights
dequantized to float32, or kept as int8 when they are all Q8_0, its tokenizer built from its
metadata) a sample ends at the tokenizer's end-of-sequence token, when it has one. With --mesh
the parameters are laid out on a device mesh by `jaxattn.axes.RULES` and the KV cache is split
by rows (the samples) and kv heads; the tokens are those of one device.

The model comes from `train.models.load.load_model`, the loader of every program, and its flags
from `train.models.source`. The samples are drawn `train.decode.memory.ROWS_PER_CALL` at a time
(fewer where memory is short; `train.decode.calls.sample`), so what one call holds (its KV cache
at the model's context, its logits, XLA's buffers) does not grow with --num-samples; before
compiling, stderr gets the memory the whole run takes at its peak, a warning when that is most of
what is free and an error when it is more than the machine has. A token drawn from logits that are
not finite (a model loaded with --allow-nonfinite) ends the run with a line naming the first layer
whose output is not finite. With --speculative the samples are `jaxattn.speculative_generate`'s, within the
model's context, and stderr gets the drafts' statistics (`train.decode.speculative`).
"""

from __future__ import annotations

import argparse
import sys

import numpy as np
import psutil

from jaxattn import Kernels, axes, prepare_weights, resolve_kernels
from jaxattn.cache.containers import KV_CACHES
from jaxattn.config import ModelConfig
from train import kept_programs
from train.checkpoints.meta import CheckpointError
from train.cli import ArgumentParser, Stopped, UsageError, guard
from train.config import RuntimeConfig
from train.data.errors import DataError
from train.data.tokenizer import Tokenizer
from train.decode import calls, memory, speculative
from train.decode.calls import NonFiniteError
from train.models.load import device_mesh, load_model, quant_line
from train.models.nonfinite import list_weights
from train.models.source import SourceFlags
from train.run import runtime as runtime_lib

PROGRAM = "python -m train.sample"
FLAGS = SourceFlags(scan_layers=True, quant=True, adapter=True)  # every model source and option
BIG_REQUEST = 1_000_000  # tokens (all samples together) from which the time is announced


def parse_args(argv=None) -> argparse.Namespace:
    """The flags, their usage errors said (`UsageError`); `args.model_source` the model they name."""
    parser = ArgumentParser(prog=PROGRAM, description=__doc__.split("\n\n")[0])
    FLAGS.add_to(parser)
    parser.add_argument("--prompt", help="prompt text; '-' or absent (with piped stdin) reads stdin")
    parser.add_argument("--max-new-tokens", type=int, default=500)
    parser.add_argument("--num-samples", type=int, default=1)
    parser.add_argument("--temperature", type=float, default=0.8, help="0 = greedy")
    parser.add_argument("--top-k", type=int, default=200, help="0 = off")
    parser.add_argument("--top-p", type=float, default=1.0, help="1 = off")
    parser.add_argument("--seed", type=int, default=1337, help="the draws' seed (and with --random-init the "
                        "parameters')")
    parser.add_argument("--mesh", help="sample on a device mesh, e.g. data:2,tensor:4 (product = device count)")
    kept_programs.add_flag(parser)
    parser.add_argument("--cpu-devices", type=int, metavar="N", help="make N host devices on a CPU (before JAX "
                        "starts) for --mesh")
    parser.add_argument("--kv-cache", choices=KV_CACHES, default="auto", help="the KV cache's storage: auto (the "
                        "compute dtype) or int8 (int8 numbers with a float32 scale per token and head; default auto)")
    speculative.add_flag(parser)
    args = parser.parse_args(argv)
    args.model_source = FLAGS.read(parser, args)
    speculative.check_flags(parser, args)
    return args


def until_eos(ids: np.ndarray, eos_token_id: int | None) -> np.ndarray:
    """`ids` up to (without) the first `eos_token_id`; all of them when it is None or absent."""
    ends = np.flatnonzero(ids == eos_token_id) if eos_token_id is not None else []
    return ids[:ends[0]] if len(ends) else ids


def read_prompt(prompt: str | None, stdin=None) -> str:
    """The prompt text: the argument, or stdin when it is '-' or absent and stdin is not a terminal; else a newline."""
    stdin = sys.stdin if stdin is None else stdin
    if prompt == "-" or (prompt is None and not stdin.isatty()):
        prompt = stdin.read()
    elif prompt is None:
        prompt = "\n"  # nanoGPT's default start
    if not prompt:
        raise UsageError("the prompt is empty: pass --prompt TEXT or pipe text on stdin")
    return prompt


def encode_prompt(tokenizer: Tokenizer, prompt: str, config: ModelConfig) -> np.ndarray:
    """Prompt ids `[P]`; UsageError for characters the tokenizer does not know."""
    try:
        ids = tokenizer.encode(prompt)
    except ValueError as err:  # text outside the vocabulary (every tokenizer kind raises ValueError)
        raise UsageError(f"the prompt cannot be encoded: {err}") from err
    if len(ids) >= config.max_seq_len:
        print(f"note: the prompt is {len(ids)} tokens and the model's context {config.max_seq_len}: "
              f"it sees the last {config.max_seq_len - 1}", file=sys.stderr)
    return ids


def _check_knobs(args) -> None:
    """UsageError for a sampling knob out of its range, or a request too big for this machine; a warning
    for one that takes a while."""
    if args.max_new_tokens < 1 or args.num_samples < 1:
        raise UsageError("--max-new-tokens and --num-samples must be >= 1")
    if not args.temperature >= 0:
        raise UsageError(f"--temperature must be >= 0 (0 = greedy), got {args.temperature}")
    if not 0 <= args.seed < 2 ** 63:
        raise UsageError(f"--seed must be in [0, 2**63), got {args.seed}")
    if args.top_k < 0:
        raise UsageError(f"--top-k must be >= 0 (0 = off), got {args.top_k}")
    if not 0.0 < args.top_p <= 1.0:
        raise UsageError(f"--top-p must be in (0, 1], got {args.top_p}")
    if args.cpu_devices is not None:
        _check_cpu_devices(args.cpu_devices, args.mesh, args.num_samples)
    tokens, what = args.max_new_tokens * args.num_samples, f"{args.num_samples} x {args.max_new_tokens}"
    memory.check_ids_fit(tokens, what)
    if tokens >= BIG_REQUEST:
        print(f"warning: {tokens:,} tokens ({what}) take a while; Ctrl-C stops and prints what was generated",
              file=sys.stderr)


def _check_cpu_devices(cpu_devices: int, mesh: str | None, num_samples: int) -> None:
    """UsageError unless `--cpu-devices` makes exactly the devices of a `--mesh` (none idle; sampling
    without a mesh uses one device); the runtime's warning when they outnumber the cores."""
    if mesh is None:
        raise UsageError(f"--cpu-devices {cpu_devices} makes host devices for a --mesh of that size: "
                         "pass --mesh too (e.g. --mesh data:N), or leave both out")
    try:
        config = RuntimeConfig(cpu_devices=cpu_devices, mesh=mesh)
        warnings = runtime_lib.check_cpu_devices(config, num_samples)
    except ValueError as err:
        raise UsageError(str(err)) from err
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)


class SamplePrinter:
    """Prints samples on stdout as they come, prompt + text, between separator lines, each decoded alone;
    `close()` ends the last line."""

    def __init__(self, prompt: str, tokenizer):
        self.prompt, self.tokenizer, self.printed = prompt, tokenizer, 0
        self.eos = getattr(tokenizer, "eos_token_id", None)

    def __call__(self, ids: np.ndarray) -> None:
        for row in ids:
            text = self.prompt + self.tokenizer.decode(until_eos(row, self.eos))
            sys.stdout.write(("\n---------------\n" if self.printed else "") + text)
            self.printed += 1
        sys.stdout.flush()

    def close(self) -> None:
        if self.printed:
            sys.stdout.write("\n")
            sys.stdout.flush()


def stop_line(sampled: calls.Sampled, draw: calls.Draw) -> str:
    """What a stopped run says it kept."""
    kept = f"{sampled.stopped} after {sampled.complete} of {draw.num_samples} samples"
    if sampled.cut:
        kept += (f" and {sampled.cut} cut at {sampled.cut_tokens} of {draw.max_new_tokens} new tokens"
                 if draw.num_samples > 1 else f" ({sampled.cut_tokens} of {draw.max_new_tokens} new tokens)")
    return kept + ": what was generated is printed above" + (
        "; the others were never drawn" if sampled.complete + sampled.cut < draw.num_samples else "")


def plan_sampling(args, config: ModelConfig, prompt_len: int, kernels, mesh) -> memory.MemoryEstimate:
    """The memory plan of this run on this machine, reported on stderr (`train.decode.memory.plan_memory`)."""
    machine = psutil.virtual_memory()
    plan, warnings = memory.plan_memory(config, prompt_len=prompt_len, num_samples=args.num_samples,
                                        max_new_tokens=args.max_new_tokens,
                                        rows=memory.rows_per_call(args.num_samples, mesh),
                                        process=psutil.Process().memory_info().rss,
                                        available=int(machine.available), physical=int(machine.total),
                                        kernels=kernels)
    print(f"memory: {plan.describe()}", file=sys.stderr)
    for warning in warnings:
        print(f"warning: {warning}", file=sys.stderr)
    return plan


def run(argv=None) -> int:
    """Loads the model, samples, reports kernels, memory and timing on stderr, prints the texts (prompt +
    continuation) on stdout; after a stop signal prints what was drawn and raises `Stopped`."""
    args = parse_args(argv)
    _check_knobs(args)
    if args.cpu_devices is not None:
        runtime_lib.host_devices(args.cpu_devices)  # before anything starts JAX
    kept = kept_programs.KeptPrograms(args)
    prompt = read_prompt(args.prompt)
    loaded = load_model(args.model_source)
    loaded.print_notes()
    params, config, tokenizer = loaded.params, loaded.config, loaded.tokenizer
    listed = list_weights(params) if args.allow_nonfinite else ""  # a damaged model is sampled until it fails
    if listed:
        print(f"warning: the weights holding NaN or infinity: {listed}; sampling stops at the first token whose "
              "logits are not finite", file=sys.stderr)
    prompt_ids = encode_prompt(tokenizer, prompt, config)
    mesh = device_mesh(args.mesh, config)
    kernels, reasons = resolve_kernels(Kernels.auto())
    print(f"kernels: decode {kernels.decode!r} ({reasons['decode']}), matmul {kernels.matmul!r} "
          f"({reasons['matmul']})" + (f"; mesh {axes.MeshShape.of(mesh)}" if mesh is not None else "")
          + quant_line(loaded.quant, kernels, reasons, loaded.head_quant), file=sys.stderr)
    plan = plan_sampling(args, config, len(prompt_ids), kernels, mesh)
    params = prepare_weights(params, kernels)  # e.g. quantized weights in the native kernel's panels
    draw = calls.Draw(num_samples=args.num_samples, max_new_tokens=args.max_new_tokens, seed=args.seed,
                      temperature=args.temperature, top_k=args.top_k, top_p=args.top_p, kv_cache=args.kv_cache)
    printer = SamplePrinter(prompt, tokenizer)
    try:
        if args.speculative is not None:  # train.decode.speculative: speculative_generate, within the context
            sampled = speculative.sample(args.speculative, params, config, prompt_ids, draw, kernels, plan.rows,
                                         eos=printer.eos, emit=printer)
        else:
            sampled = calls.sample(params, config, prompt_ids, draw, kernels, mesh, plan.rows, emit=printer)
    finally:
        printer.close()
    kept.report()
    if sampled.stopped:
        raise Stopped(stop_line(sampled, draw))
    return 0


def main(argv=None) -> int:
    """0 after printing the samples; one line and exit 1, 2 or 130 otherwise (train.cli)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError, DataError, NonFiniteError))


if __name__ == "__main__":
    sys.exit(main())
