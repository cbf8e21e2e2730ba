"""The model-source flags, defined once for every program that loads a model.

    --checkpoint DIR | --hf DIR | --gguf FILE | --random-init CONFIG    (one of them, required)
    --data FILE_OR_DIR   --allow-nonfinite   --scan-layers   --quant MODE   --adapter DIR   --seed N

A program says which of them it takes with a `SourceFlags` (`python -m train.sample` takes them
all, `train.export` --checkpoint and --gguf alone), adds them to its parser (`add_to`) and reads
them back as a `ModelSource` (`read`), the one place of their usage errors: `--data goes with
--random-init`, `--allow-nonfinite goes with --hf or --gguf`, `--quant does not go with --mesh`.
`train.models.load.load_model(source)` loads the model a `ModelSource` names.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

SOURCES = ("checkpoint", "hf", "gguf", "random_init")  # where a model comes from: exactly one is given
PRETRAINED = ("hf", "gguf")  # made elsewhere: the sources whose weights may hold NaN or infinity
QUANT_MODES = ("int8", "int8:channel", "int4", "int4:64")  # --quant
OPTIONS = ("data", "allow_nonfinite", "scan_layers", "quant", "adapter")  # the flags a program may take or not
SEED_LIMIT = 2 ** 32  # a --seed of the random init alone (train.attention_maps): jax.random.PRNGKey's range

SOURCE_HELP = {
    "checkpoint": ("DIR", "a training run directory (or its checkpoints/...)"),
    "hf": ("DIR", "a transformers directory with a tokenizer.json (e.g. written by python -m train.export; its "
                  "chat template from chat_template.jinja or tokenizer_config.json)"),
    "gguf": ("FILE", "a llama.cpp GGUF file (its quantized weights kept so, in the nearest native format where "
                     "the file's has none, unless --dtype float32; the tokenizer and chat template from its "
                     "metadata)"),
    "random_init": ("CONFIG", "a config name from configs/ (or a .toml file), randomly initialised"),
}
DATA_HELP = {
    False: "with --random-init: the text whose characters are the vocabulary (default: Tiny Shakespeare), or a "
           "directory prepared by python -m train.prepare, whose tokenizer is used",
    True: "with --random-init: the corpus its tokenizer is built from, as training builds it (default: the "
          "config's data_path)",
}


def flag(name: str) -> str:
    """The command-line flag of a `ModelSource` field: "random_init" -> "--random-init"."""
    return "--" + name.replace("_", "-")


@dataclass(frozen=True)
class ModelSource:
    """Where a program's model comes from, and what is done to it as it loads (`load_model`).

    Attributes:
      checkpoint, hf, gguf, random_init: the source, exactly one of them: a training run, a
        transformers directory, a GGUF file, a config (a name in configs/ or a .toml file).
      data: with random_init, where its tokenizer comes from (`train.models.fresh`).
      seed: with random_init, the parameters' seed.
      allow_nonfinite: with hf or gguf, load weights holding NaN or infinity.
      adapter: a PEFT LoRA adapter directory merged into the model.
      quant: a `jaxattn.quantize` mode for the weights (None: as loaded).
      dtype: "float32": a GGUF file's quantized weights dequantized to float32 rather than kept quantized.
      scan_layers: the repeated layers stacked under one scan (True), one by one (False), or as saved.
      on_mesh: the model will be laid out on a device mesh: a GGUF file's Q8_0 weights are not kept int8.
      as_saved: the float weights in the source's own layout and names, nothing fused or kept int8
        (what `train.export` writes and `train.attention_maps` names).
      fit_vocab: with random_init, the tokenizer the config trains with and the vocab_size made its
        size (`train.models.fresh.as_trained`), instead of `--data`'s and a vocab_size that must match.
    """

    checkpoint: str | None = None
    hf: str | None = None
    gguf: str | None = None
    random_init: str | None = None
    data: str | None = None
    seed: int = 0
    allow_nonfinite: bool = False
    adapter: str | None = None
    quant: str | None = None
    dtype: str | None = None
    scan_layers: bool | None = None
    on_mesh: bool = False
    as_saved: bool = False
    fit_vocab: bool = False

    def __post_init__(self):
        given = [name for name in SOURCES if getattr(self, name) is not None]
        if len(given) != 1:
            raise ValueError(f"a ModelSource names exactly one of {', '.join(SOURCES)}, got {given or 'none'}")

    @property
    def kind(self) -> str:
        """Which source it is: "checkpoint", "hf", "gguf" or "random_init"."""
        return next(name for name in SOURCES if getattr(self, name) is not None)

    @property
    def path(self) -> str:
        """The source's value as given: the directory, the file or the config."""
        return getattr(self, self.kind)

    @property
    def name(self) -> str:
        """The model's name (the id `train.serve` serves it as): a GGUF file's or a config's stem, a
        directory's own name."""
        if self.kind in ("gguf", "random_init"):
            return Path(self.path).stem
        return Path(self.path).resolve().name


@dataclass(frozen=True)
class SourceFlags:
    """The model-source flags one program takes (`add_to`, `read`) and how it loads its model.

    Attributes:
      sources: the source flags, one of which is required (`SOURCES`' names).
      data, allow_nonfinite, scan_layers, quant, adapter: whether it takes `--data`,
        `--allow-nonfinite`, `--scan-layers`, `--quant` and `--adapter`.
      init_seed: a `--seed` of the random init's own (default 0), refused without --random-init;
        without it, the program's own `--seed` (if any) seeds a random init too.
      as_saved, fit_vocab: as `ModelSource` says.
    """

    sources: tuple[str, ...] = SOURCES
    data: bool = True
    allow_nonfinite: bool = True
    scan_layers: bool = False
    quant: bool = False
    adapter: bool = False
    init_seed: bool = False
    as_saved: bool = False
    fit_vocab: bool = False

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        """Adds the flags: the sources as a required group of which exactly one is given, then the options."""
        group = parser.add_mutually_exclusive_group(required=True)
        for name in self.sources:
            metavar, help_ = SOURCE_HELP[name]
            group.add_argument(flag(name), metavar=metavar, help=help_)
        if self.data:
            parser.add_argument("--data", metavar="FILE_OR_DIR", help=DATA_HELP[self.fit_vocab])
        if self.init_seed:
            parser.add_argument("--seed", type=int, default=None, help="with --random-init: the parameters' seed (0)")
        if self.allow_nonfinite:
            parser.add_argument("--allow-nonfinite", action="store_true", help=f"with {self._pretrained()}: load "
                                "weights holding NaN or infinity (refused otherwise)")
        if self.scan_layers:
            parser.add_argument("--scan-layers", action=argparse.BooleanOptionalAction, default=None,
                                help="compile the repeated layers once under a scan (a faster start, a slower "
                                     "token on a CPU) or each layer on its own; default: as the model was saved")
        if self.quant:
            parser.add_argument("--quant", choices=QUANT_MODES, help="store the weights as int8 (groups of 32, as "
                                "llama.cpp's Q8_0; int8:channel: a scale per output channel) or int4 (groups of 32, "
                                "or :64) and multiply by them so (jaxattn.quantize; the lookup tables, norms and the "
                                "router stay float)")
            parser.add_argument("--dtype", choices=("float32",), help="with --gguf: the file's quantized weights "
                                "dequantized to float32 (they are kept quantized otherwise)")
        if self.adapter:
            parser.add_argument("--adapter", metavar="DIR", help="a PEFT LoRA adapter directory "
                                "(adapter_config.json, adapter_model.safetensors; python -m train.export of a LoRA "
                                "run writes one) merged into the model first")

    def read(self, parser: argparse.ArgumentParser, args: argparse.Namespace) -> ModelSource:
        """The `ModelSource` of parsed `args`, after the flags' usage errors (`parser.error`): a flag
        given without the source it goes with, `--quant` with the program's `--mesh`."""
        taken = self.taken(args)
        random = taken["random_init"] is not None
        if taken.get("data") is not None and not random:
            parser.error("--data goes with --random-init (a checkpoint carries its own tokenizer)")
        if taken.get("allow_nonfinite") and not any(taken.get(name) for name in PRETRAINED):
            parser.error(f"--allow-nonfinite goes with {self._pretrained()}")
        if self.init_seed and args.seed is not None and not random:
            parser.error("--seed goes with --random-init")
        if self.init_seed and args.seed is not None and not 0 <= args.seed < SEED_LIMIT:
            parser.error(f"--seed must be in [0, 2**32), got {args.seed}")
        if taken.get("dtype") is not None and taken["gguf"] is None:
            parser.error("--dtype goes with --gguf (other sources' weights are float as they load)")
        if taken.get("quant") is not None and getattr(args, "mesh", None) is not None:
            parser.error("--quant does not go with --mesh: quantized weights are laid out on one device")
        return self.source(args)

    def source(self, args: argparse.Namespace) -> ModelSource:
        """The `ModelSource` of parsed `args` as they stand (no usage errors: `read` says them). The seed
        is `--seed` (the program's own, or the random init's), 0 without one; `on_mesh` says whether the
        program's `--mesh` was given."""
        return ModelSource(**{name: value for name, value in self.taken(args).items() if value is not None},
                           seed=getattr(args, "seed", None) or 0, on_mesh=getattr(args, "mesh", None) is not None,
                           as_saved=self.as_saved, fit_vocab=self.fit_vocab)

    def taken(self, args: argparse.Namespace) -> dict:
        """The values in `args` of the flags this program takes from here (by `ModelSource` field): a flag
        of the same name that the program defines for itself (`train.export`'s refusing `--quant`) is
        not read."""
        names = [*SOURCES] + [name for name in OPTIONS if getattr(self, name)] + (["dtype"] if self.quant else [])
        return {name: getattr(args, name, None) for name in names}

    def _pretrained(self) -> str:
        """The sources made elsewhere that this program takes, as words: "--hf or --gguf"."""
        return " or ".join(flag(name) for name in self.sources if name in PRETRAINED)

