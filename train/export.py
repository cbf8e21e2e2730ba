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

`load_hf` is the reader of such a directory (or any transformers save with a
tokenizer.json) for `train.sample` and `train.attention_maps`; `load_gguf` the reader of a GGUF
file for `train.sample` and `train.serve`.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

from jaxattn.config import ModelConfig
from train import sampling_checkpoint
from train.checkpoint import CheckpointError
from train.cli import ArgumentParser, guard, one_line
from train.outputs import check_folder
from train.tokenizer import to_hf_tokenizer

if TYPE_CHECKING:
    from jaxattn.hf import SaveReport

PROGRAM = "python -m train.export"


def _hf():
    """`jaxattn.hf`, imported on first use (it needs safetensors); ImportError as a CheckpointError."""
    try:
        from jaxattn import hf
    except ImportError as err:
        raise CheckpointError(f"Hugging Face interop needs {err.name or 'a missing package'}: "
                              "pip install safetensors tokenizers") from err
    return hf


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
    """Writes the run at `checkpoint` (best step, else latest) as a transformers directory `out`.

    Returns `jaxattn.hf.SaveReport`: the transformers architecture, the files written (only
    those: a file of the user's in `out` is never among them) and, with `overwrite`, the
    files of an earlier export they replaced. CheckpointError (a ValueError) when the
    checkpoint cannot be read, `out` is not empty and not `overwrite`, or the model or
    tokenizer has no transformers counterpart; UnwritablePath (an OSError) when `out`
    cannot be written. Nothing is written then.
    """
    out, checkpoint = Path(out), Path(checkpoint)
    _check_out(out, checkpoint, overwrite)
    params, config, tokenizer = sampling_checkpoint.load_for_sampling(checkpoint)
    hf = _hf()
    try:
        hf_tokenizer = to_hf_tokenizer(tokenizer)
        return hf.save_pretrained(out, config, params, tokenizer=hf_tokenizer, overwrite=overwrite)
    except ImportError as err:
        raise CheckpointError(f"exporting a tokenizer needs the tokenizers package ({err})") from err
    except (ValueError, FileExistsError) as err:  # hf.UnsupportedCheckpoint among them: the message names the field
        raise CheckpointError(f"cannot export {checkpoint}: {one_line(err)}") from err


def _gguf():
    """`jaxattn.gguf`, imported on first use (it needs the gguf package); ImportError as a CheckpointError."""
    try:
        from jaxattn import gguf
    except ImportError as err:
        raise CheckpointError(f"reading GGUF files needs {err.name or 'a missing package'}: pip install gguf") from err
    return gguf


def _open_gguf(path: str | Path):
    """The `jaxattn.gguf.GGUFModel` of `path`; CheckpointError (one line, naming the file) when it cannot be read."""
    gguf, hf = _gguf(), _hf()
    try:
        return gguf.GGUFModel.open(path)
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


def _load_gguf_model(model, allow_nonfinite: bool) -> tuple[Any, ModelConfig, Any]:
    hf = _hf()
    try:
        tokenizer = model.tokenizer()
        config, params = model.load("float32", allow_nonfinite=allow_nonfinite)
    except hf.HFCheckpointError as err:
        message = one_line(err).replace(hf.checkpoint.NONFINITE_HINT, "--allow-nonfinite loads them anyway")
        raise CheckpointError(f"cannot load {message}") from err
    return params, config, tokenizer


def load_gguf(path: str | Path, *, allow_nonfinite: bool = False) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of a llama.cpp GGUF file, as `load_hf` gives them for a directory.

    The weights are dequantized to float32. CheckpointError (one line, naming the file and the key,
    tensor, architecture or tensor type) for a file that is missing, is not GGUF, or holds what
    jaxattn does not read; the tokenizer is built (and checked) before any tensor is read.
    """
    return _load_gguf_model(_open_gguf(path), allow_nonfinite)


def gguf_kept_quantization(path: str | Path) -> str | None:
    """The `jaxattn.quantize` mode that keeps a GGUF file's weights as the file stores them, or None.

    "int8:32" when its matmul weights are all Q8_0 (`jaxattn.gguf.GGUFModel.kept_quantization`:
    quantizing `load_gguf`'s float32 params so gives back the file's int8 values and scales
    exactly); None for any other file. A separate step from `load_gguf`, whose params stay float32.
    CheckpointError as `load_gguf` raises it.
    """
    return _open_gguf(path).kept_quantization()


def _chat(model) -> tuple[str | None, dict[str, str]]:
    hf = _hf()
    try:
        return model.chat_template, model.special_tokens
    except hf.HFCheckpointError as err:
        raise CheckpointError(f"cannot load {one_line(err)}") from err


def gguf_chat(path: str | Path) -> tuple[str | None, dict[str, str]]:
    """(the chat template or None, the named special tokens) of a GGUF file, for `train.serve`."""
    return _chat(_open_gguf(path))


def export_gguf(gguf_file: str | Path, out: str | Path, *, overwrite: bool = False) -> SaveReport:
    """Writes a llama.cpp GGUF file as a transformers directory `out` (see the module docstring).

    Returns `jaxattn.hf.SaveReport`, chat_template.jinja among its files when the GGUF file has a
    template. CheckpointError as `export` raises it, and for a GGUF file that cannot be read;
    nothing is written then.
    """
    out, gguf_file = Path(out), Path(gguf_file)
    _check_out(out, gguf_file, overwrite)
    model = _open_gguf(gguf_file)
    template, specials = _chat(model)
    params, config, tokenizer = _load_gguf_model(model, allow_nonfinite=False)
    hf = _hf()
    try:
        saved = hf.save_pretrained(out, config, params, tokenizer=tokenizer, overwrite=overwrite)
    except (ValueError, FileExistsError) as err:  # hf.UnsupportedCheckpoint among them: the message names the field
        raise CheckpointError(f"cannot export {gguf_file}: {one_line(err)}") from err
    settings = json.loads((out / "tokenizer_config.json").read_text())
    (out / "tokenizer_config.json").write_text(json.dumps({**specials, **settings}, indent=2) + "\n")
    if template is None:
        return saved
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return dataclasses.replace(saved, written=tuple(sorted([*saved.written, out / "chat_template.jinja"])))


def load_hf(directory: str | Path, *, allow_nonfinite: bool = False) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) of a transformers directory holding a tokenizer.json.

    The tokenizer has `encode(text) -> ids`, `decode(ids) -> str` and `eos_token_id`
    (int or None); the params are float32, for `jaxattn.DecoderLM(config)`. CheckpointError
    (one line, naming the file and the key or tensor) for a missing directory or
    tokenizer.json, an unsupported architecture, a damaged file, or weights holding NaN or
    infinity (loaded anyway with `allow_nonfinite`). The tokenizer is read first: a bad
    directory fails before any tensor.
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
        config, params = hf.load_pretrained(path, dtype="float32", allow_nonfinite=allow_nonfinite)
    except hf.HFCheckpointError as err:
        message = one_line(err).replace(hf.checkpoint.NONFINITE_HINT, "--allow-nonfinite loads them anyway")
        where = "" if isinstance(err, hf.InvalidCheckpoint) else f"{path}: "  # an InvalidCheckpoint names its file
        raise CheckpointError(f"cannot load {where}{message}") from err
    except OSError as err:
        raise CheckpointError(f"cannot load {path}: {err.filename or path}: {err.strerror or err}") from err
    return params, config, tokenizer


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
    source = parser.add_mutually_exclusive_group(required=True)
    source.add_argument("--checkpoint", metavar="RUN", help="a run directory (or its checkpoints/...)")
    source.add_argument("--gguf", metavar="FILE", help="a llama.cpp GGUF file (its weights dequantized)")
    parser.add_argument("--out", required=True, metavar="DIR", help="the transformers directory to write")
    parser.add_argument("--overwrite", action="store_true", help="replace an earlier export in DIR (its files "
                        "only: other files in DIR stay)")
    parser.add_argument("--quant", help="refused: quantized weights are not exported (quantize when loading: "
                        "python -m train.sample or train.serve --quant)")
    args = parser.parse_args(argv)
    if args.quant is not None:
        parser.error(f"--quant {args.quant}: quantized weights are not exported; export the float weights and "
                     "pass --quant to python -m train.sample or train.serve")
    if args.gguf is not None:
        print(report(export_gguf(args.gguf, args.out, overwrite=args.overwrite)))
    else:
        print(report(export(args.checkpoint, args.out, overwrite=args.overwrite)))
    return 0


def main(argv: list[str] | None = None) -> int:
    """Exit status: 0 written, 1 a runtime error, 2 a usage error (each one `error:` line on stderr)."""
    return guard(PROGRAM, lambda: run(argv), expected=(CheckpointError,))


if __name__ == "__main__":
    sys.exit(main())
