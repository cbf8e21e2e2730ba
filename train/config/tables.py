"""The tables of an experiment besides the model's: `[train]` (`TrainConfig`: how to train),
`[runtime]` (`RuntimeConfig`: how this machine runs it) and `[lora]` (`LoraTable`: adapters on a
checkpoint). Each checks its own fields; what spans tables is `train.config.experiment`'s."""

from typing import Annotated, Any, Literal, Self

from pydantic import (
    Field,
    NonNegativeFloat,
    NonNegativeInt,
    PlainSerializer,
    PlainValidator,
    PositiveFloat,
    PositiveInt,
    ValidationInfo,
    field_validator,
    model_validator,
)
from pydantic_core import PydanticCustomError

from jaxattn import kernels, lora
from jaxattn.axes import MeshShape
from train.config.base import OpenFraction, Table, is_saved


class TrainConfig(Table):
    """How to train. Defaults are nanoGPT's CPU "baby" Shakespeare run.

    Attributes:
      batch_size, block_size: B sequences of T tokens per step.
      max_iters: optimizer steps.
      lr, min_lr: peak and final learning rate.
      warmup_iters: linear warmup from 0 to lr.
      lr_decay_iters: the schedule reaches min_lr here (then stays).
      schedule: "cosine" (nanoGPT's) or "wsd": warmup-stable-decay, flat at lr, then linear
        to min_lr over the last `decay_fraction` of lr_decay_iters (docs/theory.md §22).
      optimizer: "adamw", or "muon": Muon for the hidden matrices at `muon_lr` (same schedule),
        AdamW at lr for embeddings, head, norms and biases (train.run.optim).
      muon_momentum, muon_momentum_start, muon_momentum_warmup: Muon's Nesterov momentum,
        linear from start to muon_momentum over the first muon_momentum_warmup steps.
      beta1, beta2, weight_decay: AdamW (weight_decay also Muon's, decoupled).
      adam_states: AdamW's two moments in "float32", or "int8": one byte per value in blocks of 256
        with a float32 scale each, on a dynamic code (bitsandbytes' 8-bit Adam; train.run.adam8bit), a
        quarter of the memory, for parameters of at least 4096 values.
      decay_embeddings: apply weight decay to embedding tables too (nanoGPT does).
      grad_clip: clip_by_global_norm threshold (0 = off).
      eval_interval, eval_iters: evaluate every N steps on eval_iters fixed batches per split.
      eval_whole_val: the val loss over every token of the validation split instead (windows
        of block_size), the train loss still on eval_iters batches.
      target_loss: report the training seconds and step of the first evaluation whose val
        loss is at or below this (`--target-loss`); a loss, so not negative.
      log_interval: steps between progress-bar/metrics updates.
      steps_per_dispatch: optimizer steps fused into one jitted call with lax.scan.
      seed: the one seed of params, batches and dropout.
      out_dir: where checkpoints, metrics.jsonl, config.json and loss.png go (not empty: that
        would be the current directory).
      checkpoint: save latest and best-by-val-loss checkpoints at each eval.
      data_path: the corpus: a text file or a directory made by `python -m train.prepare`
        (None: Tiny Shakespeare, see train.data.corpus).
      tokenizer: "char" or "byte" (built from a text file when the run starts), "bpe" or "hf"
        (a prepared directory's, which must be of this kind).
      val_fraction: the last fraction of a text file held out (a prepared directory keeps its split).
      sample_tokens, sample_temperature, sample_prompt: the sample printed at the end.
      plot: write the loss curve PNG at the end.
      init_from: start from a trained checkpoint instead of random weights: "hf:DIR" (a transformers
        directory with its tokenizer.json) or "gguf:FILE" (`train.init_from`). Its model config replaces
        `[model]` and its tokenizer the corpus's (`train.tokenizer` is not used). A `data_path` ending in
        .jsonl is then chat data, rendered with its chat template and packed (`train.data.corpus.open_chat_corpus`).
      train_on: which predictions of chat data count toward the loss: "assistant" (the assistant's turns,
        `train.data.chats.render_conversation`) or "all".
      long_chats: a conversation longer than `block_size + 1` tokens: "split" into pieces of that many (a
        warning says how many and what share of the counted predictions lose the conversation's beginning),
        "drop" (left out, with a warning) or "error" (the run does not start).
    """

    _where = "TrainConfig"

    batch_size: PositiveInt = 12
    block_size: PositiveInt = 64
    max_iters: PositiveInt = 2000
    lr: PositiveFloat = 1e-3
    min_lr: NonNegativeFloat = 1e-4
    warmup_iters: NonNegativeInt = 100
    lr_decay_iters: PositiveInt = 2000
    schedule: Literal["cosine", "wsd"] = "cosine"
    decay_fraction: Annotated[float, Field(ge=0, le=1)] = 0.2
    optimizer: Literal["adamw", "muon"] = "adamw"
    muon_lr: PositiveFloat = 0.02
    muon_momentum: OpenFraction = 0.95
    muon_momentum_start: OpenFraction = 0.85
    muon_momentum_warmup: NonNegativeInt = 300
    beta1: OpenFraction = 0.9
    beta2: OpenFraction = 0.99
    weight_decay: NonNegativeFloat = 0.1
    adam_states: Literal["float32", "int8"] = "float32"
    decay_embeddings: bool = True
    grad_clip: NonNegativeFloat = 1.0
    eval_interval: PositiveInt = 250
    eval_iters: PositiveInt = 20
    eval_whole_val: bool = False
    target_loss: float | None = None  # >= 0: `_a_loss`
    log_interval: PositiveInt = 10
    steps_per_dispatch: PositiveInt = 1
    seed: Annotated[int, Field(ge=0, lt=2 ** 63)] = 1337
    out_dir: str = "runs/shakespeare_char_baby"
    checkpoint: bool = True
    data_path: str | None = None
    tokenizer: Literal["char", "byte", "bpe", "hf"] = "char"
    val_fraction: OpenFraction = 0.1
    sample_tokens: NonNegativeInt = 300
    sample_temperature: NonNegativeFloat = 0.8
    sample_prompt: str = "\n"
    plot: bool = True
    init_from: str | None = None
    train_on: Literal["assistant", "all"] = "assistant"
    long_chats: Literal["split", "drop", "error"] = "split"

    @model_validator(mode="after")
    def _min_lr_at_most_lr(self) -> Self:
        if self.min_lr > self.lr:
            raise ValueError(f"min_lr={self.min_lr} exceeds lr={self.lr}")
        return self

    @field_validator("out_dir", "data_path")
    @classmethod
    def _a_path(cls, value: str | None, info: ValidationInfo) -> str | None:
        """An empty path is the current directory: `out_dir=""` would write the run among the user's
        files, `data_path=""` read the current directory as a corpus."""
        if value is not None and not value.strip() and not is_saved(info):
            raise PydanticCustomError("empty_path", "Input should be a non-empty path")
        return value

    @field_validator("init_from")
    @classmethod
    def _a_checkpoint(cls, value: str | None, info: ValidationInfo) -> str | None:
        kind, sep, path = (value or "").partition(":")
        if value is not None and not is_saved(info) and (not sep or kind not in ("hf", "gguf") or not path.strip()):
            raise PydanticCustomError("checkpoint", "Input should be hf:DIR (a transformers directory) or gguf:FILE")
        return value

    @field_validator("target_loss")
    @classmethod
    def _a_loss(cls, value: float | None, info: ValidationInfo) -> float | None:
        if value is not None and value < 0 and not is_saved(info):
            raise PydanticCustomError("greater_than_equal", "Input should be greater than or equal to 0 (a loss)")
        return value

    @model_validator(mode="after")
    def _runnable(self, info: ValidationInfo) -> Self:
        """Settings a run would train with, but not as asked: refused when a config is made.

        * Muon's momentum rises from `muon_momentum_start` to `muon_momentum` over
          `muon_momentum_warmup` steps (`train.run.optim.momentum_schedule`); a start above the end
          would make the warm-up lower it.
        * WSD (`train.run.optim.lr_schedule`) warms up linearly to `lr` over `warmup_iters` steps, holds
          it, then decays to `min_lr`. With `warmup_iters >= max_iters` the run ends inside the
          warmup, its rate still rising below `lr`: neither the stable part nor the decay, which
          is what a WSD run's final loss comes from, ever happens. That is refused rather than
          warned about: nothing can come of such a run but a loss taken at a high rate, and a
          shorter warmup (or the cosine schedule) is one setting away. The cosine schedule is
          nanoGPT's and keeps nanoGPT's behaviour: a short trial of a config with a long warmup
          (`--set train.max_iters=50` on the baby's 100 warmup steps) still runs.
        """
        if is_saved(info):
            return self
        if self.muon_momentum_warmup and self.muon_momentum_start > self.muon_momentum:
            raise ValueError(f"muon_momentum_start={self.muon_momentum_start} is above muon_momentum="
                             f"{self.muon_momentum}: the warm-up over muon_momentum_warmup={self.muon_momentum_warmup} "
                             "steps would lower the momentum; set muon_momentum_start <= muon_momentum")
        if self.schedule == "wsd" and self.warmup_iters >= self.max_iters:
            raise ValueError(f"schedule 'wsd' with warmup_iters={self.warmup_iters} >= max_iters={self.max_iters}: "
                             "the run would end inside the warmup, the rate still rising, never held at lr or "
                             "decayed to min_lr; set warmup_iters below max_iters")
        return self


def _kernel_choice(field: str):
    """The names `runtime.FIELD` takes: `jaxattn.kernels`' implementations of FIELD, or "auto"."""
    return Literal[kernels.choices(field) + (kernels.AUTO,)]


def _mesh_or_auto(value: Any) -> MeshShape | Literal["auto"]:
    """"auto", or a mesh: its text ("data:2,fsdp:2") is parsed here, once."""
    if value == "auto" or isinstance(value, MeshShape):
        return value
    if not isinstance(value, str):
        raise PydanticCustomError("mesh_type", "Input should be \"auto\" or a mesh like \"data:2,fsdp:2\"")
    return MeshShape.parse(value)  # ValueError naming what is wrong


class RuntimeConfig(Table):
    """How this machine runs an experiment; never the model's maths (docs/theory.md §15).

    Attributes:
      attention, decode, matmul, mla, moe, paged: `jaxattn.Kernels` implementation names, or "auto":
        chosen for the platform when the run starts (`train.run.runtime`), printed with the
        reason and saved resolved.
      mesh: "auto" or the device mesh, a `MeshShape`, written "data:D,fsdp:F,tensor:T" (axes
        left out are 1; see `jaxattn.sharding`); its product must equal the device count.
        "auto": the batch split over one host device per CPU core that divides it (on a CPU),
        or over the devices that divide it (on a GPU or TPU).
      cpu_devices: host devices to make on a CPU (JAX's `jax_num_cpu_devices`, set before
        JAX starts); "auto": the mesh's size, or one per core for an "auto" mesh.
      xla_flags: extra XLA_FLAGS, applied before JAX starts.
    """

    _where = "RuntimeConfig"

    attention: _kernel_choice("attention") = "auto"
    decode: _kernel_choice("decode") = "auto"
    matmul: _kernel_choice("matmul") = "auto"
    mla: _kernel_choice("mla") = "auto"
    moe: _kernel_choice("moe") = "auto"
    paged: _kernel_choice("paged") = "auto"
    quantized: _kernel_choice("quantized") = "auto"
    mesh: Annotated[MeshShape | Literal["auto"], PlainValidator(_mesh_or_auto), PlainSerializer(str)] = "auto"
    cpu_devices: PositiveInt | Literal["auto"] = "auto"
    xla_flags: str = ""

    def requested_kernels(self) -> kernels.Kernels:
        """The kernels asked for (fields may be "auto")."""
        return kernels.Kernels(**{field: getattr(self, field) for field in kernels.IMPLEMENTATIONS})


assert set(kernels.IMPLEMENTATIONS) <= set(RuntimeConfig.model_fields), "a kernel field is missing from [runtime]"


LORA_TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts")


class LoraTable(Table):
    """LoRA fine-tuning (`jaxattn.lora`): a table `[lora]` trains low-rank adapters on a frozen base.

    Attributes:
      rank: r of each adapter (`A [in, r]`, `B [r, out]`).
      alpha: the adapters' output is scaled by alpha / r (alpha / sqrt(r) with `rslora`).
      dropout: dropout on an adapter's input while training (PEFT's `lora_dropout`).
      rslora: rank-stabilised scaling, alpha / sqrt(r).
      targets: the projections that get adapters, by logical name: q, k, v, o (attention), gate, up,
        down (the MLP), experts (a mixture's routed experts).
      base_dtype: the frozen base's storage, "float32" or "bfloat16" (half its memory; the adapters and
        their optimizer stay float32).
    The base is the run's `train.init_from`; only the adapters are trained, kept in the optimizer and
    saved in checkpoints (with the base's source and sha256, checked when the run resumes).
    """

    _where = "LoraTable"

    rank: PositiveInt = 8
    alpha: PositiveFloat = 16.0
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    rslora: bool = False
    targets: tuple[Literal[LORA_TARGETS], ...] = ("q", "k", "v", "o", "gate", "up", "down")
    base_dtype: Literal["float32", "bfloat16"] = "float32"

    def settings(self) -> lora.LoraConfig:
        """The adapters' settings as `jaxattn.lora` takes them."""
        return lora.LoraConfig(rank=self.rank, alpha=self.alpha, dropout=self.dropout, rslora=self.rslora,
                               targets=self.targets)

    @field_validator("targets")
    @classmethod
    def _some_targets(cls, value: tuple[str, ...]) -> tuple[str, ...]:
        if not value:
            raise PydanticCustomError("no_targets", f"Input should name at least one of {LORA_TARGETS}")
        if len(set(value)) != len(value):
            raise PydanticCustomError("repeated_targets", "Input should name each target once")
        return value

