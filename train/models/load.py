"""`load_model(source)`: the one loader of a model for the programs, from wherever it comes.

    from train.models.load import load_model
    from train.models.source import ModelSource
    loaded = load_model(ModelSource(hf="exports/baby"))
    loaded.params, loaded.config, loaded.tokenizer

The sources (`train.models.source.ModelSource`, from the flags every program shares): a training
run's best (else latest) checkpoint, a LoRA run's adapters merged into its base
(`train.models.runs`); a transformers directory or a llama.cpp GGUF file (`train.models.pretrained`);
a config with fresh parameters (`train.models.fresh`). Then, in this order: a PEFT adapter merged in
(`--adapter`), q, k and v fused into one projection (`jaxattn.with_fused_qkv`: the same numbers, a
faster token; not with `--allow-nonfinite`, so that a damaged weight is named as the checkpoint names
it), the layers stacked or unrolled (`--scan-layers`: a checkpoint of either layout loads as either),
the weights quantized (`--quant`, `jaxattn.quantize`). A GGUF file's quantized weights stay quantized
(`jaxattn.gguf.kept`: Q8_0, Q4_0 and Q4_1 as the file's own numbers, the other block formats in the
nearest native format) unless `--quant`, `--dtype float32` or a mesh is asked for, with a note naming
what was kept; a tied head kept as the file's own numbers is then the embedding table too (no float copy). `ModelSource.as_saved` (export, attention maps) keeps the weights as the source saved them.

Failures: CheckpointError (a source or adapter that cannot be read), DataError (`--data`),
UsageError (an unknown config, a `--quant` mode the model's widths do not fit), each one line.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass
from typing import Any

import flax.linen as nn
import jax

from jaxattn import Kernels, axes, gguf, lora, with_fused_qkv
from jaxattn.config import ModelConfig
from jaxattn.hf import peft as hf_peft
from jaxattn.hf.errors import HFCheckpointError
from jaxattn.kernels import native_paged, quant_matmul
from jaxattn.quantization import drop_tied_table, quantize
from jaxattn.scan_plan import relayout
from train.checkpoints.meta import CheckpointError
from train.cli import UsageError, describe
from train.models import fresh, pretrained, runs
from train.models.source import ModelSource
from train.run.host_memory import release_freed_memory

KEPT_GGUF_NOTE = "{path} stores its weights as {kept}; --dtype float32 to dequantize them"


@dataclass(frozen=True)
class LoadedModel:
    """A model as `load_model` gives it, with what the programs need next.

    Attributes:
      params: the parameters, for `jaxattn.DecoderLM(config)`.
      config: the model config (q, k and v fused, the layers laid out, as loaded).
      tokenizer: `encode(text) -> ids`, `decode(ids) -> str`; a transformers or GGUF one also has
        `eos_token_id` (int or None).
      source: where it came from.
      quant: the `jaxattn.quantize` mode of its weights (`--quant`, or a GGUF file's kept); None for float weights.
      head_quant: the head's mode where it differs from `quant` (a GGUF file's head stored otherwise).
      notes: what the program says on stderr after "note: ", one line each.
    """

    params: Any
    config: ModelConfig
    tokenizer: Any
    source: ModelSource
    quant: str | None = None
    notes: tuple[str, ...] = ()
    head_quant: str | None = None

    @property
    def name(self) -> str:
        """The model's name: a directory's, a config's or a GGUF file's (`ModelSource.name`)."""
        return self.source.name

    def read_chat(self, *, template: bool = True) -> tuple[str | None, dict[str, str]]:
        """(its chat template's source or None, its named special tokens): `read_chat` of its source."""
        return read_chat(self.source, template=template)

    def print_notes(self, file=None) -> None:
        """The notes on `file` (default stderr), each as a `note: ...` line."""
        for note in self.notes:
            print(f"note: {note}", file=file or sys.stderr)


def load_model(source: ModelSource) -> LoadedModel:
    """The model `source` names, loaded and made ready as the module docstring says.

    CheckpointError, DataError or UsageError (one line each) when it cannot be."""
    params, config, tokenizer = _read(source)
    quant, head, kept = _quantization(source)
    notes = () if kept is None else (KEPT_GGUF_NOTE.format(path=source.gguf, kept=kept.describe()),)
    if source.adapter is not None:
        params = with_adapter(source.adapter, config, params)
    if not (source.allow_nonfinite or source.as_saved):  # a damaged model keeps its layout: errors name its weights
        params, config = with_fused_qkv(nn.unbox(params), config)  # one matmul for q, k and v: a faster token
    if source.scan_layers is not None:
        params, config = relayout(nn.unbox(params), config, source.scan_layers)
    if quant is not None:
        try:
            params = quantize(params, config, quant, head=head)
        except ValueError as err:
            raise UsageError(f"--quant {quant}: {err}") from None
        if kept is not None and kept.exact:  # a tied head holding the file's own table: no float copy of it beside
            params = drop_tied_table(params)
        release_freed_memory()  # the float32 weights quantized from: not resident beside the quantized ones
    return LoadedModel(params=params, config=config, tokenizer=tokenizer, source=source, quant=quant,
                       notes=notes, head_quant=None if head == quant else head)


def _read(source: ModelSource) -> tuple[Any, ModelConfig, Any]:
    """(params, model config, tokenizer) as the source holds them."""
    if source.kind == "random_init" and source.fit_vocab:
        config, tokenizer = fresh.as_trained(source.random_init, source.data)
        return fresh.fresh_params(config, source.seed), config, tokenizer
    if source.kind == "random_init":
        return fresh.random_init(source.random_init, source.seed, source.data)
    if source.kind == "checkpoint":
        return runs.load_for_sampling(source.checkpoint)
    return pretrained.read(source.kind, source.path, allow_nonfinite=source.allow_nonfinite)


def _quantization(source: ModelSource) -> tuple[str | None, str | None, gguf.KeptQuantization | None]:
    """(the quantize mode of the layers, the head's, what a GGUF file keeps or None): `--quant` for both, else a
    GGUF file's quantized weights kept so when the model runs on one device (the float32 they were
    dequantized to takes 4 to 7 times the memory)."""
    if (source.quant is not None or source.kind != "gguf" or source.on_mesh or source.as_saved
            or source.dtype == "float32"):
        return source.quant, source.quant, None
    kept = pretrained.gguf_kept_quantization(source.gguf)
    if kept is None or kept.layers is None:  # float layers: nothing is kept (a quantized head alone is not)
        return None, None, None
    return kept.layers, kept.head, kept


def with_adapter(directory: str, config: ModelConfig, params) -> dict:
    """`params` with the PEFT LoRA adapter in `directory` merged in (`jaxattn.hf.peft.load_adapter`, then
    `jaxattn.lora.merge_lora`: the model then runs as fast as the base); CheckpointError (one line naming the
    file and the key or module) when the adapter cannot be read or does not fit the model."""
    try:
        adapted, _ = hf_peft.load_adapter(directory, config, nn.unbox(params))
    except (HFCheckpointError, ValueError, OSError) as err:
        raise CheckpointError(f"--adapter {directory}: {describe(err)}") from err
    return lora.merge_lora(adapted)


def read_adapter(directory: str, config: ModelConfig, params) -> dict:
    """`params` with the PEFT LoRA adapter in `directory` on them, unmerged (`jaxattn.hf.peft.load_adapter`),
    for a server's slots (`jaxattn.serving.Engine.add_lora`); CheckpointError (one line naming the file and
    the key or module, for the caller to prefix) when the adapter cannot be read or does not fit the model."""
    try:
        adapted, _ = hf_peft.load_adapter(directory, config, nn.unbox(params))
    except (HFCheckpointError, ValueError, OSError) as err:
        raise CheckpointError(describe(err)) from err
    return adapted


def read_chat(source: ModelSource, *, template: bool = True) -> tuple[str | None, dict[str, str]]:
    """(the chat template's source or None, the named special tokens) of a transformers directory or a
    GGUF file (`train.models.pretrained.read_chat`; `template` False reads the tokens alone); (None, {})
    for a run or a config, which have none. Read when asked, not by `load_model`: a program that does
    not chat is not refused for a template it would not use."""
    if source.kind not in pretrained.KINDS:
        return None, {}
    return pretrained.read_chat(source.kind, source.path, template=template)


def paged_part(kernels: Kernels, reasons: dict[str, str]) -> str:
    """The serving program's `kernels:` line's part for the paged attention, naming the native loop's
    instruction-set path (`native_paged.native_path()`, e.g. "avx2") when it runs one."""
    path = f", {native_paged.native_path()} path" if kernels.paged == "ragged_cpu" else ""
    return f"paged {kernels.paged!r}{path} ({reasons['paged']})"


def quant_line(quant: str | None, kernels: Kernels, reasons: dict[str, str], head: str | None = None) -> str:
    """The programs' `kernels:` line's part for quantized weights ("" for float ones), naming the native
    loop's instruction-set path (`quant_matmul.native_path()`, e.g. "avx2") when it runs one."""
    if quant is None:
        return ""
    path = f", {quant_matmul.native_path()} path" if kernels.quantized.startswith("native") else ""
    head = "" if head is None else f" (head {head})"
    return f"; weights {quant}{head}, quantized {kernels.quantized!r}{path} ({reasons['quantized']})"


def device_mesh(spec: str | None, config: ModelConfig):
    """The device mesh of a program's `--mesh` (None without one); UsageError when it does not fit the
    devices or the model."""
    if spec is None:
        return None
    try:
        shape = axes.MeshShape.parse(spec)
        axes.check_mesh(config, shape)
        return axes.make_mesh(shape, jax.devices()[:shape.size] if shape.size <= jax.device_count() else None)
    except ValueError as err:
        raise UsageError(str(err)) from err
