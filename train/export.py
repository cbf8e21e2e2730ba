"""Write a trained run as a Hugging Face transformers directory, with its tokenizer.

    python -m train.export --checkpoint runs/shakespeare_char_baby --out exports/baby
    python -m train.export --checkpoint runs/NAME --out DIR --overwrite   # replace what DIR holds

DIR then holds config.json, model.safetensors, tokenizer.json (the run's character or
byte tokenizer, same ids) and tokenizer_config.json, and loads with
`transformers.AutoModelForCausalLM.from_pretrained(DIR)`
and `AutoTokenizer.from_pretrained(DIR)`, or here with
`python -m train.sample --hf DIR` and `python -m train.attention_maps --hf DIR`.
The architecture is the transformers one that computes the same function as the run's
model (jaxattn.hf.export: RoPE + LayerNorm + GELU, the default, is GPTNeoXForCausalLM; learned
positions GPT2LMHeadModel; RoPE + RMSNorm + SwiGLU LlamaForCausalLM); a config with none
(e.g. sinusoidal positions, or GQA with LayerNorm) is refused in one line, before anything
is written.

`load_hf` is the reader of such a directory (or any transformers save with a
tokenizer.json) for `train.sample` and `train.attention_maps`.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from jaxattn.config import ModelConfig
from train import checkpoint as checkpoint_lib
from train.checkpoint import CheckpointError
from train.tokenizer import to_hf_tokenizer


def _hf():
    """`jaxattn.hf`, imported on first use (it needs safetensors); ImportError as a CheckpointError."""
    try:
        from jaxattn import hf
    except ImportError as err:
        raise CheckpointError(f"Hugging Face interop needs {err.name or 'a missing package'}: "
                              "pip install safetensors tokenizers") from err
    return hf


def _check_out(out: Path, checkpoint: Path, overwrite: bool) -> None:
    """CheckpointError when writing `out` would replace something without --overwrite, or the run itself."""
    if out.exists() and not out.is_dir():
        raise CheckpointError(f"--out {out} is a file, not a directory")
    if out.is_dir() and any(out.iterdir()) and not overwrite:
        raise CheckpointError(f"--out {out} is not empty: pass --overwrite to replace what it holds, "
                              "or choose another directory")
    run = checkpoint.resolve()
    if out.resolve() == run or out.resolve() in run.parents:
        raise CheckpointError(f"--out {out} holds the checkpoint being exported: choose another directory")


def export(checkpoint: str | Path, out: str | Path, *, overwrite: bool = False) -> tuple[str, list[Path]]:
    """Writes the run at `checkpoint` (best step, else latest) as a transformers directory `out`.

    Returns (the transformers architecture written, the files `out` now holds). CheckpointError
    (a ValueError) when the checkpoint cannot be read, `out` is not empty and not
    `overwrite`, or the model or tokenizer has no transformers counterpart; nothing is
    written then.
    """
    out, checkpoint = Path(out), Path(checkpoint)
    _check_out(out, checkpoint, overwrite)
    params, config, tokenizer = checkpoint_lib.load_for_sampling(checkpoint)
    hf = _hf()
    try:
        hf_tokenizer = to_hf_tokenizer(tokenizer)
        hf.save_pretrained(out, config, params, tokenizer=hf_tokenizer, overwrite=overwrite)
    except ImportError as err:
        raise CheckpointError(f"exporting a tokenizer needs the tokenizers package ({err})") from err
    except ValueError as err:  # hf.UnsupportedCheckpoint among them: the message names the field
        raise CheckpointError(f"cannot export {checkpoint}: {err}") from err
    architecture = json.loads((out / "config.json").read_text()).get("architectures", ["?"])[0]
    return architecture, sorted(p for p in out.rglob("*") if p.is_file())


def load_hf(directory: str | Path) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of a transformers directory holding a tokenizer.json.

    The tokenizer has `encode(text) -> ids`, `decode(ids) -> str` and `eos_token_id`
    (int or None); the params are float32, for `jaxattn.DecoderLM(config)`. CheckpointError
    (one line) for a missing directory or tokenizer.json, an unsupported architecture or
    unreadable weights. The tokenizer is read first: a bad directory fails before any tensor.
    """
    path = Path(directory)
    if not path.is_dir():
        raise CheckpointError(f"{str(path)!r} is not a directory (expected a transformers save: "
                              "config.json, *.safetensors, tokenizer.json)")
    if not (path / "tokenizer.json").is_file():
        raise CheckpointError(f"{path} has no tokenizer.json: the text cannot be encoded (python -m "
                              "train.export writes one; for a transformers model, save its fast tokenizer there)")
    hf = _hf()
    try:
        tokenizer = hf.load_tokenizer(path)
        config, params = hf.load_pretrained(path, dtype="float32")
    except (ValueError, OSError) as err:
        raise CheckpointError(f"cannot load {path}: {err}") from err
    return params, config, tokenizer


def report(out: Path, architecture: str, files: list[Path]) -> str:
    """What `main` prints after an export: the architecture, the files, how to load them."""
    lines = [f"wrote {out} as {architecture}:"]
    lines += [f"  {p.relative_to(out)}  ({p.stat().st_size:,} bytes)" for p in files]
    lines += ["load it with transformers:",
              f"  AutoModelForCausalLM.from_pretrained({str(out)!r}), AutoTokenizer.from_pretrained({str(out)!r})",
              f"or sample here: python -m train.sample --hf {out} --prompt \"ROMEO:\""]
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 written, 1 a runtime error (one `error:` line), 2 a usage error (argparse)."""
    parser = argparse.ArgumentParser(prog="python -m train.export", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", required=True, metavar="RUN", help="a run directory (or its checkpoints/...)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the transformers directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace what DIR already holds")
    args = parser.parse_args(argv)
    try:
        architecture, files = export(args.checkpoint, args.out, overwrite=args.overwrite)
    except (CheckpointError, OSError) as err:
        print("error: " + "; ".join(line.strip() for line in str(err).splitlines()), file=sys.stderr)  # one line
        return 1
    print(report(Path(args.out), architecture, files))
    return 0


if __name__ == "__main__":
    sys.exit(main())
