"""Write a trained run as a Hugging Face transformers directory, with its tokenizer.

    python -m train.export --checkpoint runs/shakespeare_char_baby --out exports/baby
    python -m train.export --checkpoint runs/NAME --out DIR --overwrite   # replace an earlier export
    python -m train.export --gguf model-Q8_0.gguf --out DIR   # a llama.cpp file as a transformers directory

DIR then holds config.json, model.safetensors, generation_config.json, tokenizer.json (the
run's tokenizer with the same ids: its character or byte tokenizer as a `tokenizers` one, or the
BPE or Hugging Face tokenizer.json of its prepared corpus as it is) and tokenizer_config.json,
and loads with
`transformers.AutoModelForCausalLM.from_pretrained(DIR)`
and `AutoTokenizer.from_pretrained(DIR)`, or here with
`python -m train.sample --hf DIR` and `python -m train.attention_maps --hf DIR`.
The architecture is the transformers one that computes the same function as the run's
model (jaxattn.hf.export: RoPE + LayerNorm + GELU, the default, is GPTNeoXForCausalLM; learned
positions GPT2LMHeadModel; RoPE + RMSNorm + SwiGLU LlamaForCausalLM); a config with none
(e.g. sinusoidal positions, or GQA with LayerNorm) is refused in one line, before anything
is written. A non-empty DIR is refused unless --overwrite, which replaces those files (and an
older sharded save's index and the shards it lists) and leaves every other file in DIR as it was.

With --gguf FILE the source is a llama.cpp GGUF file (`jaxattn.gguf`: its weights dequantized
to float32) instead of a run: DIR gets its family's transformers architecture, the tokenizer built
from the file's vocabulary, and its chat template as chat_template.jinja (with the file's named
special tokens in tokenizer_config.json, which templates use).

The model is read by the programs' one loader, `train.models.load.load_model`, its weights as the
run or the file saved them; the same loader reads the directory written (`--hf DIR`, or any
transformers save with a tokenizer.json) for `train.sample`, `train.serve` and `train.attention_maps`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path

from jaxattn import hf
from jaxattn.hf import SaveReport
from train.checkpoints import init_from
from train.checkpoints.store import CheckpointError
from train.cli import ArgumentParser, guard, one_line
from train.data.tokenizer import to_hf_tokenizer
from train.models import runs
from train.models.load import load_model
from train.models.source import ModelSource, SourceFlags
from train.outputs import check_folder

PROGRAM = "python -m train.export"
# A run or a GGUF file, read as saved: its own weights' names and layout, float (nothing fused or kept int8).
FLAGS = SourceFlags(sources=("checkpoint", "gguf"), data=False, allow_nonfinite=False, as_saved=True)


def _check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """Refuses an `out` that cannot take an export, before the checkpoint is read.

    CheckpointError when writing `out` would replace something without --overwrite, or
    the run itself; UnwritablePath (an OSError) when no file can be written there.
    """
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"--out {out} is not empty: pass --overwrite to replace an earlier export there "
                              "(other files stay), or choose another directory")
    run = checkpoint.resolve()
    if out.resolve() == run or out.resolve() in run.parents:
        raise CheckpointError(f"--out {out} holds the checkpoint being exported: choose another directory")
    check_folder(out, "--out")


def export(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> SaveReport:
    """Writes the run at `checkpoint` (best step, else latest) as a transformers directory `out`; a LoRA
    run's adapters merged into its base (`python -m train.export --merge`).

    Returns `jaxattn.hf.SaveReport`: the transformers architecture, the files written (only
    those: a file of the user's in `out` is never among them) and, with `overwrite`, the
    files of an earlier export they replaced. CheckpointError (a ValueError) when the
    checkpoint cannot be read, `out` is not empty and not `overwrite`, or the model or
    tokenizer has no transformers counterpart; UnwritablePath (an OSError) when `out`
    cannot be written. Nothing is written then.
    """
    out, checkpoint = Path(out), Path(checkpoint)
    _check_out(out, checkpoint, overwrite)
    loaded = load_model(ModelSource(checkpoint=str(checkpoint), as_saved=True))
    try:
        hf_tokenizer = to_hf_tokenizer(loaded.tokenizer)
        return hf.save_pretrained(out, loaded.config, loaded.params, tokenizer=hf_tokenizer, overwrite=overwrite)
    except ImportError as err:
        raise CheckpointError(f"exporting a tokenizer needs the tokenizers package ({err})") from err
    except (ValueError, FileExistsError) as err:  # hf.UnsupportedCheckpoint among them: the message names the field
        raise CheckpointError(f"cannot export {checkpoint}: {one_line(err)}") from err


def export_adapter(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> list[Path]:
    """Writes a LoRA run's adapters (best step, else latest) as a PEFT adapter directory `out`
    (`jaxattn.hf.peft.save_adapter`: adapter_config.json and adapter_model.safetensors, which
    `peft.PeftModel.from_pretrained` loads onto the run's base, named there as its `train.init_from`).

    Returns the files written. CheckpointError when the run is no LoRA run, its base cannot be read or
    has changed, `out` holds an adapter and not `overwrite`, or PEFT cannot hold the adapters (one line
    naming the module); nothing is written then.
    """
    out, checkpoint = Path(out), Path(checkpoint)
    _check_out(out, checkpoint, overwrite=True)  # other files in `out` stay; an adapter there needs --overwrite
    params, config, _ = runs.load_adapted(checkpoint)
    _, base = init_from.parse_source(config.train.init_from)
    try:
        hf.peft.save_adapter(out, config.model, params, config.lora.settings(), base_model_name_or_path=str(base),
                             overwrite=overwrite)
    except FileExistsError as err:
        raise CheckpointError(f"--out {out} holds an adapter already: pass --overwrite to replace it") from err
    except ValueError as err:  # hf.UnsupportedCheckpoint among them: the message names the module
        raise CheckpointError(f"cannot export {checkpoint}'s adapters: {one_line(err)} (--merge writes the base with "
                              "the adapters merged instead)") from err
    return [out / name for name in (hf.peft.CONFIG_FILE, hf.peft.WEIGHTS_FILE)]


def export_gguf(gguf_file: str | Path, out: str | Path, *, overwrite: bool = False) -> SaveReport:
    """Writes a llama.cpp GGUF file as a transformers directory `out` (see the module docstring).

    Returns `jaxattn.hf.SaveReport`, chat_template.jinja among its files when the GGUF file has a
    template. CheckpointError as `export` raises it, and for a GGUF file that cannot be read;
    nothing is written then.
    """
    out, gguf_file = Path(out), Path(gguf_file)
    _check_out(out, gguf_file, overwrite)
    loaded = load_model(ModelSource(gguf=str(gguf_file), as_saved=True))
    template, specials = loaded.read_chat()
    try:
        saved = hf.save_pretrained(out, loaded.config, loaded.params, tokenizer=loaded.tokenizer, overwrite=overwrite)
    except (ValueError, FileExistsError) as err:  # hf.UnsupportedCheckpoint among them: the message names the field
        raise CheckpointError(f"cannot export {gguf_file}: {one_line(err)}") from err
    settings = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**specials, **settings}, indent=2) + "\n")
    if template is None:
        return saved
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dataclasses.replace(saved, written=tuple(sorted([*saved.written, out / "chat_template.jinja"])))


def report(saved: SaveReport) -> str:
    """What `main` prints after an export (`saved`, a SaveReport): the architecture, the files, how to load them."""
    out = saved.directory
    lines = [f"wrote {out} as {saved.architecture}:"]
    lines += [f"  {p.relative_to(out)}  ({p.stat().st_size:,} bytes)" for p in saved.written]
    if saved.replaced:
        lines += [f"replaced: {', '.join(str(p.relative_to(out)) for p in saved.replaced)} (an earlier save's; "
                  "other files in the directory are untouched)"]
    lines += ["load it with transformers:",
              f"  AutoModelForCausalLM.from_pretrained({str(out)!r}), AutoTokenizer.from_pretrained({str(out)!r})",
              f"or sample here: python -m train.sample --hf {out} --prompt \"ROMEO:\""]
    return "\n".join(lines)


def run(argv: list[str] | None = None) -> int:
    """Parses `argv`, exports, prints the report; raises UsageError, CheckpointError or OSError."""
    parser = ArgumentParser(prog=PROGRAM, description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    FLAGS.add_to(parser)
    parser.add_argument("--out", required=True, metavar="DIR", help="the transformers directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in DIR (its files "
                        "only: other files in DIR stay)")
    parser.add_argument("--quant", help="refused: quantized weights are not exported (quantize when loading: "
                        "python -m train.sample or train.serve --quant)")
    parser.add_argument("--merge", action="store_true", help="a LoRA run: its adapters merged into the base, a "
                        "whole transformers directory (without it: a PEFT adapter directory)")
    args = parser.parse_args(argv)
    source = FLAGS.read(parser, args)
    if args.quant is not None:
        parser.error(f"--quant {args.quant}: quantized weights are not exported; export the float weights and "
                     "pass --quant to python -m train.sample or train.serve")
    if source.kind == "gguf":
        if args.merge:
            parser.error("--merge merges a LoRA run's adapters; a GGUF file has none")
        print(report(export_gguf(source.gguf, args.out, overwrite=args.overwrite)))
    elif runs.is_lora_run(source.checkpoint) and not args.merge:
        written = export_adapter(source.checkpoint, args.out, overwrite=args.overwrite)
        print(adapter_report(written, json.loads((written[0]).read_text())["base_model_name_or_path"]))
    else:
        if args.merge and not runs.is_lora_run(source.checkpoint):
            parser.error(f"--merge merges a LoRA run's adapters; {source.checkpoint} trained every weight: export it "
                         "without --merge")
        print(report(export(source.checkpoint, args.out, overwrite=args.overwrite)))
    return 0


def adapter_report(written: list[Path], base: str) -> str:
    """What `export_adapter` wrote and how to load it onto `base` (the run's `train.init_from` directory)."""
    out = written[0].parent
    lines = [f"wrote {out} as a PEFT LoRA adapter:"]
    lines += [f"  {p.name}  ({p.stat().st_size:,} bytes)" for p in written]
    lines += ["load it with peft:",
              f"  PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained({base!r}), {str(out)!r})",
              f"or sample here: python -m train.sample --hf {base} --adapter {out}",
              "(python -m train.export --merge writes the base with the adapters merged, a whole transformers "
              "directory)"]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 written, 1 a runtime error, 2 a usage error (each one `error:` line on stderr)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError,))


if __name__ == "__main__":
    sys.exit(main())
