"""Which weights get LoRA adapters and how they scale (`LoraConfig`); the targets' names (`TARGETS`).

The table of what each target names is `jaxattn.lora`'s (the package docstring). It imports nothing of the model,
so the LoRA layers, the PEFT files and a training run's [lora] table can all read it.
"""

from __future__ import annotations

import dataclasses
import math

TARGETS = ("q", "k", "v", "o", "gate", "up", "down", "experts")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Which weights get adapters and how they scale.

    Attributes:
      rank: r > 0, the adapters' inner width.
      alpha: the scale's numerator (PEFT's `lora_alpha`).
      dropout: in [0, 1), the rate of the dropout on the adapters' input (see the module docstring
        for when it runs).
      rslora: scale by `alpha / sqrt(rank)` (rank-stabilised LoRA) instead of `alpha / rank`.
      targets: logical names from `TARGETS`, at least one.
    """

    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    rslora: bool = False
    targets: tuple[str, ...] = ("q", "k", "v", "o")

    def __post_init__(self):
        if isinstance(self.rank, bool) or not isinstance(self.rank, int) or self.rank <= 0:
            raise ValueError(f"LoraConfig.rank must be a positive integer, got {self.rank!r}")
        if isinstance(self.alpha, bool) or not isinstance(self.alpha, (int, float)) or not math.isfinite(self.alpha):
            raise ValueError(f"LoraConfig.alpha must be a finite number, got {self.alpha!r}")
        if isinstance(self.dropout, bool) or not isinstance(self.dropout, (int, float)) or not 0 <= self.dropout < 1:
            raise ValueError(f"LoraConfig.dropout must be in [0, 1), got {self.dropout!r}")
        if not isinstance(self.rslora, bool):
            raise ValueError(f"LoraConfig.rslora must be a bool, got {self.rslora!r}")
        targets = (self.targets,) if isinstance(self.targets, str) else self.targets
        try:
            targets = tuple(targets)
        except TypeError:
            raise ValueError(f"LoraConfig.targets must be names from {TARGETS}, got {self.targets!r}") from None
        unknown = [t for t in targets if t not in TARGETS]
        if unknown or not targets:
            raise ValueError(f"LoraConfig.targets must be one or more of {TARGETS}, got {self.targets!r}")
        object.__setattr__(self, "targets", tuple(dict.fromkeys(targets)))  # a list is accepted; order kept, once each
        object.__setattr__(self, "alpha", float(self.alpha))
        object.__setattr__(self, "dropout", float(self.dropout))

    @property
    def scale(self) -> float:
        """`alpha / rank`, or `alpha / sqrt(rank)` with rsLoRA."""
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)
